#!/usr/bin/env bash
# Installs the Debian packages kmla needs (when missing), then configures and builds.
# Usage: scripts/build.sh [build-dir] [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh cmake ninja-build g++ libgtest-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev libopenblas-dev \
  pybind11-dev python3-dev python3-numpy python3-pytest python3-torch
dir=${1:-build}
shift || true
cmake -S . -B "$dir" -G Ninja "$@" >/dev/null
cmake --build "$dir"
