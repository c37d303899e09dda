// The math of a layer's decode step around the delta rule, defined once for the CPU and CUDA
// backends: the causal depthwise conv update of one channel (causal_conv1d_update's semantics,
// over T tokens) and the gated RMSNorm of Qwen3-Next (HF Qwen3NextRMSNormGated).
#pragma once

#include <cmath>

#include "core/delta_math.h"
#include "core/numeric.h"
#include "core/problem.h"

namespace deltastate::detail {

constexpr int kMaxConvWidth = 4;  // causal_conv1d_update supports widths 2..4

// SiLU as causal-conv1d's kernel and PyTorch's CUDA silu write it: x / (1 + e^-x).
DS_HD float silu(float x) { return x / (1.0f + expf(-x)); }

// One conv output: bias + sum_j w[j] * s[j] over the `width` inputs s ending at this token
// (oldest first), accumulated in fp32 in tap order with fused multiply-adds, then SiLU.
DS_HD float conv_output(const float* w, const float* s, int width, float bias, bool act) {
  float o = bias;
  DS_UNROLL
  for (int j = 0; j < kMaxConvWidth; ++j)
    if (j < width) o = fmaf(w[j], s[j], o);
  return act ? silu(o) : o;
}

// The conv window of one channel in one slot: element i (0 = oldest) of its state_len entries.
struct ConvChannelWindow {
  void* ptr;
  DType dtype;
  int64_t stride;  // elements between consecutive window entries
  DS_HD float load(int i) const { return load_float(ptr, dtype, i * stride); }
  DS_HD void store(int i, float v) const { store_float(ptr, dtype, i * stride, v); }
};

// The window of channel c of slot `slot` (int64 offsets).
DS_HD ConvChannelWindow channel_window(const ConvWindowRef& w, int64_t slot, int64_t c) {
  char* p = static_cast<char*>(w.ptr) +
            (slot * w.slot_stride + c * w.dim_stride) * static_cast<int64_t>(dtype_size(w.dtype));
  return {p, w.dtype, w.tok_stride};
}

// The weights and bias of channel c as fp32.
struct ConvTaps {
  float w[kMaxConvWidth];
  float bias;
};
DS_HD ConvTaps conv_taps(const ConvParams& p, int64_t c) {
  ConvTaps t;
  DS_UNROLL
  for (int j = 0; j < kMaxConvWidth; ++j)
    t.w[j] = j < p.width ? load_float(p.weight, p.weight_dtype,
                                      c * p.weight_dim_stride + j * p.weight_width_stride)
                         : 0.0f;
  t.bias = p.bias ? load_float(p.bias, p.bias_dtype, c * p.bias_stride) : 0.0f;
  return t;
}

// One channel's causal conv update over T new inputs x(0..T-1), in place on its window of
// state_len >= width-1 entries (causal_conv1d_update's semantics):
//   shifted (circular = false): the window is the last state_len values of [window, x]; the
//     outputs convolve [window, x] (the last width-1 window entries, then x).
//   circular (circular = true, `start` = cache_seqlens[b] % state_len): the inputs go to entries
//     start, start+1, ... (mod state_len) and the conv reads the width-1 entries before start.
// out(t, y) receives each token's output y; the window stores round to its dtype, the conv uses
// the inputs as given. Each output reads only the window and earlier inputs of the same call, so
// the T tokens of a speculative verify step run through it unchanged.
template <class Input, class Output>
DS_HD void conv_channel_update(const ConvChannelWindow& win, int state_len, int T, bool circular,
                               int start, const ConvTaps& taps, int width, bool act, Input x,
                               Output out) {
  float s[kMaxConvWidth];
  const int L = state_len, W1 = width - 1;
  int pos = 0;  // circular: the next entry written
  if (!circular) {
    for (int i = 0; i + T + W1 < L; ++i) win.store(i, win.load(i + T));  // shift left by T
    DS_UNROLL
    for (int i = 0; i < kMaxConvWidth - 1; ++i) {
      if (i >= W1) break;
      const float v = win.load(L - W1 + i);
      const int dst = L - T - W1 + i;
      if (dst >= 0) win.store(dst, v);
      s[i] = v;
    }
  } else {
    pos = start - W1;
    if (pos < 0) pos += L;
    DS_UNROLL
    for (int i = 0; i < kMaxConvWidth - 1; ++i) {
      if (i >= W1) break;
      s[i] = win.load(pos);
      pos = pos + 1 >= L ? pos + 1 - L : pos + 1;
    }
  }
  for (int t = 0; t < T; ++t) {
    const float v = x(t);
    if (!circular) {
      if (L - T + t >= 0) win.store(L - T + t, v);
    } else {
      win.store(pos, v);
      pos = pos + 1 >= L ? pos + 1 - L : pos + 1;
    }
    s[W1] = v;
    out(t, conv_output(taps.w, s, width, taps.bias, act));
    DS_UNROLL
    for (int i = 0; i < kMaxConvWidth - 1; ++i)
      if (i < W1) s[i] = s[i + 1];
  }
}

// Qwen3NextRMSNormGated over one value head's V outputs x (as stored in the activation dtype
// `act`): inv = 1/sqrt(mean(x^2) + eps) in fp32; y = round_act(x*inv); t = w*y, rounded to act
// when the weight has the activation dtype (torch's promotion: otherwise fp32); result t*silu(z)
// in fp32, rounded by the store.
DS_HD float rms_inverse(float sum_sq, int n, float eps) {
  return 1.0f / sqrtf(sum_sq / static_cast<float>(n) + eps);
}
DS_HD float gated_norm(float x, float inv, float w, float z, DType act, bool round_product) {
  const float y = round_to(act, x * inv);
  float t = w * y;
  if (round_product) t = round_to(act, t);
  return t * silu(z);
}

}  // namespace deltastate::detail
