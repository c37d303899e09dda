// CPU kernels of ReplaySSM speculative verify and of its cursor commit (ops.h ReplayVerifyArgs):
// one task per (sequence, value head, block of state rows). A task rebuilds its rows of the state
// after the committed records from the checkpoint, replaying each record with the two operations
// of the recurrent step (simd.h: s *= alpha, s = fma(d, k, s)), so the rebuilt rows equal the
// recurrent op's state after the same tokens bit for bit; the drafts then run through
// delta_rows, the recurrent op's token step. Nothing outside a task's own rows, and the ring
// positions of its drafts, is written, and those positions lie past every record another task
// reads, so results do not depend on blocking or thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/delta_math.h"
#include "cpu/kernels.h"
#include "cpu/row_io.h"
#include "cpu/simd.h"
#include "cpu/state_io.h"
#include "cpu/thread_pool.h"

namespace deltastate::cpu {

using namespace deltastate::detail;

namespace {
struct Scratch {
  std::vector<float> S, x, q, k, v, g, alpha, d, o;
  void resize(int K, int rows) {  // grows once per thread, then stays
    auto grow = [](std::vector<float>& y, int64_t n) {
      if (y.size() < static_cast<size_t>(n)) y.resize(static_cast<size_t>(n));
    };
    grow(S, static_cast<int64_t>(K) * rows);
    for (auto* y : {&x, &q, &k, &g, &alpha}) grow(*y, K);
    for (auto* y : {&v, &d, &o}) grow(*y, rows);
  }
};
}  // namespace

void run_replayssm_verify(const ReplayVerifyProblem& p) {
  const RecurrentProblem& r = p.r;
  const int K = r.K, V = r.V, HV = r.HV, H = r.H, L = p.L;
  const int group = HV / H;
  const int64_t head_elems = static_cast<int64_t>(V) * K;
  const int g_width = r.gate.kda ? K : 1;  // floats per g record
  const int blocks = row_blocks(r.num_heads_total(), V);
  const int block_rows = (V + blocks - 1) / blocks;
  const simd::Kernels& vk = simd::kernels();
  // A checkpoint in its storage format (quantized, or rounded stochastically): its rows loaded
  // and a fold stored through state_io.h, the step of the rounding key read once per call.
  const bool formatted = r.state.formatted();
  const StoreRounding rnd = store_rounding(r.state);

  parallel_for(r.num_heads_total() * blocks, [&](int64_t task) {
    thread_local Scratch sc;
    const int64_t head = task / blocks;
    const int r0 = static_cast<int>(task % blocks) * block_rows;
    const int rows = std::min(block_rows, V - r0);
    if (rows <= 0) return;
    sc.resize(K, rows);
    const int64_t n = head / HV;
    const int hv = static_cast<int>(head % HV);
    const int h = hv / group;
    const int64_t seq = r.cu_seqlens ? 0 : n;
    const int64_t tok0 = r.cu_seqlens ? load_index(r.cu_seqlens, r.cu_dtype, n) : 0;
    const int64_t len = r.cu_seqlens ? load_index(r.cu_seqlens, r.cu_dtype, n + 1) - tok0 : r.T;
    const int64_t slot = index_at(r.indices, r.index_dtype, r.index_stride, n);
    if (slot <= p.null_block_id) {  // padded: output rows zero, nothing read or written
      if (p.rows == 2) return;      // (the fold-only call writes no output)
      std::fill_n(sc.o.data(), rows, 0.0f);
      for (int64_t t = 0; t < len; ++t)
        store_row(r.out.ptr, r.out.dtype, head_offset(r.out, seq, tok0 + t, hv) + r0, rows,
                  sc.o.data());
      return;
    }
    // The ring and cursor row: the replay row, or the checkpoint slot.
    const int64_t rr = p.replay ? index_at(p.replay, p.replay_dtype, p.replay_stride, n) : slot;
    const int m = p.write_pos[rr], base = p.cache_base[rr];
    const bool fold = flag_at(p.is_flush, p.flush_dtype, rr);
    if ((p.rows == 1 && fold) || (p.rows == 2 && !fold)) return;  // another call's rows
    auto pos = [&](int64_t c) { return (base + c) % L; };         // logical record -> ring position
    const int64_t d_base = (rr * HV + hv) * L * V;                // d_cache[rr, hv, 0, 0]
    const int64_t k_base = (rr * H + h) * L * K;                  // k_cache[rr, h, 0, 0]
    const int64_t g_base = (rr * HV + hv) * L * g_width;          // g_cache[rr, hv, 0(, 0)]
    const int64_t b_base = (rr * HV + hv) * L;                    // beta_cache[rr, hv, 0]
    const int64_t state_off = slot * r.state.slot_stride + hv * head_elems + int64_t{r0} * K;
    float* S = sc.S.data();
    if (formatted) load_state_rows(r.state, slot, hv, V, K, r0, rows, S);
    else load_row(r.state.ptr, r.state.dtype, state_off, rows * K, S);
    // alpha = e^g of ring record c, by the vector exp the recurrent step's gate_row uses (the
    // same bits)
    auto record_alpha = [&](int64_t c) {
      const float* g = p.g_cache + g_base + c * g_width;
      vk.gate(detail::GateMode::log_decay, g, nullptr, 0.0f, 0.0f, r.gate.kda ? K : 1, nullptr,
              sc.alpha.data());
      if (!r.gate.kda) std::fill(sc.alpha.begin() + 1, sc.alpha.begin() + K, sc.alpha[0]);
    };

    if (fold && p.beta_ring) {
      // 1'. The exact fold (exact-raw ring): each committed token's raw (v, k, g, beta) through
      //     the recurrent step itself, so the rebuilt rows are the recurrent op's state.
      for (int j = 0; j < m; ++j) {
        const int64_t c = pos(j);
        load_row(p.rawk, p.rawk_dtype, k_base + c * K, K, sc.k.data());
        load_row(p.rawv, p.rawv_dtype, d_base + c * V + r0, rows, sc.v.data());
        prepare_qk(sc.k.data(), K, r.l2norm, 1.0f);
        record_alpha(c);
        const float beta = p.beta_ring[b_base + c];
        const float kk = dot(sc.k.data(), sc.k.data(), K);
        vk.delta_rows(S, rows, K, sc.alpha.data(), sc.k.data(), sc.k.data(), sc.v.data(), beta, kk,
                      sc.o.data());  // (its output unused)
      }
    } else {
      // 1. The committed records, oldest first: per row s *= exp(g_j); s = fma(d_j, k_j, s).
      for (int j = 0; j < m; ++j) {
        const int64_t c = pos(j);
        load_row(p.k_cache, p.k_dtype, k_base + c * K, K, sc.k.data());
        load_row(p.d_cache, p.d_dtype, d_base + c * V + r0, rows, sc.d.data());
        record_alpha(c);
        for (int row = 0; row < rows; ++row) {
          float* s = S + static_cast<int64_t>(row) * K;
          vk.mul(s, sc.alpha.data(), K);
          vk.axpy(s, sc.d[row], sc.k.data(), K);
        }
      }
    }
    // 2. The fold: the rebuilt state becomes the checkpoint (the commit then moves the ring's
    //    origin past the folded records).
    //    A formatted checkpoint: stored with fresh row scales and the slot's stochastic key
    //    (replayssm_decode's flush), then the drafts run from it as stored (loaded back
    //    dequantized): the state every later verify rebuilds from, and what the CUDA fold, a
    //    launch of its own, leaves the verify kernel to read.
    if (fold && m > 0) {
      if (formatted) {
        store_state_rows(r.state, rnd, rnd.key_of(slot), slot, hv, V, K, r0, rows, S);
        load_state_rows(r.state, slot, hv, V, K, r0, rows, S);
      } else {
        store_row(r.state.ptr, r.state.dtype, state_off, rows * K, S);
      }
    }

    // 3. The drafts: the recurrent step on the rebuilt rows, each token's record (u, k, g)
    //    appended at logical position m + t. u is the step's own beta*(v - s.k), with s.k taken
    //    in the dot product's lane order from the decayed row, as delta_rows forms it.
    //    Records past the ring (m + t >= L) are dropped, as SGLang drops them. The exact-raw
    //    ring also takes the raw v, the raw k and beta; the residual ring the parts of d and k
    //    that d_cache's and k_cache's dtypes round off.
    for (int64_t t = 0; t < len; ++t) {
      const int64_t tok = tok0 + t;
      const bool record = m + t < L;
      const int64_t c = pos(m + t);
      load_row(r.q.ptr, r.q.dtype, head_offset(r.q, seq, tok, h), K, sc.q.data());
      load_row(r.k.ptr, r.k.dtype, head_offset(r.k, seq, tok, h), K, sc.k.data());
      load_row(r.v.ptr, r.v.dtype, head_offset(r.v, seq, tok, hv) + r0, rows, sc.v.data());
      const bool k_writer = record && r0 == 0 && hv % group == 0;  // one per key head
      if (k_writer && p.beta_ring) store_row(p.rawk, p.rawk_dtype, k_base + c * K, K, sc.k.data());
      if (record && p.beta_ring)
        store_row(p.rawv, p.rawv_dtype, d_base + c * V + r0, rows, sc.v.data());
      prepare_qk(sc.q.data(), K, r.l2norm, r.scale);
      prepare_qk(sc.k.data(), K, r.l2norm, 1.0f);
      gate_row(r.gate, r.g.ptr, r.g.dtype, head_offset(r.g, seq, tok, hv), hv, K, sc.g.data(),
               sc.alpha.data());
      const float beta =
          beta_value(load_float(r.beta.ptr, r.beta.dtype, head_offset(r.beta, seq, tok, hv)),
                     r.beta_is_logit, r.round_beta, r.beta.dtype);
      const float kq = dot(sc.k.data(), sc.q.data(), K);
      for (int row = 0; row < rows; ++row) {
        std::copy_n(S + static_cast<int64_t>(row) * K, K, sc.x.data());
        vk.mul(sc.x.data(), sc.alpha.data(), K);
        sc.d[row] = delta_u(sc.v[row], vk.dot(sc.x.data(), sc.k.data(), K), beta);
      }
      vk.delta_rows(S, rows, K, sc.alpha.data(), sc.k.data(), sc.q.data(), sc.v.data(), beta, kq,
                    sc.o.data());
      store_row(r.out.ptr, r.out.dtype, head_offset(r.out, seq, tok, hv) + r0, rows, sc.o.data());
      if (!record) continue;
      store_row(p.d_cache, p.d_dtype, d_base + c * V + r0, rows, sc.d.data());
      if (p.rawv && !p.beta_ring) {           // residual: d - round(d), rounded to rawv's dtype
        for (int row = 0; row < rows; ++row)  // (o is stored: its buffer is free)
          sc.o[row] = sc.d[row] - round_to(p.d_dtype, sc.d[row]);
        store_row(p.rawv, p.rawv_dtype, d_base + c * V + r0, rows, sc.o.data());
      }
      if (r0 == 0) {  // one writer per head for g and beta
        for (int i = 0; i < g_width; ++i) p.g_cache[g_base + c * g_width + i] = sc.g[i];
        if (p.beta_ring) p.beta_ring[b_base + c] = beta;
      }
      if (k_writer) {
        store_row(p.k_cache, p.k_dtype, k_base + c * K, K, sc.k.data());
        if (p.rawk && !p.beta_ring) {  // residual: k^ - round(k^)
          for (int i = 0; i < K; ++i) sc.x[i] = sc.k[i] - round_to(p.k_dtype, sc.k[i]);
          store_row(p.rawk, p.rawk_dtype, k_base + c * K, K, sc.x.data());
        }
      }
    }
  });
  // The counter advances once per call that serves folding rows (an append-only call stores no
  // state: append then fold store what one call of both rows stores).
  if (p.rows != 1) advance_step(r.state);
}

void run_replayssm_commit(const ReplayCommitProblem& p) {
  // Serial: B small integer updates (a slot appears in one row of a step).
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t slot = p.slots.at(b, 0);
    if (slot <= p.null_block_id) continue;
    const int32_t a = static_cast<int32_t>(p.accepted.at(b, 0));
    int32_t& wp = p.write_pos[slot];
    if (flag_at(p.is_flush, p.flush_dtype, slot)) {
      if (a > 0) p.cache_base[slot] = static_cast<int32_t>((p.cache_base[slot] + wp) % p.buf_len);
      wp = a;
    } else {
      wp += a;
    }
    const bool next = p.fold_every_commit ? wp > 0 : wp + 2 * p.max_spec_len > p.L;
    set_flag(p.is_flush, p.flush_dtype, slot, next);
  }
}

void run_replayssm_reset_cursors(const ReplayResetProblem& p) {
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t slot = p.slots.at(b, 0);
    if (slot > p.null_block_id && reset_row(p, b)) reset_cursors(p, slot);
  }
}

void run_replayssm_fold_commit(const ReplayFoldProblem& p) {
  // One task per (layer, row, value head, block of state rows): the rows replay the accepted raw
  // records through delta_rows (the recurrent op's token step; its output unused).
  const int K = p.K, V = p.V, HV = p.HV, L = p.L;
  const int group = HV / p.H;
  const int gw = p.kda ? K : 1;
  const int64_t heads = static_cast<int64_t>(p.layers) * p.B * HV;
  const int blocks = row_blocks(heads, V);
  const int block_rows = (V + blocks - 1) / blocks;
  const simd::Kernels& vk = simd::kernels();
  parallel_for(heads * blocks, [&](int64_t task) {
    thread_local Scratch sc;
    const int64_t head = task / blocks;
    const int r0 = static_cast<int>(task % blocks) * block_rows;
    const int rows = std::min(block_rows, V - r0);
    if (rows <= 0) return;
    const int64_t layer = head / (int64_t{p.B} * HV);
    const int64_t b = head / HV % p.B;
    const int hv = static_cast<int>(head % HV), h = hv / group;
    const int64_t slot = p.slots.at(b, 0);
    const int64_t a = p.accepted.at(b, 0);
    if (slot <= p.null_block_id || a <= 0) return;
    const int64_t track = p.track.ptr ? p.track.at(b, 0) : p.null_block_id;
    const int64_t track_step = p.track.ptr ? p.steps.at(b, 0) : -1;
    sc.resize(K, rows);
    const int64_t head_off = int64_t{hv} * V * K + int64_t{r0} * K;
    const int64_t state_off = layer * p.state_layer_stride + slot * p.state_slot_stride + head_off;
    const int64_t v_base = p.rawv.at(layer, slot) + int64_t{hv} * L * V + r0;
    const int64_t k_base = p.rawk.at(layer, slot) + int64_t{h} * L * K;
    const int64_t g_base = p.g.at(layer, slot) + int64_t{hv} * L * gw;
    const int64_t b_base = p.beta.at(layer, slot) + int64_t{hv} * L;
    float* S = sc.S.data();
    load_row(p.state, p.state_dtype, state_off, rows * K, S);
    for (int64_t t = 0; t < a; ++t) {
      load_row(p.rawk.ptr, p.rawk.dtype, k_base + t * K, K, sc.k.data());
      load_row(p.rawv.ptr, p.rawv.dtype, v_base + t * V, rows, sc.v.data());
      prepare_qk(sc.k.data(), K, p.l2norm, 1.0f);
      vk.gate(detail::GateMode::log_decay, p.g.f32() + g_base + t * gw, nullptr, 0.0f, 0.0f, gw,
              nullptr, sc.alpha.data());
      if (!p.kda) std::fill(sc.alpha.begin() + 1, sc.alpha.begin() + K, sc.alpha[0]);
      const float kk = dot(sc.k.data(), sc.k.data(), K);
      vk.delta_rows(S, rows, K, sc.alpha.data(), sc.k.data(), sc.k.data(), sc.v.data(),
                    p.beta.f32()[b_base + t], kk, sc.o.data());  // (its output unused)
      if (t == track_step && track > p.null_block_id)
        store_row(p.state, p.state_dtype,
                  layer * p.state_layer_stride + track * p.state_slot_stride + head_off, rows * K,
                  S);
    }
    store_row(p.state, p.state_dtype, state_off, rows * K, S);
  });
}

void run_replayssm_circular_commit(const ReplayCircularProblem& p) {
  // One task per (layer, row, value head, block of state rows): the fold and the track state are
  // both formed from the old checkpoint rows (the fold is stored last), then the folded rows'
  // cursors move, after every task.
  const int K = p.K, V = p.V, HV = p.HV, L = p.L;
  const int group = HV / p.H;
  const int64_t heads = static_cast<int64_t>(p.layers) * p.B * HV;
  const int blocks = row_blocks(heads, V);
  const int block_rows = (V + blocks - 1) / blocks;
  parallel_for(heads * blocks, [&](int64_t task) {
    thread_local std::vector<float> old, out, kv, G, u, tmp;
    const int64_t head = task / blocks;
    const int r0 = static_cast<int>(task % blocks) * block_rows;
    const int rows = std::min(block_rows, V - r0);
    if (rows <= 0) return;
    const int64_t layer = head / (int64_t{p.B} * HV);
    const int64_t b = head / HV % p.B;
    const int hv = static_cast<int>(head % HV), h = hv / group;
    const int64_t slot = p.slots.at(b, 0);
    if (slot <= p.null_block_id) return;
    const int64_t r = p.rows.at(b, 0);
    const int n = p.write_pos[r];
    const bool fold = flag_at(p.is_flush, p.flush_dtype, r);
    const int64_t track = p.track.ptr ? p.track.at(b, 0) : p.null_block_id;
    const int64_t step = p.track.ptr ? p.steps.at(b, 0) : -1;
    const bool tracking = track > p.null_block_id && step >= 0;
    if (!fold && !tracking) return;
    const int64_t tlen = tracking ? n - p.accepted.at(b, 0) + step + 1 : 0;
    const int m_track = static_cast<int>(std::clamp<int64_t>(tlen, 0, L));
    const int need = std::max(fold ? n : 0, m_track);
    const int base = p.cache_base[r];
    old.resize(static_cast<size_t>(rows) * K);
    out.resize(old.size());
    kv.resize(static_cast<size_t>(std::max(need, 1)) * K);
    u.resize(static_cast<size_t>(std::max(need, 1)) * rows);
    G.resize(static_cast<size_t>(std::max(need, 1)));
    const int64_t head_off = int64_t{hv} * V * K + int64_t{r0} * K;
    load_row(p.state, p.state_dtype,
             layer * p.state_layer_stride + slot * p.state_slot_stride + head_off, rows * K,
             old.data());
    // The records j < need: key (+ residual), this task's rows of d (+ residual), the prefix
    // sums of g (fp32, in order).
    float acc = 0.0f;
    for (int j = 0; j < need; ++j) {
      const int64_t pos = (base + j) % L;
      float* kj = kv.data() + static_cast<size_t>(j) * K;
      float* uj = u.data() + static_cast<size_t>(j) * rows;
      const int64_t k_at = (int64_t{h} * L + pos) * K;
      const int64_t d_at = (int64_t{hv} * L + pos) * V + r0;
      load_row(p.k.ptr, p.k.dtype, p.k.at(layer, r) + k_at, K, kj);
      load_row(p.d.ptr, p.d.dtype, p.d.at(layer, r) + d_at, rows, uj);
      if (p.d_res.ptr) {
        if (tmp.size() < static_cast<size_t>(std::max(K, rows)))
          tmp.resize(static_cast<size_t>(std::max(K, rows)));
        load_row(p.k_res.ptr, p.k_res.dtype, p.k_res.at(layer, r) + k_at, K, tmp.data());
        for (int i = 0; i < K; ++i) kj[i] += tmp[i];
        load_row(p.d_res.ptr, p.d_res.dtype, p.d_res.at(layer, r) + d_at, rows, tmp.data());
        for (int i = 0; i < rows; ++i) uj[i] += tmp[i];
      }
      acc += p.g.f32()[p.g.at(layer, r) + int64_t{hv} * L + pos];
      G[j] = acc;
    }
    // The state after the first mm records: e^{G_{mm-1}} old + sum_j e^{G_{mm-1} - G_j} u_j k_j^T.
    auto materialize = [&](int mm, int64_t dst_slot) {
      const float total = mm > 0 ? G[mm - 1] : 0.0f;
      const float keep = std::exp(total);
      for (size_t e = 0; e < out.size(); ++e) out[e] = old[e] * keep;
      for (int j = 0; j < mm; ++j) {
        const float w = std::exp(total - G[j]);
        const float* kj = kv.data() + static_cast<size_t>(j) * K;
        for (int row = 0; row < rows; ++row) {
          const float c = w * u[static_cast<size_t>(j) * rows + row];
          float* o = out.data() + static_cast<size_t>(row) * K;
          for (int i = 0; i < K; ++i) o[i] = std::fma(c, kj[i], o[i]);
        }
      }
      store_row(p.state, p.state_dtype,
                layer * p.state_layer_stride + dst_slot * p.state_slot_stride + head_off, rows * K,
                out.data());
    };
    if (tracking) materialize(m_track, track);
    if (fold) materialize(n, slot);
  });
  for (int64_t b = 0; b < p.B; ++b) {  // the folded rows' cursors
    if (p.slots.at(b, 0) <= p.null_block_id) continue;
    const int64_t r = p.rows.at(b, 0);
    if (!flag_at(p.is_flush, p.flush_dtype, r)) continue;
    p.cache_base[r] = static_cast<int32_t>((p.cache_base[r] + p.write_pos[r]) % L);
    p.write_pos[r] = 0;
    set_flag(p.is_flush, p.flush_dtype, r, false);
  }
}

}  // namespace deltastate::cpu
