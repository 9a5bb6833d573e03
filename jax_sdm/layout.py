"""Argument checking (at trace time) and the public <-> kernel layout transforms.

Public layout: `[B, T, H, ...]` (README "API"). Kernel layout: time-major units, `[NC, P, C, ...]` with `P = B*H`
streams and `NC = ceil(T / C)` chunks (docs/DESIGN.md).
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_CHUNK = 256
MAX_LANES = 256
BANK_DTYPES = (jnp.float32, jnp.bfloat16)


class Dims(NamedTuple):
    B: int
    T: int
    H: int
    K: int
    D: int
    W: int
    R: int
    C: int
    per_write_gates: bool
    shared_bank: bool

    @property
    def P(self):
        return self.B * self.H

    @property
    def NC(self):
        return -(-self.T // self.C)


def _shape_error(name, a, want):
    return ValueError(f"sdm_write_read: `{name}` has shape {tuple(a.shape)}, expected {want}")


def _dtype_error(name, a, want):
    return TypeError(f"sdm_write_read: `{name}` has dtype {jnp.dtype(a.dtype).name}, expected {want}")


def validate(bank, k_idx, k_val, v, beta, g, q_idx, q_val, chunk_size, allow_float64=False):
    """Check every argument's rank, shape and dtype; return the problem's `Dims`."""
    if not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, bool):
        raise TypeError(f"sdm_write_read: `chunk_size` must be a Python int, got {type(chunk_size).__name__}")
    if not 1 <= chunk_size <= MAX_CHUNK:
        raise ValueError(f"sdm_write_read: `chunk_size` must be in 1..{MAX_CHUNK}, got {chunk_size}")

    bank_dtypes = BANK_DTYPES + ((jnp.float64,) if allow_float64 else ())
    if jnp.dtype(bank.dtype) not in [jnp.dtype(d) for d in bank_dtypes]:
        names = " or ".join(jnp.dtype(d).name for d in bank_dtypes)
        raise _dtype_error("bank", bank, names)
    if k_idx.ndim != 4:
        raise _shape_error("k_idx", k_idx, "[B, T, H, W] (rank 4)")
    B, T, H, W = k_idx.shape
    if bank.ndim == 4:
        if bank.shape[:2] != (B, H):
            raise _shape_error("bank", bank, f"[B, H, K, D] = [{B}, {H}, K, D] or a shared [H, K, D] bank")
    elif bank.ndim == 3:
        if bank.shape[0] != H:
            raise _shape_error("bank", bank, f"[H, K, D] = [{H}, K, D] or [B, H, K, D]")
    else:
        raise _shape_error("bank", bank, "[B, H, K, D] or [H, K, D] (rank 4 or 3)")
    K, D = bank.shape[-2:]
    if K < 1 or D < 1:
        raise _shape_error("bank", bank, "at least one slot (K >= 1) of width D >= 1")
    if T < 1:
        raise _shape_error("k_idx", k_idx, "at least one token (T >= 1)")
    if q_idx.ndim != 4 or q_idx.shape[:3] != (B, T, H):
        raise _shape_error("q_idx", q_idx, f"[B, T, H, R] = [{B}, {T}, {H}, R]")
    R = q_idx.shape[3]
    for name, n in (("k_idx", W), ("q_idx", R)):
        if not 1 <= n <= MAX_LANES:
            lanes = "W" if name == "k_idx" else "R"
            raise ValueError(f"sdm_write_read: `{name}` has {lanes} = {n} lanes, expected 1..{MAX_LANES}")
    for name, a in (("k_idx", k_idx), ("q_idx", q_idx)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise _dtype_error(name, a, "an integer type (int32 preferred)")
    for name, a, want in (("k_val", k_val, (B, T, H, W)), ("q_val", q_val, (B, T, H, R)), ("v", v, (B, T, H, D))):
        if tuple(a.shape) != want:
            raise _shape_error(name, a, list(want))
        if a.dtype != bank.dtype:
            raise _dtype_error(name, a, f"the bank's dtype {jnp.dtype(bank.dtype).name}")
    gate_dtypes = [jnp.dtype(jnp.float32)] + ([jnp.dtype(jnp.float64)] if bank.dtype == jnp.float64 else [])
    if tuple(beta.shape) != (B, T, H):
        raise _shape_error("beta", beta, [B, T, H])
    if tuple(g.shape) == (B, T, H):
        per_write = False
    elif tuple(g.shape) == (B, T, H, W):
        per_write = True
    else:
        raise _shape_error("g", g, f"[B, T, H] = [{B}, {T}, {H}] (per token) or [B, T, H, W] = [{B}, {T}, {H}, {W}] (per write)")
    for name, a in (("beta", beta), ("g", g)):
        if jnp.dtype(a.dtype) not in gate_dtypes:
            raise _dtype_error(name, a, " or ".join(d.name for d in gate_dtypes))
    return Dims(B, T, H, K, D, W, R, int(chunk_size), per_write, bank.ndim == 3)


def to_stream_units(a, dims, fill=0):
    """`[B, T, H, ...]` -> `[NC, B, H, C, ...]`, padding the last chunk with `fill`."""
    B, T, C, NC = dims.B, dims.T, dims.C, dims.NC
    if NC * C > T:
        a = jnp.pad(a, [(0, 0), (0, NC * C - T)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
    a = a.reshape((B, NC, C) + a.shape[2:])  # [B, NC, C, H, ...]
    return jnp.moveaxis(a, (1, 3), (0, 2))  # [NC, B, H, C, ...]


def from_stream_units(a, dims):
    """`[NC, B, H, C, ...]` -> `[B, T, H, ...]` (inverse of `to_stream_units`, dropping the padding)."""
    a = jnp.moveaxis(a, (0, 2), (1, 3))  # [B, NC, C, H, ...]
    return a.reshape((dims.B, dims.NC * dims.C) + a.shape[3:])[:, :dims.T]


def to_units(a, dims, fill=0):
    """`[B, T, H, ...]` -> `[NC, P, C, ...]` (streams `P = B*H`), padding the last chunk with `fill`."""
    a = to_stream_units(a, dims, fill)
    return a.reshape((dims.NC, dims.P) + a.shape[3:])


def from_units(a, dims):
    """`[NC, P, C, ...]` -> `[B, T, H, ...]` (inverse of `to_units`, dropping the padding)."""
    return from_stream_units(a.reshape((dims.NC, dims.B, dims.H) + a.shape[2:]), dims)


def stream_arguments(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims):
    """The kernels' arguments with explicit streams: bank `[B, H, K, D]` (a shared bank broadcast over the batch)
    and per-token arrays `[NC, B, H, C, ...]` (int32 ids padded with -1, float32 values, gates per lane)."""
    f32 = jnp.float32
    units = lambda a, fill=0: to_stream_units(a, dims, fill)
    return (batch_banks(bank, dims), units(k_idx.astype(jnp.int32), -1), units(k_val.astype(f32)),
            units(lane_gates(g, dims).astype(f32)), units(v.astype(f32)), units(beta.astype(f32)),
            units(q_idx.astype(jnp.int32), -1), units(q_val.astype(f32)))


def batch_banks(bank, dims, broadcast=None):
    """The bank per batch element, `[B, H, K, D]` (a shared `[H, K, D]` bank is broadcast over the batch).

    `broadcast`: `ordered_broadcast` (the default) or `differentiable_ordered_broadcast`."""
    if dims.shared_bank:
        return (broadcast or ordered_broadcast)(bank, dims.B, 0)
    return bank


def lane_gates(g, dims, broadcast=None):
    """Gates per write lane, `[B, T, H, W]` (a per-token gate is broadcast over the lanes; `broadcast` as for
    `batch_banks`)."""
    if dims.per_write_gates:
        return g
    return (broadcast or ordered_broadcast)(g, dims.W, g.ndim)


def _broadcast(a, copies, axis):
    return jnp.broadcast_to(jnp.expand_dims(a, axis), a.shape[:axis] + (copies,) + a.shape[axis:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def ordered_broadcast(a, copies, axis):
    """`a` repeated `copies` times along a new axis at `axis`; its gradient sums the copies in index order.

    The transpose JAX would use is an XLA reduction, whose summation order the GPU compiler may choose differently
    from one compilation to the next (seen as last-bit differences of the gate gradient between processes); a
    chain of elementwise adds has one order (docs/MATH.md, "Determinism"). The sum is kept in at least float32.
    Reverse mode only (the kernel path); `differentiable_ordered_broadcast` serves every transformation.
    """
    return _broadcast(a, copies, axis)


def _ordered_broadcast_fwd(a, copies, axis):
    return ordered_broadcast(a, copies, axis), None


def _ordered_broadcast_bwd(copies, axis, _, ct):
    acc = jnp.promote_types(ct.dtype, jnp.float32)
    total = jnp.take(ct, 0, axis).astype(acc)
    for n in range(1, copies):
        total = total + jnp.take(ct, n, axis).astype(acc)
    return (total.astype(ct.dtype),)


ordered_broadcast.defvjp(_ordered_broadcast_fwd, _ordered_broadcast_bwd)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def differentiable_ordered_broadcast(a, copies, axis):
    """`ordered_broadcast` for the pure-JAX paths: also forward mode and higher orders (a JVP rule, not a VJP).

    The tangent is `copies` stacked copies rather than a broadcast, so its transpose (the gradient) is a chain of
    adds, one per copy, in at least float32, like `ordered_broadcast`'s: in an order fixed by JAX's transpose (index
    order with current jax), never an XLA reduction. (Under a sharded `jit` XLA may move the copies between devices
    with collective-permutes, which `ordered_broadcast` avoids.)
    """
    return _broadcast(a, copies, axis)


@differentiable_ordered_broadcast.defjvp
def _differentiable_ordered_broadcast_jvp(copies, axis, primals, tangents):
    (a,), (t,) = primals, tangents
    wide = t.astype(jnp.promote_types(t.dtype, jnp.float32))
    return (differentiable_ordered_broadcast(a, copies, axis),
            jnp.stack([wide] * copies, axis).astype(t.dtype))
