#!/usr/bin/env bash
# The test command: sets up what it needs on a fresh machine, builds, runs every test.
#
#   scripts/test.sh            C++ tests (CTest: GoogleTest suite + CLI), then the Python package
#                              installed with `pip install .` into .venv and its pytest suite
#
# Needs: a C++20 compiler, CMake >= 3.25, Python >= 3.9 with venv, GoogleTest (Debian
# libgtest-dev; installed with apt when missing and possible). The CUDA backend is compiled when
# nvcc is found; CUDA tests skip without a GPU. Environment:
#   DELTASTATE_CUDA_ALL_KERNELS=ON   compile every specialized CUDA kernel (default OFF here:
#                                    the generic kernels only, to keep CPU-only builds short)
#   DELTASTATE_SKIP_TORCH=1          do not install torch (its tests are then skipped, loudly)
#   JOBS=N                           build parallelism (default: nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOBS=${JOBS:-$(nproc)}
BUILD=${BUILD:-build}
say() { printf '\n== %s\n' "$*"; }

# --- system prerequisites -----------------------------------------------------------------------
need_gtest() { [ -f /usr/include/gtest/gtest.h ] || [ -d /usr/src/googletest ]; }
if ! need_gtest; then
  say "GoogleTest missing: installing libgtest-dev"
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgtest-dev cmake g++ >/dev/null
  else
    echo "error: install GoogleTest (Debian: apt-get install libgtest-dev) and re-run" >&2; exit 1
  fi
fi

# --- the Python environment (.venv): the build's and the tests' packages -------------------------
VENV=${VENV:-$ROOT/.venv}
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  python3 -m venv "$VENV"
fi
PY=$VENV/bin/python
"$PY" -m pip install -q --upgrade pip >/dev/null
"$PY" -m pip install -q numpy pytest apache-tvm-ffi scikit-build-core
# CUTLASS's CuTe headers for the CUDA backend's Hopper kernels, pinned (CMakeLists.txt finds them
# in this Python); only the headers are used, so none of the wheel's own dependencies. A
# CPU-only build (DELTASTATE_CUDA=OFF) needs none of it.
if [ "${DELTASTATE_CUDA:-AUTO}" != OFF ]; then
  "$PY" -m pip install -q --no-deps "nvidia-cutlass==4.2.0.0"
fi

# --- C++ build and tests ------------------------------------------------------------------------
say "configure + build ($BUILD, CUDA: ${DELTASTATE_CUDA:-AUTO})"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DDELTASTATE_CUDA="${DELTASTATE_CUDA:-AUTO}" \
  -DDELTASTATE_CUDA_ALL_KERNELS="${DELTASTATE_CUDA_ALL_KERNELS:-OFF}" \
  -DPython3_EXECUTABLE="$PY" >/dev/null
cmake --build "$BUILD" -j "$JOBS"
say "C++ tests (ctest)"
ctest --test-dir "$BUILD" -j "$JOBS" --output-on-failure

# --- Python package: pip install . and pytest ----------------------------------------------------
if [ "${DELTASTATE_SKIP_TORCH:-0}" != 1 ] && ! "$PY" -c "import torch" 2>/dev/null; then
  say "installing torch (torch-CPU tests)"
  "$PY" -m pip install -q torch || echo "WARNING: torch could not be installed; the torch tests will be SKIPPED" >&2
fi
# The integration tests (python/tests/integrations, peer/test_fla_registry.py) need these, pinned
# to the versions they were written against; without them those tests skip, loudly.
if [ "${DELTASTATE_SKIP_TORCH:-0}" != 1 ] && "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "transformers==5.23.0" "fla-core==0.6.0" "einops==0.8.2" ||
    echo "WARNING: transformers / fla-core could not be installed; the integration tests will be SKIPPED" >&2
fi
say "pip install . (scikit-build-core over this CMake project; CUDA: ${DELTASTATE_CUDA:-AUTO})"
# pip is verbose only so that the compiler's progress lines ([n/N]) can be shown as they come.
set +o pipefail
SKBUILD_CMAKE_DEFINE="DELTASTATE_CUDA=${DELTASTATE_CUDA:-AUTO};DELTASTATE_CUDA_ALL_KERNELS=${DELTASTATE_CUDA_ALL_KERNELS:-OFF}" \
  "$PY" -m pip install -v --no-build-isolation . 2>&1 | tee "$BUILD/pip-install.log" |
  grep --line-buffered -E '^ *\[[0-9]+/[0-9]+\]|^Successfully installed' | cut -c1-120
rc=${PIPESTATUS[0]}
set -o pipefail
if [ "$rc" != 0 ]; then
  tail -n 60 "$BUILD/pip-install.log" >&2; echo "error: pip install . failed ($BUILD/pip-install.log)" >&2
  exit "$rc"
fi
say "Python tests (pytest)"
cd "$ROOT/python/tests" && "$PY" -m pytest -q -ra "$ROOT/python/tests"
