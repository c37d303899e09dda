// Loading and storing rows of a V-first state pool in its storage format (CPU): fp32 / bf16 / fp16
// through the vector converters, quantized states (float8_e4m3fn, int8) dequantized on load and
// requantized on store with a fresh per-row scale, stochastic rounding keyed per element. The
// rounding rules are core/state_format.h's, shared with the CUDA backend.
#pragma once

#include <cstdint>

#include "core/problem.h"
#include "core/state_format.h"
#include "cpu/row_io.h"

namespace deltastate::cpu {

// How one call stores a state: the key's step (read once per call) completes
// (seed, slot, layer, step); key_of gives a slot's key.
struct StoreRounding {
  bool stochastic = false;
  uint64_t seed = 0, layer = 0, step = 0;
  uint64_t key_of(int64_t slot) const {
    return detail::sr_key(seed, static_cast<uint64_t>(slot), layer, step);
  }
};
inline StoreRounding store_rounding(const detail::StatePoolRef& st) {
  StoreRounding r;
  r.stochastic = st.stochastic;
  if (st.stochastic) {
    r.seed = st.seed;
    r.layer = st.layer;
    r.step = static_cast<uint64_t>(*st.step);
  }
  return r;
}
// After the call's stores: the counter advances once.
inline void advance_step(const detail::StatePoolRef& st) {
  if (st.stochastic) ++*st.step;
}

// One quantized row: x[0..K) stored as `codes` (dtype f8e4m3 or i8) with its scale; element e's
// random bits are sr_bits(key, index0 + e) (a draw per 4 elements).
inline void quantize_row(const float* x, int K, DType dtype, bool stochastic, uint64_t key,
                         uint64_t index0, void* codes, float* scale) {
  float amax = 0.0f;
  for (int e = 0; e < K; ++e) amax = detail::amax_step(amax, x[e]);
  const bool fp8 = dtype == DType::f8e4m3;
  const float s = detail::row_scale(amax, fp8 ? detail::kE4m3Max : detail::kInt8Max);
  *scale = s;
  uint64_t draw = 0;
  for (int e = 0; e < K; ++e) {
    const uint64_t index = index0 + static_cast<uint64_t>(e);
    if (stochastic && (e == 0 || (index & 3u) == 0)) draw = detail::sr_draw(key, index >> 2);
    const uint32_t U = stochastic ? detail::sr_field(draw, index) : 0u;
    const float y = x[e] / s;
    if (fp8) static_cast<uint8_t*>(codes)[e] = detail::float_to_e4m3(y, stochastic, U);
    else static_cast<int8_t*>(codes)[e] = detail::float_to_i8(y, stochastic, U);
  }
}

inline void dequantize_row(const void* codes, DType dtype, float scale, int K, float* x) {
  if (dtype == DType::f8e4m3) {
    const uint8_t* c = static_cast<const uint8_t*>(codes);
    for (int e = 0; e < K; ++e) x[e] = detail::e4m3_to_float(c[e]) * scale;
  } else {
    const int8_t* c = static_cast<const int8_t*>(codes);
    for (int e = 0; e < K; ++e) x[e] = static_cast<float>(c[e]) * scale;
  }
}

// Rows [r0, r0 + rows) of value head hv of `slot` (V-first) into S (rows x K fp32).
inline void load_state_rows(const detail::StatePoolRef& st, int64_t slot, int hv, int V, int K,
                            int r0, int rows, float* S) {
  const int64_t row0 = static_cast<int64_t>(hv) * V + r0;  // the first row's index in [HV, V]
  const int64_t off = slot * st.slot_stride + row0 * K;
  if (!is_quantized(st.dtype)) {
    load_row(st.ptr, st.dtype, off, rows * K, S);
    return;
  }
  const char* codes = static_cast<const char*>(st.ptr) + off;
  const float* scales = st.scales + slot * st.scale_slot_stride + row0;
  for (int r = 0; r < rows; ++r)
    dequantize_row(codes + static_cast<int64_t>(r) * K, st.dtype, scales[r], K,
                   S + static_cast<int64_t>(r) * K);
}

// S (rows x K fp32) into rows [r0, r0 + rows) of value head hv of `slot`, rounded per the pool's
// format; `key`: rnd.key_of(slot) (unused when rounding to nearest).
inline void store_state_rows(const detail::StatePoolRef& st, const StoreRounding& rnd, uint64_t key,
                             int64_t slot, int hv, int V, int K, int r0, int rows, const float* S) {
  const int64_t row0 = static_cast<int64_t>(hv) * V + r0;
  const int64_t off = slot * st.slot_stride + row0 * K;
  if (is_quantized(st.dtype)) {
    char* codes = static_cast<char*>(st.ptr) + off;
    float* scales = st.scales + slot * st.scale_slot_stride + row0;
    for (int r = 0; r < rows; ++r)
      quantize_row(S + static_cast<int64_t>(r) * K, K, st.dtype, rnd.stochastic, key,
                   static_cast<uint64_t>((row0 + r) * K), codes + static_cast<int64_t>(r) * K,
                   scales + r);
    return;
  }
  if (!rnd.stochastic) {
    store_row(st.ptr, st.dtype, off, rows * K, S);
    return;
  }
  // bf16 / fp16, stochastic: element e of the block is element (row0 * K + e) of the layer.
  uint16_t* dst = static_cast<uint16_t*>(st.ptr) + off;
  const int64_t n = static_cast<int64_t>(rows) * K;
  uint64_t draw = 0;
  for (int64_t e = 0; e < n; ++e) {
    const uint64_t index = static_cast<uint64_t>(row0 * K + e);
    if (e == 0 || (index & 3u) == 0) draw = detail::sr_draw(key, index >> 2);
    const uint32_t U = detail::sr_field(draw, index);
    dst[e] = st.dtype == DType::bf16 ? detail::float_to_bf16_sr(S[e], U)
                                     : detail::float_to_f16_sr(S[e], U);
  }
}

}  // namespace deltastate::cpu
