"""Both chunked implementations against the two oracles: the reference package's golden outputs and the token
loop on fresh random problems (outputs, final bank and every gradient, relative L2 below 1e-5)."""
import functools

import pytest

from jax_sdm import sdm_write_read
from jax_sdm.testing import FLOAT_ARGS, check_against_reference, outputs_and_grads, rel_err

IMPLS = ["xla", "ffi"]


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
