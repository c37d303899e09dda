// Row-level helpers shared by the CPU kernels: load/store a run of elements as fp32 (converted in
// vector registers, cpu/simd.h), head offsets, and q/k preparation (L2 norm, scale) from the
// shared math.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/delta_math.h"
#include "cpu/simd.h"
#include "cpu/thread_pool.h"

namespace deltastate::cpu {

using detail::head_offset;
using detail::HeadInput;
using detail::HeadOutput;

// Load `n` consecutive elements starting at element offset `off` of a float tensor into fp32.
inline void load_row(const void* base, DType dtype, int64_t off, int n, float* dst) {
  simd::kernels().load(base, dtype, off, n, dst);
}

inline void store_row(void* base, DType dtype, int64_t off, int n, const float* src) {
  simd::kernels().store(base, dtype, off, n, src);
}

// Elements [off, off + n) of a tensor into L2 ahead of use: per-head rows of packed inputs lie a
// packed row (kilobytes) apart, too far for the hardware prefetchers. always_inline: GCC otherwise
// finds the function free of side effects and drops its calls.
[[gnu::always_inline]] inline void prefetch_row(const void* base, DType dtype, int64_t off, int n) {
  const char* a = static_cast<const char*>(base) + off * dtype_size(dtype);
  const int64_t bytes = n * dtype_size(dtype);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(a + b, 0, 2);
}

inline float dot(const float* a, const float* b, int n) { return simd::kernels().dot(a, b, n); }

// Normalize (optionally) and scale one q or k vector in place: the sum of squares is a dot
// product (simd.h's lane order), each element then divided by the one denominator (IEEE
// division, as the fp64 reference's form x / sqrt(sum x^2 + eps); simd.h's div_scale).
inline void prepare_qk(float* x, int n, bool l2norm, float scale) {
  const float den = l2norm ? detail::l2norm_denominator(dot(x, x, n)) : 1.0f;
  if (den != 1.0f || scale != 1.0f) simd::kernels().div_scale(x, den, scale, n);
}

// Row blocks per head for the decode kernels' (sequence, head, row block) tasks: enough tasks for
// every thread to get several (B = 1 included), blocks no thinner than 16 rows. The count changes
// speed only, never results: a row's arithmetic does not depend on its block.
inline int row_blocks(int64_t heads, int V) {
  const int64_t want = 4 * static_cast<int64_t>(num_threads());
  const int64_t most = std::max(1, V / 16);
  return static_cast<int>(std::clamp<int64_t>((want + heads - 1) / heads, 1, most));
}

// Log-space decay g of one (token, value head) into g_out[0..K) and, with alpha_out, the decay
// alpha = e^g into alpha_out[0..K): the K-vector for KDA, one value broadcast for GDN. `off` is
// the element offset of the gate input (g or raw a) of this head. The math is simd.h's `gate`
// (vector exp / softplus / sigmoid, the same bits on every ISA), so every CPU kernel that calls
// this gets the same gates. g_out may be null.
inline void gate_row(const detail::GateParams& gate, const void* in, DType in_dtype, int64_t off,
                     int hv, int K, float* g_out, float* alpha_out = nullptr) {
  const simd::Kernels& vk = simd::kernels();
  const float A_log = gate.A_log ? detail::load_float(gate.A_log, gate.A_log_dtype, hv) : 0.0f;
  const int count = gate.kda ? K : 1;
  constexpr int kChunk = 64;  // on the stack: no allocation per call
  float x[kChunk], dt[kChunk];
  for (int c = 0; c < count; c += kChunk) {
    const int n = std::min(kChunk, count - c);
    load_row(in, in_dtype, off + c, n, x);
    if (gate.dt_bias)
      load_row(gate.dt_bias, gate.dt_bias_dtype, gate.kda ? int64_t{hv} * K + c : hv, n, dt);
    vk.gate(gate.mode, x, gate.dt_bias ? dt : nullptr, A_log, gate.lower_bound, n,
            g_out ? g_out + c : nullptr, alpha_out ? alpha_out + c : nullptr);
  }
  if (gate.kda) return;
  if (g_out) std::fill(g_out + 1, g_out + K, g_out[0]);
  if (alpha_out) std::fill(alpha_out + 1, alpha_out + K, alpha_out[0]);
}

}  // namespace deltastate::cpu
