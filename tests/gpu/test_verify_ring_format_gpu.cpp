// SGLang's cache_ring (verify's ring_v, ring_k, ring_g, ring_beta: the raw inputs of the steps
// t < L at each sequence's slot) on a pool in its storage format (float8_e4m3fn rounded
// stochastically, its default, and int8 to nearest, per-row fp32 scales) on the CUDA backend
// (src/cuda/verify/fmt.cuh, verify_fmt_kernel's ring instantiation) against the CPU backend, the
// oracle. The rings stay float: raw v and k bit-equal to the CPU's, g and beta at the float ring
// test's tolerances (tests/gpu/test_replayssm_verify_gpu.cpp VerifyCacheRingMatchesCpu), every
// position not written (t >= L, past a short sequence, a padded sequence's, other slots) still
// its sentinel on both; outputs and the float scratch at tests/gpu/test_state_format_gpu.cpp's
// tolerances; the pool's written slots within one quantum (scales 1e-4 relative), every other byte
// and the step counter equal (expect_pools_match). Every test skips when no CUDA device is present.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "gpu/gpu_util.h"
#include "gpu/quant_pools.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::StateRounding;

// sglang_tree: SGLang's verify (no write-back, a float scratch by scratch row with a tree, one
// sequence without a scratch row); in_place: the final state stored quantized at the sequence's
// slot, the float scratch by batch row.
enum class RingMode { sglang_tree, in_place };

struct RingFmtCase {
  const char* name;
  bool kda;
  Shape shape;
  DType dtype;
  StateRounding rounding;
  RingMode mode;
  DType ring;                    // ring_v and ring_k's dtype (ring_g, ring_beta: float32)
  std::vector<int64_t> seqlens;  // varlen (cu_seqlens); empty: kT tokens each
};
void PrintTo(const RingFmtCase& c, std::ostream* os) { *os << c.name; }

// Four sequences over a pool of kS slots (layer kLayer of two), sequence 1 padded; L = 3 ring
// positions, fewer than the tokens: the last tokens record nothing.
constexpr int64_t kN = 4, kT = 4, kL = 3, kS = 7, kLayer = 1;
const std::vector<int64_t> kSlots{3, -1, 1, 5}, kRows{2, 0, -1, 1};
const std::vector<std::vector<int64_t>> kParents{
    {-1, 0, 0, 2}, {-1, 0, 1, 2}, {-1, -1, 1, 0}, {-1, 0, 1, 1}};

class GpuVerifyRingFormat : public GpuParamTest<RingFmtCase> {};

TEST_P(GpuVerifyRingFormat, MatchesCpu) {
  const RingFmtCase& c = GetParam();
  const Shape& s = c.shape;
  Rng rng = test_rng();
  const bool tree = c.mode == RingMode::sglang_tree;
  const QuantPools q = make_quant_pools(s, c.dtype, c.rounding, deltastate::PoolLayout::envelope, 2,
                                        kS, blocks_of(kLayer, kSlots), rng);
  RecurrentSpec spec = c.seqlens.empty() ? recurrent_spec(s, c.kda, bf16, kN, kT)
                                         : recurrent_spec(s, c.kda, bf16, 1, 0, c.seqlens);
  spec.lower_bound = c.kda ? kLb : kNoLb;
  RecurrentBatch rb = make_recurrent_batch(rng, spec);
  std::vector<int64_t> lens(kN, kT);
  if (!c.seqlens.empty()) lens = c.seqlens;
  Tensor idx = index_tensor(kSlots), rows = index_tensor(kRows, DType::i64);
  Tensor parents = Tensor::contiguous(DType::i32, {kN, kT});
  for (int64_t n = 0; n < kN; ++n)
    for (int64_t t = 0; t < kT; ++t) parents.set({n, t}, static_cast<double>(kParents[n][t]));
  const int64_t he = s.state_elems();
  Tensor inter = Tensor::contiguous(DType::f32, {kN, kT, s.HV, s.V, s.K});
  inter.fill_all(kSentinel);
  const Tensor inter0 = inter.empty_like();
  std::memcpy(inter0.alloc_base(), inter.alloc_base(), static_cast<size_t>(inter.alloc_bytes()));
  Tensor rv = Tensor::contiguous(c.ring, {kS, s.HV, kL, s.V});
  Tensor rk = Tensor::contiguous(c.ring, {kS, s.H, kL, s.K});
  Tensor rg = c.kda ? Tensor::contiguous(f32, {kS, s.HV, kL, s.K})
                    : Tensor::contiguous(f32, {kS, s.HV, kL});
  Tensor rbt = Tensor::contiguous(f32, {kS, s.HV, kL});
  for (Tensor* t : {&rv, &rk, &rg, &rbt}) t->fill_all(kSentinel);
  rb.poison_out();
  Mirror m;
  m.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, rb.cu, idx, rows,
               parents, inter, rv, rk, rg, rbt);
  auto run = [&](auto&& view_of, const deltastate::StatePool& p) {
    deltastate::VerifyArgs a = verify_inputs(rb.args(view_of), c.kda);
    a.state = p.layer_state(kLayer);
    a.state_format = format_of(p, kLayer, c.rounding);
    a.state_indices = view_of(idx);
    a.intermediate_states = view_of(inter);
    if (tree) {
      a.update_state = false;
      a.intermediate_state_indices = view_of(rows);
      a.parent_tokens = view_of(parents);
    }
    a.ring_v = view_of(rv);
    a.ring_k = view_of(rk);
    a.ring_g = view_of(rg);
    a.ring_beta = view_of(rbt);
    deltastate::verify(a);
  };
  run(host_view, *q.host);
  run(m.views(), *q.dev);
  sync();
  EXPECT_NO_THROW(deltastate::check_errors());

  // outputs: a padded sequence's zero
  RecurrentBatch got = rb;
  got.out = m.download(rb.out);
  for (int64_t n = 0; n < kN; ++n)
    for (int64_t t = 0; t < lens[n]; ++t) {
      if (kSlots[n] < 0) EXPECT_TRUE(all_zero(got.out_token(n, t))) << "padded sequence " << n;
      else
        EXPECT_TRUE(close_vs_cpu(got.out_token(n, t), rb.out_token(n, t), kOutTol, bf16))
            << "sequence " << n << " token " << t;
    }

  // the float scratch: the (row, step) entries written within the fp32 tolerance, the others
  // bit-untouched
  const Tensor dinter = m.download(inter);
  for (int64_t row = 0; row < kN; ++row)
    for (int64_t t = 0; t < kT; ++t) {
      bool w = false;
      for (int64_t n = 0; n < kN; ++n)
        w = w || (kSlots[n] >= 0 && (tree ? kRows[n] : n) == row && t < lens[n]);
      const int64_t at = (row * kT + t) * he;
      const TensorView dv = dinter.view(), hv = inter.view(), v0 = inter0.view();
      if (w)
        EXPECT_TRUE(
            close_vs_cpu(view_values(dv, at, he), view_values(hv, at, he), kFp32StateTol, f32))
            << "scratch row " << row << " step " << t;
      else
        EXPECT_TRUE(Snapshot::equal_except(range_of(dv, at, he).begin, range_of(v0, at, he).begin,
                                           he * 4, {}))
            << "untouched scratch row " << row << " step " << t;
    }

  // the rings: position (slot, t) written by the sequence at that slot for t < min(L, its length)
  auto ring_written = [&](int64_t slot, int64_t t) {
    for (int64_t n = 0; n < kN; ++n)
      if (kSlots[n] == slot) return t < std::min(kL, lens[n]);
    return false;
  };
  // every element of a ring of [kS, heads, kL, width]: written ones by the CPU (not its sentinel),
  // the rest the sentinel, on both backends; `exact`: the device's bit-equal to the CPU's
  auto check_ring = [&](const char* name, const Tensor& host, int64_t heads, int64_t width,
                        bool exact) {
    SCOPED_TRACE(name);
    const Tensor dev = m.download(host);
    const std::vector<double> hvals = host.values(), dvals = dev.values();
    Tensor one = Tensor::contiguous(host.dtype(), {1});
    one.fill_all(kSentinel);
    const double sentinel = one.get_linear(0);  // as the ring's dtype stores it
    std::vector<double> hw, dw;
    for (int64_t slot = 0; slot < kS; ++slot)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t t = 0; t < kL; ++t)
          for (int64_t e = 0; e < width; ++e) {
            const int64_t i = ((slot * heads + h) * kL + t) * width + e;
            if (!ring_written(slot, t)) {
              ASSERT_EQ(hvals[i], sentinel) << "the CPU wrote slot " << slot << " t " << t;
              ASSERT_EQ(dvals[i], sentinel) << "the GPU wrote slot " << slot << " t " << t;
              continue;
            }
            ASSERT_NE(hvals[i], sentinel) << "the CPU left slot " << slot << " t " << t;
            if (exact) {
              ASSERT_EQ(std::memcmp(&hvals[i], &dvals[i], sizeof(double)), 0)
                  << "slot " << slot << " head " << h << " t " << t << " element " << e;
            }
            hw.push_back(hvals[i]);
            dw.push_back(dvals[i]);
          }
    EXPECT_TRUE(close_vs_cpu(dw, hw, Tol{1e-6, 1e-5}, f32));
  };
  check_ring("ring_v", rv, s.HV, s.V, true);
  check_ring("ring_k", rk, s.H, s.K, true);
  check_ring("ring_g", rg, s.HV, c.kda ? s.K : 1, false);
  check_ring("ring_beta", rbt, s.HV, 1, false);

  // the pool: written slots within one quantum, every other byte and the step counter equal
  if (q.stochastic) {
    EXPECT_EQ(host_step(q, kLayer), kStep0 + 1);
  }
  expect_pools_match(q, c.dtype, tree ? std::vector<Block>{} : blocks_of(kLayer, kSlots));
}

INSTANTIATE_TEST_SUITE_P(Cuda, GpuVerifyRingFormat,
                         ::testing::Values(RingFmtCase{"gdn_fp8_default_sglang_tree",
                                                       false,
                                                       kQwen3Next,
                                                       DType::f8e4m3,
                                                       StateRounding::format_default,
                                                       RingMode::sglang_tree,
                                                       bf16,
                                                       {}},
                                           RingFmtCase{"gdn_int8_rn_in_place",
                                                       false,
                                                       kQwen3Next,
                                                       DType::i8,
                                                       StateRounding::nearest,
                                                       RingMode::in_place,
                                                       f32,
                                                       {}},
                                           RingFmtCase{"gdn_fp8_default_in_place_varlen",
                                                       false,
                                                       kQwen3Next,
                                                       DType::f8e4m3,
                                                       StateRounding::format_default,
                                                       RingMode::in_place,
                                                       bf16,
                                                       {4, 2, 1, 3}},
                                           RingFmtCase{"kda_odd_fp8_default_in_place",
                                                       true,
                                                       kOdd,
                                                       DType::f8e4m3,
                                                       StateRounding::format_default,
                                                       RingMode::in_place,
                                                       bf16,
                                                       {}},
                                           RingFmtCase{"kda_odd_int8_rn_sglang_tree_varlen",
                                                       true,
                                                       kOdd,
                                                       DType::i8,
                                                       StateRounding::nearest,
                                                       RingMode::sglang_tree,
                                                       f32,
                                                       {2, 4, 3, 1}},
                                           RingFmtCase{"kda_kimi_int8_rn_sglang_tree",
                                                       true,
                                                       kKimi,
                                                       DType::i8,
                                                       StateRounding::nearest,
                                                       RingMode::sglang_tree,
                                                       bf16,
                                                       {}}),
                         [](const ::testing::TestParamInfo<RingFmtCase>& i) {
                           return std::string(i.param.name);
                         });

}  // namespace
}  // namespace dstest
