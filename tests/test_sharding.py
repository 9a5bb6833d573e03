"""impl="ffi" on inputs sharded along batch and/or heads (jax_sdm/sharding.py): each device runs its own streams.

The checks need several devices, and `--xla_force_host_platform_device_count` must be set before JAX starts, so
they run in a subprocess (this file run as a script) on 4 CPU devices. For every case the subprocess compares the
sharded results, and the gradients of a loss over all float inputs with cotangents on `y` and on the final bank,
with the unsharded single-device results; checks the result shardings; and lists the collectives in the compiled
HLO of the forward and of the gradient, and the streams one kernel call sees. It also runs the op and its gradient
inside `jax.shard_map` (default `check_vma=True`), with own and shared banks. It prints a readable report and a
final JSON line that the test asserts on.
"""
import json

import pytest

from .helpers import run_on_host_devices

N_DEVICES = 4
FLOATS = ("bank", "k_val", "v", "beta", "g", "q_val")
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def _cases():
    """`name: (mesh shape, mesh axis names, axis type, spec of the tokens, spec of the bank, problem kwargs)`.

    Token specs are over `[B, T, H, ...]`, bank specs over `[B, H, K, D]` (or `[H, K, D]` when shared)."""
    return {
        "B sharded over 4": ((4,), ("b",), "Auto", ("b",), ("b",), {}),
        "H sharded over 4": ((4,), ("h",), "Auto", (None, None, "h"), (None, "h"), {}),
        "2x2 mesh over (B, H), per-write gates": ((2, 2), ("b", "h"), "Auto", ("b", None, "h"), ("b", "h"),
                                                  dict(per_write_gates=True)),
        "shared [H, K, D] bank, B sharded": ((4,), ("b",), "Auto", ("b",), (), dict(shared_bank=True)),
        "2x2 mesh over (B, H), Explicit axes": ((2, 2), ("b", "h"), "Explicit", ("b", None, "h"), ("b", "h"), {}),
        "B and T sharded (T resharded)": ((2, 2), ("b", "t"), "Auto", ("b", "t"), ("b",), dict(T=12)),
    }


def _run_checks():
    """The subprocess: run every case, print the report and the JSON summary."""
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

    from jax_sdm import sdm_write_read
    from jax_sdm.testing import random_problem

    assert len(jax.devices()) == N_DEVICES, jax.devices()
    B, H, K, D, CHUNK = 4, 4, 8, 4, 4

    def op(args):
        return sdm_write_read(**args, chunk_size=CHUNK, impl="ffi")

    def loss(floats, ints, dy, dfinal):
        y, final = op({**floats, **ints})
        return jnp.sum(y * dy) + jnp.sum(final * dfinal)

    grad = jax.grad(loss)

    def collectives(hlo):
        return sorted({c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", hlo)})

    def gathered_banks(hlo):
        """All-gathers whose result ends in `[K, D]`: a gathered bank (or bank-shaped residual)."""
        shapes = re.findall(r"= \w+\[([\d,]*)\][^ ]* all-gather", hlo)
        return [s for s in shapes if tuple(int(d) for d in s.split(",")[-2:]) == (K, D)]

    def kernel_streams(hlo, target):
        """The streams one `target` call sees: the leading dims of its bank result (`[P, K, D]`, `[B, H, K, D]`)."""
        calls = [line for line in hlo.splitlines() if f'custom_call_target="{target}"' in line]
        shapes = [[int(d) for d in m.group(1).split(",")] for line in calls
                  if (m := re.search(r"= \(?\w+\[([\d,]+)\]", line))]
        return sorted({int(np.prod(dims[:-2])) for dims in shapes})

    def compare(got, want):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        if np.array_equal(got, want):
            return "bitwise", 0.0
        return "differs", float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))

    results = {}
    for name, (mesh_shape, axis_names, axis_type, token_spec, bank_spec, kw) in _cases().items():
        kw = dict(kw)
        T = kw.pop("T", 10)
        args = random_problem(7, B=B, T=T, H=H, K=K, D=D, W=2, R=3, distinct=False, **kw)
        rng = np.random.default_rng(8)
        dy = rng.standard_normal((B, T, H, D)).astype(np.float32)
        dfinal = rng.standard_normal((B, H, K, D)).astype(np.float32)

        # unsharded, one device
        ints = {k: v for k, v in args.items() if k not in FLOATS}
        floats = {k: args[k] for k in FLOATS}
        y_ref, final_ref = jax.jit(op)(args)
        g_ref = jax.jit(grad)(floats, ints, dy, dfinal)

        # sharded
        mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), axis_names,
                    axis_types=(getattr(AxisType, axis_type),) * len(axis_names))
        tokens = NamedSharding(mesh, PartitionSpec(*token_spec))
        bank = NamedSharding(mesh, PartitionSpec(*bank_spec))
        final_sharding = bank
        if kw.get("shared_bank"):  # B of the final bank follows the tokens, H the bank
            final_sharding = NamedSharding(mesh, PartitionSpec(token_spec[0], *(bank_spec or (None,))))
        put = lambda k, v: jax.device_put(v, bank if k == "bank" else tokens)
        s_args = {k: put(k, v) for k, v in args.items()}
        s_floats = {k: s_args[k] for k in FLOATS}
        s_ints = {k: s_args[k] for k in ints}
        s_dy, s_dfinal = jax.device_put(dy, tokens), jax.device_put(dfinal, final_sharding)

        fwd = jax.jit(op).lower(s_args).compile()
        bwd = jax.jit(grad).lower(s_floats, s_ints, s_dy, s_dfinal).compile()
        y, final = fwd(s_args)
        g = bwd(s_floats, s_ints, s_dy, s_dfinal)
        hlo_fwd, hlo_bwd = fwd.as_text(), bwd.as_text()

        same = lambda a, s: bool(a.sharding.is_equivalent_to(s, a.ndim))
        def shards(entry):  # devices along one spec entry
            return int(np.prod([mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry or ())]))
        # B and H as the tokens' (a sharding along T is not kept: T is replicated for the kernels)
        bh_tokens = NamedSharding(mesh, PartitionSpec(token_spec[0], None, *token_spec[2:3]))
        results[name] = dict(
            y=compare(y, y_ref), final=compare(final, final_ref),
            grads={k: compare(g[k], g_ref[k]) for k in FLOATS},
            y_sharding=str(y.sharding.spec), y_sharded_like_tokens=same(y, bh_tokens),
            final_sharding=str(final.sharding.spec), final_sharded_like_bank=same(final, final_sharding),
            grads_sharded_like_inputs={k: same(g[k], bank if k == "bank" else bh_tokens) for k in FLOATS},
            fwd_collectives=collectives(hlo_fwd), grad_collectives=collectives(hlo_bwd),
            gathered_banks=gathered_banks(hlo_fwd) + gathered_banks(hlo_bwd),
            # the forward of a call that is not differentiated: on the CPU the token recurrence in one kernel
            streams_per_call={"forward": kernel_streams(hlo_fwd, "sdm_token_recurrence"),
                              "backward": kernel_streams(hlo_bwd, "sdm_backward")},
            streams_per_device=B // shards(token_spec[0]) * H // shards((token_spec + (None,) * 3)[2]),
        )
        r = results[name]
        print(f"[{name}] mesh {dict(zip(axis_names, mesh_shape))} ({axis_type}), tokens {tokens.spec}, "
              f"bank {bank.spec}")
        print(f"  y: {r['y'][0]} (max rel diff {r['y'][1]:.1e}), sharding {r['y_sharding']}; "
              f"final bank: {r['final'][0]}, sharding {r['final_sharding']}")
        grads = [f"{k} {how}" + (f" ({diff:.1e})" if diff else "") for k, (how, diff) in r["grads"].items()]
        print("  grads: " + ", ".join(grads))
        print(f"  collectives: forward {r['fwd_collectives'] or 'none'}, gradient {r['grad_collectives'] or 'none'}"
              f"; streams per kernel call {r['streams_per_call']} (of {B * H})")
    results["shard_map"] = _shard_map_checks(op, loss, compare)
    print(json.dumps(results))


def _shard_map_cases():
    """`name: (mesh shape, mesh axis names, spec of the tokens, spec of the bank, problem kwargs)`."""
    return {
        "own bank, B over 4": ((4,), ("b",), ("b",), ("b",), {}),
        "own bank, (B, H) over 2x2": ((2, 2), ("b", "h"), ("b", None, "h"), ("b", "h"), {}),
        "shared bank, B over 4": ((4,), ("b",), ("b",), (), dict(shared_bank=True)),
        "shared bank, (B, H) over 2x2": ((2, 2), ("b", "h"), ("b", None, "h"), ("h",), dict(shared_bank=True)),
        "shared bank, B over 4, impl=xla": ((4,), ("b",), ("b",), (), dict(shared_bank=True, impl="xla")),
        "shared bank, B over 4, impl=reference": ((4,), ("b",), ("b",), (), dict(shared_bank=True, impl="reference")),
    }


def _shard_map_checks(op, loss, compare):
    """`jax.grad` through `jax.shard_map` (default `check_vma=True`): results and gradients against one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    from jax_sdm import sdm_write_read
    from jax_sdm.testing import random_problem

    results = {}
    ffi_op, ffi_loss = op, loss
    for name, (mesh_shape, axis_names, token_spec, bank_spec, kw) in _shard_map_cases().items():
        kw = dict(kw)
        impl = kw.pop("impl", "ffi")
        op = ffi_op if impl == "ffi" else (lambda a, impl=impl: sdm_write_read(**a, chunk_size=4, impl=impl))
        loss = ffi_loss if impl == "ffi" else (lambda f, i, dy, dfinal, op=op: sum(
            jnp.sum(o * c) for o, c in zip(op({**f, **i}), (dy, dfinal))))
        args = random_problem(11, B=4, T=9, H=2 * mesh_shape[-1], K=8, D=4, W=2, R=3, distinct=False, **kw)
        floats = {k: args[k] for k in FLOATS}
        ints = {k: v for k, v in args.items() if k not in FLOATS}
        rng = np.random.default_rng(12)
        dy = rng.standard_normal(args["v"].shape).astype(np.float32)
        dfinal = rng.standard_normal(args["v"].shape[:1] + args["bank"].shape[-3:]).astype(np.float32)
        mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), axis_names)
        tokens, bank = PartitionSpec(*token_spec), PartitionSpec(*bank_spec)
        final_spec = PartitionSpec(token_spec[0], *token_spec[2:3])

        def local_loss(floats, ints, dy, dfinal):  # the loss of the local streams, summed over the devices
            return jax.lax.psum(loss(floats, ints, dy, dfinal), axis_names)

        specs = ({k: bank if k == "bank" else tokens for k in floats}, {k: tokens for k in ints}, tokens, final_spec)
        run = jax.jit(jax.shard_map(lambda a: op(a), mesh=mesh, in_specs=({**specs[0], **specs[1]},),
                                    out_specs=(tokens, final_spec)))
        grad = jax.jit(jax.grad(jax.shard_map(local_loss, mesh=mesh, in_specs=specs, out_specs=PartitionSpec())))
        y, final = run(args)
        g = grad(floats, ints, dy, dfinal)
        y_ref, final_ref = jax.jit(op)(args)
        g_ref = jax.jit(jax.grad(loss))(floats, ints, dy, dfinal)
        results[name] = dict(y=compare(y, y_ref), final=compare(final, final_ref),
                             grads={k: compare(g[k], g_ref[k]) for k in FLOATS})
        print(f"[shard_map: {name}] y {results[name]['y']}, final {results[name]['final']}, "
              f"grads {results[name]['grads']}")
    return results


@pytest.fixture(scope="module")
def report():
    return run_on_host_devices(__file__, N_DEVICES, timeout=600)


CASES = list(_cases())


@pytest.mark.parametrize("case", list(_shard_map_cases()))
def test_grad_through_shard_map(report, case):
    """Inside `shard_map` (check_vma=True) the kernel path's results and gradients are those of one device."""
    r = report["shard_map"][case]
    assert r["y"][1] <= 1e-6 and r["final"][1] <= 1e-6, r
    for k, (how, diff) in r["grads"].items():
        assert diff <= 1e-6, (k, how, diff)


@pytest.mark.parametrize("case", CASES)
def test_results_equal_unsharded(report, case):
    r = report[case]
    assert r["y"][0] == "bitwise", r["y"]
    assert r["final"][0] == "bitwise", r["final"]
    for k, (how, diff) in r["grads"].items():
        if k == "bank" and "shared" in case:  # summed over B across devices: the order of the sum may differ
            assert diff <= 1e-6, (k, diff)
        else:
            assert how == "bitwise", (k, how, diff)


@pytest.mark.parametrize("case", CASES)
def test_results_keep_the_input_shardings(report, case):
    r = report[case]
    assert r["y_sharded_like_tokens"], r["y_sharding"]
    assert r["final_sharded_like_bank"], r["final_sharding"]
    assert all(r["grads_sharded_like_inputs"].values()), r["grads_sharded_like_inputs"]


@pytest.mark.parametrize("case", CASES)
def test_no_gather_of_the_bank(report, case):
    r = report[case]
    assert r["gathered_banks"] == [], r["gathered_banks"]
    # each device runs its own streams: one kernel call sees the local streams only
    assert r["streams_per_call"] == {"forward": [r["streams_per_device"]],
                                     "backward": [r["streams_per_device"]]}, r["streams_per_call"]
    if "T sharded" in case:  # the per-token arrays are gathered along T (the kernels need whole streams)
        assert set(r["fwd_collectives"]) <= {"all-gather"} and set(r["grad_collectives"]) <= {"all-gather"}
        return
    assert r["fwd_collectives"] == [], r["fwd_collectives"]
    if "shared" in case:  # the shared bank's gradient sums over the batch
        assert set(r["grad_collectives"]) <= {"all-reduce", "reduce-scatter"}, r["grad_collectives"]
    else:
        assert r["grad_collectives"] == [], r["grad_collectives"]


if __name__ == "__main__":
    _run_checks()
