// Contract of chunked prefill (ops.h ChunkPrefillArgs): FLA's chunk_gated_delta_rule / chunk_kda
// arguments (their texts where FLA or FlashInfer define one, FlashInfer's for the checkpoint
// arguments), the recurrent op's texts for the arguments the two ops share, and the pool's slot
// rules. Host data (cu_seqlens, checkpoint counts, slot indices) is read on the CPU only, before
// anything is written.
#include <cmath>
#include <cstdint>
#include <string>
#include <unordered_map>

#include "contracts/contract.h"
#include "contracts/problem_parts.h"
#include "contracts/validate.h"
#include "core/numeric.h"

namespace deltastate::detail {

namespace {

long long ll(int64_t v) { return static_cast<long long>(v); }

// A 1-D [n] index tensor: shape, dtype, contiguity, device.
void index_vector(Contract& c, const char* name, const TensorView& t, const char* dim) {
  c.shape(name, t, {dim});
  c.index_dtype(name, t);
  c.contiguous(name, t);
  c.device(name, t);
}

int64_t seq_len(const ChunkPrefillArgs& args, int64_t T, int64_t n) {
  if (!args.cu_seqlens) return T;
  const TensorView& cu = *args.cu_seqlens;
  return load_index(cu.data, cu.dtype, n + 1) - load_index(cu.data, cu.dtype, n);
}

// checkpoint_cu_starts counts len / every checkpoints per sequence from 0; returns the total.
int64_t check_checkpoint_counts_host(const ChunkPrefillArgs& args, int64_t N, int64_t T,
                                     int64_t every) {
  const TensorView& cs = *args.checkpoint_cu_starts;
  const int64_t first = load_index(cs.data, cs.dtype, 0);
  if (first != 0)
    fail(format("`checkpoint_cu_starts` must start at 0; got checkpoint_cu_starts[0]=%lld",
                ll(first)));
  int64_t total = 0;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t len = seq_len(args, T, n);
    const int64_t next = load_index(cs.data, cs.dtype, n + 1);
    if (next - total != len / every) {
      fail(format(
          "`checkpoint_cu_starts` must count len / %lld checkpoints per sequence: sequence "
          "%lld has %lld tokens and so %lld, but checkpoint_cu_starts[%lld] - "
          "checkpoint_cu_starts[%lld] = %lld - %lld",
          ll(every), ll(n), ll(len), ll(len / every), ll(n + 1), ll(n), ll(next), ll(total)));
    }
    total = next;
  }
  return total;
}

// The pool slots a call writes: every live sequence's final state (output_state_indices, else in
// place) and its stored checkpoints. Each in range, each written once, and none the initial slot
// of a live sequence other than that sequence's own final state.
void check_pool_writes_host(const ChunkPrefillArgs& args, int64_t N, int64_t slots) {
  const TensorView& in = *args.initial_state_indices;
  std::unordered_map<int64_t, int64_t> reader;  // initial slot -> sequence
  for (int64_t n = 0; n < N; ++n) {
    const int64_t s = load_index(in.data, in.dtype, n);
    if (s >= 0) reader.emplace(s, n);
  }
  std::unordered_map<int64_t, std::string> writer;  // slot -> what writes it
  auto claim = [&](int64_t slot, int64_t n, const std::string& what, bool final_state) {
    auto r = reader.find(slot);
    if (r != reader.end() && !(final_state && r->second == n)) {
      fail(
          format("slot %lld is the initial state of sequence %lld and would receive %s; a "
                 "sequence's initial slot may only receive its own final state",
                 ll(slot), ll(r->second), what.c_str()));
    }
    auto [w, inserted] = writer.emplace(slot, what);
    if (!inserted) {
      fail(format("slot %lld would receive both %s and %s; every written slot needs its own",
                  ll(slot), w->second.c_str(), what.c_str()));
    }
  };
  auto out_of_range = [&](const char* name, int64_t i, int64_t slot, const char* negative) {
    fail(
        format("`%s`[%lld]=%lld is out of range for a state pool of %lld slots (valid: 0..%lld; "
               "< 0 %s)",
               name, ll(i), ll(slot), ll(slots), ll(slots - 1), negative));
  };
  for (int64_t n = 0; n < N; ++n) {
    const int64_t in_slot = load_index(in.data, in.dtype, n);
    if (in_slot < 0) continue;  // padded: writes nothing
    int64_t out = in_slot;
    if (args.output_state_indices) {
      const TensorView& o = *args.output_state_indices;
      out = load_index(o.data, o.dtype, n);
      if (out >= slots) out_of_range("output_state_indices", n, out, "stores no final state");
    }
    if (out >= 0) claim(out, n, format("the final state of sequence %lld", ll(n)), true);
    if (!args.checkpoint_slot_indices) continue;
    const TensorView& cs = *args.checkpoint_cu_starts;
    const TensorView& ck = *args.checkpoint_slot_indices;
    const int64_t begin = load_index(cs.data, cs.dtype, n),
                  end = load_index(cs.data, cs.dtype, n + 1);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = load_index(ck.data, ck.dtype, i);
      if (slot >= slots) out_of_range("checkpoint_slot_indices", i, slot, "skips the checkpoint");
      if (slot >= 0)
        claim(slot, n, format("checkpoint %lld of sequence %lld", ll(i - begin), ll(n)), false);
    }
  }
}

}  // namespace

ChunkPrefillProblem validate_chunk_prefill(const ChunkPrefillArgs& args, int64_t workspace_needed) {
  const bool kda = args.is_kda;
  const char* op = kda ? "chunk_kda" : "chunk_gated_delta_rule";
  Contract c;
  c.shape("q", args.q, {"B", "T", "H", "K"});
  c.shape("k", args.k, {"B", "T", "H", "K"});
  c.shape("v", args.v, {"B", "T", "HV", "V"});
  if (kda) c.shape("g", args.g, {"B", "T", "HV", "K"});
  else c.shape("g", args.g, {"B", "T", "HV"});
  c.shape("beta", args.beta, {"B", "T", "HV"});
  c.shape("out", args.out, {"B", "T", "HV", "V"});
  const int64_t B = c.get("B"), T = c.get("T"), H = c.get("H"), HV = c.get("HV"), K = c.get("K"),
                V = c.get("V");
  if (H <= 0 || HV % H != 0) {
    fail(
        format("%s: `v` has HV=%lld heads and `q`/`k` have H=%lld; HV must be a positive "
               "multiple of H",
               op, ll(HV), ll(H)));
  }
  c.last_dim_contiguous("q", args.q);
  c.last_dim_contiguous("k", args.k);
  c.last_dim_contiguous("v", args.v);
  c.last_dim_contiguous("out", args.out);
  if (kda) c.last_dim_contiguous("g", args.g);
  for (auto [name, t] : {std::pair{"q", &args.q},
                         {"k", &args.k},
                         {"v", &args.v},
                         {"g", &args.g},
                         {"beta", &args.beta},
                         {"out", &args.out}}) {
    c.floating(name, *t);
    c.device(name, *t);
  }

  int64_t N = B;
  if (args.cu_seqlens) {
    const TensorView& cu = *args.cu_seqlens;
    if (B != 1) {  // FLA's text
      fail(
          format("The batch size is expected to be 1 rather than %lld when using `cu_seqlens`."
                 "Please flatten variable-length inputs before processing.",
                 ll(B)));
    }
    if (cu.ndim != 1 || cu.shape[0] < 1)
      fail(format("`cu_seqlens` must be a 1D tensor [N+1]; got shape %s", shape_str(cu).c_str()));
    c.index_dtype("cu_seqlens", cu);
    c.contiguous("cu_seqlens", cu);
    c.device("cu_seqlens", cu);
    N = cu.shape[0] - 1;
  }
  c.bind("N", N, args.cu_seqlens ? "`cu_seqlens`" : "`q`");

  // ---- states ---------------------------------------------------------------------------------
  const bool pooled = args.initial_state_indices.has_value();
  StatePoolRef pool;
  if (args.initial_state) {
    const TensorView& s = *args.initial_state;
    c.shape("initial_state", s, {"slots", "HV", "V", "K"});
    if (!inner_strides_compact(s)) {
      fail(
          "`initial_state` must be contiguous in its [HV, V, K] inner dimensions; an arbitrary "
          "slot stride is supported." +
          inner_strides_detail("initial_state", s));
    }
    if (!pooled && s.shape[0] != N) {  // FLA's text
      fail(
          format("The number of initial states is expected to be equal to the number of input "
                 "sequences, i.e., %lld rather than %lld.",
                 ll(N), ll(s.shape[0])));
    }
    if (!is_quantized(s.dtype)) c.floating("initial_state", s);
    c.device("initial_state", s);
    pool = {s.data, s.dtype, s.stride[0], s.shape[0]};
    check_state_format(c, op, "initial_state", s, args.state_format, true, pool);
    if (pool.formatted() && !pooled)
      throw Error(
          ErrorKind::not_implemented,
          format("%s: %s states%s run as a pool (initial_state_indices) for now (issue "
                 "#36)",
                 op, dtype_name(s.dtype), pool.stochastic ? " with stochastic rounding" : ""));
  } else if (args.state_format.scales || args.state_format.step) {
    fail(format("%s: `state_scales` / `rounding_step` are given without a state", op));
  }
  if (pooled) {
    if (!args.initial_state)
      fail("`initial_state_indices` index a state pool, but no `initial_state` pool was given");
    index_vector(c, "initial_state_indices", *args.initial_state_indices, "N");
  }
  if (args.has_initial_state) {
    if (!args.initial_state)
      fail("`has_initial_state` says which sequences read `initial_state`, but none was given");
    index_vector(c, "has_initial_state", *args.has_initial_state, "N");
  }
  if (args.output_state_indices) {
    if (!pooled) {
      fail(
          "`output_state_indices` name slots of the `initial_state` pool, but no "
          "`initial_state_indices` were given");
    }
    index_vector(c, "output_state_indices", *args.output_state_indices, "N");
  }
  if (args.final_state) {
    c.shape("final_state", *args.final_state, {"N", "HV", "V", "K"});
    c.contiguous("final_state", *args.final_state);
    c.floating("final_state", *args.final_state);
    c.device("final_state", *args.final_state);
  }

  // ---- gates and scale (the recurrent op's rules and texts) -----------------------------------
  if (args.gate_in_kernel) {
    if (!args.A_log) fail(format("%s: the in-kernel gate (use_gate_in_kernel) needs `A_log`", op));
    const TensorView& A_log = *args.A_log;
    if (A_log.numel() != HV)
      fail(format("`A_log` must have %lld elements (got %lld).", ll(HV), ll(A_log.numel())));
    c.contiguous("A_log", A_log);
    c.floating("A_log", A_log);
    c.device("A_log", A_log);
    if (args.dt_bias) {
      const TensorView& dt = *args.dt_bias;
      const int64_t want = kda ? HV * K : HV;
      if (dt.numel() != want)
        fail(format("`dt_bias` must have %lld elements (got %lld).", ll(want), ll(dt.numel())));
      c.contiguous("dt_bias", dt);
      c.floating("dt_bias", dt);
      c.device("dt_bias", dt);
    }
    if (args.lower_bound && !std::isfinite(*args.lower_bound))
      fail(format("lower_bound must be finite (got %g)", *args.lower_bound));
  } else if (args.A_log || args.dt_bias || args.lower_bound) {
    fail(
        format("%s: `A_log`, `dt_bias` and lower_bound apply only with the in-kernel gate "
               "(use_gate_in_kernel=True); `g` is otherwise the log-space decay itself",
               op));
  }
  const double scale = args.scale.value_or(1.0 / std::sqrt(static_cast<double>(K)));
  if (!(scale > 0.0) || !std::isfinite(scale))
    fail(format("scale must be positive (got %g)", scale));

  // ---- checkpoints (FlashInfer's texts where it has one) ---------------------------------------
  const int64_t every = args.checkpoint_every_n_tokens;
  constexpr int64_t chunk = ChunkPrefillProblem::kChunk;
  if (every < 0)
    fail(format("checkpoint_every_n_tokens must be non-negative, got %lld", ll(every)));
  if (every % chunk != 0) {
    fail(format("checkpoint_every_n_tokens must be a multiple of the chunk size (%lld), got %lld",
                ll(chunk), ll(every)));
  }
  if (every > INT32_MAX)
    fail(format("checkpoint_every_n_tokens must be below 2^31, got %lld", ll(every)));
  const bool dense_ckpt = args.state_checkpoints.has_value();
  const bool slot_ckpt = args.checkpoint_slot_indices.has_value();
  if (every == 0 && (args.checkpoint_cu_starts || dense_ckpt || slot_ckpt)) {
    fail(
        "`checkpoint_cu_starts`, `state_checkpoints` and `checkpoint_slot_indices` must be None "
        "when checkpoint_every_n_tokens == 0");
  }
  if (every > 0) {
    if (!args.checkpoint_cu_starts)
      fail("checkpoint_every_n_tokens > 0 needs `checkpoint_cu_starts`");
    if (dense_ckpt == slot_ckpt) {
      fail(
          "checkpoint_every_n_tokens > 0 needs one destination: `state_checkpoints` (dense) or "
          "`checkpoint_slot_indices` (pool slots), not both");
    }
    const TensorView& cs = *args.checkpoint_cu_starts;
    if (cs.ndim != 1 || cs.shape[0] != N + 1) {
      fail(format("`checkpoint_cu_starts` must have shape [N+1]=(%lld,); got %s (N=%lld from %s)",
                  ll(N + 1), shape_str(cs).c_str(), ll(N),
                  args.cu_seqlens ? "`cu_seqlens`" : "`q`"));
    }
    c.index_dtype("checkpoint_cu_starts", cs);
    c.contiguous("checkpoint_cu_starts", cs);
    c.device("checkpoint_cu_starts", cs);
    if (dense_ckpt) {
      const TensorView& d = *args.state_checkpoints;
      c.shape("state_checkpoints", d, {"checkpoints", "HV", "V", "K"});
      c.contiguous("state_checkpoints", d);
      c.floating("state_checkpoints", d);
      c.device("state_checkpoints", d);
    } else {
      if (!pooled) {
        fail(
            "`checkpoint_slot_indices` name slots of the `initial_state` pool, but no "
            "`initial_state_indices` were given");
      }
      index_vector(c, "checkpoint_slot_indices", *args.checkpoint_slot_indices, "checkpoints");
    }
  }

  // ---- workspace ----------------------------------------------------------------------------
  int64_t workspace_bytes = 0;
  if (args.workspace) {
    const TensorView& w = *args.workspace;
    c.contiguous("workspace", w);
    c.device("workspace", w);
    workspace_bytes = w.numel() * w.element_size();
  }
  if (workspace_bytes < workspace_needed) {
    if (!args.workspace) {
      fail(format(
          "%s needs a workspace of %lld bytes (chunk_prefill_workspace_bytes); none was given", op,
          ll(workspace_needed)));
    }
    fail(format("`workspace` has %lld bytes; %s needs %lld (chunk_prefill_workspace_bytes)",
                ll(workspace_bytes), op, ll(workspace_needed)));
  }
  if (args.workspace && reinterpret_cast<uintptr_t>(args.workspace->data) % 16 != 0) {
    fail(format(
        "`workspace` must be 16-byte aligned; its address is %lld bytes past a multiple of 16",
        ll(static_cast<int64_t>(reinterpret_cast<uintptr_t>(args.workspace->data) % 16))));
  }

  c.check_devices("All inputs must be on the same device", true);

  // ---- host data (CPU tensors): before anything is written -----------------------------------
  const bool on_cpu = c.common_device().type == DeviceType::cpu;
  check_state_format_backend(op, pool, c.common_device(), /*cuda_built=*/true);
  const bool check = args.check_indices.value_or(on_cpu);
  if (!on_cpu) require_cuda_k(K);  // the recurrent op's CUDA limit, same text
  if (on_cpu) {
    if (args.cu_seqlens) check_cu_seqlens_host(*args.cu_seqlens, T);
    if (every > 0) {
      const int64_t total = check_checkpoint_counts_host(args, N, T, every);
      if (dense_ckpt && args.state_checkpoints->shape[0] < total) {
        fail(format(
            "`state_checkpoints` has %lld rows; checkpoint_cu_starts counts %lld checkpoints",
            ll(args.state_checkpoints->shape[0]), ll(total)));
      }
      if (slot_ckpt && args.checkpoint_slot_indices->shape[0] < total) {
        fail(
            format("`checkpoint_slot_indices` has %lld entries; checkpoint_cu_starts counts %lld "
                   "checkpoints",
                   ll(args.checkpoint_slot_indices->shape[0]), ll(total)));
      }
    }
    if (check && pooled) {
      const int64_t slots = args.initial_state->shape[0];
      const TensorView& in = *args.initial_state_indices;
      check_slot_indices_host("initial_state_indices", in.data, in.dtype, N, 1, slots);
      check_pool_writes_host(args, N, slots);
    }
  }

  ChunkPrefillProblem p;
  fill_token_part(p, args, N, H, HV, K, V, T, kda, scale);
  p.state = pool;
  if (pooled) {
    p.initial_indices = args.initial_state_indices->data;
    p.initial_index_dtype = args.initial_state_indices->dtype;
  }
  if (args.has_initial_state) {
    p.has_initial = args.has_initial_state->data;
    p.has_initial_dtype = args.has_initial_state->dtype;
  }
  if (args.output_state_indices) {
    p.output_indices = args.output_state_indices->data;
    p.output_index_dtype = args.output_state_indices->dtype;
  }
  if (args.final_state) {
    p.final_state = args.final_state->data;
    p.final_dtype = args.final_state->dtype;
  }
  p.checkpoint_every = static_cast<int32_t>(every);
  if (every > 0) {
    p.checkpoint_cu_starts = args.checkpoint_cu_starts->data;
    p.checkpoint_cu_dtype = args.checkpoint_cu_starts->dtype;
    if (dense_ckpt) {
      p.checkpoints = args.state_checkpoints->data;
      p.checkpoint_dtype = args.state_checkpoints->dtype;
    } else {
      p.checkpoint_slots = args.checkpoint_slot_indices->data;
      p.checkpoint_slot_dtype = args.checkpoint_slot_indices->dtype;
    }
  }
  if (args.workspace) {
    p.workspace = args.workspace->data;
    p.workspace_bytes = workspace_bytes;
  }
  p.check_indices = check;
  p.pdl = args.pdl;
  p.device = c.common_device();
  return p;
}

}  // namespace deltastate::detail
