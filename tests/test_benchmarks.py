"""The benchmark scripts run end to end on a tiny problem (they import each other's timing code: a renamed helper
must fail here, not on the GPU machine)."""
import math
import re

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


def test_bench_layer_decode_prints_times(capsys):
    pytest.importorskip("flax")
    bench_layer = load_benchmark("bench_layer")
    assert bench_layer.main(["--layer-decode", "--min-log-k", "6", "--max-log-k", "6", "--decode-steps", "3",
                             "--repeats", "1"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2^6 |"))
    layer_us, op_us, ratio = (float(x) for x in re.findall(r"\d+\.\d+", row))
    assert min(layer_us, op_us) > 0 and ratio == pytest.approx(layer_us / op_us, abs=0.006 + 0.01 * ratio)
