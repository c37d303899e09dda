// Host helpers of the CUDA micro-benchmarks in bench/ (stream_trace, bulk_copy_bench): a checked
// CUDA call and the median event-timed time of a launch.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace bench {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Median microseconds of launch(r) for r = 0 .. reps-1 (reps >= 1), each between two events on
// `stream`, after `warmups` untimed launch(0).
template <class F>
double median_us(F&& launch, int reps, int warmups = 1, cudaStream_t stream = nullptr) {
  for (int w = 0; w < warmups; ++w) launch(0);
  check(cudaGetLastError(), "launch");
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    check(cudaEventRecord(a, stream), "cudaEventRecord");
    launch(r);
    check(cudaEventRecord(b, stream), "cudaEventRecord");
    check(cudaEventSynchronize(b), "timed launch");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    t.push_back(ms * 1e3f);
  }
  check(cudaEventDestroy(a), "cudaEventDestroy");
  check(cudaEventDestroy(b), "cudaEventDestroy");
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace bench
