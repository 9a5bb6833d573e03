"""Time `sdm_write_read` forward and forward+backward for each implementation; print a Markdown table.

    python benchmarks/bench.py [--impls reference,xla,ffi]
                               [--shape cpu-small|cpu-large|cpu-demo|cpu-notebook|small|mid|flagship|paper|mid-16k|...]
                               [--repeats N] [--pipeline N] [--chunk C] [--detail] [--loss y+bank|y]
                               [--snapshot-dtype bfloat16|float8_e4m3fn|int4]

* forward: `jax.jit` of the op, returning `(y, final_bank)`.
* forward+backward: `jax.jit(jax.grad(loss))` with `loss = sum(y * dy) + sum(final_bank * dbank)` (fixed random
  cotangents `dy`, `dbank`), differentiated with respect to every float input (bank, k_val, v, beta, g, q_val).
  `--loss y` drops the final bank's term, as when a model's loss reads only the readings.
* Each function is warmed up (tracing and compilation, then calls for at least half a second), then timed two ways:
  - pipelined (the main columns): `--pipeline` calls enqueued back to back without waiting in between (earlier
    results dropped at once), one wait at the end; time per call = the run's time / calls, median over `--repeats`
    runs. When the device is the bottleneck this is the device time per call, what CUDA events around a loop of
    calls measure (how the reference package's numbers were taken).
  - synchronous (the "(sync)" columns): each call followed by `jax.block_until_ready`; the median over `--repeats`
    calls. This adds the host's dispatch and the wait for the result to every call: what a loop that needs each
    result before the next call pays.
  tokens/s is `B*T*H / time` (pipelined). On the CPU, pipelined calls may run side by side on several cores.
* `--detail` also times the no-grad forward with `in_place=True` and the bank donated, each call taking the bank
  the previous one returned (the "in place" columns): a prefill that drops its old bank.
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
import functools
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
    "cpu-demo": dict(B=2, H=4, T=512, K=1024, D=32, W=8, R=8, chunk=64, dtype="float32"),  # examples/demo.py's
    "cpu-notebook": dict(B=1, H=2, T=2048, K=1024, D=32, W=8, R=8, chunk=64, dtype="float32"),  # notebook 04's, T 2048
    "small": dict(B=8, H=1, T=2048, K=16384, D=128, W=16, R=16, chunk=64, dtype="bfloat16"),
    "mid": dict(B=4, H=1, T=4096, K=65536, D=512, W=32, R=32, chunk=64, dtype="bfloat16"),
    "flagship": dict(B=4, H=1, T=4096, K=65536, D=1024, W=64, R=64, chunk=64, dtype="bfloat16"),
    # the shape the reference's authors benchmarked their first version at: one head of width 2048, 512^2 slots
    "paper": dict(B=2, H=1, T=8192, K=262144, D=2048, W=64, R=64, chunk=64, dtype="bfloat16"),
}
# Long-context variants of the anchors: the same streams and bank, 4x and 8x the tokens.
for _name in ("mid", "flagship"):
    for _T in (16384, 32768):
        SHAPES[f"{_name}-{_T // 1024}k"] = dict(SHAPES[_name], T=_T)

# The reference PyTorch package on one H200, bfloat16 bank, at its best chunk size (measured side by side with ours
# on 2026-12-03; ms, GiB): forward + backward, no-grad forward, peak training memory. A user picks the best chunk of
# each implementation, so the ratios compare against these whatever chunk we run.
ANCHORS = {
    "small": dict(fwd_bwd=6.35, nograd_fwd=1.91, peak_gib=0.32),
    "mid": dict(fwd_bwd=7.46, nograd_fwd=2.68, peak_gib=1.54),
    "flagship": dict(fwd_bwd=13.41, nograd_fwd=4.59, peak_gib=3.99),
    "paper": dict(fwd_bwd=25.15, nograd_fwd=7.77, peak_gib=9.54),
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


class WithCotangents:
    """A jitted function of `(*args, dy, dbank)` called as `f(*args)`: the cotangents go in as arguments. Closed over,
    they would be constants of the program, which XLA folds at compile time (minutes for a bank-sized one) and
    holds as a second copy on the device."""

    def __init__(self, fn, cotangents):
        self.fn, self.cotangents = fn, cotangents

    def __call__(self, *args):
        return self.fn(*args, *self.cotangents)

    def lower(self, *args):
        return self.fn.lower(*args, *self.cotangents)


def make_functions(impl, chunk, dy, dbank, snapshot_dtype=None):
    def forward(*args):
        return sdm_write_read(*args, chunk_size=chunk, impl=impl, snapshot_dtype=snapshot_dtype)

    def loss(*args_and_cotangents):
        *args, dy_, dbank_ = args_and_cotangents
        y, final = forward(*args)
        out = jnp.sum(y.astype(jnp.float32) * dy_)
        # dbank None: a loss of the readings only (the final bank's cotangent is then zeros made inside the jit)
        return out if dbank_ is None else out + jnp.sum(final.astype(jnp.float32) * dbank_)

    return jax.jit(forward), WithCotangents(jax.jit(jax.grad(loss, argnums=FLOAT_ARGS)), (dy, dbank))


class ThreadedBank:
    """A jitted `fn(bank, *rest) -> (y, final_bank)` with the bank donated, called as `f(*rest)`: each call takes
    the bank the previous call returned (a copy of `bank` first), as a prefill loop that drops its old bank
    does."""

    def __init__(self, fn, bank):
        self.fn, self.bank = jax.jit(fn, donate_argnums=0), jnp.array(bank, copy=True)

    def __call__(self, *rest):
        y, self.bank = self.fn(self.bank, *rest)
        return y


WARMUP_SECONDS = 0.5
PIPELINE_CALLS = 10


def warm_up(fn, args):
    """At least 3 calls and WARMUP_SECONDS: compilation, and an idle GPU starts at a low clock and needs a moment
    of work to reach its boost clock (a single warm-up call left the medians of the mid shape 13% apart between
    two processes)."""
    start = time.perf_counter()
    for i in itertools.count():
        jax.block_until_ready(fn(*args))
        if i >= 2 and time.perf_counter() - start >= WARMUP_SECONDS:
            break


def sync_seconds(fn, args, repeats):
    """The median wall time of `repeats` calls, each waited for (seconds)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pipelined_seconds(fn, args, repeats, calls):
    """The median over `repeats` runs of a run's wall time / `calls`, a run enqueueing `calls` calls back to back
    and waiting once, for the last (seconds). The earlier calls' results are dropped as soon as they are returned
    (their buffers go back to the allocator once the call has run), so memory does not grow with `calls`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls - 1):
            fn(*args)
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def measure(label, fn, args, repeats, calls, after_sync=None):
    """(pipelined seconds, synchronous seconds), each NA / OOM / ERROR where the function could not run.
    `after_sync()` is called between the two measurements (the peak memory of synchronous calls)."""
    try:
        warm_up(fn, args)
        sync = sync_seconds(fn, args, repeats)
        if after_sync is not None:
            after_sync()
        return pipelined_seconds(fn, args, repeats, calls), sync
    except NotImplementedError as err:
        print(f"[{label}] not available: {err}", file=sys.stderr)
        return NA, NA
    except Exception as err:  # noqa: BLE001  (report, keep benchmarking the other rows)
        if "RESOURCE_EXHAUSTED" in str(err):  # e.g. the token loop's gradient at the large shapes
            print(f"[{label}] out of memory: {str(err).splitlines()[0]}", file=sys.stderr)
            return OOM, OOM
        print(f"[{label}] failed:", file=sys.stderr)
        traceback.print_exc()
        return ERROR, ERROR


def detail_row(impl, name, shape, args, dy, dbank, repeats, calls, snapshot_dtype=None):
    """The GPU table's row: no-grad forward, training forward (the VJP's forward, saving residuals), backward
    (applying the VJP), their sum, forward + backward as one jitted grad, peak device memory of the one-jit grad
    (timed first in the process, read after its synchronous calls: the inputs, the cotangents in the bank's dtype,
    and what one step held besides), the forward's bank bandwidth and the ratios to the reference package's best
    (ANCHORS), all from the pipelined times; then the synchronous times."""
    chunk = shape["chunk"]
    floats = [args[i] for i in FLOAT_ARGS]
    rest = {i: a for i, a in enumerate(args) if i not in FLOAT_ARGS}

    def op(*fl, in_place=False):
        full = [rest[i] if i in rest else None for i in range(len(args))]
        for i, a in zip(FLOAT_ARGS, fl):
            full[i] = a
        return sdm_write_read(*full, chunk_size=chunk, impl=impl, snapshot_dtype=snapshot_dtype, in_place=in_place)

    nograd = jax.jit(op)
    train_fwd = jax.jit(lambda *fl: jax.vjp(op, *fl))
    # The one-jit grad first: the peak after it is a training step's (inputs, cotangents, residuals, gradients),
    # so nothing else may be on the device yet (the separate backward's cotangents are made after it).
    _, grad = make_functions(impl, chunk, dy, dbank, snapshot_dtype)
    peak = []
    t_grad = measure(f"{impl} {name} grad", grad, args, repeats, calls,
                     after_sync=lambda: peak.append((jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")))
    peak = peak[0] if peak else None
    y, final = jax.eval_shape(nograd, *floats)
    cts = (dy.astype(y.dtype), jnp.zeros(final.shape, final.dtype) if dbank is None else dbank.astype(final.dtype))
    # The cotangents go in as arguments: closed over they would be constants of the program (a bank-sized one
    # at the paper's shape, 2 GiB), as WithCotangents says.
    bwd = jax.jit(lambda vjp_fn, cts: vjp_fn(cts))
    t_nograd = measure(f"{impl} {name} no-grad fwd", nograd, floats, repeats, calls)
    in_place = ThreadedBank(functools.partial(op, in_place=True), floats[0])
    t_in_place = measure(f"{impl} {name} no-grad fwd, bank donated", in_place, floats[1:], repeats, calls)
    del in_place
    t_train = measure(f"{impl} {name} training fwd", train_fwd, floats, repeats, calls)
    _, vjp_fn = train_fwd(*floats)
    t_bwd = measure(f"{impl} {name} bwd", bwd, (vjp_fn, cts), repeats, calls)
    del vjp_fn
    elem = 2 if shape["dtype"] == "bfloat16" else 4
    bank_bytes = shape["B"] * shape["H"] * shape["T"] * (3 * shape["W"] + shape["R"]) * shape["D"] * elem
    anchor = ANCHORS.get(name, {})
    # fwd+bwd: the two jitted calls' sum, in each way of timing
    total = [t if isinstance(t, str) else b if isinstance(b, str) else t + b for t, b in zip(t_train, t_bwd)]
    nograd_s, grad_s, total_s = t_nograd[0], t_grad[0], total[0]
    peak_gib = None if peak is None else peak / 2**30
    return [impl, name, str(chunk), fmt_ms(nograd_s), fmt_ms(t_train[0]), fmt_ms(t_bwd[0]), fmt_ms(total_s),
            fmt_ms(grad_s), "-" if peak is None else f"{peak_gib:.2f}",
            nograd_s if isinstance(nograd_s, str) else f"{bank_bytes / nograd_s / 1e12:.2f}",
            fmt_ratio(nograd_s, anchor.get("nograd_fwd")), fmt_ratio(grad_s, anchor.get("fwd_bwd")),
            fmt_ratio(total_s, anchor.get("fwd_bwd")),
            "-" if peak is None or "peak_gib" not in anchor else f"{peak_gib / anchor['peak_gib']:.2f}x",
            fmt_ms(t_nograd[1]), fmt_ms(t_train[1]), fmt_ms(t_bwd[1]), fmt_ms(total[1]), fmt_ms(t_grad[1]),
            fmt_ms(t_in_place[0]), fmt_ratio(t_in_place[0], anchor.get("nograd_fwd")), fmt_ms(t_in_place[1])]


DETAIL_HEADER = ["impl", "shape", "chunk", "no-grad fwd ms", "fwd ms", "bwd ms", "fwd+bwd ms", "grad ms", "grad peak GiB",
                 "fwd bank TB/s", "no-grad / ref", "grad / ref", "fwd+bwd / ref", "peak / ref",
                 "no-grad fwd ms (sync)", "fwd ms (sync)", "bwd ms (sync)", "fwd+bwd ms (sync)", "grad ms (sync)",
                 "no-grad in place ms", "in place / ref", "no-grad in place ms (sync)"]


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
    parser.add_argument("--repeats", type=int, default=5,
                        help="pipelined runs, and synchronous calls, per measurement; the tables show medians "
                             "(default 5)")
    parser.add_argument("--pipeline", type=int, default=PIPELINE_CALLS,
                        help=f"calls per pipelined run, enqueued back to back (default {PIPELINE_CALLS})")
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
    parser.add_argument("--snapshot-dtype", default=None, choices=["bfloat16", "float8_e4m3fn", "int4"],
                        help="sdm_write_read's snapshot_dtype (the kernels' storage of the written rows the "
                             "backward reads; default: the bank's dtype)")
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
    if opts.pipeline < 1:
        parser.error("--pipeline must be at least 1")

    device = jax.devices()[0]
    print(f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}, commit {git_commit()}, "
          f"jax {jax.__version__}, backend {backend}, device {device.device_kind}, "
          f"loss {opts.loss}, snapshot {opts.snapshot_dtype or 'the bank dtype'}{_load()}", flush=True)
    print(f"ms: per call in runs of {opts.pipeline} calls enqueued back to back, one wait per run (device time per "
          f"call when the device is the bottleneck), median of {opts.repeats} runs; ms (sync): each call waited "
          f"for, median of {opts.repeats} calls; both after at least {WARMUP_SECONDS} s of warm-up calls")
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
                rows.append(detail_row(impl, name, shape, args, dy, dbank, opts.repeats, opts.pipeline,
                                       opts.snapshot_dtype))
                failed |= ERROR in rows[-1]
                continue
            fwd, fwd_bwd = make_functions(impl, shape["chunk"], dy, dbank, opts.snapshot_dtype)
            (t_fwd, t_fwd_sync) = measure(f"{impl} {name} fwd", fwd, args, opts.repeats, opts.pipeline)
            (t_bwd, t_bwd_sync) = measure(f"{impl} {name} fwd+bwd", fwd_bwd, args, opts.repeats, opts.pipeline)
            failed |= ERROR in (t_fwd, t_bwd)
            rows.append([
                impl, name, fmt_ms(t_fwd), fmt_ms(t_bwd), fmt_rate(tokens, t_fwd), fmt_rate(tokens, t_bwd),
                fmt_ratio(t_fwd, anchor and anchor["nograd_fwd"]),
                fmt_ratio(t_bwd, anchor and anchor["fwd_bwd"]),
                fmt_ms(t_fwd_sync), fmt_ms(t_bwd_sync),
            ])
            print(f"  {impl} {name}: fwd {fmt_ms(t_fwd)}, fwd+bwd {fmt_ms(t_bwd)} (ms; sync {fmt_ms(t_fwd_sync)}, "
                  f"{fmt_ms(t_bwd_sync)})", file=sys.stderr, flush=True)
        del args, dy, dbank

    header = ["impl", "shape", "fwd ms", "fwd+bwd ms", "fwd tokens/s", "fwd+bwd tokens/s",
              "fwd / anchor", "fwd+bwd / anchor", "fwd ms (sync)", "fwd+bwd ms (sync)"]
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
