// Quantized state pools (float8_e4m3fn, int8 with fp32 scales) and stochastic rounding on the
// CUDA backend (packed decode and the recurrent op, on the direct kernel's formatted-state twin)
// against the CPU backend, the oracle. Every test skips when no CUDA device is present.
//
// Tolerances come from the format's resolution: both backends compute the step in fp32 (to 1e-5
// relative of each other) and round with the same rules and random bits (core/state_format.h),
// so a stored code may differ by one quantum where the two fp32 values straddle a rounding
// boundary (or, stochastically, the uniform threshold): every dequantized element must agree
// within one quantum of its row (int8: the scale; e4m3: 2^-3 of the value, 2^-9 of the scale in
// the subnormal range) plus the fp32 tolerance, and the scales (amax / qmax) to 1e-4 relative.
// Most codes agree exactly: at most 2% may differ.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gpu/gpu_errors.h"
#include "gpu/gpu_util.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::PackedDecodeArgs;
using deltastate::RecurrentArgs;
using deltastate::StatePool;
using deltastate::StatePoolConfig;
using deltastate::StateRounding;

double e4m3_value(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (c & 0x80) ? -v : v;
}

// A (layer, slot) block of a pool.
struct Block {
  int64_t layer, slot;
};
std::vector<Block> blocks_of(int64_t layer, const std::vector<int64_t>& slots) {
  std::vector<Block> b;
  for (int64_t slot : slots)
    if (slot >= 0) b.push_back({layer, slot});
  return b;
}

// A host pool in a quantized format and its device twin: every byte a sentinel (0x5a), then random
// codes (no NaN, no -128) and scales in the `live` blocks; stochastic: every layer's step counter
// at kStep0. push() copies the host pool's bytes onto the device.
constexpr int64_t kStep0 = 41;
constexpr int64_t kSeed = 1234;
struct QuantPools {
  std::unique_ptr<StatePool> host, dev;
  int64_t bytes = 0;
  bool stochastic = false;
  void push() const {
    CUDA_CHECK(
        cudaMemcpy(dev->data(), host->data(), static_cast<size_t>(bytes), cudaMemcpyHostToDevice));
  }
};
QuantPools make_quant_pools(const Shape& s, DType dtype, StateRounding rounding,
                            deltastate::PoolLayout layout, int64_t layers, int64_t slots,
                            const std::vector<Block>& live, Rng& rng) {
  StatePoolConfig cfg;
  cfg.layers = layers;
  cfg.slots = slots;
  cfg.HV = s.HV;
  cfg.V = s.V;
  cfg.K = s.K;
  cfg.state_dtype = dtype;
  cfg.state_rounding = rounding;
  cfg.rounding_seed = kSeed;
  cfg.layout = layout;
  QuantPools q;
  q.host = std::make_unique<StatePool>(cfg);
  cfg.device = Device::cuda(0);
  q.dev = std::make_unique<StatePool>(cfg);
  q.bytes = q.host->total_bytes();
  q.stochastic = q.host->config().stochastic_rounding();
  std::memset(q.host->data(), 0x5a, static_cast<size_t>(q.bytes));
  for (const Block& b : live) {
    const TensorView st = q.host->layer_state(b.layer), sc = q.host->layer_scales(b.layer);
    uint8_t* codes = static_cast<uint8_t*>(st.data) + b.slot * st.stride[0];
    for (int64_t i = 0; i < s.HV * s.V * s.K; ++i) {
      uint8_t c = static_cast<uint8_t>(rng.integer(0, 255));
      if (dtype == DType::f8e4m3 && (c & 0x7f) == 0x7f) c ^= 1;  // no NaN codes
      if (dtype == DType::i8 && c == 0x80) c = 0;                // no -128
      codes[i] = c;
    }
    float* scales = static_cast<float*>(sc.data) + b.slot * sc.stride[0];
    for (int64_t i = 0; i < s.HV * s.V; ++i)
      scales[i] = static_cast<float>(rng.uniform(0.1, 1.0) / (dtype == DType::i8 ? 127 : 448));
  }
  if (q.stochastic)
    for (int64_t l = 0; l < layers; ++l)
      *static_cast<int64_t*>(q.host->rounding_step(l).data) = kStep0;
  q.push();
  return q;
}

// An op's format keywords for `layer` of pool p (its scales; stochastic: its step counter).
deltastate::StateFormatArgs format_of(const StatePool& p, int64_t layer, StateRounding rounding) {
  deltastate::StateFormatArgs f;
  f.scales = p.layer_scales(layer);
  f.rounding = rounding;
  if (p.config().stochastic_rounding()) {
    f.step = p.rounding_step(layer);
    f.seed = kSeed;
    f.layer = layer;
  }
  return f;
}

int64_t host_step(const QuantPools& q, int64_t layer) {
  return *static_cast<const int64_t*>(q.host->rounding_step(layer).data);
}

// The device pool against the host pool after the same calls: in the `written` blocks, scales to
// 1e-4 relative and dequantized codes within one quantum (at most 2% of the codes differing);
// every layer's step counter equal; every other byte equal (sentinels, blocks not written).
void expect_pools_match(const QuantPools& q, DType dtype, const std::vector<Block>& written) {
  const StatePool &host = *q.host, &dev = *q.dev;
  const int64_t HV = host.config().HV, V = host.config().V, K = host.config().K;
  std::vector<uint8_t> d(static_cast<size_t>(q.bytes));
  CUDA_CHECK(cudaMemcpy(d.data(), dev.data(), d.size(), cudaMemcpyDeviceToHost));
  const char* hbase = static_cast<const char*>(host.data());
  const char* dbase = reinterpret_cast<const char*>(d.data());
  const bool fp8 = dtype == DType::f8e4m3;
  std::vector<MemRange> allowed;
  int64_t codes_total = 0, codes_differ = 0;
  for (const Block& b : written) {
    SCOPED_TRACE("layer " + std::to_string(b.layer) + " slot " + std::to_string(b.slot));
    const TensorView st = host.layer_state(b.layer), sc = host.layer_scales(b.layer);
    const int64_t code_off = static_cast<const char*>(st.data) - hbase + b.slot * st.stride[0];
    const int64_t scale_off = static_cast<const char*>(sc.data) - hbase + b.slot * sc.stride[0] * 4;
    allowed.push_back({dbase + code_off, dbase + code_off + HV * V * K});
    allowed.push_back({dbase + scale_off, dbase + scale_off + HV * V * 4});
    for (int64_t row = 0; row < HV * V; ++row) {
      float hs, ds;
      std::memcpy(&hs, hbase + scale_off + row * 4, 4);
      std::memcpy(&ds, dbase + scale_off + row * 4, 4);
      ASSERT_NEAR(ds, hs, 1e-4 * hs) << "scale of row " << row;
      for (int64_t k = 0; k < K; ++k) {
        const uint8_t hc = static_cast<uint8_t>(hbase[code_off + row * K + k]);
        const uint8_t dc = d[static_cast<size_t>(code_off + row * K + k)];
        ++codes_total;
        if (hc == dc) continue;
        ++codes_differ;
        const double hv = (fp8 ? e4m3_value(hc) : static_cast<int8_t>(hc)) * hs;
        const double dv = (fp8 ? e4m3_value(dc) : static_cast<int8_t>(dc)) * ds;
        const double quantum = fp8 ? std::max(std::fabs(hv) * 0.125, hs * std::ldexp(1.0, -9)) : hs;
        ASSERT_LE(std::fabs(dv - hv), quantum * 1.0001 + 1e-5 * hs * (fp8 ? 448 : 127))
            << "row " << row << " k " << k;
      }
    }
  }
  EXPECT_LE(codes_differ, codes_total / 50) << codes_differ << " of " << codes_total;
  if (q.stochastic) {
    for (int64_t l = 0; l < host.config().layers; ++l) {
      const int64_t off = static_cast<const char*>(dev.rounding_step(l).data) -
                          static_cast<const char*>(dev.data());
      int64_t got;
      std::memcpy(&got, dbase + off, 8);
      EXPECT_EQ(got, host_step(q, l)) << "the device's step counter of layer " << l;
      allowed.push_back({dbase + off, dbase + off + 8});
    }
  }
  EXPECT_TRUE(Snapshot::equal_except(d.data(), host.data(), q.bytes, allowed))
      << "device pool outside the written blocks' codes and scales";
}

struct QuantCase {
  const char* name;
  bool kda;
  DType dtype;
  StateRounding rounding;
  deltastate::PoolLayout layout;
};
void PrintTo(const QuantCase& c, std::ostream* os) { *os << c.name; }

class GpuQuantizedPackedDecode : public GpuParamTest<QuantCase> {};

// Two steps of packed decode on a host pool and its device copy: outputs, scales, dequantized
// states, the step counter, and every byte outside the live slots' blocks (sentinels).
TEST_P(GpuQuantizedPackedDecode, MatchesCpu) {
  const QuantCase& c = GetParam();
  const Shape s = c.kda ? kKimi : kQwen3Next;
  const int64_t layer = 1;
  Rng rng = test_rng();
  const std::vector<int64_t> slots{7, -1, 2, 5, 0};
  const QuantPools q =
      make_quant_pools(s, c.dtype, c.rounding, c.layout, 2, 9, blocks_of(layer, slots), rng);

  DecodeBatch batch = make_decode_batch(rng, s, c.kda, slots, bf16);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.K));
  Mirror m;
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step) batch.randomize(rng);
    batch.poison_out();
    m.upload_all(batch.x, batch.a, batch.b, batch.A_log, batch.dt_bias, batch.idx, batch.out);
    auto run = [&](PackedDecodeArgs a, const StatePool& p) {
      a.state_format = format_of(p, layer, c.rounding);
      if (c.kda) deltastate::kda_packed_decode(a);
      else deltastate::gdn_packed_decode(a);
    };
    run(batch.packed_args(host_view, q.host->layer_state(layer), scale), *q.host);
    run(batch.packed_args(m.views(), q.dev->layer_state(layer), scale), *q.dev);
    sync();
    EXPECT_NO_THROW(deltastate::check_errors());  // no bad row recorded
    const Tensor out = m.download(batch.out);
    for (int64_t r = 0; r < batch.B; ++r) {
      std::vector<double> g;
      for (int64_t hv = 0; hv < s.HV; ++hv)
        for (int64_t v = 0; v < s.V; ++v) g.push_back(out.get({r, 0, hv, v}));
      if (slots[r] < 0) EXPECT_TRUE(all_zero(g)) << "padded row " << r;
      else EXPECT_TRUE(close_vs_cpu(g, batch.out_row(r), kOutTol, bf16)) << "output row " << r;
    }
    if (q.stochastic) EXPECT_EQ(host_step(q, layer), kStep0 + step + 1);
    expect_pools_match(q, c.dtype, blocks_of(layer, slots));
    q.push();  // the next step starts both backends from the CPU's pool
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuQuantizedPackedDecode,
    ::testing::Values(QuantCase{"gdn_fp8_sr", false, DType::f8e4m3, StateRounding::format_default,
                                deltastate::PoolLayout::per_layer},
                      QuantCase{"gdn_int8_rn_envelope", false, DType::i8,
                                StateRounding::format_default, deltastate::PoolLayout::envelope},
                      QuantCase{"kda_fp8_rn_envelope", true, DType::f8e4m3, StateRounding::nearest,
                                deltastate::PoolLayout::envelope},
                      QuantCase{"kda_int8_sr", true, DType::i8, StateRounding::stochastic,
                                deltastate::PoolLayout::per_layer}),
    case_name<QuantCase>);

struct QuantRecurrentCase {
  const char* name;
  bool kda;
  DType dtype;
  StateRounding rounding;
  bool varlen;  // several sequences by cu_seqlens, else [B, T] with T > 1
};
void PrintTo(const QuantRecurrentCase& c, std::ostream* os) { *os << c.name; }

class GpuQuantizedRecurrent : public GpuParamTest<QuantRecurrentCase> {};

// The recurrent op's multi-token calls on a quantized pool updated in place (the state kept in
// fp32 through a sequence's tokens, stored once): two calls on a host pool and its device copy,
// each token's outputs (a padded sequence's zero), the live slots' codes and scales, the step
// counter, every other byte (sentinels).
TEST_P(GpuQuantizedRecurrent, MultiTokenMatchesCpu) {
  const QuantRecurrentCase& c = GetParam();
  const Shape s = c.kda ? kKimi : kQwen3Next;
  const int64_t layer = 1;
  Rng rng = test_rng();
  const std::vector<int64_t> slots =
      c.varlen ? std::vector<int64_t>{3, 7, -1, 0, 5} : std::vector<int64_t>{6, -1, 2, 8};
  const QuantPools q = make_quant_pools(s, c.dtype, c.rounding, deltastate::PoolLayout::per_layer,
                                        2, 9, blocks_of(layer, slots), rng);
  const RecurrentSpec spec = c.varlen ? recurrent_spec(s, c.kda, bf16, 1, 1, {3, 1, 4, 2, 5})
                                      : recurrent_spec(s, c.kda, bf16, 4, 3);
  RecurrentBatch rb = make_recurrent_batch(rng, spec);
  ASSERT_EQ(rb.N, static_cast<int64_t>(slots.size()));
  const Tensor idx = index_tensor(slots);
  Mirror m;
  for (int call = 0; call < 2; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    if (call) rb.randomize(rng);
    rb.poison_out();
    m.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, idx);
    if (c.varlen) m.upload(rb.cu);
    auto run = [&](RecurrentArgs a, const StatePool& p, const TensorView& indices) {
      a.state = p.layer_state(layer);
      a.state_indices = indices;
      a.state_format = format_of(p, layer, c.rounding);
      if (c.kda) deltastate::recurrent_kda(a);
      else deltastate::recurrent_gdn(a);
    };
    run(rb.args(host_view), *q.host, idx.view());
    run(rb.args(m.views()), *q.dev, m.view(idx));
    sync();
    EXPECT_NO_THROW(deltastate::check_errors());
    RecurrentBatch got = rb;
    got.out = m.download(rb.out);
    for (int64_t n = 0; n < rb.N; ++n)
      for (int64_t t = 0; t < rb.seq_len(n); ++t) {
        if (slots[n] < 0)
          EXPECT_TRUE(all_zero(got.out_token(n, t))) << "padded sequence " << n << " token " << t;
        else
          EXPECT_TRUE(close_vs_cpu(got.out_token(n, t), rb.out_token(n, t), kOutTol, bf16))
              << "sequence " << n << " token " << t;
      }
    if (q.stochastic) EXPECT_EQ(host_step(q, layer), kStep0 + call + 1);
    expect_pools_match(q, c.dtype, blocks_of(layer, slots));
    q.push();  // the next call starts both backends from the CPU's pool
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuQuantizedRecurrent,
    ::testing::Values(
        QuantRecurrentCase{"gdn_fp8_sr_T3", false, DType::f8e4m3, StateRounding::stochastic, false},
        QuantRecurrentCase{"gdn_fp8_sr_varlen", false, DType::f8e4m3, StateRounding::stochastic,
                           true},
        QuantRecurrentCase{"gdn_int8_rn_T3", false, DType::i8, StateRounding::nearest, false},
        QuantRecurrentCase{"gdn_int8_rn_varlen", false, DType::i8, StateRounding::nearest, true},
        QuantRecurrentCase{"kda_fp8_sr_T3", true, DType::f8e4m3, StateRounding::stochastic, false},
        QuantRecurrentCase{"kda_fp8_sr_varlen", true, DType::f8e4m3, StateRounding::stochastic,
                           true},
        QuantRecurrentCase{"kda_int8_rn_T3", true, DType::i8, StateRounding::nearest, false},
        QuantRecurrentCase{"kda_int8_rn_varlen", true, DType::i8, StateRounding::nearest, true}),
    case_name<QuantRecurrentCase>);

// CUDA-graph replay advances the stochastic-rounding step on the device: a captured packed
// decode replayed three times leaves the counter at 3, as three eager calls on the CPU do.
TEST_F(GpuTest, QuantizedGraphReplayAdvancesTheStep) {
  const Shape s = kOdd;
  StatePoolConfig cfg;
  cfg.slots = 4;
  cfg.HV = s.HV;
  cfg.V = s.V;
  cfg.K = s.K;
  cfg.state_dtype = DType::f8e4m3;
  cfg.device = Device::cuda(0);
  StatePool dev(cfg);
  Rng rng = test_rng();
  DecodeBatch batch = make_decode_batch(rng, s, false, {1, 3}, f32);
  Mirror m;
  m.upload_all(batch.x, batch.a, batch.b, batch.A_log, batch.dt_bias, batch.idx, batch.out);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  PackedDecodeArgs a = batch.packed_args(m.views(), dev.layer_state(0), 0.2);
  a.state_format.scales = dev.layer_scales(0);
  a.state_format.step = dev.rounding_step(0);
  a.stream = stream;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  deltastate::gdn_packed_decode(a);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) CUDA_CHECK(cudaGraphLaunch(exec, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  int64_t step = 0;
  CUDA_CHECK(cudaMemcpy(&step, dev.rounding_step(0).data, 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(step, 3);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace dstest
