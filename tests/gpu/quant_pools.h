// Quantized and stochastically rounded state pools on the host and their device twins, for the
// GPU tests that compare the CUDA backend's formatted-state paths with the CPU backend's
// (tests/gpu/test_state_format_gpu.cpp, tests/gpu/test_fused_step_fmt_gpu.cpp): the pools
// (make_quant_pools), an op's format keywords (format_of) and the comparison of the device pool
// with the host pool after the same calls (expect_pools_match), with its tolerances (see
// test_state_format_gpu.cpp's header).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gpu/gpu_util.h"
#include "quant_formats.h"
#include "test_util.h"

namespace dstest {

using deltastate::StatePool;
using deltastate::StatePoolConfig;
using deltastate::StateRounding;

// A (layer, slot) block of a pool.
struct Block {
  int64_t layer, slot;
};
inline std::vector<Block> blocks_of(int64_t layer, const std::vector<int64_t>& slots) {
  std::vector<Block> b;
  for (int64_t slot : slots)
    if (slot >= 0) b.push_back({layer, slot});
  return b;
}
// The slots' blocks in every layer of `layers`, layer by layer.
inline std::vector<Block> blocks_in_layers(int64_t layers, const std::vector<int64_t>& slots) {
  std::vector<Block> b;
  for (int64_t l = 0; l < layers; ++l)
    for (const Block& x : blocks_of(l, slots)) b.push_back(x);
  return b;
}

// A host pool in a quantized format and its device twin: every byte a sentinel (0x5a; with
// ScaleFill::huge every scale of every layer and slot 1e30 instead, a scale no store writes: a
// row still holding it was not written), then random codes (no NaN, no -128) and scales in the
// `live` blocks; stochastic: every layer's step counter at kStep0 (quant_formats.h). push()
// copies the host pool's bytes onto the device.
enum class ScaleFill { bytes, huge };
struct QuantPools {
  std::unique_ptr<StatePool> host, dev;
  int64_t bytes = 0;
  bool stochastic = false;
  void push() const {
    CUDA_CHECK(
        cudaMemcpy(dev->data(), host->data(), static_cast<size_t>(bytes), cudaMemcpyHostToDevice));
  }
  std::vector<uint8_t> device_bytes() const {
    std::vector<uint8_t> d(static_cast<size_t>(bytes));
    CUDA_CHECK(cudaMemcpy(d.data(), dev->data(), d.size(), cudaMemcpyDeviceToHost));
    return d;
  }
};
// Element i of a bf16 or fp16 array, as fp32 and back (to nearest).
inline float load16(const void* p, DType t, int64_t i) {
  uint16_t u;
  std::memcpy(&u, static_cast<const char*>(p) + 2 * i, 2);
  return t == DType::bf16 ? __bfloat162float(__nv_bfloat16_raw{u}) : __half2float(__half_raw{u});
}
inline void store16(void* p, DType t, int64_t i, float v) {
  const uint16_t u =
      t == DType::bf16 ? __nv_bfloat16_raw(__float2bfloat16(v)).x : __half_raw(__float2half(v)).x;
  std::memcpy(static_cast<char*>(p) + 2 * i, &u, 2);
}

inline QuantPools make_quant_pools(const Shape& s, DType dtype, StateRounding rounding,
                                   deltastate::PoolLayout layout, int64_t layers, int64_t slots,
                                   const std::vector<Block>& live, Rng& rng, int64_t replay_len = 0,
                                   bool kda = false, ScaleFill scale_fill = ScaleFill::bytes) {
  StatePoolConfig cfg;
  if (replay_len > 0) {  // ReplaySSM rings (float32)
    cfg.replay_len = replay_len;
    cfg.H = s.H;
    cfg.kda = kda;
  }
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
  const bool codes = dtype == DType::f8e4m3 || dtype == DType::i8;
  if (codes && scale_fill == ScaleFill::huge)
    for (int64_t l = 0; l < layers; ++l) {
      const TensorView sc = q.host->layer_scales(l);
      for (int64_t slot = 0; slot < slots; ++slot)
        for (int64_t r = 0; r < s.HV * s.V; ++r)
          static_cast<float*>(sc.data)[slot * sc.stride[0] + r] = 1e30f;
    }
  for (const Block& b : live) {
    const TensorView st = q.host->layer_state(b.layer);
    if (!codes) {  // a stochastically rounded 16-bit pool: its values, no scales
      for (int64_t i = 0; i < s.HV * s.V * s.K; ++i)
        store16(st.data, dtype, b.slot * st.stride[0] + i, static_cast<float>(rng.normal(0.5)));
      continue;
    }
    const TensorView sc = q.host->layer_scales(b.layer);
    uint8_t* bytes = static_cast<uint8_t*>(st.data) + b.slot * st.stride[0];
    for (int64_t i = 0; i < s.HV * s.V * s.K; ++i) bytes[i] = random_code(rng, dtype);
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

inline int64_t host_step(const QuantPools& q, int64_t layer) {
  return *static_cast<const int64_t*>(q.host->rounding_step(layer).data);
}

// The device pool against the host pool after the same calls: in the `written` blocks, scales to
// 1e-4 relative and dequantized codes within one quantum (at most 2% of the codes differing; a
// 16-bit pool: its values within one unit in the last place, at most 2% differing);
// every layer's step counter equal; every other byte equal (sentinels, blocks not written) but in
// the views `apart` (of the host pool; the caller compares them).
inline void expect_pools_match(const QuantPools& q, DType dtype, const std::vector<Block>& written,
                               const std::vector<TensorView>& apart = {}) {
  const StatePool &host = *q.host, &dev = *q.dev;
  const int64_t HV = host.config().HV, V = host.config().V, K = host.config().K;
  std::vector<uint8_t> d(static_cast<size_t>(q.bytes));
  CUDA_CHECK(cudaMemcpy(d.data(), dev.data(), d.size(), cudaMemcpyDeviceToHost));
  const char* hbase = static_cast<const char*>(host.data());
  const char* dbase = reinterpret_cast<const char*>(d.data());
  const bool fp8 = dtype == DType::f8e4m3;
  std::vector<MemRange> allowed;
  int64_t codes_total = 0, codes_differ = 0;
  const int64_t esize = dtype_size(dtype);
  for (const Block& b : written) {
    SCOPED_TRACE("layer " + std::to_string(b.layer) + " slot " + std::to_string(b.slot));
    const TensorView st = host.layer_state(b.layer);
    if (esize == 2) {
      const int64_t off = static_cast<const char*>(st.data) - hbase + b.slot * st.stride[0] * 2;
      allowed.push_back({dbase + off, dbase + off + HV * V * K * 2});
      for (int64_t i = 0; i < HV * V * K; ++i) {
        const float hv = load16(hbase + off, dtype, i), dv = load16(dbase + off, dtype, i);
        ++codes_total;
        if (std::memcmp(&hv, &dv, 4) == 0) continue;
        ++codes_differ;
        // One unit in the last place of the larger of the two (bf16: 8 bits, fp16: 11, and
        // fp16's subnormal step 2^-24 below 2^-14), plus 2^-16 of the row's largest magnitude:
        // the fp32 math of the two backends differs in its last bits, and an element that
        // cancels to far below its row's magnitude keeps that absolute difference, which
        // stochastic rounding can carry past one of its own units. 2^-16 of the row stays
        // below one unit of the row's largest elements in either format.
        const double mag = std::max(std::fabs(hv), std::fabs(dv));
        double ulp = std::ldexp(mag + 1e-30, dtype == DType::bf16 ? -7 : -10);
        if (dtype != DType::bf16) ulp = std::max(ulp, std::ldexp(1.0, -24));
        double row_amax = 0.0;
        for (int64_t j = i - i % K; j < i - i % K + K; ++j)
          row_amax =
              std::max(row_amax, static_cast<double>(std::fabs(load16(hbase + off, dtype, j))));
        ASSERT_LE(std::fabs(dv - hv), ulp * 1.0001 + std::ldexp(row_amax, -16)) << "element " << i;
      }
      continue;
    }
    const TensorView sc = host.layer_scales(b.layer);
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
        const double hv = code_value(hc, dtype) * hs;
        const double dv = code_value(dc, dtype) * ds;
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
  for (const TensorView& v : apart) {
    const int64_t off = static_cast<const char*>(v.data) - hbase;
    allowed.push_back({dbase + off, dbase + off + v.numel() * dtype_size(v.dtype)});
  }
  EXPECT_TRUE(Snapshot::equal_except(d.data(), host.data(), q.bytes, allowed))
      << "device pool outside the written blocks' codes and scales";
}

// A host pool's view read from a byte copy `copy` of the pool (the device's, downloaded).
inline std::vector<double> values_in_copy(const StatePool& host, const TensorView& v,
                                          const std::vector<uint8_t>& copy) {
  TensorView c = v;
  c.data = const_cast<uint8_t*>(copy.data()) +
           (static_cast<const char*>(v.data) - static_cast<const char*>(host.data()));
  return view_values(c, 0, v.numel());
}

// A decode batch's device outputs against the CPU's: a padded row's zero.
inline void expect_decode_outputs(Mirror& m, const DecodeBatch& batch,
                                  const std::vector<int64_t>& slots) {
  const Tensor out = m.download(batch.out);
  const int64_t HV = out.size(2), V = out.size(3);
  for (int64_t r = 0; r < batch.B; ++r) {
    std::vector<double> g;
    for (int64_t hv = 0; hv < HV; ++hv)
      for (int64_t v = 0; v < V; ++v) g.push_back(out.get({r, 0, hv, v}));
    if (slots[r] < 0) EXPECT_TRUE(all_zero(g)) << "padded row " << r;
    else EXPECT_TRUE(close_vs_cpu(g, batch.out_row(r), kOutTol, bf16)) << "output row " << r;
  }
}

// A layer's ReplaySSM rings of a pool, d, k and g: expect_replay_pools_match's `rings`.
inline std::vector<TensorView> ring_views(const StatePool& pool, int64_t layer) {
  return {pool.d_cache(layer), pool.k_cache(layer), pool.g_cache(layer)};
}

// Element (slot, row, k) of a pool's checkpoint in layer `layer`, dequantized, read from the
// bytes at `base` laid out as the host pool (its own bytes, or the device's, downloaded); row =
// hv * V + v.
inline double checkpoint_value(const StatePool& host, const char* base, DType dtype, int64_t layer,
                               int64_t slot, int64_t row, int64_t k) {
  const char* hbase = static_cast<const char*>(host.data());
  const TensorView st = host.layer_state(layer);
  const int64_t K = host.config().K;
  if (dtype_size(dtype) == 2)
    return load16(base + (static_cast<const char*>(st.data) - hbase) + slot * st.stride[0] * 2,
                  dtype, row * K + k);
  const TensorView sc = host.layer_scales(layer);
  float scale;
  std::memcpy(&scale,
              base + (static_cast<const char*>(sc.data) - hbase) + (slot * sc.stride[0] + row) * 4,
              4);
  const uint8_t code = static_cast<uint8_t>(
      base[(static_cast<const char*>(st.data) - hbase) + slot * st.stride[0] + row * K + k]);
  return code_value(code, dtype) * scale;
}

// The draft records a folding row wrote in one replayssm_verify call (ring row = its slot): their
// ring positions, oldest first. A folding row's drafts run from the checkpoint the call stored,
// and each backend stores its own rounding of its own fp32 fold (the CUDA fold's exp and
// reduction order are not the CPU's), so a code may sit one quantum apart (expect_pools_match
// bounds it) and every draft record of that row inherits the difference.
struct FoldDrafts {
  int64_t slot;
  std::vector<int64_t> pos;
  int64_t tok0 = -1;  // the row's first output token (its drafts' outputs follow), -1: unused
};

// Per element of the d ring (its linear index), how far the two stored checkpoints' difference
// can move a folded row's draft record: with e_k = |S_dev - S_cpu| of row v's element k (measured
// on the stored checkpoints; expect_pools_match holds it to one quantum), draft t's record
// d = beta (v - sum_k alpha_k S_k k_k) moves by at most sum_k e_k |k_k| (beta in (0, 1], a
// sigmoid; alpha = e^g in (0, 1], g <= 0), and the state it leaves, alpha S + d k, by at most
// e_k + |delta d| |k_k| per element: the next draft's e. The drafts are linear in the state, so
// this holds but for the backends' fp32 rounding, which the fp32 tolerance covers. k: the draft's
// normalized key, the CPU's k ring record. Zero elsewhere and in a row whose two checkpoints are
// equal: there the fp32 tolerance alone stays. Given `out_slack` (the outputs [tokens, HV, V] in
// logical order, FoldDrafts::tok0 set), the same for each draft's output o_t = S_t q_t, S_t the
// state after the draft's update (its difference bounded by that e): |delta o_t[v]| <= q_norm
// ||e||_2 (Cauchy-Schwarz), q_norm bounding the query's norm (1 / sqrt(K) for a normalized q
// with the default scale).
inline std::vector<double> folded_draft_slack(const QuantPools& q, DType dtype,
                                              const std::vector<uint8_t>& dev_bytes, int64_t layer,
                                              const std::vector<FoldDrafts>& drafts,
                                              std::vector<double>* out_slack = nullptr,
                                              double q_norm = 0.0) {
  const StatePool& host = *q.host;
  const int64_t HV = host.config().HV, V = host.config().V, K = host.config().K;
  const int64_t H = host.config().H;
  const TensorView dr = host.d_cache(layer), kr = host.k_cache(layer);
  std::vector<double> slack(static_cast<size_t>(dr.numel()), 0.0);
  const char* hbase = static_cast<const char*>(host.data());
  const char* dbase = reinterpret_cast<const char*>(dev_bytes.data());
  std::vector<double> e(static_cast<size_t>(K));
  for (const FoldDrafts& f : drafts)
    for (int64_t hv = 0; hv < HV; ++hv) {
      const int64_t h = hv / (HV / H);
      for (int64_t v = 0; v < V; ++v) {
        bool any = false;
        for (int64_t k = 0; k < K; ++k) {
          e[k] = std::fabs(checkpoint_value(host, dbase, dtype, layer, f.slot, hv * V + v, k) -
                           checkpoint_value(host, hbase, dtype, layer, f.slot, hv * V + v, k));
          any = any || e[k] != 0.0;
        }
        if (!any) continue;
        for (size_t i = 0; i < f.pos.size(); ++i) {
          const int64_t p = f.pos[i];
          const std::vector<double> key =
              view_values(kr, f.slot * kr.stride[0] + h * kr.stride[1] + p * kr.stride[2], K);
          double dd = 0.0;
          for (int64_t k = 0; k < K; ++k) dd += e[k] * std::fabs(key[k]);
          slack[f.slot * dr.stride[0] + hv * dr.stride[1] + p * dr.stride[2] + v] = dd;
          double e2 = 0.0;
          for (int64_t k = 0; k < K; ++k) {
            e[k] += dd * std::fabs(key[k]);
            e2 += e[k] * e[k];
          }
          if (out_slack && f.tok0 >= 0)
            (*out_slack)[((f.tok0 + static_cast<int64_t>(i)) * HV + hv) * V + v] =
                q_norm * std::sqrt(e2);
        }
      }
    }
  return slack;
}

// `got` against `want` within `tol` and one rounding to `stored` (close_vs_cpu), where element
// e's slack[e] > 0 (a folded row's draft, folded_draft_slack) also within that ulp and slack[e]
// (1% over it: the bound's own fp32 rounding): each such element checked alone, then the rest.
inline void expect_close_with_slack(std::vector<double> got, const std::vector<double>& want,
                                    const std::vector<double>& slack, Tol tol, DType stored,
                                    const char* what, const char* element) {
  const int ulp_bits = stored == DType::bf16 ? -7 : stored == DType::f16 ? -10 : -23;
  int bad = 0;
  for (size_t e = 0; e < got.size(); ++e) {
    if (slack[e] == 0.0) continue;
    const double w = std::fabs(want[e]);
    const double allow =
        tol.atol + tol.rtol * w + std::ldexp(w + tol.atol, ulp_bits) + slack[e] * 1.01;
    if (!(std::fabs(got[e] - want[e]) <= allow) && bad++ < 5)
      ADD_FAILURE() << element << " " << e << " of a folded row's draft: got " << got[e]
                    << ", want " << want[e] << " (allowed " << allow << ", of it slack " << slack[e]
                    << ")";
    got[e] = want[e];
  }
  EXPECT_EQ(bad, 0) << what << ": folded rows' drafts out of tolerance";
  EXPECT_TRUE(close_vs_cpu(got, want, tol, stored)) << what;
}

// After one ReplaySSM step (replayssm_decode, or the fused step's ReplaySSM mode, or
// replayssm_verify) on the host pool and its device twin (formatted checkpoint, the rings
// `rings`: views of the host pool), all but the outputs: the device cursors `wp` as the CPU's,
// the rings within fp32 tolerance plus one rounding to their dtype (a verify's `drafts` of
// folding rows: plus folded_draft_slack), the step counter one on, the `flushed` blocks'
// checkpoints within one quantum and every other byte equal; then the host pool is pushed, so the
// next step starts both backends from the CPU's pool.
inline void expect_replay_pools_match(Mirror& m, const QuantPools& q, DType dtype, const Tensor& wp,
                                      const std::vector<TensorView>& rings,
                                      const std::vector<Block>& flushed, int64_t layer,
                                      int64_t step, const std::vector<FoldDrafts>& drafts = {}) {
  EXPECT_EQ(m.download(wp).values(), wp.values()) << "cursors";
  const std::vector<uint8_t> d = q.device_bytes();
  // A ring value is one rounding, to the ring's dtype, of fp32 sums the backends add in other
  // orders: one ulp of that dtype apart at most (the d ring has the state dtype, bf16 for a bf16
  // pool: a d of 0.0106 rounded one bf16 ulp, 6.1e-5, apart was seen on an H100).
  for (size_t i = 0; i < rings.size(); ++i) {
    const TensorView& ring = rings[i];
    const std::vector<double> got = values_in_copy(*q.host, ring, d);
    const std::vector<double> want = view_values(ring, 0, ring.numel());
    // The folded rows' draft records (i == 0, the d ring) carry the two stored checkpoints'
    // difference: folded_draft_slack.
    const std::vector<double> slack = i == 0 && !drafts.empty()
                                          ? folded_draft_slack(q, dtype, d, layer, drafts)
                                          : std::vector<double>(got.size(), 0.0);
    expect_close_with_slack(got, want, slack, kFp32StateTol, ring.dtype, "a ring",
                            "d ring element");
  }
  if (q.stochastic) {
    EXPECT_EQ(host_step(q, layer), kStep0 + step + 1);
  }
  expect_pools_match(q, dtype, flushed, rings);
  q.push();
}

// After one ReplaySSM decode step on the host pool and its device twin: no bad row recorded, the
// outputs (a padded row's zero), then expect_replay_pools_match.
inline void expect_replay_step_matches(Mirror& m, const DecodeBatch& batch,
                                       const std::vector<int64_t>& slots, const QuantPools& q,
                                       DType dtype, const Tensor& wp,
                                       const std::vector<TensorView>& rings,
                                       const std::vector<Block>& flushed, int64_t layer,
                                       int64_t step) {
  sync();
  EXPECT_NO_THROW(deltastate::check_errors());
  expect_decode_outputs(m, batch, slots);
  expect_replay_pools_match(m, q, dtype, wp, rings, flushed, layer, step);
}

}  // namespace dstest
