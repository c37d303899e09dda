// Host side of the CUDA backend's launches: checked CUDA calls, the device guard, values cached
// per device (device queries, kernel attributes), the early-trigger choice of programmatic
// dependent launch, and launch_kernel, through which every kernel is launched.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>

#include "deltastate/error.h"
#include "deltastate/tensor.h"

namespace deltastate::cuda_backend {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorKind::runtime, std::string("CUDA error in ") + what + ": " +
                                        cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}
#define DS_CUDA_CHECK(expr) ::deltastate::cuda_backend::check_cuda((expr), #expr)

// Sets the current device for the scope (only when it differs: cudaSetDevice is not free).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    DS_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) DS_CUDA_CHECK(cudaSetDevice(device));
    else previous_ = -1;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
};

// Device queries, cached per device (src/cuda/memory.cu).
int num_sms(int device);
int max_smem_optin(int device);      // shared memory per block a kernel may opt in to
int compute_capability(int device);  // 10 * major + minor (90: Hopper)

// A value computed once per device and then cached (thread-safe). Kernel attributes such as the
// dynamic shared-memory opt-in are per device: a process driving several GPUs must set them on
// each, so a launcher keeps one of these per kernel instantiation. Launches read it on every
// call: a cached value is one atomic load, the mutex is taken only to compute it. Values are
// positive (0 marks "not yet"); device ordinals past kMaxDevices are computed on every call.
class PerDeviceOnce {
 public:
  template <class F>
  int get(int device, F&& compute) {
    if (device < 0 || device >= kMaxDevices) return compute();
    std::atomic<int>& value = values_[device];
    int v = value.load(std::memory_order_acquire);
    if (v > 0) return v;
    std::lock_guard<std::mutex> lk(mu_);
    v = value.load(std::memory_order_relaxed);
    if (v <= 0) {
      v = compute();
      value.store(v, std::memory_order_release);
    }
    return v;
  }

 private:
  static constexpr int kMaxDevices = 64;
  std::array<std::atomic<int>, kMaxDevices> values_{};
  std::mutex mu_;
};

// Whether a launch of `ctas` CTAs, at most `resident_per_sm` of them resident per SM, triggers the
// next PDL grid early (enter_grid): when it fills at most half of the GPU's CTA slots.
// DELTASTATE_CUDA_PDL_TRIGGER=1 (early) | 2 (at exit) forces it (benchmarks).
bool pdl_trigger_early(int64_t ctas, int resident_per_sm, int device);
// The problem as one launch passes it to its kernel: pdl_trigger_early set for that launch (only
// with pdl; without it the next grid is let in as this one's CTAs exit).
template <class Problem>
Problem with_pdl_trigger(Problem p, int64_t ctas, int resident_per_sm) {
  p.pdl_trigger_early = p.pdl && pdl_trigger_early(ctas, resident_per_sm, p.device.index);
  return p;
}

// Launches `kernel` on `stream`, with programmatic stream serialization when `pdl` (the grid may
// be scheduled while the stream's previous kernel is still running; enter_grid orders memory),
// and as clusters of `cluster_x` x 1 x 1 CTAs when cluster_x > 0 (sm_90 thread-block clusters;
// grid.x a multiple of it). Kernel parameters are passed by value, as with <<<...>>>.
template <class... Params, class... Args>
void launch_cluster_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                           cudaStream_t stream, bool pdl, unsigned cluster_x, Args&&... args) {
  cudaLaunchAttribute attr[2];
  unsigned num_attrs = 0;
  if (pdl) {
    attr[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[num_attrs].val.programmaticStreamSerializationAllowed = 1;
    ++num_attrs;
  }
  if (cluster_x > 0) {
    attr[num_attrs].id = cudaLaunchAttributeClusterDimension;
    attr[num_attrs].val.clusterDim.x = cluster_x;
    attr[num_attrs].val.clusterDim.y = 1;
    attr[num_attrs].val.clusterDim.z = 1;
    ++num_attrs;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = num_attrs > 0 ? attr : nullptr;
  config.numAttrs = num_attrs;
  DS_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                   cudaStream_t stream, bool pdl, Args&&... args) {
  launch_cluster_kernel(kernel, grid, block, smem_bytes, stream, pdl, 0u,
                        std::forward<Args>(args)...);
}

// Calls f(T{}) with T the device type of a state of `dtype` (__nv_bfloat16, __half, else float):
// the one switch from a state pool's dtype to the kernels' state type.
template <class F>
decltype(auto) with_state_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::bf16:
      return f(__nv_bfloat16{});
    case DType::f16:
      return f(__half{});
    default:
      return f(float{});
  }
}

}  // namespace deltastate::cuda_backend
