"""impl="xla" (the chunked form in pure JAX) against the golden files and the token-loop reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm import sdm_reference, sdm_write_read
from jax_sdm.testing import random_problem

from .helpers import FLOAT_ARGS, check_against_reference, cotangents, outputs_and_grads, rel_err

xla_op = functools.partial(sdm_write_read, impl="xla")


@pytest.mark.slow  # the bfloat16 rounding points: test_ffi_op.py compares the kernels with this path
def test_xla_bfloat16_bank():
    args = random_problem(11, T=48, K=32, D=16, W=4, R=4, distinct=False, dtype=jnp.bfloat16)
    # The reference computes in float32 with a float32 bank; the chunked form rounds each written row to
    # bfloat16 once per chunk, which is the error the reference package itself shows (docs/MATH.md: about 4e-3).
    check_against_reference(xla_op, args, 16, 2e-2, 11)


@pytest.mark.slow  # three compilations per case; test_ffi_op.py checks the chunk sizes on the kernels
@pytest.mark.parametrize("chunk_sizes", [(1, 7, 16), (16, 64, 256)])
def test_xla_chunk_size_only_changes_rounding(chunk_sizes):
    args = random_problem(5, T=70, K=16, W=4, R=4, distinct=False, repeats=True)
    outs = [xla_op(**args, chunk_size=c) for c in chunk_sizes]
    for y, final in outs[1:]:
        assert rel_err(y, outs[0][0]) < 1e-5
        assert rel_err(final, outs[0][1]) < 1e-5


def test_xla_float64_agrees_to_1e10():
    with jax.enable_x64(True):
        args = random_problem(12, T=45, K=8, D=6, W=4, R=3, distinct=False, repeats=True, per_write_gates=True,
                              dtype=np.float64)
        dy, dbank = cotangents(12, args)
        y, final, g = outputs_and_grads(xla_op, args, dy, dbank, chunk_size=16)
        y_ref, final_ref, g_ref = outputs_and_grads(sdm_reference, args, dy, dbank)
        assert y.dtype == jnp.float64
        assert rel_err(y, y_ref) < 1e-10
        assert rel_err(final, final_ref) < 1e-10
        for k in FLOAT_ARGS:
            assert rel_err(g[k], g_ref[k]) < 1e-10, k


@pytest.mark.slow  # JAX batches the pure-JAX path; test_transformations.py checks vmap of the kernels
def test_xla_under_vmap():
    args = random_problem(13, B=1, T=20, K=16, W=3, R=2, distinct=False)
    stacked = {k: np.stack([v, v[..., ::-1] if k.endswith("idx") else 0.5 * v]) for k, v in args.items()}
    ys, finals = jax.vmap(lambda a: xla_op(**a, chunk_size=8))(stacked)
    for i in range(2):
        y, final = sdm_reference(**{k: v[i] for k, v in stacked.items()})
        assert rel_err(ys[i], y) < 1e-5 and rel_err(finals[i], final) < 1e-5


def test_xla_phase1_memory_grows_with_entries_times_chunk():
    """Phase 1's pair sums hold O(C * (W + R) * C) elements per unit, not O((C * W)^2): XLA's temporary buffers for
    a unit of C = 64 tokens, W = 64, R = 32 (6,144 entries) stay under 32 MB (pairwise masks over the 4,096 write
    entries would take more than 64 MB each)."""
    from jax_sdm.xla import phase1_xla

    C, W, R, K = 64, 64, 32, 1024
    i32, f32 = jax.ShapeDtypeStruct((1, C, W), jnp.int32), jax.ShapeDtypeStruct((1, C, W), jnp.float32)
    r32, rf = jax.ShapeDtypeStruct((1, C, R), jnp.int32), jax.ShapeDtypeStruct((1, C, R), jnp.float32)
    compiled = jax.jit(phase1_xla, static_argnums=5).lower(i32, f32, f32, r32, rf, K).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 32 * 2**20, f"{temp / 2**20:.1f} MB"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a bound on XLA's CPU buffer assignment")
def test_xla_gradient_memory_of_the_wide_problem():
    """The wide problem (B 1, T 300, K 1024, D 37, W 256, R 200, per-write gates, chunk 128): the compiled gradient's
    temporary buffers stay under 0.15 GB (measured 0.08 GB; 0.26 GB before Phase 1's pair sums went in blocks of
    tokens). Its peak process memory, compilation included, is in benchmarks/RESULTS.md."""
    B, T, H, K, D, W, R = 1, 300, 1, 1024, 37, 256, 200
    f32, i32 = jnp.float32, jnp.int32
    floats = dict(bank=((B, H, K, D), f32), k_val=((B, T, H, W), f32), v=((B, T, H, D), f32), beta=((B, T, H), f32),
                  g=((B, T, H, W), f32), q_val=((B, T, H, R), f32))
    ints = dict(k_idx=((B, T, H, W), i32), q_idx=((B, T, H, R), i32))
    spec = lambda d: {k: jax.ShapeDtypeStruct(*v) for k, v in d.items()}

    def loss(f, i):
        y, final = xla_op(**f, **i, chunk_size=128)
        return jnp.sum(y) + jnp.sum(final)

    compiled = jax.jit(jax.grad(loss)).lower(spec(floats), spec(ints)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 0.15 * 2**30, f"{temp / 2**30:.3f} GB"


@pytest.mark.parametrize("seed", [0] + [pytest.param(s, marks=pytest.mark.slow) for s in (1, 2)])
def test_xla_bfloat16_gradient_of_a_tiny_bank_rewritten_often(seed):
    """A bfloat16 bank of 2-3 rows, each written and read ~100 times in chunks of 100 tokens: the gradients keep the
    token loop's accuracy against a float64 token loop (the bank's gradient was at 3e-2 to 1e-1 while it was kept in
    bfloat16 between chunks: every gather's and read's contribution to a row rounded)."""
    from .helpers import token_loop64

    rng = np.random.default_rng(seed)
    K, T, W = int(rng.integers(2, 4)), int(rng.integers(200, 400)), int(rng.integers(1, 3))
    args = random_problem(seed, B=1, T=T, H=1, K=K, D=8, W=W, R=2, distinct=False, dtype=jnp.bfloat16)
    dy, dbank = cotangents(seed, args)
    with jax.enable_x64(True):
        wide = {k: np.asarray(v, np.float64) if k in FLOAT_ARGS else v for k, v in args.items()}
        y64, final64, g64 = token_loop64(wide, dy, dbank)
    y, final, g = outputs_and_grads(xla_op, args, dy, dbank, chunk_size=100)
    _, _, g_loop = outputs_and_grads(sdm_reference, args, dy, dbank)
    for k in FLOAT_ARGS:
        err, loop_err = rel_err(g[k], g64[k]), rel_err(g_loop[k], g64[k])
        assert err < max(1.5 * loop_err, 4e-3), (k, err, loop_err)
    assert rel_err(y, y64) < 1e-2 and rel_err(final, final64) < 1e-2
