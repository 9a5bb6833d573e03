"""The CUDA solve kernel (``sdm_solve`` on platform CUDA). Skipped without a GPU.

Run on the GPU machine: ``python -m pytest tests/test_gpu_solve.py -q``.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_sdm import lowering
from jax_sdm.ffi_ops import solve_ffi


def make_inputs(seed, batch, C):
    rng = np.random.default_rng(seed)
    A = rng.standard_normal(batch + (C, C)).astype(np.float32) / np.sqrt(C)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal(batch + (C,))))).astype(np.float32)
    return A, beta


def solve_numpy(A, beta):
    A = np.tril(np.asarray(A, np.float64), -1)
    C = A.shape[-1]
    return np.linalg.inv(np.eye(C) + np.asarray(beta, np.float64)[..., :, None] * A)


def test_cuda_module_registered():
    assert lowering.HAS_CUDA_MODULE, "jax_sdm._sdm_cuda was not built (no nvcc at build time?)"
    assert lowering.is_registered("sdm_solve", "CUDA")


@pytest.mark.parametrize("C", [1, 5, 16, 17, 64, 128, 256])
def test_gpu_solve_matches_inverse(C):
    A, beta = make_inputs(2000 + C, (3,), C)
    got = solve_ffi(jnp.asarray(A), jnp.asarray(beta))
    assert got.dtype == jnp.float32 and got.shape == (3, C, C)
    assert list(got.devices())[0].platform == "gpu"
    got = np.asarray(got)
    np.testing.assert_allclose(got, solve_numpy(A, beta), rtol=1e-5, atol=1e-5)
    assert (got[..., np.arange(C), np.arange(C)] == 1).all()
    iu = np.triu_indices(C, 1)
    assert (got[..., iu[0], iu[1]] == 0).all()


def test_gpu_solve_batch_shape_jit_and_determinism():
    A, beta = make_inputs(7, (2, 5), 64)
    A, beta = jnp.asarray(A), jnp.asarray(beta)
    a = solve_ffi(A, beta)
    b = jax.jit(solve_ffi)(A, beta)
    c = jax.jit(solve_ffi)(A, beta)
    assert a.shape == (2, 5, 64, 64)
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes() == np.asarray(c).tobytes()


def test_gpu_solve_many_units():
    A, beta = make_inputs(8, (4096,), 64)
    got = np.asarray(jax.jit(solve_ffi)(jnp.asarray(A), jnp.asarray(beta)))
    idx = [0, 1, 1000, 4095]
    np.testing.assert_allclose(got[idx], solve_numpy(A[idx], beta[idx]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("C", [33, 64, 128, 256, 282, 283])
def test_gpu_solve_equals_cpu_bitwise(C):
    """Both kernels sum j ascending with unfused multiply and add (kernels/solve.h); C up to 282 runs the
    shared-memory kernel (the running sums of each column in shared memory) on the H200, 283 the global-memory
    one."""
    A, beta = make_inputs(9, (6,), C)
    gpu = np.asarray(solve_ffi(jnp.asarray(A), jnp.asarray(beta)))
    cpu_dev = jax.devices("cpu")[0]
    with jax.default_device(cpu_dev):
        out = solve_ffi(jax.device_put(A, cpu_dev), jax.device_put(beta, cpu_dev))
    assert list(out.devices())[0].platform == "cpu"
    cpu = np.asarray(out)
    assert gpu.tobytes() == cpu.tobytes(), np.abs(gpu - cpu).max()
