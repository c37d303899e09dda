// cuda_available() against an independent cudaGetDeviceCount, on any machine: true exactly when the
// CUDA runtime reports a device (false, not an error, on a machine without a GPU or driver, and
// with CUDA_VISIBLE_DEVICES empty: the ctest `CudaQuery.NoVisibleDevices` runs this file so), while
// cuda_built() is true in this CUDA build whatever the machine. Not a GpuTest: it never skips.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "deltastate/ops.h"

namespace {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

TEST(CudaQuery, AvailableMatchesTheDeviceCount) {
  EXPECT_TRUE(deltastate::cuda_built());
  bool available = true;
  EXPECT_NO_THROW(available = deltastate::cuda_available());
  EXPECT_EQ(available, device_count() > 0) << "cudaGetDeviceCount reports " << device_count();
  // With a device, the query leaves no error for the next op's cudaGetLastError. (Without a
  // driver the runtime reports its initialization error again on every call; nothing to check.)
  if (available) {
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the query leaves no CUDA error behind";
  }
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible && !*visible) {
    EXPECT_FALSE(available) << "CUDA_VISIBLE_DEVICES is empty";
  }
}

}  // namespace
