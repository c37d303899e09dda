// Contract of ReplaySSM buffered decode: the checks and texts of SGLang's Triton function
// (`fused_recurrent_linear_replayssm_decode`), in its order; with `helion`, first those of its
// Helion KDA twin (`helion_fused_recurrent_kda_replayssm_decode`), in that one's order. Checks
// beyond SGLang's (dtypes, devices, scale, slot bounds, cursor range) follow.
#include <cmath>

#include "contracts/contract.h"
#include "contracts/problem_parts.h"
#include "contracts/validate.h"

namespace deltastate::detail {

namespace {
long long ll(int64_t v) { return static_cast<long long>(v); }

// `t` as a contiguous [rows, numel/rows] (or [numel]) view: Helion's a.view(B, -1) and
// dt_bias.view(-1).
TensorView flat(const TensorView& t, bool keep_rows) {
  TensorView v = t;
  const int64_t n = t.numel();
  if (keep_rows && t.ndim >= 1) {
    const int64_t rows = t.shape[0];
    v.ndim = 2;
    v.shape[0] = rows;
    v.shape[1] = rows ? n / rows : 0;
    v.stride[0] = v.shape[1];
    v.stride[1] = 1;
  } else {
    v.ndim = 1;
    v.shape[0] = n;
    v.stride[0] = 1;
  }
  return v;
}

// The Helion twin's checks, before the Triton function's (which then add the slot counts of the
// rings, int32 indices and what deltastate checks beyond both).
void check_helion(const ReplayDecodeArgs& args) {
  const TensorView& a = args.a;
  const TensorView& dt_bias = args.dt_bias;
  if ((a.ndim != 2 && a.ndim != 3) || !a.is_contiguous())
    fail("KDA `a` must be a contiguous 2D or 3D tensor.");
  if ((dt_bias.ndim != 1 && dt_bias.ndim != 2) || !dt_bias.is_contiguous())
    fail("KDA `dt_bias` must be a contiguous 1D or 2D tensor.");
  Contract c;
  const PackedSizes s = check_packed_inputs(c, args.mixed_qkv, flat(a, true), args.b, args.A_log,
                                            flat(dt_bias, false), args.state, args.out,
                                            args.state_indices, /*kda=*/true);
  const TensorView& wp = args.write_pos;
  if (wp.ndim != 1 || wp.dtype != DType::i32) fail("`write_pos` must be a 1D int32 tensor.");
  if (wp.shape[0] != s.B) fail(format("`write_pos` must have shape %s.", tuple_str({s.B}).c_str()));
  if (args.force_flush) {
    const TensorView& ff = *args.force_flush;
    if (ff.ndim != 1 || ff.dtype != DType::i32 || ff.shape[0] != s.B)
      fail("`force_flush` must be a length-B int32 tensor or None.");
  }
  const TensorView& dc = args.d_cache;
  const TensorView& kc = args.k_cache;
  const TensorView& gc = args.g_cache;
  if (dc.ndim != 4) fail("`d_cache` must have shape [slots, HV, L, V].");
  const int64_t L = dc.shape[2];
  if (L < 1) fail("ReplaySSM cache length must be at least 1.");
  if (dc.shape[1] != s.HV || dc.shape[3] != s.V)
    fail("`d_cache` must have shape [slots, HV, L, V].");
  if (kc.ndim != 4 || kc.shape[1] != s.H || kc.shape[2] != L || kc.shape[3] != s.K)
    fail("`k_cache` must have shape [slots, H, L, K].");
  if (gc.ndim != 4 || gc.shape[1] != s.HV || gc.shape[2] != L || gc.shape[3] != s.K)
    fail("`g_cache` must have shape [slots, HV, L, K].");
  if (gc.dtype != DType::f32) fail("`g_cache` must have dtype " + dtype_mark("float32") + ".");
  const Device dev = args.mixed_qkv.device;
  for (const TensorView* t : {&dc, &kc, &gc, &wp})
    if (!(t->device == dev)) fail("ReplaySSM inputs must be on the same device.");
  if (args.force_flush && !(args.force_flush->device == dev))
    fail("`force_flush` must be on the same device as the inputs.");
}
}  // namespace

int64_t replay_ring_length(const TensorView& dc, int64_t S, int64_t HV, int64_t V) {
  if (dc.ndim < 3)
    fail(format("`d_cache` shape must be (%lld, %lld, L, %lld) (got %s).", ll(S), ll(HV), ll(V),
                shape_str(dc).c_str()));
  const int64_t L = dc.shape[2];
  if (L < 1) fail("ReplaySSM cache length must be at least 1.");
  return L;
}

void check_replay_rings(const TensorView& dc, const TensorView& kc, const TensorView& gc, int64_t S,
                        int64_t HV, int64_t H, int64_t V, int64_t K, int64_t L, bool kda) {
  if (!dc.is_contiguous() || !kc.is_contiguous() || !gc.is_contiguous()) {
    fail("ReplaySSM ring caches must be contiguous." +
         (!dc.is_contiguous()   ? strides_detail("d_cache", dc)
          : !kc.is_contiguous() ? strides_detail("k_cache", kc)
                                : strides_detail("g_cache", gc)));
  }
  if (dc.ndim != 4 || dc.shape[0] != S || dc.shape[1] != HV || dc.shape[3] != V)
    fail(format("`d_cache` shape must be %s (got %s).", tuple_str({S, HV, L, V}).c_str(),
                shape_str(dc).c_str()));
  if (kc.ndim != 4 || kc.shape[0] != S || kc.shape[1] != H || kc.shape[2] != L || kc.shape[3] != K)
    fail(format("`k_cache` shape must be %s (got %s).", tuple_str({S, H, L, K}).c_str(),
                shape_str(kc).c_str()));
  if (kda) {
    if (gc.ndim != 4 || gc.shape[0] != S || gc.shape[1] != HV || gc.shape[2] != L ||
        gc.shape[3] != K)
      fail(format("`g_cache` shape must be %s (got %s).", tuple_str({S, HV, L, K}).c_str(),
                  shape_str(gc).c_str()));
  } else if (gc.ndim != 3 || gc.shape[0] != S || gc.shape[1] != HV || gc.shape[2] != L) {
    fail(format("`g_cache` shape must be %s (got %s).", tuple_str({S, HV, L}).c_str(),
                shape_str(gc).c_str()));
  }
  if (gc.dtype != DType::f32)
    fail(format("`g_cache` must be float32 (got %s).", dtype_mark(dtype_name(gc.dtype)).c_str()));
}

void check_replay_cursor_tensors(const TensorView& wp, const std::optional<TensorView>& ff) {
  if (wp.ndim != 1 || wp.dtype != DType::i32 || !wp.is_contiguous())
    fail("`write_pos` must be a contiguous 1D int32 tensor.");
  if (ff && (ff->ndim != 1 || ff->dtype != DType::i32 || !ff->is_contiguous()))
    fail("`force_flush` must be a contiguous 1D int32 tensor or None.");
}

void check_replay_rows(const TensorView& idx, const TensorView& wp,
                       const std::optional<TensorView>& ff, int64_t B) {
  if (idx.ndim != 1 || idx.dtype != DType::i32)
    fail("`ssm_state_indices` must be a 1D int32 tensor.");
  if (wp.shape[0] != B || idx.shape[0] != B)
    fail(
        format("`write_pos` and `ssm_state_indices` must both have length B=%lld (got %lld, %lld).",
               ll(B), ll(wp.shape[0]), ll(idx.shape[0])));
  if (ff && ff->shape[0] != B) fail(format("`force_flush` must have length B=%lld.", ll(B)));
}

void check_replay_ring_parts(Contract& c, const TensorView& dc, const TensorView& kc,
                             const TensorView& gc, const TensorView& wp,
                             const std::optional<TensorView>& ff) {
  c.device("d_cache", dc);
  c.device("k_cache", kc);
  c.device("g_cache", gc);
  c.device("write_pos", wp);
  if (ff) c.device("force_flush", *ff);
}

void check_replay_ring_dtypes(Contract& c, const TensorView& dc, const TensorView& kc) {
  c.floating("d_cache", dc);
  c.floating("k_cache", kc);
}

void check_replay_cursors_host(const TensorView& idx, int64_t index_stride, const TensorView& wp,
                               int64_t B, int64_t L) {
  const auto* w = static_cast<const int32_t*>(wp.data);
  const auto* ix = static_cast<const int32_t*>(idx.data);
  for (int64_t i = 0; i < B; ++i) {
    if (ix[i * index_stride] >= 0 && (w[i] < 0 || w[i] >= L))
      fail(
          format("`write_pos`[%lld]=%d is outside the ring [0, L-1=%lld]", ll(i), w[i], ll(L - 1)));
  }
}

void check_replay_cache_base_tensor(const ReplayModeArgs& m) {
  if (!m.circular) return;
  const std::optional<TensorView>& cb = *m.cache_base;
  if (!cb || cb->ndim != 1 || cb->dtype != DType::i32 || !cb->is_contiguous())
    fail("`cache_base` must be a contiguous 1D int32 tensor for circular replay.");
}

ReplayModes check_replay_modes(const ReplayModeArgs& m, const TensorView& x,
                               const TensorView& state, const TensorView& dc, const TensorView& kc,
                               int64_t B, int64_t H, int64_t HV, int64_t L, bool kda,
                               const std::optional<double>& lower_bound) {
  const std::optional<TensorView>& cb = *m.cache_base;
  if (m.circular && cb->shape[0] != B)
    fail(format("`cache_base` must have shape %s (got %s).", tuple_str({B}).c_str(),
                shape_str(*cb).c_str()));
  if (m.predecay) {
    if (!kda || !m.prefix || !m.circular)
      fail("Pre-decayed K requires KDA circular replay with prefix gates.");
    if (H != HV) fail("Pre-decayed K requires one K head per value head.");
    if (state.dtype != DType::f32) fail("Pre-decayed K requires a float32 checkpoint state.");
    if (dc.dtype != kc.dtype) fail("Pre-decayed K requires matching d/k ring dtypes.");
    if (dc.dtype != x.dtype && dc.dtype != DType::f32)
      fail("Pre-decayed K d/k rings must use the activation dtype or float32.");
    if (L < 2 || L > 16) fail("Pre-decayed K requires a cache length between 2 and 16.");
    if (!lower_bound || !std::isfinite(*lower_bound) || *lower_bound >= 0)
      fail("Pre-decayed K requires a finite negative safe-gate lower bound.");
    if (static_cast<double>(L - 1) * std::fabs(*lower_bound) > 80)
      fail(
          "Pre-decayed K inverse-prefix scaling is unsafe: (cache_len - 1) * abs(lower_bound) "
          "must be <= 80.");
    if (x.dtype == DType::f16 && kc.dtype != DType::f32)
      fail("Pre-decayed K with FP16 activations requires an FP32 ring.");
  }
  ReplayModes r;
  r.circular = m.circular;
  r.cache_base = m.circular ? static_cast<int32_t*>(cb->data) : nullptr;
  r.prefix_gates = m.prefix && kda;
  r.predecayed_k = m.predecay;
  return r;
}

void check_replay_cache_base_host(const ReplayModes& m, const TensorView& idx, int64_t index_stride,
                                  int64_t B, int64_t L) {
  if (!m.circular) return;
  const auto* ix = static_cast<const int32_t*>(idx.data);
  for (int64_t i = 0; i < B; ++i) {
    const int32_t v = m.cache_base[i];
    if (ix[i * index_stride] >= 0 && (v < 0 || v >= L))
      fail(format("`cache_base`[%lld]=%d is outside the ring [0, L-1=%lld]", ll(i), v, ll(L - 1)));
  }
}

void check_replay_cuda_ring(const char* op, int64_t L) {
  // The CUDA kernels keep the cursor in the low 16 bits of write_pos during a launch, and their
  // shared-memory layouts are int arithmetic (the CPU kernels take any L).
  if (L > 4096)
    throw Error(
        ErrorKind::not_implemented,
        format("%s: ring length L=%lld is above the CUDA kernel's limit of 4096", op, ll(L)));
}

ReplayProblem validate_replayssm_decode(const ReplayDecodeArgs& args) {
  if (args.helion) check_helion(args);
  const TensorView& x = args.mixed_qkv;
  const TensorView& a = args.a;
  const TensorView& b = args.b;
  const TensorView& A_log = args.A_log;
  const TensorView& dt_bias = args.dt_bias;
  const TensorView& state = args.state;
  const TensorView& out = args.out;
  const TensorView& idx = args.state_indices;
  const TensorView& wp = args.write_pos;
  const bool kda = args.is_kda || args.helion;

  if (x.ndim != 2) fail(format("`mixed_qkv` must be 2D (got ndim=%d).", x.ndim));
  if (x.stride[1] != 1)
    fail("`mixed_qkv` must be contiguous in the last dim." + last_stride_detail("mixed_qkv", x));
  if (b.ndim != 2) fail(format("`b` must be 2D (got b.ndim=%d).", b.ndim));
  if (A_log.ndim != 1) fail("`A_log` must be a 1D tensor.");
  if (state.ndim != 4) fail(format("`initial_state` must be 4D (got ndim=%d).", state.ndim));
  if (!out.is_contiguous()) fail("`out` must be contiguous." + strides_detail("out", out));
  check_replay_cursor_tensors(wp, args.force_flush);
  const ReplayModeArgs modes{&args.cache_base, args.circular_replay && !args.helion,
                             args.prefix_gate_cache && !args.helion,
                             args.predecayed_k_cache && !args.helion};
  check_replay_cache_base_tensor(modes);
  if (!inner_strides_compact(state)) {
    fail(
        "`initial_state` must be contiguous in its [HV, V, K] inner dimensions; an arbitrary slot "
        "stride is supported." +
        inner_strides_detail("initial_state", state));
  }
  const int64_t B = x.shape[0];
  const int64_t S = state.shape[0], HV = state.shape[1], V = state.shape[2], K = state.shape[3];
  const int64_t width = x.shape[1];
  if (width <= HV * V || (width - HV * V) % 2 != 0) {
    fail(format("Invalid packed `mixed_qkv` last dim=%lld for HV=%lld, V=%lld.", ll(width), ll(HV),
                ll(V)));
  }
  const int64_t q_dim = (width - HV * V) / 2;
  if (q_dim <= 0 || q_dim % K != 0) {
    fail(format("Invalid packed `mixed_qkv` last dim=%lld for HV=%lld, V=%lld, K=%lld.", ll(width),
                ll(HV), ll(V), ll(K)));
  }
  const int64_t H = q_dim / K;
  if (H <= 0 || HV % H != 0)
    fail(format("Invalid head config inferred from mixed_qkv: H=%lld, HV=%lld.", ll(H), ll(HV)));
  if (b.shape[0] != B || b.shape[1] != HV || (HV > 1 && b.stride[1] != 1))
    fail(format("`b` must have contiguous shape %s.", tuple_str({B, HV}).c_str()));
  if (A_log.shape[0] != HV || !A_log.is_contiguous())
    fail(format("`A_log` must have contiguous shape %s.", tuple_str({HV}).c_str()));

  // Rings: L comes from d_cache.
  const TensorView& dc = args.d_cache;
  const TensorView& kc = args.k_cache;
  const TensorView& gc = args.g_cache;
  const int64_t L = replay_ring_length(dc, S, HV, V);

  if (kda) {
    // Beyond SGLang's Triton function: the flat forms [B, HV*K] / [HV*K] too (the Helion twin's).
    const bool a_ok = (a.ndim == 3 && a.shape[0] == B && a.shape[1] == HV && a.shape[2] == K) ||
                      (a.ndim == 2 && a.shape[0] == B && a.shape[1] == HV * K);
    if (!a_ok)
      fail(format("KDA `a` must have shape %s (got %s).", tuple_str({B, HV, K}).c_str(),
                  shape_str(a).c_str()));
    const bool dt_ok = (dt_bias.ndim == 2 && dt_bias.shape[0] == HV && dt_bias.shape[1] == K) ||
                       (dt_bias.ndim == 1 && dt_bias.shape[0] == HV * K);
    if (!dt_ok)
      fail(format("KDA `dt_bias` must have shape %s (got %s).", tuple_str({HV, K}).c_str(),
                  shape_str(dt_bias).c_str()));
    if (!a.is_contiguous() || !dt_bias.is_contiguous()) {
      fail("KDA `a`/`dt_bias` must be contiguous." +
           (!a.is_contiguous() ? strides_detail("a", a) : strides_detail("dt_bias", dt_bias)));
    }
  } else {
    // SGLang's shape rule; a row stride is taken (a slice of the b/a projection), the heads of
    // a row adjacent (beyond SGLang: the kernels read them so).
    if (a.ndim != 2 || a.shape[0] != B || a.shape[1] != HV)
      fail(format("GDN `a` must have shape %s (got %s).", tuple_str({B, HV}).c_str(),
                  shape_str(a).c_str()));
    if (HV > 1 && a.stride[1] != 1)
      fail("GDN `a` must be contiguous in the last dim." + last_stride_detail("a", a));
    if (dt_bias.ndim != 1 || dt_bias.shape[0] != HV || !dt_bias.is_contiguous())
      fail(format("GDN `dt_bias` must have shape %s (got %s).", tuple_str({HV}).c_str(),
                  shape_str(dt_bias).c_str()));
  }
  check_replay_rings(dc, kc, gc, S, HV, H, V, K, L, kda);
  if (out.ndim != 4 || out.shape[0] != B || out.shape[1] != 1 || out.shape[2] != HV ||
      out.shape[3] != V)
    fail(format("`out` must have shape %s (got %s).", tuple_str({B, 1, HV, V}).c_str(),
                shape_str(out).c_str()));
  check_replay_rows(idx, wp, args.force_flush, B);
  const ReplayModes rm =
      check_replay_modes(modes, x, state, dc, kc, B, H, HV, L, kda, args.lower_bound);

  Contract c;
  c.device("mixed_qkv", x);
  c.device("a", a);
  c.device("b", b);
  c.device("A_log", A_log);
  c.device("dt_bias", dt_bias);
  c.device("initial_state", state);
  c.device("out", out);
  c.device("ssm_state_indices", idx);
  check_replay_ring_parts(c, dc, kc, gc, wp, args.force_flush);
  if (rm.circular) c.device("cache_base", *args.cache_base);  // read on the host below (CPU)
  c.check_devices("ReplaySSM inputs must be on the same device.", false);

  // Beyond SGLang: dtypes, scale, slot bounds, cursor range.
  c.floating("mixed_qkv", x);
  c.floating("a", a);
  c.floating("b", b);
  c.floating("A_log", A_log);
  c.floating("dt_bias", dt_bias);
  if (!is_quantized(state.dtype)) c.floating("initial_state", state);
  StatePoolRef pool{state.data, state.dtype, state.stride[0], S};
  check_state_format(c,
                     args.helion ? "helion_fused_recurrent_kda_replayssm_decode"
                                 : "fused_recurrent_linear_replayssm_decode",
                     "initial_state", state, args.state_format, true, pool);
  c.check_devices("ReplaySSM inputs must be on the same device", true);  // the format's tensors
  check_replay_ring_dtypes(c, dc, kc);
  c.floating("out", out);
  const double scale = checked_scale(args.scale, K);
  if (args.lower_bound && !std::isfinite(*args.lower_bound))
    fail(format("lower_bound must be finite (got %g)", *args.lower_bound));
  const int64_t index_stride = B > 1 ? idx.stride[0] : 1;
  const bool on_cpu = c.common_device().type == DeviceType::cpu;
  const bool check = args.check_indices.value_or(on_cpu);
  if (on_cpu && check) {
    check_slot_indices_host("ssm_state_indices", idx.data, idx.dtype, B, index_stride, S);
    check_replay_cursors_host(idx, index_stride, wp, B, L);
    check_replay_cache_base_host(rm, idx, index_stride, B, L);
  }
  const char* op_name = args.helion ? "helion_fused_recurrent_kda_replayssm_decode"
                                    : "fused_recurrent_linear_replayssm_decode";
  // A checkpoint in its storage format runs on CUDA on the generic kernel's formatted
  // instantiation (basic rings) or the modes kernel's (SGLang's ring modes).
  check_state_format_backend(op_name, pool, c.common_device(), /*cuda_built=*/true);
  if (!on_cpu) {
    require_cuda_k(K);
    check_replay_cuda_ring("replayssm_decode", L);
  }

  ReplayProblem p;
  p.B = static_cast<int32_t>(B);
  p.H = static_cast<int32_t>(H);
  p.HV = static_cast<int32_t>(HV);
  p.K = static_cast<int32_t>(K);
  p.V = static_cast<int32_t>(V);
  p.L = static_cast<int32_t>(L);
  const PackedQkv in = packed_qkv(x.data, x.dtype, x.stride[0], H, K, V);
  p.q = in.q;
  p.k = in.k;
  p.v = in.v;
  p.a = {a.data, a.dtype, kda ? HV * K : a.stride[0], 0, kda ? K : 1};
  p.b = {b.data, b.dtype, b.stride[0], 0, 1};
  p.out = {out.data, out.dtype, HV * V, 0, V};
  p.gate = gate_params(kda, args.lower_bound ? GateMode::safe : GateMode::softplus, &A_log,
                       &dt_bias, args.lower_bound);
  p.round_beta = args.round_beta_to_input;
  p.l2norm = args.use_qk_l2norm;
  p.scale = static_cast<float>(scale);
  p.state = pool;
  p.d_cache = dc.data;
  p.d_dtype = dc.dtype;
  p.k_cache = kc.data;
  p.k_dtype = kc.dtype;
  p.g_cache = static_cast<float*>(gc.data);
  p.indices = static_cast<const int32_t*>(idx.data);
  p.index_stride = index_stride;
  p.write_pos = static_cast<int32_t*>(wp.data);
  p.force_flush = args.force_flush ? static_cast<const int32_t*>(args.force_flush->data) : nullptr;
  p.advance_write_pos = args.advance_write_pos;
  p.modes = rm;
  p.check_indices = check;
  p.pdl = args.pdl;
  p.device = c.common_device();
  return p;
}

}  // namespace deltastate::detail
