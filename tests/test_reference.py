"""The token-loop reference against the reference package's golden outputs."""
import jax
import numpy as np

from jax_sdm import sdm_reference
from jax_sdm.testing import random_problem

from .helpers import out_of_range_case, outputs_and_grads, rel_err


def test_reference_matches_golden(golden):
    args, expected, _ = golden
    y, final, g = outputs_and_grads(sdm_reference, args, expected["dy"])
    assert rel_err(y, expected["y"]) < 1e-5
    assert rel_err(final, expected["final_bank"]) < 1e-5
    for k in g:
        assert rel_err(g[k], expected[f"grad_{k}"]) < 1e-5, k


def test_reference_runs_in_float64():
    with jax.enable_x64(True):
        p = random_problem(3, T=9, K=8, D=5, W=3, R=2, dtype=np.float64, distinct=False, repeats=True)
        y, final = sdm_reference(**p)
        assert y.dtype == np.float64 and final.dtype == np.float64


def test_reference_out_of_range_ids_touch_nothing():
    bad, twin = out_of_range_case(4)
    y_bad, f_bad = sdm_reference(**bad)
    y_twin, f_twin = sdm_reference(**twin)
    np.testing.assert_allclose(y_bad, y_twin, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(f_bad, f_twin[..., :-1, :], rtol=1e-6, atol=1e-7)
