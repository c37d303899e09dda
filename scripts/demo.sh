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
  # The transformers mode runs in Python: the package from this tree in .venv, with torch and
  # transformers. It is installed only when missing, when a source changed since its install, or
  # when --device cuda needs the CUDA backend it lacks; a CUDA build is never replaced by a
  # CPU-only one (it runs the CPU demo too). A CUDA install reuses build/ (scripts/test.sh's
  # tree), a CPU-only one build-cpu/ (the CLI demo's), so only what changed is compiled.
  # DELTASTATE_PYTHON=/path/to/python uses that interpreter as it is instead.
  PY=${DELTASTATE_PYTHON:-}
  if [ -z "$PY" ]; then
    source scripts/lib/package.sh
    VENV=${VENV:-$PWD/.venv}
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    PY=$VENV/bin/python
    "$PY" -c "import torch, transformers, tvm_ffi, scikit_build_core" 2>/dev/null ||
      "$PY" -m pip install -q numpy apache-tvm-ffi scikit-build-core torch "transformers==5.23.0" >&2
    have=$(installed_backend "$PY")
    want=cpu
    if [ $cuda = ON ] || [ "$have" = cuda ]; then want=cuda; fi
    why=
    if [ "$have" = none ]; then why="not installed"
    elif [ "$want" = cuda ] && [ "$have" = cpu ]; then why="--device cuda needs the CUDA backend"
    elif sources_changed "$(package_stamp "$PY")"; then why="sources changed since its install"
    fi
    if [ -n "$why" ]; then
      if [ $want = cuda ]; then tree=${BUILD:-build} backend=ON; else tree=${BUILD:-build-cpu} backend=OFF; fi
      if [ $want = cuda ]; then "$PY" -m pip install -q --no-deps "nvidia-cutlass==4.2.0.0" >&2; fi
      echo "demo: installing deltastate from this tree into $VENV ($why; CUDA backend:" \
        "$backend; CMake tree $tree/)" >&2
      install_package "$PY" "$tree" "$backend" -q >&2
      echo "demo: installed $("$PY" -m pip show deltastate 2>/dev/null | sed -n 's/^Version: //p')" \
        "with CUDA backend: $(installed_backend "$PY" | sed 's/cuda/built/; s/cpu/not built/')" >&2
    else
      echo "demo: $VENV's deltastate is current (CUDA backend: $(installed_backend "$PY" |
        sed 's/cuda/built/; s/cpu/not built/')); not reinstalled" >&2
    fi
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
