"""The public op `sdm_write_read` and its `impl` dispatch: the kernel path (`kernel_path.py`), the chunked form in
pure JAX (`xla.py`) or the token loop (`reference.py`)."""

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from . import kernel_path, layout, sharding
from .reference import sdm_reference
from .xla import chunk_loop_xla, phase1_xla, solve_xla

IMPLS = ("auto", "ffi", "xla", "reference")


DIFFERENTIABLE = layout.differentiable_ordered_broadcast  # the pure-JAX path serves every transformation


def _sdm_xla(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims):
    """The chunked form in pure JAX (docs/MATH.md "Chunked form"), in kernel layout."""
    f32 = jnp.promote_types(bank.dtype, jnp.float32)
    units = lambda a, fill=0: layout.to_units(a, dims, fill)
    k_idx_u = units(k_idx.astype(jnp.int32), -1)
    q_idx_u = units(q_idx.astype(jnp.int32), -1)
    p1 = phase1_xla(k_idx_u, units(k_val.astype(f32)), units(layout.lane_gates(g, dims, DIFFERENTIABLE).astype(f32)),
                    q_idx_u, units(q_val.astype(f32)), dims.K)
    beta_u = units(beta.astype(f32))
    minv = solve_xla(p1.A, beta_u)
    bank = layout.batch_banks(bank, dims, DIFFERENTIABLE)
    y, final = chunk_loop_xla(bank.reshape(dims.P, dims.K, dims.D), k_idx_u, q_idx_u, units(v.astype(f32)),
                              beta_u, p1, minv)
    return (layout.from_units(y, dims).astype(bank.dtype), final.reshape(dims.B, dims.H, dims.K, dims.D),
            jnp.sum(p1.repeats))


def _check_inputs(num_slots, k_idx, q_idx, floats):
    """The run-time checks of `check=True`: slot ids outside `[0, K)` and non-finite inputs.

    Each is a `jax.experimental.checkify.check`: run eagerly it raises `checkify.JaxRuntimeError` (a `ValueError`);
    under `checkify.checkify(f)` the first failing one is the returned error (`err.get()` is its message,
    `err.throw()` raises it). Staged (`jit`, `scan`, ...) without `checkify`, JAX refuses to compile it.
    """
    out_of_range = lambda idx: jnp.sum((idx < 0) | (idx >= num_slots))
    problems = [(out_of_range(k_idx), f"write slot ids (k_idx) outside [0, K={num_slots})"),
                (out_of_range(q_idx), f"read slot ids (q_idx) outside [0, K={num_slots})")]
    problems += [(jnp.sum(~jnp.isfinite(a)), f"non-finite values in `{name}`")
                 for name, a in zip(CHECKED_FLOATS, floats)]
    for count, what in problems:
        checkify.check(count == 0, "sdm_write_read(check=True): {count} " + what, count=count)


CHECKED_FLOATS = ("bank", "k_val", "v", "beta", "g", "q_val")


def _count_repeats(k_idx, num_slots):
    """Write lanes that repeat an earlier lane's slot in the same token (the reference path's count)."""
    W = k_idx.shape[-1]
    earlier = jnp.tril(jnp.ones((W, W), bool), -1)
    same = (k_idx[..., :, None] == k_idx[..., None, :]) & earlier
    valid = (k_idx >= 0) & (k_idx < num_slots)
    return jnp.sum(valid & jnp.any(same, axis=-1)).astype(jnp.int32)


def sdm_write_read(bank, k_idx, k_val, v, beta, g, q_idx, q_val, *, chunk_size=64, impl="auto", check=False,
                   return_repeats=False):
    """Sparse Delta Memory: write then read a sparse per-head memory bank at every token (docs/MATH.md).

    Args:
      bank: `[B, H, K, D]` (or `[H, K, D]` shared by the batch), float32 or bfloat16.
      k_idx, k_val: `[B, T, H, W]` write slot ids (int) and weights (the bank's dtype).
      v: `[B, T, H, D]` values (the bank's dtype).
      beta: `[B, T, H]` write strengths, float32.
      g: `[B, T, H]` per-token or `[B, T, H, W]` per-write log-gates, float32.
      q_idx, q_val: `[B, T, H, R]` read slot ids and weights.
      chunk_size: tokens per chunk of the chunked form (changes results only by rounding).
      impl: "auto" | "ffi" | "xla" | "reference". "auto" and "ffi" run the FFI kernels (C++ on CPU, CUDA on
        GPU), "xla" the chunked form in pure JAX, "reference" the token loop.
      check: also check the data at run time: slot ids outside `[0, K)` and non-finite inputs are errors,
        reported through `jax.experimental.checkify`: wrap the (jitted) function in `checkify.checkify` to get
        them as an error value (`err.throw()` raises `checkify.JaxRuntimeError`, a `ValueError`); run eagerly they
        raise that directly. Under `jit` without `checkify` JAX refuses to compile the checks. Without `check` an
        out-of-range id is ignored: it reads zeros and touches no row.
      return_repeats: also return the number of write lanes that repeated a slot of an earlier lane of the same
        token (such a slot decays once; docs/MATH.md).

    Returns:
      `(y, final_bank)`: readings `[B, T, H, D]` and the bank after the last token `[B, H, K, D]`, in the bank's
      dtype; `(y, final_bank, repeats)` with `return_repeats=True`.
    """
    if impl not in IMPLS:
        raise ValueError(f"sdm_write_read: `impl` must be one of {IMPLS}, got {impl!r}")
    bank, k_idx, k_val, v, beta, g, q_idx, q_val = map(jnp.asarray, (bank, k_idx, k_val, v, beta, g, q_idx, q_val))
    dims = layout.validate(bank, k_idx, k_val, v, beta, g, q_idx, q_val, chunk_size,
                           allow_float64=impl in ("xla", "reference"))
    if check:
        _check_inputs(dims.K, k_idx, q_idx, (bank, k_val, v, beta, g, q_val))
    # Inside `shard_map`: every input varies along the manual axes along which any does (a bank shared by the
    # devices is updated per device; the transpose of this cast sums its gradient over them).
    axes = sharding.varying_axes(bank, k_idx, k_val, v, beta, g, q_idx, q_val)
    bank, k_idx, k_val, v, beta, g, q_idx, q_val = (sharding.to_varying(a, axes)
                                                    for a in (bank, k_idx, k_val, v, beta, g, q_idx, q_val))
    if impl == "reference":
        y, final = sdm_reference(bank, k_idx, k_val, v, beta, g, q_idx, q_val)
        repeats = _count_repeats(k_idx, dims.K) if return_repeats else None
    else:
        run = _sdm_xla if impl == "xla" else kernel_path.sdm_ffi
        y, final, repeats = run(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims)
    return (y, final, repeats) if return_repeats else (y, final)
