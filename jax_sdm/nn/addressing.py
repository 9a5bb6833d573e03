"""Sparse addressing: which `k` of a head's `K` slots a token writes or reads, and with what scores.

Both functions return `(scores [..., k], slot_ids [..., k])`, best first. The slot ids are discrete; the scores
are gathered from the inputs, so gradients flow to the scores of the selected slots (and only to those).
"""
import functools
import math

import jax
import jax.numpy as jnp

import jax_sdm


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
    """Top-`k` over all slots: `scores [..., K]` -> `(scores [..., k], slot_ids [..., k] int32)`; among equal
    scores the smaller slot id comes first."""
    if not 1 <= k <= scores.shape[-1]:
        raise ValueError(f"topk_slots: need 1 <= k <= K = {scores.shape[-1]}, got k = {k}")
    # On a matrix of rows: XLA's fast top-k kernels match a matrix (on a higher rank it may sort every row).
    values, ids = jax.lax.top_k(scores.reshape(-1, scores.shape[-1]), k)
    return values.reshape(scores.shape[:-1] + (k,)), ids.astype(jnp.int32).reshape(scores.shape[:-1] + (k,))


def product_key_slots(factor_scores, k, *, impl="auto"):
    """Top-`k` over the product of factors, exactly, without scoring all of them: `jax_sdm.product_key_topk` on
    the factors' scores side by side.

    `factor_scores` is a sequence of `F >= 1` arrays `[..., n_f]` (float32 or bfloat16); slot `(j_1, ..., j_F)`
    (mixed radix, the first factor most significant: `id = (j_1 * n_2 + j_2) * n_3 + ...`) scores
    `sum_f factor_scores[f][..., j_f]` (in float32, in factor order). Returns `(scores [..., k] float32,
    slot_ids [..., k] int32)`, the best `k` of all `prod(n_f)` slots, best first, ties by the factors' rank
    tuples (docs/MATH.md "Product-key top-k"); only the rank tuples with `prod(r_f + 1) <= k` are scored.
    Gradients reach the selected slots' factor scores only. `impl` as for `product_key_topk`.
    """
    factor_scores = list(factor_scores)
    if not factor_scores:
        raise ValueError("product_key_slots: need at least one factor")
    sizes = tuple(int(s.shape[-1]) for s in factor_scores)
    if not 1 <= k <= math.prod(sizes):
        raise ValueError(f"product_key_slots: need 1 <= k <= {math.prod(sizes)} slots (factors {sizes}), got k = {k}")
    lead = factor_scores[0].shape[:-1]
    if any(s.shape[:-1] != lead for s in factor_scores):
        raise ValueError(f"product_key_slots: the factors' leading shapes differ: "
                         f"{[tuple(s.shape) for s in factor_scores]}")
    dtype = functools.reduce(jnp.promote_types, [s.dtype for s in factor_scores])
    x = jnp.concatenate([s.astype(dtype) for s in factor_scores], axis=-1)
    return jax_sdm.product_key_topk(x, sizes, k, impl=impl)
