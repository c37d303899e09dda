// Host-side helpers of quantized and stochastically rounded state pools, shared by the CPU tests
// (tests/test_fused_step.cpp, tests/test_pool.cpp) and the GPU tests (tests/gpu/quant_pools.h):
// the value of a code, random finite codes, the seed and first step the tests' pools use, an op's
// format keywords for a pool's layer, a pool's conv windows and a host pool filled in its format.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "deltastate/ops.h"
#include "deltastate/state_pool.h"
#include "test_util.h"

namespace dstest {

constexpr int64_t kStep0 = 41;  // the step counters' value in the tests' stochastic pools
constexpr int64_t kSeed = 1234;

inline double e4m3_value(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (c & 0x80) ? -v : v;
}
// A code's value before its scale (f8e4m3 or i8).
inline double code_value(uint8_t c, DType t) {
  return t == DType::f8e4m3 ? e4m3_value(c) : static_cast<double>(static_cast<int8_t>(c));
}
// A random finite code of dtype t (no NaN, no -128).
inline uint8_t random_code(Rng& rng, DType t) {
  uint8_t c = static_cast<uint8_t>(rng.integer(0, 255));
  if (t == DType::f8e4m3 && (c & 0x7f) == 0x7f) c ^= 1;
  if (t == DType::i8 && c == 0x80) c = 0;
  return c;
}

// An op's format keywords for `layer` of pool p (its scales; stochastic: its step counter).
inline deltastate::StateFormatArgs format_of(const deltastate::StatePool& p, int64_t layer,
                                             deltastate::StateRounding rounding) {
  deltastate::StateFormatArgs f;
  const DType dtype = p.config().state_dtype;
  if (dtype == DType::f8e4m3 || dtype == DType::i8) f.scales = p.layer_scales(layer);
  f.rounding = rounding;
  if (p.config().stochastic_rounding()) {
    f.step = p.rounding_step(layer);
    f.seed = kSeed;
    f.layer = layer;
  }
  return f;
}

// The pool's conv windows of `layer` as the fused step takes them: one packed window, or q, k, v.
inline std::vector<TensorView> pool_windows(const deltastate::StatePool& pool, int64_t layer) {
  if (!pool.config().conv_split_qkv) return {pool.conv_state(layer)};
  return {pool.conv_state(layer, 0), pool.conv_state(layer, 1), pool.conv_state(layer, 2)};
}

// Every byte 0x5a, every scale (every layer, every slot) 1e30 (no store writes it: a row still
// holding it was not written), every step counter kStep0; then in the live slots (idx >= 0) of
// `layers` random checkpoints (codes and scales, or 16-bit values), conv windows and ring records
// (where the pool has them).
inline void fill_formatted_pool(deltastate::StatePool& pool, const std::vector<int64_t>& layers,
                                const std::vector<int64_t>& idx, Rng& rng) {
  const deltastate::StatePoolConfig& cfg = pool.config();
  std::memset(pool.data(), 0x5a, static_cast<size_t>(pool.total_bytes()));
  const bool quantized = cfg.state_dtype == DType::f8e4m3 || cfg.state_dtype == DType::i8;
  const int64_t rows = cfg.HV * cfg.V;
  for (int64_t l = 0; l < cfg.layers; ++l) {
    if (quantized) {
      const TensorView sc = pool.layer_scales(l);
      for (int64_t sl = 0; sl < cfg.physical_slots(); ++sl)
        for (int64_t r = 0; r < rows; ++r)
          static_cast<float*>(sc.data)[sl * sc.stride[0] + r] = 1e30f;
    }
    if (cfg.stochastic_rounding()) *static_cast<int64_t*>(pool.rounding_step(l).data) = kStep0;
  }
  // per slot: its inner elements, contiguous after the slot stride
  auto fill = [&](const TensorView& v, int64_t sl, double lo, double hi) {
    int64_t per = 1;
    for (int d = 1; d < v.ndim; ++d) per *= v.shape[d];
    for (int64_t e = 0; e < per; ++e)
      store_value(v.data, v.dtype, sl * v.stride[0] + e, rng.uniform(lo, hi));
  };
  for (int64_t layer : layers) {
    for (int64_t sl : idx) {
      if (sl < 0) continue;
      const TensorView st = pool.layer_state(layer);
      if (quantized) {
        uint8_t* codes = static_cast<uint8_t*>(st.data) + sl * st.stride[0];
        for (int64_t i = 0; i < rows * cfg.K; ++i) codes[i] = random_code(rng, cfg.state_dtype);
        float* scales = static_cast<float*>(pool.layer_scales(layer).data) +
                        sl * pool.layer_scales(layer).stride[0];
        for (int64_t r = 0; r < rows; ++r)
          scales[r] = static_cast<float>(rng.uniform(0.1, 1.0) /
                                         (cfg.state_dtype == DType::i8 ? 127 : 448));
      } else {
        fill(st, sl, -0.5, 0.5);
      }
      if (cfg.conv_dim > 0) {
        for (const TensorView& w : pool_windows(pool, layer))
          for (int64_t ch = 0; ch < w.shape[1]; ++ch)
            for (int64_t i = 0; i < w.shape[2]; ++i)
              store_value(w.data, w.dtype, sl * w.stride[0] + ch * w.stride[1] + i * w.stride[2],
                          rng.uniform(-1, 1));
      }
      if (cfg.replay_len > 0) {
        fill(pool.d_cache(layer), sl, -0.2, 0.2);
        fill(pool.k_cache(layer), sl, -0.3, 0.3);
        fill(pool.g_cache(layer), sl, -0.5, 0.0);
      }
    }
  }
}

}  // namespace dstest
