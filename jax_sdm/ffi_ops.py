"""``jax.ffi.ffi_call`` wrappers of the jax_sdm kernels, with the shape logic.

Kernel layout and outputs: docs/DESIGN.md. Each target's operands, attributes and results are declared once, in
C++ (ffi/targets.h), and described by the extension modules (``lowering.INTERFACES``): the wrappers pass and read
them by name. Leading dimensions before the per-unit ones are a batch shape: the handlers take any number of them
(their product is the unit count), so the wrappers pass them through and use ``vmap_method="broadcast_all"``: a
``vmap`` adds a leading dim to one kernel call, never a loop of calls.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import lowering
from .layout import Phase1


def _call(target, results, aliases=None, **operands):
    """``jax.ffi.ffi_call`` of ``target`` with its operands and attributes by name (``operands``) and its results by
    name (``results``: ``{name: jax.ShapeDtypeStruct}``, every result of the target and any of its optional ones);
    ``aliases`` maps an operand's name to the name of the result it is updated into. Returns
    ``{result name: array}``."""
    face = lowering.interface(target)
    names = face.results + tuple(n for n in face.optional_results if n in results)
    expected = set(face.results), set(face.args + face.attrs)
    assert expected[0] <= set(results) <= set(names) and set(operands) == expected[1], (target, sorted(results),
                                                                                      sorted(operands))
    call = jax.ffi.ffi_call(
        target, [results[n] for n in names], vmap_method="broadcast_all",
        input_output_aliases={face.args.index(a): names.index(r) for a, r in (aliases or {}).items()})
    outs = call(*(operands[n] for n in face.args), **{n: operands[n] for n in face.attrs})
    return dict(zip(names, outs))


def _check_shape(op, name, a, shape):
    if tuple(jnp.shape(a)) != tuple(shape):
        raise ValueError(f"{op}: {name} has shape {tuple(jnp.shape(a))}, expected {tuple(shape)}")


def _phase1_dims(op, k_idx, k_val, x, q_idx, q_val, num_slots):
    """Checks Phase 1's inputs; returns ``(batch, C, W, R, K)``."""
    shape_w = tuple(jnp.shape(k_idx))
    shape_r = tuple(jnp.shape(q_idx))
    if len(shape_w) < 2:
        raise ValueError(f"{op}: k_idx must be [..., C, W], got shape {shape_w}")
    if len(shape_r) < 2:
        raise ValueError(f"{op}: q_idx must be [..., C, R], got shape {shape_r}")
    for name, a in (("k_val", k_val), ("x", x)):
        if tuple(jnp.shape(a)) != shape_w:
            raise ValueError(
                f"{op}: {name} has shape {tuple(jnp.shape(a))}, expected the shape "
                f"of k_idx {shape_w}")
    if tuple(jnp.shape(q_val)) != shape_r:
        raise ValueError(
            f"{op}: q_val has shape {tuple(jnp.shape(q_val))}, expected the shape "
            f"of q_idx {shape_r}")
    if shape_r[:-1] != shape_w[:-1]:
        raise ValueError(
            f"{op}: q_idx shape {shape_r} and k_idx shape {shape_w} must agree "
            f"in all but the last dim ([..., C])")
    try:
        K = int(num_slots)
    except TypeError:
        raise TypeError(
            f"{op}: num_slots must be a static Python int, got {num_slots!r}") from None
    if not 0 <= K < 2**31:
        raise ValueError(f"{op}: num_slots must be in [0, 2^31), got {K}")
    return shape_w[:-2], shape_w[-2], shape_w[-1], shape_r[-1], K


def _phase1_workspace(batch, C, W, R, backward):
    """The trailing workspace result of ``sdm_phase1`` / ``sdm_phase1_bwd`` (uint8): the CUDA kernels' scratch of
    the units that do not fit in shared memory (``lowering.phase1_workspace_bytes``); the CPU handlers ignore it."""
    size = lowering.phase1_workspace_bytes(math.prod(batch), C, W, R, backward)
    return jax.ShapeDtypeStruct((size,), jnp.uint8)


def phase1_ffi(k_idx, k_val, x, q_idx, q_val, num_slots):
    """Phase 1 of the chunked form on the kernels (docs/DESIGN.md "Phase 1").

    Args:
      k_idx: ``[..., C, W]`` write slot ids (cast to int32).
      k_val: ``[..., C, W]`` write weights (cast to float32).
      x: ``[..., C, W]`` per-lane log-gates (cast to float32).
      q_idx: ``[..., C, R]`` read slot ids (cast to int32).
      q_val: ``[..., C, R]`` read weights (cast to float32).
      num_slots: ``K``, a Python int; ids outside ``[0, K)`` are invalid entries.

    Returns:
      A ``Phase1`` (``jax_sdm.layout``) ``(log_k, rex, cpe, k_eff, w, log_q, q_w, A, QK, w_order, w_group, r_order,
      r_group, repeats)`` with the batch shape ``...`` in front of the per-unit shapes of DESIGN.md.
    """
    batch, C, W, R, K = _phase1_dims("phase1_ffi", k_idx, k_val, x, q_idx, q_val, num_slots)
    f32, i32 = jnp.float32, jnp.int32
    shapes = dict(log_k=((C, W), f32), rex=((C, W), f32), cpe=((C, W), f32), k_eff=((C, W), f32), w=((C, W), f32),
                  log_q=((C, R), f32), q_w=((C, R), f32), A=((C, C), f32), QK=((C, C), f32),
                  w_order=((C * W,), i32), w_group=((C * W + 1,), i32), r_order=((C * R,), i32),
                  r_group=((C * R + 1,), i32), repeats=((), i32))
    results = {n: jax.ShapeDtypeStruct(batch + s, d) for n, (s, d) in shapes.items()}
    outs = _call("sdm_phase1", dict(results, workspace=_phase1_workspace(batch, C, W, R, backward=False)),
                 k_idx=jnp.asarray(k_idx).astype(i32), k_val=jnp.asarray(k_val).astype(f32),
                 x=jnp.asarray(x).astype(f32), q_idx=jnp.asarray(q_idx).astype(i32),
                 q_val=jnp.asarray(q_val).astype(f32), num_slots=np.int64(K))
    return Phase1(**{n: outs[n] for n in Phase1._fields})
    return _phase1_result(outs[:len(out_shapes)])


def phase1_bwd_ffi(k_idx, k_val, x, q_idx, q_val, num_slots, p1, dk_eff, dw, dcpe, dq_w, dA, dQK):
    """The VJP of Phase 1 w.r.t. ``k_val``, ``x``, ``q_val`` (docs/DESIGN.md "Phase-1 backward").

    Args:
      k_idx, k_val, x, q_idx, q_val, num_slots: Phase 1's inputs, as for ``phase1_ffi``.
      p1: Phase 1's outputs for these inputs (the ``Phase1`` of ``phase1_ffi``); its
        ``log_k``, ``rex``, ``cpe`` and ``log_q`` are read.
      dk_eff, dw, dcpe: ``[..., C, W]`` cotangents of ``k_eff``, ``w``, ``cpe``.
      dq_w: ``[..., C, R]`` cotangent of ``q_w``.
      dA, dQK: ``[..., C, C]`` cotangents of ``A`` (its strictly lower part is read)
        and ``QK`` (its lower part with the diagonal is read).
      Any cotangent may be ``None`` (zero). The cotangents of ``log_k``, ``rex`` and
      ``log_q`` are taken as zero.

    Returns:
      ``(dk_val [..., C, W], dx [..., C, W], dq_val [..., C, R])`` float32; invalid
      entries and the gates of repeats get 0.
    """
    op = "phase1_bwd_ffi"
    batch, C, W, R, K = _phase1_dims(op, k_idx, k_val, x, q_idx, q_val, num_slots)
    f32 = jnp.float32
    shape_w, shape_r, shape_c = batch + (C, W), batch + (C, R), batch + (C, C)
    p1 = Phase1(*p1)
    for name, shape in (("log_k", shape_w), ("rex", shape_w), ("cpe", shape_w),
                        ("log_q", shape_r)):
        _check_shape(op, f"p1.{name}", getattr(p1, name), shape)

    def cotangent(name, a, shape):
        if a is None:
            return jnp.zeros(shape, f32)
        _check_shape(op, name, a, shape)
        return jnp.asarray(a).astype(f32)

    cots = {name: cotangent(name, a, shape) for name, a, shape in (
        ("dk_eff", dk_eff, shape_w), ("dw", dw, shape_w), ("dcpe", dcpe, shape_w),
        ("dq_w", dq_w, shape_r), ("dA", dA, shape_c), ("dQK", dQK, shape_c))}
    outs = _call("sdm_phase1_bwd", dict(dk_val=jax.ShapeDtypeStruct(shape_w, f32),
                                        dx=jax.ShapeDtypeStruct(shape_w, f32),
                                        dq_val=jax.ShapeDtypeStruct(shape_r, f32),
                                        workspace=_phase1_workspace(batch, C, W, R, backward=True)),
                 k_idx=jnp.asarray(k_idx).astype(jnp.int32), k_val=jnp.asarray(k_val).astype(f32),
                 x=jnp.asarray(x).astype(f32), q_idx=jnp.asarray(q_idx).astype(jnp.int32),
                 q_val=jnp.asarray(q_val).astype(f32),
                 **{n: jnp.asarray(getattr(p1, n)).astype(f32) for n in ("log_k", "rex", "cpe", "log_q")},
                 **cots, num_slots=np.int64(K))
    return outs["dk_val"], outs["dx"], outs["dq_val"]
    return dk_val, dx, dq_val


def solve_ffi(A, beta):
    """``Minv = (I + diag(beta) A)^{-1}`` per unit (docs/DESIGN.md "Solve").

    Args:
      A: ``[..., C, C]``; only its strictly lower triangle is read.
      beta: ``[..., C]``.

    Returns:
      ``Minv`` ``[..., C, C]`` float32.
    """
    A = jnp.asarray(A)
    beta = jnp.asarray(beta)
    if A.ndim < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"solve_ffi: A must be [..., C, C], got shape {A.shape}")
    if tuple(beta.shape) != tuple(A.shape[:-1]):
        raise ValueError(
            f"solve_ffi: beta has shape {tuple(beta.shape)}, expected {tuple(A.shape[:-1])} "
            f"(A's shape without its last dim)")
    return _call("sdm_solve", dict(Minv=jax.ShapeDtypeStruct(A.shape, jnp.float32)),
                 A=A.astype(jnp.float32), beta=beta.astype(jnp.float32))["Minv"]


class ForwardSegments(NamedTuple):
    """Packed sequences for `forward_ffi` (`segments.chunk_segments`): the initial bank (like the bank), each token's
    segment counted from its chunk's first `local [..., NC, P, C]` and each chunk's first segment `seg0 [..., NC, P]`
    (int32)."""
    initial: jax.Array
    local: jax.Array
    seg0: jax.Array


class BackwardSegments(NamedTuple):
    """Packed sequences for `backward_ffi`: those of `ForwardSegments`, the final stamps and their snapshot
    (`Forward.stamp`, `Forward.stamp_snapshot`) and `dinitial`, the cotangent of the initial bank so far (dbank's
    dtype): the gradient of the reads of stale rows is added to it."""
    initial: jax.Array
    local: jax.Array
    seg0: jax.Array
    stamp: jax.Array
    stamp_snapshot: jax.Array
    dinitial: jax.Array


class Forward(NamedTuple):
    """`forward_ffi`'s results: the final bank, the readings `y` and the residuals `delta`, `vg`, `snapshot`,
    `snapshot_scale` and the links `link_k`, `link_q`; with packed sequences the stamps and their snapshot, and for
    a slab the first steps to carry to the next slab (else None)."""
    bank: jax.Array
    y: jax.Array
    delta: jax.Array
    vg: jax.Array
    snapshot: jax.Array
    snapshot_scale: jax.Array
    link_k: jax.Array
    link_q: jax.Array
    stamp: jax.Array | None = None
    stamp_snapshot: jax.Array | None = None
    first: jax.Array | None = None


# How the forward stores the snapshot (docs/MATH.md "Snapshot storage"): the kernels' codes
# (kernels/snapshot_codec.h SnapshotDtype), by name; None is the bank's dtype.
SNAPSHOT_CODES = {None: 0, "bfloat16": 1, "float8_e4m3fn": 2, "int4": 3}


def snapshot_arrays(code, units, C, W, D, bank_dtype):
    """The snapshot's shape and dtype for storage `code` (`SNAPSHOT_CODES`), and its scales': `((shape, dtype),
    (shape, dtype))` for the unit shape `units` (`[..., NC, P]`). Every chunk but the last (no later chunk reads a
    row through the last one's writes: `[..., NC - 1, P]` units, none for one chunk) of: the bank's dtype or
    bfloat16 `[..., C*W, D]`; float8 codes `[..., C*W, D]` and int4 codes two a byte `[..., C*W, ceil(D/2)]` as
    uint8, with a float32 scale per row `[..., C*W]` (an empty `[..., 0]` scale for the unscaled codes)."""
    units = units[:-2] + (max(units[-2] - 1, 0), units[-1])
    rows = units + (C * W,)
    if code in (0, 1):
        return (rows + (D,), bank_dtype if code == 0 else jnp.bfloat16), (units + (0,), jnp.float32)
    cols = D if code == 2 else (D + 1) // 2
    return (rows + (cols,), jnp.uint8), (rows, jnp.float32)


class Backward(NamedTuple):
    """`backward_ffi`'s results: the gradient bank and the cotangents of Phase 1's outputs and of `beta` and `v`;
    with packed sequences `dinitial` (else None)."""
    dbank: jax.Array
    dk_eff: jax.Array
    dw: jax.Array
    dcpe: jax.Array
    dq_w: jax.Array
    dA: jax.Array
    dQK: jax.Array
    dbeta: jax.Array
    dv: jax.Array
    dinitial: jax.Array | None = None


def _workspace(bank, k_idx, q_idx, backward):
    """The chunk steps' workspace result, float32 (`lowering.chunk_steps_workspace_floats`, kernels/chunk_steps.h):
    the CUDA kernels' per-chunk rows, group tables and fresh-result arrays; the CPU handlers ignore it."""
    floats = lowering.chunk_steps_workspace_floats(
        math.prod(k_idx.shape[:-4]), k_idx.shape[-4], k_idx.shape[-3], k_idx.shape[-2], k_idx.shape[-1],
        q_idx.shape[-1], bank.shape[-2], bank.shape[-1], backward)
    return jax.ShapeDtypeStruct((floats,), jnp.float32)


def _phase1_operands(p1, names):
    return {n: getattr(p1, n) for n in names}


def _stream_bank_shape(bank, k_idx):
    """The shape of a bank per stream, `[..., P, K, D]`, for an input bank per stream or shared."""
    return k_idx.shape[:-4] + (k_idx.shape[-3],) + bank.shape[-2:]


class ForwardSlab(NamedTuple):
    """A slab of the no-grad forward in slabs (`forward_ffi`'s `slab`): `carry` the bank the earlier slabs left
    `[..., P, K, D]` and `first` their slots' first writing steps (int32 `[..., P, K]`), both None for the first slab;
    `last`: this slab is the sequence's last."""
    carry: jax.Array | None
    first: jax.Array | None
    last: bool


def forward_ffi(bank, k_idx, q_idx, v, beta, p1, minv, save, segments=None, slab=None, snapshot_code=0,
                in_place=False):
    """The forward chunk loop (docs/DESIGN.md "Forward steps").

    Args:
      bank: `[..., P, K, D]` float32 or bfloat16, the initial bank. Without `segments` the final bank is a new
        buffer: the CUDA kernels read each row from `bank` until its first write, so no whole-bank copy is made
        whether or not `bank` is donated. With `segments` it is updated in place (aliased to the returned bank:
        donate it to avoid a copy). Without `segments`, `bank` may also be one `[P_in, K, D]` that the streams
        share (`P_in` dividing `P`; stream `p` starts from its row block `p % P_in`): the `B*H` streams of a bank
        shared over the batch read it as it is, with no broadcast first.
      k_idx, q_idx, v, beta: `[..., NC, P, C, W|R|D]` / `[..., NC, P, C]` (kernel layout).
      p1: Phase 1's outputs (`Phase1`) in the same layout; minv: the solve's `[..., NC, P, C, C]`.
      save: keep the residuals for the backward (else they come back empty and nothing is saved).
      slab: None, or a `ForwardSlab` (no `segments`, `save` False): this call is a slab of a no-grad forward in
        slabs, `bank` the sequence's input bank. The final bank and the first steps (the `first` result) are the
        carry's, updated in place (aliased); the CUDA kernels read each row from `bank` until its first write in any
        slab, and the last slab copies the rows no slab wrote, so a sequence's untouched rows are copied once.
      segments: None, or a `ForwardSegments` for packed sequences. `p1` must then come from the virtual slot ids
        (`segments.virtual_slots`); `k_idx` and `q_idx` are the real ones.
      snapshot_code: how the snapshot is stored (`SNAPSHOT_CODES`, `snapshot_arrays`).
      in_place: (no `segments`, no `slab`) the final bank aliases `bank`, one per stream `[..., P, K, D]`: the
        kernels update the written rows where they are and touch no other row (donate `bank` to avoid XLA's copy of
        it).

    Returns:
      A `Forward`: the final bank; `y` in the bank's dtype (`v` goes in it too: the kernels widen it on load and
      round the readings once on store); `delta` and `vg = v - G` (G the gathers of the write lanes, the backward's
      only use of `v`) float32, `snapshot` and `snapshot_scale` as `snapshot_arrays` says (each stored write
      group's row after its chunk's write), and the links `link_k [..., NC, P, C, W]`, `link_q [..., NC, P, C, R]`
      int32 (each entry's slot's latest write in an earlier chunk, as its snapshot entry, or -1). With `segments`, the
      final bank is the working bank (each row that of its stamp's segment), and the stamps `[..., P, K]` int32
      (each row's segment of its last write) and, with `save`, the stamps' snapshot `[..., NC, P, C*W]` int32
      follow.
    """
    C, W = k_idx.shape[-2:]
    D = bank.shape[-1]
    tokens = k_idx.shape[:-1]
    f32, i32 = jnp.float32, jnp.int32

    def residual(shape, dtype):
        return jax.ShapeDtypeStruct(shape if save else (0,), dtype)

    snapshot, scale = snapshot_arrays(snapshot_code, tokens[:-1], C, W, D, bank.dtype)
    results = dict(bank_out=jax.ShapeDtypeStruct(_stream_bank_shape(bank, k_idx), bank.dtype),
                   y=jax.ShapeDtypeStruct(tokens + (D,), bank.dtype),
                   delta=residual(tokens + (D,), f32), vg=residual(tokens + (D,), f32),
                   snapshot=residual(*snapshot), snapshot_scale=residual(*scale),
                   link_k=residual(k_idx.shape, i32), link_q=residual(q_idx.shape, i32),
                   workspace=_workspace(bank, k_idx, q_idx, backward=False))
    operands = dict(bank=bank, k_idx=k_idx.astype(i32), q_idx=q_idx.astype(i32), v=v.astype(bank.dtype),
                    beta=beta.astype(f32), minv=minv, snapshot_dtype=np.int64(snapshot_code),
                    **_phase1_operands(p1, ("k_eff", "w", "cpe", "q_w", "QK", "w_order", "w_group")))
    if slab is not None:
        streams = _stream_bank_shape(bank, k_idx)
        carried = slab.carry is not None
        results.update(first_out=jax.ShapeDtypeStruct(streams[:-1], i32))
        outs = _call("sdm_forward_slab", results,
                     aliases=dict(carry="bank_out", first="first_out") if carried else None, **operands,
                     carry=slab.carry if carried else jnp.zeros((0,), bank.dtype),
                     first=slab.first if carried else jnp.zeros((0,), i32), last_slab=np.int64(slab.last))
    elif segments is None:
        if in_place and bank.shape != results["bank_out"].shape:
            raise ValueError(f"forward_ffi: `in_place` needs a bank per stream {results['bank_out'].shape}, got "
                             f"{bank.shape}")
        outs = _call("sdm_forward", results, aliases=dict(bank="bank_out") if in_place else None, **operands)
    else:
        results.update(stamp=jax.ShapeDtypeStruct(bank.shape[:-1], i32),
                       stamp_snapshot=residual(tokens[:-1] + (C * W,), i32))
        outs = _call("sdm_forward_packed", results, aliases=dict(bank="bank_out"), **operands,
                     initial=segments.initial.astype(bank.dtype), local=segments.local.astype(i32),
                     seg0=segments.seg0.astype(i32))
    return Forward(outs["bank_out"], outs["y"], outs["delta"], outs["vg"], outs["snapshot"], outs["snapshot_scale"],
                   outs["link_k"], outs["link_q"], outs.get("stamp"), outs.get("stamp_snapshot"), outs.get("first_out"))


def backward_ffi(bank, dbank, dy, k_idx, q_idx, beta, p1, minv, delta, vg, snapshot, snapshot_scale, link_k, link_q,
                 snapshot_code=0, segments=None):
    """The reverse chunk loop (docs/DESIGN.md "Backward steps").

    `bank` is the forward's input bank (per stream, or shared as `forward_ffi` takes it; only read) and `dbank`
    the cotangent of the final bank, or for a zero cotangent an empty `[..., P, 0, D]` array (no bank-sized buffer
    of zeros). The gradient of the initial bank comes back in `dbank`'s buffer (aliased) with `segments`; else in a
    buffer of its own, and `dbank` is left as it is (the CUDA kernels read each row of it until its first write: no
    whole-bank copy of a `dbank` the caller keeps). `dbank`'s dtype is the working gradient bank's: float32, or the
    bank's bfloat16 (float32 inside each step, rounded once per written row). `dy`, the readings' cotangent
    `[..., NC, P, C, D]`, goes to the kernels in the bank's dtype (they widen it on load): the readings leave the
    op in that dtype, so their cotangent is exact there at half float32's bytes. `v`'s cotangent `dv` comes back
    in the bank's dtype too (`v`'s in the op), rounded once on store.

    `snapshot`, `snapshot_scale`, `link_k`, `link_q`: the forward's residuals, the snapshot stored as
    `snapshot_code` says (`snapshot_arrays`; a None scale: the empty scale of an unscaled code). The backward reads
    each row as it was before a chunk from the decoded snapshot (rounded to the bank's dtype) through the links, or
    from `bank`: it keeps no working bank.

    `segments`: None, or a `BackwardSegments` for packed sequences (`bank` is then their initial bank).

    Returns:
      A `Backward`; with `segments` the initial bank's whole gradient is `dbank + dinitial`.
    """
    f32, i32 = jnp.float32, jnp.int32
    if snapshot_scale is None:
        snapshot_scale = jnp.zeros(snapshot.shape[:-2] + (0,), f32)
    like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
    results = dict(dbank_out=jax.ShapeDtypeStruct(_stream_bank_shape(bank, k_idx), dbank.dtype),
                   dk_eff=like(p1.k_eff), dw=like(p1.w), dcpe=like(p1.cpe), dq_w=like(p1.q_w), dA=like(p1.A),
                   dQK=like(p1.QK), dbeta=jax.ShapeDtypeStruct(beta.shape, f32),
                   dv=jax.ShapeDtypeStruct(dy.shape, bank.dtype),  # v's dtype: the op takes v in the bank's
                   workspace=_workspace(bank, k_idx, q_idx, backward=True))
    operands = dict(bank=bank, dbank=dbank, dy=dy.astype(bank.dtype), k_idx=k_idx.astype(i32),
                    q_idx=q_idx.astype(i32), beta=beta.astype(f32), minv=minv, delta=delta, vg=vg, snapshot=snapshot,
                    snapshot_scale=snapshot_scale, link_k=link_k, link_q=link_q,
                    snapshot_dtype=np.int64(snapshot_code),
                    **_phase1_operands(p1, ("k_eff", "w", "cpe", "q_w", "A", "QK", "w_order", "w_group", "r_order",
                                            "r_group")))
    if segments is None:
        outs = _call("sdm_backward", results, **operands)
    else:  # the stamps and dinitial are updated in place, like dbank
        results.update(stamp_out=like(segments.stamp), dinitial_out=like(dbank))
        outs = _call("sdm_backward_packed", results,
                     aliases=dict(dbank="dbank_out", stamp="stamp_out", dinitial="dinitial_out"),
                     **operands, initial=segments.initial.astype(bank.dtype), local=segments.local.astype(i32),
                     seg0=segments.seg0.astype(i32), stamp=segments.stamp.astype(i32),
                     stamp_snapshot=segments.stamp_snapshot.astype(i32),
                     dinitial=segments.dinitial.astype(dbank.dtype))
    return Backward(*(outs[n] for n in ("dbank_out", "dk_eff", "dw", "dcpe", "dq_w", "dA", "dQK", "dbeta", "dv")),
                    outs.get("dinitial_out"))


def decode_step_ffi(bank, k_idx, k_val, x, v, beta, q_idx, q_val):
    """One token of every stream on the kernels, the bank updated in place (docs/DESIGN.md "Decode step").

    Args:
      bank: `[..., K, D]` float32 or bfloat16 (aliased to the returned bank: donate it to avoid a copy).
      k_idx, k_val: `[..., W]` write slot ids (cast to int32) and weights (the bank's dtype).
      x: `[...]` per-token or `[..., W]` per-write log-gates (cast to float32).
      v: `[..., D]` values; beta: `[...]` write strengths (cast to float32).
      q_idx, q_val: `[..., R]` read slot ids and weights.

    Returns:
      `(new_bank, y)`: the bank after the token and the readings `[..., D]`, in the bank's dtype.
    """
    f32, i32 = jnp.float32, jnp.int32
    outs = _call("sdm_decode_step", dict(bank_out=jax.ShapeDtypeStruct(bank.shape, bank.dtype),
                                         y=jax.ShapeDtypeStruct(v.shape, bank.dtype)),
                 aliases=dict(bank="bank_out"), bank=bank, k_idx=k_idx.astype(i32), k_val=k_val, x=x.astype(f32),
                 v=v, beta=beta.astype(f32), q_idx=q_idx.astype(i32), q_val=q_val)
    return outs["bank_out"], outs["y"]


# The codes of the layer's weight activations and readout norms (kernels/decode_step.h LaneActivation, ReadoutNorm).
LANE_ACTIVATIONS = ("softmax", "l2_normalize", "identity", "sigmoid", "tanh", "relu", "gelu", "silu", "softplus")
READOUT_NORMS = (None, "rms", "layer")
_LAYER_DECODE_COLUMNS = ("num_writes", "num_reads", "v_offset", "b_offset", "a_offset", "og_offset")
_LAYER_DECODE_OPTIONS = _LAYER_DECODE_COLUMNS + ("write_activation", "read_activation", "per_write_gates",
                                                 "readout_norm", "write_scale", "read_scale", "norm_eps")


def layer_decode_step_ffi(bank, ids, scores, proj, gates, norm, **options):
    """The layer's decode step in one kernel call (kernels/decode_step.h "The layer's decode step"): the decode step
    with its lanes, gates and values made from the address top-k and the input projection, and its readings normed
    and gated.

    Args:
      bank: `[..., K, D]` float32 or bfloat16 (aliased to the returned bank: donate it to avoid a copy).
      ids, scores: `[..., 2, k]` a stream's top lists (writes, then reads; best first), int32 and float32.
      proj: `[..., width]` the stream's input projection row (the bank's dtype).
      gates: `[..., H, 2]` per head `-exp(A_log)` and `dt_bias`; norm: `[..., 2, D]` the readout norm's scale and
        bias (float32; leading dims of product G split the streams into G groups, heads last).
      options: `num_writes`, `num_reads`; the columns `v_offset` (to `v_offset + D`), `b_offset`, `a_offset` and
        `og_offset` (the output gate's `D` columns; `< 0`: none) of `proj`; `write_activation`, `read_activation`
        (names in `LANE_ACTIVATIONS`), `per_write_gates`, `readout_norm` (one of `READOUT_NORMS`), `write_scale`,
        `read_scale`, `norm_eps`.

    Returns:
      `(new_bank, out [..., D])`, in the bank's dtype.
    """
    outs = _call("sdm_layer_decode_step", _layer_decode_results(bank), aliases=dict(bank="bank_out"), bank=bank,
                 ids=ids.astype(jnp.int32), scores=scores.astype(jnp.float32), proj=proj,
                 gates=gates.astype(jnp.float32), norm=norm.astype(jnp.float32), **_layer_decode_attributes(options))
    return outs["bank_out"], outs["out"]


def layer_decode_rank_step_ffi(bank, proj, table, gates, norm, *, factors, k, write_rank_offset, read_rank_offset,
                               **options):
    """`layer_decode_step_ffi` with the lists ranked in the call: the product-key top-k (`factors`, `k`, the
    candidate table `[F, C]`) of each stream's address rows, the projection's columns from `write_rank_offset` and
    `read_rank_offset` (`sum(factors)` each); `options` as there."""
    outs = _call("sdm_layer_decode_rank_step", _layer_decode_results(bank), aliases=dict(bank="bank_out"),
                 bank=bank, proj=proj, table=jnp.asarray(table, jnp.int32), gates=gates.astype(jnp.float32),
                 norm=norm.astype(jnp.float32), factors=np.asarray(factors, np.int64), k=np.int64(k),
                 write_rank_offset=np.int64(write_rank_offset), read_rank_offset=np.int64(read_rank_offset),
                 **_layer_decode_attributes(options))
    return outs["bank_out"], outs["out"]


def _layer_decode_results(bank):
    """The layer decode targets' results: the bank and the outputs `[..., D]`, in the bank's dtype."""
    return dict(bank_out=jax.ShapeDtypeStruct(bank.shape, bank.dtype),
                out=jax.ShapeDtypeStruct(bank.shape[:-2] + bank.shape[-1:], bank.dtype))


def _layer_decode_attributes(options):
    """The layer decode targets' attributes from `layer_decode_step_ffi`'s options (all of them, no other)."""
    missing = [n for n in _LAYER_DECODE_OPTIONS if n not in options]
    unknown = [n for n in options if n not in _LAYER_DECODE_OPTIONS]
    if missing or unknown:
        raise TypeError(f"layer decode step: missing options {missing}, unknown options {unknown}")
    attrs = {n: np.int64(options[n]) for n in _LAYER_DECODE_COLUMNS}
    attrs.update(write_activation=np.int64(LANE_ACTIVATIONS.index(options["write_activation"])),
                 read_activation=np.int64(LANE_ACTIVATIONS.index(options["read_activation"])),
                 per_write_gates=np.int64(bool(options["per_write_gates"])),
                 readout_norm=np.int64(READOUT_NORMS.index(options["readout_norm"])),
                 write_scale=np.float32(options["write_scale"]), read_scale=np.float32(options["read_scale"]),
                 norm_eps=np.float32(options["norm_eps"]))
    return attrs


def token_recurrence_ffi(bank, k_idx, k_val, x, v, beta, q_idx, q_val, in_place=False):
    """The token recurrence in one kernel, the CPU's no-grad forward (docs/DESIGN.md "No-grad forward"),
    on the op's arguments in the public layout as they are: nothing is laid out or widened first.

    Args:
      bank: `[..., B, H, K, D]` float32 or bfloat16, the initial bank. The final bank is a new buffer (the kernel
        copies each stream's rows in the thread that runs the stream: in parallel, and into its cache), or with
        `in_place` aliases `bank` (updated in place: donate it to avoid a copy).
      k_idx, k_val: `[..., B, T, H, W]` write slot ids (int32; an id outside `[0, K)` touches no row) and weights
        (the bank's dtype); x: the log-gates, `[..., B, T, H]` per token or `[..., B, T, H, W]` per write (float32).
      v: `[..., B, T, H, D]` values, beta: `[..., B, T, H]` write strengths (float32); q_idx, q_val: `[..., B, T, H,
        R]` read slot ids and weights.

    Returns:
      `(y [..., B, T, H, D] in the bank's dtype, final_bank, repeats [..., B, H] int32)`: the readings, the bank
      after the last token, and per stream the write lanes that repeat an earlier lane's slot in their token.
    """
    outs = _call("sdm_token_recurrence",
                 dict(bank_out=jax.ShapeDtypeStruct(bank.shape, bank.dtype),
                      y=jax.ShapeDtypeStruct(v.shape, bank.dtype),
                      repeats=jax.ShapeDtypeStruct(bank.shape[:-2], jnp.int32)),
                 aliases=dict(bank="bank_out") if in_place else None, bank=bank, k_idx=k_idx.astype(jnp.int32),
                 k_val=k_val, x=x.astype(jnp.float32), v=v, beta=beta.astype(jnp.float32),
                 q_idx=q_idx.astype(jnp.int32), q_val=q_val)
    return outs["y"], outs["bank_out"], outs["repeats"]
