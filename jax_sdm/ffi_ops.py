"""``jax.ffi.ffi_call`` wrappers of the jax_sdm kernels, with the shape logic.

Kernel layout and outputs: docs/DESIGN.md. Leading dimensions before the
per-unit ones are a batch shape: they are flattened to ``N`` for the kernel and
restored on the results.
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
    k_idx = jnp.asarray(k_idx)
    q_idx = jnp.asarray(q_idx)
    if k_idx.ndim < 2:
        raise ValueError(f"phase1_ffi: k_idx must be [..., C, W], got shape {k_idx.shape}")
    if q_idx.ndim < 2:
        raise ValueError(f"phase1_ffi: q_idx must be [..., C, R], got shape {q_idx.shape}")
    shape_w = tuple(k_idx.shape)
    for name, a in (("k_val", k_val), ("x", x)):
        if tuple(jnp.shape(a)) != shape_w:
            raise ValueError(
                f"phase1_ffi: {name} has shape {tuple(jnp.shape(a))}, expected the shape "
                f"of k_idx {shape_w}")
    shape_r = tuple(q_idx.shape)
    if tuple(jnp.shape(q_val)) != shape_r:
        raise ValueError(
            f"phase1_ffi: q_val has shape {tuple(jnp.shape(q_val))}, expected the shape "
            f"of q_idx {shape_r}")
    if shape_r[:-1] != shape_w[:-1]:
        raise ValueError(
            f"phase1_ffi: q_idx shape {shape_r} and k_idx shape {shape_w} must agree "
            f"in all but the last dim ([..., C])")
    try:
        K = int(num_slots)
    except TypeError:
        raise TypeError(
            f"phase1_ffi: num_slots must be a static Python int, got {num_slots!r}") from None
    if not 0 <= K < 2**31:
        raise ValueError(f"phase1_ffi: num_slots must be in [0, 2^31), got {K}")

    batch = shape_w[:-2]
    C, W = shape_w[-2:]
    R = shape_r[-1]
    N = math.prod(batch)

    def flat(a, dtype, lanes):
        return jnp.asarray(a).astype(dtype).reshape(N, C, lanes)

    args = (
        flat(k_idx, jnp.int32, W),
        flat(k_val, jnp.float32, W),
        flat(x, jnp.float32, W),
        flat(q_idx, jnp.int32, R),
        flat(q_val, jnp.float32, R),
    )
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
        [jax.ShapeDtypeStruct((N,) + s, d) for s, d in out_shapes],
        vmap_method="sequential",
    )
    outs = call(*args, num_slots=np.int64(K))
    outs = [o.reshape(batch + s) for o, (s, _) in zip(outs, out_shapes)]
    return _phase1_result(outs)


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
    batch = tuple(A.shape[:-2])
    C = A.shape[-1]
    N = math.prod(batch)
    call = jax.ffi.ffi_call(
        "sdm_solve",
        jax.ShapeDtypeStruct((N, C, C), jnp.float32),
        vmap_method="sequential",
    )
    out = call(A.astype(jnp.float32).reshape(N, C, C),
               beta.astype(jnp.float32).reshape(N, C))
    return out.reshape(batch + (C, C))
