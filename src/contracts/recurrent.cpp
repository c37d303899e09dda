// Contract of the pooled varlen recurrent op (FlashInfer's `recurrent_kda` with its stride
// contract; FLA's fused-recurrent functions). Messages a peer defines are verbatim; the rest come
// from the Contract matchers, which name the tensor and show expected vs actual.
#include <cmath>
#include <cstdint>

#include "contracts/contract.h"
#include "contracts/problem_parts.h"
#include "contracts/validate.h"
#include "core/numeric.h"

namespace deltastate::detail {

namespace {

// `flashinfer`: recurrent_kda's stride contract and the texts of SGLang's wrapper around it.
void check_state_pool(Contract& c, const TensorView& state, bool flashinfer, bool k_first) {
  if (state.ndim != 4) {
    if (flashinfer)
      fail(format("recurrent_kda needs a [N, HV, V, K] state pool; got shape %s",
                  shape_str(state).c_str()));
    fail(format("`initial_state` must be a 4D tensor (got ndim=%d).", state.ndim));
  }
  if (k_first) c.shape("initial_state", state, {"slots", "HV", "K", "V"});
  else c.shape("initial_state", state, {"slots", "HV", "V", "K"});
  if (!inner_strides_compact(state)) {
    const int64_t V = state.shape[2], K = state.shape[3];
    if (k_first)
      fail(
          "`initial_state` must be contiguous in its [HV, K, V] inner dimensions; an arbitrary "
          "slot stride is supported." +
          inner_strides_detail("initial_state", state));
    if (flashinfer) {
      fail(
          format("recurrent_kda state inner strides must be compact (V*K, K, 1)=(%lld, %lld, 1); "
                 "got %s (only the slot stride may be non-compact)",
                 static_cast<long long>(V * K), static_cast<long long>(K),
                 tuple_str(state.stride + 1, 3).c_str()));
    }
    fail(
        "`initial_state` must be contiguous in its [HV, V, K] inner dimensions; an arbitrary slot "
        "stride is supported." +
        inner_strides_detail("initial_state", state));
  }
  if (flashinfer) {
    const int64_t slot_stride = state.stride[0];
    const auto base = static_cast<long long>(reinterpret_cast<uintptr_t>(state.data) % 32);
    if (slot_stride % 16 != 0 || base != 0) {
      fail(
          format("recurrent_kda state pool breaks the compiled stride contract: slot stride %lld "
                 "elements must be a multiple of 16 and the base byte offset %lld a multiple of 32 "
                 "(sym_int64(divisibility=16) / assumed_align=32)",
                 static_cast<long long>(slot_stride), base));
    }
  }
}

}  // namespace

RecurrentProblem validate_recurrent(const RecurrentArgs& args, bool kda) {
  const char* op = kda ? "recurrent_kda" : "recurrent_gated_delta_rule";
  Contract c;
  c.shape("q", args.q, {"B", "T", "H", "K"});
  c.shape("k", args.k, {"B", "T", "H", "K"});
  c.shape("v", args.v, {"B", "T", "HV", "V"});
  // A per-K decay through the GDN entry (FLA's `gk`) is KDA's gate.
  const bool per_k_gate = kda || (args.g.ndim == 4 && !args.gate_in_kernel);
  if (per_k_gate) c.shape("g", args.g, {"B", "T", "HV", "K"});
  else c.shape("g", args.g, {"B", "T", "HV"});
  c.shape("beta", args.beta, {"B", "T", "HV"});
  c.shape("out", args.out, {"B", "T", "HV", "V"});
  const int64_t B = c.get("B"), T = c.get("T"), H = c.get("H"), HV = c.get("HV"), K = c.get("K"),
                V = c.get("V");
  if (H <= 0 || HV % H != 0) {
    fail(
        format("%s: `v` has HV=%lld heads and `q`/`k` have H=%lld; HV must be a positive "
               "multiple of H",
               op, static_cast<long long>(HV), static_cast<long long>(H)));
  }
  c.last_dim_contiguous("q", args.q);
  c.last_dim_contiguous("k", args.k);
  c.last_dim_contiguous("v", args.v);
  c.last_dim_contiguous("out", args.out);
  if (per_k_gate) c.last_dim_contiguous("g", args.g);
  c.floating("q", args.q);
  c.floating("k", args.k);
  c.floating("v", args.v);
  c.floating("g", args.g);
  c.floating("beta", args.beta);
  c.floating("out", args.out);
  for (auto [name, t] : {std::pair{"q", &args.q},
                         {"k", &args.k},
                         {"v", &args.v},
                         {"g", &args.g},
                         {"beta", &args.beta},
                         {"out", &args.out}})
    c.device(name, *t);

  int64_t N = B;
  if (args.cu_seqlens) {
    const TensorView& cu = *args.cu_seqlens;
    if (B != 1) {
      fail(
          format("The batch size is expected to be 1 rather than %lld when using `cu_seqlens`."
                 "Please flatten variable-length inputs before processing.",
                 static_cast<long long>(B)));
    }
    if (cu.ndim != 1 || cu.shape[0] < 1)
      fail(format("`cu_seqlens` must be a 1D tensor [N+1]; got shape %s", shape_str(cu).c_str()));
    c.index_dtype("cu_seqlens", cu);
    c.contiguous("cu_seqlens", cu);
    c.device("cu_seqlens", cu);
    N = cu.shape[0] - 1;
  }
  c.bind("N", N, args.cu_seqlens ? "`cu_seqlens`" : "`q`");

  const bool k_first = args.state_layout == StateLayout::k_first;
  StatePoolRef pool;
  if (args.state) {
    const TensorView& st = *args.state;
    check_state_pool(c, st, kda && args.stride_contract && !k_first, k_first);
    if (!is_quantized(st.dtype)) c.floating("initial_state", st);
    c.device("initial_state", st);
    pool = {st.data, st.dtype, st.stride[0], st.shape[0]};
    check_state_format(c, op, "initial_state", st, args.state_format, true, pool);
    if (pool.formatted() &&
        (k_first || !args.state_indices || !args.update_state || args.final_state))
      throw Error(
          ErrorKind::not_implemented,
          format("%s: %s states%s run as a V-first pool updated in place "
                 "(ssm_state_indices, no final_state) for now (issue #36)",
                 op, dtype_name(st.dtype), pool.stochastic ? " with stochastic rounding" : ""));
  } else if (args.state_format.scales || args.state_format.step) {
    fail(format("%s: `state_scales` / `rounding_step` are given without a state", op));
  }
  if (args.state_indices) {
    const TensorView& idx = *args.state_indices;
    if (!args.state)
      fail("`ssm_state_indices` index a state pool, but no `initial_state` pool was given");
    if (idx.ndim != 1 || idx.shape[0] != N) {
      fail(
          format("The number of initial states is expected to be equal to the number of input "
                 "sequences, i.e., %lld rather than %lld.",
                 static_cast<long long>(N),
                 static_cast<long long>(idx.ndim == 1 ? idx.shape[0] : idx.numel())));
    }
    c.index_dtype("ssm_state_indices", idx);
    c.device("ssm_state_indices", idx);
  } else if (args.state && args.state->shape[0] != N) {
    fail(
        format("The number of initial states is expected to be equal to the number of input "
               "sequences, i.e., %lld rather than %lld.",
               static_cast<long long>(N), static_cast<long long>(args.state->shape[0])));
  }
  if (args.final_state) {
    if (k_first) c.shape("final_state", *args.final_state, {"N", "HV", "K", "V"});
    else c.shape("final_state", *args.final_state, {"N", "HV", "V", "K"});
    c.contiguous("final_state", *args.final_state);
    c.floating("final_state", *args.final_state);
    c.device("final_state", *args.final_state);
  }
  if (args.update_state && !args.state)
    fail(format("%s: update_state needs a state pool (`initial_state`)", op));

  if (args.gate_in_kernel) {
    // The safe gate without A_log uses the factor exp(0) = 1 (FLA's KDA gate with A_log=None).
    if (!args.A_log && !args.lower_bound)
      fail(format("%s: the in-kernel gate (use_gate_in_kernel) needs `A_log`", op));
    if (args.A_log) {
      const TensorView& A_log = *args.A_log;
      if (A_log.numel() != HV)
        fail(format("`A_log` must have %lld elements (got %lld).", static_cast<long long>(HV),
                    static_cast<long long>(A_log.numel())));
      c.contiguous("A_log", A_log);
      c.floating("A_log", A_log);
      c.device("A_log", A_log);
    }
    if (args.dt_bias) {
      const TensorView& dt = *args.dt_bias;
      const int64_t want = kda ? HV * K : HV;
      if (dt.numel() != want)
        fail(format("`dt_bias` must have %lld elements (got %lld).", static_cast<long long>(want),
                    static_cast<long long>(dt.numel())));
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
  const double scale = checked_scale(args.scale, K);

  c.check_devices("All inputs must be on the same device", true);
  const bool on_cpu = c.common_device().type == DeviceType::cpu;
  if (k_first && !on_cpu && (args.state || args.final_state)) {
    throw Error(ErrorKind::not_implemented,
                format("%s: a K-first state [N, HV, K, V] (state_v_first=False) runs on the CPU "
                       "backend only; on CUDA pass the state V-first [N, HV, V, K] with "
                       "state_v_first=True (deltastate never transposes a state behind the "
                       "caller's back)",
                       op));
  }
  if (on_cpu && args.cu_seqlens) check_cu_seqlens_host(*args.cu_seqlens, T);
  const bool check = args.check_indices.value_or(on_cpu);
  const int64_t index_stride = args.state_indices && N > 1 ? args.state_indices->stride[0] : 1;
  if (on_cpu && check && args.state_indices)
    check_slot_indices_host("ssm_state_indices", args.state_indices->data,
                            args.state_indices->dtype, N, index_stride, args.state->shape[0]);
  check_state_format_backend(op, pool, c.common_device(), /*cuda_built=*/true);
  if (!on_cpu) require_cuda_k(K);

  RecurrentProblem p;
  fill_token_part(p, args, N, H, HV, K, V, T, per_k_gate, scale);
  p.round_beta = args.round_beta_to_input;
  p.state = pool;
  p.state.k_first = k_first;
  if (args.state_indices) {
    p.indices = args.state_indices->data;
    p.index_dtype = args.state_indices->dtype;
    p.index_stride = index_stride;
  }
  p.update_state = args.update_state;
  if (args.final_state) {
    p.final_state = args.final_state->data;
    p.final_dtype = args.final_state->dtype;
  }
  p.check_indices = check;
  p.pdl = args.pdl;
  p.device = c.common_device();
  return p;
}

}  // namespace deltastate::detail
