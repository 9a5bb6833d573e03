"""Bitwise determinism on the GPU across processes and XLA command-buffer settings (GPU only).

The first run saves the outputs and gradients under $SDM_DIGEST_FILE; every later run (another process,
e.g. with XLA_FLAGS=--xla_gpu_enable_command_buffer=) must reproduce it bit for bit.
"""
import functools
import os
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm import sdm_write_read
from jax_sdm.testing import random_problem

from .helpers import cotangents, outputs_and_grads

CASES = {
    "f32_collisions": dict(B=2, T=300, H=2, K=64, D=72, W=8, R=6, distinct=False, repeats=True),
    "bf16_distinct": dict(B=1, T=256, H=4, K=4096, D=128, W=16, R=16, dtype=jnp.bfloat16),
    # A shared [H, K, D] bank: its gradient is the sum over the batch (layout.ordered_broadcast).
    "bf16_shared_bank": dict(B=5, T=130, H=2, K=1024, D=64, W=8, R=8, dtype=jnp.bfloat16, shared_bank=True),
}


def results(name, chunk_size):
    """Outputs and gradients by name, as float32 NumPy arrays."""
    args = random_problem(7, **CASES[name])
    dy, dbank = cotangents(7, args)
    op = functools.partial(sdm_write_read, impl="ffi")
    y, final, grads = outputs_and_grads(op, args, dy, dbank, chunk_size=chunk_size)
    out = dict(y=y, final_bank=final, **{f"grad_{k}": v for k, v in grads.items()})
    return {k: np.asarray(v, np.float32) for k, v in out.items()}


def assert_as_in_earlier_processes(key, arrays):
    """`arrays` (by name) are bitwise those an earlier process saved under `key` in $SDM_DIGEST_FILE; the first
    process saves them."""
    path = pathlib.Path(os.environ.get("SDM_DIGEST_FILE", "/tmp/sdm_digests")) / f"{key}.npz"
    if path.exists():
        diff = differences(arrays, dict(np.load(path)))
        assert diff == {}, f"differs from an earlier process ({path}): {diff}"
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **arrays)


def differences(a, b):
    """The arrays of `a` and `b` that are not bitwise equal, with their largest difference."""
    return {k: float(np.max(np.abs(a[k] - b[k]))) for k in a if a[k].tobytes() != b[k].tobytes()}


@pytest.mark.parametrize("chunk_size", [64, 128])  # 128: the GPU default; the in-loop solves staged at both
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_bitwise(name, chunk_size):
    first = results(name, chunk_size)
    assert differences(results(name, chunk_size), first) == {}  # same process, second call
    assert_as_in_earlier_processes(f"{name}_c{chunk_size}", first)
