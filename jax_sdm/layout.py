"""Argument checking (at trace time) and the public <-> kernel layout transforms.

Public layout: `[B, T, H, ...]` (README "API"). Kernel layout: time-major units, `[NC, P, C, ...]` with `P = B*H`
streams and `NC = ceil(T / C)` chunks (docs/DESIGN.md).
"""
import collections
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


class Phase1(NamedTuple):
    """Phase 1's outputs for units `[N, ...]` (docs/DESIGN.md "Phase 1"), in the order of the handler's results and
    of `xla.phase1_xla`'s."""
    log_k: jax.Array    # [N, C, W]
    rex: jax.Array      # [N, C, W]
    cpe: jax.Array      # [N, C, W]
    k_eff: jax.Array    # [N, C, W]
    w: jax.Array        # [N, C, W]
    log_q: jax.Array    # [N, C, R]
    q_w: jax.Array      # [N, C, R]
    A: jax.Array        # [N, C, C]
    QK: jax.Array       # [N, C, C]
    w_order: jax.Array  # [N, C*W]
    w_group: jax.Array  # [N, C*W + 1]
    r_order: jax.Array  # [N, C*R]
    r_group: jax.Array  # [N, C*R + 1]
    repeats: jax.Array  # [N]


def _shape_error(op, name, a, want):
    return ValueError(f"{op}: `{name}` has shape {tuple(a.shape)}, expected {want}")


def _dtype_error(op, name, a, want):
    return TypeError(f"{op}: `{name}` has dtype {jnp.dtype(a.dtype).name}, expected {want}")


def _common_lead(per_token, rank):
    """The leading shape (`[B, T, H]`, or `[B, H]` for one token) that most per-token arguments share (the first
    one's among equals), so that an error names the argument that disagrees rather than whichever is compared
    first. `per_token`: name -> array, in argument order; `beta` has no trailing axis, `g` may have none."""
    leads = [tuple(a.shape[:rank]) for name, a in per_token.items()
             if a.ndim == rank + (name != "beta") or (name == "g" and a.ndim == rank)]
    return collections.Counter(leads).most_common(1)[0][0]


def validate(bank, k_idx, k_val, v, beta, g, q_idx, q_val, chunk_size, allow_float64=False, op="sdm_write_read",
             step=False):
    """Check every argument's rank, shape and dtype; return the problem's `Dims`.

    With `step=True` (one token: `sdm_step`) the per-token arrays have no time axis (`[B, H, ...]`); the `Dims`
    then have `T = C = 1`. `op` names the function in the error messages.
    """
    if not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, bool):
        raise TypeError(f"{op}: `chunk_size` must be a Python int, got {type(chunk_size).__name__}")
    if not 1 <= chunk_size <= MAX_CHUNK:
        raise ValueError(f"{op}: `chunk_size` must be in 1..{MAX_CHUNK}, got {chunk_size}")
    shape_error = functools.partial(_shape_error, op)
    dtype_error = functools.partial(_dtype_error, op)

    bank_dtypes = BANK_DTYPES + ((jnp.float64,) if allow_float64 else ())
    if jnp.dtype(bank.dtype) not in [jnp.dtype(d) for d in bank_dtypes]:
        names = " or ".join(jnp.dtype(d).name for d in bank_dtypes)
        if jnp.dtype(bank.dtype) == jnp.float64:  # the kernels are float32 inside; the pure-JAX paths are not
            names += " (a float64 bank needs impl='xla' or impl='reference')"
        raise dtype_error("bank", bank, names)
    # The per-token shapes: `[B, T, H, ...]`, or `[B, H, ...]` for one token.
    lead_names = ("B", "H") if step else ("B", "T", "H")
    if k_idx.ndim != len(lead_names) + 1:
        raise shape_error("k_idx", k_idx, f"[{', '.join(lead_names)}, W] (rank {len(lead_names) + 1})")
    per_token = {"k_idx": k_idx, "k_val": k_val, "v": v, "beta": beta, "g": g, "q_idx": q_idx, "q_val": q_val}
    lead, W = _common_lead(per_token, len(lead_names)), k_idx.shape[-1]
    (B, H), T = (lead, 1) if step else ((lead[0], lead[2]), lead[1])

    def expected(*rest):  # a per-token shape as text; `rest`: trailing (name, size) pairs, size None if free
        names = ", ".join(lead_names + tuple(n for n, _ in rest))
        sizes = ", ".join(str(x) for x in lead + tuple(n if x is None else x for n, x in rest))
        return f"[{names}] = [{sizes}]"

    if bank.ndim == 4:
        if bank.shape[:2] != (B, H):
            raise shape_error("bank", bank, f"[B, H, K, D] = [{B}, {H}, K, D] or a shared [H, K, D] bank")
    elif bank.ndim == 3:
        if bank.shape[0] != H:
            raise shape_error("bank", bank, f"[H, K, D] = [{H}, K, D] or [B, H, K, D]")
    else:
        raise shape_error("bank", bank, "[B, H, K, D] or [H, K, D] (rank 4 or 3)")
    K, D = bank.shape[-2:]
    if tuple(k_idx.shape[:-1]) != lead:
        raise shape_error("k_idx", k_idx, expected(("W", None)))
    if q_idx.ndim != len(lead) + 1 or tuple(q_idx.shape[:-1]) != lead:
        raise shape_error("q_idx", q_idx, expected(("R", None)))
    R = q_idx.shape[-1]
    for name, n in (("k_idx", W), ("q_idx", R)):
        if not 0 <= n <= MAX_LANES:
            lanes = "W" if name == "k_idx" else "R"
            raise ValueError(f"{op}: `{name}` has {lanes} = {n} lanes, expected 0..{MAX_LANES}")
    for name, a in (("k_idx", k_idx), ("q_idx", q_idx)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise dtype_error(name, a, "an integer type (int32 preferred)")
    for name, a, want in (("k_val", k_val, lead + (W,)), ("q_val", q_val, lead + (R,)), ("v", v, lead + (D,))):
        if tuple(a.shape) != want:
            raise shape_error(name, a, list(want))
        if a.dtype != bank.dtype:
            raise dtype_error(name, a, f"the bank's dtype {jnp.dtype(bank.dtype).name}")
    gate_dtypes = [jnp.dtype(jnp.float32)] + ([jnp.dtype(jnp.float64)] if bank.dtype == jnp.float64 else [])
    if tuple(beta.shape) != lead:
        raise shape_error("beta", beta, list(lead))
    if tuple(g.shape) == lead:
        per_write = False
    elif tuple(g.shape) == lead + (W,):
        per_write = True
    else:
        raise shape_error("g", g, f"{expected()} (per token) or {expected(('W', W))} (per write)")
    for name, a in (("beta", beta), ("g", g)):
        if jnp.dtype(a.dtype) not in gate_dtypes:
            raise dtype_error(name, a, " or ".join(d.name for d in gate_dtypes))
    return Dims(B, T, H, K, D, W, R, int(chunk_size), per_write, bank.ndim == 3)


def is_empty(dims):
    """Whether the problem has no work: no stream, token, slot or column (the readings are all zeros or empty and
    the bank comes back unchanged)."""
    return 0 in (dims.B, dims.T, dims.H, dims.K, dims.D)


def empty_result(bank, dims):
    """`(y, final_bank)` of an empty problem: zero readings `[B, T, H, D]` and the bank unchanged (per batch
    element), so that no kernel ever sees an empty dimension and gradients are zeros of the right shapes."""
    return jnp.zeros((dims.B, dims.T, dims.H, dims.D), bank.dtype), batch_banks(bank, dims)


def one_lane_if_none(k_idx, k_val, g, q_idx, q_val, dims):
    """A token with no write lanes (`W = 0`) or no read lanes (`R = 0`) gets one lane with an out-of-range id and
    weight 0 (and gate 0): it writes and reads nothing, and no kernel sees an empty dimension. Returns the
    arguments and their `Dims`."""
    def one_lane(idx, val):
        return (jnp.full(idx.shape[:3] + (1,), -1, jnp.int32), jnp.zeros(val.shape[:3] + (1,), val.dtype))

    if dims.W == 0:
        k_idx, k_val = one_lane(k_idx, k_val)
        if dims.per_write_gates:
            g = jnp.zeros(g.shape[:3] + (1,), g.dtype)
        dims = dims._replace(W=1)
    if dims.R == 0:
        q_idx, q_val = one_lane(q_idx, q_val)
        dims = dims._replace(R=1)
    return k_idx, k_val, g, q_idx, q_val, dims


def in_range(idx, num_slots, xp):
    """Mask of the ids in `[0, num_slots)`, compared in the ids' own integer type (never cast first)."""
    info = np.iinfo(idx.dtype)
    ok = idx >= 0 if info.min < 0 else xp.ones(idx.shape, bool)
    if num_slots <= info.max:
        ok = ok & (idx < num_slots)
    return ok


def slot_ids(idx, num_slots):
    """Slot ids as int32, every id outside `[0, num_slots)` replaced by -1 (ignored), whatever its integer type:
    an id of 2^32 + 3 must not wrap to slot 3 in the cast."""
    if isinstance(idx, jax.Array):
        return jnp.where(in_range(idx, num_slots, jnp), idx, -1).astype(jnp.int32)
    idx = np.asarray(idx)  # NumPy ids: mapped before JAX would truncate 64-bit ids to 32 bits (x64 off)
    if not np.issubdtype(idx.dtype, np.integer):
        return idx  # validate names the bad dtype
    return np.where(in_range(idx, num_slots, np), idx, -1).astype(np.int32)


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


def kernel_tokens(k_idx, k_val, x, v, beta, q_idx, q_val, dims):
    """The per-token arrays `[B, T, H, ...]` in kernel layout `[NC, P, C, ...]`, as the kernels take them: int32 ids
    (`slot_ids`: -1 for every id outside `[0, K)`, and for the padding), float32 weights and gates (`x` per write
    lane), `v` in its own dtype (the bank's: the forward's kernels widen it on load). `v` may be None (then None)."""
    f32 = jnp.float32
    units = lambda a, fill=0: to_units(a, dims, fill)
    return (units(slot_ids(k_idx, dims.K), -1), units(k_val.astype(f32)), units(lane_gates(x, dims).astype(f32)),
            None if v is None else units(v), units(beta.astype(f32)), units(slot_ids(q_idx, dims.K), -1),
            units(q_val.astype(f32)))


def tokens_from_units(grad, dims, dtype, per_lane=True):
    """The transpose of `kernel_tokens` for one float argument: its gradient `[NC, P, C, ...]` back in the public
    layout `[B, T, H, ...]` and in `dtype`; `per_lane=False` for per-token gates (the lanes' gradients summed as
    `ordered_broadcast`'s are)."""
    grad = from_units(grad, dims)
    if not per_lane:
        grad = ordered_sum(grad, grad.ndim - 1)
    return grad.astype(dtype)


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


def ordered_sum(a, axis):
    """The sum of `a` along `axis` as a chain of adds in index order, in at least float32, in `a`'s dtype: the
    transpose of `ordered_broadcast`."""
    if a.shape[axis] == 0:
        return jnp.zeros(a.shape[:axis] + a.shape[axis + 1:], a.dtype)
    acc = jnp.promote_types(a.dtype, jnp.float32)
    total = jnp.take(a, 0, axis).astype(acc)
    for n in range(1, a.shape[axis]):
        total = total + jnp.take(a, n, axis).astype(acc)
    return total.astype(a.dtype)


def _ordered_broadcast_bwd(copies, axis, _, ct):
    return (ordered_sum(ct, axis),)


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
    out = differentiable_ordered_broadcast(a, copies, axis)
    if copies == 0:
        return out, jnp.zeros(out.shape, t.dtype)
    wide = t.astype(jnp.promote_types(t.dtype, jnp.float32))
    return out, jnp.stack([wide] * copies, axis).astype(t.dtype)
