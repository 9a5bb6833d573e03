"""``jax.ffi.ffi_call`` wrappers of the jax_sdm kernels, with the shape logic.

Kernel layout and outputs: docs/DESIGN.md. Leading dimensions before the
per-unit ones are a batch shape: the handlers take any number of them (their
product is the unit count), so the wrappers pass them through and use
``vmap_method="broadcast_all"``: a ``vmap`` adds a leading dim to one kernel call,
never a loop of calls.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import lowering

lowering.register()

_PHASE1_FIELDS = (
    "log_k", "rex", "cpe", "k_eff", "w", "log_q", "q_w", "A", "QK",
    "w_order", "w_group", "r_order", "r_group", "repeats",
)


def _phase1_result(values):
    """The ``Phase1`` named tuple of ``jax_sdm.xla`` when it exists, else a tuple."""
    try:
        from .xla import Phase1
    except ImportError:
        return tuple(values)
    return Phase1(*values)


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


# kernels/phase1.h: kPhase1CudaSharedBytes, kPhase1CudaGlobalBlocks, kPhase1CudaWarps and the scratch formulas.
_PHASE1_CUDA_SHARED_BYTES = 226 * 1024
_PHASE1_CUDA_GLOBAL_BLOCKS = 128
_PHASE1_CUDA_WARPS = 32

# kernels/steps.h: kTableBatches and table_chunks, the chunks of group tables the backward holds at once.
_TABLE_BATCHES = 4


def _table_chunks(NC):
    return (NC + _TABLE_BATCHES - 1) // _TABLE_BATCHES


def _round_up_256(n):
    return (n + 255) // 256 * 256


def _phase1_workspace(batch, C, W, R, backward):
    """The trailing workspace result of ``sdm_phase1`` / ``sdm_phase1_bwd`` (uint8, bytes).

    The CUDA kernels keep each unit's sort buffers and runs in shared memory when they fit; else the run arrays
    go to this workspace (one slice per block), or, when the rest does not fit either, all of it. The size
    mirrors ``sdm::phase1_cuda_workspace_bytes`` in kernels/phase1.h. The CPU handlers ignore it.
    """
    E = C * (W + R)
    base = _round_up_256(4 * (_PHASE1_CUDA_WARPS * max(256, 2 * C) + 3 * E))
    runs = _round_up_256(4 * (2 if backward else 1) * E)
    if base + runs <= _PHASE1_CUDA_SHARED_BYTES:
        slice_bytes = 0
    elif base <= _PHASE1_CUDA_SHARED_BYTES:
        slice_bytes = runs
    else:
        slice_bytes = base + runs
    n = math.prod(batch)
    size = 0 if n <= 0 or slice_bytes == 0 else min(n, _PHASE1_CUDA_GLOBAL_BLOCKS) * slice_bytes
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
      ``(log_k, rex, cpe, k_eff, w, log_q, q_w, A, QK, w_order, w_group, r_order,
      r_group, repeats)`` (a ``jax_sdm.xla.Phase1`` when that type exists) with the
      batch shape ``...`` in front of the per-unit shapes of DESIGN.md.
    """
    batch, C, W, R, K = _phase1_dims("phase1_ffi", k_idx, k_val, x, q_idx, q_val, num_slots)
    f32, i32 = jnp.float32, jnp.int32
    out_shapes = [
        ((C, W), f32),          # log_k
        ((C, W), f32),          # rex
        ((C, W), f32),          # cpe
        ((C, W), f32),          # k_eff
        ((C, W), f32),          # w
        ((C, R), f32),          # log_q
        ((C, R), f32),          # q_w
        ((C, C), f32),          # A
        ((C, C), f32),          # QK
        ((C * W,), i32),        # w_order
        ((C * W + 1,), i32),    # w_group
        ((C * R,), i32),        # r_order
        ((C * R + 1,), i32),    # r_group
        ((), i32),              # repeats
    ]
    call = jax.ffi.ffi_call(
        "sdm_phase1",
        [jax.ShapeDtypeStruct(batch + s, d) for s, d in out_shapes]
        + [_phase1_workspace(batch, C, W, R, backward=False)],
        vmap_method="broadcast_all",
    )
    outs = call(jnp.asarray(k_idx).astype(i32), jnp.asarray(k_val).astype(f32),
                jnp.asarray(x).astype(f32), jnp.asarray(q_idx).astype(i32),
                jnp.asarray(q_val).astype(f32), num_slots=np.int64(K))
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
    p1 = _phase1_result(p1)
    for name, shape in (("log_k", shape_w), ("rex", shape_w), ("cpe", shape_w),
                        ("log_q", shape_r)):
        _check_shape(op, f"p1.{name}", getattr(p1, name), shape)

    def cotangent(name, a, shape):
        if a is None:
            return jnp.zeros(shape, f32)
        _check_shape(op, name, a, shape)
        return jnp.asarray(a).astype(f32)

    cots = [cotangent(name, a, shape) for name, a, shape in (
        ("dk_eff", dk_eff, shape_w), ("dw", dw, shape_w), ("dcpe", dcpe, shape_w),
        ("dq_w", dq_w, shape_r), ("dA", dA, shape_c), ("dQK", dQK, shape_c))]
    call = jax.ffi.ffi_call(
        "sdm_phase1_bwd",
        (jax.ShapeDtypeStruct(shape_w, f32), jax.ShapeDtypeStruct(shape_w, f32),
         jax.ShapeDtypeStruct(shape_r, f32), _phase1_workspace(batch, C, W, R, backward=True)),
        vmap_method="broadcast_all",
    )
    dk_val, dx, dq_val, _ = call(jnp.asarray(k_idx).astype(jnp.int32), jnp.asarray(k_val).astype(f32),
                jnp.asarray(x).astype(f32), jnp.asarray(q_idx).astype(jnp.int32), jnp.asarray(q_val).astype(f32),
                *(jnp.asarray(getattr(p1, n)).astype(f32) for n in ("log_k", "rex", "cpe", "log_q")),
                *cots, num_slots=np.int64(K))
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
    call = jax.ffi.ffi_call(
        "sdm_solve",
        jax.ShapeDtypeStruct(A.shape, jnp.float32),
        vmap_method="broadcast_all",
    )
    return call(A.astype(jnp.float32), beta.astype(jnp.float32))


def forward_ffi(bank, k_idx, q_idx, v, beta, p1, minv, save, segments=None, in_place=False):
    """The forward chunk loop (docs/DESIGN.md "Forward steps").

    Args:
      bank: `[..., P, K, D]` float32 or bfloat16, the initial bank. Without `segments` the final bank is a new
        buffer: the CUDA kernels read each row from `bank` until its first write, so no whole-bank copy is made
        whether or not `bank` is donated. With `segments` it is updated in place (aliased to the returned bank:
        donate it to avoid a copy).
      k_idx, q_idx, v, beta: `[..., NC, P, C, W|R|D]` / `[..., NC, P, C]` (kernel layout).
      p1: Phase 1's outputs (`Phase1`) in the same layout; minv: the solve's `[..., NC, P, C, C]`.
      save: keep the residuals for the backward (else they come back empty and nothing is saved).
      in_place: without `segments`, the final bank aliases `bank` (updated in place: the chunk loop of a
        forward in slabs carries the bank from one slab to the next without copying it).
      segments: None, or for packed sequences `(initial, local, seg0)`: the initial bank (like `bank`), each
        token's segment counted from its chunk's first `[..., NC, P, C]` and each chunk's first segment
        `[..., NC, P]` (int32; `segments.chunk_segments`). `p1` must then come from the virtual slot ids
        (`segments.virtual_slots`); `k_idx` and `q_idx` are the real ones.

    Returns:
      `(final_bank, y, delta, vg, snapshot)`; `y`, `delta` and `vg = v - G` (G the gathers of the write lanes, the
      backward's only use of `v`) float32, `snapshot` in the bank's dtype. With
      `segments`, the final bank is the working bank (each row that of its stamp's segment) and two more
      results follow: the stamps `[..., P, K]` int32 (each row's segment of its last write) and, with `save`,
      the stamps' snapshot `[..., NC, P, C*W]` int32.
    """
    C, W = k_idx.shape[-2:]
    D = bank.shape[-1]
    tokens = k_idx.shape[:-1]
    f32, i32 = jnp.float32, jnp.int32

    def residual(shape, dtype):
        return jax.ShapeDtypeStruct(shape if save else (0,), dtype)

    results = (jax.ShapeDtypeStruct(bank.shape, bank.dtype), jax.ShapeDtypeStruct(tokens + (D,), f32),
               residual(tokens + (D,), f32), residual(tokens + (D,), f32),
               residual(tokens[:-1] + (C * W, D), bank.dtype), _workspace(bank, k_idx, q_idx, forward=True))
    args = (bank, k_idx.astype(i32), q_idx.astype(i32), v.astype(f32), beta.astype(f32),
            p1.k_eff, p1.w, p1.cpe, p1.q_w, p1.QK, p1.w_order, p1.w_group, minv)
    if segments is None:
        call = jax.ffi.ffi_call("sdm_forward", results, vmap_method="broadcast_all",
                                input_output_aliases={0: 0} if in_place else None)
        return call(*args)[:5]
    initial, local, seg0 = segments
    results += (jax.ShapeDtypeStruct(bank.shape[:-1], i32), residual(tokens[:-1] + (C * W,), i32))
    call = jax.ffi.ffi_call("sdm_forward_packed", results, vmap_method="broadcast_all", input_output_aliases={0: 0})
    outs = call(*args, initial.astype(bank.dtype), local.astype(i32), seg0.astype(i32))
    return outs[:5] + outs[6:]


def _workspace(bank, k_idx, q_idx, forward):
    """The steps' scratch (kernels/steps.h `forward_workspace_floats` / `backward_workspace_floats`), float32: per
    problem (leading dims of the bank `[..., P, K, D]`) `3 * P * C * D` floats rounded up to a multiple of 4, then 4
    per slot group (the forward's write groups, `k_idx.size`; the backward's write and read groups of
    `_table_chunks(NC)` chunks only: a ring rebuilt per batch of chunks), then one per bank row (each slot's first
    writing step) and one per gather lane (the write lanes, and the forward's read lanes); the backward's row of
    zeros last."""
    P, D, NC, C = bank.shape[-3], bank.shape[-1], k_idx.shape[-4], k_idx.shape[-2]
    rows = math.prod(bank.shape[:-3]) * ((3 * P * C * D + 3) // 4 * 4)
    ring = math.prod(bank.shape[:-2]) * _table_chunks(NC) * C  # tokens of table_chunks chunks of every stream
    groups = k_idx.size if forward else ring * (k_idx.shape[-1] + q_idx.shape[-1])
    tags = k_idx.size + (q_idx.size if forward else 0)
    zero_row = 0 if forward else (D + 3) // 4 * 4 + 4  # the backward's row of zeros, 16-byte aligned
    return jax.ShapeDtypeStruct((rows + 4 * groups + math.prod(bank.shape[:-1]) + tags + zero_row,), jnp.float32)


def backward_ffi(bank, dbank, dy, k_idx, q_idx, beta, p1, minv, delta, vg, snapshot, segments=None):
    """The reverse chunk loop (docs/DESIGN.md "Backward steps").

    `bank` is the final bank (it comes back as the initial one, restored in place) and `dbank` the cotangent of
    the final bank, or for a zero cotangent an empty `[..., P, 0, D]` array (no bank-sized buffer of zeros). The
    gradient of the initial bank comes back in `dbank`'s buffer (aliased) with `segments`; else in a buffer of its
    own, and `dbank` is left as it is (the CUDA kernels read each row of it until its first write: no whole-bank
    copy of a `dbank` the caller keeps). `dbank`'s dtype is the working
    gradient bank's: float32, or the bank's bfloat16 (float32 inside each step, rounded once per written row).
    `dy`, the readings' cotangent `[..., NC, P, C, D]`, goes to the kernels in the bank's dtype (they widen it on
    load): the readings leave the op in that dtype, so their cotangent is exact there at half float32's bytes.

    `segments`: None, or for packed sequences `(initial, local, seg0, stamp, stamp_snapshot, dinitial)`: those
    of `forward_ffi` (`bank` then is its working bank, `stamp` its final stamps) and `dinitial`, the cotangent of
    the initial bank so far (dbank's dtype): the gradient of the reads of stale rows is added to it.

    Returns:
      `(initial_bank, dbank, dk_eff, dw, dcpe, dq_w, dA, dQK, dbeta, dv)`, then `dinitial` with `segments`; the
      initial bank's whole gradient is then `dbank + dinitial`.
    """
    f32, i32 = jnp.float32, jnp.int32
    like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
    results = (like(bank), jax.ShapeDtypeStruct(bank.shape, dbank.dtype), like(p1.k_eff), like(p1.w), like(p1.cpe),
               like(p1.q_w), like(p1.A), like(p1.QK), like(beta.astype(f32)), jax.ShapeDtypeStruct(dy.shape, f32),
               _workspace(bank, k_idx, q_idx, forward=False))
    args = (bank, dbank, dy.astype(bank.dtype), k_idx.astype(i32), q_idx.astype(i32),
            beta.astype(f32), p1.k_eff, p1.w, p1.cpe, p1.q_w, p1.A, p1.QK, p1.w_order,
            p1.w_group, p1.r_order, p1.r_group, minv, delta, vg, snapshot)
    if segments is None:
        call = jax.ffi.ffi_call("sdm_backward", results, vmap_method="broadcast_all", input_output_aliases={0: 0})
        return call(*args)[:10]
    initial, local, seg0, stamp, stamp_snapshot, dinitial = segments
    n = len(args)  # the stamps and dinitial are updated in place, like the bank and dbank
    call = jax.ffi.ffi_call("sdm_backward_packed", results + (like(stamp), like(dbank)), vmap_method="broadcast_all",
                            input_output_aliases={0: 0, 1: 1, n + 3: len(results), n + 5: len(results) + 1})
    outs = call(*args, initial.astype(bank.dtype), local.astype(i32), seg0.astype(i32), stamp.astype(i32),
                stamp_snapshot.astype(i32), dinitial.astype(dbank.dtype))
    return outs[:10] + outs[-1:]


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
    call = jax.ffi.ffi_call(
        "sdm_decode_step",
        (jax.ShapeDtypeStruct(bank.shape, bank.dtype), jax.ShapeDtypeStruct(v.shape, bank.dtype)),
        vmap_method="broadcast_all",
        input_output_aliases={0: 0},
    )
    return call(bank, k_idx.astype(i32), k_val, x.astype(f32), v, beta.astype(f32), q_idx.astype(i32), q_val)


def token_recurrence_ffi(bank, k_idx, k_val, x, v, beta, q_idx, q_val):
    """The token recurrence in one kernel, the CPU's no-grad forward (docs/DESIGN.md "No-grad forward on the CPU").

    Args:
      bank: `[..., P, K, D]` float32 or bfloat16, the initial bank. The final bank is a new buffer (the kernel
        copies each stream's rows in the thread that runs the stream: in parallel, and into its cache).
      k_idx, k_val, x: `[..., NC, P, C, W]` write slot ids (cast to int32), weights and per-lane log-gates (cast to
        float32), in kernel layout; `v` `[..., NC, P, C, D]`, `beta` `[..., NC, P, C]`, `q_idx`, `q_val`
        `[..., NC, P, C, R]` likewise. Tokens past the end carry ids outside `[0, K)`.

    Returns:
      `(y [..., NC, P, C, D] float32, final_bank, repeats [..., NC, P] int32)` as `forward_ffi` and Phase 1 give
      them: the readings, the bank after the last token, and per chunk the write lanes that repeat an earlier
      lane's slot in their token.
    """
    f32, i32 = jnp.float32, jnp.int32
    call = jax.ffi.ffi_call(
        "sdm_token_recurrence",
        (jax.ShapeDtypeStruct(bank.shape, bank.dtype), jax.ShapeDtypeStruct(v.shape, f32),
         jax.ShapeDtypeStruct(k_idx.shape[:-2], i32)),
        vmap_method="broadcast_all",
    )
    final, y, repeats = call(bank, k_idx.astype(i32), k_val.astype(f32), x.astype(f32), v.astype(f32),
                             beta.astype(f32), q_idx.astype(i32), q_val.astype(f32))
    return y, final, repeats
