#!/usr/bin/env bash
# One call on the GPU machine: build with all cores (Hopper target only), run the GPU tests,
# then the benchmark and the PyTorch peers. Logs and JSON go to $OUT (or ./gpu-out).
# Usage: scripts/gpu_check.sh [tests|sanitize|bench|all] [ctest -R regex (case-sensitive)]
#        scripts/gpu_check.sh ab CASES SETTING SETTING...
# TARGETS="kmla_cli kmla_cuda_kernel_tests" builds only those (a shorter call when the regex or
# the ab form needs no more).
# The ab form times `kmla bench --only CASES` under each SETTING (environment assignments,
# e.g. "KMLA_DECODE_PASS_ORDER=0"; "" for the defaults), the settings alternated twice in
# one process each so that clock and machine drift hit them alike, one line per case; with
# KMLA_GEMM_VERBOSE=1 in a setting, also the GEMM tuning's choices (layer cases). The lines
# also go to $OUT/ab.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
regex=${2:-[Cc]uda}  # the GPU gtests (CudaGemm, CudaDecode, ...) and the CLI runs on the GPU
if [ "$what" = ab ] && [ $# -lt 4 ]; then
  echo "usage: $0 ab CASES SETTING SETTING..." >&2
  exit 2
fi
out=${OUT:-gpu-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$out/gpu.txt"
start=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DKMLA_CUDA_GENCODE="-gencode=arch=compute_90a,code=sm_90a" ${CMAKE_EXTRA:-} >/dev/null &&
  cmake --build build-gpu -j "$(nproc)" ${TARGETS:+--target $TARGETS} >"$out/build.log" 2>&1
rc=$?
echo "build rc=$rc in $(( $(date +%s) - start )) s"
if [ $rc -ne 0 ]; then grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; fi
rm -f "$out/build.log"  # at most 8 files come back from the GPU machine
if [ "$what" = tests ] || [ "$what" = all ]; then
  ctest --test-dir build-gpu -R "$regex" --no-tests=error -j 4 --timeout 300 --output-on-failure >"$out/ctest.log" 2>&1
  echo "ctest rc=$?"
  grep -E "tests passed|No tests were found|Failed|\*\*\*|Not Run|Timeout" "$out/ctest.log" | head -60
fi
if [ "$what" = sanitize ] || [ "$what" = all ]; then
  # compute-sanitizer on a representative subset: every kernel family once, small shapes.
  t=build-gpu/tests
  log="$out/sanitize.log"; : >"$log"
  for tool in memcheck racecheck; do
    timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 $t/kmla_cuda_kernel_tests \
      --gtest_filter='CudaDecode.Bf16CacheMixedLengths:CudaDecode.DsMla*:CudaPrefill.MixedSequences*:CudaKernels.*:CudaGemm.BatchedNn*:CudaGemm.LinearFp8Slices*' \
      >>"$log" 2>&1; echo "$tool kernels rc=$?" | tee -a "$log"
  done
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 build-gpu/tests/kmla_cuda_layer_tests \
    --gtest_filter='CudaGraph.*:Grid/CudaCase.HopperPathMatchesOracle/kimi_k3_dspark_small_fp8_ds_mla_bs16' \
    >>"$log" 2>&1; echo "memcheck layer rc=$?" | tee -a "$log"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$log" | sort | uniq -c | head -20
fi
if [ "$what" = ab ]; then
  cases=$2
  shift 2
  : >"$out/ab.txt"  # every line also here: the call's output keeps only its tail
  for round in 1 2; do
    for setting in "$@"; do
      # shellcheck disable=SC2086  # a setting is a list of assignments
      env $setting build-gpu/kmla bench --only "$cases" --json >"$out/ab.json" 2>"$out/ab.err" ||
        { echo "bench failed under '$setting'"; tail -5 "$out/ab.err"; }
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(f\"{sys.argv[2] or 'defaults':40.40s} {sys.argv[3]} {c.get('name'):56.56s} {c.get('us') or 0:9.1f} us {c.get('tflops') or 0:7.1f} TF {c.get('frac_copy_bw') or 0:6.3f} copy {c.get('floor_ratio') or 0:6.3f} x {c.get('error', '')}\") for c in d.get('cases', [])]" "$out/ab.json" "$setting" "$round" | tee -a "$out/ab.txt"
      # With KMLA_GEMM_VERBOSE=1 in a setting: what GEMM tuning chose (first round).
      [ "$round" = 1 ] && grep -h ': tuned over' "$out/ab.err" | sed 's/^/  /' | head -20
    done
  done
  rm -f "$out/ab.json" "$out/ab.err"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  build-gpu/kmla bench --json ${BENCH_ARGS:-} > "$out/bench.json" 2>"$out/bench.err"
  echo "bench rc=$?"; tail -5 "$out/bench.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(c.get('name'), round(c.get('us') or 0, 1), round(c.get('frac_copy_bw') or c.get('tflops') or 0, 3), c.get('error', '')) for c in d.get('cases', [])]" "$out/bench.json"
  PYTHONUNBUFFERED=1 python3 bench/peers/torch_peers.py --json "$out/peers.json" 2>&1 | tee "$out/peers.txt" | tail -20
fi
echo "total $(( $(date +%s) - start )) s"
