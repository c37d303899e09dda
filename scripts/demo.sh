#!/usr/bin/env bash
# The main job: builds the `deltastate` CLI (incrementally, so it never runs a stale binary) and
# runs its continuous-batching demo (arguments go to `deltastate demo`; see `--help`).
#
#   scripts/demo.sh                          default sizes, a few seconds on 2 cores
#   scripts/demo.sh --model qwen3-next       the real per-layer shapes
#   scripts/demo.sh --device cuda            on a GPU (a CUDA build: needs nvcc)
#   scripts/demo.sh --hf                     a small random-weight Qwen3-Next generating through
#                                            HF transformers on deltastate, against transformers'
#                                            torch path (options: python -m
#                                            deltastate.integrations.demo --help)
#
# The CPU demo builds without the CUDA backend (build-cpu/), so a machine with nvcc does not
# compile CUDA kernels it will not run; `--device cuda` builds with it (build/).
set -euo pipefail
cd "$(dirname "$0")/.."
cuda=OFF
hf=0
prev=
args=()
for arg in "$@"; do
  case "$prev:$arg" in
    --device:cuda* | *:--device=cuda*) cuda=ON ;;
  esac
  if [ "$arg" = --hf ]; then hf=1; else args+=("$arg"); fi
  prev=$arg
done

if [ $hf = 1 ]; then
  # The transformers mode runs in Python: the package is (re)installed from this tree into .venv
  # (incremental CMake build; CPU-only unless --device cuda), with torch and transformers.
  # DELTASTATE_PYTHON=/path/to/python uses that interpreter as it is instead.
  PY=${DELTASTATE_PYTHON:-}
  if [ -z "$PY" ]; then
    VENV=${VENV:-$PWD/.venv}
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    PY=$VENV/bin/python
    "$PY" -c "import torch, transformers, tvm_ffi, scikit_build_core" 2>/dev/null ||
      "$PY" -m pip install -q numpy apache-tvm-ffi scikit-build-core torch "transformers==5.23.0" >&2
    echo "demo: installing deltastate from this tree (CUDA backend: $cuda)" >&2
    SKBUILD_CMAKE_DEFINE="DELTASTATE_CUDA=$cuda;DELTASTATE_CUDA_ALL_KERNELS=${DELTASTATE_CUDA_ALL_KERNELS:-OFF}" \
      "$PY" -m pip install -q --no-build-isolation . >&2
  fi
  exec "$PY" -m deltastate.integrations.demo ${args[@]+"${args[@]}"}
fi
if [ $cuda = ON ]; then BUILD=${BUILD:-build}; else BUILD=${BUILD:-build-cpu}; fi
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  echo "demo: configuring $BUILD (CUDA backend: $cuda)" >&2
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DDELTASTATE_CUDA=$cuda \
    -DDELTASTATE_CUDA_ALL_KERNELS="${DELTASTATE_CUDA_ALL_KERNELS:-OFF}" >/dev/null
fi
cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" --target deltastate_cli >&2
exec "$BUILD/tools/deltastate" demo "$@"
