"""The CUDA product-key top-k against the CPU kernel (bitwise, forward and backward) and the brute force over all
slots, and its determinism (GPU only; skipped elsewhere)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm import product_key_topk

from .helpers import product_key_brute_force as brute_force_ids
from .helpers import product_key_scores as random_scores
from .helpers import product_key_slot_scores as slot_scores

CASES = [  # (factors, k, leading shape)
    ((256, 256), 64, (16384,)),  # the layer's addressing at B 4, T 4096, H 1
    ((128, 128), 32, (2, 16384)),
    ((64, 32, 32), 64, (4096,)),
    ((3, 5, 7), 105, (5, 3)),
    ((8, 512), 64, (37,)),
    ((300,), 64, (9,)),
    ((1500,), 200, (7,)),  # one factor past 1024 entries
    ((256, 256), 256, (33,)),  # 1466 candidates
    ((1500, 1500), 64, (5,)),  # backward rows of two tiles
    ((65535,), 16, (3,)),  # bfloat16: the smallest factor of 64-bit composites
]


def fresh_seed():
    return int(np.random.SeedSequence().entropy % 100_000)


def run(device, x, factors, k, ct, impl="ffi"):
    """Forward and the gradient of `sum(scores * ct)` on `device`, jitted."""
    def f(a, c):
        (scores, ids), vjp = jax.vjp(lambda b: product_key_topk(b, factors, k, impl=impl), a)
        return scores, ids, vjp((c, np.zeros(ids.shape, jax.dtypes.float0)))[0]
    return jax.device_get(jax.jit(f)(jax.device_put(x, device), jax.device_put(ct, device)))


def bits(a):
    a = np.asarray(a)
    return a.view(np.int16 if a.dtype.itemsize == 2 else np.int32)


@pytest.mark.parametrize("kind", ["normal", "ints", "special"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_gpu_matches_cpu_kernel_and_brute_force(case, dtype, kind):
    factors, k, lead = CASES[case]
    seed = fresh_seed()
    x = random_scores(seed, lead, factors, kind, dtype)
    ct = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(lead + (k,)), jnp.float32)
    gpu = run(jax.devices()[0], x, factors, k, ct)
    cpu = run(jax.devices("cpu")[0], x, factors, k, ct)
    for name, a, b in zip(("scores", "ids", "dx"), gpu, cpu):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"{name}, seed {seed}")
    xla = run(jax.devices()[0], x, factors, k, ct, impl="xla")  # pure JAX on the GPU: the same forward bits
    for name, a, b in zip(("scores", "ids"), gpu, xla):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"{name} (xla), seed {seed}")
    rows = x.reshape(-1, x.shape[-1])[:64]  # the brute force scores every slot: a few rows
    expected = brute_force_ids(rows, factors, k)
    np.testing.assert_array_equal(gpu[1].reshape(-1, k)[:64], expected, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(bits(gpu[0].reshape(-1, k)[:64]), bits(slot_scores(rows, factors, expected)))


@pytest.mark.parametrize("factors,k", [((128, 128), 32), ((40, 72), 20), ((3, 5), 15),  # top lists of 32
                                       ((256, 256), 64), ((100, 37), 50), ((256, 5), 64)])  # of 64
def test_gpu_matches_cpu_kernel_with_infinities_of_both_signs(factors, k):
    """Many rows of two short bfloat16 factors (a thread a row) with +inf and -inf in both factors: rows whose sums
    meet +inf + -inf rank the table's candidates one by one, the others merge the lists; both as the CPU kernel."""
    seed = fresh_seed()
    x = random_scores(seed, (4096,), factors, "infinities", jnp.bfloat16)
    ct = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((4096, k)), jnp.float32)
    gpu = run(jax.devices()[0], x, factors, k, ct)
    cpu = run(jax.devices("cpu")[0], x, factors, k, ct)
    for name, a, b in zip(("scores", "ids", "dx"), gpu, cpu):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"{name}, seed {seed}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_is_bitwise_deterministic(dtype):
    factors, k, lead = (256, 256), 64, (16384,)
    x = random_scores(7, lead, factors, "normal", dtype)
    ct = jnp.asarray(np.random.default_rng(8).standard_normal(lead + (k,)), jnp.float32)
    first = run(jax.devices()[0], x, factors, k, ct)
    for _ in range(3):
        again = run(jax.devices()[0], x, factors, k, ct)
        for name, a, b in zip(("scores", "ids", "dx"), first, again):
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=name)
