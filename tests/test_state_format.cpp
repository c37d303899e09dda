// The rounding rules of the state storage formats (src/core/state_format.h) against independent
// references written here from the formats' definitions: e4m3fn decoding from its bit fields,
// round-to-nearest-even by a search of the sorted value table, stochastic rounding as the dithered
// value's nearest, floor(y + u) in fp64, splitmix64's published first outputs, and the
// unbiasedness of stochastic rounding. Bit-for-bit agreement with
// tools/state_accuracy.py's numpy emulation and with torch's float8_e4m3fn is checked in
// python/tests/test_state_format.py (through the ops).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/state_format.h"
#include "test_util.h"

namespace dstest {
namespace {

namespace lib = deltastate::detail;

using fmt::from_bits;

// e4m3fn from its definition: bias 7, 3 mantissa bits, exponent field 0 subnormal, 0x7f NaN.
double e4m3_value(int code) {
  const int sign = code & 0x80 ? -1 : 1;
  const int e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(m, -9);
  return sign * std::ldexp(8 + m, e - 7 - 3);
}

// The non-negative finite values 0x00..0x7e, increasing with the code.
std::vector<double> e4m3_table() {
  std::vector<double> t;
  for (int c = 0; c < 0x7f; ++c) t.push_back(e4m3_value(c));
  return t;
}

// Round-to-nearest-even reference: the nearest of the table (ties: the even code), saturating.
uint8_t e4m3_reference(const std::vector<double>& table, float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xff : 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(x));
  auto it = std::lower_bound(table.begin(), table.end(), a);
  int code;
  if (it == table.end()) {
    code = 0x7e;
  } else if (*it == a || it == table.begin()) {
    code = static_cast<int>(it - table.begin());
  } else {
    const int hi = static_cast<int>(it - table.begin()), lo = hi - 1;
    const double dlo = a - table[lo], dhi = table[hi] - a;
    code = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
  }
  return static_cast<uint8_t>(sign | code);
}

TEST(StateFormat, E4m3DecodesEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const double want = e4m3_value(c);
    const float got = lib::e4m3_to_float(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;  // -0 included
    }
  }
}

TEST(StateFormat, E4m3NearestEvenMatchesTheTableSearch) {
  const std::vector<double> table = e4m3_table();
  int64_t checked = 0, bad = 0;
  auto check = [&](float x) {
    const uint8_t want = e4m3_reference(table, x), got = lib::float_to_e4m3(x);
    ++checked;
    if (want != got && ++bad <= 5)
      ADD_FAILURE() << "x=" << x << " (bits 0x" << std::hex << lib::float_bits(x) << std::dec
                    << "): got 0x" << std::hex << int(got) << ", want 0x" << int(want);
  };
  // Every value, both neighbours' midpoint and the floats around it: the ties and their edges.
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = static_cast<float>(table[c]), hi = static_cast<float>(table[c + 1]);
    const float mid = static_cast<float>((table[c] + table[c + 1]) / 2);
    for (float x : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), hi})
      for (float s : {1.0f, -1.0f}) check(s * x);
  }
  // Sampled fp32 patterns over every binade (sign, zero, subnormals, infinities, NaN included).
  for (uint64_t u = 0; u <= 0xffffffffull; u += 4099) check(from_bits(static_cast<uint32_t>(u)));
  for (float x :
       {0.0f, -0.0f, 448.0f, 464.0f, 479.0f, 480.0f, 1e30f, std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::denorm_min()})
    check(x);
  EXPECT_EQ(bad, 0) << "of " << checked;
  EXPECT_GT(checked, 1000000);
}

// floor(y + U 2^-24) computed exactly in fp64 (y has 24 significant bits, U 24).
float floor_plus_reference(float y, uint32_t U) {
  return static_cast<float>(std::floor(static_cast<double>(y) + std::ldexp(double(U), -24)));
}

TEST(StateFormat, FloorPlusUniformIsExact) {
  Rng rng = test_rng();
  int bad = 0;
  auto check = [&](float y, uint32_t U) {
    const float want = floor_plus_reference(y, U), got = lib::floor_plus_uniform(y, U);
    if (want != got && ++bad <= 5) ADD_FAILURE() << "y=" << y << " U=" << U << ": got " << got;
  };
  const uint32_t edges[] = {0u, 1u, 2u, 0x7fffffu, 0x800000u, 0xfffffeu, 0xffffffu};
  for (int i = 0; i < 200000; ++i) {
    const double mag = std::ldexp(1.0, static_cast<int>(rng.integer(-40, 8)));
    float y = static_cast<float>(rng.uniform(-mag, mag));
    if (i % 7 == 0) y = std::nearbyint(y);  // integers
    if (i % 11 == 0) y = std::floor(y) + 0.5f;
    const uint32_t U = i % 3 == 0 ? edges[i % 7] : static_cast<uint32_t>(rng.integer(0, 0xffffff));
    check(y, U);
    // the fraction just below / above 1 - u: where the carry decides
    const float f = std::floor(y) + static_cast<float>(1.0 - std::ldexp(double(U), -24));
    check(f, U);
    check(std::nextafter(f, -1e9f), U);
    check(std::nextafter(f, 1e9f), U);
  }
  EXPECT_EQ(bad, 0);
}

// Stochastic e4m3fn from the rule's definition: the dither ((U + 1/2) 2^-16 - 1/2) spacing added to
// |x| in fp32 (the spacing of |x|'s binade, 2^-9 below 2^-6), not below the binade's floor, then
// the table's nearest even. It also lands on a neighbour of x: the table value below |x| or above
// it.
uint8_t e4m3_stochastic_reference(const std::vector<double>& table, float x, uint32_t U) {
  if (std::isnan(x)) return e4m3_reference(table, x);
  const float a = std::fabs(x);
  if (std::isinf(a)) return e4m3_reference(table, x);
  const int e = a >= std::ldexp(1.0f, -6) ? std::ilogb(a) : -6;
  const float spacing = std::ldexp(1.0f, e - 3);
  const float dither = static_cast<float>((std::ldexp(2.0 * U + 1, -17) - 0.5) * spacing);
  const float floor = a >= std::ldexp(1.0f, -6) ? std::ldexp(1.0f, e) : 0.0f;
  const float y = std::max(a + dither, floor);
  return static_cast<uint8_t>((std::signbit(x) ? 0x80 : 0) | e4m3_reference(table, y));
}

TEST(StateFormat, StochasticE4m3IsDitheredNearest) {
  const std::vector<double> table = e4m3_table();
  Rng rng = test_rng();
  for (int i = 0; i < 100000; ++i) {
    float x = static_cast<float>(rng.uniform(-1, 1) * std::ldexp(1.0, int(rng.integer(-12, 8))));
    if (i % 5 == 0) {  // e4m3 values and their midpoints: binade edges and ties
      const int c = static_cast<int>(rng.integer(0, 0x7d));
      x = static_cast<float>(i % 10 == 0 ? table[c] : (table[c] + table[c + 1]) / 2);
    }
    const uint32_t U =
        i % 7 == 0 ? (i % 14 == 0 ? 0u : 0xffffu) : static_cast<uint32_t>(rng.integer(0, 0xffff));
    const uint8_t code = lib::float_to_e4m3(x, true, U);
    ASSERT_EQ(code, e4m3_stochastic_reference(table, x, U)) << "x=" << x << " U=" << U;
    // a neighbour: the table value below |x| or the one above
    const double a = std::fabs(double(x)), got = std::fabs(e4m3_value(code));
    auto hi = std::lower_bound(table.begin(), table.end(), a);
    const double up = hi == table.end() ? 448.0 : *hi;
    const double down = hi == table.end() ? 448.0 : (*hi == a ? a : *(hi - 1));
    ASSERT_TRUE(got == up || got == down) << "x=" << x << " U=" << U << " got " << got;
  }
  // saturating: past 448 and infinity stay 448
  EXPECT_EQ(lib::float_to_e4m3(500.0f, true, 0xffff), 0x7e);
  EXPECT_EQ(lib::float_to_e4m3(-std::numeric_limits<float>::infinity(), true, 0), 0xfe);
  EXPECT_EQ(lib::float_to_e4m3(std::nanf(""), true, 5), 0x7f);
  EXPECT_EQ(lib::float_to_e4m3(-0.0f, true, 0xffff), 0x80);  // zeros stay (signed)
  EXPECT_EQ(lib::float_to_e4m3(0.0f, true, 0), 0x00);
}

TEST(StateFormat, Int8RoundsAndClips) {
  EXPECT_EQ(lib::float_to_i8(2.5f), 2);  // ties to even
  EXPECT_EQ(lib::float_to_i8(3.5f), 4);
  EXPECT_EQ(lib::float_to_i8(-2.5f), -2);
  EXPECT_EQ(lib::float_to_i8(127.4f), 127);
  EXPECT_EQ(lib::float_to_i8(200.0f), 127);
  EXPECT_EQ(lib::float_to_i8(-200.0f), -127);  // -128 is never stored
  // stochastic: y + (U + 1/2) 2^-16 - 1/2 to nearest (even)
  EXPECT_EQ(lib::float_to_i8(-126.9f, true, 0xffff), -126);
  EXPECT_EQ(lib::float_to_i8(-126.9f, true, 0), -127);
  EXPECT_EQ(lib::float_to_i8(2.25f, true, 0xc000), 3);             // 2.5 + 2^-17
  EXPECT_EQ(lib::float_to_i8(2.25f, true, 0xbfff), 2);             // 2.5 - 2^-17
  EXPECT_EQ(lib::float_to_i8(2.25f - 0x1p-17f, true, 0xc000), 2);  // 2.5: the tie, to even
  EXPECT_EQ(lib::float_to_i8(5.0f, true, 0), 5);                   // exact values stay
  EXPECT_EQ(lib::float_to_i8(5.0f, true, 0xffff), 5);
  EXPECT_EQ(lib::float_to_i8(127.0001f, true, 0xffff), 127);
  EXPECT_EQ(lib::float_to_i8(std::nanf("")), 0);
}

TEST(StateFormat, RowScale) {
  EXPECT_EQ(lib::row_scale(448.0f, lib::kE4m3Max), 1.0f);
  EXPECT_EQ(lib::row_scale(0.0f, lib::kE4m3Max), 1.0f);  // an all-zero row
  EXPECT_EQ(lib::row_scale(1.0f, lib::kInt8Max), 1.0f / 127.0f);
  EXPECT_TRUE(std::isnan(lib::row_scale(std::numeric_limits<float>::infinity(), 127.0f)));
  // amax keeps a NaN wherever it is in the row
  float m = 0.0f;
  for (float x : {1.0f, std::nanf(""), 3.0f}) m = lib::amax_step(m, x);
  EXPECT_TRUE(std::isnan(m));
}

TEST(StateFormat, Splitmix64Stream) {
  // splitmix64 seeded with 0: its first outputs (Vigna's reference implementation), each the
  // 16-bit fields of four consecutive elements, lowest first
  EXPECT_EQ(lib::sr_draw(0, 0), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(lib::sr_draw(0, 1), 0x6E789E6AA1B965F4ull);
  EXPECT_EQ(lib::sr_draw(0, 2), 0x06C45D188009454Full);
  const uint32_t fields[] = {0xCDAF, 0x7B1D, 0xA839, 0xE220, 0x65F4,
                             0xA1B9, 0x9E6A, 0x6E78, 0x454F};
  for (uint64_t e = 0; e < 9; ++e) EXPECT_EQ(lib::sr_bits(0, e), fields[e]) << "element " << e;
  // the key folds each field in with one mix
  const uint64_t z0 = lib::mix64(7 ^ lib::kGolden);
  EXPECT_EQ(lib::sr_key(7, 1, 2, 3), lib::mix64(lib::mix64(lib::mix64(z0 ^ 1) ^ 2) ^ 3));
  EXPECT_NE(lib::sr_key(7, 1, 2, 3), lib::sr_key(7, 1, 2, 4));
  EXPECT_NE(lib::sr_key(7, 1, 2, 3), lib::sr_key(7, 2, 2, 3));
}

// E[stochastic round(x)] = x: the mean of many draws within 6 standard errors (each draw is within
// one spacing of x, so its standard deviation is at most spacing / 2).
template <class Round>
void expect_unbiased(float x, double spacing, Round round) {
  const int n = 40000;
  double sum = 0.0;
  for (int i = 0; i < n; ++i) sum += round(lib::sr_bits(lib::sr_key(1, 2, 3, 4), uint64_t(i)));
  const double mean = sum / n;
  EXPECT_NEAR(mean, x, 6.0 * (spacing / 2) / std::sqrt(double(n))) << "x=" << x;
}

TEST(StateFormat, StochasticRoundingIsUnbiased) {
  for (float x : {0.3f, 1.1f, -5.7f, 100.3f, 0.0123f, 3e-3f, 1.01f, -2.03f}) {
    const double sp = std::ldexp(1.0, std::max(std::ilogb(x), -6) - 3);
    expect_unbiased(x, sp,
                    [&](uint32_t U) { return lib::e4m3_to_float(lib::float_to_e4m3(x, true, U)); });
    if (std::fabs(x) < 127)
      expect_unbiased(x, 1.0, [&](uint32_t U) { return double(lib::float_to_i8(x, true, U)); });
    const double sp16 = std::ldexp(1.0, std::ilogb(x) - 7);
    expect_unbiased(x, sp16, [&](uint32_t U) {
      return double(lib::bf16_to_float(lib::float_to_bf16_sr(x, U)));
    });
    const double sph = std::ldexp(1.0, std::max(std::ilogb(x), -14) - 10);
    expect_unbiased(
        x, sph, [&](uint32_t U) { return double(lib::f16_to_float(lib::float_to_f16_sr(x, U))); });
  }
}

TEST(StateFormat, Bf16StochasticIsTheEmulationsRule) {
  // the 16 random bits added below the kept mantissa, then truncated (state_accuracy.round_bf16)
  const float x = from_bits(0x3f80ffffu);  // 1 + (2^16 - 1) 2^-23
  EXPECT_EQ(lib::float_to_bf16_sr(x, 0), 0x3f80);
  EXPECT_EQ(lib::float_to_bf16_sr(x, 1), 0x3f81);
  EXPECT_EQ(lib::float_to_bf16_sr(1.0f, 0xffff), 0x3f80);  // exact values stay
  EXPECT_EQ(lib::float_to_f16_sr(1.0f, 0xffff), 0x3c00);
}

}  // namespace
}  // namespace dstest
