// What the GPU test files share: checked CUDA calls, the fixture that skips without a device, and
// device mirrors of host test tensors.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "test_util.h"

namespace dstest {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    cudaGetLastError();  // do not leave the error for the next call's cudaGetLastError
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(e) + " (" +
                             cudaGetErrorString(e) + ")");
  }
}
#define CUDA_CHECK(expr) check((expr), #expr)

// Waits for the device and surfaces any asynchronous kernel error.
inline void sync() {
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaGetLastError());
}

inline bool have_gpu() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" error
    return false;
  }
  return n > 0;
}

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)";
    ASSERT_TRUE(deltastate::cuda_available());
    ASSERT_EQ(cudaGetLastError(), cudaSuccess) << "a CUDA error left over from an earlier test";
  }
};
template <class P>
class GpuParamTest : public GpuTest, public ::testing::WithParamInterface<P> {};

// Device copies of host test tensors: one cudaMalloc'd buffer per host allocation, so aliases
// (q/k/v inside one packed buffer) stay aliases. Views keep the host layout, on cuda:0. Buffers are
// keyed by the host address; a tensor must be uploaded before its device view is used.
class Mirror {
 public:
  Mirror() = default;
  Mirror(const Mirror&) = delete;
  Mirror& operator=(const Mirror&) = delete;
  ~Mirror() {
    for (auto& [host, buf] : bufs_) EXPECT_EQ(cudaFree(buf.ptr), cudaSuccess);
  }
  TensorView view(const Tensor& t) { return t.view_at(buffer(t), Device::cuda(0)); }
  auto views() {
    return [this](const Tensor& t) { return view(t); };
  }
  void upload(const Tensor& t) {
    if (!t.alloc_base()) return;  // an absent optional tensor
    CUDA_CHECK(cudaMemcpy(buffer(t), t.alloc_base(), static_cast<size_t>(t.alloc_bytes()),
                          cudaMemcpyHostToDevice));
  }
  template <class... Ts>
  void upload_all(const Ts&... ts) {
    (upload(ts), ...);
  }
  // The device contents, in a new host tensor of the same layout.
  Tensor download(const Tensor& t) {
    Tensor h = t.empty_like();
    CUDA_CHECK(cudaMemcpy(h.alloc_base(), buffer(t), static_cast<size_t>(t.alloc_bytes()),
                          cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  struct Buf {
    void* ptr;
    int64_t bytes;
  };
  void* buffer(const Tensor& t) {
    auto it = bufs_.find(t.alloc_base());
    // A freed host allocation's address may come back for a new tensor of another size.
    if (it != bufs_.end() && it->second.bytes == t.alloc_bytes()) return it->second.ptr;
    if (it != bufs_.end()) {
      CUDA_CHECK(cudaFree(it->second.ptr));
      bufs_.erase(it);
    }
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(t.alloc_bytes(), 1))));
    bufs_[t.alloc_base()] = {p, t.alloc_bytes()};
    return p;
  }
  std::map<const void*, Buf> bufs_;
};

// Captures one `captured()` on `stream` into a CUDA graph, replays it `reps` times, synchronizes,
// frees the graph and reads the device's error record.
template <class Captured>
void replay_graph(cudaStream_t stream, int reps, Captured&& captured) {
  cudaGraph_t g;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  captured();
  CUDA_CHECK(cudaStreamEndCapture(stream, &g));
  CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  for (int i = 0; i < reps; ++i) CUDA_CHECK(cudaGraphLaunch(exec, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(g), cudaSuccess);
  deltastate::check_errors(stream);
}

// Whether two device buffers of `bytes` bytes hold the same bytes (a graph-replayed pool against
// its eagerly stepped twin).
inline ::testing::AssertionResult same_device_bytes(const void* a, const void* b, int64_t bytes) {
  std::vector<uint8_t> x(static_cast<size_t>(bytes)), y(x.size());
  CUDA_CHECK(cudaMemcpy(x.data(), a, x.size(), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(y.data(), b, y.size(), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < x.size(); ++i)
    if (x[i] != y[i])
      return ::testing::AssertionFailure()
             << "first difference at byte " << i << " of " << bytes << ": "
             << static_cast<int>(x[i]) << " vs " << static_cast<int>(y[i]);
  return ::testing::AssertionSuccess();
}

// Runs `step` `reps` times eagerly on the `eager` mirror, captures one `step` on the `graph`
// mirror into a CUDA graph and replays it `reps` times on `stream` (replay_graph): both mirrors
// then hold `reps` steps' results, for a byte-for-byte comparison.
template <class Step>
void run_eager_and_graph(Step&& step, Mirror& eager, Mirror& graph, cudaStream_t stream, int reps) {
  for (int i = 0; i < reps; ++i) step(eager);
  replay_graph(stream, reps, [&] { step(graph); });
}

// GPU vs CPU comparisons: each backend rounded its own fp32 result (tests/gpu/test_cuda_ops.cpp).
inline constexpr Tol kFp32StateTol{1e-5, 1e-4};
inline ::testing::AssertionResult close_vs_cpu(const std::vector<double>& gpu,
                                               const std::vector<double>& cpu, Tol tol,
                                               DType stored) {
  return all_close(gpu, cpu, tol, stored, /*rounded=*/2);
}

// A pool of `slots` slots of `slot_bytes` on the device, every byte the 0x7f pattern (the bytes
// no op may touch), freed on scope exit; `ok()` is false (nothing allocated) when the device
// lacks the memory and 2 GiB beside it, so the test can skip. For pools whose slot offsets pass
// 2^31 elements.
class PatternedDevicePool {
 public:
  PatternedDevicePool(int64_t slots, size_t slot_bytes) : slots_(slots), slot_bytes_(slot_bytes) {
    size_t free_b = 0, total_b = 0;
    check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    if (free_b < bytes() + (size_t{2} << 30)) return;
    check(cudaMalloc(&data_, bytes()), "cudaMalloc");
    check(cudaMemset(data_, 0x7f, bytes()), "cudaMemset");
  }
  ~PatternedDevicePool() {
    if (data_) {
      EXPECT_EQ(cudaFree(data_), cudaSuccess);
    }
  }
  PatternedDevicePool(const PatternedDevicePool&) = delete;
  PatternedDevicePool& operator=(const PatternedDevicePool&) = delete;
  bool ok() const { return data_ != nullptr; }
  size_t bytes() const { return static_cast<size_t>(slots_) * slot_bytes_; }
  void* slot(int64_t i) const { return static_cast<char*>(data_) + i * slot_bytes_; }
  // 8-byte words outside the `live` slots that no longer hold the pattern (128 slots a copy).
  int64_t changed_words(const std::vector<int64_t>& live) const {
    const int64_t per_copy = 128;
    std::vector<uint64_t> host(static_cast<size_t>(per_copy) * slot_bytes_ / 8);
    int64_t bad = 0;
    for (int64_t first = 0; first < slots_; first += per_copy) {
      const int64_t n = std::min(per_copy, slots_ - first);
      check(cudaMemcpy(host.data(), slot(first), n * slot_bytes_, cudaMemcpyDeviceToHost),
            "cudaMemcpy");
      for (int64_t i = 0; i < n; ++i) {
        if (std::find(live.begin(), live.end(), first + i) != live.end()) continue;
        const uint64_t* w = host.data() + i * slot_bytes_ / 8;
        for (size_t j = 0; j < slot_bytes_ / 8; ++j) bad += w[j] != 0x7f7f7f7f7f7f7f7fULL;
      }
    }
    return bad;
  }

 private:
  int64_t slots_;
  size_t slot_bytes_;
  void* data_ = nullptr;
};

}  // namespace dstest
