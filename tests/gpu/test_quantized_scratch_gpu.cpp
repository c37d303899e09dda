// A quantized verify scratch (issue #36): speculative verify on a quantized pool with
// intermediate_states in float8_e4m3fn / int8 and its fp32 intermediate_state_scales, and the
// state commit from it, on the CUDA backend (src/cuda/verify/fmt.cuh) against the CPU backend,
// the oracle. Every test skips when no CUDA device is present.
//
// Tolerances, from the format's resolution (as tests/gpu/test_state_format_gpu.cpp's): both
// backends compute each token's state in fp32 (to 1e-5 relative of each other) and store it with
// the same rules and random bits (core/state_format.h), so a stored code may differ by one
// quantum of its row where the two fp32 values straddle a rounding boundary (int8: the scale;
// e4m3: 2^-3 of the value, 2^-9 of the scale in the subnormal range), plus the fp32 tolerance;
// scales (amax / qmax) to 1e-4 relative; at most 2% of the codes differing. A tree token starts
// from its parent's stored entry, which may itself differ by one quantum: entries of a tree are
// checked within two, and their rows' scales within the amax a parent row's difference e can
// move: x = alpha p + k u with u = beta (v - p . k), so |dx_c| <= |e_c| + |k_c| |e . k| <=
// ||e||_inf + ||e||_2 (alpha, beta <= 1, |k| = 1), over qmax. The commit from a quantized scratch
// reads the same bytes on both backends and runs the same IEEE operations (a product, a division,
// no contraction): it must agree bit for bit. Every byte a call does not write (sentinel scratch
// entries, 1e30 scales, unused pool slots) must be bit-untouched.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpu/gpu_util.h"
#include "gpu/quant_pools.h"
#include "test_util.h"

namespace dstest {
namespace {

constexpr uint8_t kCodeSentinel = 0x5a;
constexpr float kScaleSentinel = 1e30f;

// A quantized host pool and its device twin (quant_pools.h) in the envelope layout: sentinels,
// random codes and scales in the `live` slots of every layer, the step counters at kStep0.
QuantPools make_pools(const Shape& s, DType dtype, StateRounding rounding, int64_t layers,
                      int64_t slots, const std::vector<int64_t>& live, Rng& rng) {
  return make_quant_pools(s, dtype, rounding, deltastate::PoolLayout::envelope, layers, slots,
                          blocks_in_layers(layers, live), rng);
}

// A quantized scratch: codes [lead..., HV, V, K] (sentinel bytes) and scales [lead..., HV, V]
// (1e30), host tensors.
struct Scratch {
  Tensor codes, scales;
  Scratch(DType dtype, std::vector<int64_t> lead, const Shape& s) {
    std::vector<int64_t> cs = lead, ss = lead;
    cs.insert(cs.end(), {s.HV, s.V, s.K});
    ss.insert(ss.end(), {s.HV, s.V});
    codes = Tensor::contiguous(dtype, cs);
    scales = Tensor::contiguous(DType::f32, ss);
    std::memset(codes.alloc_base(), kCodeSentinel, static_cast<size_t>(codes.alloc_bytes()));
    float* sc = static_cast<float*>(scales.alloc_base());
    std::fill(sc, sc + scales.alloc_bytes() / 4, kScaleSentinel);
  }
};

// `rows` quantized rows of K codes with their scales, device (d) against host (h): scales to 1e-4
// relative (plus scale_slack[r] where given), dequantized codes within `quanta` quanta of the row
// plus the fp32 tolerance. Adds to the counts of codes compared and differing.
::testing::AssertionResult rows_close(const uint8_t* hc, const float* hs, const uint8_t* dc,
                                      const float* ds, int64_t rows, int64_t K, DType t,
                                      double quanta, int64_t& total, int64_t& differ,
                                      const std::vector<double>* scale_slack = nullptr) {
  const bool fp8 = t == DType::f8e4m3;
  for (int64_t r = 0; r < rows; ++r) {
    const double slack = scale_slack ? (*scale_slack)[static_cast<size_t>(r)] : 0.0;
    if (!(std::fabs(ds[r] - hs[r]) <= 1e-4 * std::fabs(hs[r]) + slack))
      return ::testing::AssertionFailure()
             << "scale of row " << r << ": " << ds[r] << " (cpu " << hs[r] << ")";
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t a = hc[r * K + k], b = dc[r * K + k];
      ++total;
      if (a == b) continue;
      ++differ;
      const double hv = code_value(a, t) * hs[r], dv = code_value(b, t) * ds[r];
      const double quantum = fp8 ? std::max(std::max(std::fabs(hv), std::fabs(dv)) * 0.125,
                                            hs[r] * std::ldexp(1.0, -9))
                                 : hs[r];
      if (!(std::fabs(dv - hv) <= quanta * quantum * 1.0001 + 1e-5 * hs[r] * (fp8 ? 448 : 127)))
        return ::testing::AssertionFailure()
               << "row " << r << " k " << k << ": " << dv << " (cpu " << hv << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// ---- verify with a quantized scratch ----------------------------------------------------------
// SGLang's convention (scratch rows, an EAGLE tree, no write-back) and FlashInfer's (the scratch by
// batch row, the final state in place).
enum class ScratchMode { tree, in_place };

struct ScratchVerifyCase {
  const char* name;
  bool kda;
  Shape shape;
  DType pool;
  StateRounding rounding;
  DType scratch;
  ScratchMode mode;
};
void PrintTo(const ScratchVerifyCase& c, std::ostream* os) { *os << c.name; }

// Four sequences of three tokens, sequence 1 padded; start slots 5, 2, 9 (of 12), scratch rows
// 3, 0, -1 (a chain without a scratch row), 1 in the tree (row 0 then stays untouched), row n by
// batch row in place. T_alloc 4: step 3 is never written. Parents: token 2 of sequence 0 reloads
// entry 0, sequence 2's token 2 the start state, sequence 3's token 2 entry 0.
constexpr int64_t kN = 4, kT = 3, kTA = 4, kSlots = 12, kLayer = 1;
const std::vector<int64_t> kIdx{5, -1, 2, 9}, kRows{3, 0, -1, 1};
const std::vector<std::vector<int64_t>> kParents{{-1, 0, 0}, {-1, 0, 1}, {-1, 0, -1}, {-1, 0, 0}};

class GpuQuantizedScratchVerify : public GpuParamTest<ScratchVerifyCase> {};

// One verify call on a host pool and its device twin, each with its quantized scratch (sentinel-
// filled, the same on both): outputs (padding zero), written scratch entries within one quantum
// (two in a tree), every other entry's codes and scales bit-untouched, the pool's final-state
// slots within one quantum and every other byte bit-identical, the step counter +1.
TEST_P(GpuQuantizedScratchVerify, MatchesCpu) {
  const ScratchVerifyCase& c = GetParam();
  const Shape s = c.shape;
  const bool tree = c.mode == ScratchMode::tree;
  Rng rng = test_rng();
  const QuantPools p = make_pools(s, c.pool, c.rounding, 2, kSlots, {5, 2, 9}, rng);
  RecurrentBatch rb = make_recurrent_batch(rng, recurrent_spec(s, c.kda, bf16, kN, kT));
  Tensor idx = index_tensor(kIdx), rows = index_tensor(kRows, DType::i64);
  Tensor parents = Tensor::contiguous(DType::i32, {kN, kT});
  for (int64_t n = 0; n < kN; ++n)
    for (int64_t t = 0; t < kT; ++t) parents.set({n, t}, static_cast<double>(kParents[n][t]));
  Scratch scr(c.scratch, {kN, kTA}, s);
  Scratch scr0(c.scratch, {kN, kTA}, s);  // the untouched bytes, for comparison
  rb.poison_out();
  Mirror m;
  m.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, idx, rows, parents,
               scr.codes, scr.scales);
  auto run = [&](auto&& view_of, const StatePool& pool) {
    deltastate::VerifyArgs a = verify_inputs(rb.args(view_of), c.kda);
    a.state = pool.layer_state(kLayer);
    a.state_format = format_of(pool, kLayer, c.rounding);
    a.state_indices = view_of(idx);
    a.intermediate_states = view_of(scr.codes);
    a.intermediate_state_scales = view_of(scr.scales);
    if (tree) {
      a.update_state = false;
      a.intermediate_state_indices = view_of(rows);
      a.parent_tokens = view_of(parents);
    }
    deltastate::verify(a);
  };
  run(host_view, *p.host);
  run(m.views(), *p.dev);
  sync();
  EXPECT_NO_THROW(deltastate::check_errors());

  RecurrentBatch got = rb;
  got.out = m.download(rb.out);
  for (int64_t n = 0; n < kN; ++n)
    for (int64_t t = 0; t < kT; ++t) {
      if (kIdx[n] < 0) EXPECT_TRUE(all_zero(got.out_token(n, t))) << "padded, token " << t;
      else
        EXPECT_TRUE(close_vs_cpu(got.out_token(n, t), rb.out_token(n, t), kOutTol, bf16))
            << "sequence " << n << " token " << t;
    }

  // the scratch: the entries (row, t < T) of the live sequences written, the rest untouched
  const Tensor dcodes = m.download(scr.codes), dscales = m.download(scr.scales);
  const int64_t he = s.state_elems(), hr = int64_t{s.HV} * s.V;
  int64_t total = 0, differ = 0;
  for (int64_t row = 0; row < kN; ++row)
    for (int64_t t = 0; t < kTA; ++t) {
      SCOPED_TRACE("scratch row " + std::to_string(row) + " step " + std::to_string(t));
      bool written = false;
      for (int64_t n = 0; n < kN; ++n)
        written |= kIdx[n] >= 0 && t < kT && (tree ? kRows[n] : n) == row;
      const int64_t e = row * kTA + t;
      const uint8_t* hc = static_cast<const uint8_t*>(scr.codes.alloc_base()) + e * he;
      const uint8_t* dc = static_cast<const uint8_t*>(dcodes.alloc_base()) + e * he;
      const float* hs = static_cast<const float*>(scr.scales.alloc_base()) + e * hr;
      const float* ds = static_cast<const float*>(dscales.alloc_base()) + e * hr;
      if (written) {
        // a tree token from its parent's stored entry: the scales' slack from that entry's
        // difference between the backends, row by row (the header)
        std::vector<double> slack;
        for (int64_t n = 0; n < kN && tree; ++n) {
          const int64_t parent = kIdx[n] >= 0 && kRows[n] == row ? kParents[n][t] : -1;
          if (parent < 0) continue;
          const int64_t pe = row * kTA + parent;
          const uint8_t* phc = static_cast<const uint8_t*>(scr.codes.alloc_base()) + pe * he;
          const uint8_t* pdc = static_cast<const uint8_t*>(dcodes.alloc_base()) + pe * he;
          const float* phs = static_cast<const float*>(scr.scales.alloc_base()) + pe * hr;
          const float* pds = static_cast<const float*>(dscales.alloc_base()) + pe * hr;
          const double qmax = c.scratch == DType::f8e4m3 ? 448.0 : 127.0;
          slack.assign(static_cast<size_t>(hr), 0.0);
          for (int64_t r = 0; r < hr; ++r) {
            double inf = 0.0, sq = 0.0;
            for (int64_t k = 0; k < s.K; ++k) {
              const double d = code_value(pdc[r * s.K + k], c.scratch) * pds[r] -
                               code_value(phc[r * s.K + k], c.scratch) * phs[r];
              inf = std::max(inf, std::fabs(d));
              sq += d * d;
            }
            slack[static_cast<size_t>(r)] = 1.0001 * (inf + std::sqrt(sq)) / qmax;
          }
        }
        EXPECT_TRUE(rows_close(hc, hs, dc, ds, hr, s.K, c.scratch, tree ? 2.0 : 1.0, total, differ,
                               slack.empty() ? nullptr : &slack));
      } else {
        const uint8_t* c0 = static_cast<const uint8_t*>(scr0.codes.alloc_base()) + e * he;
        const float* s0 = static_cast<const float*>(scr0.scales.alloc_base()) + e * hr;
        EXPECT_EQ(std::memcmp(dc, c0, static_cast<size_t>(he)), 0) << "codes touched";
        EXPECT_EQ(std::memcmp(ds, s0, static_cast<size_t>(hr) * 4), 0) << "scales touched";
        EXPECT_EQ(std::memcmp(hc, c0, static_cast<size_t>(he)), 0) << "cpu codes touched";
      }
    }
  EXPECT_LE(differ, total / 50) << differ << " of " << total << " scratch codes differ";

  // the pool: the final states in place (FlashInfer's convention), nothing else
  const std::vector<uint8_t> d = p.device_bytes();
  const char* hbase = static_cast<const char*>(p.host->data());
  const char* dbase = reinterpret_cast<const char*>(d.data());
  std::vector<MemRange> allowed;
  const TensorView st = p.host->layer_state(kLayer), sc = p.host->layer_scales(kLayer);
  total = differ = 0;
  for (int64_t n = 0; n < kN && !tree; ++n) {
    if (kIdx[n] < 0) continue;
    const int64_t co = static_cast<const char*>(st.data) - hbase + kIdx[n] * st.stride[0];
    const int64_t so = static_cast<const char*>(sc.data) - hbase + kIdx[n] * sc.stride[0] * 4;
    EXPECT_TRUE(rows_close(
        reinterpret_cast<const uint8_t*>(hbase + co), reinterpret_cast<const float*>(hbase + so),
        reinterpret_cast<const uint8_t*>(dbase + co), reinterpret_cast<const float*>(dbase + so),
        hr, s.K, c.pool, 1.0, total, differ))
        << "final state of slot " << kIdx[n];
    allowed.push_back({dbase + co, dbase + co + he});
    allowed.push_back({dbase + so, dbase + so + hr * 4});
  }
  EXPECT_LE(differ, total / 50) << differ << " of " << total << " pool codes differ";
  if (p.host->config().stochastic_rounding()) {
    EXPECT_EQ(*static_cast<const int64_t*>(p.host->rounding_step(kLayer).data), kStep0 + 1);
    // the device's counter: like the host's (compared with the rest of the bytes)
  }
  EXPECT_TRUE(Snapshot::equal_except(d.data(), p.host->data(), p.bytes, allowed))
      << "device pool outside the final states";
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuQuantizedScratchVerify,
    ::testing::Values(
        ScratchVerifyCase{"gdn_fp8_sr_fp8_scratch_tree", false, kQwen3Next, DType::f8e4m3,
                          StateRounding::stochastic, DType::f8e4m3, ScratchMode::tree},
        ScratchVerifyCase{"gdn_int8_rn_int8_scratch_tree", false, kQwen3Next, DType::i8,
                          StateRounding::nearest, DType::i8, ScratchMode::tree},
        ScratchVerifyCase{"gdn_int8_rn_fp8_scratch_in_place", false, kQwen3Next, DType::i8,
                          StateRounding::nearest, DType::f8e4m3, ScratchMode::in_place},
        ScratchVerifyCase{"odd_fp8_rn_int8_scratch_tree", false, kOdd, DType::f8e4m3,
                          StateRounding::nearest, DType::i8, ScratchMode::tree},
        ScratchVerifyCase{"kda_fp8_sr_fp8_scratch_in_place", true, kKimi, DType::f8e4m3,
                          StateRounding::stochastic, DType::f8e4m3, ScratchMode::in_place},
        ScratchVerifyCase{"kda_int8_sr_int8_scratch_tree", true, kKimi, DType::i8,
                          StateRounding::stochastic, DType::i8, ScratchMode::tree}),
    case_name<ScratchVerifyCase>);

// ---- the commit from a quantized scratch ------------------------------------------------------
struct ScratchCommitCase {
  const char* name;
  DType pool;
  StateRounding rounding;
  DType scratch;
};
void PrintTo(const ScratchCommitCase& c, std::ostream* os) { *os << c.name; }

class GpuQuantizedScratchCommit : public GpuParamTest<ScratchCommitCase> {};

// The commit of every layer from one quantized scratch [layers, rows, steps, ...] holding random
// codes and scales, uploaded as it is: the device pool must equal the host pool byte for byte
// (copied entries of the pool's dtype, requantized ones of the other, every other slot and the
// step counters); a copied slot holds its entry's bytes.
TEST_P(GpuQuantizedScratchCommit, MatchesCpuBitForBit) {
  const ScratchCommitCase& c = GetParam();
  const Shape s = kQwen3Next;
  const int64_t layers = 2, rows = 4, steps = 3;
  Rng rng = test_rng();
  const QuantPools p = make_pools(s, c.pool, c.rounding, layers, 9, {4, 6, 8, 2}, rng);
  Scratch scr(c.scratch, {layers, rows, steps}, s);
  uint8_t* codes = static_cast<uint8_t*>(scr.codes.alloc_base());
  for (int64_t i = 0; i < scr.codes.alloc_bytes(); ++i) codes[i] = random_code(rng, c.scratch);
  float* scales = static_cast<float*>(scr.scales.alloc_base());
  for (int64_t i = 0; i < scr.scales.alloc_bytes() / 4; ++i)
    scales[i] = static_cast<float>(rng.uniform(0.1, 1.0) / (c.scratch == DType::i8 ? 127 : 448));
  // request: slot, accepted, scratch row (b1 padded, b2 nothing accepted, b3 no row)
  const Tensor idx = index_tensor({4, -1, 6, 8, 2}), acc = index_tensor({2, 3, 0, 1, 3}),
               rws = index_tensor({1, 0, 2, -1, 3}, DType::i64);
  Mirror m;
  m.upload_all(scr.codes, scr.scales, idx, acc, rws);
  auto run = [&](auto&& view_of, const StatePool& pool) {
    deltastate::CommitArgs a;
    a.state = pool.states();
    a.intermediate_states = view_of(scr.codes);
    a.intermediate_state_scales = view_of(scr.scales);
    a.state_indices = view_of(idx);
    a.accepted = view_of(acc);
    a.intermediate_state_indices = view_of(rws);
    a.state_format.scales = pool.scales();
    a.state_format.rounding = c.rounding;
    if (pool.config().stochastic_rounding()) {
      a.state_format.step = pool.rounding_steps();
      a.state_format.seed = kSeed;
    }
    deltastate::update_state_after_verify(a);
  };
  run(host_view, *p.host);
  run(m.views(), *p.dev);
  sync();
  EXPECT_NO_THROW(deltastate::check_errors());
  const std::vector<uint8_t> d = p.device_bytes();
  EXPECT_TRUE(Snapshot::equal_except(d.data(), p.host->data(), p.bytes, {}))
      << "device pool against the cpu's";
  if (p.host->config().stochastic_rounding()) {
    for (int64_t l = 0; l < layers; ++l) {
      EXPECT_EQ(*static_cast<const int64_t*>(p.host->rounding_step(l).data), kStep0 + 1);
    }
  }
  // the written slots 4 (row 1, step 1) and 2 (row 3, step 2) changed; a copy holds the entry
  const int64_t he = s.state_elems(), hr = int64_t{s.HV} * s.V;
  const std::vector<std::pair<int64_t, int64_t>> committed{{4, 1 * steps + 1}, {2, 3 * steps + 2}};
  for (int64_t l = 0; l < layers; ++l)
    for (const auto& [slot, entry] : committed) {
      const TensorView st = p.host->layer_state(l), sc = p.host->layer_scales(l);
      const uint8_t* pc = static_cast<const uint8_t*>(st.data) + slot * st.stride[0];
      const float* ps = static_cast<const float*>(sc.data) + slot * sc.stride[0];
      const int64_t e = l * rows * steps + entry;
      const bool same_codes = std::memcmp(pc, codes + e * he, static_cast<size_t>(he)) == 0;
      const bool same_scales = std::memcmp(ps, scales + e * hr, static_cast<size_t>(hr) * 4) == 0;
      if (c.scratch == c.pool) {
        EXPECT_TRUE(same_codes && same_scales) << "layer " << l << " slot " << slot << ": a copy";
      } else {
        EXPECT_FALSE(same_scales) << "layer " << l << " slot " << slot << ": requantized";
      }
    }
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuQuantizedScratchCommit,
    ::testing::Values(
        ScratchCommitCase{"fp8_sr_fp8_scratch", DType::f8e4m3, StateRounding::stochastic,
                          DType::f8e4m3},
        ScratchCommitCase{"int8_rn_int8_scratch", DType::i8, StateRounding::nearest, DType::i8},
        ScratchCommitCase{"fp8_sr_int8_scratch", DType::f8e4m3, StateRounding::stochastic,
                          DType::i8},
        ScratchCommitCase{"int8_rn_fp8_scratch", DType::i8, StateRounding::nearest, DType::f8e4m3}),
    case_name<ScratchCommitCase>);

// A verify into an fp8 scratch (a tree, no write-back) and the commit of its accepted entries
// captured in one CUDA graph and replayed three times, against three eager calls on a second
// device pool and scratch: pools and scratches bit-identical (each replay read the device's step
// counter: +2 a replay, the verify's and the commit's).
TEST_F(GpuTest, QuantizedScratchVerifyCommitGraphReplay) {
  const Shape s = kOdd;
  Rng rng = test_rng();
  const QuantPools p =
      make_pools(s, DType::f8e4m3, StateRounding::format_default, 2, 4, {2, 0}, rng);
  StatePool eager(p.dev->config());
  CUDA_CHECK(cudaMemcpy(eager.data(), p.dev->data(), static_cast<size_t>(p.bytes),
                        cudaMemcpyDeviceToDevice));
  RecurrentBatch rb = make_recurrent_batch(rng, recurrent_spec(s, false, f32, 3, 3));
  Tensor idx = index_tensor({2, -1, 0}), acc = index_tensor({3, 0, 2});
  Tensor parents = Tensor::contiguous(DType::i32, {3, 3});
  for (int64_t n = 0; n < 3; ++n)
    for (int64_t t = 0; t < 3; ++t) parents.set({n, t}, t == 2 ? 0.0 : t - 1.0);
  Scratch a(DType::f8e4m3, {3, 3}, s), b(DType::f8e4m3, {3, 3}, s);
  Mirror m;
  m.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, idx, acc, parents,
               a.codes, a.scales, b.codes, b.scales);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto step = [&](const StatePool& pool, const Scratch& scr) {
    deltastate::VerifyArgs va = verify_inputs(rb.args(m.views()), false);
    va.state = pool.layer_state(kLayer);
    va.state_format = format_of(pool, kLayer, StateRounding::format_default);
    va.state_indices = m.view(idx);
    va.update_state = false;
    va.intermediate_states = m.view(scr.codes);
    va.intermediate_state_scales = m.view(scr.scales);
    va.parent_tokens = m.view(parents);
    va.stream = stream;
    deltastate::verify(va);
    deltastate::CommitArgs ca;
    ca.state = pool.layer_state(kLayer);
    ca.intermediate_states = m.view(scr.codes);
    ca.intermediate_state_scales = m.view(scr.scales);
    ca.state_indices = m.view(idx);
    ca.accepted = m.view(acc);
    ca.state_format = format_of(pool, kLayer, StateRounding::format_default);
    ca.stream = stream;
    deltastate::update_state_after_verify(ca);
  };
  for (int i = 0; i < 3; ++i) step(eager, b);
  replay_graph(stream, 3, [&] { step(*p.dev, a); });
  int64_t got = 0;
  CUDA_CHECK(cudaMemcpy(&got, p.dev->rounding_step(kLayer).data, 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, kStep0 + 6);
  EXPECT_TRUE(same_device_bytes(p.dev->data(), eager.data(), p.bytes))
      << "graph replays against eager calls: the pool";
  const Tensor ac = m.download(a.codes), bc = m.download(b.codes);
  const Tensor as = m.download(a.scales), bs = m.download(b.scales);
  EXPECT_EQ(std::memcmp(ac.alloc_base(), bc.alloc_base(), static_cast<size_t>(ac.alloc_bytes())), 0)
      << "the scratch codes";
  EXPECT_EQ(std::memcmp(as.alloc_base(), bs.alloc_base(), static_cast<size_t>(as.alloc_bytes())), 0)
      << "the scratch scales";
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace dstest
