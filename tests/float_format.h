// Test-side storage formats: bfloat16 / float16 encode and decode with IEEE round-to-nearest-even,
// written independently of the library (src/core/numeric.h uses integer bit tricks; this uses
// frexp/ldexp and nearbyint on doubles). Used to round test inputs to their storage dtype, to read
// library outputs back, and by test_numeric as the second opinion on the library's conversions.
#pragma once

#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace dstest::fmt {

// An fp32 value from its bit pattern, and its bit pattern.
inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

struct Format {
  int mant_bits;  // explicit mantissa bits
  int exp_bits;
};
inline constexpr Format kBF16{7, 8};
inline constexpr Format kF16{10, 5};

inline int bias(Format f) { return (1 << (f.exp_bits - 1)) - 1; }

// Nearest representable value, ties to even; +-inf past the largest finite value.
inline uint16_t encode(double x, Format f) {
  const uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
  const uint16_t exp_all = static_cast<uint16_t>(((1u << f.exp_bits) - 1u) << f.mant_bits);
  if (std::isnan(x)) return sign | exp_all | static_cast<uint16_t>(1u << (f.mant_bits - 1));
  const double a = std::fabs(x);
  if (std::isinf(a)) return sign | exp_all;
  if (a == 0.0) return sign;
  const int emin = 1 - bias(f), emax = bias(f);
  int e2 = 0;
  std::frexp(a, &e2);
  const int E = e2 - 1;  // a in [2^E, 2^(E+1))
  const int quantum_exp = (E < emin ? emin : E) - f.mant_bits;
  // a / 2^quantum_exp is exact in double; nearbyint rounds ties to even in the default mode.
  const double n = std::nearbyint(std::ldexp(a, -quantum_exp));
  const double r = std::ldexp(n, quantum_exp);
  if (r >= std::ldexp(1.0, emax + 1)) return sign | exp_all;  // overflow: inf
  if (r < std::ldexp(1.0, emin)) {                            // subnormal (or rounded to zero)
    return sign | static_cast<uint16_t>(std::ldexp(r, f.mant_bits - emin));
  }
  int er = 0;
  std::frexp(r, &er);
  const int Er = er - 1;
  const auto mant = static_cast<uint32_t>(std::ldexp(r, f.mant_bits - Er)) - (1u << f.mant_bits);
  return sign | static_cast<uint16_t>((static_cast<uint32_t>(Er + bias(f)) << f.mant_bits) | mant);
}

inline double decode(uint16_t bits, Format f) {
  const bool neg = (bits & 0x8000u) != 0;
  const uint32_t e = (bits >> f.mant_bits) & ((1u << f.exp_bits) - 1u);
  const uint32_t m = bits & ((1u << f.mant_bits) - 1u);
  double v;
  if (e == (1u << f.exp_bits) - 1u) {
    v = m ? std::nan("") : INFINITY;
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), 1 - bias(f) - f.mant_bits);
  } else {
    v = std::ldexp(static_cast<double>(m + (1u << f.mant_bits)),
                   static_cast<int>(e) - bias(f) - f.mant_bits);
  }
  return neg ? -v : v;
}

inline uint16_t bf16_bits(double x) { return encode(x, kBF16); }
inline uint16_t f16_bits(double x) { return encode(x, kF16); }
inline double bf16_value(uint16_t b) { return decode(b, kBF16); }
inline double f16_value(uint16_t b) { return decode(b, kF16); }

}  // namespace dstest::fmt
