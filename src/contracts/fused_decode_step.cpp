// Contract of fused_decode_step (GDN and KDA): packed decode's checks and texts for the inputs
// the two ops share (check_packed_inputs), the conv's (check_conv_params), then the windows, the
// norm, ReplaySSM's rings and cursors (replayssm_decode's checks, shared with it) and the CUDA
// kernel's limits.
#include <cmath>
#include <utility>

#include "contracts/contract.h"
#include "contracts/problem_parts.h"
#include "contracts/validate.h"

namespace deltastate::detail {

namespace {

// One conv window [slots, channels, state_len] of the layer.
void check_window(Contract& c, const char* name, const TensorView& w, int64_t slots,
                  int64_t channels, int width) {
  if (w.ndim != 3 || w.shape[1] != channels)
    fail(format("`%s` must have shape [slots, %lld, state_len] (got %s).", name,
                static_cast<long long>(channels), shape_str(w).c_str()));
  if (w.shape[0] != slots)
    fail(format("`%s` must have as many slots as `initial_state` (%lld; got %lld).", name,
                static_cast<long long>(slots), static_cast<long long>(w.shape[0])));
  if (w.shape[2] < width - 1)
    fail(format("`%s` must have state_len >= width - 1 = %d (got %lld).", name, width - 1,
                static_cast<long long>(w.shape[2])));
  c.floating(name, w);
  c.device(name, w);
}

}  // namespace

FusedStepProblem validate_fused_decode_step(const FusedDecodeStepArgs& args, bool kda) {
  const TensorView& x = args.mixed_qkv;
  const TensorView& out = args.out;
  if (out.ndim != 3 || !out.is_contiguous())
    fail(format("`out` must be a contiguous [B, HV, V] tensor (got shape %s).",
                shape_str(out).c_str()));
  // packed decode's `out` [B, 1, HV, V] over the same memory
  TensorView out4 =
      TensorView::strided(out.data, out.dtype, {out.shape[0], 1, out.shape[1], out.shape[2]},
                          {out.stride[0], out.stride[0], out.stride[1], 1}, out.device);
  Contract c;
  const auto [B, H, HV, K, V] = check_packed_inputs(c, x, args.a, args.b, args.A_log, args.dt_bias,
                                                    args.state, out4, args.state_indices, kda);
  c.floating("mixed_qkv", x);
  c.floating("a", args.a);
  c.floating("b", args.b);
  c.floating("A_log", args.A_log);
  c.floating("dt_bias", args.dt_bias);
  if (!is_quantized(args.state.dtype)) c.floating("initial_state", args.state);
  c.floating("out", out);
  c.index_dtype("ssm_state_indices", args.state_indices);
  const double scale = checked_scale(args.scale, K);
  if (kda && args.lower_bound && !std::isfinite(*args.lower_bound))
    fail(format("lower_bound must be finite (got %g)", *args.lower_bound));

  FusedStepProblem p;
  const int64_t conv_dim = x.shape[1];
  p.conv = check_conv_params(c, args.conv_weight, args.conv_bias, conv_dim, args.conv_silu,
                             "conv_weight", "conv_bias");
  const int64_t slots = args.state.shape[0];
  const bool split = args.conv_state_k || args.conv_state_v;
  if (split) {
    if (!args.conv_state_k || !args.conv_state_v)
      fail("`conv_state_k` and `conv_state_v` go together (separate q, k, v windows).");
    check_window(c, "conv_state", args.conv_state, slots, H * K, p.conv.width);
    check_window(c, "conv_state_k", *args.conv_state_k, slots, H * K, p.conv.width);
    check_window(c, "conv_state_v", *args.conv_state_v, slots, HV * V, p.conv.width);
    if (args.conv_state_k->shape[2] != args.conv_state.shape[2] ||
        args.conv_state_v->shape[2] != args.conv_state.shape[2])
      fail("`conv_state`, `conv_state_k` and `conv_state_v` must have one state_len.");
    p.window[0] = conv_window(args.conv_state, 0);
    p.window[1] = conv_window(*args.conv_state_k, 0);
    p.window[2] = conv_window(*args.conv_state_v, 0);
  } else {
    check_window(c, "conv_state", args.conv_state, slots, conv_dim, p.conv.width);
    p.window[0] = conv_window(args.conv_state, 0);
    p.window[1] = conv_window(args.conv_state, H * K);
    p.window[2] = conv_window(args.conv_state, 2 * H * K);
  }

  if (args.norm_weight.has_value() != args.z.has_value())
    fail("`norm_weight` and `z` go together: both for the gated RMSNorm, or neither.");
  if (args.norm_weight) {
    const TensorView& w = *args.norm_weight;
    const TensorView& z = *args.z;
    if (w.ndim != 1 || w.shape[0] != V)
      fail(format("`norm_weight` must have shape [V]=(%lld) (got %s).", static_cast<long long>(V),
                  shape_str(w).c_str()));
    if (z.ndim != 3 || z.shape[0] != B || z.shape[1] != HV || z.shape[2] != V)
      fail(format("`z` must have shape [B, HV, V]=%s (got %s).", tuple_str({B, HV, V}).c_str(),
                  shape_str(z).c_str()));
    if (z.stride[2] != 1)
      fail("`z` must be contiguous in the last dim." + last_stride_detail("z", z));
    if (!(args.norm_eps >= 0.0) || !std::isfinite(args.norm_eps))
      fail(format("norm_eps must be finite and >= 0 (got %g)", args.norm_eps));
    c.floating("norm_weight", w);
    c.floating("z", z);
    c.device("norm_weight", w);
    c.device("z", z);
    p.z = z.data;
    p.z_dtype = z.dtype;
    p.z_row_stride = z.stride[0];
    p.z_head_stride = z.stride[1];
    p.norm_weight = w.data;
    p.norm_weight_dtype = w.dtype;
    p.norm_eps = static_cast<float>(args.norm_eps);
  }
  // ReplaySSM: the rings and cursors with replayssm_decode's checks and texts.
  const TensorView& idx = args.state_indices;
  const bool replay = args.d_cache || args.k_cache || args.g_cache || args.write_pos ||
                      args.force_flush || args.advance_write_pos || args.cache_base ||
                      args.circular_replay || args.prefix_gate_cache || args.predecayed_k_cache;
  int64_t L = 0;
  const ReplayModeArgs modes{&args.cache_base, args.circular_replay, args.prefix_gate_cache,
                             args.predecayed_k_cache};
  if (replay) {
    const std::pair<const char*, bool> parts[] = {{"d_cache", args.d_cache.has_value()},
                                                  {"k_cache", args.k_cache.has_value()},
                                                  {"g_cache", args.g_cache.has_value()},
                                                  {"write_pos", args.write_pos.has_value()}};
    for (const auto& [name, given] : parts)
      if (!given)
        fail(
            format("fused_decode_step (ReplaySSM): `%s` is missing; `d_cache`, `k_cache`, "
                   "`g_cache` and `write_pos` go together (force_flush, advance_write_pos and "
                   "the ring modes need them).",
                   name));
    const TensorView &dc = *args.d_cache, &kc = *args.k_cache, &gc = *args.g_cache;
    const TensorView& wp = *args.write_pos;
    check_replay_cursor_tensors(wp, args.force_flush);
    check_replay_cache_base_tensor(modes);
    L = replay_ring_length(dc, slots, HV, V);
    check_replay_rings(dc, kc, gc, slots, HV, H, V, K, L, kda);
    check_replay_rows(idx, wp, args.force_flush, B);
    p.replay.modes = check_replay_modes(modes, args.mixed_qkv, args.state, dc, kc, B, H, HV, L, kda,
                                        args.lower_bound);
    if (args.cache_base) c.device("cache_base", *args.cache_base);
    check_replay_ring_parts(c, dc, kc, gc, wp, args.force_flush);
    check_replay_ring_dtypes(c, dc, kc);
    p.replay.L = static_cast<int32_t>(L);
    p.replay.d_cache = dc.data;
    p.replay.d_dtype = dc.dtype;
    p.replay.k_cache = kc.data;
    p.replay.k_dtype = kc.dtype;
    p.replay.g_cache = static_cast<float*>(gc.data);
    p.replay.write_pos = static_cast<int32_t*>(wp.data);
    p.replay.force_flush =
        args.force_flush ? static_cast<const int32_t*>(args.force_flush->data) : nullptr;
    p.replay.advance_write_pos = args.advance_write_pos;
  }
  // The state's format: quantized and stochastically rounded states in both modes (the ReplaySSM
  // mode's checkpoint through replayssm_decode's formatted loads and stores, on either backend).
  const char* op = kda ? "kda_fused_decode_step" : "gdn_fused_decode_step";
  StatePoolRef pool{args.state.data, args.state.dtype, args.state.stride[0], slots};
  check_state_format(c, op, "initial_state", args.state, args.state_format, true, pool);
  if (args.workspace) {  // a byte buffer: any dtype, counted as numel * element size
    const TensorView& w = *args.workspace;
    if (w.ndim != 1 || !w.is_contiguous())
      fail(format("`workspace` must be a contiguous 1-D tensor (got shape %s).",
                  shape_str(w).c_str()));
    c.device("workspace", w);
    if (reinterpret_cast<uintptr_t>(w.data) % 16 != 0)
      fail(
          format("`workspace` must be 16-byte aligned; its address is %lld bytes past a "
                 "multiple of 16",
                 static_cast<long long>(reinterpret_cast<uintptr_t>(w.data) % 16)));
    p.workspace = w.data;
    p.workspace_bytes = w.numel() * w.element_size();
  }
  c.check_devices("fused_decode_step: all tensors must be on the same device", true);

  const bool on_cpu = c.common_device().type == DeviceType::cpu;
  const bool check = args.check_indices.value_or(on_cpu);
  const int64_t index_stride = B > 1 ? idx.stride[0] : 1;
  if (on_cpu && check) {
    check_slot_indices_host("ssm_state_indices", idx.data, idx.dtype, B, idx.stride[0], slots);
    if (replay) {
      check_replay_cursors_host(idx, index_stride, *args.write_pos, B, L);
      check_replay_cache_base_host(p.replay.modes, idx, index_stride, B, L);
    }
  }
  // CUDA: a formatted pool runs a chain plan, the plain one (whose packed-decode link is the
  // recurrent op's formatted paths) or the ReplaySSM one (replayssm_decode's formatted kernels);
  // both advance the step counter once after their grid. The one-launch kernels have no
  // formatted state I/O, so the chain's workspace is required.
  check_state_format_backend(op, pool, c.common_device(), /*cuda_built=*/true);
  const bool formatted = pool.formatted();
  if (!on_cpu && formatted && !args.workspace)
    throw Error(ErrorKind::not_implemented,
                format("%s: %s states%s on CUDA run the %s (the conv, %s, the norm), which "
                       "needs a `workspace` of fused_decode_step_workspace_bytes bytes; none was "
                       "given",
                       op, dtype_name(pool.dtype),
                       is_quantized(pool.dtype) ? "" : " with stochastic rounding",
                       replay ? "ReplaySSM chain" : "chain plan",
                       replay ? "replayssm_decode" : "packed decode"));
  if (!on_cpu && replay) check_replay_cuda_ring("fused_decode_step", L);
  if (!on_cpu) {
    const int64_t rows = HV / H * V;
    const int64_t esz = args.state.element_size();
    if ((K != 64 && K != 128) || rows > 256)
      throw Error(ErrorKind::not_implemented,
                  format("fused_decode_step on CUDA supports K in {64, 128} and (HV/H)*V <= 256 "
                         "(got K=%lld, (HV/H)*V=%lld)",
                         static_cast<long long>(K), static_cast<long long>(rows)));
    if (reinterpret_cast<uintptr_t>(args.state.data) % 16 != 0 ||
        (args.state.stride[0] * esz) % 16 != 0)
      throw Error(ErrorKind::not_implemented,
                  "fused_decode_step on CUDA needs 16-byte aligned state rows (base address and "
                  "slot stride)");
  }

  p.B = static_cast<int32_t>(B);
  p.H = static_cast<int32_t>(H);
  p.HV = static_cast<int32_t>(HV);
  p.K = static_cast<int32_t>(K);
  p.V = static_cast<int32_t>(V);
  p.x = x.data;
  p.x_dtype = x.dtype;
  p.x_row_stride = x.stride[0];
  p.a = {args.a.data, args.a.dtype, args.a.stride[0], 0, kda ? K : 1};
  p.b = {args.b.data, args.b.dtype, args.b.stride[0], 0, 1};
  p.gate = gate_params(kda, (kda && args.lower_bound) ? GateMode::safe : GateMode::softplus,
                       &args.A_log, &args.dt_bias, args.lower_bound);
  p.round_beta = args.round_beta_to_input;
  p.l2norm = args.use_qk_l2norm;
  p.scale = static_cast<float>(scale);
  p.state = pool;
  p.indices = idx.data;
  p.index_dtype = idx.dtype;
  p.index_stride = index_stride;
  p.out = {out.data, out.dtype, HV * V, 0, V};
  p.check_indices = check;
  p.pdl = args.pdl;
  p.device = c.common_device();
  return p;
}

void check_fused_step_workspace(const FusedStepProblem& p, int64_t needed) {
  if (p.workspace && p.workspace_bytes < needed)
    fail(
        format("`workspace` has %lld bytes; fused_decode_step needs %lld "
               "(fused_decode_step_workspace_bytes)",
               static_cast<long long>(p.workspace_bytes), static_cast<long long>(needed)));
}

}  // namespace deltastate::detail
