// The conv's inputs on the device, loaded before any is used: a channel's taps, bias, window
// entries and input each issued as bits (loads.cuh's load_float_bits) and converted where the
// shared conv math (core/layer_math.h conv_channel_update) uses them. Through load_float each
// load is converted inside its dtype switch, so a thread waited for its nine or so loads one
// after another (the conv kernel took ~6x its bytes' time at B = 256 on the H200:
// bench/results/layer-step-profile-h200.txt). The values and so the results are the same.
#pragma once

#include <cstdint>

#include "core/layer_math.h"
#include "cuda/loads.cuh"

namespace deltastate::cuda_backend {

// A channel's taps and bias as stored, loaded unconverted (conv_taps_of: as fp32). Taps past the
// width reread the last one and an absent bias reads kZeroWord, so no load waits behind a branch.
struct ConvTapBits {
  uint32_t w[detail::kMaxConvWidth];
  uint32_t bias;
};
__device__ __forceinline__ ConvTapBits load_conv_tap_bits(const detail::ConvParams& p, int64_t c) {
  ConvTapBits t;
#pragma unroll
  for (int j = 0; j < detail::kMaxConvWidth; ++j) {
    const int jj = j < p.width ? j : p.width - 1;
    t.w[j] = load_float_bits(p.weight, p.weight_dtype,
                             c * p.weight_dim_stride + jj * p.weight_width_stride);
  }
  t.bias = p.bias ? load_float_bits(p.bias, p.bias_dtype, c * p.bias_stride)
                  : static_cast<uint32_t>(kZeroWord);
  return t;
}
// conv_taps's values from the bits: the taps past the width and an absent bias 0.
__device__ __forceinline__ detail::ConvTaps conv_taps_of(const ConvTapBits& b,
                                                         const detail::ConvParams& p) {
  detail::ConvTaps t;
#pragma unroll
  for (int j = 0; j < detail::kMaxConvWidth; ++j)
    t.w[j] = j < p.width ? float_of_bits(b.w[j], p.weight_dtype) : 0.0f;
  t.bias = p.bias ? float_of_bits(b.bias, p.bias_dtype) : 0.0f;
  return t;
}

// A channel's window for conv_channel_update with its last width-1 entries (the ones a shifted
// call reads, conv_channel_update's `s`) loaded at construction; other entries (a window longer
// than width-1) and every store go to the window itself.
class PrefetchedConvWindow {
 public:
  __device__ __forceinline__ PrefetchedConvWindow(const detail::ConvChannelWindow& win,
                                                  int state_len, int width)
      : win_(win), base_(state_len - (width - 1)) {
#pragma unroll
    for (int i = 0; i < detail::kMaxConvWidth - 1; ++i) {
      const int at = base_ + (i < width - 1 ? i : width - 2);  // past the tail: its last entry
      bits_[i] = load_float_bits(win.ptr, win.dtype, static_cast<int64_t>(at) * win.stride);
    }
  }
  __device__ __forceinline__ float load(int i) const {
    const int j = i - base_;
    if (j < 0) return win_.load(i);
    // j is a constant once conv_channel_update's unrolled loop is inlined; the selects keep the
    // bits in registers where it is not
    uint32_t b = bits_[0];
#pragma unroll
    for (int k = 1; k < detail::kMaxConvWidth - 1; ++k)
      if (j == k) b = bits_[k];
    return float_of_bits(b, win_.dtype);
  }
  __device__ __forceinline__ void store(int i, float v) const { win_.store(i, v); }

 private:
  detail::ConvChannelWindow win_;
  int base_;
  uint32_t bits_[detail::kMaxConvWidth - 1];
};

// One token of channel c's shifted conv (the fused kernels' conv step): its taps, input and window
// tail issued together, then conv_channel_update; out(0, y) receives the output.
template <class Output>
__device__ __forceinline__ void conv_channel_step(const detail::ConvChannelWindow& win,
                                                  int state_len, const detail::ConvParams& conv,
                                                  int64_t c, const void* x, DType x_dtype,
                                                  int64_t x_at, Output out) {
  const ConvTapBits taps = load_conv_tap_bits(conv, c);
  const uint32_t xb = load_float_bits(x, x_dtype, x_at);
  const PrefetchedConvWindow prefetched(win, state_len, conv.width);
  detail::conv_channel_update(
      prefetched, state_len, 1, false, 0, conv_taps_of(taps, conv), conv.width, conv.silu,
      [&](int) { return float_of_bits(xb, x_dtype); }, out);
}

}  // namespace deltastate::cuda_backend
