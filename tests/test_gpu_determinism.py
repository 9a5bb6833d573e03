"""Bitwise determinism on the GPU across processes and XLA command-buffer settings (GPU only).

The first run writes a digest of outputs and gradients to $SDM_DIGEST_FILE; every later run (another process,
e.g. with XLA_FLAGS=--xla_gpu_enable_command_buffer=) must reproduce it bit for bit.
"""
import functools
import hashlib
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm import sdm_write_read
from jax_sdm.testing import cotangents, outputs_and_grads, random_problem

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

CASES = {
    "f32_collisions": dict(B=2, T=300, H=2, K=64, D=72, W=8, R=6, distinct=False, repeats=True),
    "bf16_distinct": dict(B=1, T=256, H=4, K=4096, D=128, W=16, R=16, dtype=jnp.bfloat16),
}


def digest(name):
    args = random_problem(7, **CASES[name])
    dy, dbank = cotangents(7, args)
    op = functools.partial(sdm_write_read, impl="ffi")
    out = outputs_and_grads(op, args, dy, dbank, chunk_size=64)
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(out):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_bitwise(name):
    first = digest(name)
    assert digest(name) == first  # same process, second call
    path = pathlib.Path(os.environ.get("SDM_DIGEST_FILE", "/tmp/sdm_digests")) / f"{name}.sha256"
    if path.exists():
        assert path.read_text() == first, f"differs from the digest of an earlier process ({path})"
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(first)
