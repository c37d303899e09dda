// The CPU gates' vector functions (src/cpu/simd.h `gate`: simd_impl.inc's vexp, vsoftplus,
// vsigmoid) against fp64 and libm's expf / log1pf over the whole input range of each, extremes,
// infinities and NaN included, and the same bits on every vector ISA the CPU has.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/delta_math.h"
#include "core/numeric.h"
#include "cpu/simd.h"

namespace {

using namespace deltastate;
using detail::GateMode;

const char* const kIsas[] = {"portable", "avx2", "avx512"};

// Distance in units in the last place between two finite floats of one sign (or zero).
int64_t ulps(float a, float b) {
  auto key = [](float x) {
    const int32_t i = static_cast<int32_t>(detail::float_bits(x));
    return i < 0 ? int64_t{INT32_MIN} - i : int64_t{i};
  };
  const int64_t d = key(a) - key(b);
  return d < 0 ? -d : d;
}

// Inputs: a dense grid over [lo, hi] plus the specials.
std::vector<float> grid(float lo, float hi, int n) {
  std::vector<float> x;
  for (int i = 0; i < n; ++i) x.push_back(lo + (hi - lo) * static_cast<float>(i) / (n - 1));
  for (float s : {0.0f, -0.0f, 1e-30f, -1e-30f, 1e-45f, 20.0f, std::nextafter(20.0f, 30.0f), 87.3f,
                  -87.3f, 88.3f, -88.3f, 100.0f, -100.0f, 1e30f, -1e30f})
    x.push_back(s);
  return x;
}

struct Gates {
  std::vector<float> g, alpha;
};

Gates run(GateMode mode, const std::vector<float>& x, const std::vector<float>* dt, float A_log,
          float lower_bound) {
  Gates r{std::vector<float>(x.size()), std::vector<float>(x.size())};
  cpu::simd::kernels().gate(mode, x.data(), dt ? dt->data() : nullptr, A_log, lower_bound,
                            static_cast<int>(x.size()), r.g.data(), r.alpha.data());
  return r;
}

class CpuGateMath : public ::testing::Test {
 protected:
  void TearDown() override { cpu::simd::set_isa(default_isa_.c_str()); }
  std::string default_isa_ = cpu::simd::kernels().isa;
};

// One function's results on the grid x: per element either in range (within `bound` ulp of
// libm's and of fp64's value) or out of it (then `special` says whether the result is the one
// stated for there); the worst distances are printed per ISA.
struct Point {
  float got, libm, exact;
  bool in_range, special;
};

template <class At>
void expect_within_ulps(const char* isa, const char* what, const std::vector<float>& x,
                        int64_t bound, At at) {
  int64_t worst_libm = 0, worst_exact = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const Point p = at(i);
    if (!p.in_range) {
      ASSERT_TRUE(p.special) << isa << " " << what << " x=" << x[i] << " got " << p.got;
      continue;
    }
    worst_libm = std::max(worst_libm, ulps(p.got, p.libm));
    worst_exact = std::max(worst_exact, ulps(p.got, p.exact));
    ASSERT_LE(ulps(p.got, p.libm), bound)
        << isa << " " << what << " x=" << x[i] << " got " << p.got << " libm " << p.libm;
    ASSERT_LE(ulps(p.got, p.exact), bound)
        << isa << " " << what << " x=" << x[i] << " got " << p.got << " fp64 " << p.exact;
  }
  std::printf("%s %s: worst %lld ulp from libm, %lld from fp64\n", isa, what,
              static_cast<long long>(worst_libm), static_cast<long long>(worst_exact));
}

// vsoftplus (g = -softplus(x) with A_log = 0) against fp64 log1p(exp(x)) and libm's
// log1pf(expf(x)): within 4 ulp of each for x >= -87.3; below, 0 (the true value is under
// 1.2e-38 there, and the library's exp gives 0).
TEST_F(CpuGateMath, SoftplusWithinUlpsOfLibmAndFp64) {
  const std::vector<float> x = grid(-110.0f, 60.0f, 400001);
  for (const char* isa : kIsas) {
    if (!cpu::simd::set_isa(isa)) continue;
    const Gates r = run(GateMode::softplus, x, nullptr, 0.0f, 0.0f);
    expect_within_ulps(isa, "softplus", x, 4, [&](size_t i) {
      const double xd = x[i];
      const float got = -r.g[i];
      return Point{got, detail::softplus(x[i]),
                   static_cast<float>(x[i] > 20.0f ? xd : std::log1p(std::exp(xd))), x[i] >= -87.3f,
                   got == 0.0f};
    });
  }
}

// The sigmoid of the safe gate (g = lower_bound * sigmoid(x) with A_log = 0, lower_bound = -1)
// against fp64 and libm's 1 / (1 + expf(-x)): within 3 ulp for results >= 2^-126, below it
// under 2^-126.
TEST_F(CpuGateMath, SigmoidWithinUlpsOfLibmAndFp64) {
  const std::vector<float> x = grid(-110.0f, 110.0f, 400001);
  for (const char* isa : kIsas) {
    if (!cpu::simd::set_isa(isa)) continue;
    const Gates r = run(GateMode::safe, x, nullptr, 0.0f, -1.0f);
    expect_within_ulps(isa, "sigmoid", x, 3, [&](size_t i) {
      const float exact = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(x[i]))));
      const float got = -r.g[i];
      return Point{got, detail::sigmoid(x[i]), exact, exact >= std::numeric_limits<float>::min(),
                   got < std::numeric_limits<float>::min()};
    });
  }
}

// alpha = e^g (log_decay mode: g = x) against fp64 and libm's expf: within 3 ulp on
// [-87.3, 88.3]; 0 below, +inf above.
TEST_F(CpuGateMath, ExpWithinUlpsOfLibmAndFp64) {
  const std::vector<float> x = grid(-100.0f, 100.0f, 400001);
  for (const char* isa : kIsas) {
    if (!cpu::simd::set_isa(isa)) continue;
    const Gates r = run(GateMode::log_decay, x, nullptr, 0.0f, 0.0f);
    for (size_t i = 0; i < x.size(); ++i)
      ASSERT_EQ(detail::float_bits(r.g[i]), detail::float_bits(x[i])) << "g = x";
    expect_within_ulps(isa, "exp", x, 3, [&](size_t i) {
      const float got = r.alpha[i];
      const bool special =
          x[i] < -87.3f ? got == 0.0f : got == std::numeric_limits<float>::infinity();
      return Point{got, std::exp(x[i]), static_cast<float>(std::exp(static_cast<double>(x[i]))),
                   x[i] >= -87.3f && x[i] <= 88.3f, special};
    });
  }
}

// The whole gate of each mode (A_log, dt_bias, lower_bound, the e^g of it) against the scalar
// libm gate of core/delta_math.h on realistic inputs: g within 8 ulp, alpha within 3 ulp of libm's
// expf of that g (an ulp of g moves alpha by |g| ulp-sized steps, so alpha is compared at its g).
TEST_F(CpuGateMath, GateRowsNearLibmGates) {
  std::vector<float> x = grid(-30.0f, 30.0f, 20001), dt(x.size());
  for (size_t i = 0; i < dt.size(); ++i) dt[i] = -2.0f + 4.0f * static_cast<float>(i % 97) / 96.0f;
  for (const char* isa : kIsas) {
    if (!cpu::simd::set_isa(isa)) continue;
    for (GateMode mode : {GateMode::softplus, GateMode::safe}) {
      for (float A_log : {-3.0f, 0.0f, 1.5f}) {
        const Gates r = run(mode, x, &dt, A_log, -5.0f);
        for (size_t i = 0; i < x.size(); ++i) {
          const float g = detail::gate_value(mode, x[i], dt[i], A_log, -5.0f);
          if (std::fabs(x[i]) > 60.0f) continue;  // the extremes: the tests above
          if (std::fabs(g) < 1e-37f) {  // e^{-x} beyond the library exp's range: 0 or tiny
            ASSERT_LT(std::fabs(r.g[i]), 1e-37f);
            continue;
          }
          ASSERT_LE(ulps(r.g[i], g), 8) << isa << " x=" << x[i] << " A_log=" << A_log << " mode "
                                        << int(mode) << " got " << r.g[i] << " libm " << g;
          const float alpha = std::exp(r.g[i]);
          if (r.g[i] < -87.3f) {
            ASSERT_EQ(r.alpha[i], 0.0f);
          } else {
            ASSERT_LE(ulps(r.alpha[i], alpha), 3) << isa << " x=" << x[i] << " A_log=" << A_log;
          }
        }
      }
    }
  }
}

// Infinities and NaN: softplus(+inf) = +inf, softplus(-inf) = 0, sigmoid(+-inf) = 1 / 0, NaN
// in gives NaN out (g and alpha); e^{-inf} = 0, e^{+inf} = +inf.
TEST_F(CpuGateMath, InfinitiesAndNan) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {inf, -inf, nan, -nan, 1.0f};
  for (const char* isa : kIsas) {
    if (!cpu::simd::set_isa(isa)) continue;
    const Gates sp = run(GateMode::softplus, x, nullptr, 0.0f, 0.0f);
    EXPECT_EQ(sp.g[0], -inf) << isa;
    EXPECT_EQ(sp.alpha[0], 0.0f) << isa;
    EXPECT_EQ(sp.g[1], 0.0f) << isa;
    EXPECT_EQ(sp.alpha[1], 1.0f) << isa;
    const Gates sg = run(GateMode::safe, x, nullptr, 0.0f, -2.0f);
    EXPECT_EQ(sg.g[0], -2.0f) << isa;
    EXPECT_EQ(sg.g[1], 0.0f) << isa;  // -2 * 0 = -0
    const Gates ld = run(GateMode::log_decay, x, nullptr, 0.0f, 0.0f);
    EXPECT_EQ(ld.alpha[0], inf) << isa;
    EXPECT_EQ(ld.alpha[1], 0.0f) << isa;
    for (const Gates* r : {&sp, &sg, &ld})
      for (int i : {2, 3}) {
        EXPECT_TRUE(std::isnan(r->g[i])) << isa;
        EXPECT_TRUE(std::isnan(r->alpha[i])) << isa;
      }
  }
}

// Every ISA gives the same bits as the portable kernels, at every length (vector tails).
TEST_F(CpuGateMath, SameBitsOnEveryIsa) {
  std::vector<float> x = grid(-40.0f, 40.0f, 4099), dt(x.size());
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  x.push_back(std::numeric_limits<float>::infinity());
  x.push_back(-std::numeric_limits<float>::infinity());
  dt.resize(x.size());
  for (size_t i = 0; i < dt.size(); ++i) dt[i] = 0.01f * static_cast<float>(i % 13);
  for (GateMode mode : {GateMode::log_decay, GateMode::softplus, GateMode::safe}) {
    cpu::simd::set_isa("portable");
    const Gates base = run(mode, x, &dt, 0.7f, -3.0f);
    for (const char* isa : kIsas) {
      if (!cpu::simd::set_isa(isa)) continue;
      for (int n : {1, 5, 16, 17, 63, static_cast<int>(x.size())}) {
        std::vector<float> g(n), alpha(n);
        cpu::simd::kernels().gate(mode, x.data(), dt.data(), 0.7f, -3.0f, n, g.data(),
                                  alpha.data());
        ASSERT_EQ(std::memcmp(g.data(), base.g.data(), n * sizeof(float)), 0) << isa << " n=" << n;
        ASSERT_EQ(std::memcmp(alpha.data(), base.alpha.data(), n * sizeof(float)), 0)
            << isa << " n=" << n;
      }
    }
  }
}

}  // namespace
