"""Time `sdm_write_read` forward and forward+backward for each implementation; print a Markdown table.

    python benchmarks/bench.py [--impls reference,xla,ffi] [--shape cpu-small|cpu-large|small|mid|flagship] [--repeats N]

* forward: `jax.jit` of the op, returning `(y, final_bank)`.
* forward+backward: `jax.jit(jax.grad(loss))` with `loss = sum(y * dy) + sum(final_bank * dbank)` (fixed random
  cotangents `dy`, `dbank`), differentiated with respect to every float input (bank, k_val, v, beta, g, q_val).
  `--loss y` drops the final bank's term, as when a model's loss reads only the readings.
* Each function is called once to warm up (tracing and compilation), then timed over `--repeats` calls with
  `jax.block_until_ready`; the table shows the median. tokens/s is `B*T*H / time`.
* An implementation that raises `NotImplementedError` (not built in this install) is reported as "n/a", one that
  runs out of memory as "OOM" (the token loop's gradient keeps a bank per token). Any other error is printed to
  stderr, shown as "error" in the table, and makes the exit status 1.

Inputs come from `jax_sdm.testing.random_problem` (distinct write and read slots per token). Shapes `small`, `mid`
and `flagship` are the GPU performance anchors (one stream per batch element, H=1 and B=P; bfloat16 bank; chunk 64
unless `--chunk`): for them the table adds our time divided by the reference PyTorch package's time on one H200 at
that package's best chunk size (ANCHORS); below 1 is faster than the package.
"""
import argparse
import datetime
import itertools
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdm
from jax_sdm import sdm_write_read
from jax_sdm.testing import random_problem

ARG_NAMES = ("bank", "k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val")
FLOAT_ARGS = (0, 2, 3, 4, 5, 7)  # positions of bank, k_val, v, beta, g, q_val

SHAPES = {
    "cpu-small": dict(B=2, H=2, T=256, K=1024, D=32, W=8, R=8, chunk=32, dtype="float32"),
    # about a second for the pure-JAX paths on the 2-core CPU machine
    "cpu-large": dict(B=4, H=2, T=2048, K=1024, D=64, W=16, R=16, chunk=64, dtype="float32"),
    "small": dict(B=8, H=1, T=2048, K=16384, D=128, W=16, R=16, chunk=64, dtype="bfloat16"),
    "mid": dict(B=4, H=1, T=4096, K=65536, D=512, W=32, R=32, chunk=64, dtype="bfloat16"),
    "flagship": dict(B=4, H=1, T=4096, K=65536, D=1024, W=64, R=64, chunk=64, dtype="bfloat16"),
}

# The reference PyTorch package on one H200, bfloat16 bank, at its best chunk size (measured 2026-12-01; ms, GiB):
# forward + backward, no-grad forward, peak training memory. A user picks the best chunk of each implementation, so
# the ratios compare against these whatever chunk we run.
ANCHORS = {
    "small": dict(fwd_bwd=5.50, nograd_fwd=1.93, peak_gib=0.39),
    "mid": dict(fwd_bwd=6.65, nograd_fwd=2.09, peak_gib=1.56),
    "flagship": dict(fwd_bwd=12.50, nograd_fwd=3.85, peak_gib=3.92),
}

NA, OOM, ERROR = "n/a", "OOM", "error"


def make_inputs(shape, seed):
    dtype = jnp.bfloat16 if shape["dtype"] == "bfloat16" else np.float32
    dims = {k: shape[k] for k in ("B", "T", "H", "K", "D", "W", "R")}
    problem = random_problem(seed, **dims, dtype=dtype)
    args = [jnp.asarray(problem[name]) for name in ARG_NAMES]
    # The cotangents in the bank's dtype, made on the host: no float32 copy of a bank-sized array on the device
    # (it would count in the peak memory).
    rng = np.random.default_rng(seed + 1)
    dy = jnp.asarray(rng.standard_normal(args[3].shape, dtype=np.float32), dtype=args[0].dtype)
    dbank = jnp.asarray(rng.standard_normal(args[0].shape, dtype=np.float32), dtype=args[0].dtype)
    return args, dy, dbank


def make_functions(impl, chunk, dy, dbank):
    def forward(*args):
        return sdm_write_read(*args, chunk_size=chunk, impl=impl)

    def loss(*args):
        y, final = forward(*args)
        out = jnp.sum(y.astype(jnp.float32) * dy)
        # dbank None: a loss of the readings only (the final bank's cotangent is then zeros made inside the jit)
        return out if dbank is None else out + jnp.sum(final.astype(jnp.float32) * dbank)

    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=FLOAT_ARGS))


WARMUP_SECONDS = 0.5


def median_seconds(fn, args, repeats):
    """Warm up (at least 3 calls and WARMUP_SECONDS: an idle GPU starts at a low clock and needs a moment of
    work to reach its boost clock; a single warm-up call left the medians of the mid shape 13% apart between two
    processes), then the median wall time of `repeats` calls (seconds)."""
    start = time.perf_counter()
    for i in itertools.count():
        jax.block_until_ready(fn(*args))
        if i >= 2 and time.perf_counter() - start >= WARMUP_SECONDS:
            break
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(label, fn, args, repeats):
    """Seconds, or NA / ERROR."""
    try:
        return median_seconds(fn, args, repeats)
    except NotImplementedError as err:
        print(f"[{label}] not available: {err}", file=sys.stderr)
        return NA
    except Exception as err:  # noqa: BLE001  (report, keep benchmarking the other rows)
        if "RESOURCE_EXHAUSTED" in str(err):  # e.g. the token loop's gradient at the large shapes
            print(f"[{label}] out of memory: {str(err).splitlines()[0]}", file=sys.stderr)
            return OOM
        print(f"[{label}] failed:", file=sys.stderr)
        traceback.print_exc()
        return ERROR


def detail_row(impl, name, shape, args, dy, dbank, repeats):
    """The GPU table's row: no-grad forward, training forward (the VJP's forward, saving residuals), backward
    (applying the VJP), their sum, forward + backward as one jitted grad, peak device memory of the one-jit grad
    (timed first in the process: the inputs, the cotangents in the bank's dtype, and what the step held besides),
    the forward's bank bandwidth
    and the ratios to the reference package's best (ANCHORS)."""
    chunk = shape["chunk"]
    floats = [args[i] for i in FLOAT_ARGS]
    rest = {i: a for i, a in enumerate(args) if i not in FLOAT_ARGS}

    def op(*fl):
        full = [rest[i] if i in rest else None for i in range(len(args))]
        for i, a in zip(FLOAT_ARGS, fl):
            full[i] = a
        return sdm_write_read(*full, chunk_size=chunk, impl=impl)

    nograd = jax.jit(op)
    train_fwd = jax.jit(lambda *fl: jax.vjp(op, *fl))
    y, final = jax.eval_shape(nograd, *floats)
    cts = (dy.astype(y.dtype), jnp.zeros(final.shape, final.dtype) if dbank is None else dbank.astype(final.dtype))
    bwd = jax.jit(lambda vjp_fn: vjp_fn(cts))
    # The one-jit grad first: the peak after it is a training step's (inputs, cotangents, residuals, gradients).
    _, grad = make_functions(impl, chunk, dy, dbank)
    t_grad = measure(f"{impl} {name} grad", grad, args, repeats)
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    t_nograd = measure(f"{impl} {name} no-grad fwd", nograd, floats, repeats)
    t_train = measure(f"{impl} {name} training fwd", train_fwd, floats, repeats)
    _, vjp_fn = train_fwd(*floats)
    t_bwd = measure(f"{impl} {name} bwd", bwd, (vjp_fn,), repeats)
    del vjp_fn
    elem = 2 if shape["dtype"] == "bfloat16" else 4
    bank_bytes = shape["B"] * shape["H"] * shape["T"] * (3 * shape["W"] + shape["R"]) * shape["D"] * elem
    anchor = ANCHORS.get(name, {})
    total = t_train + t_bwd if not isinstance(t_train, str) and not isinstance(t_bwd, str) else ERROR
    peak_gib = None if peak is None else peak / 2**30
    return [impl, name, str(chunk), fmt_ms(t_nograd), fmt_ms(t_train), fmt_ms(t_bwd), fmt_ms(total), fmt_ms(t_grad),
            "-" if peak is None else f"{peak_gib:.2f}",
            t_nograd if isinstance(t_nograd, str) else f"{bank_bytes / t_nograd / 1e12:.2f}",
            fmt_ratio(t_nograd, anchor.get("nograd_fwd")), fmt_ratio(t_grad, anchor.get("fwd_bwd")),
            fmt_ratio(total, anchor.get("fwd_bwd")),
            "-" if peak is None or "peak_gib" not in anchor else f"{peak_gib / anchor['peak_gib']:.2f}x"]


DETAIL_HEADER = ["impl", "shape", "chunk", "no-grad fwd ms", "fwd ms", "bwd ms", "fwd+bwd ms", "grad ms", "grad peak GiB",
                 "fwd bank TB/s", "no-grad / ref", "grad / ref", "fwd+bwd / ref", "peak / ref"]


def print_table(header, rows):
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def fmt_ms(t):
    return t if isinstance(t, str) else f"{1e3 * t:.2f}"


def fmt_rate(tokens, t):
    return t if isinstance(t, str) else f"{tokens / t:.3g}"


def fmt_ratio(t, anchor_ms):
    if isinstance(t, str) or anchor_ms is None:
        return "-" if anchor_ms is None else t
    return f"{1e3 * t / anchor_ms:.2f}x"


def git_commit():
    """$SDM_COMMIT when set (the GPU machine's copy of the tree may carry stale git metadata), else git's HEAD."""
    if os.environ.get("SDM_COMMIT"):
        return os.environ["SDM_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _load():
    """The 1-minute load average, for judging CPU timings on a shared machine."""
    try:
        return f", load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    except (AttributeError, OSError):
        return ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impls", default="reference,xla,ffi",
                        help="comma-separated implementations (default: reference,xla,ffi)")
    parser.add_argument("--shape", default=None,
                        help=f"comma-separated shapes from {', '.join(SHAPES)} "
                             "(default: cpu-small on CPU, small elsewhere)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (default 5)")
    parser.add_argument("--chunk", type=int, default=None, help="override the shape's chunk size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--detail", action="store_true",
                        help="the GPU table instead: no-grad fwd, training fwd, bwd, peak memory, bank bandwidth "
                             "(bytes: (3W + R) * D per token and stream), ratios to the reference package; run one "
                             "shape per process for a meaningful peak")
    parser.add_argument("--loss", choices=["y+bank", "y"], default="y+bank",
                        help="the training loss: sum(y * dy) + sum(final_bank * dbank) (the default), or sum(y * dy) "
                             "alone, as when a model's loss reads only the readings (no bank-sized cotangent "
                             "argument)")
    opts = parser.parse_args(argv)

    backend = jax.default_backend()
    shapes = (opts.shape or ("cpu-small" if backend == "cpu" else "small")).split(",")
    impls = [s.strip() for s in opts.impls.split(",") if s.strip()]
    for name in shapes:
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    for impl in impls:
        if impl not in jax_sdm.ops.IMPLS:
            parser.error(f"unknown impl {impl!r}; choose from {', '.join(jax_sdm.ops.IMPLS)}")
    if opts.repeats < 1:
        parser.error("--repeats must be at least 1")

    device = jax.devices()[0]
    print(f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}, commit {git_commit()}, "
          f"jax {jax.__version__}, backend {backend}, device {device.device_kind}, "
          f"median of {opts.repeats} runs after one warm-up call, loss {opts.loss}{_load()}", flush=True)
    print()

    rows = []
    failed = False
    for name in shapes:
        shape = dict(SHAPES[name])
        if opts.chunk is not None:
            shape["chunk"] = opts.chunk
        args, dy, dbank = make_inputs(shape, opts.seed)
        if opts.loss == "y":
            dbank = None
        tokens = shape["B"] * shape["T"] * shape["H"]
        anchor = ANCHORS.get(name)
        for impl in impls:
            if opts.detail:
                rows.append(detail_row(impl, name, shape, args, dy, dbank, opts.repeats))
                failed |= ERROR in rows[-1]
                continue
            fwd, fwd_bwd = make_functions(impl, shape["chunk"], dy, dbank)
            t_fwd = measure(f"{impl} {name} fwd", fwd, args, opts.repeats)
            t_bwd = measure(f"{impl} {name} fwd+bwd", fwd_bwd, args, opts.repeats)
            failed |= ERROR in (t_fwd, t_bwd)
            rows.append([
                impl, name, fmt_ms(t_fwd), fmt_ms(t_bwd), fmt_rate(tokens, t_fwd), fmt_rate(tokens, t_bwd),
                fmt_ratio(t_fwd, anchor and anchor["nograd_fwd"]),
                fmt_ratio(t_bwd, anchor and anchor["fwd_bwd"]),
            ])
            print(f"  {impl} {name}: fwd {fmt_ms(t_fwd)}, fwd+bwd {fmt_ms(t_bwd)} (ms)", file=sys.stderr, flush=True)
        del args, dy, dbank

    header = ["impl", "shape", "fwd ms", "fwd+bwd ms", "fwd tokens/s", "fwd+bwd tokens/s",
              "fwd / anchor", "fwd+bwd / anchor"]
    print_table(DETAIL_HEADER if opts.detail else header, rows)
    for name in shapes:
        s = SHAPES[name]
        chunk = opts.chunk or s["chunk"]
        print(f"- {name}: B={s['B']} H={s['H']} T={s['T']} K={s['K']} D={s['D']} W={s['W']} R={s['R']} "
              f"chunk={chunk} {s['dtype']} bank")
    for name in shapes:
        if name in ANCHORS:
            a = ANCHORS[name]
            print(f"- reference package at its best chunk on one H200 ({name}): no-grad fwd {a['nograd_fwd']} ms, "
                  f"fwd+bwd {a['fwd_bwd']} ms, peak {a['peak_gib']} GiB")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
