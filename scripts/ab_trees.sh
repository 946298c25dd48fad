#!/usr/bin/env bash
# A/B of source variants in one call on the GPU machine: `kmla bench --only CASES` from the
# working tree's build and from one build per variant, the binaries alternated twice so that
# clock and machine drift hit them alike; one line per (binary, round, case), grouped by case.
# Usage: scripts/ab_trees.sh CASES VARIANT_DIR...
# A variant directory holds replacement files at their repository paths (e.g.
# abv/evict/src/cuda/decode_attention.cu); the tree is restored after each build. For a
# variant behind an environment switch use `scripts/gpu_check.sh ab` instead (one build).
# Builds only `kmla_cli` (TARGETS overrides) with all cores; needs a configured or
# configurable build-gpu (as scripts/gpu_check.sh makes it).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
if [ $# -lt 2 ]; then
  echo "usage: $0 CASES VARIANT_DIR..." >&2
  exit 2
fi
cases=$1
shift
targets=${TARGETS:-kmla_cli}
bins=$(mktemp -d)
saved=$(mktemp -d)
build() {  # build() NAME: build the tree as it is now, keep its kmla as $bins/NAME
  # shellcheck disable=SC2086  # a list of targets
  cmake --build build-gpu -j "$(nproc)" --target $targets >"$bins/$1.log" 2>&1 ||
    { echo "build of '$1' failed:"; grep -E "error|FAILED" "$bins/$1.log" | head -20; return 1; }
  cp build-gpu/kmla "$bins/$1"
}
# shellcheck disable=SC2086  # extra cmake arguments, a list
cmake -S . -B build-gpu -G Ninja -DKMLA_CUDA_GENCODE="-gencode=arch=compute_90a,code=sm_90a" \
  ${CMAKE_EXTRA:-} >/dev/null || exit 1
build base || exit 1
names=(base)
for v in "$@"; do
  name=$(basename "$v")
  files=$(cd "$v" && find . -type f | sed 's|^\./||')
  for f in $files; do  # keep the tree's file (or note that it has none)
    mkdir -p "$saved/$name/$(dirname "$f")"
    if [ -e "$f" ]; then cp "$f" "$saved/$name/$f"; else : >"$saved/$name/$f.absent"; fi
  done
  for f in $files; do mkdir -p "$(dirname "$f")" && cp "$v/$f" "$f"; done
  build "$name" && names+=("$name")
  for f in $files; do
    if [ -e "$saved/$name/$f.absent" ]; then rm -f "$f"; else cp "$saved/$name/$f" "$f"; fi
  done
done
# shellcheck disable=SC2086  # a list of targets
cmake --build build-gpu -j "$(nproc)" --target $targets >/dev/null 2>&1  # the tree's build again
for round in 1 2; do
  for name in "${names[@]}"; do
    "$bins/$name" bench --only "$cases" --json >"$bins/ab.json" 2>"$bins/ab.err" ||
      { echo "bench failed for '$name'"; tail -3 "$bins/ab.err"; }
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(f\"{c.get('name'):56.56s} {sys.argv[2]:>12.12s} {sys.argv[3]} {c.get('us') or 0:9.1f} us {c.get('frac_copy_bw') or 0:6.3f} copy {c.get('tflops') or 0:6.1f} TF {c.get('floor_ratio') or 0:6.3f} x {c.get('error', '')}\") for c in d.get('cases', [])]" "$bins/ab.json" "$name" "$round"
  done
done | sort -s -k1,1
rm -rf "$bins" "$saved"
