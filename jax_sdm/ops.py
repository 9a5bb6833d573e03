"""The public op `sdm_write_read`, its `impl` dispatch, and the custom VJP of the kernel path."""
import functools

import jax
import jax.numpy as jnp

from . import layout
from .reference import sdm_reference
from .xla import chunk_loop_xla, phase1_xla, solve_xla
from . import ffi_ops

IMPLS = ("auto", "ffi", "xla", "reference")


def _sdm_xla(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims):
    """The chunked form in pure JAX (SPEC 1.2), in kernel layout."""
    f32 = jnp.promote_types(bank.dtype, jnp.float32)
    units = lambda a, fill=0: layout.to_units(a, dims, fill)
    k_idx_u = units(k_idx.astype(jnp.int32), -1)
    q_idx_u = units(q_idx.astype(jnp.int32), -1)
    p1 = phase1_xla(k_idx_u, units(k_val.astype(f32)), units(layout.lane_gates(g, dims).astype(f32)),
                    q_idx_u, units(q_val.astype(f32)), dims.K)
    beta_u = units(beta.astype(f32))
    minv = solve_xla(p1.A, beta_u)
    if dims.shared_bank:
        bank = jnp.broadcast_to(bank[None], (dims.B,) + bank.shape)
    y, final = chunk_loop_xla(bank.reshape(dims.P, dims.K, dims.D), k_idx_u, q_idx_u, units(v.astype(f32)),
                              beta_u, p1, minv)
    return layout.from_units(y, dims).astype(bank.dtype), final.reshape(dims.B, dims.H, dims.K, dims.D)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _sdm_kernels(bank, k_idx, k_val, x, v, beta, q_idx, q_val, num_slots):
    """The op on the FFI kernels in kernel layout: bank `[P, K, D]`, tokens `[NC, P, C, ...]`, per-lane gates `x`.

    Returns `(y [NC, P, C, D] float32, final_bank, repeats [NC, P])`. A call that is not differentiated saves no
    residuals.
    """
    out, _ = _sdm_kernels_fwd(bank, k_idx, k_val, x, v, beta, q_idx, q_val, num_slots, save=False)
    return out


def _sdm_kernels_fwd(bank, k_idx, k_val, x, v, beta, q_idx, q_val, num_slots, save=True):
    p1 = ffi_ops.phase1_ffi(k_idx, k_val, x, q_idx, q_val, num_slots)
    minv = ffi_ops.solve_ffi(p1.A, beta)
    final, y, delta, G, snapshot = ffi_ops.forward_ffi(bank, k_idx, q_idx, v, beta, p1, minv, save)
    residuals = (final, k_idx, k_val, x, v, beta, q_idx, q_val, p1, minv, delta, G, snapshot)
    return (y, final, p1.repeats), residuals


def _sdm_kernels_bwd(num_slots, residuals, cotangents):
    final, k_idx, k_val, x, v, beta, q_idx, q_val, p1, minv, delta, G, snapshot = residuals
    dy, dfinal, _ = cotangents
    _, dbank, dk_eff, dw, dcpe, dq_w, dA, dQK, dbeta, dv = ffi_ops.backward_ffi(
        final, dfinal, dy, k_idx, q_idx, v, beta, p1, minv, delta, G, snapshot)
    dk_val, dx, dq_val = ffi_ops.phase1_bwd_ffi(k_idx, k_val, x, q_idx, q_val, num_slots, p1,
                                                dk_eff, dw, dcpe, dq_w, dA, dQK)
    return dbank.astype(final.dtype), None, dk_val, dx, dv, dbeta, None, dq_val


_sdm_kernels.defvjp(_sdm_kernels_fwd, _sdm_kernels_bwd)


def _sdm_ffi(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims):
    """The op on the FFI kernels (C++ on CPU, CUDA on GPU)."""
    f32 = jnp.float32
    units = lambda a, fill=0: layout.to_units(a, dims, fill)
    if dims.shared_bank:
        bank = jnp.broadcast_to(bank[None], (dims.B,) + bank.shape)
    y, final, repeats = _sdm_kernels(
        bank.reshape(dims.P, dims.K, dims.D), units(k_idx.astype(jnp.int32), -1), units(k_val.astype(f32)),
        units(layout.lane_gates(g, dims).astype(f32)), units(v.astype(f32)), units(beta.astype(f32)),
        units(q_idx.astype(jnp.int32), -1), units(q_val.astype(f32)), dims.K)
    return (layout.from_units(y, dims).astype(bank.dtype), final.reshape(dims.B, dims.H, dims.K, dims.D),
            jnp.sum(repeats))


def sdm_write_read(bank, k_idx, k_val, v, beta, g, q_idx, q_val, *, chunk_size=64, impl="auto"):
    """Sparse Delta Memory: write then read a sparse per-head memory bank at every token (SPEC 1.1).

    Args:
      bank: `[B, H, K, D]` (or `[H, K, D]` shared by the batch), float32 or bfloat16.
      k_idx, k_val: `[B, T, H, W]` write slot ids (int) and weights (the bank's dtype).
      v: `[B, T, H, D]` values (the bank's dtype).
      beta: `[B, T, H]` write strengths, float32.
      g: `[B, T, H]` per-token or `[B, T, H, W]` per-write log-gates, float32.
      q_idx, q_val: `[B, T, H, R]` read slot ids and weights.
      chunk_size: tokens per chunk of the chunked form (changes results only by rounding).
      impl: "auto" | "ffi" | "xla" | "reference".

    Returns:
      `(y, final_bank)`: readings `[B, T, H, D]` and the bank after the last token `[B, H, K, D]`, in the bank's
      dtype.
    """
    if impl not in IMPLS:
        raise ValueError(f"sdm_write_read: `impl` must be one of {IMPLS}, got {impl!r}")
    bank, k_idx, k_val, v, beta, g, q_idx, q_val = map(jnp.asarray, (bank, k_idx, k_val, v, beta, g, q_idx, q_val))
    dims = layout.validate(bank, k_idx, k_val, v, beta, g, q_idx, q_val, chunk_size,
                           allow_float64=impl in ("xla", "reference"))
    if impl == "reference":
        return sdm_reference(bank, k_idx, k_val, v, beta, g, q_idx, q_val)
    if impl == "xla":
        return _sdm_xla(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims)
    y, final, _ = _sdm_ffi(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims)
    return y, final
