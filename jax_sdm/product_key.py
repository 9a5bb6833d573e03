"""`product_key_topk`: the exact top-k over the slots of a product key, without scoring them all.

A product key addresses `K = n_1 * ... * n_F` slots with `n_1 + ... + n_F` scores: slot `(i_1, ..., i_F)` scores the
sum of its factors' scores. The best `k` slots lie among the few rank tuples whose ranks multiply to at most `k`
(about `k ln k` of them for two factors), so only those are scored (docs/DESIGN.md "Product-key top-k").
"""
from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import lowering, sharding

IMPLS = ("auto", "ffi", "xla")
TARGET = "sdm_product_key_topk"
TARGET_BWD = "sdm_product_key_topk_bwd"
MAX_K = 256  # kernels/product_key_topk.h: kProductKeyMaxK
MAX_SLOTS = 2**31  # the slot ids are int32
MAX_CANDIDATES = 2**20  # rank tuples scored per row
FFI_MAX_FACTORS = 32  # kernels/product_key_topk.h: kProductKeyMaxFactors


@functools.lru_cache(maxsize=None)
def candidate_ranks(factors, k):
    """The rank tuples that can hold one of the best `k` slots: `(r_1, ..., r_F)` with `0 <= r_f < min(k, n_f)` and
    `prod(r_f + 1) <= k`, in lexicographic order, as a read-only int32 array `[F, C]` (factor-major).

    280 tuples for `factors = (256, 256)` and `k = 64`, 119 for `(128, 128)` and `k = 32`, 732 for `(64, 32, 32)`
    and `k = 64`. Raises `ValueError` past `MAX_CANDIDATES`.
    """
    ranks = np.zeros((0, 1), np.int64)  # [F so far, C so far]
    budget = np.array([k], np.int64)  # floor(k / prod(r_f + 1)) of each prefix: its next rank stays below it
    for n in factors:
        counts = np.minimum(budget, min(k, n))
        if counts.sum() > MAX_CANDIDATES:
            raise ValueError(
                f"product_key_topk: factors {factors} with k = {k} have more than {MAX_CANDIDATES} candidate rank "
                "tuples (many small factors); use fewer, larger factors")
        parent = np.repeat(np.arange(budget.size), counts)  # each prefix's children in order: lexicographic
        rank = np.arange(parent.size) - np.repeat(np.cumsum(counts) - counts, counts)
        ranks = np.concatenate([ranks[:, parent], rank[None]], axis=0)
        budget = budget[parent] // (rank + 1)
    out = ranks.astype(np.int32)
    out.setflags(write=False)
    return out


def _check_args(factor_scores, factors, k, impl):
    """Checked `(factor_scores, factors, k)` (an array, a tuple of ints, an int)."""
    op = "product_key_topk"
    if impl not in IMPLS:
        raise ValueError(f"{op}: `impl` must be one of {IMPLS}, got {impl!r}")
    if not isinstance(factors, (tuple, list)) or not factors:
        raise TypeError(f"{op}: `factors` must be a non-empty tuple of positive ints (n_1, ..., n_F), got {factors!r}")
    try:
        factors = tuple(operator.index(n) for n in factors)
    except TypeError:
        raise TypeError(f"{op}: `factors` must be a tuple of positive ints, got {factors!r}") from None
    if any(isinstance(n, bool) for n in factors) or min(factors) < 1:
        raise ValueError(f"{op}: `factors` must be positive ints, got {factors}")
    slots = math.prod(factors)
    if slots > MAX_SLOTS:
        raise ValueError(f"{op}: `factors` {factors} give {slots} slots, more than 2^31 (the slot ids are int32)")
    try:
        k = operator.index(k)
    except TypeError:
        raise TypeError(f"{op}: `k` must be a static int, got {k!r}") from None
    if not 1 <= k <= min(slots, MAX_K):
        raise ValueError(f"{op}: `k` must be in [1, min(prod(factors) = {slots}, {MAX_K})], got {k}")
    factor_scores = jnp.asarray(factor_scores)
    if factor_scores.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"{op}: `factor_scores` must be float32 or bfloat16, got {factor_scores.dtype}")
    if factor_scores.ndim < 1 or factor_scores.shape[-1] != sum(factors):
        raise ValueError(
            f"{op}: `factor_scores` has shape {factor_scores.shape}, expected [..., sum(factors) = {sum(factors)}] "
            f"(the scores of the factors {factors}, side by side)")
    if len(factors) > 1:
        candidate_ranks(factors, k)  # its limit, at trace time
    return factor_scores, factors, k


def _order(scores):
    """Positions of `scores [..., N]` best first: higher score first (NaN last, -0 equal to +0), equal scores by
    the smaller position (a stable sort)."""
    iota = lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1)
    return lax.sort((-scores, iota), dimension=scores.ndim - 1, num_keys=1, is_stable=True)[1]


def _forward_xla(x, factors, k):
    """Pure JAX: each factor's top `min(k, n_f)` by a stable sort, the candidates' sums, their top `k`."""
    x = x.astype(jnp.float32)
    tops = []  # per factor: (scores, indices) [..., m_f], best first
    offsets = np.cumsum((0,) + factors)
    for f, n in enumerate(factors):
        s = x[..., offsets[f]:offsets[f + 1]]
        idx = _order(s)[..., :min(k, n)]
        tops.append((jnp.take_along_axis(s, idx, axis=-1), idx))
    if len(factors) == 1:
        return _canonical_nan(tops[0][0]), tops[0][1]
    table = candidate_ranks(factors, k)
    sums = None  # in factor order, as the kernels add them
    for f, (s, _) in enumerate(tops):
        part = jnp.take(s, table[f], axis=-1)
        sums = part if sums is None else sums + part
    pos = _order(sums)[..., :k]
    ids = None
    for f, (_, idx) in enumerate(tops):
        i = jnp.take_along_axis(idx, jnp.asarray(table[f])[pos], axis=-1)
        ids = i if ids is None else ids * factors[f] + i
    return _canonical_nan(jnp.take_along_axis(sums, pos, axis=-1)), ids


def _canonical_nan(scores):
    """Every NaN score as the one quiet NaN (bits 0x7fc00000), as the kernels write it: a GPU add that meets a NaN
    makes another NaN than a CPU add does."""
    return jnp.where(jnp.isnan(scores), jnp.float32(np.nan), scores)


def candidate_table(factors, k):
    """The kernels' candidate table `[F, C]` (for one factor, its unused ranks `0..k-1`)."""
    if len(factors) == 1:
        return np.arange(k, dtype=np.int32)[None]
    return candidate_ranks(factors, k)


def _forward_ffi(x, factors, k):
    """The kernels (C++ on CPU, CUDA on GPU), one call, row-partitioned under SPMD (`sharding.rowwise`: each device
    ranks its own rows; an FFI call alone would make XLA gather every row onto every device)."""
    return sharding.rowwise(_forward_ffi_local, (factors, k), (x, jnp.asarray(candidate_table(factors, k))),
                            replicated=(1,))


def _forward_ffi_local(static, x, table):
    factors, k = static
    lead = x.shape[:-1]
    call = jax.ffi.ffi_call(
        TARGET,
        (jax.ShapeDtypeStruct(lead + (k,), jnp.float32), jax.ShapeDtypeStruct(lead + (k,), jnp.int32)),
        vmap_method="broadcast_all",  # the table too: the handler reads its first copy
    )
    return tuple(call(x, table, factors=np.asarray(factors, np.int64), k=np.int64(k)))


def _factor_indices(ids, factors):
    """The slots' per-factor indices `i_f` of `ids [..., k]` (mixed radix, the first factor most significant)."""
    out, weight = [], math.prod(factors)
    for n in factors:
        weight //= n
        out.append((ids // weight) % n)
    return out


def _backward_xla(dscores, ids, factors, dtype):
    """`d factor_scores[..., o_f + i] = sum_j dscores[..., j] [i_f(j) == i]`, as compare-selects reduced over `j` (no
    scatter: XLA's GPU scatter-add does not promise an order for repeated indices)."""
    parts = []
    for n, i in zip(factors, _factor_indices(ids, factors)):
        hit = i[..., :, None] == lax.broadcasted_iota(jnp.int32, (1,) * i.ndim + (n,), i.ndim)
        parts.append(jnp.sum(jnp.where(hit, dscores[..., :, None], 0.0), axis=-2))
    return jnp.concatenate(parts, axis=-1).astype(dtype)


def _backward_ffi(dscores, ids, factors, dtype):
    """The kernels: per row and factor, the cotangents added in selection order into a zeroed row (row-partitioned
    as the forward)."""
    return sharding.rowwise(_backward_ffi_local, (factors, np.dtype(dtype)), (dscores, ids))[0]


def _backward_ffi_local(static, dscores, ids):
    factors, dtype = static
    call = jax.ffi.ffi_call(
        TARGET_BWD, jax.ShapeDtypeStruct(ids.shape[:-1] + (sum(factors),), dtype), vmap_method="broadcast_all")
    return (call(dscores, ids, factors=np.asarray(factors, np.int64)),)


_FORWARD = {"xla": _forward_xla, "ffi": _forward_ffi}
_BACKWARD = {"xla": _backward_xla, "ffi": _backward_ffi}


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _topk(x, factors, k, impl, dtype):
    return _FORWARD[impl](x, factors, k)


def _topk_fwd(x, factors, k, impl, dtype):
    scores, ids = _FORWARD[impl](x, factors, k)
    return (scores, ids), ids


def _topk_bwd(factors, k, impl, dtype, ids, cotangents):
    dscores, _ = cotangents  # the ids have no gradient
    return (_BACKWARD[impl](dscores.astype(jnp.float32), ids, factors, dtype),)


_topk.defvjp(_topk_fwd, _topk_bwd)


def product_key_topk(factor_scores, factors, k, *, impl="auto"):
    """The best `k` of the `prod(factors)` slots of a product key, exactly, best first.

    Slot `(i_1, ..., i_F)` (`0 <= i_f < n_f`) has id `((i_1 * n_2 + i_2) * n_3 + ...) * n_F + i_F` (mixed radix, the
    first factor most significant) and score `factor_scores[..., o_1 + i_1] + ... + factor_scores[..., o_F + i_F]`
    (`o_f = n_1 + ... + n_{f-1}`), summed in float32 in factor order by every impl.

    Order. Scores compare as numbers, except that NaN ranks below every number and -0 equals +0. Each factor ranks
    its entries by score, best first, equal scores by the smaller index: `r_f(i)` is entry `i`'s position in that
    order. Slots rank by score, best first, and equal scores by their rank tuples `(r_1(i_1), ..., r_F(i_F))` in
    lexicographic order. This order is total, so the result is unique. Among slots of equal score whose factor
    scores are also equal (ties of equal entries), it is the order of the slot ids; for `F = 1` it is always.

    Why only `C` candidates need scoring: if `prod(r_f + 1) > k` for a slot `s` of ranks `r`, every rank tuple
    `r' <= r` (componentwise) is another slot `s'` whose factor scores are each at least `s`'s, so `score(s') >=
    score(s)`: floating-point addition is monotone (rounding is), overflow and NaN included, as long as no sum meets
    `+inf` and `-inf`. If `score(s') > score(s)`, `s'` comes first; if equal, `s'` comes first too, since `r' <= r`,
    `r' != r`, is lexicographically smaller. So at least `prod(r_f + 1) - 1 >= k` slots come before `s`, and only the
    tuples with `prod(r_f + 1) <= k` (`candidate_ranks`) can be among the best `k`: the top `min(k, n_f)` of each
    factor, their candidates' sums, and the top `k` of those give exactly the top `k` of all slots.
    (A tie rule by slot id alone would not survive this pruning: with one entry `1e8` in the first factor and
    `[0.25, 0.5]` in the second, both slots score `1e8` in float32; the smaller id, 0, has rank 1 in the second
    factor and `k = 1` keeps only rank 0.)

    Gradients flow to the selected slots' factor scores: `d factor_scores[..., o_f + i]` is the sum of the
    cotangents of the selected slots whose factor-`f` index is `i` (in the input's dtype), deterministic on every
    platform (no scatter-add). The slot ids have none.

    Args:
      factor_scores: `[..., n_1 + ... + n_F]` float32 or bfloat16 (the factors' scores side by side; any leading
        shape).
      factors: static tuple `(n_1, ..., n_F)` of positive ints, `prod(factors) <= 2^31`.
      k: static int, `1 <= k <= min(prod(factors), 256)`.
      impl: "auto" (the kernels where this build has them for the backend, else "xla"), "ffi" (the kernels: C++ on
        CPU, CUDA on GPU, at most 32 factors) or "xla" (pure JAX). They give the same bits (inputs with subnormal
        numbers aside: XLA's CPU backend flushes them to zero, the kernels do not).

    Returns:
      `(scores [..., k] float32, slot_ids [..., k] int32)`, best first.
    """
    x, factors, k = _check_args(factor_scores, factors, k, impl)
    if impl in ("auto", "ffi"):
        platform = jax.default_backend()
        if not lowering.is_registered(TARGET, platform):
            if impl == "ffi":
                raise NotImplementedError(
                    f"product_key_topk: impl='ffi' has no {platform} kernel ({TARGET}) in this build; use "
                    "impl='xla' (pure JAX; impl='auto' picks it here)")
            impl = "xla"
        elif len(factors) > FFI_MAX_FACTORS:
            raise ValueError(
                f"product_key_topk: the kernels (impl='{impl}') take at most {FFI_MAX_FACTORS} factors, got "
                f"{len(factors)}; impl='xla' takes any number")
        else:
            impl = "ffi"
    return _topk(x, factors, k, impl, np.dtype(x.dtype))
