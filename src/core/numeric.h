// Scalar conversions between the storage dtypes and fp32, shared by the CPU and CUDA backends.
// Rounding is IEEE round-to-nearest-even in both directions, so both backends store the same bits
// for the same fp32 value.
#pragma once

#include <cstdint>
#include <cstring>

#include "deltastate/tensor.h"

#if defined(__CUDACC__)
#define DS_HD __host__ __device__ __forceinline__
#else
#define DS_HD inline
#endif

namespace deltastate::detail {

DS_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
DS_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

DS_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }
DS_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

DS_HD float f16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // subnormal: man * 2^-24
    float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

DS_HD uint16_t float_to_f16(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // nan
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (a < 0x38800000u) {                        // below the smallest normal: subnormal
    // value * 2^24, rounded to nearest even, as an integer mantissa
    uint32_t exp = a >> 23;
    if (exp < 102) return sign;  // < 2^-25: rounds to zero
    uint32_t man = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp;  // 14..24
    uint32_t half = 1u << (shift - 1);
    uint32_t rest = man & ((1u << shift) - 1);
    uint32_t r = man >> shift;
    if (rest > half || (rest == half && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  // normal: rebias exponent, round mantissa 23 -> 10 bits
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  r -= 0x38000000u;  // (127 - 15) << 23
  return sign | static_cast<uint16_t>(r >> 13);
}

// Load element i of a float tensor of dtype t as fp32.
DS_HD float load_float(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::bf16:
      return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::f16:
      return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}
// Store fp32 v into element i of a float tensor of dtype t, rounding to nearest even.
DS_HD void store_float(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::bf16:
      static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
      break;
    case DType::f16:
      static_cast<uint16_t*>(p)[i] = float_to_f16(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
      break;
  }
}
// Round fp32 v to dtype t and back (what storing then loading would give).
DS_HD float round_to(DType t, float v) {
  switch (t) {
    case DType::bf16:
      return bf16_to_float(float_to_bf16(v));
    case DType::f16:
      return f16_to_float(float_to_f16(v));
    default:
      return v;
  }
}
// Load element i of an int32/int64 tensor.
DS_HD int64_t load_index(const void* p, DType t, int64_t i) {
  return t == DType::i64 ? static_cast<const int64_t*>(p)[i]
                         : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// Store v as element i of an int32/int64 tensor.
DS_HD void store_index(void* p, DType t, int64_t i, int64_t v) {
  if (t == DType::i64) static_cast<int64_t*>(p)[i] = v;
  else static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
}

// n / d for 0 <= n, d < 2^15 without a division instruction (kernels that derive an index from
// the grid, such as the key head hv / (HV / H) of a value head): n * m >> 31 with
// m = ceil(2^31 / d), chosen once per launch on the host. Exact: the error term
// n * (m*d - 2^31) / (d * 2^31) is below n / 2^31 < 2^-16 < 1 / d, so it never carries the
// quotient past the next integer (tests/test_numeric.cpp checks every n for d < 4096 and sampled
// larger d).
struct SmallDivider {
  uint32_t m = 1u << 31;
  static SmallDivider of(int d) {
    SmallDivider s;
    s.m = static_cast<uint32_t>(((uint64_t{1} << 31) + static_cast<uint64_t>(d) - 1) /
                                static_cast<uint64_t>(d));
    return s;
  }
  DS_HD int divide(int n) const { return static_cast<int>((static_cast<uint64_t>(n) * m) >> 31); }
};

}  // namespace deltastate::detail
