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
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

using detail::ConvUpdateProblem;
using detail::ConvWindowRef;

namespace {

constexpr int kConvThreads = 128;

// Row b's window entry (its slot): `slots` (the fused step's), `indices`, or b.
__device__ __forceinline__ int64_t conv_row_entry(const ConvUpdateProblem& p, int64_t b) {
  return p.slots     ? detail::index_at(p.slots, p.slot_dtype, p.slot_stride, b)
         : p.indices ? p.indices[b]
                     : b;
}
// Whether row b (at `entry`) is live: not padded, its entry inside the pool and, in the fused
// step's ReplaySSM chain, its cursor as the decode reads it inside the ring. Else `fill` is its
// output (padded: zeros; bad: NaN, recorded once per row by the thread with `record`).
__device__ __forceinline__ bool conv_row_live(const ConvUpdateProblem& p, int64_t b, int64_t entry,
                                              bool record, float& fill) {
  const bool bad = entry >= p.state.num_slots;
  int cursor = 0, m = 0;
  if (p.cursors && entry >= 0 && !bad) {
    cursor = p.cursors[b];
    m = replay_cursor(cursor, p.cursor_advance);
  }
  const bool bad_cursor = cursor < 0 || m >= (p.cursors ? p.cursor_limit : 1);
  if (entry >= 0 && !bad && !bad_cursor) return true;
  if ((bad || bad_cursor) && record) {
    if (bad) record_bad_row(p.errors, p.err_op, detail::kErrSlot, b, entry, p.state.num_slots);
    else
      record_bad_row(p.errors, p.err_op, detail::kErrCursor, b, cursor < 0 ? cursor : m,
                     p.cursor_limit);
  }
  fill = entry < 0 ? 0.0f : bad_row_output();
  return false;
}
// The window that holds channel c, and c's channel in it (`wc`): `state`, or with split_k the k
// or v part's own window.
__device__ __forceinline__ const ConvWindowRef& conv_channel_window(const ConvUpdateProblem& p,
                                                                    int64_t c, int64_t& wc) {
  if (p.split_k == 0 || c < p.split_k) {
    wc = c;
    return p.state;
  }
  if (c < p.split_v) {
    wc = c - p.split_k;
    return p.window_k;
  }
  wc = c - p.split_v;
  return p.window_v;
}

__global__ void __launch_bounds__(kConvThreads) conv_update_kernel(const ConvUpdateProblem p) {
  enter_grid(p.pdl_trigger_early);
  const int64_t b = blockIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kConvThreads + threadIdx.x;
  if (c >= p.dim) return;
  const int64_t entry = conv_row_entry(p, b);
  const int64_t o_off = b * p.out_batch_stride + c * p.out_dim_stride;
  const int64_t x_off = b * p.x_batch_stride + c * p.x_dim_stride;
  // the taps and the first input do not depend on the row's slot: issued beside its load
  const ConvTapBits tap_bits = load_conv_tap_bits(p.conv, c);
  const uint32_t x0 = load_float_bits(p.x, p.x_dtype, x_off);
  float fill;
  if (!conv_row_live(p, b, entry, c == 0, fill)) {
    for (int t = 0; t < p.T; ++t)
      detail::store_float(p.out, p.out_dtype, o_off + t * p.out_tok_stride, fill);
    return;
  }
  int64_t wc;
  const ConvWindowRef& win = conv_channel_window(p, c, wc);
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

// The vector kernel: one thread per kConvVecChannels consecutive channels of a row, each of its
// tensors read and written as 16-byte words. The scalar kernel's thread moves 2-4 bytes per
// access, a dozen dependent-free but separate accesses per channel, and waits two DRAM round trips
// (the slot, then the window) for each; here a thread has its 8 channels' window, input, taps and
// bias in flight at once, in an eighth of the threads. It takes the decode step's common shape
// (conv_vec_applies): one token, width 4 on a window of its 3 entries (SGLang's and vLLM's),
// entries or channels contiguous, 16-byte aligned rows, no circular windows; the math is the
// scalar kernel's (detail::conv_output on the same fp32 values, the window's stores rounded as
// detail::store_float rounds), so its bits are the same.
constexpr int kConvVecChannels = 8, kConvVecWidth = 4, kConvVecEntries = kConvVecWidth - 1;

// The vector kernel's channels once their row is live: the window read, the convolution, the
// window and the outputs written. kEntriesInner: entries contiguous (SGLang's [dim, 3]: element
// (j, i) at j*E + i of one block of words); else channels contiguous (vLLM's, dim_stride 1: entry
// i's channels one block of words each, tok_stride apart).
template <int WB, int XB, int GB, bool kEntriesInner, int NT, int NB, int NX>
__device__ __forceinline__ void conv_vec_channels(const ConvUpdateProblem& p,
                                                  const ConvWindowRef& win, char* wp,
                                                  const uint4 (&taps)[NT], const uint4 (&bias)[NB],
                                                  const uint4 (&x)[NX], uint4 (&out)[NX]) {
  constexpr int C = kConvVecChannels, E = kConvVecEntries, WW = kConvVecWidth;
  constexpr int kWinWords = C * E * WB / 16, kEntryWords = C * WB / 16;
  constexpr auto at = [](int j, int i) { return kEntriesInner ? j * E + i : i * C + j; };
  // E blocks of kEntryWords words: back to back (entries contiguous) or one per entry
  const int64_t block_bytes = kEntriesInner ? kEntryWords * 16 : win.tok_stride * WB;
  uint4 w[kWinWords];
#pragma unroll
  for (int i = 0; i < E; ++i) load_words_cs<kEntryWords>(wp + i * block_bytes, w + i * kEntryWords);
  uint4 next[kWinWords];
#pragma unroll
  for (int j = 0; j < C; ++j) {
    float s[WW], taps_j[WW];
#pragma unroll
    for (int i = 0; i < E; ++i) s[i] = float_of_bits(bits_at<WB>(w, at(j, i)), win.dtype);
    s[E] = float_of_bits(bits_at<XB>(x, j), p.x_dtype);
#pragma unroll
    for (int i = 0; i < WW; ++i)
      taps_j[i] = float_of_bits(bits_at<GB>(taps, j * WW + i), p.conv.weight_dtype);
    const float bias_j =
        p.conv.bias ? float_of_bits(bits_at<GB>(bias, j), p.conv.bias_dtype) : 0.0f;
    const float y = detail::conv_output(taps_j, s, WW, bias_j, p.conv.silu);
    set_bits_at<XB>(out, j, bits_of_float(y, p.out_dtype));
    // the window moves one entry left and takes the input, as detail::conv_channel_update stores
#pragma unroll
    for (int i = 0; i < E; ++i) set_bits_at<WB>(next, at(j, i), bits_of_float(s[i + 1], win.dtype));
  }
#pragma unroll
  for (int i = 0; i < E; ++i)
    store_words<kEntryWords>(wp + i * block_bytes, next + i * kEntryWords);
}

// WB, XB, GB: element bytes of the windows, of x and out, of the weight and bias (2 or 4).
template <int WB, int XB, int GB>
__global__ void __launch_bounds__(kConvThreads) conv_update_vec_kernel(const ConvUpdateProblem p) {
  constexpr int C = kConvVecChannels, WW = kConvVecWidth;
  constexpr int kXWords = C * XB / 16, kTapWords = C * WW * GB / 16, kBiasWords = C * GB / 16;
  enter_grid(p.pdl_trigger_early);
  const int64_t b = blockIdx.x;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * kConvThreads + threadIdx.x) * C;
  if (c >= p.dim) return;
  const int64_t entry = conv_row_entry(p, b);
  const int64_t o_off = b * p.out_batch_stride + c;
  // the taps, bias and input do not depend on the row's slot: issued beside its load
  uint4 taps[kTapWords], bias[kBiasWords], x[kXWords];
  load_words(static_cast<const char*>(p.conv.weight) + c * WW * GB, taps);
  if (p.conv.bias) load_words(static_cast<const char*>(p.conv.bias) + c * GB, bias);
  load_words(static_cast<const char*>(p.x) + (b * p.x_batch_stride + c) * XB, x);
  uint4 out[kXWords];
  float fill;
  if (!conv_row_live(p, b, entry, c == 0, fill)) {
    const uint32_t bits = bits_of_float(fill, p.out_dtype);
#pragma unroll
    for (int j = 0; j < C; ++j) set_bits_at<XB>(out, j, bits);
    store_words<kXWords>(static_cast<char*>(p.out) + o_off * XB, out);
    return;
  }
  // the split points are multiples of C: every channel of the thread is in one window
  int64_t wc;
  const ConvWindowRef& win = conv_channel_window(p, c, wc);
  char* wp = static_cast<char*>(win.ptr) + (entry * win.slot_stride + wc * win.dim_stride) * WB;
  // one code path per layout, so that every element index is a constant (registers, not a stack)
  if (win.dim_stride != 1) conv_vec_channels<WB, XB, GB, true>(p, win, wp, taps, bias, x, out);
  else conv_vec_channels<WB, XB, GB, false>(p, win, wp, taps, bias, x, out);
  store_words<kXWords>(static_cast<char*>(p.out) + o_off * XB, out);
}

// SGLang's speculative options (ops.h): the same grid, each thread resolving its row (the tree's
// parents in local memory) and running the shared verify conv of its channel; channel 0 records
// a bad row and writes the row's parents.
__global__ void __launch_bounds__(kConvThreads) conv_verify_kernel(const ConvUpdateProblem p) {
  enter_grid(p.pdl_trigger_early);
  const int64_t b = blockIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kConvThreads + threadIdx.x;
  if (c >= p.dim) return;
  const int64_t entry = p.indices ? p.indices[b] : b;  // the fused step never verifies: no slots
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

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
// Whether a window's rows suit the vector kernel: width 4 on its 3 entries, entries or channels
// contiguous, 16-byte aligned.
bool conv_vec_window(const ConvWindowRef& w, DType dtype, bool entries_inner) {
  const int64_t eb = dtype_size(w.dtype);
  const bool layout = entries_inner ? w.dim_stride == kConvVecEntries && w.tok_stride == 1
                                    : w.dim_stride == 1 && (w.tok_stride * eb) % 16 == 0;
  return w.dtype == dtype && w.state_len == kConvVecEntries && layout && aligned16(w.ptr) &&
         (w.slot_stride * eb) % 16 == 0;
}

// The decode step's shape that conv_update_vec_kernel takes (its comment); others run on
// conv_update_kernel.
bool conv_vec_applies(const ConvUpdateProblem& p) {
  if (p.speculative() || p.cache_seqlens || p.T != 1 || p.conv.width != kConvVecWidth ||
      p.dim % kConvVecChannels != 0)
    return false;
  const int64_t xb = dtype_size(p.x_dtype), gb = dtype_size(p.conv.weight_dtype);
  const bool entries_inner = p.state.dim_stride != 1;
  if (!conv_vec_window(p.state, p.state.dtype, entries_inner)) return false;
  if (p.split_k && (p.split_k % kConvVecChannels || p.split_v % kConvVecChannels ||
                    !conv_vec_window(p.window_k, p.state.dtype, entries_inner) ||
                    !conv_vec_window(p.window_v, p.state.dtype, entries_inner)))
    return false;
  const bool x_ok = p.x_dim_stride == 1 && aligned16(p.x) && (p.x_batch_stride * xb) % 16 == 0;
  const bool out_ok = dtype_size(p.out_dtype) == xb && p.out_dim_stride == 1 && aligned16(p.out) &&
                      (p.out_batch_stride * xb) % 16 == 0;
  const bool w_ok = p.conv.weight_width_stride == 1 && p.conv.weight_dim_stride == kConvVecWidth &&
                    aligned16(p.conv.weight);
  const bool bias_ok = !p.conv.bias || (p.conv.bias_stride == 1 && aligned16(p.conv.bias) &&
                                        dtype_size(p.conv.bias_dtype) == gb);
  return x_ok && out_ok && w_ok && bias_ok;
}

template <int WB, int XB>
void launch_conv_vec_g(const ConvUpdateProblem& p, dim3 grid, cudaStream_t s) {
  const int64_t ctas = static_cast<int64_t>(grid.x) * grid.y;
  if (dtype_size(p.conv.weight_dtype) == 2)
    return launch_kernel(conv_update_vec_kernel<WB, XB, 2>, grid, kConvThreads, 0, s, p.pdl,
                         with_pdl_trigger(p, ctas, 2048 / kConvThreads));
  launch_kernel(conv_update_vec_kernel<WB, XB, 4>, grid, kConvThreads, 0, s, p.pdl,
                with_pdl_trigger(p, ctas, 2048 / kConvThreads));
}
template <int WB>
void launch_conv_vec_x(const ConvUpdateProblem& p, dim3 grid, cudaStream_t s) {
  if (dtype_size(p.x_dtype) == 2) return launch_conv_vec_g<WB, 2>(p, grid, s);
  launch_conv_vec_g<WB, 4>(p, grid, s);
}

}  // namespace

void run_conv_update(const ConvUpdateProblem& problem, void* stream) {
  DeviceGuard guard(problem.device.index);
  ConvUpdateProblem p = problem;
  p.errors = device_errors(p.device.index);
  const auto s = static_cast<cudaStream_t>(stream);
  // The vector kernel where it applies and its grid pays (tuning.h: conv_vector_pays), or where
  // DELTASTATE_CUDA_CONV=vector forces it; rows on x, blocks of groups of kConvVecChannels
  // channels on y.
  const int64_t groups = p.dim / kConvVecChannels;
  const dim3 vec_grid(static_cast<unsigned>(p.B),
                      static_cast<unsigned>((groups + kConvThreads - 1) / kConvThreads));
  const ConvChoice forced = forced_conv_kernel();
  const bool vector =
      forced != ConvChoice::scalar && conv_vec_applies(p) &&
      (forced == ConvChoice::vector ||
       conv_vector_pays(static_cast<int64_t>(vec_grid.x) * vec_grid.y, num_sms(p.device.index)));
  if (vector) {
    if (dtype_size(p.state.dtype) == 2) return launch_conv_vec_x<2>(p, vec_grid, s);
    return launch_conv_vec_x<4>(p, vec_grid, s);
  }
  // rows on x (up to 2^31 - 1), channel blocks on y (dim < 2^16 * kConvThreads)
  const dim3 grid(static_cast<unsigned>(p.B), (p.dim + kConvThreads - 1) / kConvThreads);
  const int64_t ctas = static_cast<int64_t>(grid.x) * grid.y;
  if (p.speculative())
    launch_kernel(conv_verify_kernel, grid, kConvThreads, 0, s, p.pdl,
                  with_pdl_trigger(p, ctas, 2048 / kConvThreads));
  else
    launch_kernel(conv_update_kernel, grid, kConvThreads, 0, s, p.pdl,
                  with_pdl_trigger(p, ctas, 2048 / kConvThreads));
}

}  // namespace deltastate::cuda_backend
