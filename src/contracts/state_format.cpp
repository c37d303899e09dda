// Contract of a state's storage format (ops.h StateFormatArgs): the scales of a quantized state,
// the rounding and its step counter. One place for every op that reads or writes a state pool.
#include "contracts/validate.h"

namespace deltastate::detail {

namespace {
long long ll(int64_t v) { return static_cast<long long>(v); }
}  // namespace

void check_state_format(Contract& c, const char* op, const char* state_name,
                        const TensorView& state, const StateFormatArgs& f, bool op_takes_quantized,
                        StatePoolRef& ref, int64_t step_count) {
  const bool quantized = is_quantized(state.dtype);
  const char* dt = dtype_name(state.dtype);
  if (quantized && !op_takes_quantized)
    throw Error(ErrorKind::not_implemented,
                format("%s: %s states (`%s`) are not built for this op yet (issue #36); "
                       "float32, bfloat16 and float16 states are",
                       op, dt, state_name));
  if (quantized) {
    if (!f.scales)
      fail(
          format("%s: `state_scales` is required for the %s state `%s`: its fp32 scales "
                 "[slots, HV, V] (StatePool.layer_scales)",
                 op, dt, state_name));
    const TensorView& s = *f.scales;
    // the state's leading dims ([slots], or [layers, slots]), then [HV, V]
    const int lead = state.ndim - 3;
    const int64_t HV = state.shape[lead], V = state.shape[lead + 1];
    bool same = s.ndim == lead + 2 && s.shape[lead] == HV && s.shape[lead + 1] == V;
    for (int d = 0; same && d < lead; ++d) same = s.shape[d] == state.shape[d];
    if (!same) {
      int64_t want[kMaxDims] = {};
      for (int d = 0; d < lead; ++d) want[d] = state.shape[d];
      want[lead] = HV;
      want[lead + 1] = V;
      fail(format("`state_scales` must have shape [%sHV, V]=%s (one per row of `%s`); got %s",
                  lead == 2 ? "layers, slots, " : "slots, ", tuple_str(want, lead + 2).c_str(),
                  state_name, shape_str(s).c_str()));
    }
    c.dtype("state_scales", s, {DType::f32});
    if (s.stride[lead + 1] != 1 || (HV > 1 && s.stride[lead] != V))
      fail(format(
          "`state_scales` must be contiguous in its [HV, V] inner dimensions (strides (%lld, "
          "1)); got strides %s (an arbitrary slot stride is supported)",
          ll(V), stride_str(s).c_str()));
    c.device("state_scales", s);
    ref.scales = static_cast<float*>(s.data);
    ref.scale_slot_stride = s.stride[lead - 1];
  } else if (f.scales) {
    fail(format("%s: `state_scales` applies to float8_e4m3fn and int8 states; `%s` is %s", op,
                state_name, dt));
  }

  const bool stochastic = rounds_stochastically(state.dtype, f.rounding);
  if (stochastic && state.dtype == DType::f32)
    fail(
        format("%s: stochastic rounding applies to bfloat16, float16, float8_e4m3fn and int8 "
               "states; `%s` is float32 (stored exactly)",
               op, state_name));
  if (stochastic) {
    if (!f.step)
      fail(
          format("%s: stochastic rounding of the %s state `%s` needs `rounding_step`, an int64 [1] "
                 "step counter on the state's device (StatePool.rounding_step)",
                 op, dt, state_name));
    const TensorView& st = *f.step;
    if (st.numel() != step_count || (step_count > 1 && (st.ndim != 1 || st.stride[0] != 1))) {
      if (step_count == 1)
        fail(format("`rounding_step` must have one element (an int64 [1] counter); got shape %s",
                    shape_str(st).c_str()));
      fail(
          format("`rounding_step` must be a contiguous [%lld] (one int64 counter per layer); got "
                 "shape %s",
                 ll(step_count), shape_str(st).c_str()));
    }
    c.dtype("rounding_step", st, {DType::i64});
    c.device("rounding_step", st);
    if (f.layer < 0) fail(format("%s: `rounding_layer` must be >= 0; got %lld", op, ll(f.layer)));
    ref.stochastic = true;
    ref.step = static_cast<int64_t*>(st.data);
    ref.seed = static_cast<uint64_t>(f.seed);
    ref.layer = static_cast<uint64_t>(f.layer);
  } else if (f.step) {
    fail(
        format("%s: `rounding_step` is given, but the %s state `%s` is rounded to nearest (pass "
               "state_rounding stochastic, or no step)",
               op, dt, state_name));
  }
}

const TensorView* check_scratch_format(Contract& c, const char* op, const TensorView& scratch,
                                       const std::optional<TensorView>& scales,
                                       const TensorView& state) {
  const bool quantized = is_quantized(scratch.dtype);
  if (!quantized) {
    if (scales)
      fail(
          format("%s: `intermediate_state_scales` applies to a float8_e4m3fn or int8 "
                 "`intermediate_states`; it is %s",
                 op, dtype_name(scratch.dtype)));
    if (scratch.dtype != state.dtype && !is_quantized(state.dtype))  // a quantized pool: any float
      fail(format("`intermediate_states` must have the dtype of `state` (%s); got %s",
                  dtype_mark(dtype_name(state.dtype)).c_str(),
                  dtype_mark(dtype_name(scratch.dtype)).c_str()));
    return nullptr;
  }
  const char* dt = dtype_name(scratch.dtype);
  const int lead = scratch.ndim - 5;  // the layers of a commit's scratch, else none
  const char* lead_names = lead == 1 ? "layers, " : "";
  if (!is_quantized(state.dtype))
    throw Error(ErrorKind::not_implemented,
                format("%s: a quantized `intermediate_states` (here %s) is built for "
                       "float8_e4m3fn and int8 pools; `state` is %s (give a %s scratch)",
                       op, dt, dtype_name(state.dtype), dtype_name(state.dtype)));
  if (!scales)
    fail(
        format("%s: `intermediate_state_scales` is required for the %s scratch "
               "`intermediate_states`: its fp32 scales [%sN_scr, T_alloc, HV, V], one per state "
               "row",
               op, dt, lead_names));
  const TensorView& s = *scales;
  bool same = s.ndim == scratch.ndim - 1;
  for (int d = 0; same && d < s.ndim; ++d) same = s.shape[d] == scratch.shape[d];
  if (!same)
    fail(format(
        "`intermediate_state_scales` must have shape [%sN_scr, T_alloc, HV, V]=%s (one "
        "per row of `intermediate_states`); got %s",
        lead_names, tuple_str(scratch.shape, scratch.ndim - 1).c_str(), shape_str(s).c_str()));
  c.dtype("intermediate_state_scales", s, {DType::f32});
  const int64_t HV = s.shape[s.ndim - 2], V = s.shape[s.ndim - 1];
  if (s.stride[s.ndim - 1] != 1 || (HV > 1 && s.stride[s.ndim - 2] != V))
    fail(
        format("`intermediate_state_scales` must be contiguous in its [HV, V] inner dimensions "
               "(strides (%lld, 1)); got strides %s",
               ll(V), stride_str(s).c_str()));
  c.device("intermediate_state_scales", s);
  return &s;
}

void check_state_format_backend(const char* op, const StatePoolRef& ref, Device device,
                                bool cuda_built) {
  if (device.type != DeviceType::cuda || cuda_built) return;
  if (is_quantized(ref.dtype))
    throw Error(ErrorKind::not_implemented,
                format("%s: %s states are not built for the CUDA backend yet (issue #36); the CPU "
                       "backend runs them",
                       op, dtype_name(ref.dtype)));
  if (ref.stochastic)
    throw Error(ErrorKind::not_implemented,
                format("%s: stochastic rounding of %s states is not built for the CUDA backend "
                       "yet (issue #36); the CPU backend runs it",
                       op, dtype_name(ref.dtype)));
}

}  // namespace deltastate::detail
