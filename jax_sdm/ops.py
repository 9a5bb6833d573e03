"""The public op `sdm_write_read`, its `impl` dispatch, and the kernel path's forward and backward bodies
(`sharding.py` wraps them in the custom VJP, partitioned per stream)."""

import jax
import jax.numpy as jnp

from . import ffi_ops, layout, lowering, segments, sharding
from .reference import sdm_reference
from .xla import chunk_loop_xla, phase1_xla, solve_xla

IMPLS = ("auto", "ffi", "xla", "reference")


def _sdm_xla(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims, seg=None):
    """The chunked form in pure JAX (SPEC 1.2), in kernel layout; `seg`: the tokens' segment counters of packed
    sequences (`segments.segment_numbers`, padding already dropped), or None."""
    f32 = jnp.promote_types(bank.dtype, jnp.float32)
    units = lambda a, fill=0: layout.to_units(a, dims, fill)
    k_idx_u = units(k_idx.astype(jnp.int32), -1)
    q_idx_u = units(q_idx.astype(jnp.int32), -1)
    packed, p1_k_idx, p1_q_idx, p1_slots = None, k_idx_u, q_idx_u, dims.K
    if seg is not None:  # Phase 1 sees each segment of a chunk on its own slots
        packed = segments.chunk_segments(seg, dims, layout.to_units)
        p1_slots = segments.checked_virtual_slot_count(dims)
        p1_k_idx, p1_q_idx = (segments.virtual_slots(a, packed[1], dims.K) for a in (k_idx_u, q_idx_u))
    p1 = phase1_xla(p1_k_idx, units(k_val.astype(f32)), units(layout.lane_gates(g, dims).astype(f32)),
                    p1_q_idx, units(q_val.astype(f32)), p1_slots)
    beta_u = units(beta.astype(f32))
    minv = solve_xla(p1.A, beta_u)
    bank = layout.batch_banks(bank, dims)
    y, final = chunk_loop_xla(bank.reshape(dims.P, dims.K, dims.D), k_idx_u, q_idx_u, units(v.astype(f32)),
                              beta_u, p1, minv, packed)
    return (layout.from_units(y, dims).astype(bank.dtype), final.reshape(dims.B, dims.H, dims.K, dims.D),
            jnp.sum(p1.repeats))


def _sdm_kernels_fwd(bank, k_idx, k_val, x, v, beta, q_idx, q_val, num_slots, save=True):
    """The kernels' forward in kernel layout (bank `[P, K, D]`, tokens `[NC, P, C, ...]`, per-lane gates `x`):
    `((y [NC, P, C, D] float32, final_bank, repeats [NC, P]), residuals)`; with `save=False` nothing is kept for
    a backward. `sharding.py` runs it (and `_sdm_kernels_bwd`) per shard inside its custom VJP."""
    p1 = ffi_ops.phase1_ffi(k_idx, k_val, x, q_idx, q_val, num_slots)
    minv = ffi_ops.solve_ffi(p1.A, beta)
    final, y, delta, G, snapshot = ffi_ops.forward_ffi(bank, k_idx, q_idx, v, beta, p1, minv, save)
    residuals = (final, k_idx, k_val, x, v, beta, q_idx, q_val, p1, minv, delta, G, snapshot)
    return (y, final, p1.repeats), residuals


def _sdm_kernels_bwd(num_slots, residuals, cotangents):
    """The kernels' backward: gradients of `_sdm_kernels_fwd`'s inputs (None for the slot ids)."""
    final, k_idx, k_val, x, v, beta, q_idx, q_val, p1, minv, delta, G, snapshot = residuals
    dy, dfinal, _ = cotangents
    _, dbank, dk_eff, dw, dcpe, dq_w, dA, dQK, dbeta, dv = ffi_ops.backward_ffi(
        final, dfinal, dy, k_idx, q_idx, v, beta, p1, minv, delta, G, snapshot)
    dk_val, dx, dq_val = ffi_ops.phase1_bwd_ffi(k_idx, k_val, x, q_idx, q_val, num_slots, p1,
                                                dk_eff, dw, dcpe, dq_w, dA, dQK)
    return dbank.astype(final.dtype), None, dk_val, dx, dv, dbeta, None, dq_val


KERNEL_TARGETS = ("sdm_phase1", "sdm_solve", "sdm_forward", "sdm_backward", "sdm_phase1_bwd")


def _require_kernels():
    """Raise before any work if this backend lacks one of the kernels (no silent fallback, SPEC 2)."""
    platform = jax.default_backend()
    missing = [t for t in KERNEL_TARGETS if not lowering.is_registered(t, platform)]
    if missing:
        raise NotImplementedError(
            f"sdm_write_read: impl='ffi' has no {platform} kernels for {', '.join(missing)} in this build; "
            "use impl='xla' (the chunked form in pure JAX) or impl='reference' (the token loop)")


def _sdm_ffi(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims):
    """The op on the FFI kernels (C++ on CPU, CUDA on GPU): `_sdm_kernels_fwd` / `_sdm_kernels_bwd`, partitioned
    per stream for sharded inputs (`sharding.py`)."""
    _require_kernels()
    return sharding.sdm_ffi(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims)


def kernel_layout(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims):
    """The kernels' arguments in kernel layout: bank `[P, K, D]` and per-token arrays `[NC, P, C, ...]`, in the
    order of `_sdm_kernels_fwd` (`layout.stream_arguments` with `B, H` merged into `P`)."""
    bank, *tokens = layout.stream_arguments(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims)
    return (bank.reshape(dims.P, dims.K, dims.D),) + tuple(
        a.reshape((dims.NC, dims.P) + a.shape[3:]) for a in tokens)


def _check_inputs(num_slots, k_idx, q_idx, floats, op="sdm_write_read"):
    """Runtime check (`check=True`): raise for slot ids outside `[0, K)` and non-finite inputs (`floats`, in the
    order of `CHECKED_FLOATS`); `op` names the function in the message."""
    def raise_if_bad(k_out, q_out, nonfinite):
        problems = [f"{int(n)} {name} outside [0, K={num_slots})"
                    for n, name in ((k_out, "write slot ids (k_idx)"), (q_out, "read slot ids (q_idx)")) if n]
        problems += [f"non-finite values in `{name}`" for name, bad in zip(CHECKED_FLOATS, nonfinite) if bad]
        if problems:
            raise ValueError(f"{op}(check=True): " + "; ".join(problems))

    out_of_range = lambda idx: jnp.sum((idx < 0) | (idx >= num_slots))
    nonfinite = jnp.stack([~jnp.all(jnp.isfinite(a)) for a in floats])
    jax.debug.callback(raise_if_bad, out_of_range(k_idx), out_of_range(q_idx), nonfinite)


CHECKED_FLOATS = ("bank", "k_val", "v", "beta", "g", "q_val")


def _count_repeats(k_idx, num_slots):
    """Write lanes that repeat an earlier lane's slot in the same token (the reference path's count)."""
    W = k_idx.shape[-1]
    earlier = jnp.tril(jnp.ones((W, W), bool), -1)
    same = (k_idx[..., :, None] == k_idx[..., None, :]) & earlier
    valid = (k_idx >= 0) & (k_idx < num_slots)
    return jnp.sum(valid & jnp.any(same, axis=-1)).astype(jnp.int32)


def sdm_write_read(bank, k_idx, k_val, v, beta, g, q_idx, q_val, *, chunk_size=64, impl="auto", check=False,
                   return_repeats=False, segment_ids=None):
    """Sparse Delta Memory: write then read a sparse per-head memory bank at every token (SPEC 1.1).

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
      check: also check the data at run time: slot ids outside `[0, K)` or non-finite inputs raise an error
        (a `ValueError` raised from a host callback, surfacing as a runtime error under `jit`). Without it an
        out-of-range id is ignored: it reads zeros and touches no row.
      return_repeats: also return the number of write lanes that repeated a slot of an earlier lane of the same
        token (such a slot decays once; SPEC 1.1).
      segment_ids: `[B, T]` ints for packed sequences: a token whose id differs from the previous token's starts
        a new sequence from `bank`; a negative id marks padding (the token does nothing and reads zeros). The
        final bank is the bank after each row's last non-padding token. `impl="xla"` and `"reference"` only.

    Returns:
      `(y, final_bank)`: readings `[B, T, H, D]` and the bank after the last token `[B, H, K, D]`, in the bank's
      dtype; `(y, final_bank, repeats)` with `return_repeats=True`.
    """
    if impl not in IMPLS:
        raise ValueError(f"sdm_write_read: `impl` must be one of {IMPLS}, got {impl!r}")
    bank, k_idx, k_val, v, beta, g, q_idx, q_val = map(jnp.asarray, (bank, k_idx, k_val, v, beta, g, q_idx, q_val))
    dims = layout.validate(bank, k_idx, k_val, v, beta, g, q_idx, q_val, chunk_size,
                           allow_float64=impl in ("xla", "reference"))
    seg = None
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids)
        segments.validate(segment_ids, dims.B, dims.T)
        if impl in ("auto", "ffi"):
            raise NotImplementedError(f"sdm_write_read: `segment_ids` (packed sequences) has no kernels yet "
                                      f"(impl={impl!r}); use impl='xla' (the chunked form in pure JAX) or "
                                      "impl='reference' (the token loop)")
        seg, pad = segments.segment_numbers(segment_ids)
        if check:  # the ids of padding tokens are not used: not checked
            _check_inputs(dims.K, *(segments.drop_padding(a, pad, fill=0) for a in (k_idx, q_idx)),
                          (bank, k_val, v, beta, g, q_val))
        k_idx, q_idx = segments.drop_padding(k_idx, pad), segments.drop_padding(q_idx, pad)
    elif check:
        _check_inputs(dims.K, k_idx, q_idx, (bank, k_val, v, beta, g, q_val))
    if impl == "reference":
        y, final = sdm_reference(bank, k_idx, k_val, v, beta, g, q_idx, q_val, segment_ids=segment_ids)
        repeats = _count_repeats(k_idx, dims.K) if return_repeats else None
    elif impl == "xla":
        y, final, repeats = _sdm_xla(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims, seg)
    else:
        y, final, repeats = _sdm_ffi(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims)
    return (y, final, repeats) if return_repeats else (y, final)
