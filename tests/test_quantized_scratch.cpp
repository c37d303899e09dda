// A quantized verify scratch on the CPU backend (issue #36): verify on a quantized pool storing
// each token's state in a float8_e4m3fn / int8 intermediate_states with fp32
// intermediate_state_scales, then the state commit from it, against references written here from
// the formats' definitions (not src/core/state_format.h): the same verify on an fp32 pool holding
// the dequantized start states with an fp32 scratch gives the fp32 states, and each entry must be
// their rounding to nearest with a fresh per-row scale amax / qmax (int8: rint and clip to
// [-127, 127]; e4m3fn: the nearest of its value table, ties to the even code, saturating at 448).
// The commit copies an entry of the pool's dtype and requantizes one of the other dtype. Rounding
// to nearest only: stochastic rounding's bits are checked against the numpy emulation in
// python/tests/test_quantized_scratch.py. Entries and slots not written keep their sentinels.
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "test_util.h"

namespace dstest {
namespace {

using deltastate::StatePool;
using deltastate::StatePoolConfig;
using deltastate::StateRounding;

constexpr uint8_t kCodeSentinel = 0x5a;

// e4m3fn from its definition: bias 7, 3 mantissa bits, exponent field 0 subnormal.
double e4m3(int c) {
  const int e = (c >> 3) & 15, m = c & 7;
  const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (c & 0x80) ? -v : v;
}
double decode(uint8_t c, DType t) {
  return t == DType::f8e4m3 ? e4m3(c) : static_cast<double>(static_cast<int8_t>(c));
}
// y rounded to nearest in dtype t (ties to even), saturating: its code.
uint8_t encode_nearest(float y, DType t) {
  if (t == DType::i8) {
    const float r = std::nearbyint(y);
    return static_cast<uint8_t>(static_cast<int8_t>(std::fmin(std::fmax(r, -127.0f), 127.0f)));
  }
  const double a = std::fabs(static_cast<double>(y));
  int best = 0x7e;  // 448, the saturation value
  if (a < 448.0) {
    double best_d = INFINITY;
    for (int c = 0; c <= 0x7e; ++c) {
      const double d = std::fabs(e4m3(c) - a);
      if (d < best_d || (d == best_d && c % 2 == 0)) best = c, best_d = d;
    }
  }
  return static_cast<uint8_t>(best | (std::signbit(y) ? 0x80 : 0));
}
// One row of K fp32 values rounded to nearest with a fresh scale: its codes and scale.
void quantize_reference(const float* x, int64_t K, DType t, uint8_t* codes, float* scale) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(x[k]));
  const float s = amax > 0.0f ? amax / (t == DType::i8 ? 127.0f : 448.0f) : 1.0f;
  *scale = s;
  for (int64_t k = 0; k < K; ++k) codes[k] = encode_nearest(x[k] / s, t);
}

struct ScratchCase {
  const char* name;
  DType pool, scratch;
};
void PrintTo(const ScratchCase& c, std::ostream* os) { *os << c.name; }
class QuantizedScratch : public ::testing::TestWithParam<ScratchCase> {};

// Two sequences of three tokens from slots 3 and 1 of 4 (no write-back), scratch rows 1 and 0 of
// [3, 4] entries; then the commit of sequence 0's second state into slot 0 and sequence 1's third
// into slot 2.
TEST_P(QuantizedScratch, EntriesAreThePoolsRuleAndTheCommitCopiesOrRequantizes) {
  const ScratchCase& c = GetParam();
  const Shape s = kOdd;
  const int64_t N = 2, T = 3, R = 3, TA = 4, slots = 4, K = s.K;
  const int64_t he = s.state_elems(), hr = int64_t{s.HV} * s.V;
  Rng rng = test_rng();
  StatePoolConfig cfg;
  cfg.layers = 1;
  cfg.slots = slots;
  cfg.HV = s.HV;
  cfg.V = s.V;
  cfg.K = s.K;
  cfg.state_dtype = c.pool;
  cfg.state_rounding = StateRounding::nearest;
  StatePool pool(cfg);
  std::memset(pool.data(), kCodeSentinel, static_cast<size_t>(pool.total_bytes()));
  const TensorView st = pool.layer_state(0), sc = pool.layer_scales(0);
  Tensor twin = make_pool(DType::f32, slots, s);
  for (int64_t slot : {3, 1}) {
    uint8_t* codes = static_cast<uint8_t*>(st.data) + slot * st.stride[0];
    float* scales = static_cast<float*>(sc.data) + slot * sc.stride[0];
    float* x = static_cast<float*>(twin.alloc_base()) + slot * he;
    for (int64_t r = 0; r < hr; ++r) {
      scales[r] = static_cast<float>(rng.uniform(0.1, 1.0) / (c.pool == DType::i8 ? 127 : 448));
      for (int64_t k = 0; k < K; ++k) {
        uint8_t code = static_cast<uint8_t>(rng.integer(0, 255));
        if (c.pool == DType::f8e4m3 && (code & 0x7f) == 0x7f) code ^= 1;  // no NaN
        if (c.pool == DType::i8 && code == 0x80) code = 0;                // no -128
        codes[r * K + k] = code;
        x[r * K + k] = static_cast<float>(decode(code, c.pool)) * scales[r];
      }
    }
  }
  std::vector<uint8_t> pool0(static_cast<size_t>(pool.total_bytes()));
  std::memcpy(pool0.data(), pool.data(), pool0.size());

  RecurrentBatch rb = make_recurrent_batch(rng, recurrent_spec(s, false, DType::f32, N, T));
  RecurrentBatch fb = rb;  // the fp32 run's own output
  fb.out = rb.out.empty_like();
  Tensor idx = index_tensor({3, 1}), rows = index_tensor({1, 0});
  Tensor codes = Tensor::contiguous(c.scratch, {R, TA, s.HV, s.V, s.K});
  Tensor scales = Tensor::contiguous(DType::f32, {R, TA, s.HV, s.V});
  Tensor fscratch = Tensor::contiguous(DType::f32, {R, TA, s.HV, s.V, s.K});
  std::memset(codes.alloc_base(), kCodeSentinel, static_cast<size_t>(codes.alloc_bytes()));
  scales.fill_all(kSentinel);
  fscratch.fill_all(kSentinel);
  auto run = [&](RecurrentBatch& b, const TensorView& state, const Tensor& scratch, bool q) {
    deltastate::VerifyArgs a = verify_inputs(b.args(host_view), false);
    a.state = state;
    a.state_indices = idx.view();
    a.update_state = false;
    a.intermediate_states = scratch.view();
    a.intermediate_state_indices = rows.view();
    if (q) {
      a.state_format.scales = sc;
      a.state_format.rounding = StateRounding::nearest;
      a.intermediate_state_scales = scales.view();
    }
    deltastate::verify(a);
  };
  run(rb, st, codes, true);
  run(fb, twin.view(), fscratch, false);
  EXPECT_EQ(std::memcmp(rb.out.alloc_base(), fb.out.alloc_base(),
                        static_cast<size_t>(rb.out.alloc_bytes())),
            0)
      << "outputs against the fp32 pool's";
  EXPECT_EQ(std::memcmp(pool.data(), pool0.data(), pool0.size()), 0) << "no write-back";

  const uint8_t* cb = static_cast<const uint8_t*>(codes.alloc_base());
  const float* sb = static_cast<const float*>(scales.alloc_base());
  const float* fx = static_cast<const float*>(fscratch.alloc_base());
  std::vector<uint8_t> want_c(static_cast<size_t>(K));
  for (int64_t row = 0; row < R; ++row)
    for (int64_t t = 0; t < TA; ++t) {
      SCOPED_TRACE("entry (" + std::to_string(row) + ", " + std::to_string(t) + ")");
      const int64_t e = row * TA + t;
      if (row == 2 || t == T) {  // no sequence's row, or past its tokens: untouched
        for (int64_t i = 0; i < he; ++i) ASSERT_EQ(cb[e * he + i], kCodeSentinel);
        for (int64_t r = 0; r < hr; ++r) ASSERT_EQ(sb[e * hr + r], static_cast<float>(kSentinel));
        continue;
      }
      for (int64_t r = 0; r < hr; ++r) {
        float want_s;
        quantize_reference(fx + e * he + r * K, K, c.scratch, want_c.data(), &want_s);
        ASSERT_EQ(std::memcmp(&sb[e * hr + r], &want_s, 4), 0)
            << "scale of row " << r << ": " << sb[e * hr + r] << " want " << want_s;
        for (int64_t k = 0; k < K; ++k)
          ASSERT_EQ(cb[e * he + r * K + k], want_c[static_cast<size_t>(k)])
              << "row " << r << " k " << k;
      }
    }

  // the commit: sequence 0's (row 1) second state into slot 0, sequence 1's (row 0) third into 2
  Tensor cidx = index_tensor({0, 2}), acc = index_tensor({2, 3}), crows = index_tensor({1, 0});
  deltastate::CommitArgs ca;
  ca.state = st;
  ca.intermediate_states = codes.view();
  ca.intermediate_state_scales = scales.view();
  ca.state_indices = cidx.view();
  ca.accepted = acc.view();
  ca.intermediate_state_indices = crows.view();
  ca.state_format.scales = sc;
  ca.state_format.rounding = StateRounding::nearest;
  deltastate::update_state_after_verify(ca);
  std::vector<float> x(static_cast<size_t>(K));
  for (auto [slot, e] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 1 * TA + 1}, {2, 0 * TA + 2}}) {
    SCOPED_TRACE("slot " + std::to_string(slot));
    const uint8_t* pc = static_cast<const uint8_t*>(st.data) + slot * st.stride[0];
    const float* ps = static_cast<const float*>(sc.data) + slot * sc.stride[0];
    for (int64_t r = 0; r < hr; ++r) {
      float want_s = sb[e * hr + r];
      const uint8_t* want = cb + e * he + r * K;
      if (c.scratch != c.pool) {  // dequantized, then requantized with a fresh scale
        for (int64_t k = 0; k < K; ++k)
          x[static_cast<size_t>(k)] = static_cast<float>(decode(want[k], c.scratch)) * want_s;
        quantize_reference(x.data(), K, c.pool, want_c.data(), &want_s);
        want = want_c.data();
      }
      ASSERT_EQ(std::memcmp(&ps[r], &want_s, 4), 0) << "scale of row " << r;
      ASSERT_EQ(std::memcmp(pc + r * K, want, static_cast<size_t>(K)), 0) << "codes of row " << r;
    }
  }
  for (int64_t slot : {1, 3}) {  // not committed to: as before
    const int64_t co = static_cast<const char*>(st.data) - static_cast<const char*>(pool.data()) +
                       slot * st.stride[0];
    EXPECT_EQ(std::memcmp(static_cast<const char*>(pool.data()) + co, pool0.data() + co,
                          static_cast<size_t>(he)),
              0)
        << "slot " << slot;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, QuantizedScratch,
    ::testing::Values(ScratchCase{"fp8_pool_fp8_scratch", DType::f8e4m3, DType::f8e4m3},
                      ScratchCase{"int8_pool_int8_scratch", DType::i8, DType::i8},
                      ScratchCase{"fp8_pool_int8_scratch", DType::f8e4m3, DType::i8},
                      ScratchCase{"int8_pool_fp8_scratch", DType::i8, DType::f8e4m3}),
    case_name<ScratchCase>);

}  // namespace
}  // namespace dstest
