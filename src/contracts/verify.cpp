// Contracts of speculative verify and of its commits (update_state_after_verify, and
// update_conv_state_after_verify for the conv windows). The token inputs, the gate and beta
// options are the recurrent op's, checked by its validator; this file checks what verify adds:
// the pool and its index tables, the intermediate-state buffer, the tree's parent table, and
// (CPU tensors) every index's range before anything is written.
#include <cstdint>
#include <string>

#include "contracts/contract.h"
#include "contracts/validate.h"
#include "core/numeric.h"

namespace deltastate::detail {

namespace {

// A [N] index tensor (any stride) or a [N, >= cols] table, as an IndexTable.
IndexTable index_vector(Contract& c, const char* name, const TensorView& t, int64_t n) {
  if (t.ndim != 1 || t.shape[0] != n)
    fail(format("`%s` must have shape [N]=(%lld,); got %s", name, static_cast<long long>(n),
                shape_str(t).c_str()));
  c.index_dtype(name, t);
  c.device(name, t);
  return {t.data, t.dtype, n > 1 ? t.stride[0] : 1, 1, 1};
}

IndexTable index_table(Contract& c, const char* name, const TensorView& t, int64_t n,
                       int64_t min_cols) {
  if (t.ndim != 2 || t.shape[0] != n || t.shape[1] < min_cols)
    fail(format("`%s` must have shape [N, >= T]=(%lld, >= %lld); got %s", name,
                static_cast<long long>(n), static_cast<long long>(min_cols), shape_str(t).c_str()));
  c.index_dtype(name, t);
  c.device(name, t);
  return {t.data, t.dtype, t.stride[0], t.stride[1], t.shape[1]};
}

// A state-shaped block [lead..., HV, V, K] with compact inner dims (pool, scratch buffer).
void check_state_block(Contract& c, const char* name, const TensorView& t, int lead,
                       const char* lead_names, bool quantized_ok = false) {
  if (t.ndim != lead + 3)
    fail(format("`%s` must be a %dD tensor [%s, HV, V, K] (got ndim=%d).", name, lead + 3,
                lead_names, t.ndim));
  const int64_t HV = t.shape[lead], V = t.shape[lead + 1], K = t.shape[lead + 2];
  if (HV != c.get("HV") || V != c.get("V") || K != c.get("K"))
    fail(format("`%s` must have inner dims [HV, V, K]=(%lld, %lld, %lld); got %s", name,
                static_cast<long long>(c.get("HV")), static_cast<long long>(c.get("V")),
                static_cast<long long>(c.get("K")), shape_str(t).c_str()));
  if (t.stride[lead] != V * K || t.stride[lead + 1] != K || t.stride[lead + 2] != 1)
    fail(format("`%s` must be contiguous in its [HV, V, K] inner dimensions; got strides %s", name,
                stride_str(t).c_str()));
  if (!(quantized_ok && is_quantized(t.dtype))) c.float_state(name, t);
  c.device(name, t);
}

[[noreturn]] void fail_range(const char* name, int64_t row, int64_t col, int64_t value,
                             const char* what, const char* unit, int64_t limit) {
  const std::string at =
      col < 0 ? format("[%lld]", static_cast<long long>(row))
              : format("[%lld, %lld]", static_cast<long long>(row), static_cast<long long>(col));
  fail(
      format("`%s`%s=%lld is out of range for %s of %lld %s (valid: 0..%lld; < 0 marks a padded "
             "row)",
             name, at.c_str(), static_cast<long long>(value), what, static_cast<long long>(limit),
             unit, static_cast<long long>(limit - 1)));
}

int64_t seq_len_host(const RecurrentProblem& r, int64_t n) {
  if (!r.cu_seqlens) return r.T;
  return load_index(r.cu_seqlens, r.cu_dtype, n + 1) - load_index(r.cu_seqlens, r.cu_dtype, n);
}

// Every index a CPU call would follow, checked before anything is written (verify.cpp's kernel
// trusts them). The same conditions are the CUDA kernel's bad rows.
void check_verify_host(const VerifyProblem& p) {
  const RecurrentProblem& r = p.r;
  const int64_t slots = r.state.num_slots;
  for (int64_t n = 0; n < r.N; ++n) {
    const int64_t len = seq_len_host(r, n);
    int64_t start;
    if (p.source.ptr) {
      start = p.source_indices.at(n, 0);
      if (start >= p.source.num_slots)
        fail_range("source_state_indices", n, -1, start, "a source state pool", "rows",
                   p.source.num_slots);
    } else if (p.num_accepted.ptr) {
      const int64_t a = p.num_accepted.at(n, 0);
      if (a < 1 || a > p.token_slots.cols)
        fail(
            format("`num_accepted_tokens`[%lld]=%lld must be within [1, %lld] (the columns of "
                   "`token_state_indices`)",
                   static_cast<long long>(n), static_cast<long long>(a),
                   static_cast<long long>(p.token_slots.cols)));
      start = p.token_slots.at(n, a - 1);
      if (start >= slots)
        fail_range("token_state_indices", n, a - 1, start, "a state pool", "slots", slots);
    } else {
      start = r.indices ? index_at(r.indices, r.index_dtype, r.index_stride, n) : n;
      if (start >= slots) fail_range("state_indices", n, -1, start, "a state pool", "slots", slots);
    }
    if (start < 0) continue;  // padded: nothing else is followed
    if (p.output_indices.ptr) {
      const int64_t o = p.output_indices.at(n, 0);
      if (o >= slots) fail_range("output_state_indices", n, -1, o, "a state pool", "slots", slots);
    } else if (p.source.ptr && r.update_state && !p.token_slots.ptr && r.indices) {
      // with a source pool, state_indices only name where the final state is stored
      const int64_t home = index_at(r.indices, r.index_dtype, r.index_stride, n);
      if (home >= slots) fail_range("state_indices", n, -1, home, "a state pool", "slots", slots);
    }
    if (p.token_slots.ptr) {
      if (len > p.token_slots.cols)
        fail(format("sequence %lld has %lld tokens but `token_state_indices` has %lld columns",
                    static_cast<long long>(n), static_cast<long long>(len),
                    static_cast<long long>(p.token_slots.cols)));
      for (int64_t t = 0; t < len; ++t) {
        const int64_t s = p.token_slots.at(n, t);
        if (s >= slots) fail_range("token_state_indices", n, t, s, "a state pool", "slots", slots);
      }
    }
    int64_t row = -1;
    if (p.inter) {
      row = p.inter_indices.ptr ? p.inter_indices.at(n, 0) : n;
      if (row >= p.inter_rows)
        fail_range(p.inter_indices.ptr ? "intermediate_state_indices" : "intermediate_states", n,
                   -1, row, "an intermediate-state buffer", "rows", p.inter_rows);
      if (row >= 0 && len > p.inter_steps)
        fail(
            format("sequence %lld has %lld tokens but `intermediate_states` holds %lld steps "
                   "per row",
                   static_cast<long long>(n), static_cast<long long>(len),
                   static_cast<long long>(p.inter_steps)));
    }
    if (p.parents.ptr && row >= 0) {
      if (len > p.parents.cols)
        fail(format("sequence %lld has %lld tokens but `parent_tokens` has %lld columns",
                    static_cast<long long>(n), static_cast<long long>(len),
                    static_cast<long long>(p.parents.cols)));
      for (int64_t t = 1; t < len; ++t) {
        const int64_t par = p.parents.at(n, t);
        if (par >= t)
          fail(
              format("`parent_tokens`[%lld, %lld]=%lld must be an earlier token (< %lld), or "
                     "< 0 for the initial state",
                     static_cast<long long>(n), static_cast<long long>(t),
                     static_cast<long long>(par), static_cast<long long>(t)));
      }
    }
  }
}

// The commits' indices, followed on the host before anything is written (CPU tensors); the same
// conditions are the CUDA kernels' bad rows. `buffer` names the scratch tensor in the texts.
void check_commit_host(const CommitProblem& p, const char* buffer, const char* buffer_what) {
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t step = p.accepted.at(b, 0) - (p.accepted_is_step ? 0 : 1);
    const int64_t slot = p.slots.at(b, 0);
    const int64_t row = p.rows.ptr ? p.rows.at(b, 0) : b;
    if (step < 0 || slot < 0 || row < 0) continue;  // nothing accepted, or padding
    if (slot >= p.num_slots)
      fail_range("state_indices", b, -1, slot, "a state pool", "slots", p.num_slots);
    if (row >= p.inter_rows)
      fail_range(p.rows.ptr ? "intermediate_state_indices" : buffer, b, -1, row, buffer_what,
                 "rows", p.inter_rows);
    if (step >= p.inter_steps)
      fail(format("`accepted`[%lld]=%lld needs step %lld but `%s` holds %lld steps per row",
                  static_cast<long long>(b), static_cast<long long>(p.accepted.at(b, 0)),
                  static_cast<long long>(step), buffer, static_cast<long long>(p.inter_steps)));
  }
  check_slot_indices_host("state_indices", p.slots.ptr, p.slots.dtype, p.B, p.slots.row_stride,
                          p.num_slots);
}

// A [rows, cols] block with these element strides is one dense range of rows * cols elements
// (row- or column-major; a dim of size 1 has no stride that matters).
bool dense_block(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride) {
  if (rows <= 1) return cols <= 1 || col_stride == 1;
  if (cols <= 1) return row_stride == 1;
  return (col_stride == 1 && row_stride == cols) || (row_stride == 1 && col_stride == rows);
}

}  // namespace

VerifyProblem validate_verify(const VerifyArgs& args, const char* op) {
  // The token inputs, gate, beta, scale and cu_seqlens: the recurrent op's contract. The pool is
  // checked here (its index tables differ), so the recurrent validator sees none.
  RecurrentArgs ra;
  ra.q = args.q;
  ra.k = args.k;
  ra.v = args.v;
  ra.g = args.g;
  ra.beta = args.beta;
  ra.out = args.out;
  ra.A_log = args.A_log;
  ra.dt_bias = args.dt_bias;
  ra.gate_in_kernel = args.gate_in_kernel;
  ra.lower_bound = args.lower_bound;
  ra.beta_is_logit = args.beta_is_logit;
  ra.round_beta_to_input = args.round_beta_to_input;
  ra.scale = args.scale;
  ra.cu_seqlens = args.cu_seqlens;
  ra.update_state = false;
  ra.stride_contract = false;
  ra.use_qk_l2norm = args.use_qk_l2norm;
  ra.check_indices = false;
  ra.pdl = args.pdl;
  if (!args.is_kda && args.g.ndim == 4)
    fail("verify: a GDN gate has one value per value head: `g` must be [B, T, HV]");
  VerifyProblem p;
  p.r = validate_recurrent(ra, args.is_kda);
  RecurrentProblem& r = p.r;
  const int64_t N = r.N;

  Contract c;
  c.bind("HV", r.HV, "`v`");
  c.bind("V", r.V, "`v`");
  c.bind("K", r.K, "`q`");
  c.device("q", args.q);
  check_state_block(c, "state", args.state, 1, "slots", /*quantized_ok=*/true);
  r.state = {args.state.data, args.state.dtype, args.state.stride[0], args.state.shape[0]};
  check_state_format(c, op, "state", args.state, args.state_format, true, r.state);
  // A pool in its storage format (quantized, or rounded stochastically) is written through it;
  // a source pool with it is the caller's float pool (below).
  const bool formatted = r.state.formatted();
  r.update_state = args.update_state;

  if (args.token_state_indices) {
    p.token_slots = index_table(c, "token_state_indices", *args.token_state_indices, N, 1);
  }
  if (args.num_accepted_tokens) {
    if (!args.token_state_indices)
      fail(
          "`num_accepted_tokens` selects each sequence's starting slot from "
          "`token_state_indices`, which was not given");
    if (args.state_indices)
      fail("`state_indices` and `num_accepted_tokens` both choose the starting slot; give one");
    p.num_accepted = index_vector(c, "num_accepted_tokens", *args.num_accepted_tokens, N);
  }
  if (args.source_state || args.source_state_indices) {
    if (!args.source_state || !args.source_state_indices)
      fail(
          "`source_state` and `source_state_indices` must be given together: the start pool and "
          "each sequence's row in it");
    if (args.num_accepted_tokens)
      fail(
          "`source_state_indices` and `num_accepted_tokens` both choose the starting state; give "
          "one");
    const TensorView& src = *args.source_state;
    // With a formatted `state` the source is a float pool of any float dtype, read as it is (no
    // scales of its own); the states verify writes go to `state` through its format.
    if (formatted && is_quantized(src.dtype))
      throw Error(ErrorKind::not_implemented,
                  format("%s: `source_state` is %s: the read-only source pool of a %s `state`%s "
                         "is a float pool (float32, bfloat16 or float16; issue #36)",
                         op, dtype_name(src.dtype), dtype_name(args.state.dtype),
                         is_quantized(args.state.dtype) ? "" : " rounded stochastically"));
    check_state_block(c, "source_state", src, 1, "N0");
    if (!formatted && src.dtype != args.state.dtype)
      fail(format("`source_state` must have the dtype of `state` (%s); got %s",
                  dtype_mark(dtype_name(args.state.dtype)).c_str(),
                  dtype_mark(dtype_name(src.dtype)).c_str()));
    p.source = {src.data, src.dtype, src.stride[0], src.shape[0]};
    p.source_indices = index_vector(c, "source_state_indices", *args.source_state_indices, N);
  }
  // Without state_indices sequence n follows slot n: its start, or with a source pool the slot
  // its final state is stored to in place (when it is).
  const bool slot_n_followed = args.source_state ? args.update_state && !args.token_state_indices &&
                                                       !args.output_state_indices
                                                 : !args.num_accepted_tokens;
  if (args.state_indices) {
    const IndexTable t = index_vector(c, "state_indices", *args.state_indices, N);
    r.indices = t.ptr;
    r.index_dtype = t.dtype;
    r.index_stride = t.row_stride;
  } else if (slot_n_followed && args.state.shape[0] < N) {
    fail(
        format("without `state_indices` sequence n %s slot n: the pool needs at least N=%lld slots "
               "(got %lld)",
               args.source_state ? "stores its final state to" : "starts from",
               static_cast<long long>(N), static_cast<long long>(args.state.shape[0])));
  }
  if (args.output_state_indices) {
    if (args.token_state_indices)
      fail(
          "`output_state_indices` and `token_state_indices` both place states in the pool; with "
          "per-token slots the last token's slot holds the final state");
    p.output_indices = index_vector(c, "output_state_indices", *args.output_state_indices, N);
  }
  if (args.intermediate_states) {
    const TensorView& b = *args.intermediate_states;
    check_state_block(c, "intermediate_states", b, 2, "N_scr, T_alloc", /*quantized_ok=*/true);
    if (const TensorView* s =
            check_scratch_format(c, "verify", b, args.intermediate_state_scales, args.state)) {
      p.inter_scales = static_cast<float*>(s->data);
      p.inter_scale_row_stride = s->stride[0];
      p.inter_scale_step_stride = s->stride[1];
    }
    p.inter = b.data;
    p.inter_dtype = b.dtype;
    p.inter_row_stride = b.stride[0];
    p.inter_step_stride = b.stride[1];
    p.inter_rows = b.shape[0];
    p.inter_steps = b.shape[1];
  }
  if (args.intermediate_state_scales && !args.intermediate_states)
    fail(
        "`intermediate_state_scales` are the scales of a quantized `intermediate_states` buffer, "
        "which was not given");
  if (args.intermediate_state_indices) {
    if (!args.intermediate_states)
      fail(
          "`intermediate_state_indices` index an `intermediate_states` buffer, which was not "
          "given");
    const TensorView& t = *args.intermediate_state_indices;
    if (t.ndim != 1 || t.shape[0] != N)
      fail(format(
          "The number of intermediate state indices is expected to be equal to the "
          "number of input sequences, i.e., %lld != %lld.",
          static_cast<long long>(N), static_cast<long long>(t.ndim == 1 ? t.shape[0] : t.numel())));
    p.inter_indices = index_vector(c, "intermediate_state_indices", t, N);
  }
  if (args.parent_tokens) {
    if (!args.intermediate_states)
      fail(
          "`parent_tokens` (an EAGLE tree) needs `intermediate_states`: each token reads its "
          "parent's state back from there");
    p.parents = index_table(c, "parent_tokens", *args.parent_tokens, N, 1);
  }
  const bool any_ring = args.ring_v || args.ring_k || args.ring_g || args.ring_beta;
  if (any_ring) {  // SGLang's cache_ring: the raw inputs of steps t < L at each sequence's slot
    if (!args.ring_v || !args.ring_k || !args.ring_g || !args.ring_beta)
      fail(
          "cache_ring needs all four raw rings (`replayssm_rawv`, `replayssm_rawk`, "
          "`replayssm_g`, `replayssm_beta`)");
    const TensorView &rv = *args.ring_v, &rk = *args.ring_k, &rg = *args.ring_g,
                     &rb = *args.ring_beta;
    const int64_t S = args.state.shape[0], L = rv.ndim == 4 ? rv.shape[2] : 0;
    auto ring = [&](const char* name, const TensorView& t, std::initializer_list<int64_t> shape,
                    bool f32) {
      bool ok = t.ndim == static_cast<int>(shape.size()) && t.is_contiguous();
      int i = 0;
      for (int64_t e : shape) ok = ok && t.shape[i++] == e;
      if (!ok)
        fail(
            format("cache_ring expects per-layer ring views: `%s` must be a contiguous tensor "
                   "of shape %s (got %s).",
                   name, tuple_str(shape).c_str(), shape_str(t).c_str()));
      if (f32 ? t.dtype != DType::f32 : !is_floating(t.dtype))
        fail(format(f32 ? "`%s` must be float32 (got %s)." : "`%s` must be floating (got %s).",
                    name, dtype_mark(dtype_name(t.dtype)).c_str()));
      c.device(name, t);
    };
    ring("replayssm_rawv", rv, {S, r.HV, L, r.V}, false);
    ring("replayssm_rawk", rk, {S, r.H, L, r.K}, false);
    if (args.is_kda) ring("replayssm_g", rg, {S, r.HV, L, r.K}, true);
    else ring("replayssm_g", rg, {S, r.HV, L}, true);
    ring("replayssm_beta", rb, {S, r.HV, L}, true);
    if (L < 1) fail("ReplaySSM cache length must be at least 1.");
    p.ring_v = rv.data;
    p.ring_v_dtype = rv.dtype;
    p.ring_k = rk.data;
    p.ring_k_dtype = rk.dtype;
    p.ring_g = static_cast<float*>(rg.data);
    p.ring_beta = static_cast<float*>(rb.data);
    p.ring_len = static_cast<int32_t>(L);
  }
  p.keep_padded_outputs = args.keep_padded_outputs;
  c.check_devices("All inputs must be on the same device", true);
  check_state_format_backend(op, r.state, r.device, /*cuda_built=*/true);

  const bool on_cpu = r.device.type == DeviceType::cpu;
  const bool check = args.check_indices.value_or(on_cpu);
  r.check_indices = check;
  if (on_cpu && check) {
    check_verify_host(p);
    if (p.ring_v && r.indices)  // each slot's ring written by one sequence
      check_slot_indices_host("state_indices", r.indices, r.index_dtype, N, r.index_stride,
                              r.state.num_slots);
    if (r.update_state && !p.token_slots.ptr) {  // slots written once per sequence: distinct
      if (p.output_indices.ptr)
        check_slot_indices_host("output_state_indices", p.output_indices.ptr,
                                p.output_indices.dtype, N, p.output_indices.row_stride,
                                r.state.num_slots);
      else if (r.indices)
        check_slot_indices_host("state_indices", r.indices, r.index_dtype, N, r.index_stride,
                                r.state.num_slots);
    }
  }
  return p;
}

namespace {

// What both commits check and fill alike, after their tensors' own checks: the index vectors
// (the devices last), the outer dims of the pool `st` [layers?, slots, ...] and of the scratch
// `in` [layers?, rows, steps, ...], the flags. The entry's shape is the caller's.
template <class Args>
CommitProblem commit_problem(Contract& c, const Args& args, const TensorView& st,
                             const TensorView& in, bool layered) {
  const int lead = layered ? 1 : 0;
  const TensorView& idx = args.state_indices;
  if (idx.ndim != 1) fail(format("`state_indices` must be 1D [B] (got ndim=%d).", idx.ndim));
  const int64_t B = idx.shape[0];
  CommitProblem p;
  p.slots = index_vector(c, "state_indices", idx, B);
  p.accepted = index_vector(c, "accepted", args.accepted, B);
  if (args.intermediate_state_indices)
    p.rows = index_vector(c, "intermediate_state_indices", *args.intermediate_state_indices, B);
  c.check_devices("All inputs must be on the same device", true);
  p.B = static_cast<int32_t>(B);
  p.layers = layered ? static_cast<int32_t>(st.shape[0]) : 1;
  p.state = st.data;
  p.inter = in.data;
  p.dtype = st.dtype;
  p.state_layer_stride = layered ? st.stride[0] : 0;
  p.state_slot_stride = st.stride[lead];
  p.num_slots = st.shape[lead];
  p.inter_layer_stride = layered ? in.stride[0] : 0;
  p.inter_row_stride = in.stride[lead];
  p.inter_step_stride = in.stride[lead + 1];
  p.inter_rows = in.shape[lead];
  p.inter_steps = in.shape[lead + 1];
  p.accepted_is_step = args.accepted_is_step;
  p.pdl = args.pdl;
  p.device = c.common_device();
  p.check_indices = args.check_indices.value_or(p.device.type == DeviceType::cpu);
  return p;
}

}  // namespace

CommitProblem validate_commit(const CommitArgs& args) {
  const TensorView& st = args.state;
  const TensorView& in = args.intermediate_states;
  const bool layered = st.ndim == 5;
  if (st.ndim != 4 && st.ndim != 5)
    fail(format("`state` must be [layers, slots, HV, V, K] or [slots, HV, V, K] (got ndim=%d).",
                st.ndim));
  if (in.ndim != st.ndim + 1)
    fail(format("`intermediate_states` must be %s (got ndim=%d).",
                layered ? "[layers, N_scr, T_alloc, HV, V, K]" : "[N_scr, T_alloc, HV, V, K]",
                in.ndim));
  const int lead = layered ? 1 : 0;
  Contract c;
  c.bind("HV", st.shape[lead + 1], "`state`");
  c.bind("V", st.shape[lead + 2], "`state`");
  c.bind("K", st.shape[lead + 3], "`state`");
  check_state_block(c, "state", st, lead + 1, layered ? "layers, slots" : "slots",
                    /*quantized_ok=*/true);
  check_state_block(c, "intermediate_states", in, lead + 2,
                    layered ? "layers, N_scr, T_alloc" : "N_scr, T_alloc", /*quantized_ok=*/true);
  if (layered && in.shape[0] != st.shape[0])
    fail(format("`intermediate_states` has %lld layers and `state` %lld; they must match",
                static_cast<long long>(in.shape[0]), static_cast<long long>(st.shape[0])));
  const bool quantized = is_quantized(st.dtype);
  const TensorView* inter_scales =
      check_scratch_format(c, "update_state_after_verify", in, args.intermediate_state_scales, st);
  StatePoolRef ref{st.data, st.dtype, st.stride[lead], st.shape[lead]};
  check_state_format(c, "update_state_after_verify", "state", st, args.state_format, true, ref,
                     layered ? st.shape[0] : 1);
  CommitProblem p = commit_problem(c, args, st, in, layered);
  check_state_format_backend("update_state_after_verify", ref, p.device, /*cuda_built=*/true);
  if (quantized && p.device.type == DeviceType::cuda) require_cuda_k(st.shape[lead + 3]);
  p.head_elems = st.shape[lead + 1] * st.shape[lead + 2] * st.shape[lead + 3];
  p.inner_cols = p.head_elems;  // one dense row: flat
  p.inter_dtype = in.dtype;
  p.K = static_cast<int32_t>(st.shape[lead + 3]);
  if (quantized) {
    const TensorView& sc = *args.state_format.scales;
    p.scales = ref.scales;
    p.scales_layer_stride = layered ? sc.stride[0] : 0;
    p.scales_slot_stride = ref.scale_slot_stride;
    p.stochastic = ref.stochastic;
    p.steps = ref.step;
    p.seed = ref.seed;
    p.layer0 = ref.layer;
  }
  if (inter_scales) {
    p.inter_scales = static_cast<const float*>(inter_scales->data);
    p.inter_scale_layer_stride = layered ? inter_scales->stride[0] : 0;
    p.inter_scale_row_stride = inter_scales->stride[lead];
    p.inter_scale_step_stride = inter_scales->stride[lead + 1];
  }
  if (p.device.type == DeviceType::cpu && p.check_indices)
    check_commit_host(p, "intermediate_states", "an intermediate-state buffer");
  return p;
}

CommitProblem validate_conv_commit(const ConvCommitArgs& args) {
  const TensorView& st = args.conv_state;
  const TensorView& in = args.intermediate_conv_window;
  const bool layered = st.ndim == 4;
  if (st.ndim != 3 && st.ndim != 4)
    fail(format("`conv_state` must be [layers, slots, dim, W1] or [slots, dim, W1] (got ndim=%d).",
                st.ndim));
  if (in.ndim != st.ndim + 1)
    fail(format("`intermediate_conv_window` must be %s (got ndim=%d).",
                layered ? "[layers, N_scr, T_alloc, dim, W1]" : "[N_scr, T_alloc, dim, W1]",
                in.ndim));
  const int lead = layered ? 1 : 0;
  const int64_t dim = st.shape[lead + 1], W1 = st.shape[lead + 2];
  if (in.shape[lead + 2] != dim || in.shape[lead + 3] != W1)
    fail(
        format("`intermediate_conv_window` must have windows [dim, W1]=(%lld, %lld), those of "
               "`conv_state`; got %s",
               static_cast<long long>(dim), static_cast<long long>(W1), shape_str(in).c_str()));
  if (layered && in.shape[0] != st.shape[0])
    fail(format("`intermediate_conv_window` has %lld layers and `conv_state` %lld; they must match",
                static_cast<long long>(in.shape[0]), static_cast<long long>(st.shape[0])));
  Contract c;
  c.floating("conv_state", st);
  c.device("conv_state", st);
  c.floating("intermediate_conv_window", in);
  c.device("intermediate_conv_window", in);
  if (in.dtype != st.dtype)
    fail(format("`intermediate_conv_window` must have the dtype of `conv_state` (%s); got %s",
                dtype_mark(dtype_name(st.dtype)).c_str(),
                dtype_mark(dtype_name(in.dtype)).c_str()));
  CommitProblem p = commit_problem(c, args, st, in, layered);
  p.head_elems = dim * W1;
  p.inner_rows = dim;
  p.inner_cols = W1;
  p.state_inner_row_stride = st.stride[lead + 1];
  p.state_inner_col_stride = st.stride[lead + 2];
  p.inter_inner_row_stride = in.stride[lead + 2];
  p.inter_inner_col_stride = in.stride[lead + 3];
  p.flat = dense_block(dim, W1, p.state_inner_row_stride, p.state_inner_col_stride) &&
           dense_block(dim, W1, p.inter_inner_row_stride, p.inter_inner_col_stride) &&
           (dim <= 1 || p.state_inner_row_stride == p.inter_inner_row_stride) &&
           (W1 <= 1 || p.state_inner_col_stride == p.inter_inner_col_stride);
  p.err_op = kErrOpConvCommit;
  if (p.device.type == DeviceType::cpu && p.check_indices)
    check_commit_host(p, "intermediate_conv_window", "an intermediate conv-window buffer");
  return p;
}

}  // namespace deltastate::detail
