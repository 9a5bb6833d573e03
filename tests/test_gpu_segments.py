"""`segment_ids` (packed sequences) on the GPU (GPU only; skipped elsewhere): the CUDA kernels do not take them
yet and impl="ffi" says so; the pure-JAX chunked form (impl="xla", and impl="auto", which takes it there) follows
the token loop."""
import numpy as np
import pytest

from jax_sdm import sdm_write_read
from jax_sdm.testing import FLOAT_ARGS, outputs_and_grads, random_problem, rel_err

PACKED = np.array([[0] * 5 + [1] * 9 + [2] * 3 + [3] * 7 + [-1] * 4,
                   [3] * 3 + [7] * 13 + [3] * 10 + [5] * 2], np.int32)


def problem(seed):
    p = random_problem(seed, B=2, T=PACKED.shape[1], H=2, K=8, D=4, W=3, R=3, distinct=False, repeats=True,
                       per_write_gates=True)
    rng = np.random.default_rng(seed)
    return p, rng.standard_normal(p["v"].shape), rng.standard_normal(p["bank"].shape)


def test_cuda_kernels_refuse_segment_ids():
    p, _, _ = problem(0)
    with pytest.raises(NotImplementedError, match="segment_ids.*CPU kernels support it.*impl='xla'"):
        sdm_write_read(**p, impl="ffi", segment_ids=PACKED)


@pytest.mark.parametrize("impl", ["xla", "auto"])
def test_xla_on_the_gpu_follows_the_token_loop(impl):
    """impl="xla" (and "auto", which takes it for packed sequences on the GPU) against the token loop (outputs,
    final bank, every gradient)."""
    seed = int(np.random.SeedSequence().entropy % 10_000)
    p, dy, dbank = problem(seed)
    y, final, grads = outputs_and_grads(sdm_write_read, p, dy, dbank, impl=impl, chunk_size=4, segment_ids=PACKED)
    y_w, final_w, grads_w = outputs_and_grads(sdm_write_read, p, dy, dbank, impl="reference", segment_ids=PACKED)
    assert rel_err(y, y_w) < 2e-5 and rel_err(final, final_w) < 2e-5
    for k in FLOAT_ARGS:
        assert rel_err(grads[k], grads_w[k]) < 2e-5, (k, rel_err(grads[k], grads_w[k]))
