// CUDA launch of ReplaySSM speculative verify and of its cursor commit (replayssm/verify.cuh).
// No allocation, no host synchronization: graph-safe.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "api/backend.h"
#include "core/problem.h"
#include "cuda/launch.h"
#include "cuda/replayssm/fold.cuh"
#include "cuda/replayssm/verify.cuh"
#include "cuda/replayssm/verify_tc.cuh"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

namespace {

template <class StateT>
bool rows_aligned(const detail::ReplayVerifyProblem& p) {
  const int64_t es = static_cast<int64_t>(sizeof(StateT));
  return reinterpret_cast<uintptr_t>(p.r.state.ptr) % 16 == 0 &&
         (p.r.state.slot_stride * es) % 16 == 0 && (p.r.K * es) % 16 == 0;
}

template <class StateT, int KT, bool VEC, int CTAS, int BPC, bool FACTOR>
void launch_shape(const detail::ReplayVerifyProblem& p, cudaStream_t s) {
  constexpr int rows = RvLayout<StateT, KT>::ROWS * BPC;
  const dim3 grid(static_cast<unsigned>(p.r.N), static_cast<unsigned>(p.r.HV),
                  static_cast<unsigned>((p.r.V + rows - 1) / rows));
  constexpr int smem = rv_dynamic_bytes<StateT, KT, VEC, BPC, FACTOR>();
  if constexpr (smem > 0) {  // with the static part past 48 KB: opt in once per device
    static PerDeviceOnce opted;
    opted.get(p.r.device.index, [] {
      DS_CUDA_CHECK(cudaFuncSetAttribute(replay_verify_kernel<StateT, KT, VEC, CTAS, BPC, FACTOR>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      return 1;
    });
  }
  launch_kernel(replay_verify_kernel<StateT, KT, VEC, CTAS, BPC, FACTOR>, grid, kRvWarps * 32, smem,
                s, p.r.pdl, p);
}
// A formatted checkpoint runs on the replay kernel whatever the override (the factored one has
// no formatted path: its register budget stays as it is).
template <class StateT, int KT, bool VEC, int CTAS, int BPC>
void launch_shape(const detail::ReplayVerifyProblem& p, cudaStream_t s) {
  if (replay_verify_choice() == ReplayVerifyChoice::factor && !p.r.state.formatted())
    return launch_shape<StateT, KT, VEC, CTAS, BPC, true>(p, s);
  launch_shape<StateT, KT, VEC, CTAS, BPC, false>(p, s);
}

// The vector kernel's shape: two row blocks per CTA (tuning.h replay_verify_two_blocks, or
// DELTASTATE_CUDA_REPLAY_VERIFY_BPC) where V is a whole number of pairs of blocks, else one, with
// kReplayVerifyCtasPerSm resident (or DELTASTATE_CUDA_REPLAY_VERIFY_CTAS; two blocks: 2, their
// shared memory's limit).
template <class StateT, int KT, bool VEC>
void launch(const detail::ReplayVerifyProblem& p, cudaStream_t s) {
  if constexpr (!VEC) {
    launch_shape<StateT, KT, false, kReplayVerifyGenericCtasPerSm, 1>(p, s);
  } else {
    constexpr int rows = RvLayout<StateT, KT>::ROWS;
    const int forced_bpc = forced_replay_verify_blocks_per_cta();
    const int64_t ctas1 = p.r.N * p.r.HV * ((p.r.V + rows - 1) / rows);
    const bool two =
        forced_bpc ? forced_bpc == 2 : replay_verify_two_blocks(ctas1, num_sms(p.r.device.index));
    if (two && p.r.V % (2 * rows) == 0) return launch_shape<StateT, KT, true, 2, 2>(p, s);
    const int forced = forced_replay_verify_ctas();
    if ((forced ? forced : kReplayVerifyCtasPerSm) == 3)
      return launch_shape<StateT, KT, true, 3, 1>(p, s);
    launch_shape<StateT, KT, true, 2, 1>(p, s);
  }
}

// The tensor-core kernel's shape (verify_tc.cuh): an fp32 checkpoint in 16-byte aligned rows,
// K = 128, V a multiple of its 128 rows, at most kRvTokChunk drafts a sequence (no cu_seqlens:
// the host knows T), a ring that stages in one round, no hi/lo residual ring.
bool tc_shape(const detail::ReplayVerifyProblem& p) {
  return p.r.state.dtype == DType::f32 && !p.r.state.formatted() && rows_aligned<float>(p) &&
         p.r.K == kRvTcK && p.r.V % kRvTcRows == 0 && !p.r.cu_seqlens && p.r.T <= kRvTokChunk &&
         p.L <= rv_rec_chunk<kRvTcK>() && !(p.rawv && !p.beta_ring);
}
void launch_tc(const detail::ReplayVerifyProblem& p, cudaStream_t s) {
  constexpr int kCtas = 2;
  const dim3 grid(static_cast<unsigned>(p.r.N), static_cast<unsigned>(p.r.HV),
                  static_cast<unsigned>(p.r.V / kRvTcRows));
  static PerDeviceOnce opted;
  opted.get(p.r.device.index, [] {
    DS_CUDA_CHECK(cudaFuncSetAttribute(replay_verify_tc_kernel<kCtas>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kRvTcSmemDynamic));
    return 1;
  });
  launch_kernel(replay_verify_tc_kernel<kCtas>, grid, kRvWarps * 32, kRvTcSmemDynamic, s, p.r.pdl,
                p);
}

// The tensor-core kernel where its shape applies and it pays (tuning.h: the ring appends
// between folds) or it is forced; the vector kernel: K = 128 (and K = 64 with every kernel
// built), 16-byte aligned checkpoint rows; else, and for the hi/lo residual ring (its stores kept
// off the vector kernels' register budgets), the generic one (K <= 256, the validator's CUDA limit;
// element accesses). A checkpoint in its storage format: the generic float kernel, whose run-time
// path loads its rows dequantized (no instantiation of its own); its folds are the fold launch's.
template <class StateT>
void dispatch(const detail::ReplayVerifyProblem& p, cudaStream_t s) {
  const bool residual = p.rawv && !p.beta_ring;
  if (p.r.state.formatted()) return launch<float, 256, false>(p, s);
  const ReplayVerifyChoice choice = replay_verify_choice();
  if (tc_shape(p) &&
      (choice == ReplayVerifyChoice::tensor ||
       (choice == ReplayVerifyChoice::automatic && replay_verify_tc_pays(p.r.T, p.L))))
    return launch_tc(p, s);
  if (rows_aligned<StateT>(p) && !residual) {
    if (p.r.K == 128) return launch<StateT, 128, true>(p, s);
#if DELTASTATE_CUDA_ALL_KERNELS
    if (p.r.K == 64) return launch<StateT, 64, true>(p, s);
#endif
  }
  launch<StateT, 256, false>(p, s);
}

}  // namespace

void run_replayssm_verify(const detail::ReplayVerifyProblem& problem, void* stream) {
  DeviceGuard guard(problem.r.device.index);
  detail::ReplayVerifyProblem p = problem;
  p.r.errors = device_errors(p.r.device.index);
  p.r.pdl_trigger_early = false;
  if (p.r.N > 0x7fffffff || p.r.HV > 65535)
    throw Error(ErrorKind::value, "replayssm_verify: too many sequences or heads for one launch");
  auto s = static_cast<cudaStream_t>(stream);
  // The fold launch first, with the exact-raw ring (its fold and the drafts' raw records) or a
  // checkpoint in its storage format (its fold stored through the format, off the verify
  // kernel's register budget).
  if (p.beta_ring || p.r.state.formatted()) {
    const dim3 grid(static_cast<unsigned>(p.r.N), static_cast<unsigned>(p.r.HV),
                    static_cast<unsigned>((p.r.V + kFoldRows - 1) / kFoldRows));
    launch_kernel(replay_exact_fold_kernel, grid, kFoldWarps * 32, 0, s, p.r.pdl, p);
    p.history_folded = true;
  }
  with_state_type(p.r.state.dtype, [&](auto state) { dispatch<decltype(state)>(p, s); });
  // The stochastic key's step: advanced once per call that serves folding rows (an append-only
  // call stores no state), in stream order after the grids (a replayed graph advances it).
  if (p.r.state.stochastic && p.rows != 1)
    launch_kernel(advance_rounding_step, 1u, 1u, 0, s, false, p.r.state.step, 1);
}

void run_replayssm_commit(const detail::ReplayCommitProblem& problem, void* stream) {
  DeviceGuard guard(problem.device.index);
  detail::ReplayCommitProblem p = problem;
  p.errors = device_errors(p.device.index);
  const unsigned blocks = static_cast<unsigned>((p.B + kRvCommitThreads - 1) / kRvCommitThreads);
  launch_kernel(replay_commit_kernel, dim3(blocks), kRvCommitThreads, 0,
                static_cast<cudaStream_t>(stream), p.pdl, p);
}

void run_replayssm_reset_cursors(const detail::ReplayResetProblem& problem, void* stream) {
  DeviceGuard guard(problem.device.index);
  detail::ReplayResetProblem p = problem;
  p.errors = device_errors(p.device.index);
  const unsigned blocks = static_cast<unsigned>((p.B + kRvCommitThreads - 1) / kRvCommitThreads);
  launch_kernel(replay_reset_kernel, dim3(blocks), kRvCommitThreads, 0,
                static_cast<cudaStream_t>(stream), p.pdl, p);
}

void run_replayssm_fold_commit(const detail::ReplayFoldProblem& problem, void* stream) {
  DeviceGuard guard(problem.device.index);
  detail::ReplayFoldProblem p = problem;
  p.errors = device_errors(p.device.index);
  const int64_t heads = static_cast<int64_t>(p.layers) * p.HV;  // validated
  const dim3 grid(static_cast<unsigned>(p.B), static_cast<unsigned>(heads),
                  static_cast<unsigned>((p.V + kFoldRows - 1) / kFoldRows));
  launch_kernel(replay_fold_kernel, grid, kFoldWarps * 32, 0, static_cast<cudaStream_t>(stream),
                p.pdl, p);
}

void run_replayssm_circular_commit(const detail::ReplayCircularProblem& problem, void* stream) {
  DeviceGuard guard(problem.device.index);
  detail::ReplayCircularProblem p = problem;
  p.errors = device_errors(p.device.index);
  const int64_t heads = static_cast<int64_t>(p.layers) * p.HV;  // validated (and L)
  auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(p.B), static_cast<unsigned>(heads),
                  static_cast<unsigned>((p.V + kFoldRows - 1) / kFoldRows));
  launch_kernel(replay_circular_kernel, grid, kFoldWarps * 32, 0, s, p.pdl, p);
  launch_kernel(replay_circular_cursor_kernel, dim3(static_cast<unsigned>((p.B + 255) / 256)), 256,
                0, s, p.pdl, p);
}

}  // namespace deltastate::cuda_backend
