"""Both chunked implementations against the two oracles: the reference package's golden outputs and the token
loop on fresh random problems (outputs, final bank and every gradient, relative L2 below 1e-5)."""
import functools

import numpy as np
import pytest

from jax_sdm import sdm_write_read

from .helpers import FLOAT_ARGS, check_against_reference, out_of_range_case, outputs_and_grads, rel_err

IMPLS = [pytest.param("xla", marks=pytest.mark.slow), "ffi"]  # xla: slow to compile on a CPU (test_xla.py covers it)


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_golden(golden, impl):
    args, expected, chunk = golden
    op = functools.partial(sdm_write_read, impl=impl)
    y, final, g = outputs_and_grads(op, args, expected["dy"], chunk_size=chunk)
    assert rel_err(y, expected["y"]) < 1e-5
    assert rel_err(final, expected["final_bank"]) < 1e-5
    for k in FLOAT_ARGS:
        assert rel_err(g[k], expected[f"grad_{k}"]) < 1e-5, k


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_reference(random_case, impl):
    args, chunk, seed = random_case
    check_against_reference(functools.partial(sdm_write_read, impl=impl), args, chunk, 1e-5, seed)


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_ids_touch_nothing(impl):
    """Ids outside [0, K) read zeros and write nothing: the same results as a twin problem whose bad lanes point
    at one extra zero row with zero weights."""
    bad, twin = out_of_range_case(7)
    op = functools.partial(sdm_write_read, impl=impl)
    y_bad, f_bad = op(**bad, chunk_size=4)
    y_twin, f_twin = op(**twin, chunk_size=4)
    np.testing.assert_allclose(y_bad, y_twin, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(f_bad, f_twin[..., :-1, :], rtol=1e-5, atol=1e-6)
