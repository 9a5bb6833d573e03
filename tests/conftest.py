import pathlib

import jax
import numpy as np
import pytest

from jax_sdm.testing import random_problem

from .helpers import golden_problem

DATA = pathlib.Path(__file__).parent / "data"
GOLDEN_CHUNK = {"golden_f32_small_write": 16, "golden_f32_hot": 32}  # the chunk the reference package used


@pytest.fixture(params=sorted(p.stem for p in DATA.glob("golden_*.npz")))
def golden(request):
    """`(args, expected, chunk)` of one golden file, in the op's layout."""
    args, expected = golden_problem(np.load(DATA / f"{request.param}.npz"))
    return args, expected, GOLDEN_CHUNK.get(request.param, 16)


RANDOM_CASES = {
    # name: (random_problem kwargs, chunk_size)
    "distinct": (dict(T=40, K=64, W=4, R=3), 16),
    "collision_heavy": (dict(T=40, K=8, W=5, R=4, distinct=False), 16),
    "repeats_in_token": (dict(T=33, K=12, W=6, R=3, distinct=False, repeats=True), 8),
    "per_write_gates": (dict(T=40, K=16, W=4, R=4, distinct=False, repeats=True, per_write_gates=True), 16),
    "partial_last_chunk": (dict(T=37, K=32, W=3, R=2), 16),
    "shared_bank": (dict(B=3, T=20, H=2, K=16, W=3, R=3, distinct=False, shared_bank=True), 8),
    "one_lane": (dict(T=30, K=8, W=1, R=1, distinct=False), 4),
    "odd_dims": (dict(B=1, T=23, H=3, K=5, D=3, W=7, R=9, distinct=False, repeats=True), 6),
}


@pytest.fixture(params=sorted(RANDOM_CASES))
def random_case(request):
    """`(args, chunk_size, seed)`: a fresh random problem of one kind (new seed every run)."""
    kw, chunk = RANDOM_CASES[request.param]
    seed = sorted(RANDOM_CASES).index(request.param) + int(np.random.SeedSequence().entropy % 10_000) * 100
    return random_problem(seed, **kw), chunk, seed


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true",
                     help="also run the tests marked slow (left out by default; CI and scripts/gpu_check.sh run them)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long test of a feature that a faster default test covers too; "
                                       "runs only with --run-slow")


def pytest_collection_modifyitems(config, items):
    """Without `--run-slow`, the tests marked slow are deselected. Tests in `test_gpu_*.py` need a GPU backend:
    skipped elsewhere."""
    if not config.getoption("--run-slow"):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU backend (jax.default_backend() == 'gpu')")
    for item in items:
        if item.path.name.startswith("test_gpu_"):
            item.add_marker(skip)
