"""`sdm_step`: one token of every stream (decoding), the bank updated in place. Inference only."""
import functools

import jax
import jax.numpy as jnp

from . import ffi_ops, layout, lowering
from .ops import _check_inputs, sdm_write_read
from .reference import HIGHEST

IMPLS = ("auto", "ffi", "xla", "reference")
TARGET = "sdm_decode_step"


def _step_ffi(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims):
    """The fused kernel (C++ on CPU, CUDA on GPU): one call, touching the written rows only."""
    new_bank, y = ffi_ops.decode_step_ffi(layout.batch_banks(bank, dims), k_idx, k_val, g, v, beta, q_idx, q_val)
    return y, new_bank


def _stream_step_xla(bank, k_idx, k_val, x, v, beta, q_idx, q_val):
    """One token of one stream (bank `[K, D]`, lanes `[W]` / `[R]`): gathers and one scatter of the written rows.

    Rows are worked on in float32 (at least) and each written row is stored once; repeated slots share the row of
    their first lane (decayed once, with its gate), and a read of a written slot takes the row after the write.
    (XLA's CPU compiler has no bfloat16 scatter: it converts a bfloat16 bank to float32 and back around it, a
    whole-bank cost that the kernels, `impl="ffi"`, do not have.)
    """
    K = bank.shape[0]
    acc = jnp.promote_types(bank.dtype, jnp.float32)
    valid = (k_idx >= 0) & (k_idx < K)
    rows = jnp.where(valid, k_idx, K)  # out-of-range ids read zeros and touch no row
    same_slot = (k_idx[:, None] == k_idx[None, :]) & valid[None, :]
    first = jnp.argmax(same_slot, axis=1)  # each lane's first lane with its slot (itself unless a repeat)
    decayed = bank.at[rows].get(mode="fill", fill_value=0).astype(acc) * jnp.exp(x.astype(acc))[:, None]
    row = decayed[first]  # the slot's row after its one decay, for every lane
    k = jnp.where(valid, k_val, 0).astype(acc)
    pred = jnp.matmul(k, row, precision=HIGHEST)
    d = beta.astype(acc) * (v.astype(acc) - pred)
    written = row + jnp.matmul(same_slot.astype(acc), k, precision=HIGHEST)[:, None] * d[None, :]
    new_bank = bank.at[rows].set(written.astype(bank.dtype), mode="drop")  # repeats store the same row

    read_valid = (q_idx >= 0) & (q_idx < K)
    read_written = (q_idx[:, None] == k_idx[None, :]) & valid[None, :]
    q_rows = jnp.where(read_valid, q_idx, K)
    # Gathered after the scatter, so that XLA can update the bank in place; written rows unrounded, in float32.
    stored = new_bank.at[q_rows].get(mode="fill", fill_value=0).astype(acc)
    seen = jnp.where(jnp.any(read_written, axis=1)[:, None], written[jnp.argmax(read_written, axis=1)], stored)
    y = jnp.matmul(jnp.where(read_valid, q_val, 0).astype(acc), seen, precision=HIGHEST)
    return y.astype(bank.dtype), new_bank


def _step_xla(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims):
    """Pure JAX: `_stream_step_xla` mapped over the batch and heads (no op on the whole bank)."""
    step = jax.vmap(jax.vmap(_stream_step_xla))
    return step(layout.batch_banks(bank, dims), k_idx, k_val, layout.lane_gates(g, dims), v, beta, q_idx, q_val)


def _step_reference(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims):
    """The token loop (`sdm_write_read(impl="reference")`) on a sequence of one token."""
    one_token = lambda a: jnp.expand_dims(a, 1)  # [B, H, ...] -> [B, T=1, H, ...]
    y, new_bank = sdm_write_read(bank, *map(one_token, (k_idx, k_val, v, beta, g, q_idx, q_val)), impl="reference")
    return y[:, 0], new_bank


_RUN = {"auto": _step_ffi, "ffi": _step_ffi, "xla": _step_xla, "reference": _step_reference}


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _inference_only(impl, dims, *args):
    return _RUN[impl](*args, dims)


INFERENCE_ONLY = ("sdm_step is inference only and cannot be differentiated (jax.grad, jax.vjp, jax.jvp, ...); "
                  "to train, run the sequence through jax_sdm.sdm_write_read, which is differentiable in every float "
                  "input")


@_inference_only.defjvp
def _no_derivative(impl, dims, primals, tangents):
    raise TypeError(INFERENCE_ONLY)


def sdm_step(bank, k_idx, k_val, v, beta, g, q_idx, q_val, *, impl="auto", check=False):
    """One token of Sparse Delta Memory for every stream (decoding), with the bank updated in place.

    The same as `sdm_write_read` on a sequence of one token (up to rounding), without the time axis. Under
    `jax.jit` with the bank donated (`donate_argnums`), the kernels touch only the `W` written rows of each stream:
    a step costs O((W + R) D) per stream, whatever `K`. Inference only: differentiating it raises an error (use
    `sdm_write_read` to train).

    Args:
      bank: `[B, H, K, D]` (or `[H, K, D]` shared by the batch; the result is then `[B, H, K, D]`), float32 or
        bfloat16; with `jax_enable_x64`, `impl="xla"` and `"reference"` also take float64.
      k_idx, k_val: `[B, H, W]` write slot ids (int) and weights (the bank's dtype).
      v: `[B, H, D]` values (the bank's dtype).
      beta: `[B, H]` write strengths, float32.
      g: `[B, H]` per-token or `[B, H, W]` per-write log-gates, float32 (`<= 0`; `-inf` resets the written row).
      q_idx, q_val: `[B, H, R]` read slot ids and weights.
      impl: "auto" | "ffi" (the fused kernel: C++ on CPU, CUDA on GPU), "xla" (pure JAX: gathers and a scatter of
        the written rows), "reference" (`sdm_write_read(impl="reference")` on one token).
      check: as in `sdm_write_read`: raise at run time on slot ids outside `[0, K)` or non-finite inputs. Without
        it an out-of-range id is ignored (it reads zeros and touches no row).

    Returns:
      `(y, new_bank)`: readings `[B, H, D]` and the bank after the token `[B, H, K, D]`, in the bank's dtype.
    """
    if impl not in IMPLS:
        raise ValueError(f"sdm_step: `impl` must be one of {IMPLS}, got {impl!r}")
    args = tuple(map(jnp.asarray, (bank, k_idx, k_val, v, beta, g, q_idx, q_val)))
    dims = layout.validate(*args, 1, allow_float64=impl in ("xla", "reference"), op="sdm_step", step=True)
    if check:
        bank, k_idx, k_val, v, beta, g, q_idx, q_val = args
        _check_inputs(dims.K, k_idx, q_idx, (bank, k_val, v, beta, g, q_val), op="sdm_step")
    if impl in ("auto", "ffi"):
        platform = jax.default_backend()
        if not lowering.is_registered(TARGET, platform):
            if impl == "auto":  # no kernel on this backend: pure JAX
                impl = "xla"
            else:
                raise NotImplementedError(
                    f"sdm_step: impl='ffi' has no {platform} kernel ({TARGET}) in this build; use impl='xla' "
                    "(pure JAX; impl='auto' picks it here) or impl='reference' (the token loop)")
    return _inference_only(impl, dims, *args)
