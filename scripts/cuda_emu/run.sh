#!/usr/bin/env bash
# Runs the CUDA Phase 1 kernels (kernels/phase1_cuda.cu) on the CPU and compares every output with the CPU kernels
# (kernels/phase1_cpu.cc): a check of the CUDA code's logic, barriers and indexing where no GPU is at hand. One
# std::thread per CUDA thread, one block at a time; __syncthreads, __syncwarp and the warp collectives are barriers.
# It says nothing about speed, and a GPU run stays the final word.
#
#   bash scripts/cuda_emu/run.sh [plain|tsan|asan] [CASE | random SEED COUNT]
#
# tsan: ThreadSanitizer reports any shared- or global-memory race that the barriers do not order; asan: out-of-range
# accesses (the block's shared memory is a buffer of exactly the scratch size) and undefined behaviour. CASE is an
# index into the fixed cases of phase1_check.cc (all by default); `random` draws COUNT random shapes.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
MODE=${1:-plain}
shift || true
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 "$HERE/transform.py" "$REPO/kernels/phase1_cuda.cu" "$WORK/phase1_emu.inc" 2
case "$MODE" in
  plain) FLAGS="-O1" ;;
  tsan) FLAGS="-O1 -g -fsanitize=thread" ;;
  asan) FLAGS="-O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined" ;;
  *) echo "mode: plain, tsan or asan" >&2; exit 2 ;;
esac
${CXX:-g++} -std=c++20 $FLAGS -I"$REPO" -I"$HERE/shim" -I"$HERE" -I"$WORK" "$HERE/phase1_check.cc" "$REPO/kernels/phase1_cpu.cc" \
  -o "$WORK/phase1_check" -pthread
"$WORK/phase1_check" "$@"
