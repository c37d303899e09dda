// The library's scalar conversions (src/core/numeric.h): bf16 / fp16 <-> fp32 with round to
// nearest even, against hand-computed bit patterns (ties, subnormals, overflow to inf, NaN), then
// against the test tree's independent encoder (tests/float_format.h) on many random fp32 values
// and every 16-bit pattern; and the division the CUDA kernels use for the QK L2 norm
// (core/delta_math.h divide_by) against IEEE division. The only test file that includes src/.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/delta_math.h"
#include "core/numeric.h"
#include "test_util.h"

namespace dstest {
namespace {

namespace lib = deltastate::detail;

using fmt::from_bits;
using fmt::to_bits;
bool is_nan16(uint16_t h, int mant_bits) {
  const uint16_t exp_mask = static_cast<uint16_t>(0x7fffu & ~((1u << mant_bits) - 1u));
  return (h & exp_mask) == exp_mask && (h & ((1u << mant_bits) - 1u)) != 0;
}

struct Case16 {
  uint32_t f32_bits;
  uint16_t expected;
  const char* what;
};

TEST(Numeric, FloatToBf16HandComputed) {
  const Case16 cases[] = {
      {0x3F800000u, 0x3F80, "1.0"},
      {0xC0000000u, 0xC000, "-2.0"},
      {0x00000000u, 0x0000, "+0"},
      {0x80000000u, 0x8000, "-0"},
      {0x3F807FFFu, 0x3F80, "just below the tie: down"},
      {0x3F808000u, 0x3F80, "tie, even below: stays"},
      {0x3F808001u, 0x3F81, "just above the tie: up"},
      {0x3F818000u, 0x3F82, "tie, odd below: up to even"},
      {0xBF818000u, 0xBF82, "negative tie, odd below: away from zero to even"},
      {0x3FFF8000u, 0x4000, "tie carrying into the exponent"},
      {0x7F7F7FFFu, 0x7F7F, "largest bf16 finite (below tie)"},
      {0x7F7F8000u, 0x7F80, "tie above the largest finite: overflows to inf"},
      {0x7F7FFFFFu, 0x7F80, "FLT_MAX rounds to inf"},
      {0xFF7FFFFFu, 0xFF80, "-FLT_MAX rounds to -inf"},
      {0x7F800000u, 0x7F80, "+inf"},
      {0xFF800000u, 0xFF80, "-inf"},
      {0x00000001u, 0x0000, "smallest fp32 subnormal: rounds to 0"},
      {0x00008000u, 0x0000, "subnormal tie, even below: 0"},
      {0x00008001u, 0x0001, "subnormal above the tie: smallest bf16 subnormal"},
      {0x00018000u, 0x0002, "subnormal tie, odd below: up"},
      {0x007FFFFFu, 0x0080, "largest fp32 subnormal rounds to the smallest normal"},
      {0x00800000u, 0x0080, "smallest normal"},
  };
  for (const Case16& c : cases) {
    EXPECT_EQ(lib::float_to_bf16(from_bits(c.f32_bits)), c.expected) << c.what;
    EXPECT_EQ(fmt::bf16_bits(from_bits(c.f32_bits)), c.expected) << "test encoder: " << c.what;
  }
  // NaNs stay NaN (quiet), sign kept; a signaling NaN whose payload is only in the low 16 bits
  // must not collapse to inf.
  for (uint32_t nan : {0x7FC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0x7F810000u}) {
    const uint16_t h = lib::float_to_bf16(from_bits(nan));
    EXPECT_TRUE(is_nan16(h, 7)) << std::hex << nan << " -> " << h;
    EXPECT_EQ(h & 0x8000u, (nan >> 16) & 0x8000u) << std::hex << nan;
  }
}

TEST(Numeric, Bf16ToFloatHandComputed) {
  EXPECT_EQ(to_bits(lib::bf16_to_float(0x3F80)), 0x3F800000u);
  EXPECT_EQ(to_bits(lib::bf16_to_float(0xC049)), 0xC0490000u);
  EXPECT_EQ(to_bits(lib::bf16_to_float(0x0001)), 0x00010000u) << "subnormal";
  EXPECT_EQ(to_bits(lib::bf16_to_float(0x8000)), 0x80000000u) << "-0";
  EXPECT_EQ(to_bits(lib::bf16_to_float(0x7F7F)), 0x7F7F0000u) << "largest finite";
  EXPECT_TRUE(std::isinf(lib::bf16_to_float(0x7F80)));
  EXPECT_TRUE(std::isnan(lib::bf16_to_float(0xFFC0)));
  EXPECT_TRUE(std::isnan(lib::bf16_to_float(0x7F81)));
}

TEST(Numeric, FloatToF16HandComputed) {
  const Case16 cases[] = {
      {to_bits(1.0f), 0x3C00, "1.0"},
      {to_bits(-2.0f), 0xC000, "-2.0"},
      {to_bits(0.0f), 0x0000, "+0"},
      {to_bits(-0.0f), 0x8000, "-0"},
      {to_bits(65504.0f), 0x7BFF, "largest finite"},
      {to_bits(65519.996f), 0x7BFF, "below the overflow tie"},
      {to_bits(65520.0f), 0x7C00, "the overflow tie rounds to even = inf"},
      {to_bits(1e10f), 0x7C00, "overflow"},
      {to_bits(-1e10f), 0xFC00, "negative overflow"},
      {to_bits(1.0f + 0x1p-11f), 0x3C00, "tie, even below: stays"},
      {to_bits(1.0f + 0x1p-11f + 0x1p-23f), 0x3C01, "above the tie"},
      {to_bits(1.0f + 3 * 0x1p-11f), 0x3C02, "tie, odd below: up"},
      {to_bits(2047.5f), 0x6800, "tie carrying into the exponent (2047.5 -> 2048)"},
      {to_bits(0x1p-14f), 0x0400, "smallest normal"},
      {to_bits(0x1p-24f), 0x0001, "smallest subnormal"},
      {to_bits(1023 * 0x1p-24f), 0x03FF, "largest subnormal"},
      {to_bits(1023.5f * 0x1p-24f), 0x0400, "subnormal tie, odd below: up to the smallest normal"},
      {to_bits(0x1p-25f), 0x0000, "tie at half the smallest subnormal: to even 0"},
      {to_bits(0x1p-25f * 1.0000001f), 0x0001, "just above that tie"},
      {to_bits(3 * 0x1p-25f), 0x0002, "subnormal tie, odd below: up"},
      {to_bits(5 * 0x1p-25f), 0x0002, "subnormal tie, even below: stays"},
      {to_bits(0x1p-26f), 0x0000, "underflow to 0"},
      {to_bits(-0x1p-26f), 0x8000, "underflow to -0"},
      {0x00000001u, 0x0000, "fp32 subnormal"},
      {to_bits(std::numeric_limits<float>::infinity()), 0x7C00, "+inf"},
      {to_bits(-std::numeric_limits<float>::infinity()), 0xFC00, "-inf"},
  };
  for (const Case16& c : cases) {
    EXPECT_EQ(lib::float_to_f16(from_bits(c.f32_bits)), c.expected) << c.what;
    EXPECT_EQ(fmt::f16_bits(from_bits(c.f32_bits)), c.expected) << "test encoder: " << c.what;
  }
  for (uint32_t nan : {0x7FC00000u, 0x7F800001u, 0xFFC00000u, 0x7F802000u}) {
    const uint16_t h = lib::float_to_f16(from_bits(nan));
    EXPECT_TRUE(is_nan16(h, 10)) << std::hex << nan << " -> " << h;
    EXPECT_EQ(h & 0x8000u, (nan >> 16) & 0x8000u) << std::hex << nan;
  }
}

TEST(Numeric, F16ToFloatHandComputed) {
  EXPECT_EQ(lib::f16_to_float(0x3C00), 1.0f);
  EXPECT_EQ(lib::f16_to_float(0xC000), -2.0f);
  EXPECT_EQ(lib::f16_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(lib::f16_to_float(0x0400), 0x1p-14f);
  EXPECT_EQ(lib::f16_to_float(0x0001), 0x1p-24f);
  EXPECT_EQ(lib::f16_to_float(0x03FF), 1023 * 0x1p-24f);
  EXPECT_EQ(lib::f16_to_float(0x8001), -0x1p-24f);
  EXPECT_EQ(to_bits(lib::f16_to_float(0x8000)), 0x80000000u);
  EXPECT_TRUE(std::isinf(lib::f16_to_float(0x7C00)));
  EXPECT_LT(lib::f16_to_float(0xFC00), 0.0f);
  EXPECT_TRUE(std::isnan(lib::f16_to_float(0x7E00)));
  EXPECT_TRUE(std::isnan(lib::f16_to_float(0x7C01)));
}

// Every 16-bit pattern decodes to the same value as the independent decoder, and encodes back to
// itself (NaNs aside).
TEST(Numeric, AllSixteenBitPatternsDecode) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const auto b = static_cast<uint16_t>(h);
    const double want_bf = fmt::bf16_value(b), want_f16 = fmt::f16_value(b);
    const float got_bf = lib::bf16_to_float(b), got_f16 = lib::f16_to_float(b);
    if (std::isnan(want_bf)) {
      EXPECT_TRUE(std::isnan(got_bf)) << std::hex << h;
    } else {
      ASSERT_EQ(static_cast<double>(got_bf), want_bf) << std::hex << h;
      ASSERT_EQ(lib::float_to_bf16(got_bf), b) << "round trip " << std::hex << h;
    }
    if (std::isnan(want_f16)) {
      EXPECT_TRUE(std::isnan(got_f16)) << std::hex << h;
    } else {
      ASSERT_EQ(static_cast<double>(got_f16), want_f16) << std::hex << h;
      ASSERT_EQ(lib::float_to_f16(got_f16), b) << "round trip " << std::hex << h;
    }
  }
}

// Random fp32 bit patterns (all exponents) and values near ties encode like the independent
// encoder.
TEST(Numeric, RandomFloatsEncodeLikeTheReference) {
  Rng rng = test_rng();
  for (int i = 0; i < 400000; ++i) {
    uint32_t u = static_cast<uint32_t>(rng.engine()());
    if (i % 4 == 1) u = (u & 0xFFFF0000u) | 0x8000u;  // bf16 ties
    if (i % 4 == 2) u = (u & 0xFFFFE000u) | 0x1000u;  // fp16 (normal range) ties
    if (i % 4 == 3)
      u = (u & 0x807FFFFFu) | (static_cast<uint32_t>(rng.integer(96, 145)) << 23);  // fp16 range
    const float f = from_bits(u);
    if (std::isnan(f)) continue;
    ASSERT_EQ(lib::float_to_bf16(f), fmt::bf16_bits(f)) << std::hex << u;
    ASSERT_EQ(lib::float_to_f16(f), fmt::f16_bits(f)) << std::hex << u;
  }
}

// load_float / store_float / round_to / load_index, the accessors the kernels use.
TEST(Numeric, LoadStoreRoundTo) {
  uint16_t h[2] = {0, 0};
  float f[2] = {0, 0};
  lib::store_float(h, DType::bf16, 1, 1.0f + 0x1p-8f + 0x1p-20f);
  EXPECT_EQ(h[1], 0x3F81);
  EXPECT_EQ(lib::load_float(h, DType::bf16, 1), 1.0f + 0x1p-7f);
  lib::store_float(h, DType::f16, 0, 3 * 0x1p-25f);
  EXPECT_EQ(h[0], 0x0002);
  EXPECT_EQ(lib::load_float(h, DType::f16, 0), 0x1p-23f);
  lib::store_float(f, DType::f32, 1, 0.1f);
  EXPECT_EQ(lib::load_float(f, DType::f32, 1), 0.1f);
  EXPECT_EQ(lib::round_to(DType::bf16, 1.0f + 0x1p-8f), 1.0f);
  EXPECT_EQ(lib::round_to(DType::f16, 65520.0f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(lib::round_to(DType::f32, 0.1f), 0.1f);
  const int32_t i32[3] = {7, -1, 2147483647};
  const int64_t i64[2] = {int64_t{1} << 40, -5};
  EXPECT_EQ(lib::load_index(i32, DType::i32, 1), -1);
  EXPECT_EQ(lib::load_index(i32, DType::i32, 2), 2147483647);
  EXPECT_EQ(lib::load_index(i64, DType::i64, 0), int64_t{1} << 40);
  EXPECT_EQ(lib::load_index(i64, DType::i64, 1), -5);
}

// divide_by(x, d, 1/d) is the IEEE quotient x / d bit for bit for |x| >= 2^-100 (smaller x: within
// one ulp): the GPU normalizes q and k with it, the CPU reference divides, and the backends must
// agree. Denominators as the L2 norm makes them, numerators over every exponent, two whole
// binades of mantissas, both zeros.
TEST(Numeric, DivideByReciprocalIsTheIeeeQuotient) {
  auto check = [](float x, float d) {
    const float want = x / d;
    const float got = lib::divide_by(x, d, 1.0f / d);
    ASSERT_EQ(to_bits(got), to_bits(want)) << std::hexfloat << x << " / " << d;
  };
  Rng rng = test_rng();
  int64_t tiny = 0;
  for (int i = 0; i < 2000000; ++i) {
    // sum of squares over 10^-12 .. 10^8 (log-uniform), and the denominator from it
    const float ss = std::pow(10.0f, static_cast<float>(rng.uniform(-12.0, 8.0)));
    const float d = lib::l2norm_denominator(ss);
    // any mantissa, sign and exponent (x up to 2^30 beyond the denominator, down to 2^-140)
    const uint32_t mant = static_cast<uint32_t>(rng.engine()()) & 0x807FFFFFu;
    const int64_t e = std::max<int64_t>(0, rng.integer(-140, 30) + 127 + std::ilogb(d));
    const float x = from_bits(mant | (static_cast<uint32_t>(e) << 23));
    if (std::fabs(x) < 0x1p-100f) {  // the residual x - q*d may underflow: within one ulp
      const float want = x / d, got = lib::divide_by(x, d, 1.0f / d);
      ASSERT_TRUE(got == want || got == std::nextafter(want, 1.0f) ||
                  got == std::nextafter(want, -1.0f))
          << std::hexfloat << x << " / " << d;
      ++tiny;
      continue;
    }
    check(x, d);
  }
  EXPECT_GT(tiny, 0);
  for (const float d : {lib::l2norm_denominator(3.0f), lib::l2norm_denominator(0.7f)}) {
    for (uint32_t m = 0; m < (1u << 23); ++m) check(from_bits(0x3F800000u | m), d);  // [1, 2)
  }
  for (const float d : {1e-3f, 1.0f, 12345.678f}) {
    EXPECT_EQ(to_bits(lib::divide_by(0.0f, d, 1.0f / d)), to_bits(0.0f));
    EXPECT_EQ(to_bits(lib::divide_by(-0.0f, d, 1.0f / d)), to_bits(-0.0f));
    check(1.0f, d);
    check(-d, d);
  }
}

// SmallDivider (the CUDA kernels' division-free key head hv / group) is the integer quotient for
// every numerator below 2^15 and every divisor below 4096, and for sampled divisors up to 2^15.
TEST(Numeric, SmallDividerIsTheIntegerQuotient) {
  auto check_all_n = [](int d) {
    const lib::SmallDivider div = lib::SmallDivider::of(d);
    for (int n = 0; n < (1 << 15); ++n)
      if (div.divide(n) != n / d) {
        ADD_FAILURE() << n << " / " << d << ": got " << div.divide(n) << ", want " << n / d;
        return;
      }
  };
  for (int d = 1; d < 4096; ++d) check_all_n(d);
  Rng rng = test_rng();
  for (int i = 0; i < 200; ++i) check_all_n(static_cast<int>(rng.integer(4096, (1 << 15) - 1)));
  check_all_n((1 << 15) - 1);
}

}  // namespace
}  // namespace dstest
