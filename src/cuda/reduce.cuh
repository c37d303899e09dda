// Shuffle reductions inside the G lanes of a row group: N partial sums reduced at once, each
// landing on a known lane (transpose_reduce, reduced_index, holder_lane).
#pragma once

namespace deltastate::cuda_backend {

// Combines N values (op: a sum, a max), each partial over the G lanes of a row group, with
// log2(G) shuffle stages that halve the number of values while N > 1 (N - 1 + log2(G/N) shuffles
// instead of N log2(G)). Lane `l` of the group ends with the full result of value
// (l >> log2(G/N)) & (N-1).
template <int G, int N, int C = N, class T, class Op>
__device__ __forceinline__ void halving_stages(T (&v)[N], int lane, Op op) {
  if constexpr (C > 1) {
    constexpr int d = G * C / (2 * N);  // the lane distance of this stage
    const bool upper = (lane & d) != 0;
#pragma unroll
    for (int i = 0; i < C / 2; ++i) {
      const T send = upper ? v[i] : v[i + C / 2];
      const T keep = upper ? v[i + C / 2] : v[i];
      v[i] = op(keep, __shfl_xor_sync(0xffffffffu, send, d));
    }
    halving_stages<G, N, C / 2>(v, lane, op);
  }
}
template <int G, int N, class T, class Op>
__device__ __forceinline__ T transpose_combine(T (&v)[N], int lane, Op op) {
  static_assert(N >= 1 && N <= G && (N & (N - 1)) == 0, "N must be a power of two <= G");
  halving_stages<G, N>(v, lane, op);
  T x = v[0];
#pragma unroll
  for (int d = G / N / 2; d > 0; d >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, d));
  return x;
}
// The sums (the dot products of the register kernels).
template <int G, int N>
__device__ __forceinline__ float transpose_reduce(float (&v)[N], int lane) {
  return transpose_combine<G, N>(v, lane, [](float a, float b) { return a + b; });
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
