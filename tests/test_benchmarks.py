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
