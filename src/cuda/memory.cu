// The CUDA backend's memory services for the state pool, and device queries.
#include <mutex>
#include <vector>

#include "api/backend.h"
#include "cuda/common.cuh"

namespace deltastate::cuda_backend {

bool built() { return true; }

int num_sms(int device) {
  static PerDeviceOnce sms;
  return sms.get(device, [device] {
    int n = 0;
    DS_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return n;
  });
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
  DS_CUDA_CHECK(cudaMemset2DAsync(ptr, pitch, value, row_bytes, rows, static_cast<cudaStream_t>(stream)));
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
