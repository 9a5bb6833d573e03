"""The working gradient bank of the kernels' backward (`bank_grad_dtype`): the bank's dtype by default (bfloat16
for a bfloat16 bank: float32 inside each chunk step, rounded once per row a step writes), float32 on request.

Over a long sequence in which every row is rewritten many times, both stay within the bfloat16 accuracy bar
(relative L2 error 1.5e-2 against a float64 token loop) for the outputs, the final bank and every gradient."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm import sdm_write_read
from jax_sdm.testing import random_problem

from .helpers import FLOAT_ARGS, cotangents, outputs_and_grads, rel_err

BF16_BAR = 1.5e-2


@functools.lru_cache(maxsize=None)
def _long_case(seed):
    """T = 4096 at chunk 64 with 256 slots and 4 writes per token: each row is written about 64 times. Returns the
    bfloat16 problem, its cotangents, and the float64 token loop's outputs and gradients."""
    args = random_problem(seed, B=1, T=4096, H=2, K=256, D=32, W=4, R=4, dtype=jnp.bfloat16)
    dy, dbank = cotangents(seed, args)
    with jax.enable_x64(True):
        wide = {k: np.asarray(a, np.float64) if k in FLOAT_ARGS else a for k, a in args.items()}
        y, final, g = outputs_and_grads(functools.partial(sdm_write_read, impl="reference"), wide, dy, dbank)
        want = (np.asarray(y), np.asarray(final), {k: np.asarray(v) for k, v in g.items()})
    return args, dy, dbank, want


@pytest.mark.parametrize("bank_grad_dtype", [None, jnp.float32])
def test_long_sequence_within_bf16_bar(bank_grad_dtype):
    args, dy, dbank, (y_ref, final_ref, g_ref) = _long_case(3)
    op = functools.partial(sdm_write_read, impl="ffi", bank_grad_dtype=bank_grad_dtype)
    y, final, g = outputs_and_grads(op, args, dy, dbank, chunk_size=64)
    assert rel_err(y, y_ref) < BF16_BAR, rel_err(y, y_ref)
    assert rel_err(final, final_ref) < BF16_BAR, rel_err(final, final_ref)
    for k in FLOAT_ARGS:
        assert g[k].dtype == np.asarray(args[k]).dtype, k
        assert rel_err(g[k], g_ref[k]) < BF16_BAR, (k, rel_err(g[k], g_ref[k]))


def test_float32_bank_ignores_the_default():
    """A float32 bank's working gradient is float32 whether asked for or defaulted: the same bits."""
    args = random_problem(5, T=40, K=32, D=8, W=3, R=3)
    dy, dbank = cotangents(5, args)
    _, _, g_default = outputs_and_grads(functools.partial(sdm_write_read, impl="ffi"), args, dy, dbank, chunk_size=16)
    _, _, g_f32 = outputs_and_grads(functools.partial(sdm_write_read, impl="ffi", bank_grad_dtype=jnp.float32),
                                    args, dy, dbank, chunk_size=16)
    for k in FLOAT_ARGS:
        np.testing.assert_array_equal(g_default[k], g_f32[k], err_msg=k)


@pytest.mark.parametrize("dtype, bad", [(np.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float16),
                                        (jnp.bfloat16, np.float64)])
def test_bad_bank_grad_dtype(dtype, bad):
    args = random_problem(1, T=8, K=16, D=4, W=2, R=2, dtype=dtype)
    with pytest.raises(ValueError, match="bank_grad_dtype"):
        sdm_write_read(**args, impl="ffi", bank_grad_dtype=bad)
