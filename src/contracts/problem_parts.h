// Pieces of a problem struct made from validated arguments, shared by the validators so that
// each is written once.
#pragma once

#include <cstdint>
#include <optional>

#include "core/problem.h"
#include "deltastate/tensor.h"

namespace deltastate::detail {

// A per-head input laid out [seq, tok, head, e] (strides of dims 0-2; e contiguous).
inline HeadInput head_input(const TensorView& t) {
  return {t.data, t.dtype, t.stride[0], t.stride[1], t.stride[2]};
}

// The gate of one call: the op chooses the mode; A_log / dt_bias may be absent (log-space g).
inline GateParams gate_params(bool kda, GateMode mode, const TensorView* A_log,
                              const TensorView* dt_bias, std::optional<double> lower_bound) {
  GateParams g;
  g.kda = kda;
  g.mode = mode;
  if (A_log) {
    g.A_log = A_log->data;
    g.A_log_dtype = A_log->dtype;
  }
  if (dt_bias) {
    g.dt_bias = dt_bias->data;
    g.dt_bias_dtype = dt_bias->dtype;
  }
  g.lower_bound = lower_bound ? static_cast<float>(*lower_bound) : 0.0f;
  return g;
}

// The token part of the recurrent op's and the chunked prefill's problems (RecurrentProblem,
// ChunkPrefillProblem), from their validated arguments (RecurrentArgs, ChunkPrefillArgs): sizes,
// cu_seqlens, the per-token inputs and the output, the gate, beta, the q/k norm and the scale.
template <class Problem, class Args>
void fill_token_part(Problem& p, const Args& args, int64_t N, int64_t H, int64_t HV, int64_t K,
                     int64_t V, int64_t T, bool per_k_gate, double scale) {
  p.N = static_cast<int32_t>(N);
  p.H = static_cast<int32_t>(H);
  p.HV = static_cast<int32_t>(HV);
  p.K = static_cast<int32_t>(K);
  p.V = static_cast<int32_t>(V);
  p.T = static_cast<int32_t>(T);
  if (args.cu_seqlens) {
    p.cu_seqlens = args.cu_seqlens->data;
    p.cu_dtype = args.cu_seqlens->dtype;
  }
  p.q = head_input(args.q);
  p.k = head_input(args.k);
  p.v = head_input(args.v);
  p.g = head_input(args.g);
  p.beta = head_input(args.beta);
  p.out = {args.out.data, args.out.dtype, args.out.stride[0], args.out.stride[1],
           args.out.stride[2]};
  p.gate = gate_params(per_k_gate,
                       !args.gate_in_kernel ? GateMode::log_decay
                       : args.lower_bound   ? GateMode::safe
                                            : GateMode::softplus,
                       args.A_log ? &*args.A_log : nullptr, args.dt_bias ? &*args.dt_bias : nullptr,
                       args.lower_bound);
  p.beta_is_logit = args.beta_is_logit;
  p.l2norm = args.use_qk_l2norm;
  p.scale = static_cast<float>(scale);
}

}  // namespace deltastate::detail
