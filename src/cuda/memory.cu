// The CUDA backend's memory services for the state pool, and device queries.
#include <mutex>
#include <vector>

#include "api/backend.h"
#include "cuda/launch.h"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

bool built() { return true; }

bool device_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear the error, do not leave it for the ops
    return false;
  }
  return n > 0;
}

namespace {
// A device attribute, queried once per device (one atomic load afterwards).
template <cudaDeviceAttr A>
int cached_attribute(int device) {
  static PerDeviceOnce value;
  return value.get(device, [device] {
    int n = 0;
    DS_CUDA_CHECK(cudaDeviceGetAttribute(&n, A, device));
    return n;
  });
}
}  // namespace

int num_sms(int device) { return cached_attribute<cudaDevAttrMultiProcessorCount>(device); }
int max_smem_optin(int device) {
  return cached_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device);
}
int compute_capability(int device) {
  return 10 * cached_attribute<cudaDevAttrComputeCapabilityMajor>(device) +
         cached_attribute<cudaDevAttrComputeCapabilityMinor>(device);
}

bool pdl_trigger_early(int64_t ctas, int resident_per_sm, int device) {
  if (const int forced = forced_pdl_trigger()) return forced == 1;
  return pdl_trigger_fits(ctas, static_cast<int64_t>(resident_per_sm) * num_sms(device));
}

void* device_alloc(size_t bytes, int device) {
  DeviceGuard guard(device);
  void* p = nullptr;
  DS_CUDA_CHECK(cudaMalloc(&p, bytes));
  DS_CUDA_CHECK(cudaMemset(p, 0, bytes));
  DS_CUDA_CHECK(cudaDeviceSynchronize());
  return p;
}

void device_free(void* ptr, int device) noexcept {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) return;
  cudaSetDevice(device);
  cudaFree(ptr);
  cudaSetDevice(previous);
}

void memset_2d_async(void* ptr, size_t pitch, int value, size_t row_bytes, size_t rows, int device,
                     void* stream) {
  DeviceGuard guard(device);
  DS_CUDA_CHECK(
      cudaMemset2DAsync(ptr, pitch, value, row_bytes, rows, static_cast<cudaStream_t>(stream)));
}

void copy_2d_async(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                   size_t rows, int device, void* stream) {
  DeviceGuard guard(device);
  DS_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows,
                                  cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
}

void copy_to_host(void* dst, const void* src, size_t bytes, int device, void* stream) {
  DeviceGuard guard(device);
  auto s = static_cast<cudaStream_t>(stream);
  DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  DS_CUDA_CHECK(cudaStreamSynchronize(s));
}

void copy_to_device(void* dst, const void* src, size_t bytes, int device, void* stream) {
  DeviceGuard guard(device);
  auto s = static_cast<cudaStream_t>(stream);
  DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
  DS_CUDA_CHECK(cudaStreamSynchronize(s));
}

}  // namespace deltastate::cuda_backend
