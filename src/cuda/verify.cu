// CUDA launch of speculative verify, of its commits, and of the recurrent op's multi-token
// sequences (recurrent.cu hands them here): the multi-token kernel (verify/multi_token.cuh), the
// commits' copy kernels (verify/commit.cuh), and for a pool in its storage format (quantized, or
// rounded stochastically) verify/fmt.cuh's generic kernels. No allocation, no host
// synchronization: graph-safe.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "api/backend.h"
#include "core/problem.h"
#include "cuda/launch.h"
#include "cuda/tuning.h"
#include "cuda/verify/commit.cuh"
#include "cuda/verify/fmt.cuh"
#include "cuda/verify/launch.h"
#include "cuda/verify/multi_token.cuh"

namespace deltastate::cuda_backend {

using detail::CommitProblem;
using detail::RecurrentProblem;
using detail::VerifyProblem;

namespace {

template <class StateT>
bool rows_aligned(const void* ptr, std::initializer_list<int64_t> strides) {
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
  for (const int64_t s : strides)
    if ((s * static_cast<int64_t>(sizeof(StateT))) % 16 != 0) return false;
  return true;
}

template <class StateT, int KT, bool VEC, class Shape>
void launch_shape(const VerifyProblem& problem, cudaStream_t stream) {
  using M = MultiLayout<StateT, KT>;
  constexpr int rows = M::RPC * Shape::TPW;
  constexpr int resident = VEC ? Shape::CTAS : kMultiGenericCtasPerSm;
  const int ctas_per_head = (problem.r.V + rows - 1) / rows;
  const int64_t ctas = problem.r.num_heads_total() * ctas_per_head;
  if (ctas > 0x7fffffffLL) throw Error(ErrorKind::value, "verify: too many tiles for one launch");
  if (ctas == 0) return;
  VerifyProblem p = problem;
  p.r = with_pdl_trigger(problem.r, ctas, resident);
  launch_kernel(multi_token_kernel<StateT, KT, VEC, Shape>, static_cast<unsigned>(ctas),
                kMultiWarps * 32, 0, stream, p.r.pdl, p, ctas_per_head);
}

// The vector kernels' variant: DELTASTATE_CUDA_MULTI_VARIANT, else by the state type (tuning.h,
// multi_two_tiles): fp32 two tiles per warp for a one-tile grid of at most one CTA an SM, one tile
// in registers above it; 16-bit both tiles staged.
template <class StateT, int KT, bool VEC>
void launch_multi(const VerifyProblem& p, cudaStream_t stream) {
  using Two = MultiShape<2, false, kMultiTwoCtasPerSm>;
  using Stage2 = MultiShape<2, true, kMultiTwoCtasPerSm>;
  if constexpr (!VEC) {
    if (p.ring_v) launch_shape<StateT, KT, false, MultiRing>(p, stream);
    else launch_shape<StateT, KT, false, MultiBase>(p, stream);
  } else {
    switch (forced_multi_variant()) {
      case MultiVariant::base:
        return launch_shape<StateT, KT, true, MultiBase>(p, stream);
      case MultiVariant::stage:
        return launch_shape<StateT, KT, true, MultiShape<1, true, kMultiCtasPerSm>>(p, stream);
      case MultiVariant::two:
        return launch_shape<StateT, KT, true, Two>(p, stream);
      case MultiVariant::stage2:
        return launch_shape<StateT, KT, true, Stage2>(p, stream);
      case MultiVariant::automatic:
        break;
    }
    if constexpr (!std::is_same_v<StateT, float>) {
      launch_shape<StateT, KT, true, Stage2>(p, stream);
    } else {
      using M = MultiLayout<StateT, KT>;
      const int64_t ctas1 = p.r.num_heads_total() * ((p.r.V + M::RPC - 1) / M::RPC);
      if (multi_two_tiles(ctas1, num_sms(p.r.device.index)))
        return launch_shape<StateT, KT, true, Two>(p, stream);
      launch_shape<StateT, KT, true, MultiBase>(p, stream);
    }
  }
}

// The vector instantiations (K = 64 or 128, 16-byte aligned rows of the pool and the scratch
// buffer, no source pool), else the generic one (any K <= 256, element accesses; a source pool's
// start rows: the vector kernels, at their register caps, would spill with its code).
template <class StateT>
bool vector_rows(const VerifyProblem& p) {
  return !p.source.ptr && !p.ring_v &&
         (p.r.K == 128
#if DELTASTATE_CUDA_ALL_KERNELS
          || p.r.K == 64
#endif
          ) &&
         rows_aligned<StateT>(p.r.state.ptr, {p.r.state.slot_stride, p.r.K}) &&
         (!p.inter || rows_aligned<StateT>(p.inter, {p.inter_row_stride, p.inter_step_stride}));
}

template <class StateT>
void dispatch_multi(const VerifyProblem& p, cudaStream_t stream) {
  if (vector_rows<StateT>(p)) {
#if DELTASTATE_CUDA_ALL_KERNELS
    if (p.r.K == 64) return launch_multi<StateT, 64, true>(p, stream);
#endif
    return launch_multi<StateT, 128, true>(p, stream);
  }
  launch_multi<StateT, 256, false>(p, stream);
}

void run_multi(const VerifyProblem& problem, void* stream) {
  DeviceGuard guard(problem.r.device.index);
  VerifyProblem p = problem;
  p.r.errors = device_errors(p.r.device.index);
  auto s = static_cast<cudaStream_t>(stream);
  with_state_type(p.r.state.dtype, [&](auto state) { dispatch_multi<decltype(state)>(p, s); });
}

}  // namespace

// The recurrent op's multi-token problems the multi-token kernel runs: a pool (V-first, scratch
// buffers aside), no dense final state, vector rows (K = 64 or 128, 16-byte aligned).
bool run_recurrent_multi_token(const RecurrentProblem& p, void* stream) {
  if (multi_token_disabled()) return false;
  if (!(p.T > 1 || p.cu_seqlens) || !p.state.ptr || p.final_state || p.state.k_first) return false;
  VerifyProblem vp;
  vp.r = p;
  vp.err_op = detail::kErrOpRecurrent;
  const bool vec = p.state.dtype == DType::f32    ? vector_rows<float>(vp)
                   : p.state.dtype == DType::bf16 ? vector_rows<__nv_bfloat16>(vp)
                                                  : vector_rows<__half>(vp);
  if (!vec) return false;
  run_multi(vp, stream);
  return true;
}

void run_verify(const VerifyProblem& problem, void* stream) {
  if (!problem.r.state.formatted()) return run_multi(problem, stream);
  // A pool in its storage format: the generic formatted-state kernel (verify/fmt.cuh), then the
  // step counter's advance (once per call, as the CPU's).
  DeviceGuard guard(problem.r.device.index);
  VerifyProblem p = problem;
  p.r.errors = device_errors(p.r.device.index);
  auto s = static_cast<cudaStream_t>(stream);
  using Lay = RowLayout<float, 256>;
  const int wph = (p.r.V + Lay::RG * Lay::ROWS - 1) / (Lay::RG * Lay::ROWS);
  const int64_t tiles = p.r.num_heads_total() * wph;
  if (tiles > 0) {
    const DirectGrid g = direct_grid(tiles, p.r.device.index,
                                     "verify: too many tiles for one launch", kVerifyFmtCtasPerSm);
    p.r = with_pdl_trigger(p.r, g.ctas, g.resident);
    if (p.ring_v)
      launch_kernel(verify_fmt_kernel<256, true>, static_cast<unsigned>(g.ctas), g.warps * 32, 0, s,
                    p.r.pdl, p, wph);
    else
      launch_kernel(verify_fmt_kernel<256, false>, static_cast<unsigned>(g.ctas), g.warps * 32, 0,
                    s, p.r.pdl, p, wph);
  }
  if (p.r.state.stochastic)
    launch_kernel(advance_rounding_step, 1u, 1u, 0, s, false, p.r.state.step, 1);
}

// Both commits: a flat entry (every state; a conv window held as the same dense range in both
// tensors) by commit_kernel's unit copies, any other window element by element.
void run_commit(const CommitProblem& problem, void* stream) {
  DeviceGuard guard(problem.device.index);
  CommitProblem p = problem;
  p.errors = device_errors(p.device.index);
  p.pdl_trigger_early = false;
  auto s = static_cast<cudaStream_t>(stream);
  const std::string too_many =
      p.err_op == detail::kErrOpConvCommit
          ? "update_conv_state_after_verify: too many windows for one launch"
          : "update_state_after_verify: too many states for one launch";
  if (is_quantized(p.dtype)) {  // requantized from the float scratch (verify/fmt.cuh)
    const int64_t chunks = (p.head_elems / p.K + kCommitFmtWarps - 1) / kCommitFmtWarps;
    if (chunks > 0x7fffffffLL || p.B > 65535 || p.layers > 65535)
      throw Error(ErrorKind::value, too_many);
    if (chunks > 0 && p.B > 0)
      launch_kernel(commit_fmt_kernel<256>,
                    dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(p.B),
                         static_cast<unsigned>(p.layers)),
                    kCommitThreads, 0, s, p.pdl, p);
    if (p.stochastic)  // every layer's counter, once per call
      launch_kernel(advance_rounding_step, 1u,
                    static_cast<unsigned>(p.layers < 256 ? p.layers : 256), 0, s, false, p.steps,
                    static_cast<int>(p.layers));
    return;
  }
  if (!p.flat) {
    const int64_t chunks = (p.head_elems + kCommitThreads - 1) / kCommitThreads;
    if (chunks > 0x7fffffffLL || p.B > 65535 || p.layers > 65535)
      throw Error(ErrorKind::value, too_many);
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(p.B),
                    static_cast<unsigned>(p.layers));
    if (dtype_size(p.dtype) == 4)
      launch_kernel(commit_strided_kernel<uint32_t>, grid, kCommitThreads, 0, s, p.pdl, p);
    else launch_kernel(commit_strided_kernel<uint16_t>, grid, kCommitThreads, 0, s, p.pdl, p);
    return;
  }
  const int64_t es = dtype_size(p.dtype);
  const int64_t bytes = p.head_elems * es;
  const bool vec = reinterpret_cast<uintptr_t>(p.state) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(p.inter) % 16 == 0 && bytes % 16 == 0 &&
                   (p.state_layer_stride * es) % 16 == 0 && (p.state_slot_stride * es) % 16 == 0 &&
                   (p.inter_layer_stride * es) % 16 == 0 && (p.inter_row_stride * es) % 16 == 0 &&
                   (p.inter_step_stride * es) % 16 == 0;
  const int64_t unit = vec ? 16 : 2;
  const int64_t per_cta = static_cast<int64_t>(kCommitThreads) * kCommitUnitsPerThread * unit;
  const int64_t chunks = (bytes + per_cta - 1) / per_cta;
  if (chunks > 0x7fffffffLL || p.B > 65535 || p.layers > 65535)
    throw Error(ErrorKind::value, too_many);
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(p.B),
                  static_cast<unsigned>(p.layers));
  if (vec) launch_kernel(commit_kernel<uint4>, grid, kCommitThreads, 0, s, p.pdl, p);
  else launch_kernel(commit_kernel<uint16_t>, grid, kCommitThreads, 0, s, p.pdl, p);
}

}  // namespace deltastate::cuda_backend
