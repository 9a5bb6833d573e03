#!/usr/bin/env bash
# Runs CUDA kernels on the CPU and compares every output with the CPU kernels: a check of the CUDA code's logic,
# barriers and indexing where no GPU is at hand. One std::thread per CUDA thread, one block at a time;
# __syncthreads, __syncwarp and the warp collectives are barriers (cuda_emu.h). It says nothing about speed, and a
# GPU run stays the final word.
#
#   bash tests/cuda_emu/run.sh [plain|tsan|asan] [phase1|steps|decode|solve|product_key|all]
#        [CASE [SEED] | random SEED COUNT]
#   bash tests/cuda_emu/run.sh [plain|tsan|asan] steps [cpu-both] [CASE [SEED] | random SEED COUNT]
#   bash tests/cuda_emu/run.sh [plain|tsan|asan] steps [cpu-both] shape V NC P C W R K D f32|bf16 f32|bf16 INVALID
#        PAD [SEED [SEGS]]
#
# Checks: phase1 (the default, as before) runs kernels/phase1_cuda.cu against kernels/phase1_cpu.cc
# (phase1_check.cc); steps runs the CUDA chunk steps of kernels/chunk_steps/ (forward_cuda, backward_cuda) against
# the CPU ones of kernels/chunk_steps/cpu.cc (steps_check.cc), on Phase 1's outputs from the CPU kernels; decode runs
# kernels/decode_step_cuda.cu against kernels/decode_step_cpu.cc (decode_check.cc) and solve kernels/solve_cuda.cu
# against kernels/solve_cpu.cc (solve_check.cc), both bitwise, on fixed cases; product_key runs
# kernels/product_key_topk_cuda.cu against kernels/product_key_topk_cpu.cc (product_key_check.cc), bitwise, forward
# and backward, on fixed cases; all runs every check (then without
# further arguments). The check may be left out: `run.sh plain 3` is Phase 1's case 3.
# tsan: ThreadSanitizer reports any shared- or global-memory race that the barriers do not order; asan: out-of-range
# accesses (the block's dynamic shared memory is a buffer of exactly the launch's size) and undefined behaviour
# (misaligned vector loads included). CASE is an index into the fixed cases of the check (all by default; one case
# prints the max errors of each output; the steps check takes a comma-separated list too); `random` draws COUNT
# random shapes; `shape` runs one problem of the steps (sizes as in kernels/chunk_steps.h, the bank's and the gradient
# bank's dtypes, the fraction of out-of-range ids, the trailing tokens of each chunk with no valid id, and for packed
# sequences the mean segment starts per chunk). The steps check also runs packed sequences (kernels/chunk_steps.h
# StepSegments): the fixed cases 15 to 25 and 29, a third of the random ones, `shape` with SEGS > 0;
# `steps cpu-both ...` runs the CPU loops on both sides, a check of the harness itself.
#
# On 2 busy cores the steps check takes 30-50 s in plain mode, 3.5-6 minutes under tsan, about 2 minutes under
# asan (Phase 1's: about 2 minutes in plain mode); it prints, per case, ok or FAIL with the outputs that differ, and at
# the end the largest abs and relative errors per output over the cases. CUDA_EMU_OPT sets plain mode's optimisation
# (-O1 by default; -O0 compiles faster for a few tiny cases: tests/test_cuda_emu.py). CUDA_EMU_BLOCKS=reverse|shuffle
# runs the blocks of every launch in reverse or shuffled order (forward by default): a result that changes with the
# order shows a dependence between blocks that a GPU, running them in any order and at once, would not honour.
# CUDA_EMU_DEFINES adds compiler definitions to every source, e.g. -DSDM_CUDA_PDL=0 (the build option of
# kernels/chunk_steps.h: the steps check prints how many launches had programmatic dependent launch).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
MODE=${1:-plain}
shift || true
CHECK=phase1
case "${1:-}" in
  phase1|steps|decode|solve|product_key|all) CHECK=$1; shift ;;
esac
case "$MODE" in
  plain) FLAGS="${CUDA_EMU_OPT:--O1}" ;;
  tsan) FLAGS="-O1 -g -fsanitize=thread" ;;
  asan) FLAGS="-O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined" ;;
  *) echo "mode: plain, tsan or asan" >&2; exit 2 ;;
esac
FLAGS="$FLAGS ${CUDA_EMU_DEFINES:-}"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# compile OBJECTS_VAR SOURCES...: one compiler per source, at once; the objects' paths appended to the array
# OBJECTS_VAR. Sources ending in .cu (the rewritten CUDA translation units) compile as C++.
compile() {
  local -n objs_=$1
  shift
  local src pids=() pid lang
  for src in "$@"; do
    objs_+=("$WORK/obj_${#objs_[@]}_$(basename "$src").o")
    lang=(); [[ $src == *.cu ]] && lang=(-x c++)
    ${CXX:-g++} -c -std=c++20 $FLAGS -fno-strict-aliasing -I"$WORK" -I"$REPO" -I"$HERE/shim" -I"$HERE" "${lang[@]}" \
      "$src" -o "${objs_[-1]}" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
}
# build NAME CUDA_SOURCE LAUNCHES CPU_SOURCES...: the check NAME_check.cc against the CUDA source rewritten for
# the host (transform.py, into NAME_emu.inc, which the check includes; LAUNCHES: the launches it must have) and the
# CPU kernels.
build() {
  local name=$1 cu=$2 launches=$3
  shift 3
  python3 "$HERE/transform.py" "$REPO/kernels/$cu" "$WORK/${name}_emu.inc" $launches
  local objs=()
  compile objs "$HERE/${name}_check.cc" "$@"
  ${CXX:-g++} $FLAGS "${objs[@]}" -o "$WORK/${name}_check" -pthread
}
# build_steps: the chunk steps' check against the CUDA sources of kernels/chunk_steps/, each rewritten into the same
# place under $WORK (found there before the originals: -I$WORK comes first), their translation units forward_cuda.cu
# and backward_cuda.cu compiled on their own, and the CPU kernels.
build_steps() {
  mkdir -p "$WORK/kernels/chunk_steps"
  local f objs=()
  for f in "$REPO"/kernels/chunk_steps/*.cu "$REPO"/kernels/chunk_steps/*.cuh; do
    python3 "$HERE/transform.py" "$f" "$WORK/kernels/chunk_steps/$(basename "$f")"
  done
  compile objs "$HERE/steps_check.cc" "$WORK/kernels/chunk_steps/forward_cuda.cu" \
    "$WORK/kernels/chunk_steps/backward_cuda.cu" "$@"
  ${CXX:-g++} $FLAGS "${objs[@]}" -o "$WORK/steps_check" -pthread
}
if [[ $CHECK == phase1 || $CHECK == all ]]; then
  build phase1 phase1_cuda.cu 1 "$REPO/kernels/phase1_cpu.cc"
  "$WORK/phase1_check" "$@"
fi
if [[ $CHECK == decode || $CHECK == all ]]; then
  build decode decode_step_cuda.cu 3 "$REPO/kernels/decode_step_cpu.cc" "$REPO/kernels/product_key_topk_cpu.cc"
  "$WORK/decode_check" "$@"
fi
if [[ $CHECK == solve || $CHECK == all ]]; then
  build solve solve_cuda.cu 2 "$REPO/kernels/solve_cpu.cc"
  "$WORK/solve_check"
fi
if [[ $CHECK == product_key || $CHECK == all ]]; then
  build product_key product_key_topk_cuda.cu 4 "$REPO/kernels/product_key_topk_cpu.cc"
  "$WORK/product_key_check"
fi
if [[ $CHECK == steps || $CHECK == all ]]; then
  build_steps "$REPO/kernels/chunk_steps/cpu.cc" "$REPO/kernels/phase1_cpu.cc" "$REPO/kernels/solve_cpu.cc"
  "$WORK/steps_check" "$@"
fi
