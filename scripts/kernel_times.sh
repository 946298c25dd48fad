#!/usr/bin/env bash
# Per-kernel GPU times of `kmla bench` cases under Nsight Compute (GPU machine, after
# scripts/gpu_check.sh has built build-gpu): for each kernel (name and grid), the median
# duration over its launches and the launch count, in order of first launch. GEMM tuning is
# off (its candidate runs would swamp the list) and clocks are left free (ncu's default locks
# them to base), so the times are comparable with kmla bench's.
# Usage: scripts/kernel_times.sh CASES [SETTING...]   (SETTING as in gpu_check.sh ab)
set -uo pipefail
cd "$(dirname "$0")/.."
cases=$1
shift
[ $# -eq 0 ] && set -- ""
csv=$(mktemp)
for setting in "$@"; do
  echo "== ${setting:-defaults}: $cases"
  # shellcheck disable=SC2086  # a setting is a list of assignments
  env KMLA_GEMM_TUNE=0 $setting ncu --csv --clock-control none --metrics gpu__time_duration.sum \
    build-gpu/kmla bench --only "$cases" --iters 3 --warmup 1 >"$csv" 2>/dev/null ||
    { echo "ncu failed under '$setting'"; continue; }
  python3 - "$csv" <<'PY'
import csv, statistics, sys
lines = open(sys.argv[1]).read().splitlines()
start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
if start is None:
    sys.exit("no ncu rows")
times, order = {}, []
for r in csv.DictReader(lines[start:]):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    key = (r["Kernel Name"][:70], r["Grid Size"])
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[r["Metric Unit"]]
    if key not in times:
        times[key] = []
        order.append(key)
    times[key].append(float(r["Metric Value"].replace(",", "")) * scale)
for key in order:
    v = times[key]
    print(f"{statistics.median(v):10.2f} us  x{len(v):<5d} grid {key[1]:>14s}  {key[0]}")
PY
done
rm -f "$csv"
