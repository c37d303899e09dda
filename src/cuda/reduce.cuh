// Shuffle reductions inside the G lanes of a row group: N partial sums reduced at once, each
// landing on a known lane (transpose_reduce, reduced_index, holder_lane).
#pragma once

namespace deltastate::cuda_backend {

// Sums N values, each partial over the G lanes of a row group, with log2(G) shuffle stages that
// halve the number of values while N > 1 (N - 1 + log2(G/N) shuffles instead of N log2(G)). Lane
// `l` of the group ends with the full sum of value (l >> log2(G/N)) & (N-1).
template <int G, int N, int C = N>
__device__ __forceinline__ void halving_stages(float (&v)[N], int lane) {
  if constexpr (C > 1) {
    constexpr int d = G * C / (2 * N);  // the lane distance of this stage
    const bool upper = (lane & d) != 0;
#pragma unroll
    for (int i = 0; i < C / 2; ++i) {
      const float send = upper ? v[i] : v[i + C / 2];
      const float keep = upper ? v[i + C / 2] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, d);
    }
    halving_stages<G, N, C / 2>(v, lane);
  }
}
template <int G, int N>
__device__ __forceinline__ float transpose_reduce(float (&v)[N], int lane) {
  static_assert(N >= 1 && N <= G && (N & (N - 1)) == 0, "N must be a power of two <= G");
  halving_stages<G, N>(v, lane);
  float x = v[0];
#pragma unroll
  for (int d = G / N / 2; d > 0; d >>= 1) x += __shfl_xor_sync(0xffffffffu, x, d);
  return x;
}
template <int G, int N>
__device__ __forceinline__ int reduced_index(int lane) {
  constexpr int kShift = __builtin_ctz(G / N);
  return (lane >> kShift) & (N - 1);
}
// Lane (within its group of G) that holds value `idx` after transpose_reduce<G, N>.
template <int G, int N>
__device__ __forceinline__ int holder_lane(int idx) {
  return idx << __builtin_ctz(G / N);
}

}  // namespace deltastate::cuda_backend
