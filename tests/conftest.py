import pathlib

import numpy as np
import pytest

from jax_sdm.testing import golden_problem

DATA = pathlib.Path(__file__).parent / "data"
GOLDEN_CHUNK = {"golden_f32_small_write": 16, "golden_f32_hot": 32}  # the chunk the reference package used


@pytest.fixture(params=sorted(p.stem for p in DATA.glob("golden_*.npz")))
def golden(request):
    """`(args, expected, chunk)` of one golden file, in the op's layout."""
    args, expected = golden_problem(np.load(DATA / f"{request.param}.npz"))
    return args, expected, GOLDEN_CHUNK.get(request.param, 16)
