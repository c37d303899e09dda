// Contracts of ReplaySSM speculative verify and of its cursor commit. The token inputs, the pool
// and the slot indices are the verify op's contract (contracts/verify.cpp, no state written);
// this file checks the rings (the texts of replayssm_decode's contract), the slot-keyed cursors
// and, on CPU tensors, every slot and cursor before anything is written.
#include <cstdint>
#include <vector>

#include "contracts/contract.h"
#include "contracts/validate.h"
#include "core/numeric.h"

namespace deltastate::detail {

namespace {
long long ll(int64_t v) { return static_cast<long long>(v); }

// A [slots] int32 cursor table, contiguous, on `dev`.
void check_cursor(const char* name, const TensorView& t, int64_t slots, const Device& dev) {
  if (t.ndim != 1 || t.dtype != DType::i32 || !t.is_contiguous())
    fail(format("`%s` must be a contiguous 1D int32 tensor.", name));
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

}  // namespace

ReplayVerifyProblem validate_replayssm_verify(const ReplayVerifyArgs& args) {
  {  // its checkpoint is read only, as a float state (verify takes quantized pools, this op not)
    Contract c;
    c.float_state("initial_state", args.state);
  }
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
  va.state_indices = args.state_indices;
  va.update_state = false;
  va.check_indices = false;  // the slots are checked below, with null_block_id's padding
  va.pdl = args.pdl;
  ReplayVerifyProblem p;
  p.r = validate_verify(va).r;
  RecurrentProblem& r = p.r;
  const int64_t S = r.state.num_slots, HV = r.HV, H = r.H, V = r.V, K = r.K;
  const Device dev = r.device;

  const TensorView& dc = args.d_cache;
  const TensorView& kc = args.k_cache;
  const TensorView& gc = args.g_cache;
  const int64_t L = replay_ring_length(dc, S, HV, V);
  check_replay_rings(dc, kc, gc, S, HV, H, V, K, L, args.is_kda);
  for (const TensorView* t : {&dc, &kc})
    if (!is_floating(t->dtype))
      fail(format("ReplaySSM ring caches must be floating point (got %s).",
                  dtype_mark(dtype_name(t->dtype)).c_str()));
  for (const TensorView* t : {&dc, &kc, &gc})
    if (!(t->device == dev)) fail("ReplaySSM inputs must be on the same device.");
  check_cursor("write_pos", args.write_pos, S, dev);
  check_cursor("cache_base", args.cache_base, S, dev);
  check_cursor("is_flush", args.is_flush, S, dev);
  if (!r.indices) fail("`state_indices` is required: the cursors are keyed by slot");

  p.L = static_cast<int32_t>(L);
  p.d_cache = dc.data;
  p.d_dtype = dc.dtype;
  p.k_cache = kc.data;
  p.k_dtype = kc.dtype;
  p.g_cache = static_cast<float*>(gc.data);
  p.write_pos = static_cast<const int32_t*>(args.write_pos.data);
  p.cache_base = static_cast<const int32_t*>(args.cache_base.data);
  p.is_flush = static_cast<const int32_t*>(args.is_flush.data);
  p.null_block_id = args.null_block_id;

  // CPU tensors (default on): every slot and cursor checked before anything is written. CUDA
  // tensors: the kernel checks them on the device (a bad row is skipped, NaN, and recorded);
  // check_indices=true then synchronizes and raises after the launch.
  const bool on_cpu = dev.type == DeviceType::cpu;
  const bool check = args.check_indices.value_or(on_cpu);
  r.check_indices = check;
  if (on_cpu && check) {
    std::vector<char> used(static_cast<size_t>(S), 0);
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
      const int64_t m = p.write_pos[slot], base = p.cache_base[slot];
      const int64_t len = r.cu_seqlens ? load_index(r.cu_seqlens, r.cu_dtype, n + 1) -
                                             load_index(r.cu_seqlens, r.cu_dtype, n)
                                       : r.T;
      if (m < 0 || m > L)
        fail(format("`write_pos`[%lld]=%lld is outside the ring [0, L=%lld]", ll(slot), ll(m),
                    ll(L)));
      if (base < 0 || base >= L)
        fail(format("`cache_base`[%lld]=%lld is outside the ring [0, L-1=%lld]", ll(slot), ll(base),
                    ll(L - 1)));
      if (m + len > L)
        fail(
            format("sequence %lld: write_pos=%lld plus %lld draft tokens overflows the ring of "
                   "L=%lld (the commit's max_spec_len must cover the drafts)",
                   ll(n), ll(m), ll(len), ll(L)));
    }
  }
  return p;
}

ReplayCommitProblem validate_replayssm_commit(const ReplayCommitArgs& args) {
  const TensorView& wp = args.write_pos;
  if (wp.ndim != 1) fail("`write_pos` must be a contiguous 1D int32 tensor.");
  const int64_t S = wp.shape[0];
  const Device dev = wp.device;
  check_cursor("write_pos", wp, S, dev);
  check_cursor("cache_base", args.cache_base, S, dev);
  check_cursor("is_flush", args.is_flush, S, dev);
  const int64_t B = args.state_indices.ndim == 1 ? args.state_indices.shape[0] : -1;
  ReplayCommitProblem p;
  p.slots = index_entries("state_indices", args.state_indices, B, dev);
  p.accepted = index_entries("num_accepted", args.num_accepted, B, dev);
  const int64_t L = args.max_cache_len, T = args.max_spec_len;
  if (L < 1 || L > (int64_t{1} << 30))
    fail(format("max_cache_len must be in [1, 2^30] (got %lld)", ll(L)));
  if (T < 1 || 2 * T > L)
    fail(format("max_spec_len must be >= 1 with 2 * max_spec_len <= max_cache_len=%lld (got %lld)",
                ll(L), ll(T)));
  p.B = static_cast<int32_t>(B);
  p.L = static_cast<int32_t>(L);
  p.max_spec_len = static_cast<int32_t>(T);
  p.write_pos = static_cast<int32_t*>(wp.data);
  p.cache_base = static_cast<int32_t*>(args.cache_base.data);
  p.is_flush = static_cast<int32_t*>(args.is_flush.data);
  p.num_slots = S;
  p.null_block_id = args.null_block_id;
  p.device = dev;
  p.pdl = args.pdl;
  const bool on_cpu = dev.type == DeviceType::cpu;
  p.check_indices = args.check_indices.value_or(on_cpu);
  if (on_cpu && p.check_indices) {
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

}  // namespace deltastate::detail
