#!/usr/bin/env bash
# Build the GPU machine's binaries on this machine and pack them for the device tool's `carry`:
# the Python module and the GPU test binary of a CUDA build (every kernel specialization unless
# ALL_KERNELS=OFF), stripped and xz-compressed (2026-12-07: 43 + 44 MB with every kernel, over
# the carry limit together, so the module and the test binary travel in separate calls; 22 +
# 22 MB with ALL_KERNELS=OFF) into $PREBUILT_OUT (default .devrun/prebuilt, ignored), with the
# commit and the state of the tree they were built from. From scratch about 25 minutes on this
# 2-core machine; a change to one CUDA unit rebuilds in 3-5. The carry limit is 64 MiB with the
# tree and the wheels (~9 MB).
# On the GPU machine `BUILD=.devrun/prebuilt scripts/device.sh prebuilt test-layer bench-layer`
# then unpacks them and skips the ~200 s build (docs/DEVICE.md). Needs nvcc, the Python whose
# apache-tvm-ffi matches the carried wheel (PYTHON) and GoogleTest's sources in .deps/googletest.
#
#   scripts/prebuild.sh     # env: PYTHON, SRC_BUILD (build-prebuilt), PREBUILT_OUT, ALL_KERNELS,
#                           # GTEST_SOURCE
set -euo pipefail
cd "$(dirname "$0")/.."
SRC_BUILD=${SRC_BUILD:-build-prebuilt}
OUT=${PREBUILT_OUT:-.devrun/prebuilt}
# The last set goes first: a failed build must not leave it behind to be carried as this one.
rm -rf "$OUT"
cmake -S . -B "$SRC_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDELTASTATE_CUDA=ON \
  -DDELTASTATE_CUDA_ALL_KERNELS="${ALL_KERNELS:-ON}" -DDELTASTATE_BUILD_PYTHON=ON \
  -DPython_EXECUTABLE="${PYTHON:-$(command -v python3)}" \
  -DDELTASTATE_GTEST_SOURCE="${GTEST_SOURCE:-$PWD/.deps/googletest}"
cmake --build "$SRC_BUILD" -j "$(nproc)" --target deltastate_python deltastate_gpu_tests
mkdir -p "$OUT/python" "$OUT/tests"
cp "$SRC_BUILD/python/_deltastate.so" "$OUT/python/"
cp "$SRC_BUILD/tests/deltastate_gpu_tests" "$OUT/tests/"
strip --strip-unneeded "$OUT/python/_deltastate.so" "$OUT/tests/deltastate_gpu_tests"
xz -T0 -3 "$OUT/python/_deltastate.so" "$OUT/tests/deltastate_gpu_tests"
{
  echo "built $(date -u +%FT%TZ), ALL_KERNELS=${ALL_KERNELS:-ON}, from:"
  git rev-parse HEAD
  git status --short
} > "$OUT/COMMIT"
du -sh "$OUT"
