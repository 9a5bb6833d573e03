"""Run the product-key top-k kernel a few times at one shape, for a profiler (ncu) to sample.

    python benchmarks/profile_topk.py [--rows 32] [--factors 1024,1024] [--k 16] [--dtype bfloat16] [--calls 3]
                                      [--backward]

The defaults are a decode step of the layer at K = 2^20 (B 4, H 4, writes and reads ranked together: 32 rows).
Scores are standard normal; the first call compiles. --backward: each call is the gradient of a weighted sum of the
selected scores, so the backward kernel runs after the forward."""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jax_sdm import product_key_topk


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--factors", default="1024,1024", help="comma-separated factor sizes")
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--backward", action="store_true")
    opts = parser.parse_args(argv)
    factors = tuple(int(f) for f in opts.factors.split(","))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((opts.rows, sum(factors))), opts.dtype)
    topk = jax.jit(lambda a: product_key_topk(a, factors, opts.k, impl="ffi"))
    if opts.backward:
        w = jnp.asarray(np.random.default_rng(1).standard_normal((opts.rows, opts.k)), jnp.float32)
        topk = jax.jit(jax.grad(lambda a: (product_key_topk(a, factors, opts.k, impl="ffi")[0] * w).sum()))
    for _ in range(opts.calls):
        jax.block_until_ready(topk(x))
    print(f"rows {opts.rows}, factors {factors}, k {opts.k}, {opts.dtype}: {opts.calls} calls"
          f"{' of the gradient' if opts.backward else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
