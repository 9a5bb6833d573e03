"""`segment_ids` (packed sequences) on the GPU (GPU only; skipped elsewhere): the CUDA kernels and the pure-JAX
chunked form follow the token loop; the kernels are deterministic."""
import jax
import numpy as np
import pytest

from jax_sdm import sdm_write_read
from jax_sdm.testing import random_problem

from .helpers import FLOAT_ARGS, outputs_and_grads, rel_err

PACKED = np.array([[0] * 5 + [1] * 9 + [2] * 3 + [3] * 7 + [-1] * 4,
                   [3] * 3 + [7] * 13 + [3] * 10 + [5] * 2], np.int32)


def problem(seed):
    p = random_problem(seed, B=2, T=PACKED.shape[1], H=2, K=8, D=4, W=3, R=3, distinct=False, repeats=True,
                       per_write_gates=True)
    rng = np.random.default_rng(seed)
    return p, rng.standard_normal(p["v"].shape), rng.standard_normal(p["bank"].shape)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
@pytest.mark.parametrize("chunk", [4, 16])
def test_packed_on_the_gpu_follows_the_token_loop(impl, chunk):
    """The CUDA kernels (impl="ffi") and the pure-JAX chunked form on the GPU against the token loop (outputs,
    final bank, every gradient): segments that start inside chunks and at their first token, padding, repeated
    slots, per-write gates; chunk 16 puts several segments in one chunk."""
    seed = int(np.random.SeedSequence().entropy % 10_000)
    p, dy, dbank = problem(seed)
    y, final, grads = outputs_and_grads(sdm_write_read, p, dy, dbank, impl=impl, chunk_size=chunk,
                                        segment_ids=PACKED)
    y_w, final_w, grads_w = outputs_and_grads(sdm_write_read, p, dy, dbank, impl="reference", segment_ids=PACKED)
    assert rel_err(y, y_w) < 2e-5 and rel_err(final, final_w) < 2e-5, (seed, rel_err(y, y_w))
    for k in FLOAT_ARGS:
        assert rel_err(grads[k], grads_w[k]) < 2e-5, (seed, k, rel_err(grads[k], grads_w[k]))


def test_packed_kernels_are_deterministic():
    """Two runs of the packed CUDA kernels agree bitwise (outputs and gradients)."""
    p, dy, dbank = problem(3)
    runs = [outputs_and_grads(sdm_write_read, p, dy, dbank, impl="ffi", chunk_size=16, segment_ids=PACKED)
            for _ in range(2)]
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
