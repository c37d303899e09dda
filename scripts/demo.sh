#!/usr/bin/env bash
# The main job: builds the `deltastate` CLI if needed and runs its continuous-batching demo on the
# CPU (arguments go to `deltastate demo`; see `--help`).
#
#   scripts/demo.sh                          default sizes, a few seconds on 2 cores
#   scripts/demo.sh --model qwen3-next       the real per-layer shapes
#   scripts/demo.sh --device cuda            on a GPU (needs a CUDA build: nvcc at configure time)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
if [ ! -x "$BUILD/tools/deltastate" ]; then
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DDELTASTATE_CUDA="${DELTASTATE_CUDA:-AUTO}" \
    -DDELTASTATE_CUDA_ALL_KERNELS="${DELTASTATE_CUDA_ALL_KERNELS:-OFF}" >/dev/null
  cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" --target deltastate_cli
fi
exec "$BUILD/tools/deltastate" demo "$@"
