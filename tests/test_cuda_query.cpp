// The build and device queries (ops.h): cuda_built() says whether the CUDA backend was compiled
// in, cuda_available() whether a device can run it. This suite runs on every machine and build:
// a device implies the backend, and a build without the backend has no device to offer. The GPU
// test binary compares cuda_available() with its own cudaGetDeviceCount (gpu/test_cuda_query.cpp).
#include <gtest/gtest.h>

#include "deltastate/ops.h"

#ifndef DELTASTATE_TEST_CUDA_BUILT
#error "tests/CMakeLists.txt defines DELTASTATE_TEST_CUDA_BUILT (0 or 1) for this file"
#endif

namespace {

TEST(CudaQuery, AvailableImpliesBuilt) {
  bool built = false, available = false;
  EXPECT_NO_THROW(built = deltastate::cuda_built());
  EXPECT_NO_THROW(available = deltastate::cuda_available());
  EXPECT_EQ(built, DELTASTATE_TEST_CUDA_BUILT != 0) << "cuda_built() is the configuration";
  if (available) {
    EXPECT_TRUE(built);
  }
  if (!built) {
    EXPECT_FALSE(available) << "a CPU-only build cannot run on a device";
  }
  EXPECT_EQ(deltastate::cuda_available(), available) << "the same answer every time";
}

// check_errors before any CUDA op (the CPU suite never launches one): nothing to report, no
// CUDA call made (it must not fail on a machine without a driver), on any build.
TEST(CudaQuery, CheckErrorsBeforeAnyCudaOpIsANoOp) {
  EXPECT_NO_THROW(deltastate::check_errors());
  EXPECT_NO_THROW(deltastate::check_errors(nullptr));
}

}  // namespace
