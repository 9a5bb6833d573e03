"""The README's demo: one SDM recurrence on the best available device, timed and checked against the token loop.

    python examples/demo.py

Runs `sdm_write_read` with `impl="auto"` (the compiled kernels). When this build has no kernels for the op yet,
`auto` raises `NotImplementedError`; the demo then says so and uses `impl="xla"` (the pure-JAX chunked form).
The same inputs also go through `impl="reference"` (the token loop of docs/MATH.md), and the demo prints how closely
the two agree. Takes well under a minute on a small CPU.
"""
import statistics
import sys
import time

import jax
import numpy as np

import jax_sdm
from jax_sdm import sdm_write_read
from jax_sdm.testing import random_problem

SHAPE = dict(B=2, T=512, H=4, K=4096, D=64, W=8, R=8)
CHUNK = 64
REPEATS = 5
ARG_NAMES = ("bank", "k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val")
TOLERANCE = 1e-4  # float32 agreement is about 1e-7; anything near this bound means something is wrong


def compile_and_time(impl, args):
    """jit the op for `impl`; return (outputs, first-call seconds, median seconds over REPEATS later calls)."""
    fn = jax.jit(lambda *a: sdm_write_read(*a, chunk_size=CHUNK, impl=impl))
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))  # warm-up: traces and compiles
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


def main():
    device = jax.devices()[0]
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, device {device.device_kind} ({device})")
    print(f"jax_sdm {jax_sdm.__version__} from {jax_sdm.__file__}")
    shape = ", ".join(f"{k}={v}" for k, v in SHAPE.items())
    print(f"problem: {shape}, chunk {CHUNK}, float32 bank")

    problem = random_problem(0, **SHAPE)
    args = [jax.device_put(problem[name], device) for name in ARG_NAMES]

    impl = "auto"
    try:
        (y, bank), first, median = compile_and_time(impl, args)
    except NotImplementedError as err:
        print(f"impl='auto' is not available in this build ({err}).")
        print("falling back to impl='xla' (pure-JAX chunked form)")
        impl = "xla"
        (y, bank), first, median = compile_and_time(impl, args)
    (y_ref, bank_ref), first_ref, median_ref = compile_and_time("reference", args)

    tokens = SHAPE["B"] * SHAPE["T"] * SHAPE["H"]
    print()
    print(f"{'impl':<12}{'first call (s)':>16}{'median (ms)':>14}{'tokens/s':>14}")
    for name, f, m in ((impl, first, median), ("reference", first_ref, median_ref)):
        print(f"{name:<12}{f:>16.2f}{1e3 * m:>14.2f}{tokens / m:>14.3g}")
    print(f"(median of {REPEATS} runs after a warm-up call; the first call includes compilation)")

    err_y = rel_l2(y, y_ref)
    err_bank = rel_l2(bank, bank_ref)
    print()
    print(f"agreement of impl='{impl}' with the token loop (relative L2): "
          f"y {err_y:.2e}, final_bank {err_bank:.2e}")
    if not (err_y < TOLERANCE and err_bank < TOLERANCE):
        print(f"MISMATCH: expected both below {TOLERANCE:g}", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
