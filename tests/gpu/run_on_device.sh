#!/usr/bin/env bash
# Runs on the GPU machine (the device tool): the `gpu` tests (stria_gpu_tests, then comm::nccl's
# timeout-and-abort tests on one GPU, stria_nccl_gpu_tests; and, where there are two or more GPUs,
# the `multi_gpu` tests and multi_gpu_bench), compute-sanitizer memcheck, synccheck, initcheck and
# racecheck over every `gpu` test case, then the benchmarks; prints a short table last and leaves logs in $OUT.
# Uses binaries carried in .device/bin when present (built on the dev machine with the same nvcc,
# sm_90a); otherwise configures and builds them here with -j16.
#   usage: tests/gpu/run_on_device.sh [quick]      (quick: no sanitizers; SANITIZER_TIMEOUT, default 400 s, bounds each
#   sanitizer shard)
#   BENCHES="attention_bench estimator_bench ring_bench" (default) picks the benchmarks; ATTENTION_ARGS are
#   passed to attention_bench; COMPARE=1 also runs tests/bench/compare_flex.py on the same patterns.
#   The bench `attention_results` writes $OUT/attention_h200.json (tests/bench/results/): attention_bench's
#   rows at 128K for D 128 and 64 (dense, vs95, deterministic, front template) and vs95 at 32K and 512K,
#   with cuDNN's dense rows measured in the same call (tests/bench/cudnn_bench.py); STRIA_COMMIT names
#   the commit measured; estimator_bench writes $OUT/estimator_h200.json the same way. TESTS picks
#   doctest cases of stria_gpu_tests (-tc), all by default; GPU_TESTS=0 skips the GPU tests (a call for the sanitizers or benchmarks). RING_ARGS are passed to ring_bench (e.g. "--seq-len 131072 --checked": checked mode's cost). TORCH=0 skips
#   installing and testing the PyTorch package. AB="dirA dirB" times those folders' attention_bench in turns (below).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/stria-device-out}
mkdir -p "$OUT"
mode=${1:-full}
summary=()
note() { summary+=("$1"); echo "== $1"; }

nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$OUT/gpu.txt"
echo "host kernel: $(uname -r) (a -fc kernel: a Firecracker guest; timings of host-side meetings differ between guests)" | tee -a "$OUT/gpu.txt"

bin=.device/bin
benches=${BENCHES-attention_bench estimator_bench ring_bench}
if [ ! -x "$bin/stria_gpu_tests" ]; then
  bin=build-device/bin
  start=$(date +%s)
  cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRIA_BUILD_EXAMPLES=OFF \
        -DCMAKE_RUNTIME_OUTPUT_DIRECTORY="$PWD/$bin" > "$OUT/configure.log" 2>&1 &&
    cmake --build build-device -j16 --target stria_gpu_tests stria_nccl_gpu_tests stria_multi_gpu_tests stria_one_process_per_gpu attention_bench estimator_bench \
      ring_bench multi_gpu_bench stria_racecheck_probe > "$OUT/build.log" 2>&1
  note "build on device: rc=$? in $(( $(date +%s) - start )) s"
fi

run() {  # run NAME COMMAND...: logs to $OUT/NAME.log, records pass/fail and time
  local name=$1; shift
  local start=$(date +%s%N)
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local secs=$(( ($(date +%s%N) - start) / 1000000 ))  # milliseconds (no bc on the device image)
  tail -n 3 "$OUT/$name.log"
  note "$name: rc=$rc (${secs} ms)"
  return $rc
}

if [ "${GPU_TESTS:-1}" = 1 ]; then  # GPU_TESTS=0: a call for the sanitizers or benchmarks alone
  run gpu_tests "$bin/stria_gpu_tests" ${TESTS:+-tc="$TESTS"}
  # comm::nccl's timeout and abort on one GPU (a world-1 communicator held behind a gate kernel).
  if [ -x "$bin/stria_nccl_gpu_tests" ]; then run nccl_gpu_tests "$bin/stria_nccl_gpu_tests"
  else note "nccl_gpu_tests: no $bin/stria_nccl_gpu_tests (it is built where NCCL is found)"; fi
fi
# With two or more GPUs: the multi-GPU tests, one process driving every GPU and one process per GPU
# (NVLink multicast stays off).
if [ "$(nvidia-smi -L | grep -c '^GPU')" -ge 2 ] && [ -x "$bin/stria_multi_gpu_tests" ]; then
  export NCCL_NVLS_ENABLE=0
  run multi_gpu_tests "$bin/stria_multi_gpu_tests"
  [ -x "$bin/stria_one_process_per_gpu" ] && run one_process_per_gpu tests/multi_gpu/launch_ranks.sh "$bin/stria_one_process_per_gpu"
  # One layer at 512K on every GPU: the sparse rings (hierarchical 2 x G/2 from four GPUs) and the solver.
  if [ -x "$bin/multi_gpu_bench" ]; then
    variants=zigzag,striped,solver
    [ "$(nvidia-smi -L | grep -c '^GPU')" -ge 4 ] && variants=zigzag,striped,hierarchical,solver
    run multi_gpu_bench "$bin/multi_gpu_bench" --seq-len 524288 --variants $variants
    multi_shown=multi_gpu_bench
  fi
fi
if [ "$mode" != quick ]; then
  # The tools of SANITIZERS (default: memcheck, synccheck, initcheck, racecheck) over every test case
  # but the fault cases, each tool in shards of SANITIZER_SHARD_CASES (4) cases (doctest's -f/-l
  # ranges, 1-based, inclusive, up to the binary's own count of cases), SANITIZER_PROCS (12) processes
  # at once on the one GPU: one after another they outlast a 10-minute device call (racecheck alone
  # ran 4 of its 8 shards past 470 s: pick tools per call). The fault case of a rank that throws runs
  # alone under the tools of SANITIZE_FAULTS (default memcheck); the other one holds a rank's stream
  # behind a gate kernel that the host opens only after every rank has raised, and compute-sanitizer
  # serializes kernel launches: it cannot finish under a sanitizer (2026-12-04) and is left out. doctest's summary counts the cases outside a shard's range as
  # passed; the sanitizer's own ERROR SUMMARY is what counts. SANITIZER_TIMEOUT (400 s) bounds each.
  # SANITIZER_PARTS=N takes the four sweeps that outlast a call under racecheck (random and ring-step
  # indices, both element types; the 300-block backward; the paired forward) out of the shards and
  # runs each as N processes per tool, process i with STRIA_TEST_PART=i/N (every N-th configuration).
  # SANITIZER_ONLY_PARTS=1 runs those parts alone: no shards, no fault case. Under racecheck two of
  # them instrument only the kernels they exist for (compute-sanitizer --kernel-name; their other
  # kernels run unchecked, and are racechecked in the small-problem and random-index cases): the
  # paired forward's case the Hopper forwards; the 300-block case the kernels that split the vertical
  # tokens' walks into ranges of 256 query blocks (the Hopper dK/dV launch, the mma.sync vertical
  # pass). The 300-block case's configurations are (problem, backward family, mode), 32 on Hopper:
  # SANITIZER_PARTS_300 (default SANITIZER_PARTS) sets its part count alone. The probe below checks
  # that two --kernel-name options add up (either order).
  # (A template case's name ends in its type: "...indices<__nv_bfloat16>".)
  sweeps=("*random?step?indices*" "*more?than?256?query?blocks*" "*ring-step?indices*" "the?paired?Hopper?forward*")
  shard_excluded="*local_device fault*"
  [ "${SANITIZER_PARTS:-0}" -gt 0 ] && shard_excluded+=",$(IFS=,; echo "${sweeps[*]}")"
  sanitize_shard() {  # TOOL FIRST LAST | TOOL fault PATTERN | TOOL part PATTERN I/N
    local log="$OUT/sanitize_$1_$2_${3//[^a-z0-9]/}${4:+_${4//\//of}}.log" start=$(date +%s) cases
    case $2 in
      fault | part) cases=(-tc="$3") ;;
      *) cases=(-tce="$shard_excluded" -f="$2" -l="$3") ;;
    esac
    local only=()
    if [ "$1" = racecheck ] && [ "$2" = part ]; then
      case $3 in
        *paired?Hopper?forward*) only=(--kernel-name kns=sparse_forward_wgmma) ;;
        *more?than?256?query?blocks*) only=(--kernel-name kns=sparse_backward_dkdv_wgmma --kernel-name kns=sparse_backward_vertical) ;;
      esac
    fi
    env ${4:+STRIA_TEST_PART=$4} timeout "${SANITIZER_TIMEOUT:-400}" compute-sanitizer --tool "$1" --error-exitcode 9 "${only[@]}" "$bin/stria_gpu_tests" "${cases[@]}" > "$log" 2>&1
    local rc=$?
    echo "$1 cases $2 $3${4:+ part $4}${only[*]:+ (only ${only[*]})}: rc=$rc in $(( $(date +%s) - start )) s, $(grep -o 'ERROR SUMMARY: [0-9]* error\|RACECHECK SUMMARY: [0-9]* hazard[s]*' "$log" | head -1)"
    [ $rc = 0 ] && rm -f "$log"  # the others come back packed in one file (at most 8 files do)
  }
  if [ "${SANITIZER_ONLY_PARTS:-0}" = 1 ] && [ "${SANITIZER_PARTS:-0}" -lt 1 ]; then
    echo "SANITIZER_ONLY_PARTS=1 needs SANITIZER_PARTS >= 1 (the parts are all it runs)" >&2
    exit 2
  fi
  export -f sanitize_shard; export OUT bin shard_excluded
  start=$(date +%s)
  # The binary's count of test cases (doctest's listing), so that a new case is not left out of every shard.
  all_cases=$("$bin/stria_gpu_tests" -ltc | grep -o 'passing the current filters: [0-9]*' | grep -o '[0-9]*$')
  per=${SANITIZER_SHARD_CASES:-4}
  {
    for tool in ${SANITIZERS-memcheck synccheck initcheck racecheck}; do
      [ "${SANITIZER_ONLY_PARTS:-0}" = 1 ] && break  # the sweeps' parts alone (the shards ran clean in an earlier call)
      for ((first = 1; first <= ${all_cases:-64}; first += per)); do echo "$tool $first $((first + per - 1))"; done
    done
    [ "${SANITIZER_ONLY_PARTS:-0}" = 1 ] || for tool in ${SANITIZE_FAULTS-memcheck}; do echo "$tool fault *local_device?fault:?a?rank?that?throws*"; done
    for tool in ${SANITIZERS-memcheck synccheck initcheck racecheck}; do
      for ((i = 0; i < ${SANITIZER_PARTS:-0}; ++i)); do
        for sweep in "${sweeps[@]}"; do [ "$sweep" = "*more?than?256?query?blocks*" ] || echo "$tool part $sweep $i/$SANITIZER_PARTS"; done
      done
      parts_300=${SANITIZER_PARTS_300:-${SANITIZER_PARTS:-0}}
      for ((i = 0; i < parts_300; ++i)); do echo "$tool part *more?than?256?query?blocks* $i/$parts_300"; done
    done
  } | xargs -r -P "${SANITIZER_PROCS:-12}" -L 1 bash -c 'sanitize_shard "$0" "$1" "$2" "$3"' | sort -k1,1 -k3,3n > "$OUT/sanitizers.log"
  # What racecheck reports on the stage rings' hand-over (tests/gpu/racecheck_probe.cu): every lane
  # reading a stage that lane 0 releases (the forward's K ring), lane 0 alone reading, and the control.
  if [[ " ${SANITIZERS-racecheck} " == *" racecheck "* ]] && [ -x "$bin/stria_racecheck_probe" ]; then
    for how in copies copies-lane0 stores stores-lane0 syncthreads; do
      echo "racecheck probe $how: $(compute-sanitizer --tool racecheck "$bin/stria_racecheck_probe" "$how" 2>&1 |
        grep -o 'consumer summed .*\|RACECHECK SUMMARY: [0-9]* hazard[s]*' | paste -sd ' ')"
    done >> "$OUT/sanitizers.log"
    # The kernel filters' control: the probe's racy kernel named second, then first, beside a name
    # that matches nothing; both must report the hazard that `copies` has unfiltered.
    for order in "kns=no_such_kernel kns=sum_handed_over" "kns=sum_handed_over kns=no_such_kernel"; do
      read -r first second <<< "$order"
      echo "racecheck probe copies, --kernel-name $first --kernel-name $second: $(compute-sanitizer --tool racecheck --kernel-name "$first" --kernel-name "$second" \
        "$bin/stria_racecheck_probe" copies 2>&1 | grep -o 'RACECHECK SUMMARY: [0-9]* hazard[s]*')"
    done >> "$OUT/sanitizers.log"
  fi
  if compgen -G "$OUT/sanitize_*.log" > /dev/null; then
    tar czf "$OUT/sanitizer_logs.tgz" -C "$OUT" $(cd "$OUT" && ls sanitize_*.log) && rm -f "$OUT"/sanitize_*.log
  fi
  cat "$OUT/sanitizers.log"
  note "sanitizers: $(grep -c 'rc=0 ' "$OUT/sanitizers.log") of $(grep -c 'rc=' "$OUT/sanitizers.log") runs clean in $(( $(date +%s) - start )) s"
fi
# The PyTorch package (python/): built against the device's torch with pip (no index, no isolation:
# nothing can be downloaded there), then its tests against SDPA's math path, and context parallelism
# (a group of one process; with two or more GPUs, two processes). TORCH=0 skips it.
if [ "${TORCH:-1}" = 1 ] && python3 -c "import torch" 2>/dev/null; then
  CMAKE_BUILD_PARALLEL_LEVEL=16 run torch_install python3 -m pip install --no-build-isolation --no-deps --no-index ./python
  run torch_tests python3 python/tests/test_sparse_attention.py
  run torch_cp_tests timeout 300 python3 python/tests/test_context_parallel.py  # NCCL's initialisation has no timeout of its own
  bench_logs+=" torch_tests torch_cp_tests"
fi
# AB="dirA dirB ...": attention_bench of each folder (built from the commits compared, same nvcc and
# flags) timed in turns at 128K, AB_ROUNDS (2) rounds: the forward alone at D 64 and 128 (vs95 and
# dense), then forward and backward at D 128 (vs95). $OUT/ab.log holds one line per run (round, folder,
# head dim, pattern, forward ms and TF, backward ms and TF); each folder's medians are compared only
# with the others' from the same call.
if [ -n "${AB:-}" ]; then
  for ((round = 1; round <= ${AB_ROUNDS:-2}; ++round)); do
    for dim in 64 128 128full; do
      for dir in $AB; do
        args=(--head-dim "${dim%full}" --seq-len 131072 --repeats 7)
        if [ "$dim" = 128full ]; then args+=(--patterns vs95); else args+=(--forward-only --patterns vs95,dense); fi
        timeout 150 "$dir/attention_bench" "${args[@]}" 2>&1 | awk -v r="$round" -v d="$dir" -v h="$dim" \
          '$1 == 131072 && $3 ~ /%$/ { printf "round %s %-20s D %-8s %-6s fwd %8s ms %7s TF  bwd %8s ms %7s TF  %s\n", r, d, h, $2, $4, $5, $6, $7, $NF }' >> "$OUT/ab.log"
      done
    done
  done
  note "ab: $(wc -l < "$OUT/ab.log") rows, $AB in turns"
  bench_logs+=" ab"
fi
for bench in $benches; do
  if [ "$bench" = attention_results ]; then
    commit=${STRIA_COMMIT:-unknown}
    run attention_d128 "$bin/attention_bench" --seq-len 131072 --patterns dense,vs95 --front --repeats 5 --commit "$commit" --json "$OUT/part_d128.json"
    run attention_d64 "$bin/attention_bench" --head-dim 64 --seq-len 131072 --patterns dense,vs95 --front --repeats 5 --commit "$commit" \
      --json "$OUT/part_d64.json"
    run attention_lengths "$bin/attention_bench" --seq-len 32768,524288 --patterns vs95 --repeats 5 --commit "$commit" --json "$OUT/part_lengths.json"
    run attention_results python3 tests/bench/cudnn_bench.py "$OUT"/part_d128.json "$OUT"/part_d64.json "$OUT"/part_lengths.json \
      --out "$OUT/attention_h200.json"
    rm -f "$OUT"/part_*.json
    bench_logs+=" attention_d128 attention_d64 attention_lengths attention_results"
  elif [ "$bench" = attention_bench ]; then
    mkdir -p "$OUT/patterns"
    run attention_bench "$bin/attention_bench" --pattern-dir "$OUT/patterns" ${ATTENTION_ARGS:-}
  elif [ "$bench" = estimator_bench ]; then  # writes $OUT/estimator_h200.json (tests/bench/results/)
    run estimator_bench "$bin/estimator_bench" --json "$OUT/estimator_h200.json" --commit "${STRIA_COMMIT:-unknown}"
  elif [ "$bench" = ring_bench ]; then
    run ring_bench "$bin/ring_bench" ${RING_ARGS:-}
  else
    run "$bench" "$bin/$bench"
  fi
done
# PROFILE="regex[,regex...]": Nsight Compute on the first launch of each named kernel in attention_bench
# (128K vs95, D 128), the main sections, one report each in $OUT.
for kernel in ${PROFILE:+${PROFILE//,/ }}; do
  run "ncu_$kernel" ncu --clock-control none --kernel-name "regex:$kernel" --launch-count 1 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section SchedulerStats \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio|sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active' \
    "$bin/attention_bench" --seq-len 131072 --patterns vs95 --repeats 1
done
if [ "${COMPARE:-0}" = 1 ]; then
  run compare_flex python3 tests/bench/compare_flex.py "$OUT/patterns"
fi

echo
echo "================ summary ================"
printf '%s\n' "${summary[@]}"
for bench in ${bench_logs:-} $benches ${COMPARE:+compare_flex} ${multi_shown:-}; do
  [ -f "$OUT/$bench.log" ] && { echo "---- $bench ----"; cat "$OUT/$bench.log"; }
done
