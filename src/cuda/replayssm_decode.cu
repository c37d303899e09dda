// CUDA launch and dispatch of ReplaySSM buffered decode, GDN and KDA. The kernel, its math and
// its work layout: replayssm/decode.cuh; the tuning values: tuning.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "api/backend.h"
#include "core/numeric.h"
#include "core/problem.h"
#include "cuda/launch.h"
#include "cuda/loads.cuh"
#include "cuda/replayssm/decode.cuh"
#include "cuda/replayssm/decode_warp.cuh"
#include "cuda/replayssm/modes.cuh"
#include "cuda/rows.cuh"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

using detail::ReplayProblem;

namespace {

// Row blocks per CTA: 2 on the vector path where the head is a whole number of pairs of 8-warp
// blocks (V a multiple of 2 x 64 rows: Qwen3-Next, Kimi-Linear), the layout fits in shared memory
// and there are at least kReplayTwoBlockWaves one-block CTAs per SM, else 1 (tuning.h, with the
// override DELTASTATE_CUDA_REPLAY_BPC).

// TC: the tensor-core kernel (replay_tc_kernel; BPC = 2, its CTA's 128 rows).
template <class StateT, int KT, bool VEC, class In, int BPC, bool FMT, bool TC = false>
void launch_blocks(const ReplayProblem& p, cudaStream_t stream, int warps, int vblocks,
                   const SmemLayout& sm) {
  const auto kernel = [] {
    if constexpr (TC) return replay_tc_kernel<In>;
    else if constexpr (FMT) return replay_fmt_kernel;
    else return replay_kernel<StateT, KT, VEC, In, BPC>;
  }();
  if (sm.bytes > 48 * 1024) {  // opt in once per device (and instantiation) to the maximum
    static PerDeviceOnce opted;
    opted.get(p.device.index, [&p, kernel] {
      DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         max_smem_optin(p.device.index)));
      return 1;
    });
  }
  dim3 grid(static_cast<unsigned>(p.B), static_cast<unsigned>(p.HV),
            static_cast<unsigned>((vblocks + BPC - 1) / BPC));
  const int64_t ctas = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  launch_kernel(kernel, grid, warps * 32, sm.bytes, stream, p.pdl,
                with_pdl_trigger(p, ctas, FMT ? kReplayFmtCtasPerSm : kReplayCtasPerSm),
                detail::SmallDivider::of(p.HV / p.H));
}

// The one-warp kernel (replay_warp_kernel, kWarpRows rows a CTA): grid (B, HV, V / kWarpRows). A
// template, so that builds without every kernel (no caller instantiates it) do not compile it.
constexpr int kWarpRows = WarpSmem<kWarpMTiles>::kRows;
template <class In, bool KDA>
void launch_warp(const ReplayProblem& p, cudaStream_t stream) {
  dim3 grid(static_cast<unsigned>(p.B), static_cast<unsigned>(p.HV),
            static_cast<unsigned>(p.V / kWarpRows));
  const int64_t ctas = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  launch_kernel(replay_warp_kernel<In, kWarpMTiles, KDA>, grid, 32, WarpSmem<kWarpMTiles>::bytes,
                stream, p.pdl, with_pdl_trigger(p, ctas, kReplayWarpCtasPerSm),
                detail::SmallDivider::of(p.HV / p.H));
}

// The op the caller called, for the launch's errors: replayssm_decode, or the fused step whose
// ReplaySSM chain runs these kernels as its decode (err_op).
const char* op_name(const ReplayProblem& p) {
  return p.err_op == detail::kErrOpFusedStep ? "fused_decode_step" : "replayssm_decode";
}

// Warps per CTA: 8 (the ring work and the token shared by 8 warps' rows), fewer only when V has
// fewer row tiles. Small batches too: they are latency-bound, and the per-CTA chain (token, ring
// records spread over the warps, two barriers) is shortest with the most warps per CTA.
// `run` false: only the checks that throw before the launch (check_replayssm_decode_launch).
// FMT: a checkpoint in its storage format (replay_kernel's FMT; the generic float layout).
template <class StateT, int KT, bool VEC, class In, bool FMT = false>
void launch(const ReplayProblem& p, cudaStream_t stream, bool run) {
  using Lay = RowLayout<StateT, KT>;
  const int rows_per_warp = Lay::RG * Lay::ROWS;
  const int warps_needed = (p.V + rows_per_warp - 1) / rows_per_warp;
  const int warps = warps_needed < kReplayWarps ? warps_needed : kReplayWarps;
  const int vblocks = (warps_needed + warps - 1) / warps;
  // The validator limits L to 4096 (the cursor's low 16 bits); the CTAs of one row count
  // themselves in the high bits, which must not reach the sign bit.
  if (static_cast<int64_t>(p.HV) * vblocks >= (1 << 15))
    throw Error(ErrorKind::not_implemented,
                std::string(op_name(p)) +
                    ": HV * V-blocks must stay below 2^15 for the in-kernel cursor advance");
  const int rows_blk = warps * rows_per_warp;
  const int max_smem = max_smem_optin(p.device.index);
  if constexpr (VEC) {
    const int forced = forced_replay_blocks_per_cta();
    const bool two = forced ? forced == 2
                            : static_cast<int64_t>(p.B) * p.HV * vblocks >=
                                  kReplayTwoBlockWaves * num_sms(p.device.index);
    if constexpr (KT == 128 && std::is_same_v<StateT, __nv_bfloat16>) {
      const ReplayDecodeChoice choice = replay_decode_choice();
      // The one-warp kernel where it applies (bf16 inputs: its k ring staged as bf16, L <= 16,
      // V a multiple of its kWarpRows): for GDN always, for KDA from kReplayWarpKdaWaves waves of
      // its CTAs; unless another kernel is forced.
      if constexpr (std::is_same_v<In, TypedInput<__nv_bfloat16>>) {
        const int64_t warp_ctas = static_cast<int64_t>(p.B) * p.HV * (p.V / kWarpRows);
        const bool warp_pays =
            !p.gate.kda ||
            warp_ctas >= kReplayWarpKdaWaves * kReplayWarpCtasPerSm * num_sms(p.device.index);
        const bool warp_ok = choice == ReplayDecodeChoice::warp ||
                             (choice == ReplayDecodeChoice::automatic && warp_pays);
        if (warp_ok && p.L <= kWarpRingRecords && p.V % kWarpRows == 0) {
          if (run) {
            if (p.gate.kda) launch_warp<In, true>(p, stream);
            else launch_warp<In, false>(p, stream);
          }
          return;
        }
      }
      // The tensor-core kernel: whole 8-warp CTAs of 128 rows (rows_blk is 64 here).
      const int64_t tc_ctas = static_cast<int64_t>(p.B) * p.HV * (vblocks / 2);
      const bool tc = choice == ReplayDecodeChoice::tensor ||
                      (choice == ReplayDecodeChoice::automatic && two &&
                       tc_ctas >= kReplayTcWaves * kReplayCtasPerSm * num_sms(p.device.index));
      if (tc && warps == kReplayWarps && p.V % (2 * rows_blk) == 0) {
        const SmemLayout smt = tc_smem_layout<In>(p);
        if (smt.bytes <= max_smem) {
          if (run)
            launch_blocks<StateT, KT, VEC, In, 2, false, true>(p, stream, warps, vblocks, smt);
          return;
        }
      }
    }
    if (two && warps == kReplayWarps && p.V % (2 * rows_blk) == 0) {
      const SmemLayout sm2 = smem_layout<StateT, KT, VEC, In>(p, rows_blk, 2);
      if (sm2.bytes <= max_smem) {
        if (run) launch_blocks<StateT, KT, VEC, In, 2, false>(p, stream, warps, vblocks, sm2);
        return;
      }
    }
  }
  const SmemLayout sm = smem_layout<StateT, KT, VEC, In>(p, rows_blk, 1);
  if (sm.bytes > max_smem)
    throw Error(ErrorKind::not_implemented, std::string(op_name(p)) +
                                                ": ring length L=" + std::to_string(p.L) +
                                                " needs more shared memory than this GPU offers");
  if (run) launch_blocks<StateT, KT, VEC, In, 1, FMT>(p, stream, warps, vblocks, sm);
}

#if DELTASTATE_CUDA_ALL_KERNELS
template <class T>
bool inputs_are(const ReplayProblem& p) {
  constexpr DType t = std::is_same_v<T, float> ? DType::f32 : DType::bf16;
  return p.q.dtype == t && p.a.dtype == t && p.b.dtype == t && p.k_dtype == t;
}

// The vector path: 16-byte state rows, rings in the state / input dtypes, 16-byte aligned ring
// rows (V a multiple of 8 keeps every row block's d values whole 16-byte words).
template <class StateT>
bool vector_path_ok(const ReplayProblem& p) {
  auto al16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  return state_rows_aligned<StateT>(p.state) && p.d_dtype == p.state.dtype && p.V % 8 == 0 &&
         al16(p.d_cache) && al16(p.k_cache) && al16(p.g_cache);
}

template <class StateT, class In>
bool launch_fast(const ReplayProblem& p, cudaStream_t stream, bool run) {
  if (!inputs_are<typename In::type>(p) || !vector_path_ok<StateT>(p)) return false;
  if (p.K == 128) return launch<StateT, 128, true, In>(p, stream, run), true;
  if (p.K == 64) return launch<StateT, 64, true, In>(p, stream, run), true;
  return false;
}
#endif

// Kernel choice as for the recurrent op (src/cuda/recurrent.cu).
template <class StateT>
void dispatch(const ReplayProblem& p, cudaStream_t stream, bool run) {
#if DELTASTATE_CUDA_ALL_KERNELS
  if (launch_fast<StateT, TypedInput<__nv_bfloat16>>(p, stream, run)) return;
  if (launch_fast<StateT, TypedInput<float>>(p, stream, run)) return;
#endif
  launch<StateT, 256, false, AnyInput>(p, stream, run);
}

bool ring_modes(const ReplayProblem& p) {
  return p.modes.circular || p.modes.prefix_gates || p.modes.predecayed_k;
}

// The modes kernel's shared memory for K and L, opted in above 48 KB; not_implemented past the
// device's maximum. `run` false: the check only.
size_t mode_smem_checked(const ReplayProblem& p, int m_max) {
  const int64_t bytes = mode_smem_floats(p.K, m_max) * 4;
  const int max_smem = max_smem_optin(p.device.index);
  if (bytes > max_smem)
    throw Error(ErrorKind::not_implemented,
                std::string(op_name(p)) + ": SGLang's ring modes with L=" + std::to_string(p.L) +
                    ", K=" + std::to_string(p.K) + " need " + std::to_string(bytes) +
                    " bytes of shared memory per block; this GPU offers " +
                    std::to_string(max_smem));
  return static_cast<size_t>(bytes);
}

// FMT: a checkpoint in its storage format (replay_modes_kernel<true>), the step counter advanced
// after the grid, once per call (as the CPU's).
template <bool FMT>
void launch_modes(const ReplayProblem& p, cudaStream_t stream, bool run) {
  const size_t bytes = mode_smem_checked(p, p.L);
  if (!run) return;
  if (bytes > 48 * 1024) {
    static PerDeviceOnce opted;
    opted.get(p.device.index, [&p] {
      DS_CUDA_CHECK(cudaFuncSetAttribute(replay_modes_kernel<FMT>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         max_smem_optin(p.device.index)));
      return 1;
    });
  }
  dim3 grid(static_cast<unsigned>(p.B), static_cast<unsigned>(p.HV));
  launch_kernel(replay_modes_kernel<FMT>, grid, kModeThreads, bytes, stream, p.pdl,
                with_pdl_trigger(p, static_cast<int64_t>(p.B) * p.HV, 8));
  if (FMT && p.state.stochastic)
    launch_kernel(advance_rounding_step, 1u, 1u, 0, stream, false, p.state.step, 1);
}

}  // namespace

void run_replayssm_decode(const ReplayProblem& problem, void* stream) {
  DeviceGuard guard(problem.device.index);
  ReplayProblem p = problem;
  p.errors = device_errors(p.device.index);  // where the kernel records a bad row (errors.cu)
  auto s = static_cast<cudaStream_t>(stream);
  if (ring_modes(p))
    return p.state.formatted() ? launch_modes<true>(p, s, true) : launch_modes<false>(p, s, true);
  if (p.state.formatted()) {
    launch<float, 256, false, AnyInput, true>(p, s, true);
    // the step counter, once per call (as the CPU's), after the grid
    if (p.state.stochastic)
      launch_kernel(advance_rounding_step, 1u, 1u, 0, s, false, p.state.step, 1);
    return;
  }
  with_state_type(p.state.dtype, [&](auto state) { dispatch<decltype(state)>(p, s, true); });
}

void check_replayssm_decode_launch(const ReplayProblem& p) {
  DeviceGuard guard(p.device.index);
  if (ring_modes(p)) return launch_modes<false>(p, nullptr, false);  // (the check only)
  if (p.state.formatted()) return launch<float, 256, false, AnyInput, true>(p, nullptr, false);
  with_state_type(p.state.dtype, [&](auto state) { dispatch<decltype(state)>(p, nullptr, false); });
}

void check_replay_materialize(const ReplayProblem& p, int m) {
  DeviceGuard guard(p.device.index);
  mode_smem_checked(p, m);
}

void run_replay_materialize(const ReplayProblem& problem, int64_t src, int64_t dst, int m, int base,
                            void* stream) {
  DeviceGuard guard(problem.device.index);
  const ReplayProblem& p = problem;
  // The kernel's shared memory: gtot, e [K each], kw [m][K], w [L] (mode_smem_floats covers it).
  const size_t bytes = mode_smem_checked(p, m);
  // a checkpoint in its storage format: the FMT instance (no counter advance: fork is no step)
  const auto kernel =
      p.state.formatted() ? replay_materialize_kernel<true> : replay_materialize_kernel<false>;
  if (bytes > 48 * 1024) {
    static PerDeviceOnce opted[2];
    opted[p.state.formatted() ? 1 : 0].get(p.device.index, [&p, kernel] {
      DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         max_smem_optin(p.device.index)));
      return 1;
    });
  }
  launch_kernel(kernel, dim3(static_cast<unsigned>(p.HV)), kModeThreads, bytes,
                static_cast<cudaStream_t>(stream), false, p, src, dst, m, base);
}

}  // namespace deltastate::cuda_backend
