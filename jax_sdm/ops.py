"""The public op `sdm_write_read`, its `impl` dispatch, and the kernel path's forward and backward bodies
(`sharding.py` wraps them in the custom VJP, partitioned per stream)."""

import jax
import jax.numpy as jnp

from . import ffi_ops, layout, lowering, sharding
from .reference import sdm_reference
from .xla import chunk_loop_xla, phase1_xla, solve_xla

IMPLS = ("auto", "ffi", "xla", "reference")


def _sdm_xla(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims):
    """The chunked form in pure JAX (SPEC 1.2), one stream at a time under `vmap` over `B` and `H`: the streams'
    axes stay apart and are never scanned over, so under `jit` with inputs sharded along `B` / `H` every device
    keeps its own streams (no all-gather)."""
    f32 = jnp.promote_types(bank.dtype, jnp.float32)
    units = lambda a, fill=0: layout.to_stream_units(a, dims, fill)  # [NC, B, H, C, ...]

    def one_stream(bank_s, k_idx_s, k_val_s, x_s, v_s, beta_s, q_idx_s, q_val_s):
        p1 = phase1_xla(k_idx_s, k_val_s, x_s, q_idx_s, q_val_s, dims.K)
        minv = solve_xla(p1.A, beta_s)
        one = lambda a: a[:, None]  # [NC, C, ...] -> [NC, P = 1, C, ...]
        y, final = chunk_loop_xla(bank_s[None], one(k_idx_s), one(q_idx_s), one(v_s), one(beta_s),
                                  type(p1)(*map(one, p1)), one(minv))
        return y[:, 0], final[0], jnp.sum(p1.repeats)

    per_head = jax.vmap(one_stream, in_axes=(0,) + (1,) * 7, out_axes=(1, 0, 0))
    per_stream = jax.vmap(per_head, in_axes=(0,) + (1,) * 7, out_axes=(1, 0, 0))
    y, final, repeats = per_stream(
        layout.batch_banks(bank, dims), units(k_idx, -1), units(k_val.astype(f32)),
        units(layout.lane_gates(g, dims).astype(f32)), units(v.astype(f32)), units(beta.astype(f32)),
        units(q_idx, -1), units(q_val.astype(f32)))
    return layout.from_stream_units(y, dims).astype(bank.dtype), final, jnp.sum(repeats)


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


def _check_inputs(num_slots, k_idx, q_idx, floats):
    """Runtime check (`check=True`): raise for slot ids outside `[0, K)`, non-finite inputs and gates `g > 0`."""
    def raise_if_bad(k_out, q_out, nonfinite, positive_gates):
        problems = [f"{int(n)} {name} outside [0, K={num_slots})"
                    for n, name in ((k_out, "write slot ids (k_idx)"), (q_out, "read slot ids (q_idx)")) if n]
        problems += [f"non-finite values in `{name}`" for name, bad in zip(CHECKED_FLOATS, nonfinite) if bad]
        if positive_gates:
            problems.append(f"{int(positive_gates)} gates `g` > 0 (the domain is g <= 0, a decay)")
        if problems:
            raise ValueError("sdm_write_read(check=True): " + "; ".join(problems))

    out_of_range = lambda idx: jnp.sum(~layout.in_range(idx, num_slots, jnp))
    nonfinite = jnp.stack([~jnp.all(jnp.isfinite(a)) for a in floats])
    positive_gates = jnp.sum(floats[CHECKED_FLOATS.index("g")] > 0)
    jax.debug.callback(raise_if_bad, out_of_range(k_idx), out_of_range(q_idx), nonfinite, positive_gates)


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
    """Sparse Delta Memory: write then read a sparse per-head memory bank at every token (SPEC 1.1).

    Args:
      bank: `[B, H, K, D]` (or `[H, K, D]` shared by the batch), float32 or bfloat16.
      k_idx, k_val: `[B, T, H, W]` write slot ids (int) and weights (the bank's dtype).
      v: `[B, T, H, D]` values (the bank's dtype).
      beta: `[B, T, H]` write strengths, float32.
      g: `[B, T, H]` per-token or `[B, T, H, W]` per-write log-gates, float32. The domain is `g <= 0` (a decay):
        every finite gate and `-inf` (a hard reset: the written row forgets everything before the write) give
        finite results equal to the token loop's. `g > 0` is outside it: the chunked forms' exponents overflow
        (no positive range is served exactly), and `check=True` reports it.
      q_idx, q_val: `[B, T, H, R]` read slot ids and weights.
      chunk_size: tokens per chunk of the chunked form (changes results only by rounding).
      impl: "auto" | "ffi" | "xla" | "reference". "auto" and "ffi" run the FFI kernels (C++ on CPU, CUDA on
        GPU), "xla" the chunked form in pure JAX, "reference" the token loop.
      check: also check the data at run time: slot ids outside `[0, K)`, non-finite inputs or gates `g > 0`
        raise an error (a `ValueError` raised from a host callback, surfacing as a runtime error under `jit`).
        Without it an out-of-range id, of any integer type, is ignored: it reads zeros and touches no row; and
        a non-finite input gives unspecified values in the streams (batch element x head) it enters, and only
        there.
      return_repeats: also return the number of write lanes that repeated a slot of an earlier lane of the same
        token (such a slot decays once; SPEC 1.1).

    Returns:
      `(y, final_bank)`: readings `[B, T, H, D]` and the bank after the last token `[B, H, K, D]`, in the bank's
      dtype; `(y, final_bank, repeats)` with `return_repeats=True`. Any dimension may be 0: an empty problem
      (`B`, `T`, `H`, `K` or `D` zero) gives zero (or empty) readings and the bank unchanged; `W = 0` (`R = 0`)
      means tokens that write (read) nothing.
    """
    if impl not in IMPLS:
        raise ValueError(f"sdm_write_read: `impl` must be one of {IMPLS}, got {impl!r}")
    bank = jnp.asarray(bank)
    num_slots = bank.shape[-2] if bank.ndim >= 2 else 0
    k_idx, q_idx = (i if isinstance(i, jax.Array) else layout.slot_ids(i, num_slots) for i in (k_idx, q_idx))
    k_idx, k_val, v, beta, g, q_idx, q_val = map(jnp.asarray, (k_idx, k_val, v, beta, g, q_idx, q_val))
    dims = layout.validate(bank, k_idx, k_val, v, beta, g, q_idx, q_val, chunk_size,
                           allow_float64=impl in ("xla", "reference"))
    if check:
        _check_inputs(dims.K, k_idx, q_idx, (bank, k_val, v, beta, g, q_val))
    if layout.is_empty(dims):
        y, final = layout.empty_result(bank, dims)
        return (y, final, jnp.int32(0)) if return_repeats else (y, final)
    k_idx, q_idx = layout.slot_ids(k_idx, dims.K), layout.slot_ids(q_idx, dims.K)
    k_idx, k_val, g, q_idx, q_val, dims = layout.one_lane_if_none(k_idx, k_val, g, q_idx, q_val, dims)
    if impl == "reference":
        y, final = sdm_reference(bank, k_idx, k_val, v, beta, g, q_idx, q_val)
        repeats = _count_repeats(k_idx, dims.K) if return_repeats else None
    else:
        run = _sdm_xla if impl == "xla" else _sdm_ffi
        y, final, repeats = run(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims)
    return (y, final, repeats) if return_repeats else (y, final)
