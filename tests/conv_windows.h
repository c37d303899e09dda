// The conv windows of the conv commit's tests (update_conv_state_after_verify), CPU and GPU:
// pools and scratch buffers in the engines' layouts, the index vectors of a batch with padding,
// and a plain byte-level reference of the commit.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "test_util.h"

namespace dstest {

// A window [dim, W1]: window-contiguous (SGLang: W1 contiguous) or dim-contiguous (vLLM: the
// window's columns contiguous).
enum class Win { sglang, vllm };
// The scratch buffer [layers, N_scr, T_alloc, dim, W1]: dense in either window layout, dense
// with gaps between its rows (an envelope), or SGLang's deduplicated view: one [dim,
// T_alloc + W1 - 1] buffer per row, step t the window at column t (overlapping steps).
enum class Scratch { dense_sglang, dense_vllm, padded_rows, dedup };

struct ConvCommitCase {
  const char* name;
  DType dtype;
  Win pool;
  Scratch scratch;
  bool layered;    // [layers, ...] tensors (else one layer, the leading dim dropped)
  bool with_rows;  // intermediate_state_indices given (else request b reads row b)
  bool is_step;    // accepted holds steps (SGLang) instead of accepted lengths
};
inline void PrintTo(const ConvCommitCase& c, std::ostream* os) { *os << c.name; }

struct ConvDims {
  int64_t layers = 2, slots = 7, dim = 5, W1 = 3, rows = 6, steps = 4;
};

// The pool [layers, slots, dim, W1] in a page-major envelope (slot j of layer l at
// j * (layers * dim * W1 + 7) + l * dim * W1, 5 elements in), every byte of the allocation a
// 1e30 sentinel.
inline Tensor conv_pool(DType dt, const ConvDims& d, Win w) {
  const int64_t win = d.dim * d.W1, slot_stride = d.layers * win + 7;
  const int64_t rs = w == Win::sglang ? d.W1 : 1, cs = w == Win::sglang ? 1 : d.dim;
  Tensor t = Tensor::strided(dt, {d.layers, d.slots, d.dim, d.W1}, {win, slot_stride, rs, cs}, 5,
                             5 + d.slots * slot_stride + 3);
  t.fill_all(kSentinel);
  return t;
}

// The scratch buffer, every element random (an overlapping view's shared columns once).
inline Tensor conv_scratch(DType dt, const ConvDims& d, Scratch s, Rng& rng) {
  const int64_t win = d.dim * d.W1, L = d.layers, N = d.rows, T = d.steps;
  Tensor t;
  switch (s) {
    case Scratch::dense_sglang:
      t = Tensor::contiguous(dt, {L, N, T, d.dim, d.W1});
      break;
    case Scratch::dense_vllm:
      t = Tensor::strided(dt, {L, N, T, d.dim, d.W1}, {N * T * win, T * win, win, 1, d.dim});
      break;
    case Scratch::padded_rows:
      t = Tensor::strided(dt, {L, N, T, d.dim, d.W1},
                          {N * (T * win + 11), T * win + 11, win, d.W1, 1}, 3);
      break;
    case Scratch::dedup: {
      const int64_t P = T + d.W1 - 1;  // one shared [dim, P] buffer per row
      t = Tensor::strided(dt, {L, N, T, d.dim, d.W1}, {N * d.dim * P, d.dim * P, 1, P, 1}, 0,
                          L * N * d.dim * P);
      break;
    }
  }
  t.fill_all(kSentinel);
  t.fill_uniform(rng, -2, 2);
  return t;
}

// The same memory without the leading layers dim (layer 0 only).
inline Tensor first_layer(const Tensor& t) {
  std::vector<int64_t> shape(t.shape().begin() + 1, t.shape().end()), strides;
  for (int d = 1; d < t.ndim(); ++d) strides.push_back(t.stride(d));
  return t.alias(t.dtype(), shape, strides, t.offset());
}

// A 1-D index tensor with element stride `stride` (the gaps hold -7).
inline Tensor strided_index(const std::vector<int64_t>& v, DType dt, int64_t stride) {
  const int64_t n = static_cast<int64_t>(v.size());
  Tensor t = Tensor::strided(dt, {n}, {stride}, 0, n * stride);
  t.fill_all(-7);
  for (int64_t i = 0; i < n; ++i) t.set({i}, static_cast<double>(v[i]));
  return t;
}

// A batch of 5 requests over ConvDims' pool and scratch: a padded row (slot -1), nothing
// accepted (length 0 / step -1), a live slot without a scratch row (row -1, with_rows only), the
// last step of a row, and distinct live slots.
struct ConvBatch {
  std::vector<int64_t> slots{3, -1, 0, 6, 2};
  std::vector<int64_t> rows{5, 2, 0, -1, 1};
  std::vector<int64_t> lengths{2, 4, 0, 3, 4};  // accepted lengths; steps: length - 1
};
inline std::vector<int64_t> accepted_of(const ConvBatch& b, bool is_step) {
  std::vector<int64_t> a = b.lengths;
  if (is_step)
    for (int64_t& x : a) x -= 1;
  return a;
}

// The commit, written plainly: the pool's allocation after it, byte for byte. For each request
// with a step >= 0, a slot >= 0 and a row >= 0, every element (layer, i, j) of the window is
// copied from scratch[layer, row, step, i, j] to pool[layer, slot, i, j].
inline std::vector<uint8_t> reference_commit(const Tensor& pool, const Tensor& scratch,
                                             bool layered, const std::vector<int64_t>& slots,
                                             const std::vector<int64_t>* rows,
                                             const std::vector<int64_t>& accepted, bool is_step) {
  std::vector<uint8_t> out = pool.bytes();
  const std::vector<uint8_t> src = scratch.bytes();
  const int64_t es = pool.itemsize();
  const int lead = layered ? 1 : 0;
  const int64_t layers = layered ? pool.size(0) : 1;
  const int64_t dim = pool.size(lead + 1), W1 = pool.size(lead + 2);
  for (size_t b = 0; b < slots.size(); ++b) {
    const int64_t step = accepted[b] - (is_step ? 0 : 1);
    const int64_t slot = slots[b];
    const int64_t row = rows ? (*rows)[b] : static_cast<int64_t>(b);
    if (step < 0 || slot < 0 || row < 0) continue;
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t i = 0; i < dim; ++i)
        for (int64_t j = 0; j < W1; ++j) {
          const int64_t to = pool.offset() + (layered ? l * pool.stride(0) : 0) +
                             slot * pool.stride(lead) + i * pool.stride(lead + 1) +
                             j * pool.stride(lead + 2);
          const int64_t from = scratch.offset() + (layered ? l * scratch.stride(0) : 0) +
                               row * scratch.stride(lead) + step * scratch.stride(lead + 1) +
                               i * scratch.stride(lead + 2) + j * scratch.stride(lead + 3);
          std::memcpy(out.data() + to * es, src.data() + from * es, static_cast<size_t>(es));
        }
  }
  return out;
}

}  // namespace dstest
