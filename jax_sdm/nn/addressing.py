"""Sparse addressing: which `k` of a head's `K` slots a token writes or reads, and with what scores.

Both functions return `(scores [..., k], slot_ids [..., k])`, best first. The slot ids are discrete; the scores
are gathered from the inputs, so gradients flow to the scores of the selected slots (and only to those).
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


def balanced_factors(num_slots, num_factors):
    """`num_factors` integers whose product is `num_slots`, as equal as possible, largest first.

    Each factor is the largest divisor of what remains that is at most its fair share (the root of what remains,
    by the number of factors left), so `balanced_factors(4096, 2) == (64, 64)` and `balanced_factors(96, 2) == (12, 8)`.
    """
    if num_slots < 1 or num_factors < 1:
        raise ValueError(f"balanced_factors: need num_slots >= 1 and num_factors >= 1, got {num_slots}, {num_factors}")
    factors = []
    rest = num_slots
    for left in range(num_factors, 1, -1):
        share = int(round(rest ** (1.0 / left)))
        f = max(d for d in range(1, share + 1) if rest % d == 0)
        factors.append(f)
        rest //= f
    factors.append(rest)
    factors = tuple(sorted(factors, reverse=True))
    assert math.prod(factors) == num_slots
    return factors


def _top_k(x, k):
    """`jax.lax.top_k` over the last axis, run on the rows flattened to a matrix (XLA's fast top-k kernels match a
    matrix; on a stack of higher rank it may sort every row in full)."""
    values, idx = jax.lax.top_k(x.reshape(-1, x.shape[-1]), k)
    return values.reshape(x.shape[:-1] + (k,)), idx.reshape(x.shape[:-1] + (k,))


def topk_slots(scores, k):
    """Top-`k` over all slots: `scores [..., K]` -> `(scores [..., k], slot_ids [..., k] int32)`; among equal
    scores the smaller slot id comes first."""
    if not 1 <= k <= scores.shape[-1]:
        raise ValueError(f"topk_slots: need 1 <= k <= K = {scores.shape[-1]}, got k = {k}")
    values, ids = _top_k(scores, k)
    return values, ids.astype(jnp.int32)


@functools.lru_cache(maxsize=None)
def candidate_ranks(sizes, k):
    """The rank tuples that can hold one of the best `k` of a product of factors of `sizes`: every
    `(i_1, ..., i_F)` with `0 <= i_f < sizes[f]` and `prod(i_f + 1) <= k`, in lexicographic order, as an int32
    array `[C, F]`. About `k (ln k)^(F-1) / (F-1)!` tuples (280 for `k = 64` and two factors, against `k^2 = 4096`)."""
    out = []

    def walk(prefix, budget):
        f = len(prefix)
        if f == len(sizes):
            out.append(prefix)
            return
        for i in range(min(sizes[f], budget)):
            walk(prefix + (i,), budget // (i + 1))

    walk((), k)
    ranks = np.array(out, np.int32).reshape(-1, len(sizes))
    ranks.setflags(write=False)
    return ranks


def product_key_slots(factor_scores, k):
    """Top-`k` over the product of factors, exactly, without scoring all of them.

    `factor_scores` is a sequence of `F >= 1` arrays `[..., n_f]`; slot `(j_1, ..., j_F)` (mixed radix, the first
    factor most significant: `id = (j_1 * n_2 + j_2) * n_3 + ...`) scores `sum_f factor_scores[f][..., j_f]`
    (summed in factor order, in float32 or wider). Returns the `k` best of all `prod(n_f)` slots, best first.

    Order and ties: each factor ranks its entries by score, best first, equal scores by the smaller index (rank
    `i_f` is the position in that order). Slots are ordered by score, best first, and equal scores by their rank
    tuples `(i_1, ..., i_F)` in lexicographic order. This equals `jax.lax.top_k` over all `prod(n_f)` sums laid
    out in rank order, and `topk_slots` over the sums in slot order whenever no two slots' sums are equal.

    Why pruning is exact: a slot with ranks `(i_f)` scores at most each of the `prod(i_f + 1)` slots whose ranks
    are all `<=` its own (float addition is monotone), and every one of those comes before it in the order above
    (higher score, or an equal one and a lexicographically smaller rank tuple). So if `prod(i_f + 1) > k`, at
    least `k` slots come before it and it is not among the best `k`. Only the `candidate_ranks` tuples (every
    `prod(i_f + 1) <= k`) are scored: the top `min(k, n_f)` of each factor first (`jax.lax.top_k`), then the
    candidates' sums in lexicographic rank order and `jax.lax.top_k` over those (which keeps the first of equal
    sums, and so the order above).

    Gradients reach the selected slots' factor scores only.
    """
    factor_scores = list(factor_scores)
    if not factor_scores:
        raise ValueError("product_key_slots: need at least one factor")
    sizes = tuple(int(s.shape[-1]) for s in factor_scores)
    total = math.prod(sizes)
    if not 1 <= k <= total:
        raise ValueError(f"product_key_slots: need 1 <= k <= {total} slots (factors {sizes}), got k = {k}")
    lead = factor_scores[0].shape[:-1]
    if any(s.shape[:-1] != lead for s in factor_scores):
        raise ValueError(f"product_key_slots: the factors' leading shapes differ: "
                         f"{[tuple(s.shape) for s in factor_scores]}")
    if len(factor_scores) == 1:
        return topk_slots(factor_scores[0], k)
    ks = tuple(min(k, n) for n in sizes)
    acc = functools.reduce(jnp.promote_types, [s.dtype for s in factor_scores], jnp.float32)
    # The factors' top values side by side, `[..., sum(ks)]`, taken by one gather below: a gather straight from a
    # top-k's values lets XLA fold the top-k's slice into it, and the top-k becomes a full sort of every row.
    if len(set(sizes)) == 1:  # equal factors: one top-k for all of them (fewer, larger kernels)
        values, idx = _top_k(jnp.stack(factor_scores), ks[0])
        values = jnp.moveaxis(values, 0, -2).reshape(lead + (-1,))
        idx = jnp.moveaxis(idx, 0, -2).reshape(lead + (-1,))
    else:
        tops = [_top_k(s, kf) for s, kf in zip(factor_scores, ks)]
        values = jnp.concatenate([v for v, _ in tops], axis=-1)
        idx = jnp.concatenate([i for _, i in tops], axis=-1)
    scores, chosen = _best_candidates(k, ks, values.astype(acc))
    offsets = np.cumsum((0,) + ks[:-1])
    ids = jnp.zeros(scores.shape, jnp.int32)
    for f, (n, offset) in enumerate(zip(sizes, offsets)):
        ids = ids * n + jnp.take_along_axis(idx.astype(jnp.int32), chosen[f] + int(offset), axis=-1)
    return scores, ids


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _best_candidates(k, sizes, values):
    """The best `k` candidates of `candidate_ranks(sizes, k)` for the factors' sorted top scores side by side,
    `values [..., sum(sizes)]` (factor `f`'s `sizes[f]` best first): `(scores [..., k], chosen)`, `chosen[f]
    [..., k]` the selected slots' ranks in factor `f`."""
    ranks = candidate_ranks(sizes, k)
    offsets = np.cumsum((0,) + sizes[:-1])
    columns = (ranks + offsets).T.reshape(-1)  # [F * C], factor-major
    parts = values[..., columns].reshape(values.shape[:-1] + (len(sizes), -1))
    sums = parts[..., 0, :]
    for f in range(1, len(sizes)):
        sums = sums + parts[..., f, :]
    scores, pos = _top_k(sums, k)
    return scores, tuple(jnp.asarray(ranks[:, f])[pos] for f in range(len(sizes)))


@_best_candidates.defjvp
def _best_candidates_jvp(k, sizes, primals, tangents):
    # The tangent of a selected score is the sum of its factors' tangents, written as a masked sum over each
    # factor's ranks rather than a gather: its transpose (the gradient) is then a masked sum too, with one writer
    # per entry, where a gather's would be a scatter-add onto repeated ranks (atomics on a GPU).
    (values,), (d_values,) = primals, tangents
    scores, chosen = _best_candidates(k, sizes, values)
    offsets = np.cumsum((0,) + sizes[:-1])
    d_scores = sum(jnp.sum(jnp.where(c[..., :, None] == jnp.arange(n, dtype=c.dtype),
                                     d_values[..., None, int(o):int(o) + n], 0), axis=-1)
                   for c, n, o in zip(chosen, sizes, offsets))
    float0 = tuple(np.zeros(c.shape, jax.dtypes.float0) for c in chosen)
    return (scores, chosen), (d_scores.astype(scores.dtype), float0)


def product_key_brute_force(factor_scores, k):
    """`product_key_slots` by scoring all `prod(n_f)` slots (for tests and small `K`): each factor sorted by its
    order (a stable descending sort), the full grid of sums in rank order, `jax.lax.top_k` over it."""
    factor_scores = list(factor_scores)
    sizes = tuple(int(s.shape[-1]) for s in factor_scores)
    acc = functools.reduce(jnp.promote_types, [s.dtype for s in factor_scores], jnp.float32)
    orders = [jnp.argsort(-s.astype(acc), axis=-1, stable=True) for s in factor_scores]
    grid, ids = None, None
    for f, (s, order) in enumerate(zip(factor_scores, orders)):
        shape = s.shape[:-1] + tuple(sizes[g] if g == f else 1 for g in range(len(sizes)))
        part = jnp.take_along_axis(s.astype(acc), order, axis=-1).reshape(shape)
        idx = order.astype(jnp.int32).reshape(shape)
        grid = part if grid is None else grid + part
        ids = idx if ids is None else ids * sizes[f] + idx
    lead = factor_scores[0].shape[:-1]
    grid = grid.reshape(lead + (-1,))
    ids = jnp.broadcast_to(ids, lead + tuple(sizes)).reshape(lead + (-1,))
    scores, pos = jax.lax.top_k(grid, k)
    return scores, jnp.take_along_axis(ids, pos, axis=-1)
