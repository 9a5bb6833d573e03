"""The CPU solve kernel (``sdm_solve`` via ``solve_ffi``): (I + diag(beta) A)^{-1}."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_sdm.ffi_ops import solve_ffi
from jax_sdm.xla import solve_xla

from .helpers import assert_one_kernel_call


def make_inputs(seed, batch, C, *, garbage_upper=True):
    """A strictly lower A (plus garbage on and above the diagonal, which the solve
    must ignore) and beta in (0, 1), scaled so that M is well conditioned."""
    rng = np.random.default_rng(seed)
    A = rng.standard_normal(batch + (C, C)).astype(np.float32) / np.sqrt(C)
    if not garbage_upper:
        A = np.tril(A, -1)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal(batch + (C,))))).astype(np.float32)
    return A, beta


def solve_numpy(A, beta):
    A = np.tril(np.asarray(A, np.float64), -1)
    C = A.shape[-1]
    M = np.eye(C) + np.asarray(beta, np.float64)[..., :, None] * A
    return np.linalg.inv(M)


def check(got, A, beta):
    want = solve_numpy(A, beta)
    got = np.asarray(got)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    C = A.shape[-1]
    # exact structure: unit diagonal, zero upper triangle
    assert (got[..., np.arange(C), np.arange(C)] == 1).all()
    assert (got[..., np.triu_indices(C, 1)[0], np.triu_indices(C, 1)[1]] == 0).all()


@pytest.mark.parametrize("C", [1, 2, 5, 16, 17, 64, 128])
def test_solve_matches_inverse(C):
    A, beta = make_inputs(1000 + C, (3,), C)
    check(solve_ffi(A, beta), A, beta)


def test_solve_ignores_upper_and_diagonal():
    A, beta = make_inputs(7, (2,), 9)
    got = solve_ffi(A, beta)
    got_lower = solve_ffi(np.tril(A, -1), beta)
    assert np.asarray(got).tobytes() == np.asarray(got_lower).tobytes()


def test_solve_batch_shape_and_jit():
    A, beta = make_inputs(8, (2, 3), 12)
    got = solve_ffi(A, beta)
    assert got.shape == (2, 3, 12, 12)
    check(got, A, beta)
    flat = solve_ffi(A.reshape(6, 12, 12), beta.reshape(6, 12))
    assert np.asarray(flat).tobytes() == np.asarray(got).reshape(6, 12, 12).tobytes()
    jitted = jax.jit(solve_ffi)(A, beta)
    assert np.asarray(jitted).tobytes() == np.asarray(got).tobytes()


def test_solve_large_chunk():
    A, beta = make_inputs(9, (2,), 256)
    check(solve_ffi(A, beta), A, beta)


def test_solve_deterministic_bitwise():
    A, beta = make_inputs(10, (8,), 64)
    a = solve_ffi(A, beta)
    b = solve_ffi(A, beta)
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_solve_beta_zero_is_identity():
    A, _ = make_inputs(11, (2,), 7)
    got = np.asarray(solve_ffi(A, np.zeros((2, 7), np.float32)))
    np.testing.assert_array_equal(got, np.broadcast_to(np.eye(7, dtype=np.float32), got.shape))


def test_solve_empty_and_casts():
    A, beta = make_inputs(12, (0,), 4)
    assert solve_ffi(A, beta).shape == (0, 4, 4)
    A, beta = make_inputs(13, (2,), 4)
    got = solve_ffi(jnp.asarray(A, jnp.bfloat16), beta)
    assert got.dtype == jnp.float32


def test_solve_shape_errors():
    A, beta = make_inputs(14, (2,), 4)
    with pytest.raises(ValueError, match="beta"):
        solve_ffi(A, beta[:, :3])
    with pytest.raises(ValueError, match="A must be"):
        solve_ffi(A[:, :3], beta)


def test_solve_matches_xla():
    A, beta = make_inputs(15, (4,), 16, garbage_upper=False)
    np.testing.assert_allclose(np.asarray(solve_ffi(A, beta)), np.asarray(solve_xla(A, beta)), rtol=1e-5, atol=1e-5)


def test_solve_vmap_one_call_and_bitwise():
    """vmap and nested vmap fold into the batch of one kernel call; results equal per-example calls bitwise."""
    A, beta = make_inputs(12, (3, 2, 4), 10)
    per_example = [[np.asarray(solve_ffi(A[i, j], beta[i, j])) for j in range(2)] for i in range(3)]
    f1 = jax.vmap(solve_ffi)
    f2 = jax.vmap(jax.vmap(solve_ffi))
    one = np.asarray(f1(A[0], beta[0]))
    two = np.asarray(f2(A, beta))
    for i in range(3):
        for j in range(2):
            assert two[i, j].tobytes() == per_example[i][j].tobytes()
            if i == 0:
                assert one[j].tobytes() == per_example[0][j].tobytes()
    assert_one_kernel_call(f2, A, beta)
    # beta shared (broadcast), A mapped over its axis 1
    g = jax.vmap(solve_ffi, in_axes=(1, None))
    At = np.swapaxes(A[0], 0, 1)  # [4, 2, 10, 10]: axis 1 is the mapped one
    got = np.asarray(g(At, beta[0, 0]))
    for v in range(2):
        assert got[v].tobytes() == np.asarray(solve_ffi(At[:, v], beta[0, 0])).tobytes()
    assert_one_kernel_call(g, At, beta[0, 0])


def test_solve_single_unit_without_batch_dims():
    A, beta = make_inputs(13, (1,), 6)
    got = solve_ffi(A[0], beta[0])
    assert got.shape == (6, 6)
    assert np.asarray(got).tobytes() == np.asarray(solve_ffi(A, beta))[0].tobytes()
