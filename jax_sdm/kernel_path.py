"""The kernel path of `sdm_write_read` (`impl="ffi"`): the FFI kernels' forward and backward in a custom VJP.

`_sdm_kernels_fwd` / `_sdm_kernels_bwd` run the kernels (`ffi_ops.py`) on the streams `P = B*H` in kernel layout;
`stream_kernels` is the custom VJP around them, with `B` and `H` explicit so that `sharding.per_stream` runs every
shard's streams on its own device (and folds a `vmap` into `B`). `sdm_ffi` is the entry point of `ops.py`.
"""
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.interpreters import ad

from . import ffi_ops, layout, lowering, segments
from .sharding import BANK, UNITS, explicit_out_sharding, merge, per_stream, split, to_varying, varying_axes


def _phase1_slots(k_idx, q_idx, packed, num_slots):
    """Phase 1's slot ids and slot count: the slots, or with packed sequences the virtual ones of
    `segments.virtual_slots` (each segment of a chunk on its own slots)."""
    if packed is None:
        return k_idx, q_idx, num_slots
    local = packed[1]
    return (segments.virtual_slots(k_idx, local, num_slots), segments.virtual_slots(q_idx, local, num_slots),
            segments.virtual_slot_count(num_slots, k_idx.shape[-2]))


# A forward without residuals runs in slabs of chunks of about this many tokens, carrying the bank from one to the
# next: its temporaries (Phase 1's records, the solves, the steps' float32 vectors) are a slab's, whatever T is.
NOGRAD_SLAB_TOKENS = 4096


def _forward_in_slabs(bank, k_idx, k_val, x, v, beta, q_idx, q_val, num_slots, slab):
    """The kernels' forward without residuals (`_sdm_kernels_fwd` with `save=False`, no packed sequences) in slabs
    of `slab` chunks: `(y [NC, P, C, D] in the bank's dtype, final_bank, repeats [NC, P])`, the same bits as one
    call over all chunks (every phase works chunk by chunk). The first slab makes a new final bank (the kernels read
    each row from the input until its first write); the later ones update it in place inside a `lax.scan`, and write
    their readings into the one output array."""
    NC = k_idx.shape[0]
    tokens = (k_idx, k_val, x, v, beta, q_idx, q_val)

    def run(bank, chunks, in_place):
        k_idx, k_val, x, v, beta, q_idx, q_val = chunks
        p1 = ffi_ops.phase1_ffi(k_idx, k_val, x, q_idx, q_val, num_slots)
        minv = ffi_ops.solve_ffi(p1.A, beta)
        final, y = ffi_ops.forward_ffi(bank, k_idx, q_idx, v, beta, p1, minv, False, in_place=in_place)[:2]
        return final, y.astype(bank.dtype), p1.repeats

    final, y0, r0 = run(bank, tuple(a[:slab] for a in tokens), False)
    y = jnp.zeros((NC,) + y0.shape[1:], y0.dtype).at[:slab].set(y0)
    repeats = jnp.zeros((NC,) + r0.shape[1:], r0.dtype).at[:slab].set(r0)

    def body(carry, start):
        final, y, repeats = carry
        chunks = tuple(jax.lax.dynamic_slice_in_dim(a, start, slab) for a in tokens)
        final, y_s, r_s = run(final, chunks, True)
        return (final, jax.lax.dynamic_update_slice_in_dim(y, y_s, start, 0),
                jax.lax.dynamic_update_slice_in_dim(repeats, r_s, start, 0)), None

    full = NC // slab
    starts = jnp.arange(1, full, dtype=jnp.int32) * slab
    (final, y, repeats), _ = jax.lax.scan(body, (final, y, repeats), starts)
    if NC > full * slab:  # the last, partial slab
        final, y_s, r_s = run(final, tuple(a[full * slab:] for a in tokens), True)
        y, repeats = y.at[full * slab:].set(y_s), repeats.at[full * slab:].set(r_s)
    return y, final, repeats


def _sdm_kernels_fwd(bank, k_idx, k_val, x, v, beta, q_idx, q_val, packed, num_slots, save=True,
                     slab_tokens=None):
    """The kernels' forward in kernel layout (bank `[P, K, D]`, tokens `[NC, P, C, ...]`, per-lane gates `x`;
    `packed`: None, or for packed sequences `(seg0 [NC, P], local [NC, P, C], last [P])` of
    `segments.chunk_segments`): `((y [NC, P, C, D] float32, final_bank, repeats [NC, P]), residuals)`.

    `residuals = (banks, units)` are what the backward needs beyond the inputs and the final bank: arrays in bank
    layout `[P, ...]` (with packed sequences the working bank and the stamps, none otherwise) and a tree of arrays
    in unit layout `[NC, P, ...]`. With `save=False` nothing is kept for a backward. `stream_kernels` runs it
    (and `_sdm_kernels_bwd`) per shard inside its custom VJP. Without `save` and packed sequences, a sequence of
    more than `slab_tokens` tokens runs in slabs (`_forward_in_slabs`); `y` is then in the bank's dtype already."""
    slab = max(1, (slab_tokens or NOGRAD_SLAB_TOKENS) // k_idx.shape[-2])
    if not save and packed is None and k_idx.shape[0] > slab:
        return _forward_in_slabs(bank, k_idx, k_val, x, v, beta, q_idx, q_val, num_slots, slab), ((), ())
    p1_k_idx, p1_q_idx, p1_slots = _phase1_slots(k_idx, q_idx, packed, num_slots)
    p1 = ffi_ops.phase1_ffi(p1_k_idx, k_val, x, p1_q_idx, q_val, p1_slots)
    minv = ffi_ops.solve_ffi(p1.A, beta)
    if packed is None:
        final, y, delta, vg, snapshot = ffi_ops.forward_ffi(bank, k_idx, q_idx, v, beta, p1, minv, save)
        banks, stamp_snapshot = (), ()
    else:
        seg0, local, last = packed
        work, y, delta, vg, snapshot, stamp, stamp_snapshot = ffi_ops.forward_ffi(
            bank, k_idx, q_idx, v, beta, p1, minv, save, segments=(bank, local, seg0))
        final = segments.final_bank(work, bank, stamp, last)
        banks, stamp_snapshot = (work, stamp), (stamp_snapshot,)
    return (y, final, p1.repeats), (banks, (p1, minv, delta, vg, snapshot) + stamp_snapshot)


def _sdm_kernels_primal(bank, k_idx, k_val, x, v, beta, q_idx, q_val, packed, num_slots):
    """The forward of a call that is not differentiated, `(y, final_bank, repeats)` as `_sdm_kernels_fwd`'s, with
    `y` in the bank's dtype.

    Lowered for the CPU it is the token recurrence in one kernel (`ffi_ops.token_recurrence_ffi`): a no-grad
    forward needs none of Phase 1, the solves or the snapshots, and on a CPU the tokens in order cost less. For
    other platforms, and for packed sequences, the chunked kernels without residuals.
    """
    def in_bank_dtype(forward):  # both branches' results have one type (the slabs' readings are in it already)
        def run(*args):
            y, final, repeats = forward(*args)
            return y.astype(bank.dtype), final, repeats
        return run

    chunked = in_bank_dtype(lambda *args: _sdm_kernels_fwd(*args, packed, num_slots, save=False)[0])
    args = (bank, k_idx, k_val, x, v, beta, q_idx, q_val)
    if packed is not None:
        return chunked(*args)
    return jax.lax.platform_dependent(*args, cpu=in_bank_dtype(ffi_ops.token_recurrence_ffi), default=chunked)


def _sdm_kernels_bwd(num_slots, inputs, final, residuals, dy, dfinal):
    """The kernels' backward: gradients `(dbank, dk_val, dx, dv, dbeta, dq_val)` of `_sdm_kernels_fwd`'s inputs
    (`inputs`, in its order; the bank may be None without packed sequences: the backward restores it from the
    final bank) from its final bank, `residuals` and the cotangents; `dfinal` `[P, 0, D]` without packed sequences
    is a zero cotangent (`ffi_ops.backward_ffi`)."""
    bank, k_idx, k_val, x, v, beta, q_idx, q_val, packed = inputs
    banks, (p1, minv, delta, vg, snapshot, *stamp_snapshot) = residuals
    steps = (dy, k_idx, q_idx, beta, p1, minv, delta, vg, snapshot)
    if packed is None:
        _, dbank, dk_eff, dw, dcpe, dq_w, dA, dQK, dbeta, dv = ffi_ops.backward_ffi(final, dfinal, *steps)
    else:
        (work, stamp), (stamp_snapshot,), (seg0, local, last) = banks, stamp_snapshot, packed
        # The final bank's rows of the last segment are the working bank's, the others the initial bank's.
        current = (stamp == last[..., None])[..., None]
        zero = jnp.zeros((), dfinal.dtype)
        _, dwork, dk_eff, dw, dcpe, dq_w, dA, dQK, dbeta, dv, dinitial = ffi_ops.backward_ffi(
            work, jnp.where(current, dfinal, zero), *steps,
            segments=(bank, local, seg0, stamp, stamp_snapshot, jnp.where(current, zero, dfinal)))
        dbank = dwork.astype(jnp.float32) + dinitial.astype(jnp.float32)
    p1_k_idx, p1_q_idx, p1_slots = _phase1_slots(k_idx, q_idx, packed, num_slots)
    dk_val, dx, dq_val = ffi_ops.phase1_bwd_ffi(p1_k_idx, k_val, x, p1_q_idx, q_val, p1_slots, p1,
                                                dk_eff, dw, dcpe, dq_w, dA, dQK)
    return dbank.astype(final.dtype), dk_val, dx, dv, dbeta, dq_val


KERNEL_TARGETS = ("sdm_phase1", "sdm_solve", "sdm_forward", "sdm_backward", "sdm_phase1_bwd")
PACKED_TARGETS = ("sdm_forward_packed", "sdm_backward_packed")  # the steps with packed sequences


def kernels_available(packed=False):
    """Whether this backend has every kernel `impl="ffi"` needs (with `packed`, also the packed-sequence steps)."""
    platform = jax.default_backend()
    return all(lowering.is_registered(t, platform) for t in KERNEL_TARGETS + (PACKED_TARGETS if packed else ()))


def _require_kernels(packed=False):
    """Raise before any work if this backend lacks one of the kernels (`impl="ffi"` never falls back)."""
    platform = jax.default_backend()
    missing = [t for t in KERNEL_TARGETS if not lowering.is_registered(t, platform)]
    if missing:
        raise NotImplementedError(
            f"sdm_write_read: impl='ffi' has no {platform} kernels for {', '.join(missing)} in this build; "
            "use impl='xla' (the chunked form in pure JAX) or impl='reference' (the token loop)")
    if packed and not all(lowering.is_registered(t, platform) for t in PACKED_TARGETS):
        raise NotImplementedError(
            f"sdm_write_read: `segment_ids` (packed sequences) with impl='ffi' has no {platform} kernels yet: the "
            "CPU kernels support it, and so do impl='xla' (the chunked form in pure JAX, on every platform; "
            "impl='auto' picks it here) and impl='reference' (the token loop)")


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


def _kernels_per_stream(local_fn, static, args, in_axes, out_axes):
    """`per_stream(local_fn, ...)` with a JVP rule that raises HIGHER_ORDER_ERROR.

    The kernels have no derivatives: a derivative of the custom VJP's forward or backward is a second-order one,
    refused here with a clear message (JAX would say that `custom_partitioning` has no differentiation rule).
    """
    @jax.custom_jvp
    def call(*args):
        return per_stream(local_fn, static, args, in_axes, out_axes)

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


_PACKED_AXES = (UNITS, UNITS, BANK)  # seg0 [NC, B, H], local [NC, B, H, C], last [B, H]


def _input_axes(packed):
    """The B axes of the kernels' inputs: the bank, the 7 per-token arrays, then with packed sequences theirs."""
    return (BANK,) + (UNITS,) * 7 + (_PACKED_AXES if packed else ())


_V = 4  # v's place among the kernels' inputs (bank, k_idx, k_val, x, v, ...)


def _kept(inputs, packed):
    """Of the kernels' inputs (or their axes), those the custom VJP keeps for the backward: not `v` (the backward
    needs only the forward's `v - G`) and, without packed sequences, not the bank (the backward restores it from the
    final bank)."""
    return tuple(a for i, a in enumerate(inputs) if i != _V and (packed or i > 0))


def _kept_axes(packed):
    """The B axes of the inputs that the custom VJP keeps for the backward (`_kept`)."""
    return _kept(_input_axes(packed), packed)


def _kernel_inputs(arrays, packed):
    """`_sdm_kernels_fwd`'s inputs from the flat ones: the bank, the 7 per-token arrays and `packed`."""
    return (*arrays[:8], tuple(arrays[8:]) if packed else None)


def _local_forward(save, static, bank, *tokens):
    """One shard's forward: merge to `P = B*H`, run the kernels (`_sdm_kernels_fwd`), split back. `static` is
    `(num_slots, packed)`; `tokens` the 7 per-token inputs, then with packed sequences theirs.

    Returns `(y, final, repeats)`, then with `save` the kernels' residuals: those in bank layout, then the others
    flattened.
    """
    num_slots, packed = static
    H = bank.shape[1]
    merged = [merge(a, at) for a, at in zip((bank,) + tokens, _input_axes(packed))]
    if save:
        (y, final, repeats), (banks, units) = _sdm_kernels_fwd(*_kernel_inputs(merged, packed), num_slots)
    else:
        y, final, repeats = _sdm_kernels_primal(*_kernel_inputs(merged, packed), num_slots)
    # The readings leave in the bank's dtype (one rounding, as the op's result): their cotangent then comes in that
    # dtype too, which the backward's kernels take as it is (half the bytes of float32 for a bfloat16 bank).
    out = (split(y.astype(bank.dtype), UNITS, H), split(final, BANK, H), split(repeats, UNITS, H))
    if not save:
        return out
    return (out + tuple(split(b, BANK, H) for b in banks)
            + tuple(split(r, UNITS, H) for r in jax.tree_util.tree_leaves(units)))


def _local_primal(static, *args):
    return _local_forward(False, static, *args)


def _local_saving(static, *args):
    return _local_forward(True, static, *args)


def _saved_bank_count(packed):
    """How many of the saved residuals are in bank layout (the working bank and the stamps of packed sequences)."""
    return 2 if packed else 0


def _local_backward(static, final, dfinal, dy, *rest):
    """One shard's backward (`_sdm_kernels_bwd`): `rest` is the kept inputs (`_kept_axes`) and the saved
    residuals; `static` is `(num_slots, packed)`."""
    num_slots, packed = static
    H = final.shape[1]
    kept_axes = _kept_axes(packed)
    kept = [merge(a, at) for a, at in zip(rest, kept_axes)]
    # The kernels' inputs with the bank (without packed sequences, the final bank's shape) and v's shape (dy's) in
    # their places, for the tree of the residuals; the backward reads neither.
    arrays = ([] if packed else [merge(final, BANK)]) + kept
    arrays.insert(_V, jax.ShapeDtypeStruct(merge(dy, UNITS).shape, jnp.float32))
    inputs = _kernel_inputs(arrays, packed)
    rest = rest[len(kept_axes):]
    n_banks = _saved_bank_count(packed)
    units = jax.tree_util.tree_unflatten(_units_treedef(num_slots, inputs),
                                         [merge(a, UNITS) for a in rest[n_banks:]])
    residuals = (tuple(merge(a, BANK) for a in rest[:n_banks]), units)
    inputs = inputs[:_V] + (None,) + inputs[_V + 1:]
    if not packed:
        inputs = (None,) + inputs[1:]
    grads = _sdm_kernels_bwd(num_slots, inputs, merge(final, BANK), residuals, merge(dy, UNITS),
                             merge(dfinal, BANK))
    dbank, *dtokens = grads
    return (split(dbank, BANK, H),) + tuple(split(g, UNITS, H) for g in dtokens)


def _units_treedef(num_slots, inputs):
    """The tree structure of the kernels' residuals in unit layout (without running anything)."""
    shapes = jax.eval_shape(lambda *a: _sdm_kernels_fwd(*a, num_slots, save=True)[1][1], *inputs)
    return jax.tree_util.tree_structure(shapes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def stream_kernels(bank, k_idx, k_val, x, v, beta, q_idx, q_val, packed, num_slots, grad_dtype):
    """The op on the kernels with explicit streams: bank `[B, H, K, D]`, per-token arrays `[NC, B, H, C, ...]`
    (int32 ids, float32 values, per-lane gates `x`). `packed`: None, or for packed sequences
    `(seg0 [NC, B, H], local [NC, B, H, C], last [B, H])` of `segments.chunk_segments` (int32). `grad_dtype` (a
    dtype name) is the backward's working gradient bank: "float32", or the bank's dtype.

    Returns `(y [NC, B, H, C, D] in the bank's dtype, final_bank [B, H, K, D], repeats [NC, B, H])`. A call
    that is not differentiated saves no residuals. Inside `shard_map` the inputs must vary along the same manual
    axes; the results and the gradients are typed as varying along them (the FFI calls' results carry no such
    type).
    """
    args = (bank, k_idx, k_val, x, v, beta, q_idx, q_val) + (packed or ())
    static = (num_slots, packed is not None)
    outs = _kernels_per_stream(_local_primal, static, args, _input_axes(packed is not None), (UNITS, BANK, UNITS))
    return tuple(to_varying(o, varying_axes(*args)) for o in outs)


def _stream_kernels_fwd(bank, k_idx, k_val, x, v, beta, q_idx, q_val, packed, num_slots, grad_dtype):
    # symbolic_zeros: the inputs come as CustomVJPPrimal (value, perturbed)
    bank, k_idx, k_val, x, v, beta, q_idx, q_val, packed = jax.tree_util.tree_map(
        lambda a: a.value, (bank, k_idx, k_val, x, v, beta, q_idx, q_val, packed),
        is_leaf=lambda a: isinstance(a, CustomVJPPrimal))
    args = (bank, k_idx, k_val, x, v, beta, q_idx, q_val) + (packed or ())
    static = (num_slots, packed is not None)
    n_saved = len(jax.eval_shape(functools.partial(_local_saving, static), *args)) - 3
    n_banks = _saved_bank_count(packed is not None)
    y, final, repeats, *saved = _kernels_per_stream(
        _local_saving, static, args, _input_axes(packed is not None),
        (UNITS, BANK, UNITS) + (BANK,) * n_banks + (UNITS,) * (n_saved - n_banks))
    y, final, repeats = (to_varying(o, varying_axes(*args)) for o in (y, final, repeats))
    return (y, final, repeats), (final, _kept(args, packed is not None), tuple(saved))


def _stream_kernels_bwd(num_slots, grad_dtype, residuals, cotangents):
    final, kept, saved = residuals
    packed = len(kept) > 6  # `_kept`: 6 per-token inputs; with packed sequences also the bank and their 3 arrays
    dy, dfinal, _ = cotangents
    # A loss of the readings only gives the final bank a symbolic zero cotangent: without packed sequences it goes
    # to the kernels as an empty [B, H, 0, D] array (no bank-sized buffer of zeros; the backward reads zero rows).
    if isinstance(dfinal, SymbolicZero):
        shape = dfinal.shape if packed else dfinal.shape[:-2] + (0, dfinal.shape[-1])
        dfinal = jnp.zeros(shape, grad_dtype)
    dy = jnp.zeros(dy.shape, dy.dtype) if isinstance(dy, SymbolicZero) else dy
    args = (final, dfinal.astype(grad_dtype), dy) + kept + saved  # dy: the readings' dtype, the bank's
    n_banks = _saved_bank_count(packed)
    in_axes = ((BANK, BANK, UNITS) + _kept_axes(packed) + (BANK,) * n_banks
               + (UNITS,) * (len(saved) - n_banks))
    dbank, dk_val, dx, dv, dbeta, dq_val = _kernels_per_stream(
        _local_backward, (num_slots, packed), args, in_axes, (BANK,) + (UNITS,) * 5)
    dbank, dk_val, dx, dv, dbeta, dq_val = (to_varying(d, varying_axes(final))
                                            for d in (dbank, dk_val, dx, dv, dbeta, dq_val))
    return dbank.astype(final.dtype), None, dk_val, dx, dv, dbeta, None, dq_val, None


stream_kernels.defvjp(_stream_kernels_fwd, _stream_kernels_bwd, symbolic_zeros=True)


def sdm_ffi(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims, grad_dtype=None, seg=None):
    """The op on the FFI kernels, partitioned per stream: `(y [B, T, H, D], final_bank [B, H, K, D], repeats)`.
    `grad_dtype`: the backward's working gradient bank, float32 or (None, the default) the bank's dtype. `seg`:
    the tokens' segment counters of packed sequences (`segments.segment_numbers`, padding already dropped), or
    None.

    Under a mesh with `Explicit` axes (sharding in types) the body runs with those axes made `Auto` (where
    `custom_partitioning` works) and the results get the shardings of the inputs: `y` like `k_idx`, the final bank
    like `bank` (B like `k_idx` for a shared bank).
    """
    _require_kernels(packed=seg is not None)
    args = (bank, k_idx, k_val, v, beta, g, q_idx, q_val)
    _refuse_forward_mode(args)
    grad_dtype = jnp.dtype(bank.dtype if grad_dtype is None else grad_dtype).name
    run = functools.partial(_sdm_ffi_streams, dims=dims, grad_dtype=grad_dtype)
    explicit = explicit_out_sharding(*args)
    if explicit is not None:
        out_sharding, axes = explicit
        run = jax.sharding.auto_axes(run, axes=axes, out_sharding=out_sharding)
    return run(*args, seg)


def _sdm_ffi_streams(bank, k_idx, k_val, v, beta, g, q_idx, q_val, seg, dims, grad_dtype):
    args = layout.stream_arguments(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims)
    packed = None if seg is None else segments.chunk_segments(seg, dims, layout.to_stream_units)
    # Inside `shard_map`, every input varies along the manual axes along which any does (the results do too); for
    # an input that does not (e.g. a bank shared by the devices) the transpose of this cast sums its gradient.
    axes = varying_axes(*args, *(packed or ()))
    vary = lambda arrays: tuple(to_varying(a, axes) for a in arrays)
    y, final, repeats = stream_kernels(*vary(args), packed and vary(packed), dims.K, grad_dtype)
    return layout.from_stream_units(y, dims), final, jnp.sum(repeats)  # y is in the bank's dtype already
