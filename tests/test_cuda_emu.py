"""The CUDA kernels run on the CPU by the host emulation of tests/cuda_emu, against the CPU kernels.

- The chunk steps (kernels/chunk_steps/) against kernels/chunk_steps/cpu.cc: a smoke run of tiny cases of the
  steps check (a float32 bank with 4-column rows, C = 5, V = 2; a bfloat16 bank and gradient bank with 16-byte rows
  and long write groups; packed sequences with several segments per chunk, some starting at a chunk's first token;
  5 chunks, whose backward rebuilds its ring of group tables for 3 batches of chunks; C = 101, whose staged
  apply-inverse kernels take two rows a tile), so that the emulation keeps
  building as the CUDA source changes; every launch with programmatic dependent launch, and with the build option
  SDM_CUDA_PDL=0 (kernels/chunk_steps.h) none, with the same results; and with the snapshot stored in bfloat16,
  float8 and int4 (kernels/snapshot_codec.h).
- The decode step and the layer's decode step (kernels/decode_step_cuda.cu) against kernels/decode_step_cpu.cc,
  bitwise.
- The solve (kernels/solve_cuda.cu, both of its kernels) against kernels/solve_cpu.cc, bitwise.
- The product-key top-k (kernels/product_key_topk_cuda.cu, forward and backward) against
  kernels/product_key_topk_cpu.cc, bitwise.

The full checks are `bash tests/cuda_emu/run.sh plain steps|decode|solve|product_key` (developer tools: a few
minutes).
Skipped without a C++20 g++ or bash."""
import os
import pathlib
import re
import shutil
import subprocess
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = ROOT / "tests" / "cuda_emu" / "run.sh"


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


pytestmark = pytest.mark.skipif(not RUN.exists() or not _has_cxx20_barrier(),
                                reason="needs bash and g++ with C++20 <barrier>")


def run_check(*args, cases, opt="-O0", **env):
    """Run `run.sh plain ARGS` compiled with `opt` (-O0: tiny cases compile faster than they run); assert it passes
    `cases` cases and none fails; return its output."""
    # The timeout guards against a hang, not the speed: the top-k check runs about 6 minutes on 2 idle cores and
    # timed out at 10 beside other compiles.
    r = subprocess.run(["bash", str(RUN), "plain", *args], capture_output=True, text=True, timeout=1800,
                       env=dict(os.environ, CUDA_EMU_OPT=opt, **env))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert sum(line.startswith("ok ") for line in r.stdout.splitlines()) == cases, out[-4000:]
    assert "0 failing cases" in r.stdout
    return r.stdout


def launches(out):
    """(launches, launches with programmatic dependent launch) that the steps check reports."""
    m = re.search(r"launches: (\d+), with programmatic dependent launch: (\d+)", out)
    assert m, out[-2000:]
    return int(m.group(1)), int(m.group(2))


@pytest.mark.slow  # compiles the emulated steps (about a minute)
def test_cuda_steps_on_cpu_match_cpu_kernels():
    # 4: long groups among the short; 37: several groups a warp; 38-40: a token's lanes split over 4, 4 and 2-3
    # blocks (owner_split), 39 with more lanes than a round of the token's table rows; 2, 41 and 42: the forward's
    # products on tensor cores (C 16, 48, 64).
    total, pdl = launches(run_check("steps", "1,2,4,18,28,31,34,35,37,38,39,40,41,42", cases=14))
    assert total > 0 and pdl == total


@pytest.mark.slow  # compiles the emulated steps again
@pytest.mark.parametrize("snapshot", [1, 2, 3])  # kernels/snapshot_codec.h: bfloat16, float8, int4
def test_cuda_steps_with_a_snapshot_of_another_dtype(snapshot):
    # 2: VEC 1 (int4: a lane reads its column's nibble); 11: rows of several batches per lane; 35: bfloat16 rows of
    # several of the forward write's batches; 37: several groups a warp; 40: a token's lanes split over blocks.
    run_check("steps", f"snapshot={snapshot}", "1,2,4,11,18,28,35,37,40", cases=9)


@pytest.mark.slow  # compiles the emulated steps again
def test_cuda_steps_without_programmatic_dependent_launch():
    out = run_check("steps", "1,18", cases=2, CUDA_EMU_DEFINES="-DSDM_CUDA_PDL=0")
    total, pdl = launches(out)
    assert total > 0 and pdl == 0


def test_cuda_decode_step_on_cpu_matches_cpu_kernel():
    run_check("decode", cases=32)  # 12 of the step, 20 of the layer's step (8 ranking their lists, 4 of them split)


def test_cuda_solve_on_cpu_matches_cpu_kernel():
    run_check("solve", cases=10, opt="-O1")


def test_cuda_product_key_topk_on_cpu_matches_cpu_kernel():
    run_check("product_key", cases=170, opt="-O1")
