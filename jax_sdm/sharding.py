"""Per-stream partitioning of the kernel path (`kernel_path.py`) on inputs sharded along batch and/or heads:
every device runs its own streams. This module knows nothing of the kernels.

Streams (batch element x head) are independent, so under `jax.jit` with inputs sharded along `B` and/or `H` nothing
needs to move between devices. The FFI custom calls have no partitioning rule of their own (XLA would replicate their
operands, i.e. all-gather the bank), so the three bodies of the kernel path -- the primal, the forward that keeps
residuals, and the backward -- are `jax.experimental.custom_partitioning` functions of arrays whose `B` and `H`
axes are explicit:

- bank-like arrays `[B, H, K, D]` (the bank, its cotangent and gradient; `BANK`);
- per-token arrays in the public layout `[B, T, H, ...]` (`TOKENS`), or in units `[NC, B, H, C, ...]` (`UNITS`).

The kernels' `P = B*H` streams exist only inside the per-shard lowering, where the local `B` and `H` are merged
(merging them outside would hide an `H` sharding inside the merged dim). Only `B` and `H` may be sharded: the
sharding rule (Shardy) gives them one factor each, shared by every operand and result, and marks every other dim
as needing replication; the partition callback (XLA's SPMD partitioner) keeps each operand's `B` / `H` sharding and
replicates the rest, so XLA reshards an input that is sharded along another axis. A shared `[H, K, D]` bank
(`HEADS`) has no `B` factor: every shard of the batch gets it whole; its gradient is the sum over the batch, the
one collective.

A `custom_vmap` folds a vmapped axis into `B`: still one kernel call, never a loop (DESIGN.md "Leading batch dims").
"""
import functools

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from . import layout

# Where an array's B and H axes are: `[B, H, K, D]`, `[NC, B, H, C, ...]`, `[B, T, H, ...]`; `HEADS`: a bank that
# every batch element shares, `[H, K, D]` (no B axis; once `vmap` maps it, `[B, H, K, D]` like `BANK`).
BANK, UNITS, TOKENS, HEADS = (0, 1), (1, 2), (0, 2), (None, 0)


def stream_axes_of(at, rank):
    """The B and H axes of an array of rank `rank` whose kind is `at` (a `HEADS` array of rank 4 is a `BANK` one)."""
    return BANK if at == HEADS and rank == 4 else at


# ------------------------------------------------------------------------------------------------------------------
# Layout: `[B, T, H, ...]` <-> `[NC, B, H, C, ...]`


def merge(a, at):
    """`[..., B, H, ...]` -> `[..., B*H, ...]` with `B` at axis `at`."""
    return a.reshape(a.shape[:at] + (a.shape[at] * a.shape[at + 1],) + a.shape[at + 2:])


def split(a, at, H):
    """`[..., B*H, ...]` -> `[..., B, H, ...]` (inverse of `merge`)."""
    return a.reshape(a.shape[:at] + (a.shape[at] // H, H) + a.shape[at + 1:])


# ------------------------------------------------------------------------------------------------------------------
# Inside `shard_map`: the manual mesh axes an array varies along


def varying_axes(*arrays):
    """The manual mesh axes (inside `shard_map` with `check_vma=True`) along which any of `arrays` varies."""
    axes = set()
    for a in arrays:
        aval = jax.typeof(a)
        mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.9; earlier the aval's `vma`
        axes |= set(mat.varying if mat is not None else getattr(aval, "vma", ()))
    return frozenset(axes)


def to_varying(a, axes):
    """`a` typed as varying along the manual mesh axes `axes` (a no-op at run time; differentiated, its transpose
    sums over those axes). The FFI calls' results carry no such type, so the kernel path restores it."""
    missing = tuple(sorted(axes - varying_axes(a)))
    if not missing:
        return a
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(a, missing, to="varying")
    return jax.lax.pvary(a, missing)


# ------------------------------------------------------------------------------------------------------------------
# Per-stream partitioning of a function of flat arrays


def _sharding_rule(in_axes, out_axes, in_ranks, out_ranks):
    """The Shardy rule: factors `b` and `h` at each array's B/H axes, a fresh need-replication factor elsewhere."""
    others = []

    def mapping(prefix, i, at, rank):
        names = []
        for d in range(rank):
            if d in at:
                names.append("b" if d == at[0] else "h")
            else:
                names.append(f"{prefix}{i}d{d}")
                others.append(names[-1])
        return " ".join(names)

    ins = ", ".join(mapping("i", i, at, r) for i, (at, r) in enumerate(zip(in_axes, in_ranks)))
    outs = ", ".join(mapping("o", i, at, r) for i, (at, r) in enumerate(zip(out_axes, out_ranks)))
    return f"{ins} -> {outs}", tuple(others)


def _axes(entry):
    """The mesh axes of one PartitionSpec entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _stream_spec(mesh, at, rank, b, h):
    """A sharding of a rank-`rank` array with B and H at `at`: B on `b`, H on `h`, every other dim replicated."""
    entries = [None] * rank
    if at[0] is not None:
        entries[at[0]] = b
    entries[at[1]] = h
    return NamedSharding(mesh, PartitionSpec(*entries))


def _stream_axes(in_axes, arg_shapes):
    """The mesh axes of B and of H: those of the first operand that shards each (Shardy has made them agree)."""
    def first(d):
        for shape, at in zip(arg_shapes, in_axes):
            spec = tuple(getattr(shape.sharding, "spec", None) or ())
            if at[d] is not None and at[d] < len(spec) and spec[at[d]] is not None:
                return spec[at[d]]
        return None

    b, h = first(0), first(1)
    if set(_axes(b)) & set(_axes(h)):  # a mesh axis cannot shard both: keep it on B
        h = None
    return b, h


def _def_partition(fn, local_fn, shardings, rule, others):
    """Gives the custom-partitioned `fn` of `local_fn(static, *arrays)` its rules: `shardings(mesh, arg_shapes,
    result_shape) -> (operand shardings, result shardings)` for the partition and the inference, and the Shardy
    rule `rule` with its factors `others` that need replication. Returns `fn`."""
    def partition(static, mesh, arg_shapes, result_shape):
        ins, outs = shardings(mesh, arg_shapes, result_shape)
        return mesh, functools.partial(local_fn, static), outs, ins

    def infer_sharding_from_operands(static, mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes, result_shape)[1]

    fn.def_partition(partition, infer_sharding_from_operands=infer_sharding_from_operands, sharding_rule=rule,
                     need_replication_factors=others)
    return fn


@functools.lru_cache(maxsize=None)
def _partitioned(local_fn, in_axes, out_axes, in_ranks, out_ranks):
    """`local_fn(static, *arrays) -> tuple of arrays` as a custom-partitioned function of the same arguments.

    `in_axes` / `out_axes`: each array's B and H axes (`BANK`, `UNITS`, `TOKENS` or `HEADS`, as `stream_axes_of`
    gives them). `local_fn` sees the arrays of one shard (all of them, when nothing is sharded) and must be agnostic
    to the sizes of B and H.
    """
    fn = custom_partitioning(local_fn, static_argnums=(0,))

    def shardings(mesh, arg_shapes, result_shape):
        b, h = _stream_axes(in_axes, arg_shapes)
        ins = tuple(_stream_spec(mesh, at, len(s.shape), b, h) for s, at in zip(arg_shapes, in_axes))
        outs = tuple(_stream_spec(mesh, at, len(s.shape), b, h) for s, at in zip(result_shape, out_axes))
        return ins, outs

    rule, others = _sharding_rule(in_axes, out_axes, in_ranks, out_ranks)
    return _def_partition(fn, local_fn, shardings, rule, others)


def _fold(a, at):
    """`[V, ..., B, ...]` (B at `at[0]` after the leading V) -> `[..., V*B, ...]`."""
    return merge(jnp.moveaxis(a, 0, at[0]), at[0])


def _unfold(a, at, size):
    """Inverse of `_fold`."""
    b = at[0]
    return jnp.moveaxis(a.reshape(a.shape[:b] + (size, a.shape[b] // size) + a.shape[b + 1:]), b, 0)


def per_stream(local_fn, static, arrays, in_axes, out_axes):
    """Call `local_fn(static, *arrays)`, partitioned per stream under SPMD and with vmap folded into B."""
    in_axes, out_axes = tuple(in_axes), tuple(out_axes)

    @custom_vmap
    def call(*arrays):
        out_ranks = tuple(len(o.shape) for o in jax.eval_shape(functools.partial(local_fn, static), *arrays))
        axes = tuple(stream_axes_of(at, a.ndim) for a, at in zip(arrays, in_axes))
        fn = _partitioned(local_fn, axes, out_axes, tuple(a.ndim for a in arrays), out_ranks)
        return tuple(fn(static, *arrays))

    @call.def_vmap
    def call_vmap(axis_size, in_batched, *arrays):
        # B, from an array that has it: a mapped shared bank `[V, H, K, D]` becomes one per stream, `[V*B, H, K, D]`;
        # an unmapped one stays shared by all V*B batch elements.
        B = next(a.shape[at[0] + batched] for a, at, batched in zip(arrays, in_axes, in_batched)
                 if stream_axes_of(at, a.ndim - batched)[0] is not None)
        folded = []
        for a, at, batched in zip(arrays, in_axes, in_batched):
            if stream_axes_of(at, a.ndim - batched) == HEADS:
                folded.append(merge(jnp.broadcast_to(a[:, None], (axis_size, B) + a.shape[1:]), 0) if batched else a)
            else:
                folded.append(_fold(a if batched else jnp.broadcast_to(a, (axis_size,) + a.shape),
                                    stream_axes_of(at, a.ndim - batched)))
        outs = call(*folded)
        return tuple(_unfold(o, at, axis_size) for o, at in zip(outs, out_axes)), (True,) * len(outs)

    return call(*arrays)


def explicit_out_sharding(bank, *tokens):
    """The results' shardings when the inputs' types carry shardings (a mesh with `Explicit` axes), else None.

    `y` like `k_idx` (B, T and H; B and H of the first per-token input or bank that shards them when `k_idx`
    does not), the final bank like `bank` (B and H as `y` where `bank` leaves them unsharded), `repeats`
    replicated. Also returns the mesh's explicit axes.
    """
    def spec(a):
        return tuple(getattr(jax.typeof(a).sharding, "spec", None) or ()) + (None,) * a.ndim

    bank_spec = spec(bank)
    if bank.ndim == 3:
        bank_spec = (None,) + bank_spec
    token_specs = [spec(a) for a in tokens]
    if not any(bank_spec) and not any(any(s) for s in token_specs):
        return None
    mesh = next(jax.typeof(a).sharding.mesh for a in (bank,) + tokens if any(spec(a)))
    b = next((s[0] for s in token_specs + [bank_spec] if s[0] is not None), None)
    h = next((e for e in [s[2] for s in token_specs] + [bank_spec[1]] if e is not None), None)

    def named(*entries):  # drop an entry whose mesh axes an earlier entry already uses
        used, out = set(), []
        for e in entries:
            out.append(None if used & set(_axes(e)) else e)
            used |= set(_axes(out[-1]))
        return NamedSharding(mesh, PartitionSpec(*out))

    k_spec = token_specs[0]
    y = named(k_spec[0] or b, k_spec[1], k_spec[2] or h, None)
    final = named(bank_spec[0] or b, bank_spec[1] or h, *bank_spec[2:4])
    return (y, final, named()), tuple(mesh.explicit_axes)


# ------------------------------------------------------------------------------------------------------------------
# Row-wise partitioning: functions that act on each row (the last axis) of their operands independently


@functools.lru_cache(maxsize=None)
def _rowwise_partitioned(local_fn, in_ranks, out_ranks, replicated):
    """`local_fn(static, *arrays)` as a custom-partitioned function whose operands and results share their leading
    axes (every axis but the last), each of which may be sharded; the last axis, and every axis of the operands in
    `replicated`, is replicated."""
    fn = custom_partitioning(local_fn, static_argnums=(0,))
    lead = in_ranks[next(i for i in range(len(in_ranks)) if i not in replicated)] - 1
    others = []

    def mapping(prefix, i, rank, rows):
        names = [f"r{d}" for d in range(lead)] if rows else []
        for d in range(len(names), rank):
            names.append(f"{prefix}{i}d{d}")
            others.append(names[-1])
        return " ".join(names)

    ins = ", ".join(mapping("i", i, r, i not in replicated) for i, r in enumerate(in_ranks))
    outs = ", ".join(mapping("o", i, r, True) for i, r in enumerate(out_ranks))

    def shardings(mesh, arg_shapes, result_shape):
        row_op = next(s for i, s in enumerate(arg_shapes) if i not in replicated)
        spec = tuple(getattr(row_op.sharding, "spec", None) or ()) + (None,) * lead
        rows = spec[:lead]
        ins = tuple(NamedSharding(mesh, PartitionSpec()) if i in replicated else
                    NamedSharding(mesh, PartitionSpec(*rows, None)) for i in range(len(arg_shapes)))
        outs = tuple(NamedSharding(mesh, PartitionSpec(*rows, None)) for _ in result_shape)
        return ins, outs

    return _def_partition(fn, local_fn, shardings, f"{ins} -> {outs}", tuple(others))


def rowwise(local_fn, static, arrays, replicated=()):
    """Call `local_fn(static, *arrays) -> tuple of arrays` row by row: under SPMD each device runs the rows of its
    shard (the leading axes keep their sharding, the last axis and the `replicated` operands are replicated; no
    all-gather of the rows); under `vmap` the mapped axis joins the rows (still one call)."""
    replicated = tuple(replicated)

    @custom_vmap
    def call(*arrays):
        out_ranks = tuple(len(o.shape) for o in jax.eval_shape(functools.partial(local_fn, static), *arrays))
        fn = _rowwise_partitioned(local_fn, tuple(a.ndim for a in arrays), out_ranks, replicated)
        return tuple(fn(static, *arrays))

    @call.def_vmap
    def call_vmap(axis_size, in_batched, *arrays):
        arrays = [a if i in replicated else a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
                  for i, (a, b) in enumerate(zip(arrays, in_batched))]
        if any(b for i, b in enumerate(in_batched) if i in replicated):
            raise NotImplementedError("rowwise: a replicated operand cannot be mapped by vmap")
        return call(*arrays), (True,) * len(jax.eval_shape(functools.partial(local_fn, static), *arrays))

    return call(*arrays)
