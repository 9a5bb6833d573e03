"""The forward without residuals in slabs of chunks (`kernel_path._forward_in_slabs`): the same bits as the
forward over all chunks at once, for every way the chunks divide into slabs, and the public op's no-grad call
takes it for long sequences."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm import kernel_path, layout
from jax_sdm.testing import random_problem

from .helpers import kernel_layout

pytestmark = pytest.mark.skipif(not kernel_path.kernels_available(), reason="no kernels for this backend")


def _kernel_args(seed, T, C, dtype, per_write_gates):
    p = random_problem(seed, B=2, T=T, H=2, K=32, D=8, W=3, R=2, dtype=dtype, per_write_gates=per_write_gates,
                       distinct=False, repeats=True)
    args = [jnp.asarray(p[n]) for n in ("bank", "k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val")]
    dims = layout.validate(*args, chunk_size=C)
    return kernel_layout(*args, dims), dims


@pytest.mark.parametrize("T, C, slab_tokens", [(40, 4, 8), (37, 4, 12), (64, 8, 16), (30, 5, 5), (33, 8, 64)])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_slabs_equal_one_shot(T, C, slab_tokens, dtype):
    inputs, dims = _kernel_args(T + C, T, C, dtype, per_write_gates=T % 2)
    one = jax.jit(lambda i: kernel_path._sdm_kernels_fwd(i, dims.K, save=True)[0])(inputs)
    slabs = jax.jit(lambda i: kernel_path._sdm_kernels_fwd(i, dims.K, save=False, slab_tokens=slab_tokens)[0])(
        inputs)
    y1, final1, rep1 = one
    y2, final2, rep2 = slabs
    np.testing.assert_array_equal(np.asarray(y1.astype(inputs.bank.dtype)), np.asarray(y2.astype(inputs.bank.dtype)))
    np.testing.assert_array_equal(np.asarray(final1), np.asarray(final2))
    np.testing.assert_array_equal(np.asarray(rep1), np.asarray(rep2))


def test_slab_forward_memory_flat_in_T():
    """XLA's temporaries of the no-grad forward in slabs do not grow with T (the inputs and outputs do)."""
    def temp_bytes(T):
        inputs, dims = _kernel_args(0, T, 8, np.float32, False)
        fn = jax.jit(lambda i: kernel_path._sdm_kernels_fwd(i, dims.K, save=False, slab_tokens=64)[0])
        return fn.lower(inputs).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(256), temp_bytes(4096)
    assert large <= 1.3 * small + 4096, (small, large)
