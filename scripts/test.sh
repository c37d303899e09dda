#!/usr/bin/env bash
# The test command: sets up what it needs on a fresh machine, builds, runs every test.
#
#   scripts/test.sh            C++ tests (CTest: GoogleTest suite + CLI), then the Python package
#                              installed with `pip install .` into .venv and its pytest suite
#
# Everything is compiled once, in one CMake tree ($BUILD): the library, the CUDA backend, the
# tests, the CLI and the Python module; `pip install .` then runs over that same tree
# (scripts/lib/package.sh) and only installs. Each phase's time is printed at the end.
#
# Needs: a C++20 compiler, CMake >= 3.25, Python >= 3.9 with venv, GoogleTest (Debian
# libgtest-dev; installed with apt when missing and possible). The CUDA backend is compiled when
# nvcc is found; CUDA tests skip without a GPU. Environment:
#   DELTASTATE_CUDA_ALL_KERNELS=ON   compile every specialized CUDA kernel (default OFF here:
#                                    the generic kernels only, to keep CPU-only builds short)
#   DELTASTATE_CUDA_PTX=ON|OFF       embed compute_90 PTX (default: ON where nvidia-smi finds a
#                                    GPU, else OFF: a third less CUDA compile for code nothing
#                                    here runs; the sm_90a code is compiled either way)
#   DELTASTATE_SKIP_TORCH=1          do not install torch (its tests are then skipped, loudly)
#   JOBS=N                           build parallelism (default: nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOBS=${JOBS:-$(nproc)}
BUILD=${BUILD:-build}
say() { printf '\n== %s\n' "$*"; }
# Phases with their wall times and the CPU time their processes used (user + system, all cores),
# printed at the end (and on failure): wall well above CPU / cores means waiting, for the network
# or for other processes on the same cores.
PHASES=()
times_file=${TMPDIR:-/tmp}/deltastate-test-times.$$
# CPU seconds of the finished child processes so far, into $cpu (`times` runs in this shell: a
# command substitution would see its own children only).
cpu_seconds() {
  times >"$times_file"
  cpu=$(awk 'NR == 2 { n = 0; for (i = 1; i <= 2; i++) { split($i, t, /[ms]/); n += t[1] * 60 + t[2] } printf "%d", n }' "$times_file")
}
cpu=0
phase_start=$SECONDS
phase_cpu=0
phase_name=
phase() {
  cpu_seconds
  if [ -n "$phase_name" ]; then
    PHASES+=("$(printf '%5ds wall %5ds CPU  %s' $((SECONDS - phase_start)) $((cpu - phase_cpu)) "$phase_name")")
  fi
  phase_name=$1
  phase_start=$SECONDS
  phase_cpu=$cpu
}
report_phases() {
  # A run that stops early leaves no background install behind.
  if [ -n "${torch_pid:-}" ] && kill -0 "$torch_pid" 2>/dev/null; then
    kill $(pgrep -P "$torch_pid") "$torch_pid" 2>/dev/null || true
  fi
  phase ""
  rm -f "$times_file"
  printf '\n== time per phase (total %ds wall, %ds CPU)\n' "$SECONDS" "$cpu"
  printf '%s\n' "${PHASES[@]}"
}
trap report_phases EXIT
source scripts/lib/package.sh
phase "setup: GoogleTest, .venv with the build's packages"

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
"$PY" -m pip install -q numpy pytest pytest-xdist apache-tvm-ffi scikit-build-core
# CUTLASS's CuTe headers for the CUDA backend's Hopper kernels, pinned (CMakeLists.txt finds them
# in this Python); only the headers are used, so none of the wheel's own dependencies. A
# CPU-only build (DELTASTATE_CUDA=OFF) needs none of it.
if [ "${DELTASTATE_CUDA:-AUTO}" != OFF ]; then
  "$PY" -m pip install -q --no-deps "nvidia-cutlass==4.2.0.0"
fi

# torch (PyPI's Linux wheel brings its CUDA libraries: ~5 GB in .venv) and the integration tests'
# packages download and unpack while the build compiles: the network and the disk, not the two
# cores the compilers need. Their own phase below only waits for them. --no-compile: Python
# byte-compiles the modules a test imports, not all of torch up front.
torch_pid=
if [ "${DELTASTATE_SKIP_TORCH:-0}" != 1 ]; then
  (
    if ! "$PY" -c "import torch" 2>/dev/null; then
      "$PY" -m pip install -q --no-compile torch || exit 1
    fi
    # The integration tests (python/tests/integrations, peer/test_fla_registry.py) need these,
    # pinned to the versions they were written against; without them those tests skip, loudly.
    "$PY" -m pip install -q --no-compile "transformers==5.23.0" "fla-core==0.6.0" "einops==0.8.2" || exit 2
  ) >"$VENV/torch-install.log" 2>&1 &
  torch_pid=$!
fi

# --- C++ build and tests ------------------------------------------------------------------------
phase "configure + build: library, CUDA backend, tests, CLI, Python module"
if [ -z "${DELTASTATE_CUDA_PTX:-}" ]; then
  DELTASTATE_CUDA_PTX=OFF
  if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then DELTASTATE_CUDA_PTX=ON; fi
fi
say "configure + build ($BUILD, CUDA: ${DELTASTATE_CUDA:-AUTO}, compute_90 PTX: $DELTASTATE_CUDA_PTX; the Python module too)"
use_generator_of "$BUILD"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DDELTASTATE_CUDA="${DELTASTATE_CUDA:-AUTO}" \
  -DDELTASTATE_CUDA_ALL_KERNELS="${DELTASTATE_CUDA_ALL_KERNELS:-OFF}" -DDELTASTATE_CUDA_PTX="$DELTASTATE_CUDA_PTX" \
  -DDELTASTATE_BUILD_TESTS=ON -DDELTASTATE_BUILD_TOOLS=ON -DDELTASTATE_BUILD_PYTHON=ON \
  -DPython3_EXECUTABLE="$PY" -DPython_EXECUTABLE="$PY" >/dev/null
cmake --build "$BUILD" -j "$JOBS" 2>&1 | tee "$BUILD/build.log"
# ptxas's spill warnings (-Xptxas=-warn-spills): every one must be a known one (docs/SPILLS.md).
scripts/spills.sh --check "$BUILD/build.log"
phase "C++ tests (ctest)"
say "C++ tests (ctest): CPU"
ctest --test-dir "$BUILD" -j "$JOBS" --output-on-failure -LE gpu | tee "$BUILD/ctest-cpu.log"
# A CPU test applies wherever it is registered: a skipped one is a case registered by mistake.
if grep -E '\*\*\*Skipped' "$BUILD/ctest-cpu.log"; then
  echo "error: the CPU tests above were skipped; register a test only where it applies" >&2
  exit 1
fi
if [ -x "$BUILD/tests/deltastate_gpu_tests" ]; then
  # The GPU suite (label gpu): without a device its tests skip, each with its reason in the log;
  # here one line says how many ran and how many skipped (scripts/device.sh runs it on a GPU).
  say "C++ tests (ctest): GPU"
  if ! ctest --test-dir "$BUILD" -j "$JOBS" --output-on-failure -L gpu >"$BUILD/ctest-gpu.log" 2>&1; then
    cat "$BUILD/ctest-gpu.log" >&2; echo "error: GPU tests failed ($BUILD/ctest-gpu.log)" >&2; exit 1
  fi
  gpu_total=$(sed -n 's/.*tests failed out of \([0-9]*\).*/\1/p' "$BUILD/ctest-gpu.log")
  gpu_skipped=$(grep -c '\*\*\*Skipped' "$BUILD/ctest-gpu.log" || true)
  summary="GPU tests (ctest -L gpu): $((gpu_total - gpu_skipped)) passed, $gpu_skipped skipped"
  if [ "$gpu_skipped" -gt 0 ]; then summary+=": they need a CUDA device, none usable here (each reason: $BUILD/ctest-gpu.log)"; fi
  echo "$summary"
fi

# --- Python package: pip install . and pytest ----------------------------------------------------
phase "setup: torch, transformers, fla-core, einops (the wait for the background install)"
if [ -n "$torch_pid" ]; then
  say "torch, transformers, fla-core, einops (installing since the build started; log: $VENV/torch-install.log)"
  torch_rc=0
  wait "$torch_pid" || torch_rc=$?
  if [ "$torch_rc" = 1 ]; then
    cat "$VENV/torch-install.log" >&2
    echo "WARNING: torch could not be installed; the torch tests will be SKIPPED" >&2
  elif [ "$torch_rc" != 0 ]; then
    cat "$VENV/torch-install.log" >&2
    echo "WARNING: transformers / fla-core could not be installed; the integration tests will be SKIPPED" >&2
  fi
fi
phase "pip install . (over $BUILD: nothing compiled again)"
say "pip install . (scikit-build-core over the CMake tree $BUILD; CUDA: ${DELTASTATE_CUDA:-AUTO})"
if ! install_package "$PY" "$BUILD" "${DELTASTATE_CUDA:-AUTO}" -v >"$BUILD/pip-install.log" 2>&1; then
  tail -n 60 "$BUILD/pip-install.log" >&2; echo "error: pip install . failed ($BUILD/pip-install.log)" >&2
  exit 1
fi
# Compiler lines in pip's log mean the tree's objects were not reused: the build would run twice.
if grep -E '^ *\[ *[0-9]+(/[0-9]+|%)\] Building' "$BUILD/pip-install.log"; then
  echo "error: pip install . compiled the lines above again over $BUILD ($BUILD/pip-install.log)" >&2
  exit 1
fi
grep '^Successfully installed' "$BUILD/pip-install.log"
"$VENV/bin/deltastate" --version  # pip installed the CLI too (on PATH in the environment)
phase "Python tests (pytest)"
say "Python tests (pytest)"
# On every core (pytest-xdist), with the slowest tests listed. A worker per core, each with one
# OpenMP thread (torch's and BLAS's intra-op pools; deltastate's own CPU pool is separate,
# DELTASTATE_NUM_THREADS): with a pool per worker the cores were oversubscribed and the spinning
# threads took 605 of the suite's CPU-seconds against 133 (2 cores, 2026-12-06), unless the
# caller chose OMP_NUM_THREADS.
workers=()
if "$PY" -c "import xdist" 2>/dev/null; then
  workers=(-n "$JOBS")
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
cd "$ROOT/python/tests" && "$PY" -m pytest -q -ra --durations=10 ${workers[@]+"${workers[@]}"} "$ROOT/python/tests"
