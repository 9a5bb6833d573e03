"""The CUDA chunk steps (kernels/chunk_steps/) run on the CPU by the host emulation of scripts/cuda_emu against
the CPU kernels (kernels/chunk_steps/cpu.cc): a smoke run of four tiny cases of the steps check (a float32 bank with
4-column rows, C = 5, V = 2; a bfloat16 bank and gradient bank with 16-byte rows and long write groups; packed
sequences with several segments per chunk, some starting at a chunk's first token; 5 chunks, whose backward
rebuilds its ring of group tables for 3 batches of chunks), so that
the emulation keeps building as the CUDA source changes; the decode step (kernels/decode_step_cuda.cu) against
kernels/decode_step_cpu.cc, bitwise; and the solve (kernels/solve_cuda.cu, both of its kernels) against
kernels/solve_cpu.cc, bitwise. The full checks are `bash scripts/cuda_emu/run.sh plain steps|decode|solve`
(developer tools: a few minutes). Skipped without a C++20 g++ or bash."""
import os
import pathlib
import shutil
import subprocess
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = ROOT / "scripts" / "cuda_emu" / "run.sh"


def _has_cxx20_barrier():
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None or shutil.which("bash") is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "t.cc"
        src.write_text("#include <barrier>\n#include <bit>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n")
        r = subprocess.run([cxx, "-std=c++20", "-pthread", str(src), "-o", str(pathlib.Path(tmp) / "t")],
                           capture_output=True)
        return r.returncode == 0


@pytest.mark.skipif(not RUN.exists() or not _has_cxx20_barrier(), reason="needs bash and g++ with C++20 <barrier>")
def test_cuda_steps_on_cpu_match_cpu_kernels():
    env = dict(os.environ, CUDA_EMU_OPT="-O0")
    r = subprocess.run(["bash", str(RUN), "plain", "steps", "1,4,18,28"], capture_output=True, text=True,
                       timeout=600, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert sum(line.startswith("ok ") for line in r.stdout.splitlines()) == 4, out[-4000:]
    assert "0 failing cases" in r.stdout


@pytest.mark.skipif(not RUN.exists() or not _has_cxx20_barrier(), reason="needs bash and g++ with C++20 <barrier>")
def test_cuda_decode_step_on_cpu_matches_cpu_kernel():
    env = dict(os.environ, CUDA_EMU_OPT="-O0")
    r = subprocess.run(["bash", str(RUN), "plain", "decode"], capture_output=True, text=True, timeout=600, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert sum(line.startswith("ok ") for line in r.stdout.splitlines()) == 12, out[-4000:]
    assert "0 failing cases" in r.stdout


@pytest.mark.skipif(not RUN.exists() or not _has_cxx20_barrier(), reason="needs bash and g++ with C++20 <barrier>")
def test_cuda_solve_on_cpu_matches_cpu_kernel():
    r = subprocess.run(["bash", str(RUN), "plain", "solve"], capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert sum(line.startswith("ok ") for line in r.stdout.splitlines()) == 10, out[-4000:]
    assert "0 failing cases" in r.stdout
