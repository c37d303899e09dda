// Quantized state pools (float8_e4m3fn, int8 with fp32 scales) and stochastic rounding on the
// CUDA backend (packed decode and the recurrent op, on the direct kernel's formatted-state twin;
// the chunked prefill, through src/cuda/state_format.cuh) against the CPU backend, the oracle.
// Every test skips when no CUDA device is present.
//
// Tolerances come from the format's resolution: both backends compute the step in fp32 (to 1e-5
// relative of each other) and round with the same rules and random bits (core/state_format.h),
// so a stored code may differ by one quantum where the two fp32 values straddle a rounding
// boundary (or, stochastically, the uniform threshold): every dequantized element must agree
// within one quantum of its row (int8: the scale; e4m3: 2^-3 of the value, 2^-9 of the scale in
// the subnormal range) plus the fp32 tolerance, and the scales (amax / qmax) to 1e-4 relative.
// Most codes agree exactly: at most 2% may differ.
//
// The chunked prefill's fp32 states differ from the CPU's by its kernels' own error (bf16 tensor-
// core operands: tests/gpu/test_chunk_prefill_gpu.cpp, 3e-3 to 5e-3 of a state's norm), so there
// each dequantized element must agree within one quantum of its row plus 2e-2 of the row's amax,
// the scales to 2e-2 relative, the outputs to 8e-3 of their norm (bf16 outputs).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "gpu/gpu_errors.h"
#include "gpu/gpu_util.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::PackedDecodeArgs;
using deltastate::StatePool;
using deltastate::StatePoolConfig;
using deltastate::StateRounding;

double e4m3_value(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (c & 0x80) ? -v : v;
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
  StatePoolConfig cfg;
  cfg.layers = 2;
  cfg.slots = 9;
  cfg.HV = s.HV;
  cfg.V = s.V;
  cfg.K = s.K;
  cfg.state_dtype = c.dtype;
  cfg.state_rounding = c.rounding;
  cfg.rounding_seed = 1234;
  cfg.layout = c.layout;
  StatePool host(cfg);
  cfg.device = Device::cuda(0);
  StatePool dev(cfg);
  const int64_t bytes = host.total_bytes();
  const int64_t layer = 1;
  Rng rng = test_rng();
  // sentinel bytes everywhere, then random codes and scales in the live slots
  std::memset(host.data(), 0x5a, static_cast<size_t>(bytes));
  const std::vector<int64_t> slots{7, -1, 2, 5, 0};
  const TensorView st = host.layer_state(layer), sc = host.layer_scales(layer);
  for (int64_t slot : slots) {
    if (slot < 0) continue;
    uint8_t* codes = static_cast<uint8_t*>(st.data) + slot * st.stride[0];
    for (int64_t i = 0; i < s.HV * s.V * s.K; ++i) {
      uint8_t b = static_cast<uint8_t>(rng.integer(0, 255));
      if (c.dtype == DType::f8e4m3 && (b & 0x7f) == 0x7f) b ^= 1;  // no NaN codes
      if (c.dtype == DType::i8 && b == 0x80) b = 0;                // no -128
      codes[i] = b;
    }
    float* scales = static_cast<float*>(sc.data) + slot * sc.stride[0];
    for (int64_t i = 0; i < s.HV * s.V; ++i)
      scales[i] = static_cast<float>(rng.uniform(0.1, 1.0) / (c.dtype == DType::i8 ? 127 : 448));
  }
  const bool stochastic = host.config().stochastic_rounding();
  if (stochastic) *static_cast<int64_t*>(host.rounding_step(layer).data) = 41;
  CUDA_CHECK(
      cudaMemcpy(dev.data(), host.data(), static_cast<size_t>(bytes), cudaMemcpyHostToDevice));

  DecodeBatch batch = make_decode_batch(rng, s, c.kda, slots, bf16);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.K));
  Mirror m;
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step) batch.randomize(rng);
    batch.poison_out();
    m.upload_all(batch.x, batch.a, batch.b, batch.A_log, batch.dt_bias, batch.idx, batch.out);
    auto run = [&](PackedDecodeArgs a, const StatePool& p) {
      a.state_format.scales = p.layer_scales(layer);
      a.state_format.rounding = c.rounding;
      if (stochastic) {
        a.state_format.step = p.rounding_step(layer);
        a.state_format.seed = 1234;
        a.state_format.layer = layer;
      }
      if (c.kda) deltastate::kda_packed_decode(a);
      else deltastate::gdn_packed_decode(a);
    };
    run(batch.packed_args(host_view, host.layer_state(layer), scale), host);
    run(batch.packed_args(m.views(), dev.layer_state(layer), scale), dev);
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
    std::vector<uint8_t> d(static_cast<size_t>(bytes));
    CUDA_CHECK(cudaMemcpy(d.data(), dev.data(), d.size(), cudaMemcpyDeviceToHost));
    const char* hbase = static_cast<const char*>(host.data());
    std::vector<MemRange> written;
    int64_t codes_total = 0, codes_differ = 0;
    for (int64_t slot : slots) {
      if (slot < 0) continue;
      const int64_t code_off = static_cast<const char*>(st.data) - hbase + slot * st.stride[0];
      const int64_t scale_off = static_cast<const char*>(sc.data) - hbase + slot * sc.stride[0] * 4;
      const char* dc0 = reinterpret_cast<const char*>(d.data());
      written.push_back({dc0 + code_off, dc0 + code_off + s.HV * s.V * s.K});
      written.push_back({dc0 + scale_off, dc0 + scale_off + s.HV * s.V * 4});
      for (int64_t row = 0; row < s.HV * s.V; ++row) {
        float hs, ds;
        std::memcpy(&hs, hbase + scale_off + row * 4, 4);
        std::memcpy(&ds, d.data() + scale_off + row * 4, 4);
        ASSERT_NEAR(ds, hs, 1e-4 * hs) << "scale of slot " << slot << " row " << row;
        for (int64_t k = 0; k < s.K; ++k) {
          const uint8_t hc = static_cast<uint8_t>(hbase[code_off + row * s.K + k]);
          const uint8_t dc = d[static_cast<size_t>(code_off + row * s.K + k)];
          ++codes_total;
          if (hc == dc) continue;
          ++codes_differ;
          const bool fp8 = c.dtype == DType::f8e4m3;
          const double hv = (fp8 ? e4m3_value(hc) : static_cast<int8_t>(hc)) * hs;
          const double dv = (fp8 ? e4m3_value(dc) : static_cast<int8_t>(dc)) * ds;
          const double quantum =
              fp8 ? std::max(std::fabs(hv) * 0.125, hs * std::ldexp(1.0, -9)) : hs;
          ASSERT_LE(std::fabs(dv - hv), quantum * 1.0001 + 1e-5 * hs * (fp8 ? 448 : 127))
              << "slot " << slot << " row " << row << " k " << k;
        }
      }
    }
    EXPECT_LE(codes_differ, codes_total / 50) << codes_differ << " of " << codes_total;
    if (stochastic) {
      const int64_t want = 41 + step + 1;
      EXPECT_EQ(*static_cast<int64_t*>(host.rounding_step(layer).data), want);
      int64_t got = 0;
      CUDA_CHECK(cudaMemcpy(&got, dev.rounding_step(layer).data, 8, cudaMemcpyDeviceToHost));
      EXPECT_EQ(got, want) << "the device's step counter";
    }
    // everything else as the host pool holds it (sentinels; the step counter compared above)
    std::vector<MemRange> allowed = written;
    if (stochastic) {
      const int64_t off = static_cast<const char*>(dev.rounding_step(layer).data) -
                          static_cast<const char*>(dev.data());
      const char* dc0 = reinterpret_cast<const char*>(d.data());
      allowed.push_back({dc0 + off, dc0 + off + 8});
    }
    EXPECT_TRUE(Snapshot::equal_except(d.data(), host.data(), bytes, allowed))
        << "device pool outside the live slots' codes and scales";
    // the next step starts both backends from the CPU's pool
    CUDA_CHECK(
        cudaMemcpy(dev.data(), host.data(), static_cast<size_t>(bytes), cudaMemcpyHostToDevice));
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

// ---- the chunked prefill ----------------------------------------------------------------------
struct QuantPrefillCase {
  const char* name;
  Shape s;
  bool kda;
  DType dtype;
  StateRounding rounding;
  std::vector<int64_t> seqlens;  // sequence 1 (when there are several) is padded
  int64_t every;                 // checkpoint_every_n_tokens, into pool slots
  deltastate::PoolLayout layout;
};
void PrintTo(const QuantPrefillCase& c, std::ostream* os) { *os << c.name; }

class GpuQuantizedChunkPrefill : public GpuParamTest<QuantPrefillCase> {};

// Two chunked prefills (bf16 inputs, in place on the pool, checkpoints into pool slots, every
// third checkpoint slot -1, a padded sequence) on a host pool and its device copy, each from the
// CPU's pool of the call before: outputs, every written slot's scales and dequantized codes, the
// step counter (one advance per call), and every other byte of the pool (code sentinels 0x5a,
// scale sentinels 1e30) untouched.
TEST_P(GpuQuantizedChunkPrefill, MatchesCpu) {
  const QuantPrefillCase& c = GetParam();
  const Shape s = c.s;
  Rng rng = test_rng();
  RecurrentBatch rb =
      make_recurrent_batch(rng, recurrent_spec(s, c.kda, DType::bf16, 1, 0, c.seqlens));
  const int64_t N = rb.N;
  std::vector<int64_t> cu_starts{0};
  for (int64_t n = 0; n < N; ++n) cu_starts.push_back(cu_starts.back() + rb.seq_len(n) / c.every);
  const int64_t total = cu_starts.back();

  StatePoolConfig cfg;
  cfg.layers = 2;
  cfg.slots = N + total + 3;
  cfg.HV = s.HV;
  cfg.V = s.V;
  cfg.K = s.K;
  cfg.state_dtype = c.dtype;
  cfg.state_rounding = c.rounding;
  cfg.rounding_seed = 77;
  cfg.layout = c.layout;
  StatePool host(cfg);
  cfg.device = Device::cuda(0);
  StatePool dev(cfg);
  const int64_t bytes = host.total_bytes();
  const int64_t layer = 1;
  const bool fp8 = c.dtype == DType::f8e4m3;
  const double qmax = fp8 ? 448.0 : 127.0;

  std::vector<int64_t> perm(static_cast<size_t>(cfg.slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng.engine());
  size_t next = 0;
  std::vector<int64_t> in_slot(N), ck_slot(total);
  for (int64_t n = 0; n < N; ++n) in_slot[n] = N > 1 && n == 1 ? -1 : perm[next++];
  for (int64_t i = 0; i < total; ++i) ck_slot[i] = i % 3 == 2 ? -1 : perm[next++];

  // sentinels everywhere (codes 0x5a, every scale 1e30), then random live initial states
  std::memset(host.data(), 0x5a, static_cast<size_t>(bytes));
  const TensorView st = host.layer_state(layer), sc = host.layer_scales(layer);
  const int64_t rows = int64_t{s.HV} * s.V;
  for (int64_t l = 0; l < cfg.layers; ++l) {
    const TensorView lsc = host.layer_scales(l);
    for (int64_t slot = 0; slot < cfg.slots; ++slot)
      for (int64_t r = 0; r < rows; ++r)
        static_cast<float*>(lsc.data)[slot * lsc.stride[0] + r] = 1e30f;
  }
  for (int64_t slot : in_slot) {
    if (slot < 0) continue;
    uint8_t* codes = static_cast<uint8_t*>(st.data) + slot * st.stride[0];
    for (int64_t i = 0; i < rows * s.K; ++i) {
      uint8_t b = static_cast<uint8_t>(rng.integer(0, 255));
      if (fp8 && (b & 0x7f) == 0x7f) b ^= 1;  // no NaN codes
      if (!fp8 && b == 0x80) b = 0;           // no -128
      codes[i] = b;
    }
    float* scales = static_cast<float*>(sc.data) + slot * sc.stride[0];
    for (int64_t r = 0; r < rows; ++r) scales[r] = static_cast<float>(rng.uniform(0.1, 1.0) / qmax);
  }
  const bool stochastic = host.config().stochastic_rounding();
  if (stochastic) *static_cast<int64_t*>(host.rounding_step(layer).data) = 41;
  CUDA_CHECK(
      cudaMemcpy(dev.data(), host.data(), static_cast<size_t>(bytes), cudaMemcpyHostToDevice));

  const Tensor idx = index_tensor(in_slot), ck_idx = index_tensor(ck_slot),
               cu_starts_t = index_tensor(cu_starts);
  Mirror m;
  Tensor ws;
  for (int call = 0; call < 2; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    if (call) rb.randomize(rng);
    rb.poison_out();
    m.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, rb.cu, idx, ck_idx,
                 cu_starts_t);
    auto args = [&](auto&& view_of, const StatePool& p) {
      deltastate::ChunkPrefillArgs a;
      a.q = view_of(rb.q);
      a.k = view_of(rb.k);
      a.v = view_of(rb.v);
      a.g = view_of(rb.g);
      a.beta = view_of(rb.beta);
      a.out = view_of(rb.out);
      a.is_kda = c.kda;
      a.gate_in_kernel = true;
      a.A_log = view_of(rb.A_log);
      a.dt_bias = view_of(rb.dt_bias);
      a.beta_is_logit = rb.spec.beta_is_logit;
      a.cu_seqlens = view_of(rb.cu);
      a.use_qk_l2norm = true;
      a.initial_state = p.layer_state(layer);
      a.initial_state_indices = view_of(idx);
      a.checkpoint_every_n_tokens = c.every;
      a.checkpoint_cu_starts = view_of(cu_starts_t);
      a.checkpoint_slot_indices = view_of(ck_idx);
      a.state_format.scales = p.layer_scales(layer);
      a.state_format.rounding = c.rounding;
      if (stochastic) {
        a.state_format.step = p.rounding_step(layer);
        a.state_format.seed = 77;
        a.state_format.layer = layer;
      }
      return a;
    };
    deltastate::chunk_prefill(args(host_view, host));
    deltastate::ChunkPrefillArgs da = args(m.views(), dev);
    const int64_t ws_bytes = deltastate::chunk_prefill_workspace_bytes(da);
    if (ws_bytes > 0) {
      if (!ws.alloc_base()) {
        ws = Tensor::contiguous(DType::f32, {(ws_bytes + 3) / 4});
        ws.fill_all(std::nan(""));
        m.upload(ws);
      }
      da.workspace = m.view(ws);
    }
    deltastate::chunk_prefill(da);
    sync();
    EXPECT_NO_THROW(deltastate::check_errors());  // no bad row recorded

    // outputs: each live sequence within 8e-3 of its norm, the padded one zero
    const Tensor out = m.download(rb.out);
    for (int64_t n = 0; n < N; ++n) {
      double err2 = 0.0, ref2 = 0.0;
      bool zero = true;
      for (int64_t t = 0; t < rb.seq_len(n); ++t) {
        const auto [b, tok] = rb.coord(n, t);
        for (int64_t hv = 0; hv < s.HV; ++hv)
          for (int64_t v = 0; v < s.V; ++v) {
            const double g = out.get({b, tok, hv, v}), w = rb.out.get({b, tok, hv, v});
            ASSERT_TRUE(std::isfinite(g)) << "sequence " << n << " token " << t;
            err2 += (g - w) * (g - w);
            ref2 += w * w;
            zero = zero && g == 0.0;
          }
      }
      if (in_slot[n] < 0) EXPECT_TRUE(zero) << "padded sequence " << n;
      else EXPECT_LE(std::sqrt(err2 / std::max(ref2, 1e-30)), 8e-3) << "outputs of sequence " << n;
    }

    // the written slots: final states in place, checkpoint slots
    std::vector<int64_t> written_slots;
    for (int64_t slot : in_slot)
      if (slot >= 0) written_slots.push_back(slot);
    for (int64_t n = 0; n < N; ++n)  // a padded sequence stores no checkpoint
      for (int64_t i = cu_starts[n]; i < cu_starts[n + 1]; ++i)
        if (in_slot[n] >= 0 && ck_slot[i] >= 0) written_slots.push_back(ck_slot[i]);
    std::vector<uint8_t> d(static_cast<size_t>(bytes));
    CUDA_CHECK(cudaMemcpy(d.data(), dev.data(), d.size(), cudaMemcpyDeviceToHost));
    const char* hbase = static_cast<const char*>(host.data());
    const char* dc0 = reinterpret_cast<const char*>(d.data());
    std::vector<MemRange> written;
    for (int64_t slot : written_slots) {
      SCOPED_TRACE("slot " + std::to_string(slot));
      const int64_t code_off = static_cast<const char*>(st.data) - hbase + slot * st.stride[0];
      const int64_t scale_off = static_cast<const char*>(sc.data) - hbase + slot * sc.stride[0] * 4;
      written.push_back({dc0 + code_off, dc0 + code_off + rows * s.K});
      written.push_back({dc0 + scale_off, dc0 + scale_off + rows * 4});
      double err2 = 0.0, ref2 = 0.0;
      for (int64_t row = 0; row < rows; ++row) {
        float hs, ds;
        std::memcpy(&hs, hbase + scale_off + row * 4, 4);
        std::memcpy(&ds, dc0 + scale_off + row * 4, 4);
        ASSERT_TRUE(std::isfinite(hs) && hs < 1e29f) << "the CPU did not write row " << row;
        ASSERT_NEAR(ds, hs, 2e-2 * hs) << "scale of row " << row;
        const double amax = hs * qmax;
        for (int64_t k = 0; k < s.K; ++k) {
          const uint8_t hc = static_cast<uint8_t>(hbase[code_off + row * s.K + k]);
          const uint8_t dc = d[static_cast<size_t>(code_off + row * s.K + k)];
          const double hv = (fp8 ? e4m3_value(hc) : static_cast<int8_t>(hc)) * hs;
          const double dv = (fp8 ? e4m3_value(dc) : static_cast<int8_t>(dc)) * ds;
          err2 += (dv - hv) * (dv - hv);
          ref2 += hv * hv;
          if (hc == dc) continue;
          ASSERT_FALSE(!fp8 && dc == 0x80) << "int8 -128 stored, row " << row << " k " << k;
          const double quantum =
              fp8 ? std::max(std::fabs(hv) * 0.125, hs * std::ldexp(1.0, -9)) : hs;
          ASSERT_LE(std::fabs(dv - hv), quantum * 1.0001 + 2e-2 * amax)
              << "row " << row << " k " << k;
        }
      }
      EXPECT_LE(std::sqrt(err2 / std::max(ref2, 1e-30)), 5e-2) << "dequantized state";
    }
    if (stochastic) {
      const int64_t want = 41 + call + 1;
      EXPECT_EQ(*static_cast<int64_t*>(host.rounding_step(layer).data), want);
      int64_t got = 0;
      CUDA_CHECK(cudaMemcpy(&got, dev.rounding_step(layer).data, 8, cudaMemcpyDeviceToHost));
      EXPECT_EQ(got, want) << "the device's step counter: one advance per call";
      const int64_t off = static_cast<const char*>(dev.rounding_step(layer).data) -
                          static_cast<const char*>(dev.data());
      written.push_back({dc0 + off, dc0 + off + 8});
    }
    // everything else as the host pool holds it: the sentinels, the other layer, spare slots
    EXPECT_TRUE(Snapshot::equal_except(d.data(), host.data(), bytes, written))
        << "device pool outside the written slots' codes and scales";
    // the next call starts both backends from the CPU's pool
    CUDA_CHECK(
        cudaMemcpy(dev.data(), host.data(), static_cast<size_t>(bytes), cudaMemcpyHostToDevice));
  }
}

// GDN K = V = 128 with bf16 inputs takes the Hopper kernels on compute capability 9.0 (the tensor-
// core kernels elsewhere); the TP4 shape's one long sequence (64 chunks, 8 value heads) takes
// their context parallelism there (transfer, combine, segments); KDA the split kernels (2
// sequences) or the fused tensor-core kernel; K = 64 the fused tensor-core kernel in the full
// build, the fallback otherwise.
constexpr Shape kTp4{"tp4", 4, 8, 128, 128};
constexpr Shape kK64{"k64", 2, 4, 64, 64};
INSTANTIATE_TEST_SUITE_P(Cuda, GpuQuantizedChunkPrefill,
                         ::testing::Values(QuantPrefillCase{"gdn_fp8_sr",
                                                            kQwen3Next,
                                                            false,
                                                            DType::f8e4m3,
                                                            StateRounding::stochastic,
                                                            {130, 64, 1, 63, 300},
                                                            64,
                                                            deltastate::PoolLayout::per_layer},
                                           QuantPrefillCase{"gdn_int8_rn_envelope",
                                                            kQwen3Next,
                                                            false,
                                                            DType::i8,
                                                            StateRounding::nearest,
                                                            {130, 64, 1, 63, 300},
                                                            64,
                                                            deltastate::PoolLayout::envelope},
                                           QuantPrefillCase{"gdn_tp4_cp_fp8_sr",
                                                            kTp4,
                                                            false,
                                                            DType::f8e4m3,
                                                            StateRounding::stochastic,
                                                            {4096},
                                                            512,
                                                            deltastate::PoolLayout::per_layer},
                                           QuantPrefillCase{"gdn_tp4_cp_int8_rn",
                                                            kTp4,
                                                            false,
                                                            DType::i8,
                                                            StateRounding::nearest,
                                                            {4096},
                                                            512,
                                                            deltastate::PoolLayout::per_layer},
                                           QuantPrefillCase{"gdn_k64_fp8_sr",
                                                            kK64,
                                                            false,
                                                            DType::f8e4m3,
                                                            StateRounding::stochastic,
                                                            {200, 7, 64},
                                                            64,
                                                            deltastate::PoolLayout::per_layer},
                                           QuantPrefillCase{"gdn_k64_int8_rn",
                                                            kK64,
                                                            false,
                                                            DType::i8,
                                                            StateRounding::nearest,
                                                            {200, 7, 64},
                                                            64,
                                                            deltastate::PoolLayout::envelope},
                                           QuantPrefillCase{"kda_fp8_sr_split",
                                                            kKimi,
                                                            true,
                                                            DType::f8e4m3,
                                                            StateRounding::stochastic,
                                                            {150, 70},
                                                            64,
                                                            deltastate::PoolLayout::per_layer},
                                           QuantPrefillCase{"kda_int8_rn",
                                                            kKimi,
                                                            true,
                                                            DType::i8,
                                                            StateRounding::nearest,
                                                            {65, 64, 1, 128, 100},
                                                            64,
                                                            deltastate::PoolLayout::per_layer}),
                         case_name<QuantPrefillCase>);

// CUDA-graph replay of a chunked prefill on an fp8 pool (stochastic rounding; GDN K = 128, bf16:
// the Hopper kernels on compute capability 9.0): three replays of one captured call leave the
// device step counter at 3 and the pool bit-identical to three eager calls on a twin pool (the
// key's step read on the device, advanced by the graph's own kernel).
TEST_F(GpuTest, QuantizedPrefillGraphReplayMatchesEager) {
  const Shape s = kQwen3Next;
  StatePoolConfig cfg;
  cfg.slots = 4;
  cfg.HV = s.HV;
  cfg.V = s.V;
  cfg.K = s.K;
  cfg.state_dtype = DType::f8e4m3;
  cfg.device = Device::cuda(0);
  StatePool graph_pool(cfg), eager_pool(cfg);
  const int64_t bytes = graph_pool.total_bytes();
  for (const StatePool* p : {&graph_pool, &eager_pool})
    CUDA_CHECK(cudaMemset(p->data(), 0, static_cast<size_t>(bytes)));
  Rng rng = test_rng();
  RecurrentBatch rb =
      make_recurrent_batch(rng, recurrent_spec(s, false, DType::bf16, 1, 0, {130, 70}));
  const Tensor idx = index_tensor({2, 0});
  Mirror gm, em;
  for (Mirror* m : {&gm, &em})
    m->upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, rb.cu, idx);
  Tensor gws, ews;
  auto args = [&](Mirror& m, const StatePool& p, Tensor& ws) {
    deltastate::ChunkPrefillArgs a;
    a.q = m.view(rb.q);
    a.k = m.view(rb.k);
    a.v = m.view(rb.v);
    a.g = m.view(rb.g);
    a.beta = m.view(rb.beta);
    a.out = m.view(rb.out);
    a.gate_in_kernel = true;
    a.A_log = m.view(rb.A_log);
    a.dt_bias = m.view(rb.dt_bias);
    a.cu_seqlens = m.view(rb.cu);
    a.use_qk_l2norm = true;
    a.initial_state = p.layer_state(0);
    a.initial_state_indices = m.view(idx);
    a.state_format.scales = p.layer_scales(0);
    a.state_format.step = p.rounding_step(0);
    const int64_t ws_bytes = deltastate::chunk_prefill_workspace_bytes(a);
    if (ws_bytes > 0) {
      if (!ws.alloc_base()) {
        ws = Tensor::contiguous(DType::f32, {(ws_bytes + 3) / 4});
        m.upload(ws);
      }
      a.workspace = m.view(ws);
    }
    return a;
  };
  for (int i = 0; i < 3; ++i) deltastate::chunk_prefill(args(em, eager_pool, ews));
  sync();
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  deltastate::ChunkPrefillArgs ga = args(gm, graph_pool, gws);
  ga.stream = stream;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  deltastate::chunk_prefill(ga);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) CUDA_CHECK(cudaGraphLaunch(exec, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_NO_THROW(deltastate::check_errors());
  int64_t step = 0;
  CUDA_CHECK(cudaMemcpy(&step, graph_pool.rounding_step(0).data, 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(step, 3);
  std::vector<uint8_t> g(static_cast<size_t>(bytes)), e(static_cast<size_t>(bytes));
  CUDA_CHECK(cudaMemcpy(g.data(), graph_pool.data(), g.size(), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(e.data(), eager_pool.data(), e.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(g.data(), e.data(), g.size()), 0) << "graph replays and eager calls differ";
  const Tensor go = gm.download(rb.out), eo = em.download(rb.out);
  EXPECT_EQ(std::memcmp(go.alloc_base(), eo.alloc_base(), static_cast<size_t>(go.alloc_bytes())), 0)
      << "outputs of the last call";
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace dstest
