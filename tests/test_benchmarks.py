"""The benchmark scripts run end to end on a tiny problem (they import each other's timing code: a renamed helper
must fail here, not on the GPU machine)."""
import math
import re

import numpy as np
import pytest

from .helpers import load_benchmark


def table_numbers(text, impl):
    row = next(line for line in text.splitlines() if line.startswith(f"| {impl} |"))
    return [float(x) for x in re.findall(r"\d+\.\d+", row)]


def test_bench_packed_prints_times_and_ratios(capsys):
    bench_packed = load_benchmark("bench_packed")
    bench_packed.main(["--impls", "ffi", "--rows", "1", "--sequences", "2", "--length", "8", "--H", "1", "--K", "64",
                       "--D", "8", "--W", "2", "--R", "2", "--chunk", "8", "--repeats", "1"])
    fp, fu, ratio, gp, gu, gratio = table_numbers(capsys.readouterr().out, "ffi")
    assert min(fp, fu, gp, gu) > 0
    assert all(math.isfinite(x) for x in (fp, fu, gp, gu))
    # the printed ratios are those of the times, each printed to 2 decimals
    for r, a, b in ((ratio, fp, fu), (gratio, gp, gu)):
        assert r == pytest.approx(a / b, abs=0.005 / b * (1 + a / b) + 0.006)


def test_bench_topk_prints_times(capsys):
    bench_topk = load_benchmark("bench_topk")
    bench_topk.main(["--impls", "ffi,xla,nn", "--configs", "c", "--dtypes", "float32", "--rows", "4", "--calls", "1",
                     "--repeats", "1"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| c: rows 4,"))
    times = [float(x) for x in re.findall(r"\| (\d+\.\d+)", row)]
    assert len(times) == 6 and min(times) > 0 and all(math.isfinite(t) for t in times)


def test_profile_topk_runs_the_kernel(capsys):
    profile_topk = load_benchmark("profile_topk")
    assert profile_topk.main(["--rows", "3", "--factors", "16,8", "--k", "5", "--dtype", "float32", "--calls", "2"]) == 0
    assert "rows 3, factors (16, 8), k 5, float32: 2 calls" in capsys.readouterr().out


def test_ncu_source_summary_ranks_instructions_by_samples(tmp_path, capsys):
    summary = load_benchmark("ncu_source_summary")
    samples = [int(v) for v in np.random.default_rng().permutation(50)[:6] + 1]  # distinct: one order
    lines = ["==PROF== a line of the profiler", '"Address","Source","Warp Stall Sampling (All Samples)","Other"']
    lines += [f'"{16 * i:x}","INSTR_{i} R{i}, R{i + 1}","{n}","7"' for i, n in enumerate(samples)]
    path = tmp_path / "source.csv"
    path.write_text("\n".join(lines) + "\n")
    assert summary.main([str(path), "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"6 instructions, {sum(samples)} samples (Warp Stall Sampling (All Samples))"
    order = sorted(range(6), key=lambda i: -samples[i])[:3]
    assert [line.split()[3] for line in out[1:]] == [f"INSTR_{i}" for i in order]
    share = [float(line.split()[0].rstrip("%")) for line in out[1:]]
    assert share[0] == pytest.approx(100 * samples[order[0]] / sum(samples), abs=0.06)


def test_bench_layer_decode_prints_times(capsys):
    pytest.importorskip("flax")
    bench_layer = load_benchmark("bench_layer")
    assert bench_layer.main(["--layer-decode", "--min-log-k", "6", "--max-log-k", "6", "--decode-steps", "3",
                             "--repeats", "1"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2^6 |"))
    layer_us, op_us, ratio = (float(x) for x in re.findall(r"\d+\.\d+", row))
    assert min(layer_us, op_us) > 0 and ratio == pytest.approx(layer_us / op_us, abs=0.006 + 0.01 * ratio)


@pytest.mark.slow  # the token loop's gradient compiles for a while; the benchmark scripts' harness only
def test_bench_grad_takes_the_cotangents_as_arguments():
    # Captured as constants, a bank-sized cotangent is folded at compile time (minutes at the paper shape) and held
    # twice on the device; as arguments it is neither. The gradient is still that of the loss on the cotangents.
    import jax
    import numpy as np

    bench = load_benchmark("bench")
    shape = dict(bench.SHAPES["cpu-small"], T=32, K=64)
    args, dy, dbank = bench.make_inputs(shape, seed=int(np.random.SeedSequence().entropy % 1000))
    _, grad = bench.make_functions("xla", 16, dy, dbank)
    lowered = grad.lower(*args)
    assert len(jax.tree.leaves(lowered.args_info)) == len(args) + 2
    got = grad(*args)
    from jax_sdm import sdm_write_read

    def loss(*fl):
        full = list(args)
        for i, a in zip(bench.FLOAT_ARGS, fl):
            full[i] = a
        y, final = sdm_write_read(*full, chunk_size=16, impl="reference")
        return jax.numpy.sum(y * dy) + jax.numpy.sum(final * dbank)

    want = jax.grad(loss, argnums=tuple(range(len(bench.FLOAT_ARGS))))(*(args[i] for i in bench.FLOAT_ARGS))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)
