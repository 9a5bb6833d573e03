#!/usr/bin/env bash
# The GPU machine's one call: build the package, run the GPU tests and the benchmark, logs under $OUT.
#
#   bash scripts/gpu_check.sh [stages]     stages: comma list of build,tests,determinism,bench,memory,profile,
#                                          kernel_detail,timeline,sanitize,rowbw,carveout,last_use,two_chains,
#                                          dense_tiles,layer,topk,topk_profile,decode_trace,decode_profile,
#                                          decode_source,snapshot
#                                          (default: build,tests,determinism,bench)
#
# Run it as `SDM_COMMIT=<hash> bash scripts/gpu_check.sh`: the GPU machine's copy of the tree may carry stale git
# metadata, so the commit the logs name is taken from SDM_COMMIT when set.
# Environment: PYTEST_ARGS (extra pytest arguments, split at spaces, e.g. "-x"), PYTEST_K (a pytest -k expression,
# kept whole: "run_arrays or workspace_path"), BENCH_ARGS (extra bench.py arguments, e.g.
# "--pipeline 20"), GPU_TEST_FILES (replaces the GPU test list: names of files in tests/, "test_nn.py test_step.py"),
# GPU_TEST_JOBS (pytest processes sharing it, default 8), BENCH_SHAPES, BENCH_CHUNKS, BENCH_REPEATS,
# BENCH_DECODE (0 skips bench_decode.py), BENCH_DECODE_ARGS (bench_decode.py's arguments, default "--impls ffi";
# e.g. "--impls ffi,noop --device-time" adds the device's kernel time per step), PROFILE_SHAPES, PROFILE_CHUNKS,
# PROFILE_MODES, PROFILE_KERNELS (kernel_detail's kernels, a regex), PROFILE_DETAIL_SHAPE, PROFILE_DETAIL_CHUNK,
# PROFILE_INVOCATION, TOPK_PROFILE_ARGS, DECODE_ARGS, SANITIZE_TOOLS, SANITIZE_CASES, SANITIZE_ALL_KERNELS,
# SANITIZE_TAG, SANITIZE_TIMEOUT, SANITIZE_PRINT_LIMIT, ROWBW_ARGS (row_bandwidth's arguments: D K P rows per
# launch), DENSE_ARGS (dense_tiles' arguments: P C D chunks), DENSE_BASE (below), LOGS_TGZ (an archive of the logs
# after every stage: below).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/sdm_out}
STAGES=${1:-build,tests,determinism,bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
has() { [[ ",$STAGES," == *",$1,"* ]]; }
summary() { echo "== $*" | tee -a "$OUT/summary.txt"; }
# LOGS_TGZ: after every stage, all of $OUT archived into this file (the device tool brings back at most 8 files, and
# a call killed at its time limit keeps what the stages before it wrote): `LOGS_TGZ=$OUT/logs.tgz OUT=/tmp/o`.
pack() { [ -z "${LOGS_TGZ:-}" ] || tar czf "$LOGS_TGZ" -C "$OUT" --exclude="$(basename "$LOGS_TGZ")" . ; }
# XLA's flags under ncu for the decode kernels: no command buffers or autotuning (ncu crashed at the first call with
# both on: 2026-12-05, H100).
ncu_xla_flags="--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer="

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv > "$OUT/device.txt" 2>&1
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())" >> "$OUT/device.txt" 2>&1
echo "commit ${SDM_COMMIT:-$(cd "$REPO" && git rev-parse --short HEAD 2>/dev/null || echo unknown)}" >> "$OUT/device.txt"
cat "$OUT/device.txt"

if has build; then
  start=$SECONDS
  # Machine code for this GPU's architecture only (SDM_CUDA_ARCHS, default 90-real: the H100 and H200), not the
  # package's default list of three: the build's CUDA half in about half the time.
  # With line information (SDM_CUDA_LINEINFO: the same machine code), so that ncu's source pages name CUDA lines.
  (cd "$REPO" && python3 -m pip install --no-build-isolation --no-deps -v . \
    --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES="${SDM_CUDA_ARCHS:-90-real}" \
    --config-settings=cmake.define.SDM_CUDA_LINEINFO=ON > "$OUT/build.log" 2>&1)
  rc=$?
  grep -E "warning|error" "$OUT/build.log" | grep -v "^ *$" | tail -20
  summary "build rc=$rc in $((SECONDS - start)) s"
  [ $rc -eq 0 ] || { tail -40 "$OUT/build.log"; exit 1; }
fi
pack

# Tests import the installed package: run from outside the source tree.
cd /tmp
run_pytest() {  # name, then pytest arguments
  local name=$1; shift
  python3 -m pytest -q -p no:cacheprovider --import-mode=importlib --rootdir "$REPO" --run-slow "$@" ${PYTEST_ARGS:-} \
    ${PYTEST_K:+-k "$PYTEST_K"} \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  summary "$name rc=$rc: $(grep -E "[0-9]+ (passed|failed|error)" "$OUT/$name.log" | tail -1)"
  [ $rc -eq 0 ] || { grep -E "^(FAILED|ERROR)|Error" "$OUT/$name.log" | head -20; status=1; }
}

if has tests; then
  # The list takes ~8 minutes in one process, mostly XLA compiling on the host: GPU_TEST_JOBS (default 8) pytest
  # processes share it (files dealt round-robin, the slowest first; logs gpu_tests_<n>.log), each with XLA's
  # preallocation off so that they fit on the card together. GPU_TEST_JOBS=1: one process, log gpu_tests.log.
  if [ -n "${GPU_TEST_FILES:-}" ]; then
    files=($GPU_TEST_FILES)
  else
    files=(test_kernel_path.py test_nn.py test_gpu_steps.py test_gpu_phase1.py $(cd "$REPO/tests" && ls test_gpu_*.py |
      grep -v -e test_gpu_steps.py -e test_gpu_phase1.py) test_oracles.py test_grad_bank.py test_step.py
      test_slab_forward.py ${GPU_TEST_EXTRA:-})
  fi
  jobs=${GPU_TEST_JOBS:-8}
  if [ "$jobs" -le 1 ]; then
    run_pytest gpu_tests "${files[@]/#/$REPO/tests/}"
  else
    for ((g = 0; g < jobs; g++)); do
      group=()
      for ((i = g; i < ${#files[@]}; i += jobs)); do group+=("$REPO/tests/${files[$i]}"); done
      [ ${#group[@]} -gt 0 ] || continue
      (XLA_PYTHON_CLIENT_PREALLOCATE=false run_pytest "gpu_tests_$g" "${group[@]}"; echo "$status" > "$OUT/.status_$g") \
        > "$OUT/.failures_$g" 2>&1 &
    done
    wait
    for ((g = 0; g < jobs; g++)); do
      [ -f "$OUT/.status_$g" ] || continue
      cat "$OUT/.failures_$g"
      [ "$(cat "$OUT/.status_$g")" = 0 ] || status=1
      rm -f "$OUT/.status_$g" "$OUT/.failures_$g"
    done
  fi
fi
pack
if has determinism; then
  # Three processes must agree bit for bit: command buffers (CUDA graphs) on, on again, and off.
  # (test_gpu_snapshot_dtype.py's: each snapshot_dtype).
  export SDM_DIGEST_FILE=$(mktemp -d)
  digests=("$REPO"/tests/test_gpu_determinism.py "$REPO"/tests/test_gpu_snapshot_dtype.py::test_gpu_bitwise_repeatable)
  run_pytest determinism_first "${digests[@]}"
  run_pytest determinism_again "${digests[@]}"
  XLA_FLAGS=--xla_gpu_enable_command_buffer= run_pytest determinism_no_cmdbuf "${digests[@]}"
fi
pack
if has bench; then
  # The GPU anchor shapes (benchmarks/bench.py SHAPES), one process each (the peak memory is per process).
  for shape in ${BENCH_SHAPES:-small mid flagship}; do
    for chunk in ${BENCH_CHUNKS:-64 128}; do
      timeout 300 python3 "$REPO/benchmarks/bench.py" --impls ffi --shape "$shape" --chunk "$chunk" --detail \
        --repeats ${BENCH_REPEATS:-20} ${BENCH_ARGS:-} >> "$OUT/bench.log" 2>&1
      summary "bench $shape rc=$?: $(grep "^| ffi" "$OUT/bench.log" | tail -1)"
    done
  done
  # The decode step: wall time per donated step against K (BENCH_DECODE=0 skips it; --device-time in
  # BENCH_DECODE_ARGS adds the device's time per step from a jax.profiler trace).
  [ "${BENCH_DECODE:-1}" = 0 ] || timeout 300 python3 "$REPO/benchmarks/bench_decode.py" ${BENCH_DECODE_ARGS:---impls ffi} \
    > "$OUT/bench_decode.log" 2>&1
  summary "bench_decode rc=$?"
  grep "^|" "$OUT/bench_decode.log" | tee -a "$OUT/summary.txt"
fi
pack
if has layer; then
  # The Flax layer against the op alone at the layer configs (benchmarks/bench_layer.py), with device timelines
  # of the layer's calls grouped by its named scopes. LAYER_ARGS: extra arguments (e.g. "--config a").
  timeout 400 python3 "$REPO/benchmarks/bench_layer.py" --trace ${LAYER_ARGS:-} > "$OUT/bench_layer.log" 2>&1
  summary "bench_layer rc=$?"
  grep -E "^\|" "$OUT/bench_layer.log" | tee -a "$OUT/summary.txt"
fi
pack
if has topk; then
  # The product-key top-k's kernels against the pure-JAX path at the layer's shapes (benchmarks/bench_topk.py).
  timeout 200 python3 "$REPO/benchmarks/bench_topk.py" --device-time > "$OUT/bench_topk.log" 2>&1
  summary "bench_topk rc=$?"
  grep -E "^\|" "$OUT/bench_topk.log" | tee -a "$OUT/summary.txt"
fi
pack
if has topk_profile; then
  # The product-key top-k's forward and backward kernels at one shape (TOPK_PROFILE_ARGS: profile_topk.py's
  # arguments, default the layer's config b): ncu's full set of one call, as sections and as stalls per SASS line.
  rep=$OUT/ncu_topk
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 ncu --clock-control none --set full -k regex:product_key_topk \
    -c 2 -f -o "$rep" python3 "$REPO/benchmarks/profile_topk.py" --backward --calls 1 \
    ${TOPK_PROFILE_ARGS:---rows 131072 --factors 128,128 --k 32} > "$OUT/ncu_topk_run.txt" 2>&1
  summary "topk profile rc=$?"
  ncu -i "$rep.ncu-rep" --page details > "$OUT/ncu_topk_details.txt" 2>&1
  for kernel in fwd bwd; do
    filter=(--kernel-name regex:'product_key_topk_(thread_)?kernel')
    [ $kernel = fwd ] || filter=(--kernel-name regex:product_key_topk_bwd)
    ncu -i "$rep.ncu-rep" "${filter[@]}" --page source --print-source sass --csv > "$OUT/ncu_topk_$kernel.csv" 2>&1
    python3 "$REPO/benchmarks/ncu_source_summary.py" "$OUT/ncu_topk_$kernel.csv" > "$OUT/ncu_topk_$kernel.txt" 2>&1
  done
  grep -E -e "Duration|Warp Cycles Per Issued|Achieved Occupancy|Theoretical Occupancy|Registers Per" \
    -e "L1/TEX Hit|Mem Pipes|Issue Slots Busy" "$OUT/ncu_topk_details.txt" | tee -a "$OUT/summary.txt"
  rm -f "$rep.ncu-rep"
fi
pack
if has decode_trace; then
  # The layer's decode against K with device timelines at the smallest and largest K (each traced call also copies
  # the undonated state once), and XLA's optimized HLO of the decode loops (hlo_decode/: which fusions a step
  # launches besides the op and the top-k). DECODE_ARGS: more bench_layer.py arguments (e.g. "--decode-unroll 1,8").
  XLA_FLAGS="--xla_dump_to=$OUT/hlo_decode --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode_loop.*" \
    timeout 300 python3 "$REPO/benchmarks/bench_layer.py" --layer-decode --trace ${DECODE_ARGS:-} \
    > "$OUT/decode_timeline.txt" 2>&1
  summary "layer decode rc=$?"
  grep -E "^\|" "$OUT/decode_timeline.txt" | tee -a "$OUT/summary.txt"
  find "$OUT/hlo_decode" -name "*before_optimizations*" -delete 2>/dev/null
fi
pack
if has decode_profile; then
  # Where a layer decode step's time goes: ncu's full set of the layer's decode step kernel and of the op's at
  # K 2^12 and 2^20 (the op's step was about 15 us of device time for a few rows a stream: a chain of latencies),
  # then the top-k kernels' stalls per SASS instruction at the decode shapes (ncu's sampled stalls at its highest
  # rate, benchmarks/ncu_source_summary.py). The decode loop against K and its timelines are the stage decode_trace.
  for log_k in 12 20; do
    for kernel in layer_decode_step_kernel decode_step_kernel; do
      XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="$ncu_xla_flags" \
        timeout 300 ncu --clock-control none --set full -k "regex:^$kernel" -c 2 \
        python3 "$REPO/benchmarks/bench_layer.py" --layer-decode --min-log-k $log_k --max-log-k $log_k \
        --decode-steps 4 --repeats 1 > "$OUT/ncu_${kernel}_k$log_k.txt" 2>> "$OUT/ncu_err.log"
      summary "ncu $kernel K 2^$log_k rc=$?"
      grep -E "^  [a-z_]+.*\(|Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Stall" \
        "$OUT/ncu_${kernel}_k$log_k.txt" | head -20
    done
  done
  for shape in "1024,1024" "64,64"; do
    name=ncu_topk_source_${shape/,/x}
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 ncu --clock-control none --section SourceCounters \
      --section WarpStateStats --warp-sampling-interval 0 -k regex:product_key_topk -c 1 --page source \
      --print-source sass --csv python3 "$REPO/benchmarks/profile_topk.py" --factors "$shape" > "$OUT/$name.csv" \
      2>> "$OUT/ncu_err.log"
    summary "topk source profile $shape rc=$?"
    python3 "$REPO/benchmarks/ncu_source_summary.py" "$OUT/$name.csv" > "$OUT/$name.txt" 2>&1
    head -25 "$OUT/$name.txt"
  done
fi
pack
if has decode_source; then
  # The layer's decode kernel's stalls per SASS instruction (ncu's sampled stalls at its highest rate), at K 2^12
  # and 2^20; the build's line information names each instruction's CUDA line in ncu's report. (ncu's CUDA-source
  # page in CSV carries no metrics: 2026-12-05, H100.)
  for log_k in 12 20; do
    name=ncu_layer_decode_source_k$log_k
    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="$ncu_xla_flags" \
      timeout 200 ncu --clock-control none --section SourceCounters --section WarpStateStats \
      --warp-sampling-interval 0 -k regex:^layer_decode_step_kernel -c 1 --page source --print-source sass --csv \
      python3 "$REPO/benchmarks/bench_layer.py" --layer-decode --min-log-k $log_k --max-log-k $log_k \
      --decode-steps 4 --repeats 1 > "$OUT/$name.csv" 2>> "$OUT/ncu_err.log"
    summary "layer decode source profile K 2^$log_k rc=$?"
    python3 "$REPO/benchmarks/ncu_source_summary.py" "$OUT/$name.csv" > "$OUT/$name.txt" 2>&1
    head -40 "$OUT/$name.txt"
  done
fi
pack
if has sanitize; then
  # compute-sanitizer on every jax_sdm kernel (kernel names in namespace sdm), one tool per process
  # (SANITIZE_TOOLS, default all four). No XLA preallocation, autotuning or command buffers under the tools.
  # SANITIZE_CASES: sanitize_case.py's --cases (default all); SANITIZE_ALL_KERNELS=1 checks XLA's kernels too.
  # initcheck always instruments every kernel: it must see the writes of XLA's kernels to the buffers ours read.
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
    log=$OUT/sanitize_${tool}${SANITIZE_TAG:-}.log
    regex=(--kernel-regex kns=sdm)
    [[ "${SANITIZE_ALL_KERNELS:-0}" = 1 || $tool == initcheck ]] && regex=()
    # racecheck and synccheck (CUDA 13) crash on kernels launched with programmatic dependent launch: they check
    # each block's shared memory and barriers, which PDL does not change, so they run on a build without it (the
    # CMake option SDM_CUDA_PDL=OFF, installed beside the package into /tmp/sdm_nopdl, found first on PYTHONPATH);
    # sanitize_case.py --pdl checks which build it runs.
    site=(env) expect=on
    if [[ $tool == racecheck || $tool == synccheck ]]; then
      nopdl=/tmp/sdm_nopdl
      if [ ! -d "$nopdl/jax_sdm" ]; then
        (cd "$REPO" && python3 -m pip install --no-build-isolation --no-deps --target "$nopdl" \
          -Cbuild-dir=build/nopdl -Ccmake.define.SDM_CUDA_PDL=OFF . > "$OUT/build_nopdl.log" 2>&1)
        summary "build without PDL rc=$?"
      fi
      site=(env PYTHONPATH="$nopdl${PYTHONPATH:+:$PYTHONPATH}") expect=off
    fi
    "${site[@]}" XLA_PYTHON_CLIENT_PREALLOCATE=false \
      XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=" \
      timeout ${SANITIZE_TIMEOUT:-200} compute-sanitizer --tool "$tool" --error-exitcode 3 "${regex[@]}" \
        --print-limit ${SANITIZE_PRINT_LIMIT:-100} \
        python3 "$REPO/tests/sanitize_case.py" --pdl $expect ${SANITIZE_CASES:+--cases $SANITIZE_CASES} > "$log" 2>&1
    summary "sanitize $tool${SANITIZE_TAG:-} rc=$?: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|results," "$log" | tr '\n' ' ')"
    # The reports counted by kind and kernel location (the full log can be large).
    grep -E "^========= +(Uninitialized|Invalid|Race|Barrier|Error|at )" "$log" | sed -E 's/\(.*\)\+/+/' \
      | paste - - | sort | uniq -c | sort -rn | head -40 > "${log%.log}.counts"
  done
fi
pack
if has profile; then
  # Per-kernel times of one jitted forward + backward (every kernel, ours and XLA's), then the wall times of the
  # same step at each chunk size. PROFILE_SHAPES: the shapes (default flagship).
  # PROFILE_MODES: grad (the one-jit training step) and/or nograd (the no-grad forward).
  for shape in ${PROFILE_SHAPES:-flagship}; do
    for chunk in ${PROFILE_CHUNKS:-64}; do
      for mode in ${PROFILE_MODES:-grad}; do
        name=ncu_${shape}_${chunk}_$mode
        # XLA must not preallocate (the profiler needs device memory) nor autotune (its kernels would be profiled).
        XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0 \
        timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes.sum --csv \
          python3 "$REPO/benchmarks/profile_steps.py" "$shape" "$chunk" "$mode" > "$OUT/$name.csv" 2>> "$OUT/ncu_err.log"
        summary "profile $shape C$chunk $mode rc=$?"
        python3 "$REPO/benchmarks/ncu_summary.py" "$OUT/$name.csv" | tee "$OUT/$name.txt" | head -30
      done
    done
  done
fi
pack
if has kernel_detail; then
  # Stall reasons, occupancy, memory throughput and stalls per SASS instruction of one launch (the
  # PROFILE_INVOCATION-th, default 30) of each kernel whose name matches PROFILE_KERNELS, in the training step at
  # PROFILE_DETAIL_SHAPE (default flagship), chunk PROFILE_DETAIL_CHUNK (default 64).
  rep=$OUT/ncu_detail
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0 \
  timeout 300 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
    --section MemoryWorkloadAnalysis --section LaunchStats --section SourceCounters --warp-sampling-interval 0 \
    --kernel-id "::regex:${PROFILE_KERNELS:-apply_inverse}:${PROFILE_INVOCATION:-30}" -f -o "$rep" \
    python3 "$REPO/benchmarks/profile_steps.py" ${PROFILE_DETAIL_SHAPE:-flagship} ${PROFILE_DETAIL_CHUNK:-64} grad \
    > "$OUT/ncu_detail_run.txt" 2>> "$OUT/ncu_err.log"
  summary "kernel detail rc=$?"
  ncu -i "$rep.ncu-rep" --page details > "$OUT/ncu_detail.txt" 2>&1
  ncu -i "$rep.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_detail_source.csv" 2>&1
  python3 "$REPO/benchmarks/ncu_source_summary.py" "$OUT/ncu_detail_source.csv" > "$OUT/ncu_detail_source.txt" 2>&1
  grep -E -e "^  [a-z_]+.*\(|Duration|Warp Cycles Per Issued|Achieved Occupancy|Theoretical Occupancy|Registers Per" \
    -e "Block Limit|L1/TEX Hit|L2 Hit Rate  |Issue Slots Busy|Memory Throughput|Stall|Waves Per SM" \
    -e "Elapsed Cycles|SM Active Cycles|Local Memory Spilling Requests  " "$OUT/ncu_detail.txt" \
    | tee -a "$OUT/summary.txt"
  rm -f "$rep.ncu-rep"
fi
pack
if has timeline; then
  # Where each call's device time goes: kernels, copies, idle gaps (a jax.profiler trace; nsys is absent).
  for shape in ${PROFILE_SHAPES:-flagship}; do
    for mode in ${PROFILE_MODES:-grad nograd}; do
      name=timeline_${shape}_${PROFILE_CHUNKS:-64}_$mode${TIMELINE_TAG:-}
      timeout 200 python3 "$REPO/benchmarks/timeline.py" "$shape" ${PROFILE_CHUNKS:-64} "$mode" > "$OUT/$name.txt" 2>&1
      summary "timeline $shape $mode${TIMELINE_TAG:-} rc=$?: $(grep -E "^span" "$OUT/$name.txt" | head -1)"
    done
  done
fi
pack
if has snapshot; then
  # Each snapshot_dtype at the flagship (chunk SNAPSHOT_CHUNK, default 128): the grad's device timeline, then the
  # benchmark with the y + bank loss and with the y loss (the training peak that issue's memory targets count).
  for dt in ${SNAPSHOT_DTYPES:-default float8_e4m3fn int4}; do
    arg=(); [ "$dt" = default ] || arg=(--snapshot-dtype "$dt")
    chunk=${SNAPSHOT_CHUNK:-128}
    timeout 200 python3 "$REPO/benchmarks/timeline.py" flagship "$chunk" grad "${arg[@]}" \
      > "$OUT/timeline_flagship_${chunk}_grad_$dt.txt" 2>&1
    summary "timeline $dt rc=$?: $(grep -E "^span" "$OUT/timeline_flagship_${chunk}_grad_$dt.txt" | head -1)"
    for loss in y+bank y; do
      timeout 200 python3 "$REPO/benchmarks/bench.py" --impls ffi --shape flagship --chunk "$chunk" --detail \
        --repeats ${BENCH_REPEATS:-20} --loss "$loss" "${arg[@]}" >> "$OUT/bench_snapshot.log" 2>&1
      summary "bench snapshot $dt loss $loss rc=$?: $(grep "^| ffi" "$OUT/bench_snapshot.log" | tail -1)"
    done
  done
fi
pack
if has dense_tiles; then
  # The in-loop apply-inverse kernels at each tile shape, timed and checked bit for bit against one another
  # (benchmarks/dense_tiles.cu, standalone; it exits 1 if a shape's bits differ). DENSE_BASE: a folder of older
  # kernel headers (e.g. build/old/kernels/chunk_steps/dense.cuh, searched before the tree's): the benchmark built
  # against them too, timed, and its output digests compared with this tree's (a change meant to keep the bits).
  dense_tiles() {  # binary, log, include folders...
    local bin=$1 log=$2; shift 2
    nvcc -O3 -std=c++17 -arch=sm_90 "${@/#/-I}" -I"$REPO" "$REPO/benchmarks/dense_tiles.cu" -o "$bin" > "$log" 2>&1 \
      && timeout 120 "$bin" ${DENSE_ARGS:-} >> "$log" 2>&1
  }
  dense_tiles /tmp/dense_tiles "$OUT/dense_tiles.txt"
  rc=$?
  summary "dense_tiles rc=$rc"
  [ $rc -eq 0 ] || status=1
  grep -E "^\| (fwd|bwd)" "$OUT/dense_tiles.txt" | tee -a "$OUT/summary.txt"
  if [ -n "${DENSE_BASE:-}" ]; then
    dense_tiles /tmp/dense_tiles_base "$OUT/dense_tiles_base.txt" "$REPO/$DENSE_BASE"
    rc=$?
    digests() { grep "^output digests" "$1"; }
    same=DIFFERENT
    [ "$(digests "$OUT/dense_tiles.txt")" = "$(digests "$OUT/dense_tiles_base.txt")" ] && same=same
    summary "dense_tiles base rc=$rc ($DENSE_BASE): digests $same"
    [ "$same" = same ] || status=1
    grep -E "^\| (fwd|bwd)" "$OUT/dense_tiles_base.txt" | tee -a "$OUT/summary.txt"
  fi
fi
pack
if has rowbw; then
  # The ceiling of the row kernels: random-row read, write and read-modify-write bandwidth of this GPU at the
  # steps' access pattern (benchmarks/row_bandwidth.cu, standalone).
  nvcc -O3 -std=c++17 -arch=sm_90 "$REPO/benchmarks/row_bandwidth.cu" -o /tmp/row_bandwidth > "$OUT/row_bandwidth.txt" 2>&1 \
    && timeout 200 /tmp/row_bandwidth ${ROWBW_ARGS:-} >> "$OUT/row_bandwidth.txt" 2>&1
  summary "rowbw rc=$?"
  grep -E "^copy|^\| (read|write|rmw)" "$OUT/row_bandwidth.txt" | sort -t'|' -k8 -n -r | head -12 | tee -a "$OUT/summary.txt"
fi
pack
# A standalone CUDA probe, benchmarks/NAME.cu: built for sm_90, run under a time limit, its table rows that match
# PATTERN into the summary.
cuda_probe() {  # NAME, limit in s, PATTERN
  nvcc -O3 -std=c++17 -arch=sm_90 -I"$REPO" "$REPO/benchmarks/$1.cu" -o "/tmp/$1" > "$OUT/$1.txt" 2>&1 \
    && timeout "$2" "/tmp/$1" >> "$OUT/$1.txt" 2>&1
  summary "$1 rc=$?"
  grep -E "$3" "$OUT/$1.txt" | tee -a "$OUT/summary.txt"
}
# What the boundaries between a row kernel and a staged kernel cost under each shared-memory carveout preference.
has carveout && cuda_probe carveout 100 "^\| (default|max|split)"
pack
# Whether the write kernel keeps more of the gathered rows in the L2 with last-use loads and stores.
has last_use && cuda_probe last_use 100 "^\| (plain|loads|both)"
pack
# Whether the chunk loop gains from one CUDA stream a bank stream's chain of kernels.
has two_chains && cuda_probe two_chains 100 "^\| (chains|one|[0-9])"
pack
if has memory; then
  # XLA's buffer assignment for the no-grad forward and the one-jit forward + backward at each anchor shape.
  for shape in ${BENCH_SHAPES:-small mid flagship}; do
    timeout 200 python3 "$REPO/benchmarks/memory.py" --shape "$shape" >> "$OUT/memory.log" 2>&1
    summary "memory $shape rc=$?"
  done
  grep -E "^ |on gpu|on cuda" "$OUT/memory.log" | tee -a "$OUT/summary.txt"
fi
pack
cat "$OUT/summary.txt"
exit $status
