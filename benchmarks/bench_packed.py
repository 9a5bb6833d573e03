"""Time packed sequences (`segment_ids`) against the same tokens unpacked; print a Markdown table.

    python benchmarks/bench_packed.py [--impls ffi,xla,reference] [--rows 2] [--sequences 8] [--length 64] [--H 2]
                                      [--K 4096] [--D 64] [--W 16] [--R 16] [--chunk 64] [--repeats 5]

Packed: `rows` rows of `sequences * length` tokens, each row holding `sequences` sequences (`segment_ids`).
Unpacked: the same tokens as `rows * sequences` rows of `length` tokens, without `segment_ids`. Both from the same
initial bank per head (a shared `[H, K, D]` bank), float32. Forward: `jax.jit` of the op; forward+backward:
`jax.jit(jax.grad)` of `sum(y * dy)` with respect to every float input. Timed as `bench.py` times: after a warm-up,
the wall time per call in runs of calls enqueued back to back (device time when the device is the bottleneck),
median of `--repeats` runs; the ratio is packed / unpacked (the target: at most 1.2). An impl without packed sequences on
this platform is reported as "n/a".
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jax_sdm import sdm_write_read
from jax_sdm.testing import random_problem

from bench import PIPELINE_CALLS, pipelined_seconds, warm_up  # benchmarks/bench.py, next to this script

FLOATS = ("bank", "k_val", "v", "beta", "g", "q_val")


def functions(impl, chunk):
    """`forward(floats, ints)` and `grad(floats, ints, dy)` (the slot ids and segment ids are arguments, not
    constants that the compiler would fold)."""
    def forward(floats, ints):
        return sdm_write_read(**floats, **ints, impl=impl, chunk_size=chunk)

    def loss(floats, ints, dy):
        return jnp.sum(forward(floats, ints)[0] * dy)

    return jax.jit(forward), jax.jit(jax.grad(loss))


def seconds(fn, args, repeats):
    """bench.py's main number: warmed up, then per call in runs of PIPELINE_CALLS calls back to back (median)."""
    warm_up(fn, args)
    return pipelined_seconds(fn, args, repeats, PIPELINE_CALLS)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", default="ffi,xla,reference")
    for name, default in (("rows", 2), ("sequences", 8), ("length", 64), ("H", 2), ("K", 4096), ("D", 64),
                          ("W", 16), ("R", 16), ("chunk", 64), ("repeats", 5)):
        parser.add_argument(f"--{name}", type=int, default=default)
    a = parser.parse_args(argv)
    n, L = a.sequences, a.length
    p = random_problem(0, B=a.rows, T=n * L, H=a.H, K=a.K, D=a.D, W=a.W, R=a.R, shared_bank=True)
    dy = jnp.asarray(np.random.default_rng(1).standard_normal(p["v"].shape), jnp.float32)
    segment_ids = jnp.asarray(np.repeat(np.arange(n), L)[None].repeat(a.rows, 0), jnp.int32)
    unpack = lambda x: x.reshape((a.rows * n, L) + x.shape[2:])  # [rows, n*L, ...] -> [rows*n, L, ...]
    packed = {k: jnp.asarray(v) for k, v in p.items()}
    unpacked = {k: (v if k == "bank" else unpack(v)) for k, v in packed.items()}

    print(f"Packed ({a.rows} rows x {n} sequences of {L} tokens) against unpacked ({a.rows * n} rows of {L}); "
          f"H {a.H}, K {a.K}, D {a.D}, W {a.W}, R {a.R}, chunk {a.chunk}, float32; ms per call in runs of "
          f"{PIPELINE_CALLS} calls back to back, median of {a.repeats} runs; "
          f"device: {jax.devices()[0].device_kind}\n")
    print("| impl | fwd packed | fwd unpacked | ratio | fwd+bwd packed | fwd+bwd unpacked | ratio |")
    print("|---|---|---|---|---|---|---|")
    for impl in a.impls.split(","):
        cells = []
        try:
            for problem, dy_, rest in ((packed, dy, dict(segment_ids=segment_ids)), (unpacked, unpack(dy), {})):
                floats = {k: problem[k] for k in FLOATS}
                ints = dict(rest, **{k: v for k, v in problem.items() if k not in FLOATS})
                fwd, grad = functions(impl, a.chunk)
                cells.append((seconds(fwd, (floats, ints), a.repeats), seconds(grad, (floats, ints, dy_), a.repeats)))
        except NotImplementedError:
            print(f"| {impl} | n/a | | | n/a | | |", flush=True)
            continue
        (fp, gp), (fu, gu) = cells
        print(f"| {impl} | {fp * 1e3:.2f} | {fu * 1e3:.2f} | {fp / fu:.2f} | {gp * 1e3:.2f} | {gu * 1e3:.2f} "
              f"| {gp / gu:.2f} |", flush=True)


if __name__ == "__main__":
    main()
