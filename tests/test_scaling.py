"""The three layouts of benchmarks/bench_scaling.py (data, head and sequence parallel training of a small SDM
model) on 4 and 8 host CPU devices: each layout's loss and gradients equal the one-device step within float32
rounding, and the sequence-parallel step moves activations by all-to-alls around the op, never by an all-gather
of the whole sequence.

XLA's host device count is fixed when jax starts, so the benchmark's `--check` mode runs in a subprocess.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scaling.py"


def run_check(n_devices):
    flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n_devices}").strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check", "--config", "cpu"], capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=[4, 8])
def report(request):
    return request.param, run_check(request.param)


@pytest.mark.parametrize("layout", ["data", "head", "sequence"])
def test_layout_matches_one_device(report, layout):
    n, results = report
    r = results[layout]
    assert abs(r["loss"] - r["loss_one_device"]) <= 1e-6 * abs(r["loss_one_device"]), (n, r)
    assert r["max_grad_rel_err"] <= 1e-5, (n, r)


def test_sequence_parallel_moves_activations_by_all_to_all(report):
    n, results = report
    r = results["sequence"]
    assert r["collectives"]["all-to-all"] >= 2, (n, r)
    assert r["full_sequence_all_gathers"] == 0, (n, r)
    # Data parallel gathers nothing of the activations either (only the gradients' all-reduce).
    assert results["data"]["full_sequence_all_gathers"] == 0, (n, results["data"])
