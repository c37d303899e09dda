// Contracts of ReplaySSM speculative verify and of its cursor commit. The token inputs, the pool
// and the slot indices are the verify op's contract (contracts/verify.cpp, no state written);
// this file checks the rings (the texts of replayssm_decode's contract), the slot-keyed cursors
// and, on CPU tensors, every slot and cursor before anything is written.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "contracts/contract.h"
#include "contracts/validate.h"
#include "core/numeric.h"

namespace deltastate::detail {

namespace {
long long ll(int64_t v) { return static_cast<long long>(v); }

// A [slots] int32 cursor table (the flag table: int32 or int8), contiguous, on `dev`.
void check_cursor(const char* name, const TensorView& t, int64_t slots, const Device& dev,
                  bool int8_ok = false) {
  if (t.ndim != 1 || !(t.dtype == DType::i32 || (int8_ok && t.dtype == DType::i8)) ||
      !t.is_contiguous())
    fail(format(int8_ok ? "`%s` must be a contiguous 1D int32 or int8 tensor."
                        : "`%s` must be a contiguous 1D int32 tensor.",
                name));
  if (t.shape[0] != slots)
    fail(format("`%s` must have one entry per slot (%lld); got %lld", name, ll(slots),
                ll(t.shape[0])));
  if (!(t.device == dev)) fail("ReplaySSM inputs must be on the same device.");
}

// A [B] index vector (any stride, int32/int64) as an IndexTable.
IndexTable index_entries(const char* name, const TensorView& t, int64_t B, const Device& dev) {
  if (t.ndim != 1 || t.shape[0] != B)
    fail(format("`%s` must have shape [B]=(%lld,); got %s", name, ll(B), shape_str(t).c_str()));
  if (t.dtype != DType::i32 && t.dtype != DType::i64)
    fail(format("`%s` must be int32 or int64 (got %s)", name,
                dtype_mark(dtype_name(t.dtype)).c_str()));
  if (!(t.device == dev)) fail("ReplaySSM inputs must be on the same device.");
  return {t.data, t.dtype, B > 1 ? t.stride[0] : 1, 1, 1};
}

// Track slots (mamba_track_indices[b] for the rows that store one) against the batch's live
// slots (`live`: each row's checkpoint, read or written in parallel with the track stores) and
// against each other: a shared slot would be written and read by two tasks at once (beyond
// SGLang, which races there).
void check_track_slots(const IndexTable& track, const std::vector<int64_t>& rows,
                       const std::vector<char>& live) {
  std::vector<char> taken(live.size(), 0);
  for (const int64_t b : rows) {
    const int64_t ts = track.at(b, 0);
    const size_t i = static_cast<size_t>(ts);
    if (live[i])
      fail(
          format("`mamba_track_indices`[%lld]=%lld is a live slot of this batch (a track "
                 "state must not overwrite a checkpoint the commit reads)",
                 ll(b), ll(ts)));
    if (taken[i])
      fail(format("`mamba_track_indices`[%lld]=%lld repeats another row's track slot", ll(b),
                  ll(ts)));
    taken[i] = 1;
  }
}

// The checkpoint pool of the fold and circular commits: [layers, slots, HV, V, K] or
// [slots, HV, V, K], floating, compact in [HV, V, K], any slot (and layer) stride.
struct CommitPool {
  bool layered;
  int lead;  // the slot dimension
  int64_t layers, S, HV, V, K;
};
CommitPool check_commit_pool(const TensorView& st) {
  if (st.ndim != 4 && st.ndim != 5)
    fail(
        format("`checkpoint_state` must be [layers, slots, HV, V, K] or [slots, HV, V, K] (got "
               "ndim=%d).",
               st.ndim));
  CommitPool c;
  c.layered = st.ndim == 5;
  c.lead = c.layered ? 1 : 0;
  c.layers = c.layered ? st.shape[0] : 1;
  c.S = st.shape[c.lead];
  c.HV = st.shape[c.lead + 1];
  c.V = st.shape[c.lead + 2];
  c.K = st.shape[c.lead + 3];
  {  // the commits store the folded checkpoint as a float state (no scales, no rounding key)
    Contract q;
    q.float_state("checkpoint_state", st);
  }
  if (!is_floating(st.dtype))
    fail(format("`checkpoint_state` must be floating (got %s).",
                dtype_mark(dtype_name(st.dtype)).c_str()));
  if (st.stride[c.lead + 3] != 1 || st.stride[c.lead + 2] != c.K ||
      st.stride[c.lead + 1] != c.V * c.K)
    fail(
        "`checkpoint_state` must be contiguous in its [HV, V, K] inner dimensions; an arbitrary "
        "slot (and layer) stride is supported.");
  return c;
}

// A ring of a commit [layers?, rows, inner...]: the layer dimension as the pool's, `rows`
// leading entries (the pool's slots, or the circular rings' rows: `unit` names them), compact
// below them, float32 (`f32`) or floating, on `dev`; its view for the kernels (data, dtype, layer
// and row strides).
CommitRing check_commit_ring(const CommitPool& c, const char* name, const TensorView& t,
                             int64_t rows, const char* unit, std::initializer_list<int64_t> inner,
                             bool f32, const Device& dev) {
  std::vector<int64_t> want;
  if (c.layered) want.push_back(c.layers);
  want.push_back(rows);
  want.insert(want.end(), inner.begin(), inner.end());
  bool ok = t.ndim == static_cast<int>(want.size());
  for (size_t i = 0; ok && i < want.size(); ++i) ok = t.shape[i] == want[i];
  if (!ok)
    fail(format("`%s` must have shape %s (got %s).", name,
                tuple_str(want.data(), static_cast<int>(want.size())).c_str(),
                shape_str(t).c_str()));
  int64_t expect = 1;
  for (int d = t.ndim - 1; d > c.lead; --d) {
    if (t.shape[d] != 1 && t.stride[d] != expect)
      fail(
          format("`%s` must be contiguous below its %s dimension; an arbitrary %s (and layer) "
                 "stride is supported.",
                 name, unit, unit));
    expect *= t.shape[d];
  }
  if (f32 ? t.dtype != DType::f32 : !is_floating(t.dtype))
    fail(format(f32 ? "`%s` must be float32 (got %s)." : "`%s` must be floating (got %s).", name,
                dtype_mark(dtype_name(t.dtype)).c_str()));
  if (!(t.device == dev)) fail("All inputs must be on the same device.");
  return {t.data, t.dtype, c.layered ? t.stride[0] : 0, t.stride[c.lead]};
}

// The ring length and key heads of a commit's rings (both at least 1, HV a multiple of H).
void check_commit_heads(const char* k_name, int64_t L, int64_t H, int64_t HV) {
  if (L < 1) fail("ReplaySSM cache length must be at least 1.");
  if (H < 1 || HV % H != 0)
    fail(format("`%s` must have H key heads with HV %% H == 0 (HV=%lld, got H=%lld).", k_name,
                ll(HV), ll(H)));
}

// The optional track pair of a commit (mamba_track_indices, mamba_steps_to_track), together.
void commit_tracks(const std::optional<TensorView>& track, const std::optional<TensorView>& steps,
                   int64_t B, const Device& dev, IndexTable& track_out, IndexTable& steps_out) {
  if (track.has_value() != steps.has_value())
    fail("`mamba_track_indices` and `mamba_steps_to_track` go together");
  if (track) {
    track_out = index_entries("mamba_track_indices", *track, B, dev);
    steps_out = index_entries("mamba_steps_to_track", *steps, B, dev);
  }
}

// The fields every commit problem has: sizes and the checkpoint pool.
template <class Problem>
void fill_commit_head(Problem& p, const CommitPool& c, const TensorView& st, int64_t B, int64_t H,
                      int64_t L) {
  p.B = static_cast<int32_t>(B);
  p.layers = static_cast<int32_t>(c.layers);
  p.H = static_cast<int32_t>(H);
  p.HV = static_cast<int32_t>(c.HV);
  p.K = static_cast<int32_t>(c.K);
  p.V = static_cast<int32_t>(c.V);
  p.L = static_cast<int32_t>(L);
  p.state = st.data;
  p.state_dtype = st.dtype;
  p.state_layer_stride = c.layered ? st.stride[0] : 0;
  p.state_slot_stride = st.stride[c.lead];
  p.num_slots = c.S;
}

// The CUDA fold and circular commits' limits: K (their shared rows of k), layers x HV (one grid
// dimension).
void check_cuda_commit(const char* op, int64_t K, int64_t heads) {
  if (K > 256) fail(format("%s: K=%lld; CUDA tensors take K <= 256", op, ll(K)));
  if (heads > kReplayCommitMaxHeads)
    fail(format("%s: layers x HV=%lld; CUDA tensors take at most %lld", op, ll(heads),
                ll(kReplayCommitMaxHeads)));
}

// null_block_id: a slot <= it marks a padded row. Below -1 a negative slot above it would be
// read as live (and index before the pool), so -1 is the least value taken.
void check_null_block_id(int64_t id) {
  if (id < -1)
    fail(
        format("`null_block_id` must be >= -1 (got %lld): slots at or below it are padding, and "
               "a negative slot must never be live",
               ll(id)));
}

}  // namespace

ReplayVerifyProblem validate_replayssm_verify(const ReplayVerifyArgs& args) {
  check_null_block_id(args.null_block_id);
  VerifyArgs va;
  va.q = args.q;
  va.k = args.k;
  va.v = args.v;
  va.g = args.g;
  va.beta = args.beta;
  va.out = args.out;
  va.is_kda = args.is_kda;
  va.A_log = args.A_log;
  va.dt_bias = args.dt_bias;
  va.gate_in_kernel = args.gate_in_kernel;
  va.lower_bound = args.lower_bound;
  va.beta_is_logit = args.beta_is_logit;
  va.round_beta_to_input = args.round_beta_to_input;
  va.scale = args.scale;
  va.use_qk_l2norm = args.use_qk_l2norm;
  va.cu_seqlens = args.cu_seqlens;
  va.state = args.state;
  // The checkpoint's storage format (quantized with its scales, or stochastically rounded): its
  // rows are loaded dequantized and a fold stores them through it, as replayssm_decode's flush.
  va.state_format = args.state_format;
  va.state_indices = args.state_indices;
  va.update_state = false;
  va.check_indices = false;  // the slots are checked below, with null_block_id's padding
  va.pdl = args.pdl;
  ReplayVerifyProblem p;
  p.r = validate_verify(va, "replayssm_verify").r;
  RecurrentProblem& r = p.r;
  const int64_t S = r.state.num_slots, HV = r.HV, H = r.H, V = r.V, K = r.K;
  const Device dev = r.device;

  const TensorView& dc = args.d_cache;
  const TensorView& kc = args.k_cache;
  const TensorView& gc = args.g_cache;
  if (!r.indices) fail("`state_indices` is required: the cursors are keyed by slot");
  // The rings and cursors have one row per slot, or per replay row with replay_indices.
  IndexTable replay{};
  if (args.replay_indices) replay = index_entries("replay_indices", *args.replay_indices, r.N, dev);
  const int64_t R = args.replay_indices ? (dc.ndim >= 1 ? dc.shape[0] : 0) : S;
  const int64_t L = replay_ring_length(dc, R, HV, V);
  check_replay_rings(dc, kc, gc, R, HV, H, V, K, L, args.is_kda);
  for (const TensorView* t : {&dc, &kc})
    if (!is_floating(t->dtype))
      fail(format("ReplaySSM ring caches must be floating point (got %s).",
                  dtype_mark(dtype_name(t->dtype)).c_str()));
  for (const TensorView* t : {&dc, &kc, &gc})
    if (!(t->device == dev)) fail("ReplaySSM inputs must be on the same device.");
  // The cursor tables: one entry per slot, or with replay_indices per replay row in use (C
  // entries, which may differ from the rings' R rows).
  if (args.replay_indices && args.write_pos.ndim != 1)
    fail("`write_pos` must be a contiguous 1D int32 tensor.");
  const int64_t C = args.replay_indices ? args.write_pos.shape[0] : R;
  check_cursor("write_pos", args.write_pos, C, dev);
  check_cursor("cache_base", args.cache_base, C, dev);
  check_cursor("is_flush", args.is_flush, C, dev, true);
  // The raw rings: all three (exact-raw), or rawv and rawk (hi/lo residual).
  const bool has_v = args.rawv_cache.has_value(), has_k = args.rawk_cache.has_value();
  const bool has_b = args.beta_cache.has_value();
  if (has_v != has_k || (has_b && !has_v))
    fail(
        "`rawv_cache` and `rawk_cache` go together (with `beta_cache`: the exact-raw ring; "
        "without: the hi/lo residual ring); `beta_cache` needs both");
  if (has_v) {
    auto ring = [&](const char* name, const TensorView& t, std::initializer_list<int64_t> shape,
                    bool f32) {
      bool ok = t.ndim == static_cast<int>(shape.size()) && t.is_contiguous();
      int i = 0;
      for (int64_t e : shape) ok = ok && t.shape[i++] == e;
      if (!ok)
        fail(format("`%s` must be a contiguous tensor of shape %s (got %s).", name,
                    tuple_str(shape).c_str(), shape_str(t).c_str()));
      if (f32 ? t.dtype != DType::f32 : !is_floating(t.dtype))
        fail(format(f32 ? "`%s` must be float32 (got %s)." : "`%s` must be floating (got %s).",
                    name, dtype_mark(dtype_name(t.dtype)).c_str()));
      if (!(t.device == dev)) fail("ReplaySSM inputs must be on the same device.");
    };
    ring("rawv_cache", *args.rawv_cache, {R, HV, L, V}, false);
    ring("rawk_cache", *args.rawk_cache, {R, H, L, K}, false);
    if (has_b) ring("beta_cache", *args.beta_cache, {R, HV, L}, true);
    p.rawv = args.rawv_cache->data;
    p.rawv_dtype = args.rawv_cache->dtype;
    p.rawk = args.rawk_cache->data;
    p.rawk_dtype = args.rawk_cache->dtype;
    if (has_b) p.beta_ring = static_cast<float*>(args.beta_cache->data);
  }
  const int rows_mode = static_cast<int>(args.rows);
  if (rows_mode < 0 || rows_mode > 2)
    fail(format("replayssm_verify: rows must be 0 (all), 1 (append) or 2 (fold) (got %d)",
                rows_mode));
  p.rows = rows_mode;
  p.ring_rows = std::min(R, C);
  if (args.replay_indices) {
    p.replay = replay.ptr;
    p.replay_dtype = replay.dtype;
    p.replay_stride = replay.row_stride;
  }

  p.L = static_cast<int32_t>(L);
  p.d_cache = dc.data;
  p.d_dtype = dc.dtype;
  p.k_cache = kc.data;
  p.k_dtype = kc.dtype;
  p.g_cache = static_cast<float*>(gc.data);
  p.write_pos = static_cast<const int32_t*>(args.write_pos.data);
  p.cache_base = static_cast<const int32_t*>(args.cache_base.data);
  p.is_flush = args.is_flush.data;
  p.flush_dtype = args.is_flush.dtype;
  p.null_block_id = args.null_block_id;

  // CPU tensors (default on): every slot and cursor checked before anything is written. CUDA
  // tensors: the kernel checks them on the device (a bad row is skipped, NaN, and recorded);
  // check_indices=true then synchronizes and raises after the launch.
  const bool on_cpu = dev.type == DeviceType::cpu;
  const bool check = args.check_indices.value_or(on_cpu);
  r.check_indices = check;
  if (on_cpu && check) {
    std::vector<char> used(static_cast<size_t>(S), 0), used_row(static_cast<size_t>(R), 0);
    for (int64_t n = 0; n < r.N; ++n) {
      const int64_t slot = index_at(r.indices, r.index_dtype, r.index_stride, n);
      if (slot <= p.null_block_id) continue;
      if (slot >= S)
        fail(format("`state_indices`[%lld]=%lld is out of range for a pool of %lld slots", ll(n),
                    ll(slot), ll(S)));
      if (used[static_cast<size_t>(slot)])
        fail(format("`state_indices`[%lld]=%lld repeats a live slot of this batch", ll(n),
                    ll(slot)));
      used[static_cast<size_t>(slot)] = 1;
      int64_t row = slot;
      if (p.replay) {
        row = index_at(p.replay, p.replay_dtype, p.replay_stride, n);
        if (row < 0 || row >= p.ring_rows)
          fail(
              format("`replay_indices`[%lld]=%lld is out of range for rings of %lld rows and "
                     "cursor tables of %lld entries",
                     ll(n), ll(row), ll(R), ll(C)));
        if (used_row[static_cast<size_t>(row)])
          fail(format("`replay_indices`[%lld]=%lld repeats a live row of this batch", ll(n),
                      ll(row)));
        used_row[static_cast<size_t>(row)] = 1;
      }
      const int64_t m = p.write_pos[row], base = p.cache_base[row];
      if (m < 0 || m > L)
        fail(format("`write_pos`[%lld]=%lld is outside the ring [0, L=%lld]", ll(row), ll(m),
                    ll(L)));
      if (base < 0 || base >= L)
        fail(format("`cache_base`[%lld]=%lld is outside the ring [0, L-1=%lld]", ll(row), ll(base),
                    ll(L - 1)));
    }
  }
  return p;
}

// The cursor rules' lengths: the commit's (the next verify's records fit the ring: 2T <= L) and
// the reset's (any T >= 1, as SGLang's reset, whose first is_flush says 2T > L).
void check_commit_lengths(int64_t L, int64_t T, bool records_fit = true) {
  if (L < 1 || L > (int64_t{1} << 30))
    fail(format("max_cache_len must be in [1, 2^30] (got %lld)", ll(L)));
  if (!records_fit && (T < 1 || T > (int64_t{1} << 30)))
    fail(format("max_spec_len must be in [1, 2^30] (got %lld)", ll(T)));
  if (records_fit && (T < 1 || 2 * T > L))
    fail(format("max_spec_len must be >= 1 with 2 * max_spec_len <= max_cache_len=%lld (got %lld)",
                ll(L), ll(T)));
}

// The cursor tables [slots] and the rows' slots [B] of a commit or a reset: their checks.
struct CursorRows {
  int64_t S = 0, B = 0;
  Device dev{};
  IndexTable slots;
};
CursorRows check_cursor_rows(const TensorView& wp, const TensorView& base, const TensorView& flush,
                             const TensorView& state_indices, int64_t null_block_id) {
  check_null_block_id(null_block_id);
  if (wp.ndim != 1) fail("`write_pos` must be a contiguous 1D int32 tensor.");
  CursorRows c;
  c.S = wp.shape[0];
  c.dev = wp.device;
  check_cursor("write_pos", wp, c.S, c.dev);
  check_cursor("cache_base", base, c.S, c.dev);
  check_cursor("is_flush", flush, c.S, c.dev, true);
  c.B = state_indices.ndim == 1 ? state_indices.shape[0] : -1;
  c.slots = index_entries("state_indices", state_indices, c.B, c.dev);
  return c;
}

// The cursor fields the commit's and the reset's problems share, from their checked rows.
template <class Problem, class Args>
void fill_cursor_fields(Problem& p, const CursorRows& c, const Args& args) {
  p.slots = c.slots;
  p.write_pos = static_cast<int32_t*>(args.write_pos.data);
  p.cache_base = static_cast<int32_t*>(args.cache_base.data);
  p.is_flush = args.is_flush.data;
  p.flush_dtype = args.is_flush.dtype;
  p.num_slots = c.S;
  p.null_block_id = args.null_block_id;
  p.device = c.dev;
  p.pdl = args.pdl;
  p.check_indices = args.check_indices.value_or(c.dev.type == DeviceType::cpu);
}

ReplayCommitProblem validate_replayssm_commit(const ReplayCommitArgs& args) {
  const TensorView& wp = args.write_pos;
  const CursorRows c =
      check_cursor_rows(wp, args.cache_base, args.is_flush, args.state_indices, args.null_block_id);
  const int64_t S = c.S, B = c.B;
  const Device dev = c.dev;
  ReplayCommitProblem p;
  fill_cursor_fields(p, c, args);
  p.accepted = index_entries("num_accepted", args.num_accepted, B, dev);
  const int64_t L = args.max_cache_len, T = args.max_spec_len;
  check_commit_lengths(L, T);
  const int64_t buf = args.cache_buf_len == 0 ? L : args.cache_buf_len;
  if (args.cache_buf_len != 0 && (buf < L || buf > (int64_t{1} << 30) || (buf & (buf - 1)) != 0))
    fail(format("cache_buf_len must be a power of two >= max_cache_len=%lld (got %lld)", ll(L),
                ll(buf)));
  p.B = static_cast<int32_t>(B);
  p.L = static_cast<int32_t>(L);
  p.buf_len = static_cast<int32_t>(buf);
  p.fold_every_commit = args.fold_every_commit;
  p.max_spec_len = static_cast<int32_t>(T);
  if (dev.type == DeviceType::cpu && p.check_indices) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t slot = p.slots.at(b, 0);
      if (slot <= p.null_block_id) continue;
      if (slot >= S)
        fail(format("`state_indices`[%lld]=%lld is out of range for a pool of %lld slots", ll(b),
                    ll(slot), ll(S)));
      const int64_t a = p.accepted.at(b, 0);
      if (a < 0 || a > T)
        fail(format("`num_accepted`[%lld]=%lld is outside [0, max_spec_len=%lld]", ll(b), ll(a),
                    ll(T)));
    }
  }
  return p;
}

ReplayResetProblem validate_replayssm_reset_cursors(const ReplayResetArgs& args) {
  const TensorView& wp = args.write_pos;
  const CursorRows c =
      check_cursor_rows(wp, args.cache_base, args.is_flush, args.state_indices, args.null_block_id);
  const int64_t S = c.S, B = c.B;
  const Device dev = c.dev;
  ReplayResetProblem p;
  const TensorView& r = args.do_reset;
  if (r.ndim != 1 || r.shape[0] != B)
    fail(format("`do_reset` must have shape [B]=(%lld,); got %s", ll(B), shape_str(r).c_str()));
  if (r.dtype != DType::i8 && r.dtype != DType::i32 && r.dtype != DType::i64)
    fail(format("`do_reset` must be bool, int8, int32 or int64 (got %s)",
                dtype_mark(dtype_name(r.dtype)).c_str()));
  if (!(r.device == dev)) fail("ReplaySSM inputs must be on the same device.");
  const int64_t L = args.max_cache_len, T = args.max_spec_len;
  check_commit_lengths(L, T, false);
  p.B = static_cast<int32_t>(B);
  fill_cursor_fields(p, c, args);
  p.init_flush = 2 * T > L;
  p.do_reset = r.data;
  p.reset_dtype = r.dtype;
  p.reset_stride = B > 1 ? r.stride[0] : 1;
  if (dev.type == DeviceType::cpu && p.check_indices) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t slot = p.slots.at(b, 0);
      if (slot > p.null_block_id && slot >= S && reset_row(p, b))
        fail(format("`state_indices`[%lld]=%lld is out of range for a pool of %lld slots", ll(b),
                    ll(slot), ll(S)));
    }
  }
  return p;
}

ReplayFoldProblem validate_replayssm_fold_commit(const ReplayFoldArgs& args) {
  check_null_block_id(args.null_block_id);
  const TensorView& st = args.state;
  const CommitPool c = check_commit_pool(st);
  const int lead = c.lead;
  const int64_t layers = c.layers, S = c.S, HV = c.HV, V = c.V, K = c.K;
  const TensorView &rv = args.rawv, &rk = args.rawk, &rg = args.g, &rb = args.beta;
  const int64_t L = rv.ndim == st.ndim ? rv.shape[lead + 2] : 0;
  const int64_t H = rk.ndim == st.ndim ? rk.shape[lead + 1] : 0;
  const Device dev = st.device;
  auto ring = [&](const char* name, const TensorView& t, std::initializer_list<int64_t> inner,
                  bool f32) { return check_commit_ring(c, name, t, S, "slot", inner, f32, dev); };
  ReplayFoldProblem p;
  check_commit_heads("rawk_cache", L, H, HV);
  p.rawv = ring("rawv_cache", rv, {HV, L, V}, false);
  p.rawk = ring("rawk_cache", rk, {H, L, K}, false);
  p.g = args.is_kda ? ring("g_cache", rg, {HV, L, K}, true) : ring("g_cache", rg, {HV, L}, true);
  p.beta = ring("beta_cache", rb, {HV, L}, true);
  if (dev.type != DeviceType::cpu) check_cuda_commit("replayssm_fold_commit", K, layers * HV);
  const TensorView& idx = args.state_indices;
  if (idx.ndim != 1) fail(format("`ssm_state_indices` must be 1D [B] (got ndim=%d).", idx.ndim));
  const int64_t B = idx.shape[0];
  p.slots = index_entries("ssm_state_indices", idx, B, dev);
  p.accepted = index_entries("accept_lens", args.accept_lens, B, dev);
  commit_tracks(args.track_indices, args.steps_to_track, B, dev, p.track, p.steps);
  fill_commit_head(p, c, st, B, H, L);
  p.kda = args.is_kda;
  p.l2norm = args.use_qk_l2norm;
  p.null_block_id = args.null_block_id;
  p.device = dev;
  p.pdl = args.pdl;
  const bool on_cpu = dev.type == DeviceType::cpu;
  p.check_indices = args.check_indices.value_or(on_cpu);
  if (on_cpu && p.check_indices) {
    std::vector<char> used(static_cast<size_t>(S), 0);
    std::vector<int64_t> tracked;  // rows that store a track state
    for (int64_t b = 0; b < B; ++b) {
      const int64_t slot = p.slots.at(b, 0), a = p.accepted.at(b, 0);
      if (slot <= p.null_block_id || a <= 0) continue;
      if (slot >= S)
        fail(format("`ssm_state_indices`[%lld]=%lld is out of range for a pool of %lld slots",
                    ll(b), ll(slot), ll(S)));
      if (used[static_cast<size_t>(slot)])
        fail(format("`ssm_state_indices`[%lld]=%lld repeats a live slot of this batch", ll(b),
                    ll(slot)));
      used[static_cast<size_t>(slot)] = 1;
      if (a > L)
        fail(format("`accept_lens`[%lld]=%lld exceeds the ring's length L=%lld", ll(b), ll(a),
                    ll(L)));
      if (p.track.ptr) {
        const int64_t ts = p.track.at(b, 0), step = p.steps.at(b, 0);
        if (ts > p.null_block_id && step >= 0 && step < a) {
          if (ts >= S)
            fail(
                format("`mamba_track_indices`[%lld]=%lld is out of range for a pool of %lld "
                       "slots",
                       ll(b), ll(ts), ll(S)));
          tracked.push_back(b);
        }
      }
    }
    check_track_slots(p.track, tracked, used);
  }
  return p;
}

ReplayCircularProblem validate_replayssm_circular_commit(const ReplayCircularCommitArgs& args) {
  check_null_block_id(args.null_block_id);
  const TensorView& st = args.state;
  const CommitPool c = check_commit_pool(st);
  const int lead = c.lead;
  const int64_t layers = c.layers, S = c.S, HV = c.HV, V = c.V, K = c.K;
  const TensorView &dc = args.d_cache, &kc = args.k_cache, &gc = args.g_cache;
  const int64_t R = dc.ndim == st.ndim ? dc.shape[lead] : 0;
  const int64_t L = dc.ndim == st.ndim ? dc.shape[lead + 2] : 0;
  const int64_t H = kc.ndim == st.ndim ? kc.shape[lead + 1] : 0;
  const Device dev = st.device;
  auto ring = [&](const char* name, const TensorView& t, std::initializer_list<int64_t> inner,
                  bool f32) { return check_commit_ring(c, name, t, R, "row", inner, f32, dev); };
  ReplayCircularProblem p;
  check_commit_heads("k_cache", L, H, HV);
  p.d = ring("d_cache", dc, {HV, L, V}, false);
  p.k = ring("k_cache", kc, {H, L, K}, false);
  p.g = ring("g_cache", gc, {HV, L}, true);
  if (args.d_residual.has_value() != args.k_residual.has_value())
    fail("`d_residual_cache` and `k_residual_cache` go together");
  if (args.d_residual) {
    p.d_res = ring("d_residual_cache", *args.d_residual, {HV, L, V}, false);
    p.k_res = ring("k_residual_cache", *args.k_residual, {H, L, K}, false);
  }
  if (dev.type != DeviceType::cpu) {
    check_cuda_commit("commit_gdn_replayssm_circular", K, layers * HV);
    if (L > kReplayCircularMaxL)
      fail(
          format("commit_gdn_replayssm_circular: L=%lld; CUDA tensors take a ring of at most "
                 "%d records",
                 ll(L), kReplayCircularMaxL));
  }
  // The cursor tables: one entry per replay row in use (C entries; C may differ from R).
  if (args.write_pos.ndim != 1) fail("`write_pos` must be a contiguous 1D int32 tensor.");
  const int64_t C = args.write_pos.shape[0];
  check_cursor("write_pos", args.write_pos, C, dev);
  check_cursor("cache_base", args.cache_base, C, dev);
  check_cursor("is_flush", args.is_flush, C, dev, true);
  const TensorView& idx = args.state_indices;
  if (idx.ndim != 1) fail(format("`state_batch_indices` must be 1D [B] (got ndim=%d).", idx.ndim));
  const int64_t B = idx.shape[0];
  p.slots = index_entries("state_batch_indices", idx, B, dev);
  p.rows = index_entries("replay_indices", args.replay_indices, B, dev);
  p.accepted = index_entries("accept_lens", args.accept_lens, B, dev);
  commit_tracks(args.track_indices, args.steps_to_track, B, dev, p.track, p.steps);
  fill_commit_head(p, c, st, B, H, L);
  p.write_pos = static_cast<int32_t*>(args.write_pos.data);
  p.cache_base = static_cast<int32_t*>(args.cache_base.data);
  p.is_flush = args.is_flush.data;
  p.flush_dtype = args.is_flush.dtype;
  p.ring_rows = std::min(R, C);
  p.null_block_id = args.null_block_id;
  p.device = dev;
  p.pdl = args.pdl;
  const bool on_cpu = dev.type == DeviceType::cpu;
  p.check_indices = args.check_indices.value_or(on_cpu);
  if (on_cpu && p.check_indices) {
    std::vector<char> used(static_cast<size_t>(R), 0), live(static_cast<size_t>(S), 0);
    std::vector<int64_t> tracked;  // rows that store a track state
    for (int64_t b = 0; b < B; ++b) {
      const int64_t slot = p.slots.at(b, 0), r = p.rows.at(b, 0);
      if (slot <= p.null_block_id) continue;
      if (slot >= S)
        fail(format("`state_batch_indices`[%lld]=%lld is out of range for a pool of %lld slots",
                    ll(b), ll(slot), ll(S)));
      if (r < 0 || r >= p.ring_rows)
        fail(
            format("`replay_indices`[%lld]=%lld is out of range for rings of %lld rows and "
                   "cursor tables of %lld entries",
                   ll(b), ll(r), ll(R), ll(C)));
      if (used[static_cast<size_t>(r)])
        fail(format("`replay_indices`[%lld]=%lld repeats a live row of this batch", ll(b), ll(r)));
      used[static_cast<size_t>(r)] = 1;
      const int64_t n = p.write_pos[r], base = p.cache_base[r];
      if (n < 0 || n > L)
        fail(format("`write_pos`[%lld]=%lld is outside the ring [0, L=%lld]", ll(r), ll(n), ll(L)));
      if (base < 0 || base >= L)
        fail(format("`cache_base`[%lld]=%lld is outside the ring [0, L-1=%lld]", ll(r), ll(base),
                    ll(L - 1)));
      if (p.track.ptr) {
        const int64_t ts = p.track.at(b, 0), step = p.steps.at(b, 0);
        if (ts > p.null_block_id && step >= 0) {
          if (ts >= S)
            fail(
                format("`mamba_track_indices`[%lld]=%lld is out of range for a pool of %lld "
                       "slots",
                       ll(b), ll(ts), ll(S)));
          tracked.push_back(b);
        }
      }
    }
    for (int64_t b = 0; b < B; ++b) {
      const int64_t slot = p.slots.at(b, 0);
      if (slot > p.null_block_id) live[static_cast<size_t>(slot)] = 1;
    }
    check_track_slots(p.track, tracked, live);
  }
  return p;
}

}  // namespace deltastate::detail
