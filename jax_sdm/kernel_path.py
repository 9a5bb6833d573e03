"""The kernel path of `sdm_write_read` (`impl="ffi"`): the FFI kernels' forward and backward in a custom VJP.

`_sdm_kernels_fwd` / `_sdm_kernels_bwd` run the kernels (`ffi_ops.py`) on the streams `P = B*H` in kernel layout;
`stream_kernels` is the custom VJP around them, with `B` and `H` explicit so that `sharding.per_stream` runs every
shard's streams on its own device (and folds a `vmap` into `B`). `sdm_ffi` is the entry point of `ops.py`.
"""
import functools

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from . import ffi_ops, layout, lowering
from .sharding import BANK, UNITS, explicit_out_sharding, merge, per_stream, split, to_varying, varying_axes


def _sdm_kernels_fwd(bank, k_idx, k_val, x, v, beta, q_idx, q_val, num_slots, save=True):
    """The kernels' forward in kernel layout (bank `[P, K, D]`, tokens `[NC, P, C, ...]`, per-lane gates `x`):
    `((y [NC, P, C, D] float32, final_bank, repeats [NC, P]), residuals)`; with `save=False` nothing is kept for
    a backward. `stream_kernels` runs it (and `_sdm_kernels_bwd`) per shard inside its custom VJP."""
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


FORWARD_MODE_ERROR = (
    "sdm_write_read: impl='ffi' (the kernels; also impl='auto') does not support forward-mode differentiation "
    "(jax.jvp, jax.jacfwd, jax.linearize): the kernels have a reverse-mode rule only (jax.grad, jax.vjp, "
    "jax.jacrev). Use impl='xla' (the chunked form in pure JAX) or impl='reference' (the token loop), which "
    "support every JAX transformation.")
HIGHER_ORDER_ERROR = (
    "sdm_write_read: impl='ffi' (the kernels; also impl='auto') does not support higher-order differentiation "
    "(a derivative of its gradient: grad of grad, jax.hessian, jax.jacfwd of jax.grad): the kernels' forward and "
    "backward have no derivatives of their own. Use impl='xla' (the chunked form in pure JAX) or "
    "impl='reference' (the token loop), which support every JAX transformation.")


def _refuse_forward_mode(arrays):
    """Raise FORWARD_MODE_ERROR when `arrays` carry forward-mode tangents (`jax.jvp`, `jax.jacfwd`).

    JAX would refuse too, but with a message that names neither the op nor an alternative. Reverse mode traces
    with its own tracers (`jax.grad` linearizes directly), so only forward mode shows JVP tracers here. A `jax.jvp`
    of an already traced function (e.g. of a `jax.jit`) reaches the custom VJP without this check; JAX's own
    error ("can't apply forward-mode autodiff (jvp) to a custom_vjp function") stands there.
    """
    if not getattr(jax.config, "jax_use_direct_linearize", False):  # grad itself runs on JVP tracers
        return
    if any(isinstance(a, ad.JVPTracer) for a in arrays):
        raise NotImplementedError(FORWARD_MODE_ERROR)


def _kernels_per_stream(local_fn, num_slots, args, in_axes, out_axes):
    """`per_stream(local_fn, ...)` with a JVP rule that raises HIGHER_ORDER_ERROR.

    The kernels have no derivatives: a derivative of the custom VJP's forward or backward is a second-order one,
    refused here with a clear message (JAX would say that `custom_partitioning` has no differentiation rule).
    """
    @jax.custom_jvp
    def call(*args):
        return per_stream(local_fn, num_slots, args, in_axes, out_axes)

    @call.defjvp
    def _no_derivative(primals, tangents):
        raise NotImplementedError(HIGHER_ORDER_ERROR)

    return call(*args)


def kernel_layout(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims):
    """The kernels' arguments in kernel layout: bank `[P, K, D]` and per-token arrays `[NC, P, C, ...]`, in the
    order of `_sdm_kernels_fwd` (`layout.stream_arguments` with `B, H` merged into `P`)."""
    bank, *tokens = layout.stream_arguments(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims)
    return (bank.reshape(dims.P, dims.K, dims.D),) + tuple(
        a.reshape((dims.NC, dims.P) + a.shape[3:]) for a in tokens)


# ------------------------------------------------------------------------------------------------------------------
# The kernels per stream, with explicit B and H, in a custom VJP


def _local_forward(save, num_slots, bank, *tokens):
    """One shard's forward: merge to `P = B*H`, run the kernels (`_sdm_kernels_fwd`), split back.

    Returns `(y, final, repeats)`, then with `save` the kernels' residuals (those beyond the inputs), flattened.
    """
    H = bank.shape[1]
    merged = [merge(bank, BANK)] + [merge(a, UNITS) for a in tokens]
    (y, final, repeats), residuals = _sdm_kernels_fwd(*merged, num_slots, save=save)
    out = (split(y, UNITS, H), split(final, BANK, H), split(repeats, UNITS, H))
    if not save:
        return out
    if residuals[0] is not final or any(r is not m for r, m in zip(residuals[1:], merged[1:])):
        raise AssertionError("kernel_path._local_forward: _sdm_kernels_fwd's residuals must start with the final "
                             "bank and the 7 per-token inputs")
    saved = jax.tree_util.tree_leaves(residuals[1 + len(tokens):])
    return out + tuple(split(r, UNITS, H) for r in saved)


def _local_primal(num_slots, *args):
    return _local_forward(False, num_slots, *args)


def _local_saving(num_slots, *args):
    return _local_forward(True, num_slots, *args)


def _local_backward(num_slots, final, dfinal, dy, *rest):
    """One shard's backward (`_sdm_kernels_bwd`): `rest` is the 7 per-token inputs and the saved residuals."""
    H = final.shape[1]
    tokens, saved = rest[:7], rest[7:]
    merged = [merge(a, UNITS) for a in tokens]
    treedef = _saved_treedef(num_slots, [merge(final, BANK)] + merged)
    saved = jax.tree_util.tree_unflatten(treedef, [merge(a, UNITS) for a in saved])
    grads = _sdm_kernels_bwd(num_slots, (merge(final, BANK), *merged, *saved),
                             (merge(dy, UNITS), merge(dfinal, BANK), None))
    dbank, _, *dtokens = grads
    return (split(dbank, BANK, H),) + tuple(split(g, UNITS, H) for g in dtokens if g is not None)


def _saved_treedef(num_slots, merged):
    """The tree structure of the kernels' residuals beyond the inputs (without running anything)."""
    shapes = jax.eval_shape(lambda *a: _sdm_kernels_fwd(*a, num_slots, save=True)[1], *merged)
    return jax.tree_util.tree_structure(shapes[1 + 7:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def stream_kernels(bank, k_idx, k_val, x, v, beta, q_idx, q_val, num_slots, grad_dtype):
    """The op on the kernels with explicit streams: bank `[B, H, K, D]`, per-token arrays `[NC, B, H, C, ...]`
    (int32 ids, float32 values, per-lane gates `x`). `grad_dtype` (a dtype name) is the backward's working
    gradient bank: "float32", or the bank's dtype.

    Returns `(y [NC, B, H, C, D] float32, final_bank [B, H, K, D], repeats [NC, B, H])`. A call that is not
    differentiated saves no residuals. Inside `shard_map` the inputs must vary along the same manual axes; the
    results and the gradients are typed as varying along them (the FFI calls' results carry no such type).
    """
    args = (bank, k_idx, k_val, x, v, beta, q_idx, q_val)
    outs = _kernels_per_stream(_local_primal, num_slots, args, (BANK,) + (UNITS,) * 7, (UNITS, BANK, UNITS))
    return tuple(to_varying(o, varying_axes(*args)) for o in outs)


def _stream_kernels_fwd(bank, k_idx, k_val, x, v, beta, q_idx, q_val, num_slots, grad_dtype):
    args = (bank, k_idx, k_val, x, v, beta, q_idx, q_val)
    n_saved = len(jax.eval_shape(functools.partial(_local_saving, num_slots), *args)) - 3
    y, final, repeats, *saved = _kernels_per_stream(
        _local_saving, num_slots, args, (BANK,) + (UNITS,) * 7, (UNITS, BANK, UNITS) + (UNITS,) * n_saved)
    y, final, repeats = (to_varying(o, varying_axes(*args)) for o in (y, final, repeats))
    return (y, final, repeats), (final, args[1:], tuple(saved))


def _stream_kernels_bwd(num_slots, grad_dtype, residuals, cotangents):
    final, tokens, saved = residuals
    dy, dfinal, _ = cotangents
    args = (final, dfinal.astype(grad_dtype), dy.astype(jnp.float32)) + tokens + saved
    dbank, dk_val, dx, dv, dbeta, dq_val = _kernels_per_stream(
        _local_backward, num_slots, args, (BANK, BANK) + (UNITS,) * (1 + len(tokens) + len(saved)),
        (BANK,) + (UNITS,) * 5)
    dbank, dk_val, dx, dv, dbeta, dq_val = (to_varying(d, varying_axes(final))
                                            for d in (dbank, dk_val, dx, dv, dbeta, dq_val))
    return dbank.astype(final.dtype), None, dk_val, dx, dv, dbeta, None, dq_val


stream_kernels.defvjp(_stream_kernels_fwd, _stream_kernels_bwd)


def sdm_ffi(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims, grad_dtype=None):
    """The op on the FFI kernels, partitioned per stream: `(y [B, T, H, D], final_bank [B, H, K, D], repeats)`.
    `grad_dtype`: the backward's working gradient bank, float32 or (None, the default) the bank's dtype.

    Under a mesh with `Explicit` axes (sharding in types) the body runs with those axes made `Auto` (where
    `custom_partitioning` works) and the results get the shardings of the inputs: `y` like `k_idx`, the final bank
    like `bank` (B like `k_idx` for a shared bank).
    """
    _require_kernels()
    args = (bank, k_idx, k_val, v, beta, g, q_idx, q_val)
    _refuse_forward_mode(args)
    grad_dtype = jnp.dtype(bank.dtype if grad_dtype is None else grad_dtype).name
    run = functools.partial(_sdm_ffi_streams, dims=dims, grad_dtype=grad_dtype)
    explicit = explicit_out_sharding(*args)
    if explicit is not None:
        out_sharding, axes = explicit
        run = jax.sharding.auto_axes(run, axes=axes, out_sharding=out_sharding)
    return run(*args)


def _sdm_ffi_streams(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims, grad_dtype):
    args = layout.stream_arguments(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims)
    # Inside `shard_map`, every input varies along the manual axes along which any does (the results do too); for
    # an input that does not (e.g. a bank shared by the devices) the transpose of this cast sums its gradient.
    axes = varying_axes(*args)
    y, final, repeats = stream_kernels(*(to_varying(a, axes) for a in args), dims.K, grad_dtype)
    return layout.from_stream_units(y, dims).astype(bank.dtype), final, jnp.sum(repeats)
