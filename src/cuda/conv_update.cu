// causal_conv1d_update on CUDA: one thread per (row, channel), the window rolled in place by the
// shared conv math (core/layer_math.h), as the CPU kernel does, its inputs loaded ahead
// (conv_loads.cuh).
#include <cuda_runtime.h>

#include <cstdint>

#include "api/backend.h"
#include "core/layer_math.h"
#include "core/problem.h"
#include "cuda/conv_loads.cuh"
#include "cuda/grid.cuh"
#include "cuda/launch.h"
#include "cuda/replayssm/ring.cuh"

namespace deltastate::cuda_backend {

using detail::ConvUpdateProblem;
using detail::ConvWindowRef;

namespace {

constexpr int kConvThreads = 128;

__global__ void __launch_bounds__(kConvThreads) conv_update_kernel(const ConvUpdateProblem p) {
  enter_grid(p.pdl_trigger_early);
  const int64_t b = blockIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kConvThreads + threadIdx.x;
  if (c >= p.dim) return;
  const int64_t entry = p.slots     ? detail::index_at(p.slots, p.slot_dtype, p.slot_stride, b)
                        : p.indices ? p.indices[b]
                                    : b;
  const int64_t o_off = b * p.out_batch_stride + c * p.out_dim_stride;
  const int64_t x_off = b * p.x_batch_stride + c * p.x_dim_stride;
  // the taps and the first input do not depend on the row's slot: issued beside its load
  const ConvTapBits tap_bits = load_conv_tap_bits(p.conv, c);
  const uint32_t x0 = load_float_bits(p.x, p.x_dtype, x_off);
  const bool bad = entry >= p.state.num_slots;
  // A live row's ReplaySSM cursor (the fused step's ReplaySSM chain only), as the decode reads it.
  int cursor = 0, m = 0;
  if (p.cursors && entry >= 0 && !bad) {
    cursor = p.cursors[b];
    m = replay_cursor(cursor, p.cursor_advance);
  }
  const bool bad_cursor = cursor < 0 || m >= (p.cursors ? p.cursor_limit : 1);
  if (entry < 0 || bad || bad_cursor) {  // padded: zeros; a bad row: NaN, recorded once per row
    if ((bad || bad_cursor) && c == 0) {
      if (bad) record_bad_row(p.errors, p.err_op, detail::kErrSlot, b, entry, p.state.num_slots);
      else
        record_bad_row(p.errors, p.err_op, detail::kErrCursor, b, cursor < 0 ? cursor : m,
                       p.cursor_limit);
    }
    const float fill = entry < 0 ? 0.0f : bad_row_output();
    for (int t = 0; t < p.T; ++t)
      detail::store_float(p.out, p.out_dtype, o_off + t * p.out_tok_stride, fill);
    return;
  }
  // the window of channel c: `state`, or with split_k the k or v part's own window
  const ConvWindowRef& win = p.split_k == 0 || c < p.split_k ? p.state
                             : c < p.split_v                 ? p.window_k
                                                             : p.window_v;
  const int64_t wc = p.split_k == 0 || c < p.split_k ? c
                     : c < p.split_v                 ? c - p.split_k
                                                     : c - p.split_v;
  const detail::ConvChannelWindow window = detail::channel_window(win, entry, wc);
  const auto x = [&](int t) {
    return t == 0 ? float_of_bits(x0, p.x_dtype)
                  : detail::load_float(p.x, p.x_dtype, x_off + t * p.x_tok_stride);
  };
  const auto out = [&](int t, float y) {
    detail::store_float(p.out, p.out_dtype, o_off + t * p.out_tok_stride, y);
  };
  if (p.cache_seqlens) {  // circular windows: the entries read depend on the row's position
    const int start = p.cache_seqlens[b] % p.state.state_len;
    detail::conv_channel_update(window, p.state.state_len, p.T, true, start,
                                conv_taps_of(tap_bits, p.conv), p.conv.width, p.conv.silu, x, out);
    return;
  }
  // shifted windows: the last width-1 entries issued with the taps and the input
  const PrefetchedConvWindow prefetched(window, p.state.state_len, p.conv.width);
  detail::conv_channel_update(prefetched, p.state.state_len, p.T, false, 0,
                              conv_taps_of(tap_bits, p.conv), p.conv.width, p.conv.silu, x, out);
}

// SGLang's speculative options (ops.h): the same grid, each thread resolving its row (the tree's
// parents in local memory) and running the shared verify conv of its channel; channel 0 records
// a bad row and writes the row's parents.
__global__ void __launch_bounds__(kConvThreads) conv_verify_kernel(const ConvUpdateProblem p) {
  enter_grid(p.pdl_trigger_early);
  const int64_t b = blockIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kConvThreads + threadIdx.x;
  if (c >= p.dim) return;
  const int64_t entry = p.indices ? p.indices[b] : b;
  const int64_t o_off = b * p.out_batch_stride + c * p.out_dim_stride;
  int parent[detail::kMaxTreeTokens];
  detail::ConvVerifyRow r;
  if (entry >= p.state.num_slots)
    r.kind = detail::kErrSlot, r.value = entry, r.limit = p.state.num_slots;
  else if (entry >= 0) r = detail::conv_verify_row(p, b, parent);
  if (entry < 0 || r.kind) {  // padded: zeros; a bad entry: NaN, recorded once per row
    if (r.kind && c == 0) record_bad_row(p.errors, p.err_op, r.kind, b, r.value, r.limit);
    const float fill = r.kind ? bad_row_output() : 0.0f;
    for (int t = 0; t < p.T; ++t)
      detail::store_float(p.out, p.out_dtype, o_off + t * p.out_tok_stride, fill);
    return;
  }
  if (r.parent && c == 0)
    for (int t = 0; t < p.T; ++t)
      detail::store_index(p.parent_out, p.parent_dtype,
                          b * p.parent_row_stride + t * p.parent_col_stride, r.parent[t]);
  const int64_t x_off = b * p.x_batch_stride + c * p.x_dim_stride;
  const int64_t i_off = r.inter_row * p.inter_row_stride + c * p.inter_dim_stride;
  detail::conv_channel_verify(
      detail::channel_window(p.state, entry, c), p.state.state_len, p.T, r.accept_offset, r.parent,
      detail::conv_taps(p.conv, c), p.conv.width, p.conv.silu,
      [&](int t) { return detail::load_float(p.x, p.x_dtype, x_off + t * p.x_tok_stride); },
      [&](int t, float y) {
        detail::store_float(p.out, p.out_dtype, o_off + t * p.out_tok_stride, y);
      },
      [&](int t, int i, float v) {
        if (r.inter_row >= 0)
          detail::store_float(p.inter, p.state.dtype,
                              i_off + t * p.inter_step_stride + i * p.inter_win_stride, v);
      });
}

}  // namespace

void run_conv_update(const ConvUpdateProblem& problem, void* stream) {
  DeviceGuard guard(problem.device.index);
  ConvUpdateProblem p = problem;
  p.errors = device_errors(p.device.index);
  // rows on x (up to 2^31 - 1), channel blocks on y (dim < 2^16 * kConvThreads)
  const dim3 grid(static_cast<unsigned>(p.B), (p.dim + kConvThreads - 1) / kConvThreads);
  const int64_t ctas = static_cast<int64_t>(grid.x) * grid.y;
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.speculative())
    launch_kernel(conv_verify_kernel, grid, kConvThreads, 0, s, p.pdl,
                  with_pdl_trigger(p, ctas, 2048 / kConvThreads));
  else
    launch_kernel(conv_update_kernel, grid, kConvThreads, 0, s, p.pdl,
                  with_pdl_trigger(p, ctas, 2048 / kConvThreads));
}

}  // namespace deltastate::cuda_backend
