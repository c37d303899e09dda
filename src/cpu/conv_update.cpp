// CPU kernel of causal_conv1d_update: one task per batch row, each channel's window updated by
// the shared conv math (core/layer_math.h).
#include "core/layer_math.h"
#include "cpu/kernels.h"
#include "cpu/thread_pool.h"

namespace deltastate::cpu {

using namespace deltastate::detail;

void run_conv_update(const ConvUpdateProblem& p) {
  parallel_for(p.B, [&](int64_t b) {
    const int64_t entry = p.indices ? p.indices[b] : b;
    const int64_t out_row = b * p.out_batch_stride;
    if (entry < 0) {  // padded row: output zeros, window untouched
      for (int64_t c = 0; c < p.dim; ++c)
        for (int t = 0; t < p.T; ++t)
          store_float(p.out, p.out_dtype, out_row + c * p.out_dim_stride + t * p.out_tok_stride,
                      0.0f);
      return;
    }
    const int start = p.cache_seqlens ? p.cache_seqlens[b] % p.state.state_len : 0;
    for (int64_t c = 0; c < p.dim; ++c) {
      const int64_t x_off = b * p.x_batch_stride + c * p.x_dim_stride;
      const int64_t o_off = out_row + c * p.out_dim_stride;
      conv_channel_update(
          channel_window(p.state, entry, c), p.state.state_len, p.T, p.cache_seqlens != nullptr,
          start, conv_taps(p.conv, c), p.conv.width, p.conv.silu,
          [&](int t) { return load_float(p.x, p.x_dtype, x_off + t * p.x_tok_stride); },
          [&](int t, float y) {
            store_float(p.out, p.out_dtype, o_off + t * p.out_tok_stride, y);
          });
    }
  });
}

}  // namespace deltastate::cpu
