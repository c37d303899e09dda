// The rounding rules of the recurrent-state storage formats, written once for the CPU and CUDA
// backends (docs/STATE_FORMATS.md; the numpy emulation they must agree with bit for bit is
// tools/state_accuracy.py):
//
//   float8_e4m3fn  one fp32 scale per (slot, head, V row), over the row's K elements:
//                  scale = amax / 448 (1 for an all-zero row); element code = e4m3fn(x / scale),
//                  saturating at +-448; x = decode(code) * scale.
//   int8           the same per-row scale with amax / 127; code = x / scale rounded, clipped to
//                  [-127, 127] (-128 is never stored).
//   nearest        round half to even.
//   stochastic     dithered nearest: |y| + u spacing(|y|) in fp32, u = (U + 1/2) 2^-16 - 1/2 (the
//                  spacing the format's in |y|'s binade; e4m3fn: not below that binade's floor),
//                  rounded to nearest even, then the sign. The sum is exact within |y|'s binade
//                  (e4m3fn from 2^-6, int8 below 2^7), so a value rounds up with probability
//                  frac(|y| / spacing) on the 2^-16 grid, and a kernel rounds with the hardware's
//                  nearest conversion. bf16: U added below the kept mantissa, then truncated; fp16:
//                  floor(|x| / spacing + U 2^-16), exactly. U of element e is 16-bit field e mod 4
//                  of draw e / 4 + 1 of the splitmix64 stream keyed by (seed, slot, layer, step), e
//                  the element's offset in the layer's [HV, V, K] state: one draw serves 4
//                  consecutive elements, and any element's bits are computed alone, so every
//                  backend and blocking gives the same bits.
//
// Non-finite values: a row whose amax is NaN or infinite gets a NaN scale and loads as NaN (a
// NaN is never hidden by a finite code; numpy's emulation leaves such a row undefined).
// torch's float8_e4m3fn conversion agrees bit for bit for |x| < 480; above it, torch gives NaN
// and this rule saturates at 448 (a scaled state row never exceeds 448 by more than rounding).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/numeric.h"

namespace deltastate::detail {

constexpr float kE4m3Max = 448.0f;
constexpr float kInt8Max = 127.0f;

// ---- the counter-based generator (splitmix64) --------------------------------------------------
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// splitmix64's finalizer (Stafford's mix13).
DS_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// The key of (seed, slot, layer, step): each field folded in with one mix (state_accuracy.sr_key).
DS_HD uint64_t sr_key(uint64_t seed, uint64_t slot, uint64_t layer, uint64_t step) {
  uint64_t z = mix64(seed ^ kGolden);
  z = mix64(z ^ slot);
  z = mix64(z ^ layer);
  return mix64(z ^ step);
}
// The key's slot field of entry `entry` of a quantized verify scratch (its index row * T_alloc +
// step in the scratch's [N_scr, T_alloc] entries): the complement 2^64 - 1 - entry, so that a
// scratch entry never shares a pool slot's bits (a pool slot is < 2^63). The other fields are the
// pool's (seed, layer, step): a scratch is rounded as its pool is.
DS_HD uint64_t scratch_key_slot(int64_t entry) { return ~static_cast<uint64_t>(entry); }
// The 64 random bits of draw g + 1 of the splitmix64 stream seeded with key: the bits of elements
// 4 g .. 4 g + 3 (state_accuracy.sr_draw).
DS_HD uint64_t sr_draw(uint64_t key, uint64_t g) { return mix64(key + (g + 1) * kGolden); }
// The 16-bit uniform integer U of element `index` (its offset in the layer's [HV, V, K] state):
// field index mod 4 of draw index / 4 (state_accuracy.sr_bits).
DS_HD uint32_t sr_field(uint64_t draw, uint64_t index) {
  return static_cast<uint32_t>(draw >> (16 * (index & 3u))) & 0xffffu;
}
DS_HD uint32_t sr_bits(uint64_t key, uint64_t index) {
  return sr_field(sr_draw(key, index >> 2), index);
}
// The dither ((U + 1/2) 2^-16 - 1/2) q for a power-of-two spacing q: symmetric, never +-q/2, so
// an exact value is never moved onto a tie (exact: U has 16 bits).
DS_HD float sr_dither(uint32_t U, float q) {
  return (static_cast<float>(2 * U + 1) * 7.62939453125e-06f - 0.5f) * q;
}

// floor(y + U * 2^-24) for fp32 y and U < 2^24, exactly (what numpy computes in fp64), in fp32:
// with y = f + r (f = floor, r in [0, 1), both exact), the sum reaches f + 1 iff r * 2^24 >= 2^24
// - U; both sides are exact fp32 values. Negative y: -(floor(a) + (frac(a) > u)) with a = -y.
// (fp16's stochastic rounding, with U = 16 random bits << 8.)
DS_HD float floor_plus_uniform(float y, uint32_t U) {
  if (y >= 0.0f) {
    const float f = floorf(y);
    const float r = (y - f) * 16777216.0f;
    return r >= static_cast<float>(16777216u - U) ? f + 1.0f : f;
  }
  const float a = -y;
  const float f = floorf(a);
  const float r = (a - f) * 16777216.0f;
  return -(r > static_cast<float>(U) ? f + 1.0f : f);
}

// ---- e4m3fn ------------------------------------------------------------------------------------
// The value of an e4m3fn code (0x7f / 0xff: NaN).
DS_HD float e4m3_to_float(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
  if (e == 15u && m == 7u) return bits_float(sign | 0x7fc00000u);
  if (e == 0u) {  // subnormal: m * 2^-9
    const float v = static_cast<float>(m) * 0.001953125f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((e + 120u) << 23) | (m << 20));
}

// The spacing of e4m3fn values in the binade of |x| (2^-9 below 2^-6): x's exponent field, at
// least 2^-6's, less the 3 mantissa bits.
DS_HD float e4m3_spacing(uint32_t abs_bits) {
  uint32_t e = abs_bits & 0x7f800000u;
  if (e < (121u << 23)) e = 121u << 23;
  return bits_float(e - (3u << 23));
}

// The code of a non-negative e4m3fn value v (0 <= v <= 448, v representable).
DS_HD uint8_t e4m3_code_of(float v) {
  if (v < 0.015625f) return static_cast<uint8_t>(v * 512.0f);  // subnormals: v / 2^-9
  const uint32_t b = float_bits(v);
  return static_cast<uint8_t>((((b >> 23) - 120u) << 3) | ((b >> 20) & 7u));
}

// |y| dithered for stochastic e4m3fn rounding (abs_bits: |y|'s bits): |y| + sr_dither(U,
// spacing), then not below the binade's floor 2^e (|y| >= 2^-6; below, the spacing is 2^-9 down
// to zero and the floor 0), where nearest rounding would take the finer spacing of the binade
// below. Nearest rounding of the result, saturating, is the stochastic rounding of |y| (an
// infinity stays infinite and saturates, a NaN stays NaN; a sum past the binade's top rounds in
// fp32, but cannot reach the next binade's first midpoint).
DS_HD float e4m3_dithered(uint32_t abs_bits, uint32_t U) {
  const float q = e4m3_spacing(abs_bits);
  const float y = bits_float(abs_bits) + sr_dither(U, q);
  const float floor = abs_bits >= (121u << 23) ? bits_float(abs_bits & 0x7f800000u) : 0.0f;
  return y < floor ? floor : y;
}

// x rounded to e4m3fn: nearest even (stochastic = false) or dithered nearest with the 16-bit U
// (e4m3_dithered), saturating at 448 (infinities too); NaN gives 0x7f; the sign is kept (-0 too).
DS_HD uint8_t float_to_e4m3(float x, bool stochastic = false, uint32_t U = 0) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7fu;
  if (stochastic) a = float_bits(e4m3_dithered(a, U));
  const float q = e4m3_spacing(a);
  // |x| / q, exactly: q is a power of two (2^-9 to 2^125), so its reciprocal is one too, exact
  // and normal (bits (254 << 23) - q's), and the product rounds nothing a division would.
  const float t = bits_float(a) * bits_float((254u << 23) - float_bits(q));
  const float v = fminf(rintf(t) * q, kE4m3Max);
  return sign | e4m3_code_of(v);
}

// ---- int8 --------------------------------------------------------------------------------------
// y (already divided by the scale) rounded to an int8 code in [-127, 127]: nearest even, or
// dithered nearest (y + sr_dither(U, 1), exact for |y| < 2^7); NaN gives 0 (its row's scale is NaN,
// so it loads as NaN anyway).
DS_HD int8_t float_to_i8(float y, bool stochastic = false, uint32_t U = 0) {
  float r = rintf(stochastic ? y + sr_dither(U, 1.0f) : y);
  r = fminf(fmaxf(r, -kInt8Max), kInt8Max);  // fmaxf / fminf drop a NaN r: 127 or -127
  return y != y ? int8_t{0} : static_cast<int8_t>(r);
}

// ---- the per-row scale -------------------------------------------------------------------------
// Running amax that keeps a NaN (fmaxf would drop it).
DS_HD float amax_step(float m, float x) {
  const float a = fabsf(x);
  return (a > m || a != a) ? a : m;
}
// scale = amax / qmax, 1 for an all-zero row, NaN for a non-finite amax (see the top).
DS_HD float row_scale(float amax, float qmax) {
  if (!(amax < INFINITY)) return bits_float(0x7fc00000u);
  const float s = amax / qmax;
  return s > 0.0f ? s : 1.0f;
}

// ---- bf16 / fp16 stochastic --------------------------------------------------------------------
// bf16: the 16 random bits U added below the kept mantissa, then truncated (NaN stays quiet NaN; a
// finite value may round up to infinity, as the numpy emulation does).
DS_HD uint16_t float_to_bf16_sr(float f, uint32_t U) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  if ((u & 0x7fffffffu) == 0x7f800000u) return static_cast<uint16_t>(u >> 16);
  return static_cast<uint16_t>((u + U) >> 16);
}
// fp16: floor(|x| / spacing + U 2^-16) with fp16's spacing (2^-24 below 2^-14), then the exact
// conversion (a result past 65504 becomes infinity, as nearest rounding's would).
DS_HD uint16_t float_to_f16_sr(float f, uint32_t U) {
  const uint32_t u = float_bits(f);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return float_to_f16(f);
  uint32_t e = a & 0x7f800000u;
  if (e < (113u << 23)) e = 113u << 23;  // 2^-14
  const float q = bits_float(e - (10u << 23));
  const float r = floor_plus_uniform(bits_float(a) / q, U << 8) * q;
  return float_to_f16((u >> 31) ? -r : r);
}

// ---- rounding of a stored state ---------------------------------------------------------------
enum class Rounding : uint8_t { nearest, stochastic };

// Where a stochastic store draws its bits: the key's fields less the slot, and the counter the
// ops advance once per call (the step of the key is the counter's value before the call).
struct StochasticKey {
  uint64_t seed = 0;
  uint64_t layer = 0;
};

}  // namespace deltastate::detail
