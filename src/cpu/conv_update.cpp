// CPU kernel of causal_conv1d_update: one task per batch row, each channel's window updated by
// the shared conv math (core/layer_math.h).
#include <cmath>

#include "core/layer_math.h"
#include "cpu/kernels.h"
#include "cpu/thread_pool.h"

namespace deltastate::cpu {

using namespace deltastate::detail;

namespace {

// A row of SGLang's speculative options (the validator has checked its entries).
void verify_row(const ConvUpdateProblem& p, int64_t b, int64_t entry) {
  int parent[kMaxTreeTokens];
  const ConvVerifyRow r = conv_verify_row(p, b, parent);
  if (r.kind) {  // only with check_indices=false: skipped, as CUDA skips it
    for (int64_t c = 0; c < p.dim; ++c)
      for (int t = 0; t < p.T; ++t)
        store_float(p.out, p.out_dtype,
                    b * p.out_batch_stride + c * p.out_dim_stride + t * p.out_tok_stride, NAN);
    return;
  }
  if (r.parent)
    for (int t = 0; t < p.T; ++t)
      store_index(p.parent_out, p.parent_dtype, b * p.parent_row_stride + t * p.parent_col_stride,
                  r.parent[t]);
  const int64_t inter_row = r.inter_row * p.inter_row_stride;
  for (int64_t c = 0; c < p.dim; ++c) {
    const int64_t x_off = b * p.x_batch_stride + c * p.x_dim_stride;
    const int64_t o_off = b * p.out_batch_stride + c * p.out_dim_stride;
    const int64_t i_off = inter_row + c * p.inter_dim_stride;
    conv_channel_verify(
        channel_window(p.state, entry, c), p.state.state_len, p.T, r.accept_offset, r.parent,
        conv_taps(p.conv, c), p.conv.width, p.conv.silu,
        [&](int t) { return load_float(p.x, p.x_dtype, x_off + t * p.x_tok_stride); },
        [&](int t, float y) { store_float(p.out, p.out_dtype, o_off + t * p.out_tok_stride, y); },
        [&](int t, int i, float v) {
          if (r.inter_row >= 0)
            store_float(p.inter, p.state.dtype,
                        i_off + t * p.inter_step_stride + i * p.inter_win_stride, v);
        });
  }
}

}  // namespace

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
    if (p.speculative()) {
      verify_row(p, b, entry);
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
