// CUDA launch and dispatch of the pooled varlen recurrent op, GDN and KDA; packed decode is its
// T = 1 case.
//
// Decode is memory-bound: every state element is read once and written once. Three kernels, one
// math (core/delta_math.h), chosen per call by `dispatch` at the end of this file:
//  * recurrent_decode_kernel (recurrent/decode.cuh): one token per sequence, one warp per tile of
//    rows held in registers, small register footprint; the default for decode.
//  * recurrent_stream_kernel (recurrent/stream.cuh): one token per sequence, state tiles through
//    shared memory with bulk copies, the token's preparation done once per tile by a producer
//    warp; the default for 16-bit states at large batch, where the register kernels run out of
//    instruction issue.
//  * recurrent_direct_kernel (recurrent/direct.cuh): any number of tokens per sequence (varlen),
//    dense final states, no state, read-only pools; each thread keeps its rows' slices in
//    registers for the whole sequence; fast instantiations for K = 64/128 with typed inputs, a
//    generic one for any K <= 256 and any input dtypes.
// Dot products over K are shuffle reductions inside the G lanes of a row (one transposed
// reduction for all of a thread's rows). No allocation, no host synchronization: graph-capturable.
// The thresholds of the choice: tuning.h; the measurements behind them: docs/PERFORMANCE.md.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "api/backend.h"
#include "core/problem.h"
#include "cuda/launch.h"
#include "cuda/recurrent/decode.cuh"
#include "cuda/recurrent/decode_quant.cuh"
#include "cuda/recurrent/direct.cuh"
#include "cuda/recurrent/stream.cuh"
#include "cuda/rows.cuh"
#include "cuda/stream_trace.h"
#include "cuda/tuning.h"
#include "cuda/verify/launch.h"

namespace deltastate::cuda_backend {

using detail::RecurrentProblem;

namespace {

// Tiles per warp of the decode kernel (tuning.h: decode_two_tiles, the override).
int decode_tiles_per_warp(const RecurrentProblem& p, int tiles_per_head) {
  if (const int forced = forced_decode_tiles_per_warp()) return forced;
  const int64_t w1 = p.num_heads_total() * tiles_per_head;
  const int64_t cap = static_cast<int64_t>(kDecodeWarpsPerSm) * num_sms(p.device.index);
  return decode_two_tiles(w1, cap) ? 2 : 1;
}

template <class StateT, int K>
int warps_per_head_of(const RecurrentProblem& p) {  // one tile (RG*ROWS rows) per warp
  using Lay = RowLayout<StateT, K>;
  const int rows_per_warp = Lay::RG * Lay::ROWS;
  return (p.V + rows_per_warp - 1) / rows_per_warp;
}

template <class StateT, int K, class In, int TPW>
void launch_decode_tpw(const RecurrentProblem& p, int tiles, cudaStream_t stream) {
  const int wph = (tiles + TPW - 1) / TPW;
  const int64_t warps = p.num_heads_total() * wph;
  if (warps > 0x7fffffffLL)
    throw Error(ErrorKind::value, "recurrent: too many tiles for one launch");
  if (warps == 0) return;
  constexpr int smem = TPW == 2 ? kDecodeCtaWarps * kDecodeTileBytes<StateT, K> : 0;
  const auto ctas = static_cast<unsigned>((warps + kDecodeCtaWarps - 1) / kDecodeCtaWarps);
  launch_kernel(recurrent_decode_kernel<StateT, K, In, TPW>, ctas, kDecodeCtaWarps * 32, smem,
                stream, p.pdl, with_pdl_trigger(p, ctas, kDecodeCtasPerSm), wph);
}

// The quantized decode kernel: TPW 16-row tiles a warp.
template <DType T, int K, int TPW>
void launch_quant_decode(const RecurrentProblem& p, cudaStream_t stream) {
  const int wph = (p.V + TPW * kQuantTileRows - 1) / (TPW * kQuantTileRows);
  const int64_t warps = p.num_heads_total() * wph;
  if (warps > 0x7fffffffLL)
    throw Error(ErrorKind::value, "recurrent: too many tiles for one launch");
  if (warps == 0) return;
  const auto ctas = static_cast<unsigned>((warps + kQuantWarpsPerCta - 1) / kQuantWarpsPerCta);
  launch_kernel(quant_decode_kernel<T, K, AnyInput, TPW>, ctas, kQuantWarpsPerCta * 32, 0, stream,
                p.pdl, with_pdl_trigger(p, ctas, kQuantDecodeCtasPerSm), wph);
}
// Its tiles a warp: two from kQuantTwoTileMinHeads (sequence, head) pairs, else one
// (DELTASTATE_CUDA_QUANT_DECODE=mma|mma2 forces one or two).
template <DType T, int K>
void launch_quant_decode_k(const RecurrentProblem& p, QuantDecodeChoice q, cudaStream_t stream) {
  if (q == QuantDecodeChoice::mma2 ||
      (q == QuantDecodeChoice::automatic && p.num_heads_total() >= kQuantTwoTileMinHeads))
    launch_quant_decode<T, K, 2>(p, stream);
  else launch_quant_decode<T, K, 1>(p, stream);
}

template <class StateT, int K, class In>
void launch_decode(const RecurrentProblem& p, cudaStream_t stream) {
  const int tiles = warps_per_head_of<StateT, K>(p);
  if (decode_tiles_per_warp(p, tiles) == 2)
    return launch_decode_tpw<StateT, K, In, 2>(p, tiles, stream);
  launch_decode_tpw<StateT, K, In, 1>(p, tiles, stream);
}

// Resident CTAs per SM of a streaming instantiation (from its shared-memory footprint), once per
// device (the current one: the caller holds a DeviceGuard), after opting into its shared memory.
template <class StateT, int K, class In>
int stream_ctas_per_sm(int device) {
  using Lay = StreamLayout<StateT, K>;
  static PerDeviceOnce ctas;
  return ctas.get(device, [] {
    auto kernel = recurrent_stream_kernel<StateT, K, In>;
    DS_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Lay::SMEM_BYTES));
    DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                       cudaSharedmemCarveoutMaxShared));
    int n = 0;
    DS_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Lay::THREADS, Lay::SMEM_BYTES));
    return n < 1 ? 1 : n;
  });
}

template <class StateT, int K, class In>
void launch_stream(const RecurrentProblem& p, cudaStream_t stream) {
  using Lay = StreamLayout<StateT, K>;
  const int vblocks = (p.V + Lay::TILE_ROWS - 1) / Lay::TILE_ROWS;
  const int64_t ntiles = p.num_heads_total() * vblocks;
  if (ntiles > 0x7fffffffLL)
    throw Error(ErrorKind::value, "recurrent: too many tiles for one launch");
  if (ntiles == 0) return;
  const int per_sm = stream_ctas_per_sm<StateT, K, In>(p.device.index);
  const int64_t max_ctas = static_cast<int64_t>(per_sm) * num_sms(p.device.index);
  const int ctas = static_cast<int>(ntiles < max_ctas ? ntiles : max_ctas);
  launch_kernel(recurrent_stream_kernel<StateT, K, In>, ctas, Lay::THREADS, Lay::SMEM_BYTES, stream,
                p.pdl, with_pdl_trigger(p, ctas, per_sm), vblocks, static_cast<int>(ntiles));
}

template <class StateT, int KT, bool VEC, class In>
void launch_direct(const RecurrentProblem& p, cudaStream_t stream) {
  const int wph = warps_per_head_of<StateT, KT>(p);
  const int64_t tiles = p.num_heads_total() * wph;
  const int warps = direct_cta_warps(tiles, num_sms(p.device.index));
  const int64_t ctas = (tiles + warps - 1) / warps;
  if (tiles > 0x7fffffffLL)
    throw Error(ErrorKind::value, "recurrent: too many tiles for one launch");
  const int resident_ctas = kDirectCtasPerSm * 4 / warps;  // the launch bound's 16 warps per SM
  launch_kernel(recurrent_direct_kernel<StateT, KT, VEC, In>, static_cast<unsigned>(ctas),
                warps * 32, 0, stream, p.pdl, with_pdl_trigger(p, ctas, resident_ctas), wph);
}

// The step counter's advance after a formatted store (one thread, stream-ordered after the grid:
// graph-safe).
void advance_step_after(const RecurrentProblem& p, cudaStream_t stream) {
  if (p.state.stochastic && p.update_state)
    launch_kernel(advance_rounding_step, 1u, 1u, 0, stream, false, p.state.step, 1);
}

// A pool in its storage format (quantized, or stochastically rounded): the direct kernel's twin,
// then the step counter's advance.
void launch_direct_fmt(const RecurrentProblem& p, cudaStream_t stream) {
  const int wph = warps_per_head_of<float, 256>(p);
  const DirectGrid g = direct_grid(p.num_heads_total() * wph, p.device.index,
                                   "recurrent: too many tiles for one launch");
  launch_kernel(recurrent_direct_fmt_kernel<256>, static_cast<unsigned>(g.ctas), g.warps * 32, 0,
                stream, p.pdl, with_pdl_trigger(p, g.ctas, g.resident), wph);
  advance_step_after(p, stream);
}

#if DELTASTATE_CUDA_ALL_KERNELS
// Inputs of one dtype (q, k, v, gate input, beta all of dtype t): the typed fast paths.
bool inputs_are(const RecurrentProblem& p, DType t) {
  return p.q.dtype == t && p.k.dtype == t && p.v.dtype == t && p.g.dtype == t && p.beta.dtype == t;
}
#endif

// Decode kernels: which one runs a decode-shaped problem (decode_shaped). By default the
// register decode kernel, and the streaming kernel for 16-bit states from kStreamMinHeads
// (sequence, head) pairs up (KDA: kStreamMinHeadsKda); DELTASTATE_CUDA_DECODE forces one
// (tuning.h).
// One token per sequence (T = 1, no cu_seqlens) in place on the pool (no dense final-state
// copy), 16-byte aligned rows, K = 64 or 128.
template <class StateT>
bool decode_shaped(const RecurrentProblem& p) {
  return p.T == 1 && !p.cu_seqlens && p.state.ptr && p.update_state && !p.final_state &&
         state_rows_aligned<StateT>(p.state) && (p.K == 64 || p.K == 128);
}

template <class StateT>
DecodeChoice decode_kernel_for(const RecurrentProblem& p) {
  if (!decode_shaped<StateT>(p)) return DecodeChoice::direct;
  const DecodeChoice f = forced_decode_kernel();
  if (f != DecodeChoice::automatic) return f;
  const int64_t min_heads = p.gate.kda ? kStreamMinHeadsKda : kStreamMinHeads;
  return sizeof(StateT) == 2 && p.num_heads_total() >= min_heads ? DecodeChoice::stream
                                                                 : DecodeChoice::decode;
}

// A quantized pool on a decode-shaped problem (decode_shaped): the quantized decode kernel
// (tensor-core dots; K = 64 in builds with every kernel; DELTASTATE_CUDA_DECODE=direct: the direct
// kernel's formatted twin). False where it does not apply.
template <class Code>
bool launch_decode_quant(const RecurrentProblem& p, cudaStream_t stream) {
  if (p.state.dtype != Code::dtype || decode_kernel_for<Code>(p) == DecodeChoice::direct)
    return false;
  const QuantDecodeChoice q = forced_quant_decode_kernel();
  if (p.K == 128) {
    launch_quant_decode_k<Code::dtype, 128>(p, q, stream);
  } else {
#if DELTASTATE_CUDA_ALL_KERNELS
    launch_quant_decode_k<Code::dtype, 64>(p, q, stream);
#else
    return false;
#endif
  }
  advance_step_after(p, stream);
  return true;
}

template <class StateT, class In>
bool launch_decode_k(const RecurrentProblem& p, DecodeChoice c, cudaStream_t stream) {
  if (p.K == 128) {
    if (c == DecodeChoice::stream) return launch_stream<StateT, 128, In>(p, stream), true;
    return launch_decode<StateT, 128, In>(p, stream), true;
  }
#if DELTASTATE_CUDA_ALL_KERNELS
  if (p.K == 64) {
    if (c == DecodeChoice::stream) return launch_stream<StateT, 64, In>(p, stream), true;
    return launch_decode<StateT, 64, In>(p, stream), true;
  }
#endif
  return false;
}

#if DELTASTATE_CUDA_ALL_KERNELS
template <class StateT, class In>
bool launch_fast(const RecurrentProblem& p, cudaStream_t stream) {
  if (!state_rows_aligned<StateT>(p.state)) return false;
  if (p.K == 128) return launch_direct<StateT, 128, true, In>(p, stream), true;
  if (p.K == 64) return launch_direct<StateT, 64, true, In>(p, stream), true;
  return false;
}
#endif

// Kernel choice: for decode-shaped problems the register decode kernel or the streaming kernel
// (typed inputs: all bf16 or all fp32; CI builds compile only their fp32-state, K = 128,
// any-input instantiations); otherwise a direct register kernel (the multi-token path), fast when
// the inputs share one dtype, K is 64 or 128 and the rows are 16-byte aligned, else generic (any
// K <= 256, any input dtypes). DELTASTATE_CUDA_ALL_KERNELS=OFF (CI) compiles the generic ones.
template <class StateT>
void dispatch(const RecurrentProblem& p, cudaStream_t stream) {
  const DecodeChoice c = decode_kernel_for<StateT>(p);
  if (c != DecodeChoice::direct) {
#if DELTASTATE_CUDA_ALL_KERNELS
    if (inputs_are(p, DType::bf16) &&
        launch_decode_k<StateT, TypedInput<__nv_bfloat16>>(p, c, stream))
      return;
    if (inputs_are(p, DType::f32) && launch_decode_k<StateT, TypedInput<float>>(p, c, stream))
      return;
#endif
    if (std::is_same_v<StateT, float> && launch_decode_k<float, AnyInput>(p, c, stream)) return;
  }
#if DELTASTATE_CUDA_ALL_KERNELS
  if (inputs_are(p, DType::bf16) && launch_fast<StateT, TypedInput<__nv_bfloat16>>(p, stream))
    return;
  if (inputs_are(p, DType::f32) && launch_fast<StateT, TypedInput<float>>(p, stream)) return;
#endif
  launch_direct<StateT, 256, false, AnyInput>(p, stream);
}

}  // namespace

#if DELTASTATE_CUDA_STREAM_TRACE
void stream_trace_reset() {
  void* trace = nullptr;
  DS_CUDA_CHECK(cudaGetSymbolAddress(&trace, g_stream_trace));
  DS_CUDA_CHECK(cudaMemset(trace, 0, sizeof(g_stream_trace)));
}
std::vector<long long> stream_trace_read() {
  std::vector<long long> v(static_cast<size_t>(kStreamTraceCtas) * kStreamTraceTiles *
                           kStreamTracePoints);
  DS_CUDA_CHECK(cudaMemcpyFromSymbol(v.data(), g_stream_trace, v.size() * sizeof(long long)));
  return v;
}
#endif

void run_recurrent(const RecurrentProblem& problem, void* stream) {
  DeviceGuard guard(problem.device.index);
  const bool formatted =
      problem.state.ptr && (problem.state.dtype == DType::f8e4m3 ||
                            problem.state.dtype == DType::i8 || problem.state.stochastic);
  // Multi-token sequences in a pool: the multi-token kernel (src/cuda/verify.cu) where it applies.
  if (!formatted && run_recurrent_multi_token(problem, stream)) return;
  RecurrentProblem p = problem;
  p.errors = device_errors(p.device.index);  // where the kernels record a bad row (errors.cu)
  auto s = static_cast<cudaStream_t>(stream);
  if (formatted) {
    if (launch_decode_quant<QuantCode<DType::f8e4m3>>(p, s) ||
        launch_decode_quant<QuantCode<DType::i8>>(p, s))
      return;
    return launch_direct_fmt(p, s);
  }
  // Without a state pool the kernel starts from zeros; the state dtype then only selects the
  // register layout, so use fp32.
  const DType sd = p.state.ptr ? p.state.dtype : DType::f32;
  with_state_type(sd, [&](auto state) { dispatch<decltype(state)>(p, s); });
}

}  // namespace deltastate::cuda_backend
