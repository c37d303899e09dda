// A state pool in its storage format (docs/STATE_FORMATS.md), element by element: the rules every
// CUDA kernel that reads or writes a formatted state applies (state_fmt.cuh's lane loops for the
// register kernels, the chunked prefill's state I/O directly):
// quantized states (float8_e4m3fn, int8 with one fp32 scale per (slot, head, V row)) loaded
// dequantized and stored with the row's fresh scale, and stochastically rounded 16-bit states,
// element by element through core/state_format.h's rules and bits (the CPU backend's,
// src/cpu/state_io.h).
//
// The caller computes a row's amax over the row's values (amax_step, in whatever threads hold
// them), then stores each element with the row's scale (fresh_scale). An element's stochastic
// bits are drawn at its index in the layer's [HV, V, K] state with the key of its slot, read from
// the pool's step counter (the call's step: the launcher advances the counter after its grids).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "core/numeric.h"
#include "core/problem.h"
#include "core/state_format.h"

namespace deltastate::cuda_backend::fmt {

using detail::StatePoolRef;

__host__ __device__ __forceinline__ bool quantized(DType t) {
  return t == DType::f8e4m3 || t == DType::i8;
}

// Where value head hv of pool slot `slot` lives for a formatted store or load, as run-time data
// (the out-of-line state I/O of the Hopper scan takes it by value): `off` the element offset of
// its first element in the pool, `scales` its V row scales (quantized; else null), `index0` the
// index of its first element in the layer's [HV, V, K] state, `key` the stochastic key of the
// slot (stochastic; else 0). Elements are addressed by their offset e in the head's [V, K].
struct HeadRows {
  int64_t off = 0;
  float* scales = nullptr;
  uint64_t index0 = 0;
  uint64_t key = 0;
  bool stochastic = false;
};

// The key's step is the counter's value (read here, on the device).
__device__ __forceinline__ HeadRows head_rows(const StatePoolRef& st, int64_t slot, int hv, int V,
                                              int K) {
  HeadRows h;
  h.off = slot * st.slot_stride + int64_t{hv} * V * K;
  if (quantized(st.dtype)) h.scales = st.scales + slot * st.scale_slot_stride + int64_t{hv} * V;
  h.index0 = static_cast<uint64_t>(int64_t{hv} * V * K);
  h.stochastic = st.stochastic;
  if (st.stochastic)
    h.key = detail::sr_key(st.seed, static_cast<uint64_t>(slot), st.layer,
                           static_cast<uint64_t>(*st.step));
  return h;
}

// The value of a quantized code (dtype f8e4m3 or i8) before its scale.
__device__ __forceinline__ float code_value(uint8_t c, DType t) {
  return t == DType::f8e4m3 ? detail::e4m3_to_float(c) : static_cast<float>(static_cast<int8_t>(c));
}

// Element e (in row `row`) of the head in pool `base` (dtype t), dequantized with its row's
// scale when quantized.
__device__ __forceinline__ float load_elem(const void* base, DType t, const HeadRows& h, int row,
                                           int64_t e) {
  if (h.scales) return code_value(static_cast<const uint8_t*>(base)[h.off + e], t) * h.scales[row];
  return detail::load_float(base, t, h.off + e);
}

// The code of y = x / scale in a quantized dtype t, to nearest or stochastically with the bits
// of (key, index).
__device__ __forceinline__ uint8_t encode_code(DType t, float y, bool stochastic, uint64_t key,
                                               uint64_t index) {
  const uint32_t U = stochastic ? detail::sr_bits(key, index) : 0u;
  return t == DType::f8e4m3 ? detail::float_to_e4m3(y, stochastic, U)
                            : static_cast<uint8_t>(detail::float_to_i8(y, stochastic, U));
}
// x stochastically rounded to bf16 or fp16 (t) with the bits of (key, index), as its bits.
__device__ __forceinline__ uint16_t round16_sr(DType t, float x, uint64_t key, uint64_t index) {
  const uint32_t U = detail::sr_bits(key, index);
  return t == DType::bf16 ? detail::float_to_bf16_sr(x, U) : detail::float_to_f16_sr(x, U);
}

// ---- four codes at once (a 4-byte word, code i in byte i) ---------------------------------------
// The same values and codes as code_value and encode_code, element by element, with the hardware
// conversions where they are exact equivalents of the rules: e4m3 -> f16 -> f32 is exact for every
// code (f16 holds all of e4m3's values; NaN stays NaN); cvt.rn.satfinite.e4m3x2.f32 rounds to
// nearest even and saturates to +-448 as float_to_e4m3 does, for every fp32 value but a NaN,
// which it encodes as 0x7f whatever its sign (tests/gpu/test_state_format_rules.cu). A NaN's sign
// is not kept on CUDA anyway: the y = x / scale before it is fp32 division, whose NaN is the
// positive canonical one.
// The codes of w as two f16x2 words, lo (codes 0, 1) and hi (codes 2, 3), each value exact
// (f16 holds every e4m3fn and int8 value): the tensor-core kernels' operands.
__device__ __forceinline__ void code_halves4(uint32_t w, DType t, uint32_t& lo, uint32_t& hi) {
  if (t == DType::f8e4m3) {
    const __half2_raw a =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w), __NV_E4M3);
    const __half2_raw b =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
    lo = static_cast<uint32_t>(a.x) | (static_cast<uint32_t>(a.y) << 16);
    hi = static_cast<uint32_t>(b.x) | (static_cast<uint32_t>(b.y) << 16);
  } else {
    const __half2 a = __floats2half2_rn(static_cast<float>(static_cast<int8_t>(w)),
                                        static_cast<float>(static_cast<int8_t>(w >> 8)));
    const __half2 b = __floats2half2_rn(static_cast<float>(static_cast<int8_t>(w >> 16)),
                                        static_cast<float>(static_cast<int8_t>(w >> 24)));
    lo = *reinterpret_cast<const uint32_t*>(&a);
    hi = *reinterpret_cast<const uint32_t*>(&b);
  }
}
__device__ __forceinline__ void code_values4(uint32_t w, DType t, float (&x)[4]) {
  if (t == DType::f8e4m3) {
    uint32_t h[2];
    code_halves4(w, t, h[0], h[1]);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h[i]));
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = static_cast<float>(static_cast<int8_t>(w >> (8 * i)));
  }
}

// The e4m3fn codes of y[0..3] to nearest (saturating) as one word: the hardware conversion.
__device__ __forceinline__ uint32_t e4m3_codes4(const float (&y)[4]) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(y[0], y[1]), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(y[2], y[3]), __NV_SATFINITE, __NV_E4M3);
  return (lo & 0xffffu) | (hi << 16);
}
// The codes of y[0..3] (already divided by the row's scale) as one word; stochastic: the four
// elements' bits from one draw where index0 is a multiple of 4 (the register kernels' lanes), and
// e4m3fn's dithered values (state_format.h e4m3_dithered) rounded by the hardware conversion as
// to nearest.
__device__ __forceinline__ uint32_t encode_codes4(DType t, const float (&y)[4], bool stochastic,
                                                  uint64_t key, uint64_t index0) {
  if (t == DType::f8e4m3 && !stochastic) return e4m3_codes4(y);
  if (stochastic && (index0 & 3u) == 0) {
    const uint64_t draw = detail::sr_draw(key, index0 >> 2);
    if (t == DType::f8e4m3) {
      float d[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        // (a NaN stays NaN through the dither: its sum is NaN and no comparison holds)
        const uint32_t u = __float_as_uint(y[i]);
        const float m = detail::e4m3_dithered(u & 0x7fffffffu, detail::sr_field(draw, i));
        d[i] = __uint_as_float(__float_as_uint(m) | (u & 0x80000000u));
      }
      return e4m3_codes4(d);
    }
    uint32_t w = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w |= static_cast<uint32_t>(
               static_cast<uint8_t>(detail::float_to_i8(y[i], true, detail::sr_field(draw, i))))
           << (8 * i);
    return w;
  }
  uint32_t w = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w |= static_cast<uint32_t>(encode_code(t, y[i], stochastic, key, index0 + i)) << (8 * i);
  return w;
}

// The row's scale from its amax (quantized pools).
__device__ __forceinline__ float fresh_scale(DType t, float amax) {
  return detail::row_scale(amax, t == DType::f8e4m3 ? detail::kE4m3Max : detail::kInt8Max);
}

// Element e of the head in pool `base` (dtype t) stored as x: quantized with its row's scale
// `s`, or a stochastically rounded 16-bit value, or converted to the dtype (nearest).
__device__ __forceinline__ void store_elem(void* base, DType t, const HeadRows& h, int64_t e,
                                           float x, float s) {
  const int64_t off = h.off + e;
  if (quantized(t)) {
    static_cast<uint8_t*>(base)[off] = encode_code(t, x / s, h.stochastic, h.key, h.index0 + e);
    return;
  }
  if (h.stochastic && (t == DType::bf16 || t == DType::f16)) {
    static_cast<uint16_t*>(base)[off] = round16_sr(t, x, h.key, h.index0 + e);
    return;
  }
  detail::store_float(base, t, off, x);
}

}  // namespace deltastate::cuda_backend::fmt
