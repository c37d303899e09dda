// CPU kernels of speculative verify and of its commits. Verify: one task per (sequence, value
// head); the state is held in fp32 across the sequence's tokens, each token's state stored where
// the problem says (a scratch row's step, a per-token pool slot), the final state stored once.
// The commits (states and conv windows): one task per (request, layer), a memcpy of the entry
// where both tensors hold it as the same dense range, else an element-wise strided copy.
// The indices were checked by the validator (contracts/verify.cpp) before anything is written.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/delta_math.h"
#include "cpu/kernels.h"
#include "cpu/row_io.h"
#include "cpu/simd.h"
#include "cpu/state_io.h"
#include "cpu/thread_pool.h"

namespace deltastate::cpu {

using namespace deltastate::detail;

void run_verify(const VerifyProblem& p) {
  const RecurrentProblem& r = p.r;
  const int K = r.K, V = r.V, HV = r.HV;
  const int group = r.HV / r.H;
  const int64_t head_elems = static_cast<int64_t>(V) * K;
  // A quantized or stochastically rounded pool: its rows through state_io.h, the step of the
  // rounding key read once per call. A quantized scratch (a quantized pool's only) too: each
  // entry a one-slot pool, keyed by scratch_key_slot of its index.
  const bool formatted = r.state.formatted();
  const bool inter_quantized = p.inter && is_quantized(p.inter_dtype);
  const StoreRounding rnd = store_rounding(r.state);
  auto load_pool = [&](int64_t slot, int hv, float* S) {
    load_state_rows(r.state, slot, hv, V, K, 0, V, S);
  };
  auto store_pool = [&](int64_t slot, int hv, const float* S) {
    store_state_rows(r.state, rnd, rnd.key_of(slot), slot, hv, V, K, 0, V, S);
  };
  parallel_for(r.num_heads_total(), [&](int64_t task) {
    thread_local std::vector<float> S, q, k, v, alpha, o, g;
    S.resize(head_elems);
    q.resize(K);
    k.resize(K);
    alpha.resize(K);
    g.resize(K);
    v.resize(V);
    o.resize(V);
    const int64_t n = task / HV;
    const int hv = static_cast<int>(task % HV);
    const int h = hv / group;
    const int64_t seq = r.cu_seqlens ? 0 : n;
    const int64_t tok0 = r.cu_seqlens ? load_index(r.cu_seqlens, r.cu_dtype, n) : 0;
    const int64_t len = r.cu_seqlens ? load_index(r.cu_seqlens, r.cu_dtype, n + 1) - tok0 : r.T;
    // home: the sequence's slot (state_indices, else n); start: the row its state starts from,
    // of the source pool when one is given (home then only receives the final state).
    const int64_t home = r.indices ? index_at(r.indices, r.index_dtype, r.index_stride, n) : n;
    const int64_t start = p.source.ptr         ? p.source_indices.at(n, 0)
                          : p.num_accepted.ptr ? p.token_slots.at(n, p.num_accepted.at(n, 0) - 1)
                                               : home;
    if (start < 0) {  // padded: output rows zeroed (or kept), nothing read or written
      if (p.keep_padded_outputs) return;
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t t = 0; t < len; ++t)
        store_row(r.out.ptr, r.out.dtype, head_offset(r.out, seq, tok0 + t, hv), V, o.data());
      return;
    }
    auto pool_at = [&](int64_t slot) { return slot * r.state.slot_stride + hv * head_elems; };
    const int64_t row = p.inter ? (p.inter_indices.ptr ? p.inter_indices.at(n, 0) : n) : -1;
    auto inter_at = [&](int64_t step) {
      return row * p.inter_row_stride + step * p.inter_step_stride + hv * head_elems;
    };

    // the start state: a row of the read-only source pool (a float pool, of the pool's dtype, or
    // of any float dtype when the pool is formatted: the validator's rule), else of the pool
    const void* init_base = p.source.ptr ? p.source.ptr : r.state.ptr;
    const DType init_dtype = p.source.ptr ? p.source.dtype : r.state.dtype;
    const int64_t init_at =
        p.source.ptr ? start * p.source.slot_stride + hv * head_elems : pool_at(start);
    auto load_start = [&] {
      if (formatted && !p.source.ptr) load_pool(start, hv, S.data());
      else load_row(init_base, init_dtype, init_at, static_cast<int>(head_elems), S.data());
    };
    load_start();
    for (int64_t t = 0; t < len; ++t) {
      // A tree token starts from its parent's state (the initial state for a parent < 0), unless
      // the parent is the previous token, whose state S already is.
      if (p.parents.ptr && row >= 0 && t > 0) {
        const int64_t parent = p.parents.at(n, t);
        if (parent < 0) load_start();
        else if (parent != t - 1 && inter_quantized)
          load_state_rows(p.inter_entry(row, parent), 0, hv, V, K, 0, V, S.data());
        else if (parent != t - 1)
          load_row(p.inter, p.inter_dtype, inter_at(parent), static_cast<int>(head_elems),
                   S.data());
      }
      const int64_t tok = tok0 + t;
      load_row(r.q.ptr, r.q.dtype, head_offset(r.q, seq, tok, h), K, q.data());
      load_row(r.k.ptr, r.k.dtype, head_offset(r.k, seq, tok, h), K, k.data());
      load_row(r.v.ptr, r.v.dtype, head_offset(r.v, seq, tok, hv), V, v.data());
      // cache_ring: step t's raw v and raw (pre-norm) k, then below its g and beta, at the
      // sequence's slot (k by the first value head of each key head)
      const bool ring = p.ring_v && home >= 0 && t < p.ring_len;
      const int64_t ring_at = (home * HV + hv) * p.ring_len + t;  // [home, hv, t]
      if (ring) {
        store_row(p.ring_v, p.ring_v_dtype, ring_at * V, V, v.data());
        if (hv % group == 0)
          store_row(p.ring_k, p.ring_k_dtype, ((home * r.H + h) * p.ring_len + t) * K, K, k.data());
      }
      prepare_qk(q.data(), K, r.l2norm, r.scale);
      prepare_qk(k.data(), K, r.l2norm, 1.0f);
      gate_row(r.gate, r.g.ptr, r.g.dtype, head_offset(r.g, seq, tok, hv), hv, K,
               ring ? g.data() : nullptr, alpha.data());
      const float beta =
          beta_value(load_float(r.beta.ptr, r.beta.dtype, head_offset(r.beta, seq, tok, hv)),
                     r.beta_is_logit, r.round_beta, r.beta.dtype);
      if (ring) {
        const int gw = r.gate.kda ? K : 1;
        std::copy_n(g.data(), gw, p.ring_g + ring_at * gw);
        p.ring_beta[ring_at] = beta;
      }
      const float kq = dot(k.data(), q.data(), K);
      // the recurrent kernel's token step, so that each step equals plain decode bit for bit
      simd::kernels().delta_rows(S.data(), V, K, alpha.data(), k.data(), q.data(), v.data(), beta,
                                 kq, o.data());
      store_row(r.out.ptr, r.out.dtype, head_offset(r.out, seq, tok, hv), V, o.data());
      if (row >= 0 && inter_quantized)
        store_state_rows(
            p.inter_entry(row, t), rnd,
            sr_key(rnd.seed, scratch_key_slot(p.inter_entry_index(row, t)), rnd.layer, rnd.step), 0,
            hv, V, K, 0, V, S.data());
      else if (row >= 0)
        store_row(p.inter, p.inter_dtype, inter_at(t), static_cast<int>(head_elems), S.data());
      if (p.token_slots.ptr) {
        const int64_t slot = p.token_slots.at(n, t);
        if (slot >= 0 && formatted) store_pool(slot, hv, S.data());
        else if (slot >= 0)
          store_row(r.state.ptr, r.state.dtype, pool_at(slot), static_cast<int>(head_elems),
                    S.data());
      }
    }
    if (r.update_state && !p.token_slots.ptr && len > 0) {
      const int64_t dst = p.output_indices.ptr ? p.output_indices.at(n, 0) : home;
      if (dst >= 0 && formatted) store_pool(dst, hv, S.data());
      else if (dst >= 0)
        store_row(r.state.ptr, r.state.dtype, pool_at(dst), static_cast<int>(head_elems), S.data());
    }
  });
  advance_step(r.state);
}

namespace {

// One entry of a non-flat commit, element by element (ES: the dtype's bytes).
template <int64_t ES>
void copy_block(const CommitProblem& p, char* dst, const char* src) {
  for (int64_t r = 0; r < p.inner_rows; ++r)
    for (int64_t c = 0; c < p.inner_cols; ++c)
      std::memcpy(dst + (r * p.state_inner_row_stride + c * p.state_inner_col_stride) * ES,
                  src + (r * p.inter_inner_row_stride + c * p.inter_inner_col_stride) * ES, ES);
}

}  // namespace

namespace {

// A quantized state's commit: a float scratch entry requantized row by row into the slot; a
// quantized one copied (the state's dtype: codes and scales) or dequantized and requantized.
void commit_quantized(const CommitProblem& p) {
  const bool inter_quantized = is_quantized(p.inter_dtype);
  parallel_for(static_cast<int64_t>(p.B) * p.layers, [&](int64_t task) {
    thread_local std::vector<float> row;
    row.resize(p.K);
    const int64_t b = task / p.layers, layer = task % p.layers;
    const int64_t step = p.accepted.at(b, 0) - (p.accepted_is_step ? 0 : 1);
    const int64_t slot = p.slots.at(b, 0);
    const int64_t r = p.rows.ptr ? p.rows.at(b, 0) : b;
    if (step < 0 || slot < 0 || r < 0) return;  // nothing accepted, or padding
    const int64_t src =
        layer * p.inter_layer_stride + r * p.inter_row_stride + step * p.inter_step_stride;
    char* dst = static_cast<char*>(p.state) + layer * p.state_layer_stride +
                slot * p.state_slot_stride;  // 1-byte codes: elements are bytes
    float* scales = p.scales + layer * p.scales_layer_stride + slot * p.scales_slot_stride;
    const int64_t rows = p.head_elems / p.K;
    const char* src_codes = static_cast<const char*>(p.inter) + src;  // a quantized scratch's
    const float* src_scales =
        inter_quantized ? p.inter_scales + layer * p.inter_scale_layer_stride +
                              r * p.inter_scale_row_stride + step * p.inter_scale_step_stride
                        : nullptr;
    if (p.inter_dtype == p.dtype) {  // the entry is a slot in the pool's format already
      std::memcpy(dst, src_codes, static_cast<size_t>(p.head_elems));
      std::memcpy(scales, src_scales, static_cast<size_t>(rows) * sizeof(float));
      return;
    }
    const uint64_t key = p.stochastic
                             ? sr_key(p.seed, static_cast<uint64_t>(slot), p.layer0 + layer,
                                      static_cast<uint64_t>(p.steps[layer]))
                             : 0;
    for (int64_t e = 0; e < rows; ++e) {
      if (inter_quantized)
        dequantize_row(src_codes + e * p.K, p.inter_dtype, src_scales[e], p.K, row.data());
      else load_row(p.inter, p.inter_dtype, src + e * p.K, p.K, row.data());
      quantize_row(row.data(), p.K, p.dtype, p.stochastic, key, static_cast<uint64_t>(e * p.K),
                   dst + e * p.K, scales + e);
    }
  });
  if (p.stochastic)
    for (int64_t l = 0; l < p.layers; ++l) ++p.steps[l];
}

}  // namespace

void run_commit(const CommitProblem& p) {
  if (is_quantized(p.dtype)) return commit_quantized(p);
  const int64_t bytes = p.head_elems * dtype_size(p.dtype);
  parallel_for(static_cast<int64_t>(p.B) * p.layers, [&](int64_t task) {
    const int64_t b = task / p.layers, layer = task % p.layers;
    const int64_t step = p.accepted.at(b, 0) - (p.accepted_is_step ? 0 : 1);
    const int64_t slot = p.slots.at(b, 0);
    const int64_t row = p.rows.ptr ? p.rows.at(b, 0) : b;
    if (step < 0 || slot < 0 || row < 0) return;  // nothing accepted, or padding
    const int64_t es = dtype_size(p.dtype);
    const char* src =
        static_cast<const char*>(p.inter) +
        (layer * p.inter_layer_stride + row * p.inter_row_stride + step * p.inter_step_stride) * es;
    char* dst = static_cast<char*>(p.state) +
                (layer * p.state_layer_stride + slot * p.state_slot_stride) * es;
    if (p.flat) std::memcpy(dst, src, static_cast<size_t>(bytes));
    else if (es == 4) copy_block<4>(p, dst, src);
    else copy_block<2>(p, dst, src);
  });
}

}  // namespace deltastate::cpu
