"""A small SDM language model's training step on several devices: data, head and sequence parallel layouts.

    python benchmarks/bench_scaling.py [--layouts data,head,sequence] [--devices N] [--batch-per-device B] ...
    python benchmarks/bench_scaling.py --check          # correctness against one device, a JSON line last

The model: an embedding, `--layers` blocks of (RMSNorm, `jax_sdm.nn.SparseDeltaMemory`, RMSNorm, MLP) with
residuals, a final norm and an unembedding; the loss is next-token cross entropy on random tokens. One training
step is `jax.jit` of the loss, its gradient and an SGD update (parameters donated), under a `Mesh` of all local
devices (axis "x") in one of three layouts:

- data: the batch sharded, the parameters replicated (XLA all-reduces the gradients);
- head: the batch replicated; the memory layers' heads sharded (their projections column-parallel, the output
  projection row-parallel), the MLPs tensor-parallel the same way (`jax_sdm.nn.head_parallel_specs`);
- sequence: activations sharded along T; inside each memory layer the op's inputs are resharded to heads (an
  all-to-all), the readings back to T (`SparseDeltaMemory(sequence_axis="x")`).

Per layout: time per step (median of pipelined runs, as bench.py), tokens/s, peak memory per device (where the
backend reports it) and the scaling efficiency: tokens/s per device over the one-device tokens/s at the same
per-device batch (data parallel: the one-device run has the per-device batch; head and sequence parallel: every
device sees the whole batch, so the one-device run has it too).
"""
import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_sdm.nn import SparseDeltaMemory, head_parallel_specs

LAYOUTS = ("data", "head", "sequence")
AXIS = "x"


class Block(nnx.Module):
    def __init__(self, d_model, memory_options, rngs, sequence_axis=None):
        self.norm1 = nnx.RMSNorm(d_model, rngs=rngs)
        self.memory = SparseDeltaMemory(d_model, sequence_axis=sequence_axis, rngs=rngs, **memory_options)
        self.norm2 = nnx.RMSNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, x):
        x = x + self.memory(self.norm1(x))[0]
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Model(nnx.Module):
    def __init__(self, vocab, d_model, layers, memory_options, rngs, sequence_axis=None):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, memory_options, rngs, sequence_axis) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.unembed = nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.norm(x))


def make_model(config, layout):
    memory_options = dict(num_heads=config["heads"], slots_per_head=config["slots"], num_writes=config["writes"],
                          num_reads=config["reads"], chunk_size=config["chunk"], impl=config["impl"])
    return Model(config["vocab"], config["d_model"], config["layers"], memory_options, nnx.Rngs(0),
                 sequence_axis=AXIS if layout == "sequence" else None)


def param_specs(model, layout):
    """The parameters' PartitionSpecs: replicated, or for the head layout the memory layers' heads and the MLPs'
    hidden units sharded."""
    params = nnx.state(model, nnx.Param)
    specs = jax.tree.map(lambda _: P(), params)
    if layout != "head":
        return specs
    for i, block in enumerate(model.blocks):
        specs["blocks"][i]["memory"] = head_parallel_specs(block.memory, AXIS)
        specs["blocks"][i]["up"]["kernel"] = P(None, AXIS)
        specs["blocks"][i]["up"]["bias"] = P(AXIS)
        specs["blocks"][i]["down"]["kernel"] = P(AXIS, None)
    return specs


def token_spec(layout):
    return {"data": P(AXIS), "head": P(), "sequence": P(None, AXIS)}[layout]


def loss_fn(model, tokens):
    inputs, labels = tokens
    logits = model(inputs).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def make_step(model, mesh, layout, learning_rate=1e-2):
    """`(step, params, tokens_sharding)`: the jitted training step `step(params, tokens) -> (params, loss, grads)`
    with the layout's shardings, and the parameters placed accordingly."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    specs = param_specs(model, layout)
    param_sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    tokens_sharding = (NamedSharding(mesh, token_spec(layout)),) * 2

    def step(params, tokens):
        def loss(params):
            return loss_fn(nnx.merge(graphdef, params, rest), tokens)

        value, grads = jax.value_and_grad(loss)(params)
        grads = jax.lax.with_sharding_constraint(grads, param_sharding)
        new = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
        return new, value, grads

    jitted = jax.jit(step, in_shardings=(param_sharding, tokens_sharding),
                     out_shardings=(param_sharding, NamedSharding(mesh, P()), param_sharding), donate_argnums=0)
    return jitted, jax.device_put(params, param_sharding), tokens_sharding


def make_tokens(config, batch, seed=0):
    """`(inputs, labels)`, each `[batch, seq_len]`: random tokens and the next token of each."""
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, config["vocab"], (batch, config["seq_len"] + 1)), jnp.int32)
    return tokens[:, :-1], tokens[:, 1:]


def timed_steps(step, params, tokens, repeats, calls):
    """Median seconds per step over `repeats` runs of `calls` steps enqueued back to back (after warm-up)."""
    params, loss, _ = step(params, tokens)
    jax.block_until_ready(loss)
    for _ in range(2):
        params, loss, _ = step(params, tokens)
    jax.block_until_ready(loss)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            params, loss, _ = step(params, tokens)
        jax.block_until_ready(loss)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def peak_gib(devices):
    stats = [d.memory_stats() or {} for d in devices]
    peaks = [s.get("peak_bytes_in_use") for s in stats]
    return None if None in peaks else max(peaks) / 2**30


def run_layout(config, layout, devices, batch, repeats, calls):
    mesh = Mesh(np.array(devices), (AXIS,))
    with jax.set_mesh(mesh):
        model = make_model(config, layout)
        step, params, tokens_sharding = make_step(model, mesh, layout)
        tokens = jax.device_put(make_tokens(config, batch), tokens_sharding)
        seconds = timed_steps(step, params, tokens, repeats, calls)
    return seconds, batch * config["seq_len"] / seconds, peak_gib(devices)


CONFIGS = {
    # the GPU config: four heads per layer, so head and sequence parallel split up to 4 (8: use --heads 8)
    "gpu": dict(vocab=4096, d_model=1024, layers=2, heads=8, slots=16384, writes=32, reads=32, chunk=128,
                seq_len=2048, batch_per_device=4, impl="auto"),
    "cpu": dict(vocab=256, d_model=64, layers=2, heads=8, slots=256, writes=4, reads=4, chunk=16, seq_len=64,
                batch_per_device=2, impl="auto"),
}


# ----------------------------------------------------------------------------------------------------------------
# --check: every layout's loss and gradients against one device


def check(config):
    """Loss and gradients of one step in every layout on all devices against the same step on one device (the
    same global batch); the collectives in each layout's compiled step. Prints a JSON line."""
    devices = jax.devices()
    batch = config["batch_per_device"] * len(devices)
    tokens = make_tokens(config, batch, seed=1)
    results = {}
    one = Mesh(np.array(devices[:1]), (AXIS,))
    with jax.set_mesh(one):
        step1, params1, _ = make_step(make_model(config, "data"), one, "data")
        _, loss1, grads1 = step1(params1, tokens)
        grads1 = jax.tree.map(np.asarray, grads1)
    mesh = Mesh(np.array(devices), (AXIS,))
    for layout in LAYOUTS:
        with jax.set_mesh(mesh):
            step, params, tokens_sharding = make_step(make_model(config, layout), mesh, layout)
            placed = jax.device_put(tokens, tokens_sharding)
            hlo = step.lower(params, placed).compile().as_text()
            _, loss, grads = step(params, placed)
        grads = jax.tree.map(np.asarray, grads)
        errors = jax.tree.leaves(jax.tree.map(
            lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)), grads, grads1))
        bitwise = all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), grads, grads1)))
        results[layout] = dict(
            loss=float(loss), loss_one_device=float(loss1), max_grad_rel_err=max(errors), grads_bitwise=bitwise,
            collectives={c: hlo.count(f" {c}(") + hlo.count(f" {c}-start(")
                         for c in ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")},
            full_sequence_all_gathers=full_sequence_gathers(hlo, config, batch))
    print(json.dumps(results))
    return results


def full_sequence_gathers(hlo, config, batch):
    """All-gathers in the compiled step whose result holds the whole sequence of the whole batch's activations
    (an all-gather along T of `[B, T, ...]`)."""
    import re
    T = config["seq_len"]
    count = 0
    for line in hlo.splitlines():
        if "all-gather" not in line:
            continue
        m = re.search(r"= \(?[a-z0-9]+\[([0-9,]*)\]", line)
        dims = [int(d) for d in m.group(1).split(",") if d] if m else []
        if len(dims) >= 3 and dims[0] == batch and dims[1] == T:
            count += 1
    return count


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default=None,
                        help="gpu on a GPU backend, cpu otherwise")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--devices", default=None,
                        help="comma-separated device counts to run (default: 1 and all local devices)")
    parser.add_argument("--batch-per-device", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pipeline", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="compare every layout with one device; JSON last")
    opts = parser.parse_args(argv)
    config = dict(CONFIGS[opts.config or ("cpu" if jax.default_backend() == "cpu" else "gpu")])
    if opts.batch_per_device:
        config["batch_per_device"] = opts.batch_per_device
    if opts.heads:
        config["heads"] = opts.heads
    if opts.check:
        check(config)
        return 0
    all_devices = jax.devices()
    counts = [int(n) for n in opts.devices.split(",")] if opts.devices else sorted({1, len(all_devices)})
    print(f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}, jax {jax.__version__}, "
          f"{len(all_devices)} x {all_devices[0].device_kind}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}, "
          f"config {config}")
    rows, base = [], {}
    for layout in opts.layouts.split(","):
        for n in counts:
            per_device = config["batch_per_device"]
            batch = per_device * n if layout == "data" else per_device
            seconds, rate, peak = run_layout(config, layout, all_devices[:n], batch, opts.repeats, opts.pipeline)
            if n == 1:
                base[layout] = rate
            eff = rate / n / base[layout] if layout in base else float("nan")
            rows.append([layout, str(n), str(batch), f"{1e3 * seconds:.2f}", f"{rate:.4g}",
                         "-" if peak is None else f"{peak:.2f}", f"{100 * eff:.0f}%"])
            print(f"  {layout} on {n}: {1e3 * seconds:.2f} ms", file=sys.stderr, flush=True)
    print("| layout | devices | global batch | ms per step | tokens/s | peak GiB per device | efficiency |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
