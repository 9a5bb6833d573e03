"""A small workload that runs every CUDA kernel of jax_sdm once, for compute-sanitizer (`gpu_check.sh sanitize`):
the op's forward and backward (float32 and bfloat16 banks, both gradient-bank dtypes, per-token and per-write
gates, repeated and out-of-range slot ids, packed sequences), Phase 1's workspace paths (a unit's run arrays, or
all of its scratch, in the workspace: too large for shared memory), the decode step, and the product-key top-k's
forward and backward (`--cases` picks some).
Exits non-zero if a result is not finite."""
import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdm
from jax_sdm import lowering, product_key_topk, sdm_step, sdm_write_read
from jax_sdm.testing import random_problem

from helpers import FLOAT_ARGS, cotangents


def op_case(seed, dtype, bank_grad_dtype=None, chunk=16, segment_ids=None, **shape):
    """Outputs and gradients of one `jax.jit` of the forward and its VJP, with every array (slot ids and cotangents
    too) an argument of the jitted function. Arrays a jitted function closes over become constants that XLA embeds
    in its executable; initcheck never sees those written, and reports every read of them (or of their copies)."""
    args = {k: jnp.asarray(v) for k, v in random_problem(seed, dtype=dtype, **shape).items()}
    dy, dbank = (jnp.asarray(c, args["bank"].dtype) for c in cotangents(seed, args))
    floats = {k: args[k] for k in FLOAT_ARGS}
    ints = {k: v for k, v in args.items() if k not in FLOAT_ARGS}
    if segment_ids is not None:
        ints["segment_ids"] = jnp.asarray(segment_ids, jnp.int32)

    @jax.jit
    def run(floats, ints, dy, dbank):
        op = functools.partial(sdm_write_read, **ints, chunk_size=chunk, impl="ffi", bank_grad_dtype=bank_grad_dtype)
        (y, final), vjp = jax.vjp(lambda f: op(**f), floats)
        (grads,) = vjp((dy.astype(y.dtype), dbank))
        return y, final, grads

    y, final, g = run(floats, ints, dy, dbank)
    return [y, final] + [g[k] for k in FLOAT_ARGS]


def step_case():
    p = random_problem(4, B=2, T=1, H=2, K=256, D=32, W=4, R=4, dtype=jnp.bfloat16)
    step = jax.jit(functools.partial(sdm_step, impl="ffi"), donate_argnums=0)
    y, bank = step(p["bank"], *(p[k][:, 0] for k in ("k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val")))
    return [y, bank]


def topk_case(seed, dtype, rows, factors, k):
    """`product_key_topk`'s scores, ids and gradient in one `jax.jit` (scores and cotangents arguments)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, sum(factors))), dtype)
    ct = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)

    @jax.jit
    def run(x, ct):
        (scores, ids), vjp = jax.vjp(lambda a: product_key_topk(a, factors, k, impl="ffi"), x)
        return scores, ids, vjp((ct, np.zeros(ids.shape, jax.dtypes.float0)))[0]

    return list(run(x, ct))


CASES = [
    lambda: op_case(0, np.float32, T=40, K=64, D=24, W=3, R=2, distinct=False, repeats=True),  # partial last chunk
    lambda: op_case(1, jnp.bfloat16, T=40, K=64, D=64, W=4, R=4, per_write_gates=True),
    lambda: op_case(2, jnp.bfloat16, jnp.float32, T=40, K=64, D=64, W=4, R=4),
    # Phase 1: the run arrays in the workspace (the flagship's unit)
    lambda: op_case(3, np.float32, chunk=128, B=1, H=1, T=128, K=4096, D=8, W=64, R=64),
    step_case,
    lambda: op_case(0, np.float32, T=48, K=64, D=24, W=3, R=2, distinct=False, repeats=True),  # case 0, whole chunks
    lambda: op_case(5, jnp.bfloat16, B=2, T=40, K=16, D=64, W=4, R=4, distinct=False, repeats=True,  # packed
                    segment_ids=np.array([[0] * 5 + [1] * 11 + [2] * 16 + [-1] * 8, [4] * 16 + [2] * 3 + [9] * 21])),
    # Phase 1: all of the scratch in the workspace
    lambda: op_case(6, np.float32, chunk=128, B=1, H=1, T=128, K=4096, D=8, W=100, R=60),
    # the product-key top-k: keys in registers, a block's last warps idle; keys recomputed (a factor and the
    # candidates past 1024), backward rows of two tiles
    lambda: topk_case(7, jnp.bfloat16, 37, (256, 256), 64),
    lambda: topk_case(8, np.float32, 5, (1500, 1500), 256),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", default=",".join(map(str, range(len(CASES)))), help="comma list of CASES indices")
    parser.add_argument("--pdl", choices=("on", "off"),
                        help="the build expected: the CUDA chunk steps with programmatic dependent launch (on) or "
                             "without (off: built with the CMake option SDM_CUDA_PDL=OFF); exits 2 on the other")
    args = parser.parse_args()
    built = lowering.CUDA_PROGRAMMATIC_DEPENDENT_LAUNCH
    print(f"jax_sdm from {jax_sdm.__file__}: programmatic dependent launch {built}")
    if args.pdl is not None and built != (args.pdl == "on"):
        print(f"expected a build with programmatic dependent launch {args.pdl}")
        return 2
    cases = [int(i) for i in args.cases.split(",")]
    results = [r for i in cases for r in CASES[i]()]
    bad = [i for i, r in enumerate(results) if not np.all(np.isfinite(np.asarray(r, np.float32)))]
    print(f"{len(results)} results, {len(bad)} not finite")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
