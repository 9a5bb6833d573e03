"""Time `product_key_topk` (the exact top-k over a product key's slots) per impl at the layer's addressing shapes,
forward and forward + backward.

    python benchmarks/bench_topk.py [--impls ffi,xla,nn] [--dtypes float32,bfloat16] [--rows N] [--calls 20]
                                    [--repeats 5] [--device-time]

* Configs (rows: the query rows of one address call, B * T * H): `a` 16384 rows, factors (256, 256), k 64 (the
  layer at B 4, T 4096, H 1, K 65536, W = R = 64); `b` 32768 rows, (128, 128), k 32 (K 16384, W = R = 32); `c`
  16384 rows, (64, 32, 32), k 64. `--rows` replaces every config's row count (a small CPU run).
* fwd: `jax.jit(product_key_topk)`; fwd+bwd: `jax.jit(jax.value_and_grad(sum(scores * ct)))`, the gradient of the
  factor scores. A run makes `--calls` calls (dispatched back to back, then waited for); the table shows the median
  over `--repeats` runs of the wall time per call in microseconds, after a warm-up run.
* `nn` is the layer's own addressing, `jax_sdm.nn.addressing.product_key_slots` on the split factor scores
  (whatever this tree's layer does: the baseline the kernels replace).
* `--device-time` traces one more run with `jax.profiler` and adds the device's kernel time per call (GPU only; n/a
  on the CPU backend, whose trace has no device).
* Scores are standard normal (random per row), the cotangents too.
"""
import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from device_trace import activity_time, device_events, is_device, record
from jax_sdm import product_key_topk

NA = "n/a"
CONFIGS = {"a": (16384, (256, 256), 64), "b": (32768, (128, 128), 32), "c": (16384, (64, 32, 32), 64)}


def topk_fn(impl, factors, k):
    """`x [rows, sum(factors)] -> (scores, ids)` of one impl."""
    if impl == "nn":
        from jax_sdm.nn.addressing import product_key_slots

        offsets = np.cumsum((0,) + factors)
        return lambda x: product_key_slots([x[..., offsets[f]:offsets[f + 1]] for f in range(len(factors))], k)
    return lambda x: product_key_topk(x, factors, k, impl=impl)


def time_call(fn, args, opts):
    """Median wall us per call over `opts.repeats` runs of `opts.calls` calls, and the device's kernel us per call
    in one more, traced run (None without a device or without `opts.device_time`)."""
    def run():
        out = None
        for _ in range(opts.calls):
            out = fn(*args)
        jax.block_until_ready(out)

    run()  # compile
    times = []
    for _ in range(opts.repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) / opts.calls)
    kernel = None
    if opts.device_time:
        events, processes = device_events(record(run))
        if any(is_device(p) for p in processes):
            kernel = activity_time(events)[0] / opts.calls
    return statistics.median(times) * 1e6, kernel


def measure(impl, config, dtype, mode, opts):
    rows, factors, k = CONFIGS[config]
    rows = opts.rows or rows
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, sum(factors))), dtype)
    ct = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    topk = topk_fn(impl, factors, k)
    if mode == "fwd":
        fn, args = jax.jit(topk), (x,)
    else:
        fn, args = jax.jit(jax.value_and_grad(lambda a, c: jnp.sum(topk(a)[0] * c))), (x, ct)
    try:
        return time_call(fn, args, opts)
    except (NotImplementedError, ValueError) as err:
        print(f"[{impl} {config} {jnp.dtype(dtype).name} {mode}] not available: {err}", file=sys.stderr)
        return NA, None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", default="ffi,xla,nn", help="comma list of ffi, xla, nn (the layer's addressing)")
    parser.add_argument("--configs", default="a,b,c", help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--rows", type=int, default=0, help="rows of every config (0: the config's own)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device-time", action="store_true",
                        help="also the device's kernel time per call, from one more run under jax.profiler (GPU)")
    opts = parser.parse_args(argv)
    impls, modes = opts.impls.split(","), opts.modes.split(",")
    print(f"`product_key_topk`, wall us per jitted call (median of {opts.repeats} runs of {opts.calls} calls)"
          + (", and device kernel us per call" if opts.device_time else "")
          + f"; device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print()
    suffixes = ["wall", "kernel"] if opts.device_time else ["wall"]
    header = [f"{impl} {mode} {s}" for mode in modes for impl in impls for s in suffixes]
    print("| config | dtype | " + " | ".join(header) + " |")
    print("|---|---|" + "---:|" * len(header))
    for config in opts.configs.split(","):
        rows, factors, k = CONFIGS[config]
        label = f"{config}: rows {opts.rows or rows}, factors {factors}, k {k}"
        for dtype in opts.dtypes.split(","):
            cells = []
            for mode in modes:
                for impl in impls:
                    wall, kernel = measure(impl, config, jnp.dtype(dtype), mode, opts)
                    cells.append(wall if isinstance(wall, str) else f"{wall:.1f}")
                    if opts.device_time:
                        cells.append(NA if kernel is None else f"{kernel:.1f}")
            print(f"| {label} | {dtype} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
