// fused_decode_step on CUDA: launch and dispatch of the fused decode layer step's kernels, state
// dtype and K as template parameters. The cluster kernel (src/cuda/fused_decode_step/cluster.cuh:
// one thread-block cluster per (row, key head), one or two row tiles per warp) runs the small
// batches (fused_cluster_pays, tuning.h) whose key head's rows fit a cluster of
// kFusedClusterMaxCtas CTAs of kFusedClusterMaxWarps warps; the others run the CTA kernel
// (src/cuda/fused_decode_step/kernel.cuh: one CTA per (row, key head), one or two row tiles per
// warp, two when the group has more than kFusedMaxWarps tiles), or, where the caller gives a
// workspace, the chain plan (src/cuda/fused_decode_step/chain.cuh: the conv, packed decode and
// norm kernels in sequence), which is faster than the CTA kernel there. DELTASTATE_CUDA_FUSED=
// cta|cluster|chain forces one (tuning.h). ReplaySSM calls run
// src/cuda/fused_decode_step/replay.cuh's kernel (the CTA kernel's structure with
// replayssm_decode's step, no workspace), or under DELTASTATE_CUDA_FUSED=chain the ReplaySSM
// chain (chain.cuh: the conv, replayssm_decode's and the norm kernels through the workspace).
// A quantized or stochastically rounded pool runs the chain plan (plain mode) or the ReplaySSM
// chain (ReplaySSM mode) whatever DELTASTATE_CUDA_FUSED says: their decode links are the recurrent
// op's and replayssm_decode's formatted paths, which store the codes (and scales) and advance the
// rounding step counter once after their grid.
// The validator limits K to {64, 128} and (HV/H)*V to 256 rows.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "api/backend.h"
#include "core/problem.h"
#include "cuda/fused_decode_step/chain.cuh"
#include "cuda/fused_decode_step/cluster.cuh"
#include "cuda/fused_decode_step/kernel.cuh"
#include "cuda/fused_decode_step/replay.cuh"
#include "cuda/launch.h"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

namespace {

template <class StateT, int K, int TPW>
void launch_fused(const FusedStepProblem& p, cudaStream_t stream, int warps) {
  const dim3 grid(static_cast<unsigned>(p.B), static_cast<unsigned>(p.H));
  const int64_t ctas = static_cast<int64_t>(p.B) * p.H;
  const size_t smem = static_cast<size_t>(fused_smem_floats(p)) * sizeof(float);
  const int resident = kFusedMaxWarps / warps > 0 ? kFusedMaxWarps / warps : 1;
  launch_kernel(fused_decode_step_kernel<StateT, K, TPW>, grid, warps * 32, smem, stream, p.pdl,
                with_pdl_trigger(p, ctas, resident));
}

// The ReplaySSM kernel (replay.cuh), one CTA per (row, key head) as launch_fused. Its shared
// memory grows with the ring: opted in beyond 48 KB (once per device), and a ring the GPU's
// per-block maximum does not hold is rejected before the launch.
template <class StateT, int K, int TPW>
void launch_replay(const FusedStepProblem& p, cudaStream_t stream, int warps) {
  // The key heads of a row count themselves in the cursor's high 16 bits (advance_row_cursor),
  // which must not reach the sign bit.
  if (p.H >= (1 << 15))
    throw Error(ErrorKind::not_implemented,
                "fused_decode_step: H must stay below 2^15 for the in-kernel cursor advance");
  const size_t smem = static_cast<size_t>(fused_replay_smem(p).floats) * sizeof(float);
  const int max_smem = max_smem_optin(p.device.index);
  if (smem > static_cast<size_t>(max_smem))
    throw Error(ErrorKind::not_implemented,
                "fused_decode_step: ReplaySSM ring length L=" + std::to_string(p.replay.L) +
                    " needs more shared memory than this GPU offers");
  if (smem > 48 * 1024) {
    static PerDeviceOnce opted;
    opted.get(p.device.index, [&p, max_smem] {
      DS_CUDA_CHECK(cudaFuncSetAttribute(fused_replay_step_kernel<StateT, K, TPW>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem));
      return 1;
    });
  }
  const dim3 grid(static_cast<unsigned>(p.B), static_cast<unsigned>(p.H));
  const int64_t ctas = static_cast<int64_t>(p.B) * p.H;
  const int resident = kFusedMaxWarps / warps > 0 ? kFusedMaxWarps / warps : 1;
  launch_kernel(fused_replay_step_kernel<StateT, K, TPW>, grid, warps * 32, smem, stream, p.pdl,
                with_pdl_trigger(p, ctas, resident));
}

// The cluster split of a key head's rows (FusedCluster) with TPW row tiles per warp, or false
// where none fits: at most kFusedClusterMaxCtas / group CTAs per value head, each the fewest row
// tiles that reach all of them in that many CTAs, and no CTA without rows.
template <class StateT, int K>
bool fused_cluster_shape(const FusedStepProblem& p, int tpw, FusedCluster& fc) {
  constexpr int kRows = RowLayout<StateT, K>::RG * RowLayout<StateT, K>::ROWS;
  const int group = p.HV / p.H;
  if (group > kFusedClusterMaxCtas) return false;
  const int tiles_per_head = (p.V + kRows - 1) / kRows;
  const int most = kFusedClusterMaxCtas / group;
  const int tiles_per_cta = (tiles_per_head + most - 1) / most;
  fc.warps = (tiles_per_cta + tpw - 1) / tpw;
  if (fc.warps > kFusedClusterMaxWarps) return false;
  fc.tiles = (tiles_per_head + fc.warps * tpw - 1) / (fc.warps * tpw);
  fc.ctas = group * fc.tiles;
  const int chunk = (2 * K + fc.ctas - 1) / fc.ctas;
  fc.qk_chunk = (chunk + 7) / 8 * 8;
  return true;
}

template <class StateT, int K, int TPW>
void launch_cluster(const FusedStepProblem& p, cudaStream_t stream, const FusedCluster& fc) {
  constexpr int kRows = RowLayout<StateT, K>::RG * RowLayout<StateT, K>::ROWS;
  const dim3 grid(static_cast<unsigned>(p.B) * static_cast<unsigned>(fc.ctas),
                  static_cast<unsigned>(p.H));
  const int64_t ctas = static_cast<int64_t>(p.B) * p.H * fc.ctas;
  const size_t smem = fused_cluster_smem_bytes<StateT, K, kRows, TPW>(fc);
  const int resident = kFusedClusterCtasPerSm * kFusedClusterMaxWarps / fc.warps;
  launch_cluster_kernel(fused_decode_step_cluster_kernel<StateT, K, TPW>, grid, fc.warps * 32, smem,
                        stream, p.pdl, static_cast<unsigned>(fc.ctas),
                        with_pdl_trigger(p, ctas, resident), fc);
}

// The cluster kernel where a cluster holds the key head's rows; false elsewhere. One tile per
// warp unless DELTASTATE_CUDA_FUSED_TPW=2 asks for two, the packed decode kernel's shape from a
// few waves up (the second tile shares the token's preparation and doubles the state in flight
// per warp), which the fused kernel does not take by itself: at the 80-register cap its tile
// loop spills a few registers.
template <class StateT, int K>
bool launch_cluster_k(const FusedStepProblem& p, cudaStream_t stream) {
  FusedCluster fc{};
  if (forced_fused_tiles_per_warp() == 2 && fused_cluster_shape<StateT, K>(p, 2, fc))
    return launch_cluster<StateT, K, 2>(p, stream, fc), true;
  if (!fused_cluster_shape<StateT, K>(p, 1, fc)) return false;
  launch_cluster<StateT, K, 1>(p, stream, fc);
  return true;
}

// Whether launch_cluster_k finds a cluster shape for the key head's rows.
template <class StateT, int K>
bool cluster_fits(const FusedStepProblem& p) {
  FusedCluster fc{};
  return (forced_fused_tiles_per_warp() == 2 && fused_cluster_shape<StateT, K>(p, 2, fc)) ||
         fused_cluster_shape<StateT, K>(p, 1, fc);
}

// The plan of a call (`workspace`: whether the caller gives one). A ReplaySSM call: its chain
// where a workspace is given or DELTASTATE_CUDA_FUSED=chain forces it, else its one-launch kernel
// (which DELTASTATE_CUDA_FUSED=cta or =cluster forces). Otherwise the cluster kernel where it
// pays and fits; else the chain where a workspace is given; else the CTA kernel;
// DELTASTATE_CUDA_FUSED forces one of these three (a forced cluster that does not fit runs the
// CTA kernel). A forced chain is the chain
// with or without a workspace: launch_k refuses it without one. fused_decode_step_workspace_bytes
// asks the same function.
enum class FusedPlan { replay, replay_chain, cluster, chain, cta };
template <class StateT, int K>
FusedPlan fused_plan(const FusedStepProblem& p, bool workspace) {
  const FusedChoice forced = forced_fused_kernel();
  // SGLang's ring modes run only in the chain (replayssm_decode's ring-modes kernel as its decode;
  // the one-launch kernel has the basic ring only), whatever DELTASTATE_CUDA_FUSED says.
  const detail::ReplayModes& rm = p.replay.modes;
  if (p.is_replay() && (rm.circular || rm.prefix_gates || rm.predecayed_k))
    return FusedPlan::replay_chain;
  // A checkpoint in its storage format (quantized, or stochastically rounded): the ReplaySSM
  // chain, whatever DELTASTATE_CUDA_FUSED says (its decode is replayssm_decode's formatted
  // kernels; the one-launch kernel has no formatted state I/O).
  if (p.is_replay() && p.state.formatted()) return FusedPlan::replay_chain;
  if (p.is_replay()) {
    // The ReplaySSM chain by default where a workspace is given: faster than the one-launch
    // kernel at every batch measured (bench/results/layer-step-chain-h200.json; the workspace
    // query follows the plan).
    const bool chain =
        forced == FusedChoice::chain || (forced == FusedChoice::automatic && workspace);
    return chain ? FusedPlan::replay_chain : FusedPlan::replay;
  }
  // A pool in its storage format (quantized, or stochastically rounded): the chain, whatever
  // DELTASTATE_CUDA_FUSED says (its packed decode is the recurrent op's formatted paths; the
  // one-launch kernels have no formatted state I/O).
  if (p.state.formatted()) return FusedPlan::chain;
  const bool cluster =
      forced == FusedChoice::cluster ||
      (forced == FusedChoice::automatic &&
       fused_cluster_pays(static_cast<int64_t>(p.B) * p.H, num_sms(p.device.index)));
  if (cluster && cluster_fits<StateT, K>(p)) return FusedPlan::cluster;
  if (forced == FusedChoice::chain || (forced == FusedChoice::automatic && workspace))
    return FusedPlan::chain;
  return FusedPlan::cta;
}

template <class StateT, int K>
void launch_k(const FusedStepProblem& p, cudaStream_t stream) {
  const FusedPlan plan = fused_plan<StateT, K>(p, p.workspace != nullptr);
  if (plan == FusedPlan::cluster && launch_cluster_k<StateT, K>(p, stream)) return;
  if (plan == FusedPlan::chain || plan == FusedPlan::replay_chain) {
    const int64_t need = fused_chain_workspace_bytes(p);
    const detail::ReplayModes& rm = p.replay.modes;
    if (!p.workspace && (rm.circular || rm.prefix_gates || rm.predecayed_k))
      throw Error(ErrorKind::value,
                  "fused_decode_step: SGLang's ring modes on CUDA run the ReplaySSM chain (the "
                  "conv, replayssm_decode, the norm), which needs a `workspace` of " +
                      std::to_string(need) +
                      " bytes (fused_decode_step_workspace_bytes); none was given");
    if (!p.workspace && p.state.formatted())  // the validator raises first; a direct caller here
      throw Error(ErrorKind::not_implemented,
                  std::string("fused_decode_step: a quantized or stochastically rounded state on "
                              "CUDA runs the ") +
                      (plan == FusedPlan::replay_chain ? "ReplaySSM chain" : "chain plan") +
                      ", which needs a `workspace` of " + std::to_string(need) +
                      " bytes (fused_decode_step_workspace_bytes); none was given");
    if (!p.workspace)
      throw Error(ErrorKind::value,
                  "fused_decode_step: DELTASTATE_CUDA_FUSED=chain needs a `workspace` of " +
                      std::to_string(need) +
                      " bytes (fused_decode_step_workspace_bytes); none was given");
    if (p.workspace_bytes < need)  // the entry point checks it first; a direct caller here too
      throw Error(ErrorKind::value, "`workspace` has " + std::to_string(p.workspace_bytes) +
                                        " bytes; fused_decode_step needs " + std::to_string(need) +
                                        " (fused_decode_step_workspace_bytes)");
    if (plan == FusedPlan::replay_chain) return run_fused_replay_chain(p, stream);
    return run_fused_chain(p, stream);
  }
  constexpr int kRows = RowLayout<StateT, K>::RG * RowLayout<StateT, K>::ROWS;
  const int tiles = (p.HV / p.H) * ((p.V + kRows - 1) / kRows);
  if (tiles > 2 * kFusedMaxWarps)  // the validator's (HV/H)*V <= 256 keeps this unreachable
    throw Error(ErrorKind::not_implemented, "fused_decode_step: too many rows per key head");
  if (plan == FusedPlan::replay) {
    if (tiles > kFusedMaxWarps) return launch_replay<StateT, K, 2>(p, stream, (tiles + 1) / 2);
    return launch_replay<StateT, K, 1>(p, stream, tiles);
  }
  if (tiles > kFusedMaxWarps) return launch_fused<StateT, K, 2>(p, stream, (tiles + 1) / 2);
  launch_fused<StateT, K, 1>(p, stream, tiles);
}

template <class StateT>
void dispatch(const FusedStepProblem& p, cudaStream_t stream) {
#if DELTASTATE_CUDA_ALL_KERNELS
  if (p.K == 64) return launch_k<StateT, 64>(p, stream);
#endif
  if (p.K == 128) return launch_k<StateT, 128>(p, stream);
  throw Error(ErrorKind::not_implemented,
              "fused_decode_step: K=" + std::to_string(p.K) +
                  " is not compiled in this build (DELTASTATE_CUDA_ALL_KERNELS=OFF: K = 128 only)");
}

// The plan's workspace for K (the row layouts of every K the validator allows, compiled or not).
template <class StateT>
int64_t workspace_bytes_of(const FusedStepProblem& p) {
  FusedPlan plan = FusedPlan::cta;
  if (p.K == 128) plan = fused_plan<StateT, 128>(p, true);
  else if (p.K == 64) plan = fused_plan<StateT, 64>(p, true);
  else return 0;  // the validator rejects other K on CUDA
  return plan == FusedPlan::chain || plan == FusedPlan::replay_chain
             ? fused_chain_workspace_bytes(p)
             : 0;
}

}  // namespace

int64_t fused_decode_step_workspace_bytes(const FusedStepProblem& p) {
  return with_state_type(p.state.dtype,
                         [&](auto state) { return workspace_bytes_of<decltype(state)>(p); });
}

void run_fused_decode_step(const FusedStepProblem& problem, void* stream) {
  DeviceGuard guard(problem.device.index);
  FusedStepProblem p = problem;
  p.errors = device_errors(p.device.index);  // where the kernel records a bad row (errors.cu)
  auto s = static_cast<cudaStream_t>(stream);
  with_state_type(p.state.dtype, [&](auto state) { dispatch<decltype(state)>(p, s); });
}

}  // namespace deltastate::cuda_backend
