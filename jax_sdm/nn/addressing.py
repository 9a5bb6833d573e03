"""Sparse addressing: which `k` of a head's `K` slots a token writes or reads, and with what scores.

Both functions return `(scores [..., k], slot_ids [..., k])`, best first. The slot ids are discrete; the scores
are gathered from the inputs, so gradients flow to the scores of the selected slots (and only to those).
"""
import math

import jax
import jax.numpy as jnp


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


def topk_slots(scores, k):
    """Top-`k` over all slots: `scores [..., K]` -> `(scores [..., k], slot_ids [..., k] int32)`."""
    if not 1 <= k <= scores.shape[-1]:
        raise ValueError(f"topk_slots: need 1 <= k <= K = {scores.shape[-1]}, got k = {k}")
    values, ids = jax.lax.top_k(scores, k)
    return values, ids.astype(jnp.int32)


def product_key_slots(factor_scores, k):
    """Top-`k` over the product of factors, without scoring all of them.

    `factor_scores` is a sequence of `F >= 1` arrays `[..., n_f]`; slot `(i_1, ..., i_F)` (mixed radix, the first
    factor most significant: `id = (i_1 * n_2 + i_2) * n_3 + ...`) scores `sum_f factor_scores[f][..., i_f]`.
    Returns the `k` best slots of all `prod(n_f)`, exactly: the top `k` of each factor, then factor by factor the
    top `k` of the sums of the candidates kept so far with the next factor's (a slot among the best `k` has
    every partial sum among the best `k` partial sums, so pruning to `k` at every step loses none).
    """
    factor_scores = list(factor_scores)
    total = math.prod(s.shape[-1] for s in factor_scores)
    if not factor_scores or not 1 <= k <= total:
        raise ValueError(f"product_key_slots: need at least one factor and 1 <= k <= {total} slots, got k = {k}")
    scores, ids = jax.lax.top_k(factor_scores[0], min(k, factor_scores[0].shape[-1]))
    for nxt in factor_scores[1:]:
        n = nxt.shape[-1]
        s2, i2 = jax.lax.top_k(nxt, min(k, n))
        pair_scores = (scores[..., :, None] + s2[..., None, :]).reshape(scores.shape[:-1] + (-1,))
        pair_ids = (ids[..., :, None] * n + i2[..., None, :]).reshape(ids.shape[:-1] + (-1,))
        scores, pos = jax.lax.top_k(pair_scores, min(k, pair_scores.shape[-1]))
        ids = jnp.take_along_axis(pair_ids, pos, axis=-1)
    return scores, ids.astype(jnp.int32)
