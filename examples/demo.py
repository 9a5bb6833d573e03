"""The README's demo: one SDM recurrence, timed for each implementation and checked against the token loop.

    python examples/demo.py [--impls auto,reference]

Runs `sdm_write_read` with `impl="auto"` (the compiled kernels where this build has them for the platform, else
`impl="xla"`, the pure-JAX chunked form) and `impl="reference"` (the token loop of docs/MATH.md), each jitted,
forward alone and forward + backward (the gradients of every float input). It prints the time of each and how
closely each implementation agrees with the token loop, and exits with status 1 if one disagrees. Takes well under a
minute on a small CPU; `--impls auto,xla,reference` adds the pure-JAX chunked form (about a minute more on a CPU,
mostly compilation: it is the path for TPUs and forward-mode differentiation, not for speed on a CPU).
"""
import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdm
from jax_sdm import sdm_write_read
from jax_sdm.kernel_path import kernels_available
from jax_sdm.testing import random_problem

# The token loop's gradient keeps the bank of every token (T * B*H*K*D floats): at this shape 0.5 GB.
SHAPE = dict(B=2, T=512, H=4, K=1024, D=32, W=8, R=8)
CHUNK = 64
REPEATS = 5
ARG_NAMES = ("bank", "k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val")
FLOATS = (0, 2, 3, 4, 5, 7)  # positions of the float arguments: bank, k_val, v, beta, g, q_val
TOLERANCE = 1e-4  # float32 agreement is about 1e-7; anything near this bound means something is wrong


def functions(impl):
    """The jitted forward `(y, final_bank)` and forward + backward (the gradients of a loss of both) for `impl`."""
    def forward(*args):
        return sdm_write_read(*args, chunk_size=CHUNK, impl=impl)

    def loss(*args):
        y, bank = forward(*args)
        return jnp.sum(y) + jnp.sum(bank)

    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=FLOATS))


def time_call(fn, args):
    """`(result, first-call seconds, median seconds of REPEATS later calls)`; the first call compiles."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return out, first, statistics.median(times)


def rel_l2(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--impls", default="auto,reference",
                        help="comma-separated implementations to time (auto, ffi, xla, reference); the token loop "
                             "(reference) always runs, as the oracle")
    impls = [s.strip() for s in parser.parse_args(argv).impls.split(",") if s.strip()]
    impls = [i for i in impls if i != "reference"] + ["reference"]
    device = jax.devices()[0]
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, device {device.device_kind} ({device})")
    print(f"jax_sdm {jax_sdm.__version__} from {jax_sdm.__file__}")
    shape = ", ".join(f"{k}={v}" for k, v in SHAPE.items())
    print(f"problem: {shape}, chunk {CHUNK}, float32 bank")
    has_kernels = kernels_available()
    print(f"impl='auto' runs {'the kernels (ffi)' if has_kernels else 'the pure-JAX chunked form (xla)'} here")

    problem = random_problem(0, **SHAPE)
    args = [jax.device_put(problem[name], device) for name in ARG_NAMES]

    rows, results = [], {}
    for impl in impls:
        forward, train = functions(impl)
        outputs, first, fwd = time_call(forward, args)
        grads, _, fwd_bwd = time_call(train, args)
        results[impl] = (*outputs, *grads)
        rows.append((impl, first, fwd, fwd_bwd))

    tokens = SHAPE["B"] * SHAPE["T"] * SHAPE["H"]
    ref_fwd, ref_fwd_bwd = rows[-1][2:]
    print()
    print(f"{'impl':<12}{'first call (s)':>16}{'forward (ms)':>14}{'fwd+bwd (ms)':>14}{'tokens/s (fwd)':>16}"
          f"{'speed-up fwd / fwd+bwd':>25}")
    for impl, first, fwd, fwd_bwd in rows:
        print(f"{impl:<12}{first:>16.2f}{1e3 * fwd:>14.2f}{1e3 * fwd_bwd:>14.2f}{tokens / fwd:>16.3g}"
              f"{ref_fwd / fwd:>12.2g}x / {ref_fwd_bwd / fwd_bwd:.2g}x")
    print(f"Each time is the median of {REPEATS} jitted calls after a first one that compiles; fwd+bwd computes the "
          "gradients of every float input; the speed-up is over the token loop (reference).")

    print()
    names = ("y", "final_bank") + tuple(f"d{ARG_NAMES[i]}" for i in FLOATS)
    ok = True
    for impl in impls[:-1]:
        errors = [rel_l2(a, b) for a, b in zip(results[impl], results["reference"])]
        print(f"agreement of impl='{impl}' with the token loop (relative L2): "
              + ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errors)))
        ok &= all(e < TOLERANCE for e in errors)
    if not ok:
        print(f"MISMATCH: expected every error below {TOLERANCE:g}", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
