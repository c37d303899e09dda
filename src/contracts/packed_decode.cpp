// Contract of GDN / KDA packed decode. SGLang's messages (`_validate_packed_decode_inputs`) are
// reproduced verbatim and in SGLang's order; checks beyond SGLang's (dtypes, the pool's inner
// strides, slot bounds, scale) follow.
#include <cmath>

#include "contracts/contract.h"
#include "contracts/problem_parts.h"
#include "contracts/validate.h"

namespace deltastate::detail {

double checked_scale(const std::optional<double>& scale, int64_t K) {
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(K)));
  if (!(s > 0.0) || !std::isfinite(s)) fail(format("scale must be positive (got %g)", s));
  return s;
}

PackedSizes check_packed_inputs(Contract& c, const TensorView& x, const TensorView& a,
                                const TensorView& b, const TensorView& A_log,
                                const TensorView& dt_bias, const TensorView& state,
                                const TensorView& out, const TensorView& idx, bool kda) {
  if (x.ndim != 2) fail(format("`mixed_qkv` must be a 2D tensor (got ndim=%d).", x.ndim));
  // SGLang's texts, then the strides found and needed (beyond SGLang).
  if (x.stride[1] != 1)
    fail("`mixed_qkv` must be contiguous in the last dim." + last_stride_detail("mixed_qkv", x));
  if (a.ndim != 2 || b.ndim != 2)
    fail(format("`a` and `b` must be 2D tensors (got a.ndim=%d, b.ndim=%d).", a.ndim, b.ndim));
  if (a.stride[1] != 1 || b.stride[1] != 1) {
    fail("`a`/`b` must be contiguous in the last dim." +
         (a.stride[1] != 1 ? last_stride_detail("a", a) : last_stride_detail("b", b)));
  }
  if (A_log.ndim != 1 || dt_bias.ndim != 1) fail("`A_log`/`dt_bias` must be 1D tensors.");
  if (A_log.stride[0] != 1 || dt_bias.stride[0] != 1) {
    fail("`A_log`/`dt_bias` must be contiguous." + (A_log.stride[0] != 1
                                                        ? strides_detail("A_log", A_log)
                                                        : strides_detail("dt_bias", dt_bias)));
  }
  if (idx.ndim != 1)
    fail(format("`ssm_state_indices` must be 1D for packed decode (got ndim=%d).", idx.ndim));
  if (!out.is_contiguous()) fail("`out` must be contiguous." + strides_detail("out", out));

  c.device("mixed_qkv", x);
  c.device("a", a);
  c.device("b", b);
  c.device("A_log", A_log);
  c.device("dt_bias", dt_bias);
  c.device("initial_state", state);
  c.device("out", out);
  c.device("ssm_state_indices", idx);
  c.check_devices("All inputs must be on the same device.", false);

  const int64_t B = x.shape[0];
  if (a.shape[0] != B || b.shape[0] != B) {
    fail(
        format("Mismatched batch sizes: mixed_qkv.shape[0]=%lld, a.shape[0]=%lld, b.shape[0]=%lld.",
               static_cast<long long>(B), static_cast<long long>(a.shape[0]),
               static_cast<long long>(b.shape[0])));
  }
  if (idx.shape[0] != B) {
    fail(format("`ssm_state_indices` must have shape [B] (got %s; expected %s).",
                shape_str(idx).c_str(), tuple_str({B}).c_str()));
  }
  if (state.ndim != 4)
    fail(format("`initial_state` must be a 4D tensor (got ndim=%d).", state.ndim));
  if (state.stride[3] != 1) {
    fail("`initial_state` must be contiguous in the last dim." +
         last_stride_detail("initial_state", state));
  }
  // Beyond SGLang: the inner [HV, V, K] strides are used, so check them.
  if (!inner_strides_compact(state)) {
    fail(
        "`initial_state` must be contiguous in its [HV, V, K] inner dimensions; an arbitrary slot "
        "stride is supported." +
        inner_strides_detail("initial_state", state));
  }
  const int64_t HV = state.shape[1], V = state.shape[2], K = state.shape[3];

  if (!kda) {
    if (a.shape[1] != HV || b.shape[1] != HV) {
      fail(format("`a`/`b` must have shape [B, HV] with HV=%lld (got a.shape=%s, b.shape=%s).",
                  static_cast<long long>(HV), shape_str(a).c_str(), shape_str(b).c_str()));
    }
    if (A_log.numel() != HV || dt_bias.numel() != HV) {
      fail(
          format("`A_log` and `dt_bias` must have %lld elements (got A_log.numel()=%lld, "
                 "dt_bias.numel()=%lld).",
                 static_cast<long long>(HV), static_cast<long long>(A_log.numel()),
                 static_cast<long long>(dt_bias.numel())));
    }
  } else {
    if (a.shape[1] != HV * K) {
      fail(format("`a` must have shape [B, HV*K] with HV=%lld, K=%lld (got a.shape=%s).",
                  static_cast<long long>(HV), static_cast<long long>(K), shape_str(a).c_str()));
    }
    if (b.shape[1] != HV) {
      fail(format("`b` must have shape [B, HV] with HV=%lld (got b.shape=%s).",
                  static_cast<long long>(HV), shape_str(b).c_str()));
    }
    if (A_log.numel() != HV) {
      fail(format("`A_log` must have %lld elements (got %lld).", static_cast<long long>(HV),
                  static_cast<long long>(A_log.numel())));
    }
    if (dt_bias.numel() != HV * K) {
      fail(format("`dt_bias` must have %lld elements (got %lld).", static_cast<long long>(HV * K),
                  static_cast<long long>(dt_bias.numel())));
    }
  }
  if (out.ndim != 4 || out.shape[0] != B || out.shape[1] != 1 || out.shape[2] != HV ||
      out.shape[3] != V) {
    std::string message = format("`out` must have shape %s (got out.shape=%s).",
                                 tuple_str({B, 1, HV, V}).c_str(), shape_str(out).c_str());
    // Beyond SGLang: the usual cause when out's last dim is the state's last, K != V: a K-first
    // state (FLA's default layout) read as the pool's V-first one. With K = V the two layouts
    // have one shape and cannot be told apart (README, the FLA functions' docstrings).
    if (out.ndim == 4 && out.shape[0] == B && out.shape[1] == 1 && out.shape[2] == HV &&
        out.shape[3] == K && K != V) {
      message += format(
          " `initial_state` %s looks K-first [slots, HV, K, V]: packed decode takes the pool's "
          "V-first layout [slots, HV, V, K] (FLA: state_v_first=True; deltastate never "
          "transposes a state behind the caller's back).",
          shape_str(state).c_str());
    }
    fail(message);
  }
  const int64_t width = x.shape[1];
  const int64_t qk = width - HV * V;
  if (qk <= 0 || qk % 2 != 0) {
    fail(format("Invalid packed `mixed_qkv` last dim=%lld for HV=%lld, V=%lld.",
                static_cast<long long>(width), static_cast<long long>(HV),
                static_cast<long long>(V)));
  }
  const int64_t q_dim = qk / 2;
  if (q_dim % K != 0) {
    fail(format("Invalid packed Q size %lld: must be divisible by K=%lld.%s",
                static_cast<long long>(q_dim), static_cast<long long>(K),
                kda ? " KDA packed decode requires num_q_heads == num_k_heads and head_q_dim == "
                      "head_k_dim."
                    : ""));
  }
  const int64_t H = q_dim / K;
  if (H <= 0 || HV % H != 0) {
    fail(format("Invalid head config inferred from mixed_qkv: H=%lld, HV=%lld.",
                static_cast<long long>(H), static_cast<long long>(HV)));
  }
  return {B, H, HV, K, V};
}

RecurrentProblem validate_packed_decode(const PackedDecodeArgs& args, bool kda) {
  const TensorView& x = args.mixed_qkv;
  const TensorView& a = args.a;
  const TensorView& b = args.b;
  const TensorView& A_log = args.A_log;
  const TensorView& dt_bias = args.dt_bias;
  const TensorView& state = args.state;
  const TensorView& out = args.out;
  const TensorView& idx = args.state_indices;

  Contract c;
  const auto [B, H, HV, K, V] =
      check_packed_inputs(c, x, a, b, A_log, dt_bias, state, out, idx, kda);

  // Beyond SGLang: dtypes, scale, slot bounds.
  c.floating("mixed_qkv", x);
  c.floating("a", a);
  c.floating("b", b);
  c.floating("A_log", A_log);
  c.floating("dt_bias", dt_bias);
  if (!is_quantized(state.dtype)) c.floating("initial_state", state);
  c.floating("out", out);
  c.index_dtype("ssm_state_indices", idx);
  const char* op =
      kda ? "fused_recurrent_kda_packed_decode" : "fused_recurrent_gated_delta_rule_packed_decode";
  StatePoolRef pool{state.data, state.dtype, state.stride[0], state.shape[0]};
  check_state_format(c, op, "initial_state", state, args.state_format, true, pool);
  c.check_devices("All inputs must be on the same device", true);  // the format's tensors
  const double scale = checked_scale(args.scale, K);
  if (kda && args.lower_bound && !std::isfinite(*args.lower_bound))
    fail(format("lower_bound must be finite (got %g)", *args.lower_bound));

  const bool on_cpu = c.common_device().type == DeviceType::cpu;
  const bool check = args.check_indices.value_or(on_cpu);
  if (on_cpu && check)
    check_slot_indices_host("ssm_state_indices", idx.data, idx.dtype, B, idx.stride[0],
                            state.shape[0]);
  check_state_format_backend(op, pool, c.common_device(), /*cuda_built=*/true);
  if (!on_cpu) require_cuda_k(K);

  RecurrentProblem p;
  p.N = static_cast<int32_t>(B);
  p.H = static_cast<int32_t>(H);
  p.HV = static_cast<int32_t>(HV);
  p.K = static_cast<int32_t>(K);
  p.V = static_cast<int32_t>(V);
  p.T = 1;
  const PackedQkv in = packed_qkv(x.data, x.dtype, x.stride[0], H, K, V);
  p.q = in.q;
  p.k = in.k;
  p.v = in.v;
  p.g = {a.data, a.dtype, a.stride[0], 0, kda ? K : 1};
  p.beta = {b.data, b.dtype, b.stride[0], 0, 1};
  p.out = {out.data, out.dtype, HV * V, 0, V};
  p.gate = gate_params(kda, (kda && args.lower_bound) ? GateMode::safe : GateMode::softplus, &A_log,
                       &dt_bias, args.lower_bound);
  p.beta_is_logit = true;
  p.round_beta = args.round_beta_to_input;
  p.l2norm = args.use_qk_l2norm;
  p.scale = static_cast<float>(scale);
  p.state = pool;
  p.indices = idx.data;
  p.index_dtype = idx.dtype;
  p.index_stride = B > 1 ? idx.stride[0] : 1;
  p.update_state = true;
  p.check_indices = check;
  p.pdl = args.pdl;
  p.device = c.common_device();
  return p;
}

}  // namespace deltastate::detail
