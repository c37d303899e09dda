// Contract of causal_conv1d_update (causal-conv1d's csrc/causal_conv1d.cpp checks, in its order,
// with readable texts where the package's bare TORCH_CHECKs give none; its width text verbatim),
// and the conv parameters shared with fused_decode_step.
#include "contracts/contract.h"
#include "contracts/validate.h"
#include "core/layer_math.h"

namespace deltastate::detail {

ConvParams check_conv_params(Contract& c, const TensorView& weight,
                             const std::optional<TensorView>& bias, int64_t dim, bool silu,
                             const char* weight_name, const char* bias_name) {
  if (weight.ndim != 2 || weight.shape[0] != dim)
    fail(format("`%s` must have shape [dim, width] with dim=%lld (got %s).", weight_name,
                static_cast<long long>(dim), shape_str(weight).c_str()));
  c.floating(weight_name, weight);
  c.device(weight_name, weight);
  const int64_t width = weight.shape[1];
  if (width < 2 || width > 4) fail("causal_conv1d only supports width between 2 and 4");
  ConvParams p;
  p.weight = weight.data;
  p.weight_dtype = weight.dtype;
  p.weight_dim_stride = weight.stride[0];
  p.weight_width_stride = weight.stride[1];
  p.width = static_cast<int32_t>(width);
  p.silu = silu;
  if (bias) {
    if (bias->dtype != weight.dtype)
      fail(format("`%s` must have the dtype of `%s` (%s; got %s).", bias_name, weight_name,
                  dtype_name(weight.dtype), dtype_name(bias->dtype)));
    if (bias->ndim != 1 || bias->shape[0] != dim)
      fail(format("`%s` must have shape [dim] with dim=%lld (got %s).", bias_name,
                  static_cast<long long>(dim), shape_str(*bias).c_str()));
    c.device(bias_name, *bias);
    p.bias = bias->data;
    p.bias_dtype = bias->dtype;
    p.bias_stride = bias->stride[0];
  }
  return p;
}

ConvWindowRef conv_window(const TensorView& w, int64_t first_channel) {
  ConvWindowRef r;
  r.ptr = static_cast<char*>(w.data) + first_channel * w.stride[1] * w.element_size();
  r.dtype = w.dtype;
  r.slot_stride = w.stride[0];
  r.dim_stride = w.stride[1];
  r.tok_stride = w.stride[2];
  r.num_slots = w.shape[0];
  r.state_len = static_cast<int32_t>(w.shape[2]);
  return r;
}

namespace {

// A [batch] index vector (int32/int64, any stride) of the speculative options.
IndexTable conv_index_vector(Contract& c, const char* name, const TensorView& t, int64_t B) {
  if (t.ndim != 1 || t.shape[0] != B)
    fail(format("`%s` must have shape [batch]=(%lld) (got %s).", name, static_cast<long long>(B),
                shape_str(t).c_str()));
  c.index_dtype(name, t);
  c.device(name, t);
  return {t.data, t.dtype, B > 1 ? t.stride[0] : 1, 1, 1};
}

// A [batch, >= seqlen] table of the EAGLE tree.
IndexTable conv_index_table(Contract& c, const char* name, const TensorView& t, int64_t B,
                            int64_t T) {
  if (t.ndim != 2 || t.shape[0] != B || t.shape[1] < T)
    fail(format("`%s` must have shape [batch, >= seqlen]=(%lld, >= %lld) (got %s).", name,
                static_cast<long long>(B), static_cast<long long>(T), shape_str(t).c_str()));
  c.index_dtype(name, t);
  c.device(name, t);
  return {t.data, t.dtype, t.stride[0], t.stride[1], t.shape[1]};
}

// SGLang's speculative options (ops.h), checked after the package's arguments.
void check_conv_verify(Contract& c, const CausalConv1dUpdateArgs& args, ConvUpdateProblem& p,
                       int64_t B, int64_t dim, int64_t T, int64_t state_len) {
  const bool tree =
      args.retrieve_next_token || args.retrieve_next_sibling || args.retrieve_parent_token;
  if ((args.num_accept_tokens || args.intermediate_conv_window || tree) && args.cache_seqlens)
    fail(
        "`cache_seqlens` (a circular window) cannot be combined with `num_accept_tokens`, "
        "`intermediate_conv_window` or the `retrieve_*` tree tables.");
  const int W1 = p.conv.width - 1;
  if (args.num_accept_tokens) {
    p.num_accept = conv_index_vector(c, "num_accept_tokens", *args.num_accept_tokens, B);
    if (state_len < W1 - 1 + T)
      fail(
          format("`conv_state` must have state_len >= width - 2 + seqlen = %lld with "
                 "`num_accept_tokens` (got %lld).",
                 static_cast<long long>(W1 - 1 + T), static_cast<long long>(state_len)));
    p.accept_limit = state_len - W1 + 1;
  }
  if (args.intermediate_state_indices && !args.intermediate_conv_window)
    fail("`intermediate_state_indices` needs `intermediate_conv_window`.");
  if (args.intermediate_conv_window) {
    const TensorView& w = *args.intermediate_conv_window;
    if (w.ndim != 4 || w.shape[1] < T || w.shape[2] != dim || w.shape[3] != W1)
      fail(
          format("`intermediate_conv_window` must have shape [N_scr, >= seqlen, dim, width - 1]="
                 "(N_scr, >= %lld, %lld, %d) (got %s).",
                 static_cast<long long>(T), static_cast<long long>(dim), W1, shape_str(w).c_str()));
    if (w.dtype != args.conv_state.dtype)
      fail(format("`intermediate_conv_window` must have the dtype of `conv_state` (%s; got %s).",
                  dtype_name(args.conv_state.dtype), dtype_name(w.dtype)));
    c.device("intermediate_conv_window", w);
    p.inter = w.data;
    p.inter_row_stride = w.stride[0];
    p.inter_step_stride = w.stride[1];
    p.inter_dim_stride = w.stride[2];
    p.inter_win_stride = w.stride[3];
    p.inter_rows = w.shape[0];
    if (args.intermediate_state_indices)
      p.inter_indices =
          conv_index_vector(c, "intermediate_state_indices", *args.intermediate_state_indices, B);
  }
  if (tree) {
    if (!args.retrieve_next_token || !args.retrieve_next_sibling || !args.retrieve_parent_token)
      fail(
          "`retrieve_next_token`, `retrieve_next_sibling` and `retrieve_parent_token` go together "
          "(the EAGLE tree's child and sibling tables and the parents the op writes).");
    p.next_token = conv_index_table(c, "retrieve_next_token", *args.retrieve_next_token, B, T);
    p.next_sibling =
        conv_index_table(c, "retrieve_next_sibling", *args.retrieve_next_sibling, B, T);
    const IndexTable parents =
        conv_index_table(c, "retrieve_parent_token", *args.retrieve_parent_token, B, T);
    p.parent_out = args.retrieve_parent_token->data;
    p.parent_dtype = parents.dtype;
    p.parent_row_stride = parents.row_stride;
    p.parent_col_stride = parents.col_stride;
    if (T > kMaxTreeTokens)
      throw Error(ErrorKind::not_implemented,
                  format("causal_conv1d_update supports trees of up to %d draft tokens (got "
                         "seqlen=%lld)",
                         kMaxTreeTokens, static_cast<long long>(T)));
  }
}

// Every speculative entry a CPU call follows, checked before anything is written.
void check_conv_verify_host(const ConvUpdateProblem& p) {
  int parent[kMaxTreeTokens];
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t entry = p.indices ? p.indices[b] : b;
    if (entry < 0) continue;  // padded row
    const ConvVerifyRow r = conv_verify_row(p, b, parent);
    if (r.kind == kErrStep && p.num_accept.ptr &&
        (p.num_accept.at(b, 0) < 1 || p.num_accept.at(b, 0) > p.accept_limit))
      fail(
          format("`num_accept_tokens`[%lld]=%lld is outside [1, %lld] (the window's first entry "
                 "is num_accept_tokens - 1 of a conv_state of %d entries)",
                 static_cast<long long>(b), static_cast<long long>(r.value),
                 static_cast<long long>(p.accept_limit), p.state.state_len));
    if (r.kind == kErrRow)
      fail(
          format("`intermediate_state_indices`[%lld]=%lld is out of range for an "
                 "intermediate_conv_window of %lld rows (valid: 0..%lld; < 0 stores no window)",
                 static_cast<long long>(b), static_cast<long long>(r.value),
                 static_cast<long long>(p.inter_rows), static_cast<long long>(p.inter_rows - 1)));
    if (r.kind == kErrStep) {
      const int64_t t = r.value, child = p.next_token.at(b, t);
      const bool bad_child = child != -1 && (child <= t || child >= p.T);
      fail(format("`%s`[%lld, %lld]=%lld must name a later draft token (%lld..%d) or be -1",
                  bad_child ? "retrieve_next_token" : "retrieve_next_sibling",
                  static_cast<long long>(b), static_cast<long long>(t),
                  static_cast<long long>(bad_child ? child : p.next_sibling.at(b, t)),
                  static_cast<long long>(t + 1), p.T - 1));
    }
  }
}

}  // namespace

ConvUpdateProblem validate_conv_update(const CausalConv1dUpdateArgs& args) {
  const TensorView& x = args.x;
  const TensorView& st = args.conv_state;
  const TensorView& out = args.out;
  Contract c;
  if (x.ndim != 2 && x.ndim != 3)
    fail(format("`x` must have shape [batch, dim] or [batch, dim, seqlen] (got %s).",
                shape_str(x).c_str()));
  c.floating("x", x);
  c.device("x", x);
  if (st.ndim != 3)
    fail(
        format("`conv_state` must be a 3D tensor [batch, dim, state_len] (got ndim=%d).", st.ndim));
  if (st.dtype != x.dtype)
    fail(format("`conv_state` must have the dtype of `x` (%s; got %s).", dtype_name(x.dtype),
                dtype_name(st.dtype)));
  c.device("conv_state", st);
  const int64_t B = x.shape[0], dim = x.shape[1], T = x.ndim == 3 ? x.shape[2] : 1;
  ConvUpdateProblem p;
  p.conv = check_conv_params(c, args.weight, args.bias, dim, args.silu, "weight", "bias");
  const int64_t state_len = st.shape[2];
  if (state_len < p.conv.width - 1)
    fail(format("`conv_state` must have state_len >= width - 1 = %d (got %lld).", p.conv.width - 1,
                static_cast<long long>(state_len)));
  if (args.conv_state_indices) {
    const TensorView& idx = *args.conv_state_indices;
    c.dtype("conv_state_indices", idx, {DType::i32});
    c.device("conv_state_indices", idx);
    if (idx.ndim != 1 || idx.shape[0] != B)
      fail(format("`conv_state_indices` must have shape [batch]=(%lld) (got %s).",
                  static_cast<long long>(B), shape_str(idx).c_str()));
    if (B > 1 && idx.stride[0] != 1) {
      fail("`conv_state_indices` must be contiguous." + strides_detail("conv_state_indices", idx));
    }
    if (st.shape[1] != dim)
      fail(format("`conv_state` must have shape [entries, dim, state_len] with dim=%lld (got %s).",
                  static_cast<long long>(dim), shape_str(st).c_str()));
    p.indices = static_cast<const int32_t*>(idx.data);
  } else if (st.shape[0] != B || st.shape[1] != dim) {
    fail(format("`conv_state` must have shape [batch, dim, state_len]=(%lld, %lld, %lld) (got %s).",
                static_cast<long long>(B), static_cast<long long>(dim),
                static_cast<long long>(state_len), shape_str(st).c_str()));
  }
  if (args.cache_seqlens) {
    const TensorView& cs = *args.cache_seqlens;
    c.dtype("cache_seqlens", cs, {DType::i32});
    c.device("cache_seqlens", cs);
    if (cs.ndim != 1 || cs.shape[0] != B)
      fail(format("`cache_seqlens` must have shape [batch]=(%lld) (got %s).",
                  static_cast<long long>(B), shape_str(cs).c_str()));
    if (B > 1 && cs.stride[0] != 1)
      fail("`cache_seqlens` must be contiguous." + strides_detail("cache_seqlens", cs));
    p.cache_seqlens = static_cast<const int32_t*>(cs.data);
  }
  check_conv_verify(c, args, p, B, dim, T, state_len);
  if (out.ndim != x.ndim || out.shape[0] != B || out.shape[1] != dim ||
      (x.ndim == 3 && out.shape[2] != T) || out.dtype != x.dtype)
    fail(format("`out` must have the shape %s and dtype %s of `x` (got %s, %s).",
                shape_str(x).c_str(), dtype_name(x.dtype), shape_str(out).c_str(),
                dtype_name(out.dtype)));
  c.device("out", out);
  c.check_devices("causal_conv1d_update: all tensors must be on the same device", true);

  const bool on_cpu = c.common_device().type == DeviceType::cpu;
  const bool check = args.check_indices.value_or(on_cpu);
  if (!on_cpu && dim >= (int64_t{1} << 23))  // the CUDA grid: 128-channel blocks on grid.y
    throw Error(ErrorKind::not_implemented,
                format("causal_conv1d_update on CUDA supports dim < 8388608 (got %lld)",
                       static_cast<long long>(dim)));
  if (on_cpu && check && p.indices)
    check_slot_indices_host("conv_state_indices", p.indices, DType::i32, B, 1, st.shape[0]);

  p.B = static_cast<int32_t>(B);
  p.dim = static_cast<int32_t>(dim);
  p.T = static_cast<int32_t>(T);
  p.x = x.data;
  p.x_dtype = x.dtype;
  p.x_batch_stride = x.stride[0];
  p.x_dim_stride = x.stride[1];
  p.x_tok_stride = x.ndim == 3 ? x.stride[2] : 0;
  p.out = out.data;
  p.out_dtype = out.dtype;
  p.out_batch_stride = out.stride[0];
  p.out_dim_stride = out.stride[1];
  p.out_tok_stride = out.ndim == 3 ? out.stride[2] : 0;
  p.state = conv_window(st, 0);
  p.check_indices = check;
  if (on_cpu && check && p.speculative()) check_conv_verify_host(p);
  p.pdl = args.pdl;
  p.device = c.common_device();
  return p;
}

}  // namespace deltastate::detail
