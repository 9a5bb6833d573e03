"""Time the `jax_sdm.nn.SparseDeltaMemory` layer against the op alone at the same shapes; print a Markdown table.

    python benchmarks/bench_layer.py [--config a,b | cpu] [--repeats N] [--pipeline N] [--trace]
                                     [--layer-option NAME=VALUE ...]
    python benchmarks/bench_layer.py --layer-decode [--min-log-k 12 --max-log-k 20] [--decode-steps 256] [--trace]
                                     [--decode-unroll 1,4]

For each config:
* layer training step: `jax.jit` of the gradient of `sum(layer(x) * dy)` with respect to `x` and every parameter;
* layer no-grad: `jax.jit` of the layer's call;
* op fwd+bwd and op no-grad: `sdm_write_read` alone on the arguments the layer makes for the same `x` (its
  addressing, values, strengths and gates), the gradient taken with respect to every float argument, the loss
  `sum(y * dy_op)`;
* overhead: (layer - op) / op, the share of the op's time the layer spends around it.
Timing as in bench.py: warm-up, then pipelined calls (device time per call when the device is the bottleneck),
median over `--repeats` runs. `--trace` adds a device timeline of one layer training step and one no-grad call,
the device time grouped by the layer's named scopes (`address`, `project`, `memory`, `readout`) and by kernel.

`--layer-decode`: decoding through the layer against the op alone, per token, against `K` (B 4, H 4, D 128,
d_model 512, W = R = 16, bf16; float32 on the CPU): the layer's `decode_loop` (one jit, a `lax.scan` over
`--decode-steps` tokens of `layer.decode`, the state donated) and `sdm_step` in the same kind of loop on the
memory inputs the layer makes for the same tokens; wall time per token, median of `--repeats` runs; each
`--decode-unroll` (steps per loop iteration, both loops) in turn. With `--trace`
also the device timeline of one loop at the smallest and the largest K, by scope and kernel.
"""
import argparse
import collections
import datetime
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench import fmt_ms, git_commit, pipelined_seconds, print_table, warm_up, _load
from device_trace import record

import jax_sdm
from jax_sdm.nn import SparseDeltaMemory, decode_loop
from jax_sdm.nn.layer import _decode_loop

# The layer configs of the brief (bf16, chunk 128, no output gate or readout norm), and a small one for the CPU.
CONFIGS = {
    "a": dict(B=4, T=4096, d_model=1024, num_heads=1, slots_per_head=65536, num_writes=64, num_reads=64,
              dtype="bfloat16", chunk_size=128),
    "b": dict(B=8, T=2048, d_model=1024, num_heads=4, slots_per_head=16384, num_writes=32, num_reads=32,
              dtype="bfloat16", chunk_size=128),
    "cpu": dict(B=2, T=512, d_model=128, num_heads=2, slots_per_head=1024, num_writes=8, num_reads=8,
                dtype="float32", chunk_size=64),
}
FLOAT_ARGS = (0, 2, 3, 4, 5, 7)  # bank, k_val, v, beta, g, q_val among the op's arguments


def parse_value(text):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def make_layer(config, options):
    dtype = jnp.bfloat16 if config["dtype"] == "bfloat16" else jnp.float32
    kwargs = dict(num_heads=config["num_heads"], slots_per_head=config["slots_per_head"],
                  num_writes=config["num_writes"], num_reads=config["num_reads"], chunk_size=config["chunk_size"],
                  output_gate=False, readout_norm=False, dtype=dtype)
    kwargs.update(options)
    return SparseDeltaMemory(config["d_model"], rngs=nnx.Rngs(0), **kwargs)


def layer_functions(layer, dy):
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def call(params, x):
        return nnx.merge(graphdef, params, rest)(x)[0]

    def loss(params, x):
        return jnp.sum(call(params, x).astype(jnp.float32) * dy)

    return params, jax.jit(call), jax.jit(jax.grad(loss, argnums=(0, 1)))


def op_functions(layer, chunk, dy_op):
    def call(*args):
        return jax_sdm.sdm_write_read(*args, chunk_size=chunk)

    def loss(*floats, ints):
        full = list(ints)
        for i, a in zip(FLOAT_ARGS, floats):
            full.insert(i, a)
        y, _ = call(*full)
        return jnp.sum(y.astype(jnp.float32) * dy_op)

    return jax.jit(call), jax.jit(jax.grad(loss, argnums=tuple(range(len(FLOAT_ARGS)))))


def timed(fn, args, repeats, calls):
    warm_up(fn, args)
    return pipelined_seconds(fn, args, repeats, calls)


SCOPES = ("address", "project", "memory", "readout")


def op_names(fn, args):
    """Instruction name -> op name (the named-scope path) of the compiled program of `fn`, the names with '.'
    written '_' (XLA names a fusion's kernel after its instruction: `sort.2` runs as `sort_2_0`)."""
    text = fn.lower(*args).compile().as_text()
    found = re.findall(r'%?([\w.\-]+) = [^\n]*?metadata=\{[^}]*?op_name="([^"]*)"', text)
    return {name.replace(".", "_"): op for name, op in found}


def scope_of(kernel, event_args, names):
    """The layer scope an XLA kernel belongs to, from its HLO instruction's op name; "sdm kernels" for the op's."""
    if "sdm::" in kernel:
        return "sdm kernels"
    key = str(event_args.get("hlo_op") or kernel).replace(".", "_")
    op = names.get(key) or names.get(re.sub(r"_\d+$", "", key), "")
    for scope in SCOPES:
        if re.search(rf"[/(]{scope}[)/]", f"/{op}/"):  # the scope, or it under a transformation: jvp(address)
            return scope
    return "other"


def timeline(fn, args, label):
    """The device time of one call of `fn`, grouped by the layer's scopes and by kernel (from a jax.profiler
    trace)."""
    warm_up(fn, args)
    names = op_names(fn, args)
    trace = record(lambda: jax.block_until_ready(fn(*args)))
    meta = [e for e in trace["traceEvents"] if e.get("ph") == "M" and e.get("name") == "process_name"]
    gpu = {e["pid"] for e in meta if "GPU" in e["args"]["name"] or "gpu" in e["args"]["name"]}
    threads = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e.get("ph") == "M"
               and e.get("name") == "thread_name" and e.get("pid") in gpu
               and e["args"]["name"].startswith("Stream")}
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("pid") in gpu
              and (not threads or (e["pid"], e.get("tid")) in threads)]
    if not events:
        print(f"{label}: no device events in the trace (CPU backend)")
        return
    by_scope, by_kernel = collections.Counter(), collections.Counter()
    for e in events:
        dur = float(e.get("dur", 0))
        by_scope[scope_of(e.get("name", ""), e.get("args", {}), names)] += dur
        by_kernel[e.get("name", "")[:60]] += dur
    span = max(float(e["ts"]) + float(e.get("dur", 0)) for e in events) - min(float(e["ts"]) for e in events)
    print(f"{label}: device span {span:.1f} us, busy {sum(by_scope.values()):.1f} us")
    for scope, t in by_scope.most_common():
        print(f"  scope {scope:10s} {t:9.1f} us")
    for name, t in by_kernel.most_common(25):
        print(f"  {t:9.1f} us  {name}")
    print()


DECODE = dict(B=4, num_heads=4, head_dim=128, num_writes=16, num_reads=16)


def decode_layer(K, steps, options):
    """The layer of the decode benchmark with `K` slots per head (in eval mode) and `steps` tokens of input."""
    B, H, D = DECODE["B"], DECODE["num_heads"], DECODE["head_dim"]
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    kwargs = dict(num_heads=H, head_dim=D, slots_per_head=K, num_writes=DECODE["num_writes"],
                  num_reads=DECODE["num_reads"], dtype=dtype, **options)
    layer = SparseDeltaMemory(H * D, rngs=nnx.Rngs(0), **kwargs)
    layer.eval()
    x = jnp.asarray(np.random.default_rng(K).standard_normal((B, steps, H * D), np.float32), dtype)
    return layer, x


def decode_timeline(K, steps, options):
    """The device timelines of one decode loop of `steps` tokens through the layer, then through the op alone, by
    scope and kernel. The loops are jitted without donating the state (a traced call must be repeatable): one copy
    of the state per call shows in each besides the steps."""
    layer, x = decode_layer(K, steps, options)
    graphdef, params = nnx.split(layer)
    loop = jax.jit(lambda params, x, state: _decode_loop(graphdef, params, x, state))
    state = layer.init_state(x.shape[0]) + 0
    timeline(loop, (params, x, state), f"layer decode, K 2^{K.bit_length() - 1}, {steps} tokens")
    args = jax.jit(lambda x: layer.memory_inputs(x))(x)
    timeline(op_decode_loop(1, donate=False), (state, args), f"op sdm_step, K 2^{K.bit_length() - 1}, {steps} tokens")


def op_decode_loop(unroll, donate=True):
    """`sdm_step` over the tokens of the layer's memory inputs in one jitted `lax.scan` (`unroll` steps an
    iteration): `(bank, args) -> (ys, bank)`, the bank donated unless `donate` is false."""
    def loop(bank, args):
        def body(bank, token):
            y, bank = jax_sdm.sdm_step(bank, *token)
            return bank, y
        bank, ys = jax.lax.scan(body, bank, tuple(jnp.swapaxes(a, 0, 1) for a in args), unroll=unroll)
        return ys, bank
    return jax.jit(loop, donate_argnums=0 if donate else ())


def decode_times(K, steps, repeats, options, unroll=1):
    """(layer us per token, op us per token) for decoding `steps` tokens inside one jitted, donated loop
    (`unroll` steps an iteration, both loops)."""
    B = DECODE["B"]
    layer, x = decode_layer(K, steps, options)
    args = jax.jit(lambda x: layer.memory_inputs(x))(x)

    op_loop = op_decode_loop(unroll)

    def per_token(loop, *inputs):
        state = layer.init_state(B) + 0  # a buffer of its own, to donate
        _, state = jax.block_until_ready(loop(*inputs, state))  # compile
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _, state = jax.block_until_ready(loop(*inputs, state))
            times.append((time.perf_counter() - start) / steps)
        return statistics.median(times) * 1e6

    t_layer = per_token(lambda x, state: decode_loop(layer, x, state, unroll=unroll), x)
    t_op = per_token(lambda args, state: op_loop(state, args), args)
    return t_layer, t_op


def main_decode(opts, options):
    backend = jax.default_backend()
    high = opts.max_log_k or (20 if backend != "cpu" else 14)
    print(f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}, commit {git_commit()}, jax {jax.__version__}, "
          f"device {jax.devices()[0].device_kind}, layer options {options or 'default'}{_load()}")
    print(f"decode, us per token inside one jitted loop of {opts.decode_steps} tokens (state donated), median of "
          f"{opts.repeats} runs; B {DECODE['B']}, H {DECODE['num_heads']}, D {DECODE['head_dim']}, d_model "
          f"{DECODE['num_heads'] * DECODE['head_dim']}, W {DECODE['num_writes']}, R {DECODE['num_reads']}")
    print()
    rows = []
    unrolls = [int(u) for u in opts.decode_unroll.split(",")]
    for log_k in range(opts.min_log_k, high + 1):
        for unroll in unrolls:
            t_layer, t_op = decode_times(1 << log_k, opts.decode_steps, opts.repeats, options, unroll)
            rows.append([f"2^{log_k}", str(unroll), f"{t_layer:.1f}", f"{t_op:.1f}", f"{t_layer / t_op:.2f}"])
            print(f"  K 2^{log_k}, unroll {unroll}: layer {t_layer:.1f} us, op {t_op:.1f} us", file=sys.stderr,
                  flush=True)
    print_table(["K", "unroll", "layer decode us/token", "op sdm_step us/token", "layer / op"], rows)
    if opts.trace:
        print()
        for log_k in sorted({opts.min_log_k, high}):
            decode_timeline(1 << log_k, opts.decode_steps, options)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=None, help=f"comma-separated configs from {', '.join(CONFIGS)} "
                        "(default: cpu on the CPU, a,b elsewhere)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--pipeline", type=int, default=20)
    parser.add_argument("--trace", action="store_true", help="also print a device timeline of the layer's calls")
    parser.add_argument("--layer-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an extra SparseDeltaMemory option (repeatable), e.g. addressing=topk")
    parser.add_argument("--layer-decode", action="store_true",
                        help="time decoding through the layer against the op alone, against K")
    parser.add_argument("--min-log-k", type=int, default=12)
    parser.add_argument("--max-log-k", type=int, default=None, help="default 20 (14 on the CPU)")
    parser.add_argument("--decode-steps", type=int, default=256)
    parser.add_argument("--decode-unroll", default="1",
                        help="comma-separated steps per loop iteration (decode_loop's unroll; the op's loop too)")
    opts = parser.parse_args(argv)
    backend = jax.default_backend()
    names = (opts.config or ("cpu" if backend == "cpu" else "a,b")).split(",")
    options = dict(o.split("=", 1) for o in opts.layer_option)
    options = {k: parse_value(v) for k, v in options.items()}
    if opts.layer_decode:
        return main_decode(opts, options)
    print(f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}, commit {git_commit()}, jax {jax.__version__}, "
          f"device {jax.devices()[0].device_kind}, layer options {options or 'default'}{_load()}")
    print(f"ms per call, {opts.pipeline} calls enqueued back to back, median of {opts.repeats} runs")
    print()
    rows = []
    for name in names:
        config = CONFIGS[name]
        layer = make_layer(config, options)
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((config["B"], config["T"], config["d_model"]), np.float32),
                        layer.dtype)
        dy = jnp.asarray(rng.standard_normal(x.shape, np.float32))
        params, layer_call, layer_step = layer_functions(layer, dy)
        op_args = list(jax.jit(lambda x: (layer.initial_bank(),) + layer.memory_inputs(x))(x))
        dy_op = jnp.asarray(rng.standard_normal(op_args[3].shape, np.float32))
        op_call, op_grad = op_functions(layer, config["chunk_size"], dy_op)
        ints = tuple(a for i, a in enumerate(op_args) if i not in FLOAT_ARGS)
        floats = tuple(op_args[i] for i in FLOAT_ARGS)
        op_step = jax.jit(lambda *f: op_grad(*f, ints=ints))
        t_layer_step = timed(layer_step, (params, x), opts.repeats, opts.pipeline)
        t_layer_call = timed(layer_call, (params, x), opts.repeats, opts.pipeline)
        t_op_step = timed(op_step, floats, opts.repeats, opts.pipeline)
        t_op_call = timed(op_call, tuple(op_args), opts.repeats, opts.pipeline)
        over = lambda layer_t, op_t: f"{100 * (layer_t - op_t) / op_t:+.0f}%"
        rows.append([name, fmt_ms(t_op_step), fmt_ms(t_layer_step), over(t_layer_step, t_op_step),
                     fmt_ms(t_op_call), fmt_ms(t_layer_call), over(t_layer_call, t_op_call)])
        print(f"  {name}: layer step {fmt_ms(t_layer_step)} ms, op fwd+bwd {fmt_ms(t_op_step)} ms; layer no-grad "
              f"{fmt_ms(t_layer_call)} ms, op no-grad {fmt_ms(t_op_call)} ms", file=sys.stderr, flush=True)
        if opts.trace:
            timeline(layer_step, (params, x), f"{name} layer training step")
            timeline(layer_call, (params, x), f"{name} layer no-grad")
        del params, x, dy, op_args, floats
    print_table(["config", "op fwd+bwd ms", "layer step ms", "step overhead", "op no-grad ms", "layer no-grad ms",
                 "no-grad overhead"], rows)
    for name in names:
        c = CONFIGS[name]
        print(f"- {name}: B={c['B']} T={c['T']} d_model={c['d_model']} H={c['num_heads']} K={c['slots_per_head']} "
              f"W={c['num_writes']} R={c['num_reads']} {c['dtype']} chunk {c['chunk_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
