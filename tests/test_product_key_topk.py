"""`product_key_topk` (CPU): every impl against a brute force over all `prod(factors)` slots, the impls bitwise
equal, gradients against `jax.vjp` of the brute force, determinism, jit and vmap, bad input."""
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm import product_key_topk
from jax_sdm.product_key import candidate_ranks

from .helpers import product_key_brute_force as brute_force_ids
from .helpers import product_key_scores as random_scores
from .helpers import product_key_slot_scores as slot_scores

IMPLS = ("xla", "ffi")


def fresh_seed():
    return int(np.random.SeedSequence().entropy % 100_000)


CASES = [  # (factors, k, leading shape)
    ((300,), 64, (3,)),
    ((5,), 5, (2, 2)),
    ((256, 256), 64, (4,)),
    ((16, 16), 256, (2,)),  # k = prod(factors)
    ((8, 512), 64, (3,)),  # k > n_1
    ((64, 32, 32), 64, (2,)),
    ((3, 5, 7), 105, (2,)),  # k = prod(factors)
    ((3, 5, 7), 1, (2, 3)),
    ((4, 1, 6), 10, (3,)),  # a factor of one entry
    ((128, 128), 32, (2, 1, 3)),  # several leading axes
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["normal", "ints", "equal", "special"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_brute_force(case, kind, impl):
    factors, k, lead = CASES[case]
    seed = fresh_seed()
    x = random_scores(seed, lead, factors, kind)
    scores, ids = product_key_topk(x, factors, k, impl=impl)
    assert scores.shape == ids.shape == lead + (k,)
    assert scores.dtype == jnp.float32 and ids.dtype == jnp.int32
    expected = brute_force_ids(x, factors, k)
    np.testing.assert_array_equal(ids, expected, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(scores, slot_scores(x, factors, expected), err_msg=f"seed {seed}")


@pytest.mark.parametrize("kind", ["normal", "ints", "special"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_ffi_and_xla_bitwise_equal(case, dtype, kind):
    factors, k, lead = CASES[case]
    x = random_scores(fresh_seed(), lead, factors, kind, dtype)
    a = product_key_topk(x, factors, k, impl="ffi")
    b = product_key_topk(x, factors, k, impl="xla")
    for u, v in zip(a, b):
        assert u.dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(u).view(np.int32), np.asarray(v).view(np.int32))


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_matches_brute_force(impl):
    factors, k = (64, 32, 32), 64
    x = random_scores(fresh_seed(), (3,), factors, "normal", jnp.bfloat16)  # bfloat16 values tie often
    scores, ids = product_key_topk(x, factors, k, impl=impl)
    expected = brute_force_ids(x, factors, k)
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_array_equal(scores, slot_scores(x, factors, expected))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_tie_by_rounding_keeps_the_rank_order(impl):
    # Both slots score 1e8 in float32; slot 1 (rank 0 in the second factor) comes first, as the pruning needs.
    x = jnp.asarray([1e8, 0.25, 0.5], jnp.float32)
    scores, ids = product_key_topk(x, (1, 2), 2, impl=impl)
    np.testing.assert_array_equal(ids, [1, 0])
    np.testing.assert_array_equal(scores, [1e8, 1e8])
    np.testing.assert_array_equal(brute_force_ids(x, (1, 2), 2), [1, 0])


def test_candidate_ranks_are_the_pruned_tuples_in_order():
    for factors, k in [((256, 256), 64), ((64, 32, 32), 64), ((3, 5, 7), 105), ((8, 512), 64), ((4, 1, 6), 10),
                       ((300,), 64)]:
        want = [t for t in itertools.product(*(range(min(k, n)) for n in factors))
                if math.prod(r + 1 for r in t) <= k]
        got = candidate_ranks(factors, k)
        assert got.dtype == np.int32 and got.shape == (len(factors), len(want))
        np.testing.assert_array_equal(got.T, np.array(want, np.int32).reshape(-1, len(factors)))
    assert candidate_ranks((256, 256), 64).shape[1] == 280


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", [0, 2, 4, 5, 6, 9])
def test_gradients_match_vjp_of_brute_force(case, dtype, impl):
    factors, k, lead = CASES[case]
    seed = fresh_seed()
    x = random_scores(seed, lead, factors, "normal", dtype)  # continuous: no ties (bfloat16 ties give equal grads)
    ids = brute_force_ids(x, factors, k)
    ct = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(lead + (k,)), jnp.float32)
    (scores, got_ids), vjp = jax.vjp(lambda a: product_key_topk(a, factors, k, impl=impl), x)
    np.testing.assert_array_equal(got_ids, ids)
    (dx,) = vjp((ct, np.zeros(got_ids.shape, jax.dtypes.float0)))
    ref_scores, ref_vjp = jax.vjp(lambda a: slot_scores(a, factors, ids), x)
    (ref,) = ref_vjp(ct)
    assert dx.dtype == x.dtype and dx.shape == x.shape
    # float32: an entry sums the cotangents of up to prod(factors) / n_f selected slots, in another order than the
    # brute force's transpose (35 terms of magnitude ~1 at (3, 5, 7): a few ulps of the sum)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol,
                               err_msg=f"seed {seed}")
    assert np.count_nonzero(np.asarray(dx, np.float32)) > 0


def test_gradient_is_sparse_and_sums_repeats():
    # Factor scores of the selected slots only; an entry shared by several selected slots sums their cotangents.
    factors, k = (4, 3), 5
    x = jnp.asarray(np.random.default_rng(fresh_seed()).standard_normal((2, 7)), jnp.float32)
    for impl in IMPLS:
        _, ids = product_key_topk(x, factors, k, impl=impl)
        ct = jnp.arange(1.0, 1.0 + 2 * k).reshape(2, k)
        dx = jax.grad(lambda a: jnp.sum(product_key_topk(a, factors, k, impl=impl)[0] * ct))(x)
        want = np.zeros((2, 7), np.float32)
        for r in range(2):
            for j, slot in enumerate(np.asarray(ids[r])):
                want[r, slot // 3] += ct[r, j]
                want[r, 4 + slot % 3] += ct[r, j]
        np.testing.assert_allclose(dx, want, rtol=1e-6)


def test_ffi_is_bitwise_deterministic():
    factors, k = (256, 256), 64
    x = random_scores(fresh_seed(), (64,), factors)
    ct = jnp.asarray(np.random.default_rng(3).standard_normal((64, k)), jnp.float32)
    f = jax.jit(jax.value_and_grad(lambda a: jnp.sum(product_key_topk(a, factors, k, impl="ffi")[0] * ct)))
    first = jax.device_get(f(x))
    for _ in range(3):
        again = jax.device_get(f(x))
        for u, v in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
            np.testing.assert_array_equal(np.asarray(u).view(np.int32), np.asarray(v).view(np.int32))


@pytest.mark.parametrize("impl", ["auto"] + list(IMPLS))
def test_jit_and_vmap(impl):
    factors, k = (64, 32, 32), 64
    x = random_scores(fresh_seed(), (3, 2), factors)
    plain = product_key_topk(x, factors, k, impl=impl)
    jitted = jax.jit(lambda a: product_key_topk(a, factors, k, impl=impl))(x)
    mapped = jax.vmap(lambda a: product_key_topk(a, factors, k, impl=impl))(x)
    mapped_rows = jax.vmap(jax.vmap(lambda a: product_key_topk(a, factors, k, impl=impl)), in_axes=1, out_axes=1)(x)
    for other in (jitted, mapped, mapped_rows):
        for u, v in zip(plain, other):
            np.testing.assert_array_equal(u, v)
    ct = jnp.asarray(np.random.default_rng(0).standard_normal((3, 2, k)), jnp.float32)
    loss = lambda a: jnp.sum(product_key_topk(a, factors, k, impl=impl)[0] * ct)
    per_row = jax.vmap(jax.grad(lambda a, c: jnp.sum(product_key_topk(a, factors, k, impl=impl)[0] * c)))(x, ct)
    np.testing.assert_allclose(jax.grad(loss)(x), per_row, rtol=1e-6)


def test_bad_input():
    x = jnp.zeros((2, 12), jnp.float32) + 0.5
    with pytest.raises(ValueError, match="`k` must be in \\[1, min\\(prod\\(factors\\) = 32, 256\\)\\], got 0"):
        product_key_topk(x, (4, 8), 0)
    with pytest.raises(ValueError, match="`k`.*got 33"):
        product_key_topk(x, (4, 8), 33)
    with pytest.raises(ValueError, match="`k`.*256.*got 257"):
        product_key_topk(jnp.zeros((2, 64)), (32, 32), 257)
    with pytest.raises(TypeError, match="`k` must be a static int"):
        product_key_topk(x, (4, 8), 2.0)
    with pytest.raises(ValueError, match=r"`factor_scores` has shape \(2, 12\), expected \[..., sum\(factors\) = 13\]"):
        product_key_topk(x, (4, 9), 2)
    with pytest.raises(TypeError, match="`factors` must be a non-empty tuple"):
        product_key_topk(x, 12, 2)
    with pytest.raises(TypeError, match="`factors` must be a non-empty tuple"):
        product_key_topk(x, (), 2)
    with pytest.raises(TypeError, match="`factors` must be a tuple of positive ints"):
        product_key_topk(x, (4.0, 8), 2)
    with pytest.raises(ValueError, match="`factors` must be positive ints"):
        product_key_topk(x, (13, 0, -1), 2)
    with pytest.raises(ValueError, match="more than 2\\^31"):
        product_key_topk(jnp.zeros((1, 3 * 2048)), (2048, 2048, 2048), 2)
    with pytest.raises(ValueError, match="candidate rank tuples"):
        product_key_topk(jnp.zeros((1, 48)), (2,) * 24, 256)
    with pytest.raises(TypeError, match="float32 or bfloat16, got int32"):
        product_key_topk(jnp.zeros((2, 12), jnp.int32), (4, 8), 2)
    with pytest.raises(ValueError, match="`impl` must be one of"):
        product_key_topk(x, (4, 8), 2, impl="cuda")
    with pytest.raises(ValueError, match="at most 32 factors.*impl='xla'"):
        product_key_topk(jnp.zeros((1, 33)), (1,) * 33, 1, impl="ffi")
    # The xla impl takes them.
    np.testing.assert_array_equal(product_key_topk(jnp.zeros((1, 33)), (1,) * 33, 1, impl="xla")[1], [[0]])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("factors", [(6,), (2, 3), (2, 1, 3)])
def test_every_nan_score_is_the_one_quiet_nan(factors, impl):
    # NaNs of other payloads and signs in, the one quiet NaN 0x7fc00000 out, whichever add made it (the kernels and
    # the pure-JAX path on any platform give the same bits).
    width, k = sum(factors), int(np.prod(factors))
    rng = np.random.default_rng(fresh_seed())
    bits = rng.standard_normal(width).astype(np.float32).view(np.uint32)
    nan_at = [rng.integers(factors[0] - 1), width - 1 - rng.integers(factors[-1] - 1)]  # first, last factor
    bits[nan_at] = [0x7fc00123, 0xffc00000]
    scores, ids = product_key_topk(jnp.asarray(bits.view(np.float32)), factors, k, impl=impl)
    got = np.asarray(scores).view(np.uint32)
    nan = np.isnan(np.asarray(scores))
    assert nan.any() and (~nan).any()
    assert np.all(got[nan] == 0x7fc00000), [hex(v) for v in got[nan]]
    assert not np.any(nan[:-1] & ~nan[1:])  # NaN ranks last
