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
// the T tokens of a speculative verify step run through it unchanged. Window: ConvChannelWindow,
// or a type with its load(i) / store(i, v) (the CUDA kernels' prefetched window, conv_loads.cuh).
template <class Window, class Input, class Output>
DS_HD void conv_channel_update(const Window& win, int state_len, int T, bool circular, int start,
                               const ConvTaps& taps, int width, bool act, Input x, Output out) {
  float s[kMaxConvWidth] = {};  // zeroed: gcc cannot see that only entries below width are read
  const int L = state_len, W1 = width - 1;
  int pos = 0;  // circular: the next entry written
  if (!circular) {
    for (int i = 0; i + T + W1 < L; ++i) win.store(i, win.load(i + T));  // shift left by T
    // the last width-1 entries, all read before any is moved (each store lands below every
    // entry read after it, so the order does not change what is read)
    DS_UNROLL
    for (int i = 0; i < kMaxConvWidth - 1; ++i)
      if (i < W1) s[i] = win.load(L - W1 + i);
    DS_UNROLL
    for (int i = 0; i < kMaxConvWidth - 1; ++i) {
      const int dst = L - T - W1 + i;
      if (i < W1 && dst >= 0) win.store(dst, s[i]);
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
    DS_UNROLL
    for (int i = 0; i < kMaxConvWidth; ++i)  // s[W1] = v at constant indices: s stays in registers
      if (i == W1) s[i] = v;
    out(t, conv_output(taps.w, s, width, taps.bias, act));
    DS_UNROLL
    for (int i = 0; i < kMaxConvWidth - 1; ++i)
      if (i < W1) s[i] = s[i + 1];
  }
}

// ---- speculative verify (SGLang's causal_conv1d_update options) --------------------------------
constexpr int kMaxTreeTokens = 64;  // draft tokens of an EAGLE tree per row

// The parents of an EAGLE tree from its first-child and next-sibling tables (next(t), sibling(t):
// a token index, -1: none), as SGLang's conv kernel derives them in token order: token t's child
// gets parent t, its next sibling t's parent; token 0 (and a token nothing names) keeps 0. Returns
// -1, or the first token whose child or sibling is not a later token of the T (parent[t] < t then
// holds for every t >= 1).
template <class Next, class Sibling>
DS_HD int eagle_parents(int T, Next next, Sibling sibling, int* parent) {
  for (int t = 0; t < T; ++t) parent[t] = 0;
  for (int t = 0; t < T; ++t) {
    const int64_t c = next(t), s = sibling(t);
    if ((c != -1 && (c <= t || c >= T)) || (s != -1 && (s <= t || s >= T))) return t;
    if (c != -1) parent[c] = t;
    if (s != -1) parent[s] = parent[t];
  }
  return -1;
}

// What row b of a speculative causal_conv1d_update reads and writes: the window's first entry
// (num_accept - 1; -1: the window's last width-1 entries), the intermediate row (< 0: none) and,
// for a tree, the parents (into `parent`). kind != 0 names a bad entry (DeviceErrorKind, its
// value and limit): the row is skipped.
struct ConvVerifyRow {
  int kind = 0;
  int64_t value = 0, limit = 0;
  int accept_offset = -1;
  int64_t inter_row = -1;
  const int* parent = nullptr;  // null: a chain
};
DS_HD ConvVerifyRow conv_verify_row(const ConvUpdateProblem& p, int64_t b, int* parent) {
  ConvVerifyRow r;
  if (p.num_accept.ptr) {
    const int64_t a = p.num_accept.at(b, 0);
    if (a < 1 || a > p.accept_limit) {
      r.kind = kErrStep, r.value = a, r.limit = p.accept_limit;
      return r;
    }
    r.accept_offset = static_cast<int>(a - 1);
  }
  if (p.inter) {
    r.inter_row = p.inter_indices.ptr ? p.inter_indices.at(b, 0) : b;
    if (r.inter_row >= p.inter_rows) {
      r.kind = kErrRow, r.value = r.inter_row, r.limit = p.inter_rows;
      return r;
    }
  }
  if (p.next_token.ptr) {
    const int bad = eagle_parents(
        p.T, [&](int t) { return p.next_token.at(b, t); },
        [&](int t) { return p.next_sibling.at(b, t); }, parent);
    if (bad >= 0) {
      r.kind = kErrStep, r.value = bad, r.limit = p.T;
      return r;
    }
    r.parent = parent;
  }
  return r;
}

// Element i of a window held in registers (i < kMaxConvWidth - 1), without a dynamic index.
DS_HD float window_entry(const float* h, int i) {
  float v = h[0];
  DS_UNROLL
  for (int k = 1; k < kMaxConvWidth - 1; ++k)
    if (k == i) v = h[k];
  return v;
}

// One channel's conv over the T draft tokens of a speculative verify, with SGLang's options.
// Token t convolves its path, oldest first: the window's entries, then the tokens down to t (a
// chain: 0..t; a tree: token 0, ..., parent(t), t), so a chain's outputs are
// conv_channel_update's bit for bit. The window's update in place:
//   accept_offset < 0: as conv_channel_update (the last state_len values of [window, x]); the
//     conv reads the window's last width-1 entries;
//   accept_offset = a - 1 >= 0 (num_accept_tokens a): the window is [width-2 older entries, the
//     previous step's drafts]; the conv reads entries a-1 .. a+width-3 (the window after the a
//     accepted drafts) and the update writes [those entries from a on, x] from entry 0.
// inter(t, i, v) receives entry i (0 = oldest) of the window after token t: its path's last
// width-1 values.
template <class Input, class Output, class Inter>
DS_HD void conv_channel_verify(const ConvChannelWindow& win, int state_len, int T,
                               int accept_offset, const int* parent, const ConvTaps& taps,
                               int width, bool act, Input x, Output out, Inter inter) {
  const int L = state_len, W1 = width - 1;
  const int first = accept_offset >= 0 ? accept_offset : L - W1;
  float h[kMaxConvWidth - 1];
  DS_UNROLL
  for (int i = 0; i < kMaxConvWidth - 1; ++i) h[i] = i < W1 ? win.load(first + i) : 0.0f;
  if (accept_offset >= 0) {  // each read is of an entry above the one written
    for (int i = 0; i + 1 < W1; ++i) win.store(i, win.load(accept_offset + 1 + i));
    for (int t = 0; t < T; ++t) win.store(W1 - 1 + t, x(t));
  } else {
    for (int i = 0; i < L; ++i) win.store(i, i + T < L ? win.load(i + T) : x(i + T - L));
  }
  for (int t = 0; t < T; ++t) {
    float v[kMaxConvWidth];
    v[kMaxConvWidth - 1] = x(t);
    int idx = t;
    DS_UNROLL
    for (int j = kMaxConvWidth - 2; j >= 0; --j) {  // the path back from t, newest first
      if (j < kMaxConvWidth - 1 - W1) break;
      idx = idx > 0 && parent ? parent[idx] : idx - 1;
      v[j] = idx >= 0 ? x(idx) : window_entry(h, W1 + idx);
    }
    // the path's last `width` values start at v[kMaxConvWidth - width]
    const float* s = v + (kMaxConvWidth - width);
    out(t, conv_output(taps.w, s, width, taps.bias, act));
    for (int i = 0; i < W1; ++i) inter(t, i, s[i + 1]);
  }
}

// The order of the sum of squares where one warp normalizes a head on the GPU (the chain's norm
// kernel and the CTA kernels' outputs, which must agree bit for bit): lane l adds the squares of
// its consecutive elements [l*C, l*C + C) below V in order, C = norm_lane_elements(V), then the
// warp adds the lanes' sums in a butterfly. Consecutive elements let the chain's kernel read a
// lane's share of a 128- or 256-wide head as whole words.
DS_HD int norm_lane_elements(int V) { return (V + 31) / 32; }

// Qwen3NextRMSNormGated over one value head's V outputs x (as stored in the activation dtype
// `act`): inv = 1/sqrt(mean(x^2) + eps) in fp32; y = round_act(x*inv); t = w*y, rounded to act
// when the weight has the activation dtype (torch's promotion: otherwise fp32); result t*silu(z)
// in fp32, rounded by the store.
DS_HD float rms_inverse(float sum_sq, int n, float eps) {
  return 1.0f / sqrtf(sum_sq / static_cast<float>(n) + eps);
}
// gated_norm_of_silu takes silu(z) computed beforehand (a kernel computes it while the sum of
// squares is reduced); the same bits.
DS_HD float gated_norm_of_silu(float x, float inv, float w, float silu_z, DType act,
                               bool round_product) {
  const float y = round_to(act, x * inv);
  float t = w * y;
  if (round_product) t = round_to(act, t);
  return t * silu_z;
}
DS_HD float gated_norm(float x, float inv, float w, float z, DType act, bool round_product) {
  return gated_norm_of_silu(x, inv, w, silu(z), act, round_product);
}

}  // namespace deltastate::detail
