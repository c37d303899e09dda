#!/usr/bin/env bash
# The main job: builds the `deltastate` CLI (incrementally, so it never runs a stale binary) and
# runs its continuous-batching demo (arguments go to `deltastate demo`; see `--help`).
#
#   scripts/demo.sh                          default sizes, a few seconds on 2 cores
#   scripts/demo.sh --model qwen3-next       the real per-layer shapes
#   scripts/demo.sh --device cuda            on a GPU (a CUDA build: needs nvcc)
#
# The CPU demo builds without the CUDA backend (build-cpu/), so a machine with nvcc does not
# compile CUDA kernels it will not run; `--device cuda` builds with it (build/).
set -euo pipefail
cd "$(dirname "$0")/.."
cuda=OFF
prev=
for arg in "$@"; do
  case "$prev:$arg" in
    --device:cuda* | *:--device=cuda*) cuda=ON ;;
  esac
  prev=$arg
done
if [ $cuda = ON ]; then BUILD=${BUILD:-build}; else BUILD=${BUILD:-build-cpu}; fi
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  echo "demo: configuring $BUILD (CUDA backend: $cuda)" >&2
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DDELTASTATE_CUDA=$cuda \
    -DDELTASTATE_CUDA_ALL_KERNELS="${DELTASTATE_CUDA_ALL_KERNELS:-OFF}" >/dev/null
fi
cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" --target deltastate_cli >&2
exec "$BUILD/tools/deltastate" demo "$@"
