// Pieces of a problem struct made from validated arguments, shared by the validators so that
// each is written once.
#pragma once

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

}  // namespace deltastate::detail
