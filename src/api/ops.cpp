// Public op entry points: validate (src/contracts), then run on the tensors' device.
#include "deltastate/ops.h"

#include "api/backend.h"
#include "contracts/contract.h"
#include "contracts/validate.h"
#include "cpu/kernels.h"

namespace deltastate {

namespace {

// A CUDA launch; with check_indices the documented debug mode: synchronize and check_errors.
template <class Problem>
void run_cuda_checked(const Problem& p, Stream stream, void (*launch)(const Problem&, void*)) {
  launch(p, stream);
  if (p.check_indices) cuda_backend::check_errors_after_op(stream);
}

void run(const detail::RecurrentProblem& p, Stream stream) {
  if (p.N == 0) return;
  if (p.device.type == DeviceType::cpu) cpu::run_recurrent(p);
  else run_cuda_checked(p, stream, cuda_backend::run_recurrent);
}

}  // namespace

void gdn_packed_decode(const PackedDecodeArgs& args) {
  run(detail::validate_packed_decode(args, /*kda=*/false), args.stream);
}

void kda_packed_decode(const PackedDecodeArgs& args) {
  run(detail::validate_packed_decode(args, /*kda=*/true), args.stream);
}

void recurrent_gdn(const RecurrentArgs& args) {
  run(detail::validate_recurrent(args, /*kda=*/false), args.stream);
}

void recurrent_kda(const RecurrentArgs& args) {
  run(detail::validate_recurrent(args, /*kda=*/true), args.stream);
}

void replayssm_decode(const ReplayDecodeArgs& args) {
  const detail::ReplayProblem p = detail::validate_replayssm_decode(args);
  if (p.B == 0) return;
  if (p.device.type == DeviceType::cpu) cpu::run_replayssm_decode(p);
  else run_cuda_checked(p, args.stream, cuda_backend::run_replayssm_decode);
}

// Speculative verify and its commits (states, conv windows).
void verify(const VerifyArgs& args) {
  const detail::VerifyProblem p = detail::validate_verify(args);
  if (p.r.N == 0) return;
  if (p.r.device.type == DeviceType::cpu) {
    cpu::run_verify(p);
    return;
  }
  cuda_backend::run_verify(p, args.stream);
  if (p.r.check_indices) cuda_backend::check_errors_after_op(args.stream);
}

void update_state_after_verify(const CommitArgs& args) {
  const detail::CommitProblem p = detail::validate_commit(args);
  if (p.B == 0) return;
  if (p.device.type == DeviceType::cpu) cpu::run_commit(p);
  else run_cuda_checked(p, args.stream, cuda_backend::run_commit);
}

void update_conv_state_after_verify(const ConvCommitArgs& args) {
  const detail::CommitProblem p = detail::validate_conv_commit(args);
  if (p.B == 0 || p.head_elems == 0) return;
  if (p.device.type == DeviceType::cpu) cpu::run_commit(p);
  else run_cuda_checked(p, args.stream, cuda_backend::run_commit);
}

void check_errors(Stream stream) { cuda_backend::check_errors(stream); }

bool cuda_available() { return cuda_backend::device_available(); }
bool cuda_built() { return cuda_backend::built(); }

int64_t chunk_prefill_workspace_bytes(const ChunkPrefillArgs& args) {
  if (args.q.ndim != 4 || args.v.ndim != 4) {  // the validator's first checks, same texts
    detail::Contract c;
    c.shape("q", args.q, {"B", "T", "H", "K"});
    c.shape("v", args.v, {"B", "T", "HV", "V"});
  }
  const int K = static_cast<int>(args.q.shape[3]), V = static_cast<int>(args.v.shape[3]);
  if (args.q.device.type != DeviceType::cpu) {
    int64_t N = args.q.shape[0];
    if (args.cu_seqlens && args.cu_seqlens->ndim == 1)
      N = args.cu_seqlens->shape[0] > 0 ? args.cu_seqlens->shape[0] - 1 : 0;
    const int64_t tokens = args.q.shape[0] * args.q.shape[1];
    return cuda_backend::chunk_prefill_workspace_bytes(K, V, N, args.v.shape[2], tokens,
                                                       args.is_kda, args.q.device.index);
  }
  return cpu::chunk_prefill_workspace_bytes(K, V, args.is_kda);
}

void chunk_prefill(const ChunkPrefillArgs& args) {
  const detail::ChunkPrefillProblem p =
      detail::validate_chunk_prefill(args, chunk_prefill_workspace_bytes(args));
  if (p.N == 0) return;
  if (p.device.type == DeviceType::cpu) cpu::run_chunk_prefill(p);
  else run_cuda_checked(p, args.stream, cuda_backend::run_chunk_prefill);
}

// ---- the conv update and the fused decode layer step -------------------------------------------
void causal_conv1d_update(const CausalConv1dUpdateArgs& args) {
  const detail::ConvUpdateProblem p = detail::validate_conv_update(args);
  if (p.B == 0 || p.dim == 0) return;
  if (p.device.type == DeviceType::cpu) cpu::run_conv_update(p);
  else run_cuda_checked(p, args.stream, cuda_backend::run_conv_update);
}

namespace {
void run_fused(const detail::FusedStepProblem& p, Stream stream) {
  if (p.B == 0) return;
  if (p.device.type == DeviceType::cpu) return cpu::run_fused_decode_step(p);
  detail::check_fused_step_workspace(p, cuda_backend::fused_decode_step_workspace_bytes(p));
  run_cuda_checked(p, stream, cuda_backend::run_fused_decode_step);
}
}  // namespace

int64_t fused_decode_step_workspace_bytes(const FusedDecodeStepArgs& args) {
  const TensorView& x = args.mixed_qkv;
  const TensorView& st = args.state;
  if (x.ndim != 2 || st.ndim != 4)  // the shapes it reads, before the validator's own checks
    detail::fail(detail::format(
        "fused_decode_step_workspace_bytes needs `mixed_qkv` [B, conv_dim] and `initial_state` "
        "[slots, HV, V, K] (got shapes %s and %s)",
        shape_str(x).c_str(), shape_str(st).c_str()));
  if (st.device.type == DeviceType::cpu) return 0;  // the CPU runs no plan with a workspace
  detail::FusedStepProblem p;
  // ReplaySSM mode (d_cache given): the plan asks only whether it is on (its one-launch kernel
  // needs no workspace, its chain the plain chain's); the rings' sizes change neither.
  if (args.d_cache) p.replay.L = 1;
  // SGLang's ring modes run the chain on CUDA: its workspace whatever DELTASTATE_CUDA_FUSED says
  // (prefix gates without circular rings count for KDA only; the query reads no `is_kda`, so it
  // may answer the chain's bytes for a GDN call the plan runs without them).
  p.replay.modes.circular = args.circular_replay;
  p.replay.modes.prefix_gates = args.prefix_gate_cache;
  p.replay.modes.predecayed_k = args.predecayed_k_cache;
  p.HV = static_cast<int32_t>(st.shape[1]);
  p.V = static_cast<int32_t>(st.shape[2]);
  p.K = static_cast<int32_t>(st.shape[3]);
  const int64_t qk = x.shape[1] - st.shape[1] * st.shape[2];  // 2*H*K
  if (p.K <= 0 || qk <= 0 || qk % (2 * p.K) != 0) return 0;   // a shape the validator rejects
  p.H = static_cast<int32_t>(qk / (2 * p.K));
  if (p.HV % p.H != 0) return 0;
  p.B = static_cast<int32_t>(x.shape[0]);
  p.x_dtype = x.dtype;
  p.state.dtype = st.dtype;
  // a stochastically rounded pool runs the chain plan (as a quantized one, by its dtype)
  p.state.stochastic = rounds_stochastically(st.dtype, args.state_format.rounding);
  p.device = st.device;
  return cuda_backend::fused_decode_step_workspace_bytes(p);
}

void gdn_fused_decode_step(const FusedDecodeStepArgs& args) {
  run_fused(detail::validate_fused_decode_step(args, /*kda=*/false), args.stream);
}

void kda_fused_decode_step(const FusedDecodeStepArgs& args) {
  run_fused(detail::validate_fused_decode_step(args, /*kda=*/true), args.stream);
}

// ---- ReplaySSM speculative verify and its cursor commit -----------------------------------------
void replayssm_verify(const ReplayVerifyArgs& args) {
  const detail::ReplayVerifyProblem p = detail::validate_replayssm_verify(args);
  if (p.r.N == 0) return;
  if (p.r.device.type == DeviceType::cpu) {
    cpu::run_replayssm_verify(p);
    return;
  }
  cuda_backend::run_replayssm_verify(p, args.stream);
  if (p.r.check_indices) cuda_backend::check_errors_after_op(args.stream);
}

void replayssm_commit(const ReplayCommitArgs& args) {
  const detail::ReplayCommitProblem p = detail::validate_replayssm_commit(args);
  if (p.B == 0) return;
  if (p.device.type == DeviceType::cpu) cpu::run_replayssm_commit(p);
  else run_cuda_checked(p, args.stream, cuda_backend::run_replayssm_commit);
}

void replayssm_reset_cursors(const ReplayResetArgs& args) {
  const detail::ReplayResetProblem p = detail::validate_replayssm_reset_cursors(args);
  if (p.B == 0) return;
  if (p.device.type == DeviceType::cpu) cpu::run_replayssm_reset_cursors(p);
  else run_cuda_checked(p, args.stream, cuda_backend::run_replayssm_reset_cursors);
}

void replayssm_fold_commit(const ReplayFoldArgs& args) {
  const detail::ReplayFoldProblem p = detail::validate_replayssm_fold_commit(args);
  if (p.B == 0 || p.layers == 0) return;
  if (p.device.type == DeviceType::cpu) cpu::run_replayssm_fold_commit(p);
  else run_cuda_checked(p, args.stream, cuda_backend::run_replayssm_fold_commit);
}

void replayssm_circular_commit(const ReplayCircularCommitArgs& args) {
  const detail::ReplayCircularProblem p = detail::validate_replayssm_circular_commit(args);
  if (p.B == 0 || p.layers == 0) return;
  if (p.device.type == DeviceType::cpu) cpu::run_replayssm_circular_commit(p);
  else run_cuda_checked(p, args.stream, cuda_backend::run_replayssm_circular_commit);
}

}  // namespace deltastate
