// Row-level helpers shared by the CPU kernels: load/store a run of elements as fp32, head
// offsets, and q/k preparation (L2 norm, scale) from the shared math.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/delta_math.h"

namespace deltastate::cpu {

using detail::head_offset;
using detail::HeadInput;
using detail::HeadOutput;

// Load `n` consecutive elements starting at element offset `off` of a float tensor into fp32.
inline void load_row(const void* base, DType dtype, int64_t off, int n, float* dst) {
  if (dtype == DType::f32) {
    std::copy_n(static_cast<const float*>(base) + off, n, dst);
    return;
  }
  for (int i = 0; i < n; ++i) dst[i] = detail::load_float(base, dtype, off + i);
}

inline void store_row(void* base, DType dtype, int64_t off, int n, const float* src) {
  if (dtype == DType::f32) {
    std::copy_n(src, n, static_cast<float*>(base) + off);
    return;
  }
  for (int i = 0; i < n; ++i) detail::store_float(base, dtype, off + i, src[i]);
}

// Normalize (optionally) and scale one q or k vector in place.
inline void prepare_qk(float* x, int n, bool l2norm, float scale) {
  if (l2norm) {
    float ss = 0.0f;
    for (int i = 0; i < n; ++i) ss += x[i] * x[i];
    const float den = detail::l2norm_denominator(ss);
    for (int i = 0; i < n; ++i) x[i] = x[i] / den;
  }
  if (scale != 1.0f)
    for (int i = 0; i < n; ++i) x[i] *= scale;
}

inline float dot(const float* a, const float* b, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Log-space decay g of one (token, value head) into g_out[0..K): the K-vector for KDA, one value
// broadcast for GDN. `off` is the element offset of the gate input (g or raw a) of this head.
inline void gate_row(const detail::GateParams& gate, const void* in, DType in_dtype, int64_t off,
                     int hv, int K, float* g_out) {
  const float A_log = gate.A_log ? detail::load_float(gate.A_log, gate.A_log_dtype, hv) : 0.0f;
  const int count = gate.kda ? K : 1;
  for (int i = 0; i < count; ++i) {
    const int64_t dt_index = gate.kda ? static_cast<int64_t>(hv) * K + i : hv;
    const float dt =
        gate.dt_bias ? detail::load_float(gate.dt_bias, gate.dt_bias_dtype, dt_index) : 0.0f;
    g_out[i] = detail::gate_value(gate.mode, detail::load_float(in, in_dtype, off + i), dt, A_log,
                                  gate.lower_bound);
  }
  if (!gate.kda) std::fill(g_out + 1, g_out + K, g_out[0]);
}

}  // namespace deltastate::cpu
