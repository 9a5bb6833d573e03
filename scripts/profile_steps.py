"""One forward + backward of an anchor shape, for a kernel profiler (ncu) to time each of our kernels.

    ncu --clock-control none --metrics gpu__time_duration.sum -k regex:'fwd_|bwd_|phase1|solve' \
        --launch-skip N --launch-count M --csv python3 scripts/profile_steps.py flagship
"""
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/benchmarks")
from bench import SHAPES, make_inputs  # noqa: E402

from jax_sdm import sdm_write_read  # noqa: E402

shape = SHAPES[sys.argv[1] if len(sys.argv) > 1 else "flagship"]
args, _, _ = make_inputs(shape, 0)
kw = dict(zip(("bank", "k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val"), args))


def loss(bank, k_val, v, q_val):
    y, final = sdm_write_read(**dict(kw, bank=bank, k_val=k_val, v=v, q_val=q_val), chunk_size=shape["chunk"])
    return jnp.sum(y.astype(jnp.float32)) + jnp.sum(final.astype(jnp.float32))


step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
jax.block_until_ready(step(kw["bank"], kw["k_val"], kw["v"], kw["q_val"]))
