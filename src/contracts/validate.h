// One validator per op: every check of the op's contract, in one place, run before any memory is
// written. Each returns the backend-neutral problem the kernels run.
#pragma once

#include <optional>

#include "contracts/contract.h"
#include "core/problem.h"
#include "deltastate/ops.h"

namespace deltastate::detail {

RecurrentProblem validate_packed_decode(const PackedDecodeArgs& args, bool kda);

// The state's storage format (state_format.cpp): a quantized state (float8_e4m3fn / int8) needs
// its `state_scales` [slots, HV, V] fp32 (inner strides (V, 1)); scales for a float state,
// stochastic rounding of an fp32 state, or a missing / malformed `rounding_step` are errors; an
// op whose kernels do not take quantized states (`op_takes_quantized` false) raises
// NotImplementedError. Registers the tensors' devices in `c`; fills ref's format fields.
// `state` is [slots, HV, V, K] or (the commit) [layers, slots, HV, V, K], the scales then
// [layers, slots, HV, V]; `step_count` the counters `rounding_step` must hold (one per layer).
void check_state_format(Contract& c, const char* op, const char* state_name,
                        const TensorView& state, const StateFormatArgs& f, bool op_takes_quantized,
                        StatePoolRef& ref, int64_t step_count = 1);
// A verify scratch `intermediate_states` [lead dims..., N_scr, T_alloc, HV, V, K] (its shape
// checked by the caller) against the pool `state`: a float scratch has the state's dtype, or any
// float dtype with a quantized state; a quantized one (float8_e4m3fn / int8) serves a quantized
// state only (NotImplementedError otherwise) and needs `intermediate_state_scales`
// [lead dims..., N_scr, T_alloc, HV, V] fp32 (inner strides (V, 1)); scales for a float scratch
// are an error. Registers the scales' device in `c`; returns them (null: a float scratch).
const TensorView* check_scratch_format(Contract& c, const char* op, const TensorView& scratch,
                                       const std::optional<TensorView>& scales,
                                       const TensorView& state);
// After every other check: the CUDA backend takes neither quantized states nor stochastic
// rounding yet (NotImplementedError), except in the ops that say so (`cuda_built`: packed decode
// and the recurrent op, on the direct kernel's formatted-state twin; verify and the state commit,
// on verify/fmt.cuh's kernels; ReplaySSM decode, on replay_fmt_kernel; the chunked prefill, in
// every prefill kernel's state I/O; the fused decode step, on its chain plans).
void check_state_format_backend(const char* op, const StatePoolRef& ref, Device device,
                                bool cuda_built = false);

// SGLang's packed-decode checks with its texts, in its order (`_validate_packed_decode_inputs`);
// shared by packed decode and the Helion ReplaySSM contract. Registers every tensor's device in
// `c`. Returns the sizes they give.
struct PackedSizes {
  int64_t B, H, HV, K, V;
};
PackedSizes check_packed_inputs(Contract& c, const TensorView& mixed_qkv, const TensorView& a,
                                const TensorView& b, const TensorView& A_log,
                                const TensorView& dt_bias, const TensorView& state,
                                const TensorView& out, const TensorView& state_indices, bool kda);

// scale: K^-0.5 when unset, else finite and > 0.
double checked_scale(const std::optional<double>& scale, int64_t K);
RecurrentProblem validate_recurrent(const RecurrentArgs& args, bool kda);
ReplayProblem validate_replayssm_decode(const ReplayDecodeArgs& args);
// The ring length L from d_cache [S, HV, L, V] (at least 3 dims, L >= 1), replayssm_decode's
// texts.
int64_t replay_ring_length(const TensorView& d_cache, int64_t S, int64_t HV, int64_t V);
// The rings' contiguity, shapes ([S, HV, L, V], [S, H, L, K], [S, HV, L(, K)]) and g's float32,
// with replayssm_decode's texts (shared by replayssm_verify).
void check_replay_rings(const TensorView& d_cache, const TensorView& k_cache,
                        const TensorView& g_cache, int64_t S, int64_t HV, int64_t H, int64_t V,
                        int64_t K, int64_t L, bool kda);
// The rest of replayssm_decode's ReplaySSM checks, shared by the fused decode step's ReplaySSM
// mode, with replayssm_decode's texts: write_pos (and force_flush) contiguous 1-D int32; the
// state indices int32 and every row tensor of length B; the rings' and cursors' devices
// (registered in `c`); the rings' float dtypes; on the host, every live row's cursor inside
// [0, L-1]; the CUDA kernels' ring length limit (not_implemented, naming `op`).
void check_replay_cursor_tensors(const TensorView& write_pos,
                                 const std::optional<TensorView>& force_flush);
void check_replay_rows(const TensorView& state_indices, const TensorView& write_pos,
                       const std::optional<TensorView>& force_flush, int64_t B);
void check_replay_ring_parts(Contract& c, const TensorView& d_cache, const TensorView& k_cache,
                             const TensorView& g_cache, const TensorView& write_pos,
                             const std::optional<TensorView>& force_flush);
void check_replay_ring_dtypes(Contract& c, const TensorView& d_cache, const TensorView& k_cache);
void check_replay_cursors_host(const TensorView& state_indices, int64_t index_stride,
                               const TensorView& write_pos, int64_t B, int64_t L);
void check_replay_cuda_ring(const char* op, int64_t L);
// SGLang's ring modes (ReplayDecodeArgs::circular_replay etc.), shared by the fused decode
// step: `check_replay_cache_base_tensor` right after the cursor tensors' checks (SGLang's order),
// `check_replay_modes` after the row lengths (cache_base's length, the nine predecay texts;
// returns the problem's modes), `check_replay_cache_base_host` with the cursors' host check (each
// live row's base in [0, L-1]).
struct ReplayModeArgs {
  const std::optional<TensorView>* cache_base;
  bool circular, prefix, predecay;
};
void check_replay_cache_base_tensor(const ReplayModeArgs& m);
ReplayModes check_replay_modes(const ReplayModeArgs& m, const TensorView& mixed_qkv,
                               const TensorView& state, const TensorView& d_cache,
                               const TensorView& k_cache, int64_t B, int64_t H, int64_t HV,
                               int64_t L, bool kda, const std::optional<double>& lower_bound);
void check_replay_cache_base_host(const ReplayModes& m, const TensorView& state_indices,
                                  int64_t index_stride, int64_t B, int64_t L);
// `workspace_needed`: chunk_prefill_workspace_bytes of the same arguments.
ChunkPrefillProblem validate_chunk_prefill(const ChunkPrefillArgs& args, int64_t workspace_needed);

// The conv update and the fused decode layer step (conv_update.cpp, fused_decode_step.cpp).
// check_conv_params: weight [dim, width] (width 2..4) and bias [dim] of weight's dtype;
// conv_window: a [slots, dim, state_len] window from channel `first_channel` on.
ConvParams check_conv_params(Contract& c, const TensorView& weight,
                             const std::optional<TensorView>& bias, int64_t dim, bool silu,
                             const char* weight_name, const char* bias_name);
ConvWindowRef conv_window(const TensorView& w, int64_t first_channel);
ConvUpdateProblem validate_conv_update(const CausalConv1dUpdateArgs& args);
FusedStepProblem validate_fused_decode_step(const FusedDecodeStepArgs& args, bool kda);
// A given workspace of fewer than `needed` bytes (fused_decode_step_workspace_bytes of the call)
// is an error naming it; none given runs a plan that needs none.
void check_fused_step_workspace(const FusedStepProblem& p, int64_t needed);
// Speculative verify and its commit (contracts/verify.cpp). `op` names the op in the state
// format's texts (replayssm_verify validates its token inputs and pool through verify's contract).
VerifyProblem validate_verify(const VerifyArgs& args, const char* op = "verify");
CommitProblem validate_commit(const CommitArgs& args);
CommitProblem validate_conv_commit(const ConvCommitArgs& args);

// ReplaySSM speculative verify and its cursor commit (contracts/replayssm_verify.cpp).
ReplayVerifyProblem validate_replayssm_verify(const ReplayVerifyArgs& args);
ReplayCommitProblem validate_replayssm_commit(const ReplayCommitArgs& args);
ReplayResetProblem validate_replayssm_reset_cursors(const ReplayResetArgs& args);
ReplayFoldProblem validate_replayssm_fold_commit(const ReplayFoldArgs& args);
ReplayCircularProblem validate_replayssm_circular_commit(const ReplayCircularCommitArgs& args);

}  // namespace deltastate::detail
