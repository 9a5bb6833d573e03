"""The kernel path of `sdm_write_read` (`impl="ffi"`): the FFI kernels' forward and backward in a custom VJP.

`_sdm_kernels_fwd` / `_sdm_kernels_bwd` run the kernels (`ffi_ops.py`) on the streams `P = B*H` in kernel layout;
`stream_kernels` is the custom VJP around them, with `B` and `H` explicit so that `sharding.per_stream` runs every
shard's streams on its own device (and folds a `vmap` into `B`). `sdm_ffi` is the entry point of `ops.py`. The
inputs, the saved residuals and the gradients travel as named tuples; where `per_stream` needs flat arrays each
array's `B` axis follows from its field's name (`_flatten`).
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.interpreters import ad

from . import ffi_ops, layout, lowering, segments
from .layout import Phase1
from .sharding import (BANK, HEADS, TOKENS, UNITS, explicit_out_sharding, merge, per_stream, split, stream_axes_of,
                       to_varying, varying_axes)


class Packed(NamedTuple):
    """Packed sequences as the kernels take them (`segments.chunk_segments`, int32): the segment running at each
    chunk's start `seg0 [NC, P]`, each token's segment counted from it `local [NC, P, C]`, and each stream's last
    segment `last [P]` (with explicit streams `P` is `B, H`)."""
    seg0: jax.Array
    local: jax.Array
    last: jax.Array


class Inputs(NamedTuple):
    """The kernels' inputs: the bank `[P, K, D]` (or, without packed sequences, `[H, K, D]` shared by the batch)
    and per-token arrays `[NC, P, C, ...]` in kernel layout (int32 ids, float32 values, per-lane gates `x`; with
    explicit streams `P` is `B, H`), and `packed`: a `Packed`, or None without packed sequences. The backward keeps
    them without `v` (it needs only the forward's `v - G`): None there."""
    bank: jax.Array | None
    k_idx: jax.Array
    k_val: jax.Array
    x: jax.Array
    v: jax.Array | None
    beta: jax.Array
    q_idx: jax.Array
    q_val: jax.Array
    packed: Packed | None


class PackedSaved(NamedTuple):
    """What the forward saves with packed sequences: the final stamps (bank layout) and the stamps' snapshot (unit
    layout)."""
    stamp: jax.Array
    stamp_snapshot: jax.Array


class Saved(NamedTuple):
    """What the kernels' backward needs beyond the inputs (unit layout `[NC, P, ...]`): no bank, since the backward
    reads each row as it was before a chunk from the snapshot through the links, or from the input bank."""
    p1: Phase1
    minv: jax.Array
    delta: jax.Array
    vg: jax.Array
    snapshot: jax.Array
    snapshot_scale: jax.Array
    link_k: jax.Array
    link_q: jax.Array
    packed: PackedSaved | None


class Grads(NamedTuple):
    """Gradients of the float inputs of `Inputs`."""
    bank: jax.Array
    k_val: jax.Array
    x: jax.Array
    v: jax.Array
    beta: jax.Array
    q_val: jax.Array


# Fields whose arrays are in bank layout (`[P, ...]`, or `[B, H, ...]`) and, outside the kernels, per-token arrays
# in the public layout (`[B, T, H, ...]`); every other array is in unit layout (`[NC, P, ...]`): the B and H axes
# `per_stream` and `merge` / `split` need (sharding.BANK, sharding.TOKENS, sharding.UNITS).
_BANK_FIELDS = frozenset({"bank", "last", "stamp", "dfinal"})
_TOKEN_FIELDS = frozenset({"k_idx", "k_val", "x", "v", "beta", "q_idx", "q_val", "dy"})


def _flatten(tree):
    """`(arrays, axes, treedef)`: the arrays of a tree of named tuples, each one's B and H axes (by the name of its
    field: `_BANK_FIELDS`, `_TOKEN_FIELDS`, else units; an input bank `[H, K, D]` is one shared by the batch,
    `HEADS`) and the tree's structure. (A shard's merged arrays, `[P, K, D]` and the like, are flattened only to be
    split again by the axes of their kind.)"""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)

    def axes_of(name, a):
        if name == "bank" and a.ndim == 3:
            return HEADS
        return BANK if name in _BANK_FIELDS else TOKENS if name in _TOKEN_FIELDS else UNITS

    axes = tuple(axes_of(path[-1].name, a) for path, a in leaves)
    return tuple(a for _, a in leaves), axes, treedef


def _per_stream_bank(bank, dims):
    """A shard's bank `[P, K, D]` (`P = B*H`) from a shared `[H, K, D]` one, stream `b*H + h` starting from head
    `h`; a bank per stream as it is."""
    if bank.shape[0] == dims.B * dims.H:
        return bank
    return merge(layout.batch_banks(bank, dims), 0)


def _phase1_slots(k_idx, q_idx, packed, num_slots):
    """Phase 1's slot ids and slot count: the slots, or with packed sequences the virtual ones of
    `segments.virtual_slots` (each segment of a chunk on its own slots)."""
    if packed is None:
        return k_idx, q_idx, num_slots
    return (segments.virtual_slots(k_idx, packed.local, num_slots),
            segments.virtual_slots(q_idx, packed.local, num_slots),
            segments.virtual_slot_count(num_slots, k_idx.shape[-2]))


# A forward without residuals runs in slabs of about this many tokens, carrying the bank from one to the next: its
# temporaries (the slab's arrays in kernel layout, Phase 1's records, the solves, the float32 readings) are a slab's,
# whatever T is.
NOGRAD_SLAB_TOKENS = 4096


def _kernel_inputs(inputs, dims):
    """`inputs` (one shard's `Inputs` as `_local` gives them: the bank `[P, K, D]` or None, per-token arrays in the
    public layout `[B, T, H, ...]`) with the per-token arrays in kernel layout; `dims` with the shard's `B`, `H`
    and `T`."""
    per_token = layout.kernel_tokens(inputs.k_idx, inputs.k_val, inputs.x, inputs.v, inputs.beta, inputs.q_idx,
                                     inputs.q_val, dims)
    return Inputs(inputs.bank, *per_token, inputs.packed)


def _sdm_kernels_primal(bank, tokens, dims, slab_tokens, in_place=False):
    """The forward of a call that is not differentiated, without packed sequences, on one shard: the bank `[P, K, D]`
    and the per-token arrays of `tokens` (an `Inputs`) in the public layout `[B, T, H, ...]` as the op got them.
    Returns `(y [B, T, H, D] in the bank's dtype, final_bank [P, K, D], repeats [P])`; with `in_place` the final
    bank aliases `bank` (a bank per stream; a shared one is broadcast first).

    Lowered for the CPU it is the token recurrence in one kernel (`ffi_ops.token_recurrence_ffi`) on those arrays
    as they are: a no-grad forward needs none of Phase 1, the solves or the snapshots, on a CPU the tokens in order
    cost less, and nothing is laid out or widened (no temporaries beyond the results). For other platforms, the
    chunked kernels without residuals in slabs of `slab_tokens` tokens (`_forward_in_slabs`).
    """
    per_token = (tokens.k_idx, tokens.k_val, tokens.x, tokens.v, tokens.beta, tokens.q_idx, tokens.q_val)
    H = dims.H
    ids = lambda i: i if i.dtype == jnp.int32 else layout.slot_ids(i, dims.K)  # the kernel ignores ids outside [0, K)

    def recurrence(bank, k_idx, k_val, x, v, beta, q_idx, q_val):
        bank = _per_stream_bank(bank, dims)
        y, final, repeats = ffi_ops.token_recurrence_ffi(split(bank, 0, H), ids(k_idx), k_val, x, v, beta,
                                                         ids(q_idx), q_val, in_place=in_place)
        return y, merge(final, 0), merge(repeats, 0)

    def chunked(bank, *per_token):
        return _forward_in_slabs(bank, Inputs(None, *per_token, None), dims, slab_tokens, in_place)

    return jax.lax.platform_dependent(bank, *per_token, cpu=recurrence, default=chunked)


def _forward_in_slabs(bank, tokens, dims, slab_tokens, in_place=False):
    """The chunked kernels' forward without residuals (no packed sequences) on one shard (bank `[P, K, D]`, `tokens`
    an `Inputs` with per-token arrays `[B, T, H, ...]`) in slabs of `slab_tokens` tokens (whole chunks), each laid
    out for the kernels on its own: `(y [B, T, H, D] in the bank's dtype, final_bank [P, K, D], repeats [P])`, the
    same bits as the forward that keeps residuals (every phase works chunk by chunk). The slabs make one fresh final
    bank (`ffi_ops.ForwardSlab`): the first slab makes it, the later ones update it in place inside a `lax.scan`;
    the kernels read each row from the input bank until its first write in any slab, and the last slab copies the
    rows no slab wrote. With `in_place` every slab updates `bank` itself (aliased; a shared bank is broadcast
    first): no row is copied. The slabs write their readings into the one output array."""
    T = dims.T
    slab = min(T, max(1, slab_tokens // dims.C) * dims.C)
    per_token = tokens._replace(bank=None, packed=None)
    if in_place:
        bank = _per_stream_bank(bank, dims)

    def run(start, T_slab, carry=None, first=None, last=True, one=False):
        cut = jax.tree_util.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, T_slab, 1), per_token)
        inputs = _kernel_inputs(cut._replace(bank=bank), dims._replace(T=T_slab))
        p1 = ffi_ops.phase1_ffi(inputs.k_idx, inputs.k_val, inputs.x, inputs.q_idx, inputs.q_val, dims.K)
        minv = ffi_ops.solve_ffi(p1.A, inputs.beta)
        forward = functools.partial(ffi_ops.forward_ffi, k_idx=inputs.k_idx, q_idx=inputs.q_idx, v=inputs.v,
                                    beta=inputs.beta, p1=p1, minv=minv, save=False)
        if in_place:  # the bank the previous slab updated (the input for the first), updated again
            out = forward(bank if carry is None else carry, in_place=True)
        else:
            out = forward(inputs.bank, slab=None if one else ffi_ops.ForwardSlab(carry, first, last))
        y = layout.from_units(out.y, dims._replace(T=T_slab))
        return out.bank, out.first, y, jnp.sum(p1.repeats, axis=0, dtype=jnp.int32)

    if slab == T:
        final, _, y, repeats = run(0, T, one=True)
        return y, final, repeats
    final, first, y0, repeats = run(0, slab, last=False)
    y = jnp.zeros((dims.B, T, dims.H, dims.D), y0.dtype).at[:, :slab].set(y0)

    def body(carry, start):
        final, first, y, repeats = carry
        final, first, y_s, r_s = run(start, slab, final, first, last=False)
        return (final, first, jax.lax.dynamic_update_slice_in_dim(y, y_s, start, 1), repeats + r_s), None

    slabs = -(-T // slab)
    if slabs > 2:  # the slabs between the first and the last
        # Their starts from `iota`, not a constant array: the body of a `custom_partitioning` may hold no constants
        # (jax 0.8 refuses them).
        starts = (jax.lax.iota(jnp.int32, slabs - 2) + 1) * slab
        (final, first, y, repeats), _ = jax.lax.scan(body, (final, first, y, repeats), starts)
    last = (slabs - 1) * slab  # the last slab, whole or partial
    final, _, y_s, r_s = run(last, T - last, final, first)
    return y.at[:, last:].set(y_s), final, repeats + r_s


def _sdm_kernels_fwd(inputs, num_slots, save=True, snapshot_code=0):
    """The kernels' forward on `Inputs` in kernel layout (bank `[P, K, D]`): `((y [NC, P, C, D] in the bank's dtype,
    final_bank, repeats [NC, P]), saved)`, `saved` the `Saved` residuals for the backward (None with `save=False`),
    the snapshot stored as `snapshot_code` says (`ffi_ops.SNAPSHOT_CODES`).
    `stream_kernels` runs it (and `_sdm_kernels_bwd`) per shard inside its custom VJP."""
    bank, packed = inputs.bank, inputs.packed
    p1_k_idx, p1_q_idx, p1_slots = _phase1_slots(inputs.k_idx, inputs.q_idx, packed, num_slots)
    p1 = ffi_ops.phase1_ffi(p1_k_idx, inputs.k_val, inputs.x, p1_q_idx, inputs.q_val, p1_slots)
    minv = ffi_ops.solve_ffi(p1.A, inputs.beta)
    steps = (inputs.k_idx, inputs.q_idx, inputs.v, inputs.beta, p1, minv, save)
    if packed is None:
        out = ffi_ops.forward_ffi(bank, *steps, snapshot_code=snapshot_code)
        final, packed_saved = out.bank, None
    else:
        out = ffi_ops.forward_ffi(bank, *steps, segments=ffi_ops.ForwardSegments(bank, packed.local, packed.seg0),
                                  snapshot_code=snapshot_code)
        final = segments.final_bank(out.bank, bank, out.stamp, packed.last)
        packed_saved = PackedSaved(out.stamp, out.stamp_snapshot)
    saved = (Saved(p1, minv, out.delta, out.vg, out.snapshot, out.snapshot_scale, out.link_k, out.link_q,
                   packed_saved) if save else None)
    return (out.y, final, p1.repeats), saved


def _sdm_kernels_bwd(num_slots, inputs, saved, dy, dfinal, snapshot_code=0):
    """The kernels' backward: the `Grads` of `_sdm_kernels_fwd`'s inputs (`inputs`, whose `v` may be None) from its
    `Saved` residuals (the snapshot stored as `snapshot_code` says) and the cotangents; `dfinal` `[P, 0, D]` without
    packed sequences is a zero cotangent (`ffi_ops.backward_ffi`). The bank's gradient is per stream `[P, K, D]`."""
    packed, p1 = inputs.packed, saved.p1
    steps = (dy, inputs.k_idx, inputs.q_idx, inputs.beta, p1, saved.minv, saved.delta, saved.vg, saved.snapshot,
             saved.snapshot_scale, saved.link_k, saved.link_q, snapshot_code)
    if packed is None:
        out = ffi_ops.backward_ffi(inputs.bank, dfinal, *steps)
        dbank = out.dbank
    else:
        stamp = saved.packed.stamp
        # The final bank's rows of the last segment are the working bank's, the others the initial bank's.
        current = (stamp == packed.last[..., None])[..., None]
        zero = jnp.zeros((), dfinal.dtype)
        segs = ffi_ops.BackwardSegments(inputs.bank, packed.local, packed.seg0, stamp, saved.packed.stamp_snapshot,
                                        jnp.where(current, zero, dfinal))
        out = ffi_ops.backward_ffi(inputs.bank, jnp.where(current, dfinal, zero), *steps, segments=segs)
        dbank = out.dbank.astype(jnp.float32) + out.dinitial.astype(jnp.float32)
    p1_k_idx, p1_q_idx, p1_slots = _phase1_slots(inputs.k_idx, inputs.q_idx, packed, num_slots)
    dk_val, dx, dq_val = ffi_ops.phase1_bwd_ffi(p1_k_idx, inputs.k_val, inputs.x, p1_q_idx, inputs.q_val, p1_slots,
                                                p1, out.dk_eff, out.dw, out.dcpe, out.dq_w, out.dA, out.dQK)
    return Grads(dbank.astype(inputs.bank.dtype), dk_val, dx, out.dv, out.dbeta, dq_val)


# The FFI targets the kernel path calls (ffi/targets.h).
KERNEL_TARGETS = ("sdm_phase1", "sdm_solve", "sdm_forward", "sdm_backward", "sdm_forward_packed",
                  "sdm_forward_slab", "sdm_backward_packed", "sdm_phase1_bwd")


def kernels_available():
    """Whether this backend has every kernel `impl="ffi"` needs."""
    platform = jax.default_backend()
    return all(lowering.is_registered(t, platform) for t in KERNEL_TARGETS)


def _require_kernels():
    """Raise before any work if this backend lacks one of the kernels (`impl="ffi"` never falls back)."""
    platform = jax.default_backend()
    missing = [t for t in KERNEL_TARGETS if not lowering.is_registered(t, platform)]
    if missing:
        built = "" if lowering.HAS_CPU_MODULE else (
            " (the extension modules are not built: `pip install --no-build-isolation .` builds them)")
        raise NotImplementedError(
            f"sdm_write_read: impl='ffi' has no {platform} kernels for {', '.join(missing)} in this build{built}; "
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


# ------------------------------------------------------------------------------------------------------------------
# The kernels per stream, with explicit B and H, in a custom VJP


def _local(static, arrays):
    """One shard's tree (`static`'s structure) of `arrays`, with `B, H` merged into `P = B*H` in every array but the
    per-token ones in the public layout, and the `Dims` of the shard (its `B` and `H`)."""
    dims, _, treedef, axes, _, _ = static
    tree = jax.tree_util.tree_unflatten(treedef, arrays)
    B, _, H = _tokens_of(tree).k_idx.shape[:3]
    merged = [a if at in (TOKENS, HEADS) else merge(a, at[0])
              for a, at in ((a, stream_axes_of(at, a.ndim)) for a, at in zip(arrays, axes))]
    return jax.tree_util.tree_unflatten(treedef, merged), dims._replace(B=B, H=H)


def _tokens_of(tree):
    return tree if isinstance(tree, Inputs) else tree.kept


def _local_forward(save, static, *arrays):
    """One shard's forward on the arrays of an `Inputs` (bank `[B, H, K, D]`, per-token arrays `[B, T, H, ...]`):
    lay the tokens out for the kernels and run them (`_sdm_kernels_fwd`), or without `save` and packed sequences
    run the no-grad forward (`_sdm_kernels_primal`). `static` is `(dims, slab_tokens, treedef, axes, snapshot_code,
    in_place)` (`_flatten`; `snapshot_code`: how the snapshot is stored, `ffi_ops.SNAPSHOT_CODES`; `in_place`: the
    no-grad forward's final bank aliases the bank).

    Returns `(y [B, T, H, D] in the bank's dtype, final [B, H, K, D], repeats [B, H])`, then with `save` the arrays
    of the kernels' `Saved` residuals (`_flatten`).
    """
    tree, dims = _local(static, arrays)
    if save or tree.packed is not None:
        (y, final, repeats), saved = _sdm_kernels_fwd(_kernel_inputs(tree, dims), dims.K, save, static[4])
        # The readings leave the kernels in the bank's dtype (one rounding, the op's result): their cotangent then
        # comes in that dtype too, which the backward's kernels take as it is (half the bytes of float32 for bfloat16).
        y = layout.from_units(y, dims)
        repeats = jnp.sum(repeats, axis=0, dtype=jnp.int32)
    else:
        (y, final, repeats), saved = _sdm_kernels_primal(tree.bank, tree, dims, static[1], static[5]), None
    out = (y, split(final, 0, dims.H), split(repeats, 0, dims.H))
    if not save:
        return out
    saved_arrays, saved_axes, _ = _flatten(saved)
    return out + tuple(split(a, at[0], dims.H) for a, at in zip(saved_arrays, saved_axes))


def _local_primal(static, *arrays):
    return _local_forward(False, static, *arrays)


def _local_saving(static, *arrays):
    return _local_forward(True, static, *arrays)


class BackwardArgs(NamedTuple):
    """The arrays of one shard's backward: the cotangents and the residuals of the custom VJP."""
    dfinal: jax.Array
    dy: jax.Array
    kept: Inputs
    saved: Saved


def _local_backward(static, *arrays):
    """One shard's backward (`_sdm_kernels_bwd`) on the arrays of a `BackwardArgs` (the readings' cotangent `dy`
    and the kept inputs in the public layout); `static` as `_local_forward`'s. Returns the gradients of the bank
    `[B, H, K, D]` and of the float per-token inputs, in the public layout and in their dtypes."""
    args, dims = _local(static, arrays)
    kept = _kernel_inputs(args.kept, dims)
    grads = _sdm_kernels_bwd(dims.K, kept, args.saved, layout.to_units(args.dy, dims), args.dfinal, static[4])
    public = lambda g, like, per_lane=True: layout.tokens_from_units(g, dims, like.dtype, per_lane)
    tokens = args.kept
    return (split(grads.bank, 0, dims.H), public(grads.k_val, tokens.k_val),
            public(grads.x, tokens.x, dims.per_write_gates), public(grads.v, args.dy), public(grads.beta, tokens.beta),
            public(grads.q_val, tokens.q_val))


def _saved_structure(static, arrays):
    """The structure and the B, H axes (`_flatten`) of the kernels' `Saved` residuals for these `Inputs` arrays,
    without running anything."""
    def saved(*arrays):
        tree, dims = _local(static, arrays)
        return _sdm_kernels_fwd(_kernel_inputs(tree, dims), dims.K, True, static[4])[1]

    _, saved_axes, saved_def = _flatten(jax.eval_shape(saved, *arrays))
    return saved_def, saved_axes


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def stream_kernels(inputs, dims, grad_dtype, slab_tokens, snapshot_code=0, in_place=False):
    """The op on the kernels with explicit streams: `Inputs` with the bank `[B, H, K, D]` and per-token arrays in
    the public layout `[B, T, H, ...]` (int32 ids, the values in the bank's dtype, float32 `beta` and gates `x`,
    per token or per lane as `dims.per_write_gates` says; `packed`: None, or a `Packed` of
    `segments.chunk_segments`, int32, in stream units). `grad_dtype` (a dtype name) is the backward's working
    gradient bank: "float32", or the bank's dtype. A call that is not differentiated runs in slabs of
    `slab_tokens` tokens (without packed sequences) and saves no residuals; with `in_place` its final bank aliases
    the bank (a differentiated call keeps the bank for the backward and ignores it). `snapshot_code`: how the
    forward stores the snapshot for the backward (`ffi_ops.SNAPSHOT_CODES`).

    Returns `(y [B, T, H, D] in the bank's dtype, final_bank [B, H, K, D], repeats [B, H])`. Inside `shard_map`
    the inputs must vary along the same manual axes; the results and the gradients are typed as varying along them
    (the FFI calls' results carry no such type).
    """
    arrays, axes, treedef = _flatten(inputs)
    outs = _kernels_per_stream(_local_primal, (dims, slab_tokens, treedef, axes, snapshot_code, in_place), arrays,
                               axes, (TOKENS, BANK, BANK))
    return tuple(to_varying(o, varying_axes(*arrays)) for o in outs)


def _stream_kernels_fwd(inputs, dims, grad_dtype, slab_tokens, snapshot_code, in_place):
    # symbolic_zeros: the inputs come as CustomVJPPrimal (value, perturbed)
    inputs = jax.tree_util.tree_map(lambda a: a.value, inputs, is_leaf=lambda a: isinstance(a, CustomVJPPrimal))
    arrays, axes, treedef = _flatten(inputs)
    static = (dims, slab_tokens, treedef, axes, snapshot_code, False)
    saved_def, saved_axes = _saved_structure(static, arrays)
    y, final, repeats, *saved = _kernels_per_stream(_local_saving, static, arrays, axes,
                                                    (TOKENS, BANK, BANK) + saved_axes)
    y, final, repeats = (to_varying(o, varying_axes(*arrays)) for o in (y, final, repeats))
    # The backward needs no v (only the forward's v - G) and no final bank (the input bank, the snapshot and the
    # links give every row it reads).
    kept = inputs._replace(v=None)
    return (y, final, repeats), (kept, jax.tree_util.tree_unflatten(saved_def, saved))


def _stream_kernels_bwd(dims, grad_dtype, slab_tokens, snapshot_code, in_place, residuals, cotangents):
    kept, saved = residuals
    packed = kept.packed is not None
    dy, dfinal, _ = cotangents
    # A loss of the readings only gives the final bank a symbolic zero cotangent: without packed sequences it goes
    # to the kernels as an empty [B, H, 0, D] array (no bank-sized buffer of zeros; the backward reads zero rows).
    if isinstance(dfinal, SymbolicZero):
        shape = dfinal.shape if packed else dfinal.shape[:-2] + (0, dfinal.shape[-1])
        dfinal = jnp.zeros(shape, grad_dtype)
    dy = jnp.zeros(dy.shape, dy.dtype) if isinstance(dy, SymbolicZero) else dy  # the readings' dtype, the bank's
    arrays, axes, treedef = _flatten(BackwardArgs(dfinal.astype(grad_dtype), dy, kept, saved))
    grads = _kernels_per_stream(_local_backward, (dims, slab_tokens, treedef, axes, snapshot_code, False), arrays,
                                axes, (BANK,) + (TOKENS,) * 5)
    grads = Grads(*(to_varying(g, varying_axes(*jax.tree_util.tree_leaves(kept))) for g in grads))
    dbank = grads.bank.astype(kept.bank.dtype)
    if not packed and dims.shared_bank:  # a bank shared by the batch: the sum of its streams' gradients
        dbank = layout.ordered_sum(dbank, 0)
    return (Inputs(dbank, None, grads.k_val, grads.x, grads.v, grads.beta, None, grads.q_val, None),)


stream_kernels.defvjp(_stream_kernels_fwd, _stream_kernels_bwd, symbolic_zeros=True)


def sdm_ffi(bank, k_idx, k_val, v, beta, g, q_idx, q_val, dims, grad_dtype=None, seg=None,
            slab_tokens=NOGRAD_SLAB_TOKENS, snapshot_code=0, in_place=False):
    """The op on the FFI kernels, partitioned per stream: `(y [B, T, H, D], final_bank [B, H, K, D], repeats)`.
    `grad_dtype`: the backward's working gradient bank, float32 or (None, the default) the bank's dtype. `seg`:
    the tokens' segment counters of packed sequences (`segments.segment_numbers`, padding already dropped), or
    None. `slab_tokens`: the tokens per slab of a call that is not differentiated (`_forward_in_slabs`).
    `snapshot_code`: how the forward stores the snapshot for the backward (`ffi_ops.SNAPSHOT_CODES`). `in_place`:
    the final bank of a call that is not differentiated aliases `bank` (`stream_kernels`).

    Under a mesh with `Explicit` axes (sharding in types) the body runs with those axes made `Auto` (where
    `custom_partitioning` works) and the results get the shardings of the inputs: `y` like `k_idx`, the final bank
    like `bank` (B like `k_idx` for a shared bank).
    """
    _require_kernels()
    args = (bank, k_idx, k_val, v, beta, g, q_idx, q_val)
    _refuse_forward_mode(args)
    grad_dtype = jnp.dtype(bank.dtype if grad_dtype is None else grad_dtype).name
    run = functools.partial(_sdm_ffi_streams, dims=dims, grad_dtype=grad_dtype, slab_tokens=slab_tokens,
                            snapshot_code=snapshot_code, in_place=in_place)
    explicit = explicit_out_sharding(*args)
    if explicit is not None:
        out_sharding, axes = explicit
        run = jax.sharding.auto_axes(run, axes=axes, out_sharding=out_sharding)
    return run(*args, seg)


def _sdm_ffi_streams(bank, k_idx, k_val, v, beta, g, q_idx, q_val, seg, dims, grad_dtype, slab_tokens, snapshot_code,
                     in_place):
    packed = None if seg is None else Packed(*segments.chunk_segments(seg, dims, layout.to_stream_units))
    # Without packed sequences the kernels read a shared `[H, K, D]` bank as it is (no `[B, H, K, D]` broadcast
    # first); the backward sums its gradient over the batch (`_stream_kernels_bwd`).
    inputs = Inputs(bank if packed is None else layout.batch_banks(bank, dims), k_idx, k_val, g, v, beta, q_idx,
                    q_val, packed)
    # Inside `shard_map`, every input varies along the manual axes along which any does (the results do too); for
    # an input that does not (e.g. a bank shared by the devices) the transpose of this cast sums its gradient.
    axes = varying_axes(*jax.tree_util.tree_leaves(inputs))
    y, final, repeats = stream_kernels(jax.tree_util.tree_map(lambda a: to_varying(a, axes), inputs), dims,
                                       grad_dtype, slab_tokens, snapshot_code, in_place)
    return y, final, jnp.sum(repeats)
