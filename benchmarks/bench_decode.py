"""Time `sdm_step` (one decode token for every stream, the bank donated) against the number of slots `K`.

    python benchmarks/bench_decode.py [--impls ffi,xla] [--dtypes bfloat16,float32] [--min-log-k 12]
                                      [--max-log-k 20] [--steps 200] [--repeats 5] [--in-jit] [--device-time]
                                      [--B 4 --H 4 --D 128 --W 16 --R 16]

* The step is `jax.jit(sdm_step, donate_argnums=0)`; a run calls it `--steps` times in a Python loop, feeding the
  returned bank back in and cycling through 16 different tokens, then waits for the result. The table shows the
  median over `--repeats` runs of the wall time per step, in microseconds (after one warm-up run). This is what a
  decoding loop pays per token: dispatch, the kernel, and no copy of the bank.
* Tokens follow the benchmarks' recipe: distinct slots `a + n*b mod K` per token, l2-normalised weights, `v` standard
  normal, `beta = sigmoid(randn)`, `g = -0.5 * softplus(randn)`; the bank is `0.1 * randn`.
* `--impls noop` times a jitted, donated call with the same arguments and results that computes nothing (`y = v`,
  the bank passed through): the floor that dispatching a step costs.
* `--device-time` runs the loop once more under `jax.profiler` and adds, per step, the device's time in kernels and
  its busy time (kernels, copies and memsets), overlapping activities counted once and idle gaps not counted, and
  the number of kernels: what the step costs the GPU when the host's dispatch is not the bottleneck. On the CPU
  backend the trace has no device (the steps run on host threads), and these columns say n/a.
* The default `--max-log-k` is 20 on a GPU and 16 on the CPU (a float32 bank of `B*H*K*D` values takes 8 GiB at
  K = 2^20 and the default shape). An implementation that raises `NotImplementedError` shows as "n/a".
"""
import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from device_trace import activity_time, device_events, is_device, record
from jax_sdm import sdm_step

NA = "n/a"


def make_tokens(seed, n, B, H, K, D, W, R, dtype):
    """`n` random tokens (dicts of device arrays) in `sdm_step`'s layout."""
    rng = np.random.default_rng(seed)

    def slots(lanes):
        a = rng.integers(0, K, size=(B, H, 1))
        b = 2 * rng.integers(0, max(K // 2, 1), size=(B, H, 1)) + 1
        return jnp.asarray((a + np.arange(lanes) * b) % K, jnp.int32)

    def unit_rows(lanes):
        x = rng.standard_normal((B, H, lanes))
        return jnp.asarray(x / np.linalg.norm(x, axis=-1, keepdims=True), dtype)

    return [dict(k_idx=slots(W), k_val=unit_rows(W), v=jnp.asarray(rng.standard_normal((B, H, D)), dtype),
                 beta=jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((B, H)))), jnp.float32),
                 g=jnp.asarray(-0.5 * np.logaddexp(0, rng.standard_normal((B, H))), jnp.float32),
                 q_idx=slots(R), q_val=unit_rows(R)) for _ in range(n)]


def microseconds_per_step(impl, dtype, K, args):
    """Median wall time per step over `args.repeats` runs of `args.steps` donated steps, or NA; with
    `args.device_time` also the device's (kernel us, busy us, kernels) per step in one more run, traced (None when
    the trace has no device), and the trace's process names."""
    shape = (args.B, args.H, K, args.D)
    bank = jax.jit(lambda key: (0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype))(
        jax.random.PRNGKey(K))
    tokens = make_tokens(K, 16, args.B, args.H, K, args.D, args.W, args.R, dtype)
    if impl == "noop":  # the dispatch floor: a jitted, donated call with the same arguments and results that
        # computes nothing (y = v, the bank passed through)
        def one(bank, tok):
            return tok["v"], bank
    else:
        def one(bank, tok):
            return sdm_step(bank, **tok, impl=impl)

    if args.in_jit:  # every step inside one jitted, donated call: a loop over the stacked tokens
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *tokens)

        @functools.partial(jax.jit, donate_argnums=0)
        def steps(bank, stacked):
            def body(i, carry):
                y, bank = one(carry[1], jax.tree.map(lambda x: x[i % len(tokens)], stacked))
                return y, bank
            return jax.lax.fori_loop(0, args.steps, body, (jnp.zeros_like(tokens[0]["v"]), bank))

        def run(bank):
            y, bank = steps(bank, stacked)
            jax.block_until_ready((y, bank))
            return bank
    else:
        step = jax.jit(one, donate_argnums=0)

        def run(bank):
            y = None
            for i in range(args.steps):
                y, bank = step(bank, tokens[i % len(tokens)])
            jax.block_until_ready((y, bank))
            return bank

    try:
        bank = run(bank)  # warm-up: compile
    except NotImplementedError as err:
        print(f"[{impl} {jnp.dtype(dtype).name} K={K}] not available: {err}", file=sys.stderr)
        return NA, None, []
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        bank = run(bank)
        times.append((time.perf_counter() - start) / args.steps)
    device, processes = None, []
    if args.device_time:
        carry = [bank]
        del bank  # donated by the traced run: the only reference is the carry's

        def traced():
            carry[0] = run(carry[0])

        events, processes = device_events(record(traced))
        if any(is_device(p) for p in processes):
            kernel_us, busy_us, kernels = activity_time(events)
            device = (kernel_us / args.steps, busy_us / args.steps, kernels / args.steps)
    return statistics.median(times) * 1e6, device, processes


def main():
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", default="ffi,xla",
                        help="comma list of ffi, xla, reference, and noop (a jitted donated call with the same arguments "
                             "that computes nothing: what dispatching any step costs)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--min-log-k", type=int, default=12)
    parser.add_argument("--max-log-k", type=int, default=20 if on_gpu else 16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--in-jit", action="store_true",
                        help="run the steps inside one jitted call (a fori_loop): the time per step without "
                             "Python's dispatch, as in a generation loop compiled whole")
    parser.add_argument("--device-time", action="store_true",
                        help="also trace one run with jax.profiler and report the device's kernel time, busy time "
                             "and kernels per step (GPU only; n/a on the CPU backend)")
    for name, default in (("B", 4), ("H", 4), ("D", 128), ("W", 16), ("R", 16)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    impls = args.impls.split(",")
    dtypes = [jnp.dtype(d) for d in args.dtypes.split(",")]

    columns = [(impl, dtype) for dtype in dtypes for impl in impls]
    how = "inside one jitted loop" if args.in_jit else "per jitted, donated call"
    print(f"`sdm_step`, wall time per step {how} (us), median of {args.repeats} runs of {args.steps} "
          f"steps; B {args.B}, H {args.H}, D {args.D}, W {args.W}, R {args.R}; device: {jax.devices()[0].device_kind}"
          f", jax {jax.__version__}")
    if args.device_time:
        print(f"wall: host wall time per step {how}. device (one more run of {args.steps} steps under jax.profiler, "
              "per step): kernel = time the device ran kernels, busy = time it ran any activity (kernels, copies, "
              "memsets), overlaps counted once and idle gaps not counted; kernels = kernel launches")
        suffixes = ["wall us/call" if not args.in_jit else "wall us/step", "device kernel us/step",
                    "device busy us/step", "kernels/step"]
    else:
        suffixes = [""]
    print()
    print("| K | " + " | ".join(f"{impl} {dtype.name}" + (f" {suffix}" if suffix else "")
                                for impl, dtype in columns for suffix in suffixes) + " |")
    print("|---|" + "---:|" * (len(columns) * len(suffixes)))
    no_device = set()  # the trace's processes, where one had no device
    for log_k in range(args.min_log_k, args.max_log_k + 1):
        K = 1 << log_k
        cells = []
        for impl, dtype in columns:
            t, device, processes = microseconds_per_step(impl, dtype, K, args)
            cells.append(t if isinstance(t, str) else f"{t:.1f}")
            if args.device_time:
                if device is None and not isinstance(t, str):
                    no_device.update(processes)
                cells += [NA] * 3 if device is None else [f"{device[0]:.1f}", f"{device[1]:.1f}", f"{device[2]:.2f}"]
        print(f"| 2^{log_k} | " + " | ".join(cells) + " |", flush=True)
    if no_device:
        print(f"\ndevice columns n/a: the {jax.default_backend()} backend's trace has no device process, only "
              f"{', '.join(sorted(no_device))} (the steps run on host threads): there is no device time to report")


if __name__ == "__main__":
    main()
