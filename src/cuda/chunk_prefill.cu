// CUDA launch and dispatch of chunked prefill (GDN and KDA): kernels over one validated problem
// (core/problem.h ChunkPrefillProblem), picked per call from shapes, dtypes, addresses and the
// workspace size only (no device data, no host synchronization: graph-capturable):
//  * the Hopper GDN kernels (chunk_prefill_hopper.cu: a chunk-parallel prep kernel, then a
//    warp-specialized wgmma / TMA scan over (sequence, value head)) on compute capability 9.0,
//    K = V = 128, q/k/v all bf16 or all fp16 with TMA-readable strides, when the workspace holds
//    the prep kernel's blocks; every other problem takes one of the kernels below.
//  * the split kernels (chunk_prefill/split.cuh, its design there), GDN and KDA: an intra-chunk
//    kernel and an output kernel parallel over (chunk, value head) around a sequential state
//    pass over (sequence, value head, row tile), through the workspace. Taken where the
//    tensor-core kernels apply, the fused kernel's grid would fill less than half of the GPU
//    (prefill_split_pays, tuning.h) and the workspace holds their blocks.
//  * chunk_prefill_tc_kernel (chunk_prefill/tc_kernel.cuh): the fused tensor-core kernel
//    (mma.sync bf16/fp16, fp32 accumulation), one CTA per (sequence, value head) with the fp32
//    state on chip across the sequence's chunks, when the split path is not taken.
//    Runs K = V = 128 (and 64 in the full build), q, k, v all bf16 or all fp16 with 16-byte
//    aligned rows, outputs aligned to 4 elements (the split kernels' conditions too).
//  * chunk_prefill_fallback_kernel (chunk_prefill/fallback.cuh): everything else (K != V, other
//    sizes, fp32 or mixed q/k/v, unaligned rows, too little shared memory), the fp32 token
//    recurrence on CUDA cores: exact to fp32, slow.
// DELTASTATE_CUDA_ALL_KERNELS=OFF (CI) compiles the tensor-core kernels for K = 128, bf16 only;
// DELTASTATE_CUDA_PREFILL=split|fused|fallback forces one (tuning.h). Gates, decays and states of
// every dtype and layout the problem describes run on all of them, quantized and stochastically
// rounded pools too (each kernel's state I/O through cuda/state_format.cuh; the step counter
// advanced after the call's grids).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "api/backend.h"
#include "core/error_text.h"
#include "core/problem.h"
#include "cuda/chunk_prefill/fallback.cuh"
#include "cuda/chunk_prefill/split.cuh"
#include "cuda/chunk_prefill/tc_kernel.cuh"
#include "cuda/chunk_prefill_hopper.h"
#include "cuda/launch.h"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

using detail::ChunkPrefillProblem;

namespace {

bool aligned_to(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

// Every row (head vector) of a per-token tensor starts on an `elems`-element boundary: the base
// address and the strides that apply (the batch stride only without cu_seqlens).
template <class Head>
bool rows_aligned(const Head& t, const ChunkPrefillProblem& p, int64_t elems) {
  const int64_t esize = dtype_size(t.dtype);
  if (!aligned_to(t.ptr, elems * esize)) return false;
  if (t.tok_stride % elems != 0 || t.head_stride % elems != 0) return false;
  return p.cu_seqlens || p.N <= 1 || t.seq_stride % elems == 0;
}

// The head size the tensor-core kernel runs this problem at, or 0 (fallback).
int tc_head_size(const ChunkPrefillProblem& p) {
  if (forced_prefill_kernel() == PrefillChoice::fallback) return 0;
  if (p.K != p.V) return 0;
#if DELTASTATE_CUDA_ALL_KERNELS
  if (p.K != 128 && p.K != 64) return 0;
  const bool dtype_ok = p.q.dtype == DType::bf16 || p.q.dtype == DType::f16;
#else
  if (p.K != 128) return 0;
  const bool dtype_ok = p.q.dtype == DType::bf16;
#endif
  if (!dtype_ok || p.k.dtype != p.q.dtype || p.v.dtype != p.q.dtype) return 0;
  // cp.async copies 16-byte pieces of the q, k, v rows; outputs are stored 4 elements at a time.
  if (!rows_aligned(p.q, p, 8) || !rows_aligned(p.k, p, 8) || !rows_aligned(p.v, p, 8)) return 0;
  if (!rows_aligned(p.out, p, 4)) return 0;
  return p.K;
}

// After opting the kernel into its shared memory (once per device): how many of its CTAs an SM
// holds (the early-trigger rule of programmatic dependent launch).
template <class Kernel>
int opt_in_and_occupancy(Kernel kernel, int smem, int threads) {
  DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int n = 0;
  DS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
  return n < 1 ? 1 : n;
}

unsigned grid_of(const ChunkPrefillProblem& p) {
  const int64_t ctas = p.num_heads_total();
  if (ctas > 0x7fffffffLL)
    throw Error(ErrorKind::value, "chunk_prefill: too many (sequence, head) pairs for one launch");
  return static_cast<unsigned>(ctas);
}

template <int D, class In, bool KDA>
void launch_tc(const ChunkPrefillProblem& p, cudaStream_t stream) {
  using L = prefill::TcLayout<D, KDA>;
  auto kernel = prefill::chunk_prefill_tc_kernel<D, In, KDA>;
  static PerDeviceOnce per_sm;
  const int resident = per_sm.get(
      p.device.index, [kernel] { return opt_in_and_occupancy(kernel, L::SMEM, L::THREADS); });
  const unsigned ctas = grid_of(p);
  const bool early = p.pdl && pdl_trigger_early(ctas, resident, p.device.index);
  launch_kernel(kernel, dim3(ctas), dim3(L::THREADS), L::SMEM, stream, p.pdl, p, early);
}

template <int D, class In>
void launch_tc_gate(const ChunkPrefillProblem& p, cudaStream_t stream) {
  if (p.gate.kda) launch_tc<D, In, true>(p, stream);
  else launch_tc<D, In, false>(p, stream);
}

// The tensor-core kernel when the device gives a CTA its shared memory; false otherwise.
// Without DELTASTATE_CUDA_ALL_KERNELS only <128, bf16> is compiled (tc_head_size picks no other).
template <int D, class In>
bool try_tc(const ChunkPrefillProblem& p, cudaStream_t stream) {
#if !DELTASTATE_CUDA_ALL_KERNELS
  if constexpr (D != 128 || !std::is_same_v<In, __nv_bfloat16>) {
    return false;
  } else
#endif
  {
    const int smem =
        p.gate.kda ? prefill::TcLayout<D, true>::SMEM : prefill::TcLayout<D, false>::SMEM;
    if (smem > max_smem_optin(p.device.index)) return false;
    launch_tc_gate<D, In>(p, stream);
    return true;
  }
}

// The split kernels (chunk_prefill/split.cuh, GDN and KDA) where the tensor-core kernels apply,
// when the fused kernel's grid would leave most SMs idle (prefill_split_pays) or when forced, and
// the workspace holds their blocks (it does when sized by chunk_prefill_workspace_bytes).
bool use_split(const ChunkPrefillProblem& p) {
  const PrefillChoice forced = forced_prefill_kernel();
  if (forced == PrefillChoice::fused) return false;
  return forced == PrefillChoice::split ||
         prefill_split_pays(p.num_heads_total(), num_sms(p.device.index));
}

int64_t split_bytes(int D, bool kda, int64_t N, int64_t HV, int64_t slots) {
  const int64_t block =
      kda ? (D == 128 ? prefill::SplitLayout<128, true>::BLOCK
                      : prefill::SplitLayout<64, true>::BLOCK)
          : (D == 128 ? prefill::SplitLayout<128>::BLOCK : prefill::SplitLayout<64>::BLOCK);
  return prefill::split_status_bytes(N) + slots * HV * block;
}

template <int D, class In, bool KDA>
bool try_split(const ChunkPrefillProblem& p, cudaStream_t stream) {
#if !DELTASTATE_CUDA_ALL_KERNELS
  if constexpr (D != 128 || !std::is_same_v<In, __nv_bfloat16>) {
    return false;
  } else
#endif
  {
    using Lay = prefill::SplitLayout<D, KDA>;
    const int64_t slots = prefill::split_chunk_slots(p);
    if (!p.workspace || p.workspace_bytes < split_bytes(D, KDA, p.N, p.HV, slots)) return false;
    if (Lay::Intra::SMEM > max_smem_optin(p.device.index) ||
        Lay::State::SMEM > max_smem_optin(p.device.index))
      return false;
    if (slots > 0x7fffffffLL || p.HV > 65535 ||
        p.num_heads_total() * (D / prefill::kSplitRows) > 0x7fffffffLL)
      throw Error(ErrorKind::value, "chunk_prefill: too many chunks or heads for one launch");
    auto intra = prefill::chunk_prefill_split_intra_kernel<D, In, KDA>;
    auto state = prefill::chunk_prefill_split_state_kernel<D, In, KDA>;
    auto out = prefill::chunk_prefill_split_output_kernel<D, In, KDA>;
    static PerDeviceOnce per_sm;
    const int resident = per_sm.get(p.device.index, [=] {
      opt_in_and_occupancy(intra, Lay::Intra::SMEM, Lay::THREADS);
      opt_in_and_occupancy(state, Lay::State::SMEM, Lay::State::THREADS);
      return opt_in_and_occupancy(out, Lay::Out::SMEM, Lay::THREADS);
    });
    const dim3 chunk_grid(static_cast<unsigned>(slots), static_cast<unsigned>(p.HV));
    // Each kernel waits for the previous one in enter_grid; only the last lets the next op's
    // grid in early.
    if (slots > 0)
      launch_kernel(intra, chunk_grid, dim3(Lay::THREADS), Lay::Intra::SMEM, stream, p.pdl, p);
    const auto state_ctas = static_cast<unsigned>(p.num_heads_total() * (D / prefill::kSplitRows));
    launch_kernel(state, dim3(state_ctas), dim3(Lay::State::THREADS), Lay::State::SMEM, stream,
                  p.pdl, p);
    if (slots > 0) {
      const bool early = p.pdl && pdl_trigger_early(slots * p.HV, resident, p.device.index);
      launch_kernel(out, chunk_grid, dim3(Lay::THREADS), Lay::Out::SMEM, stream, p.pdl, p, early);
    }
    return true;
  }
}

template <int D, class In>
bool try_split_gate(const ChunkPrefillProblem& p, cudaStream_t stream) {
  return p.gate.kda ? try_split<D, In, true>(p, stream) : try_split<D, In, false>(p, stream);
}

void launch_fallback(const ChunkPrefillProblem& p, cudaStream_t stream) {
  auto kernel = prefill::chunk_prefill_fallback_kernel;
  const int64_t smem = prefill::fallback_smem_bytes(p.K, p.V);
  const int optin = max_smem_optin(p.device.index);
  if (smem > optin) {
    throw Error(
        ErrorKind::not_implemented,
        detail::format("chunk_prefill on CUDA: K=%d, V=%d need %lld bytes of shared memory; "
                       "this device gives a CTA %d",
                       p.K, p.V, static_cast<long long>(smem), optin));
  }
  static PerDeviceOnce opted;
  opted.get(p.device.index, [kernel, optin] {
    DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
    return 1;
  });
  int resident = 1;
  if (p.pdl)
    DS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &resident, kernel, prefill::kFallbackThreads, static_cast<size_t>(smem)));
  const unsigned ctas = grid_of(p);
  const bool early = p.pdl && pdl_trigger_early(ctas, resident < 1 ? 1 : resident, p.device.index);
  launch_kernel(kernel, dim3(ctas), dim3(prefill::kFallbackThreads), static_cast<size_t>(smem),
                stream, p.pdl, p, early);
}

// The kernels of one call (the dispatch above), without the step counter's advance.
void launch_prefill(const ChunkPrefillProblem& p, cudaStream_t s);

// One thread: the stochastic-rounding step counter of a call, after its grids.
__global__ void advance_prefill_rounding_step(int64_t* step) {
  enter_grid(false);
  *step += 1;
}

}  // namespace

int64_t chunk_prefill_workspace_bytes(int K, int V, int64_t N, int64_t HV, int64_t tokens, bool kda,
                                      int device) {
  // The fused tensor-core kernel keeps everything on chip; the fallback needs global memory only
  // for states too large for its shared memory; the split kernels (the tensor-core kernels' head
  // sizes; KDA's blocks are the larger) a block per (chunk slot, value head): tokens / 64 + N
  // slots bound the chunks of any split of `tokens` into N sequences (split.cuh).
  const int64_t E = static_cast<int64_t>(K) * V;
  const int64_t fallback = E <= prefill::kFallbackSmemStateElems ? 0 : N * HV * E * 4;
#if DELTASTATE_CUDA_ALL_KERNELS
  const bool split_size = K == V && (K == 128 || K == 64);
#else
  const bool split_size = K == V && K == 128;
#endif
  // Only a call the dispatch sends down the split path (use_split's rule on the same N, HV and
  // device) asks for its blocks: the fused kernel's grids need none of them. Without a device to
  // ask (no driver: the contract checks still run, the launch would fail) no split is planned.
  const PrefillChoice forced = forced_prefill_kernel();
  // The Hopper kernels' blocks where the dispatch may take them (the q/k/v dtype is not known
  // here: the blocks are asked for whenever the device and the shapes allow them).
  const int64_t slots_bound = tokens / ChunkPrefillProblem::kChunk + N;
  const bool hopper = device_available() && hopper_prefill_shapes(K, V, device);
  const int64_t base =
      hopper ? std::max(fallback, hopper_prefill_workspace_bytes(slots_bound, HV, kda) +
                                      hopper_prefill_cp_workspace_bytes(N, HV, tokens, kda, device))
             : fallback;
  if (!split_size || forced == PrefillChoice::fused || forced == PrefillChoice::fallback ||
      forced == PrefillChoice::hopper)
    return base;
  const bool split_path = forced == PrefillChoice::split ||
                          (device_available() && prefill_split_pays(N * HV, num_sms(device)));
  if (!split_path) return base;
  return std::max(base, split_bytes(K, kda, N, HV, slots_bound));
}

void run_chunk_prefill(const ChunkPrefillProblem& problem, void* stream) {
  if (problem.N == 0) return;
  DeviceGuard guard(problem.device.index);
  ChunkPrefillProblem p = problem;
  p.errors = device_errors(p.device.index);  // where the kernels record a bad slot (errors.cu)
  auto s = static_cast<cudaStream_t>(stream);
  launch_prefill(p, s);
  // A stochastically rounded pool (cuda/state_format.cuh): every kernel above read the key's step
  // from the counter; it advances once per call, stream-ordered after them (graph-safe).
  if (p.state.stochastic)
    launch_kernel(advance_prefill_rounding_step, 1u, 1u, 0, s, false, p.state.step);
}

namespace {

void launch_prefill(const ChunkPrefillProblem& p, cudaStream_t s) {
  if (run_hopper_prefill(p, s)) return;
  const int D = tc_head_size(p);
  const bool bf16 = p.q.dtype == DType::bf16;
  if (D != 0 && use_split(p)) {
    if (D == 128 &&
        (bf16 ? try_split_gate<128, __nv_bfloat16>(p, s) : try_split_gate<128, __half>(p, s)))
      return;
    if (D == 64 &&
        (bf16 ? try_split_gate<64, __nv_bfloat16>(p, s) : try_split_gate<64, __half>(p, s)))
      return;
  }
  if (D == 128) {
    if (bf16 ? try_tc<128, __nv_bfloat16>(p, s) : try_tc<128, __half>(p, s)) return;
  } else if (D == 64) {
    if (bf16 ? try_tc<64, __nv_bfloat16>(p, s) : try_tc<64, __half>(p, s)) return;
  }
  launch_fallback(p, s);
}

}  // namespace

}  // namespace deltastate::cuda_backend
