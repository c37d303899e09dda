// Launch of the Hopper chunked prefill (chunk_prefill/hopper_prep.cuh, hopper_prep_kda.cuh,
// hopper_scan.cuh): the prep kernel over (chunk slot, value-head pair; KDA: value head), then the
// warp-specialized wgmma scan over (sequence, value head), through the workspace. Its own
// translation unit: the only one that includes CUTLASS's CuTe, compiled for sm_90a alone
// (CMakeLists.txt), and run only on devices of compute capability 9.0 (wgmma, setmaxnreg and the
// TMA have no other target here).
#include "cuda/chunk_prefill_hopper.h"

#include <cutlass/numeric_types.h>

#include <algorithm>

#include "cuda/chunk_prefill/hopper_combine.cuh"
#include "cuda/chunk_prefill/hopper_prep.cuh"
#include "cuda/chunk_prefill/hopper_prep_kda.cuh"
#include "cuda/chunk_prefill/hopper_scan.cuh"
#include "cuda/launch.h"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

using detail::ChunkPrefillProblem;

namespace {

using namespace prefill::hopper;

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// A per-token input the TMA can read: 16-byte aligned base and strides (in elements of 2 bytes:
// multiples of 8), positive strides of the extents it walks.
template <class Head>
bool tma_readable(const Head& t, const ChunkPrefillProblem& p, int64_t heads) {
  if (!aligned16(t.ptr)) return false;
  auto ok = [](int64_t stride, int64_t extent) {
    return extent <= 1 || (stride > 0 && stride % 8 == 0 && stride < (int64_t{1} << 39));
  };
  const int64_t N = p.cu_seqlens ? 1 : p.N;
  return ok(t.tok_stride, p.T) && ok(t.head_stride, heads) && ok(t.seq_stride, N);
}

// A stride the TMA accepts for a mode of extent 1 (never walked).
int64_t tma_stride(int64_t stride, int64_t extent) { return extent <= 1 ? 8 : stride; }

// Context parallelism (ScanPass): for one sequence whose heads' scan CTAs fill few SMs, segments
// as many as one wave of the segments pass holds, of at least 8 chunks (512 tokens), and only
// four or more: the transfer pass scans all but the last segment twice, so fewer segments do not
// pay. Where the heads' scan CTAs (V split included) leave fewer than 4 segments a wave, the V
// split alone is faster: H100, Qwen3-Next 1x8192 (64 V-split CTAs) 279 µs a call against 381
// with 4 segments of 32 chunks, 1x32768 1050 against 1242 (docs/PERFORMANCE.md).
// DELTASTATE_CUDA_PREFILL_CP=<chunks> forces segments of that many chunks (tests), =off none.
// KDA takes none (the transfer pass is GDN's).
struct CpPlan {
  int segs = 1, seg_chunks = 0;
  bool on() const { return segs > 1; }
};
CpPlan cp_plan(int64_t N, int64_t HV, int64_t T, bool kda, int sms) {
  const int forced = prefill_cp_chunks();
  const int64_t chunks = (T + kC - 1) / kC;
  if (kda || N != 1 || forced == 0 || chunks < 2) return {};
  int64_t seg_chunks = forced;
  if (forced < 0) {
    const int64_t ctas = HV * (prefill_vsplit_pays(HV, sms) ? 2 : 1);
    const int64_t segs = std::min<int64_t>(sms / ctas, chunks / 8);
    if (segs < 4) return {};
    seg_chunks = (chunks + segs - 1) / segs;
  }
  const int64_t segs = (chunks + seg_chunks - 1) / seg_chunks;
  if (segs < 2 || segs * HV > 0x7fffffffLL / 4) return {};
  return {static_cast<int>(segs), static_cast<int>(seg_chunks)};
}
int64_t cp_bytes(const CpPlan& cp, int64_t HV) {
  return cp.on() ? (2 * int64_t{cp.segs - 1} + 1) * HV * kD * kD * 4 : 0;
}

template <class In, class E, int G, bool KDA>
void launch(const ChunkPrefillProblem& p, int64_t slots, const CpPlan& cp, cudaStream_t stream) {
  using Lay = ScanLayout<E, G, KDA>;
  using Params = ScanParams<E, G, KDA>;
  const int64_t blocks = slots * p.HV;
  auto prep = prefill::hopper::chunk_prefill_hopper_prep_kernel<In>;
  auto prep_kda = prefill::hopper::chunk_prefill_hopper_prep_kda_kernel<In>;
  auto scan = prefill::hopper::chunk_prefill_hopper_scan_kernel<E, G, KDA>;
  // The kernels opted into their shared memory once per device; one scan CTA fits an SM (its
  // shared memory), which the early-trigger rule of PDL reads.
  static PerDeviceOnce opted;
  const int resident = opted.get(p.device.index, [=] {
    if constexpr (KDA)
      DS_CUDA_CHECK(cudaFuncSetAttribute(prep_kda, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         PrepKdaLayout::SMEM));
    else
      DS_CUDA_CHECK(cudaFuncSetAttribute(prep, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         PrepLayout::SMEM));
    DS_CUDA_CHECK(
        cudaFuncSetAttribute(scan, cudaFuncAttributeMaxDynamicSharedMemorySize, Lay::kSmem));
    DS_CUDA_CHECK(cudaFuncSetAttribute(chunk_prefill_hopper_combine_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kCombineSmem));
    return 1;
  });
  if constexpr (KDA) {
    if (slots > 0)
      launch_kernel(prep_kda, dim3(static_cast<unsigned>(slots), static_cast<unsigned>(p.HV)),
                    dim3(PrepKdaLayout::THREADS), PrepKdaLayout::SMEM, stream, p.pdl, p, slots);
  } else {
    // a prep CTA makes the blocks of the two value heads that share a key head (GVA) where there
    // are two
    const int nv = (p.HV / p.H) % PrepLayout::NV == 0 ? PrepLayout::NV : 1;
    if (slots > 0)
      launch_kernel(prep, dim3(static_cast<unsigned>(slots), static_cast<unsigned>(p.HV / nv)),
                    dim3(PrepLayout::THREADS), PrepLayout::SMEM, stream, p.pdl, p, slots, nv);
  }

  const int T = static_cast<int>(p.T), N = p.cu_seqlens ? 1 : p.N;
  auto view = [&](const auto& t, int heads) {
    return head_view<const E>(static_cast<const E*>(t.ptr), T, heads, N,
                              tma_stride(t.tok_stride, T), tma_stride(t.head_stride, heads),
                              tma_stride(t.seq_stride, N));
  };
  const BlockPtrs ws = block_ptrs(p.workspace, blocks, 0);
  Params params{};
  params.p = p;
  if constexpr (KDA) {  // the prep's decayed q, k and update keys, [slots * C, D, HV, 1]
    const int rows = static_cast<int>(slots * kC);
    auto ws_view = [&](void* a) {
      return head_view<const E>(static_cast<const E*>(a), rows, static_cast<int>(p.HV), 1, kD,
                                int64_t{rows} * kD, 8);
    };
    params.q = make_tma_copy(SM90_TMA_LOAD{}, ws_view(ws.qg), typename Lay::InTile{});
    params.k = make_tma_copy(SM90_TMA_LOAD{}, ws_view(ws.kg), typename Lay::InTile{});
    params.kd = make_tma_copy(SM90_TMA_LOAD{}, ws_view(ws.kd), typename Lay::InTile{});
  } else {
    params.q = make_tma_copy(SM90_TMA_LOAD{}, view(p.q, p.H), typename Lay::InTile{});
    params.k = make_tma_copy(SM90_TMA_LOAD{}, view(p.k, p.H), typename Lay::InTile{});
  }
  params.v = make_tma_copy(SM90_TMA_LOAD{}, view(p.v, p.HV), typename Lay::VTile{});
  const int nb = static_cast<int>(blocks);
  params.t = make_tma_copy(SM90_TMA_LOAD{}, matrix_view<E>(static_cast<const E*>(ws.t), nb),
                           typename Lay::MatTile{});
  params.pm = make_tma_copy(SM90_TMA_LOAD{}, matrix_view<E>(static_cast<const E*>(ws.p), nb),
                            typename Lay::MatTile{});
  params.scal = make_tma_copy(SM90_TMA_LOAD{}, scalar_view(ws.scal, nb), typename Lay::ScalTile{});
  // whole chunks leave by TMA stores where the output is in the input dtype and TMA-writable
  params.tma_out = prefill_tma_out() && p.out.dtype == p.q.dtype && tma_readable(p.out, p, p.HV);
  if (params.tma_out)
    params.o = make_tma_copy(
        SM90_TMA_STORE{},
        head_view<E>(static_cast<E*>(p.out.ptr), T, p.HV, N, tma_stride(p.out.tok_stride, T),
                     tma_stride(p.out.head_stride, p.HV), tma_stride(p.out.seq_stride, N)),
        typename Lay::OutTile{});
  params.in_T = T;
  params.in_N = N;
  params.slots = slots;
  params.ordered = prefill_ordered_math();
  params.pass = ScanPass::whole;
  params.segs = cp.segs;
  params.seg_chunks = cp.seg_chunks;
  params.cp = reinterpret_cast<float*>(static_cast<unsigned char*>(p.workspace) +
                                       hopper_prefill_workspace_bytes(slots, p.HV, KDA));
  int64_t ctas = p.num_heads_total() * Lay::kSplit;
  if (cp.on()) {  // transfer pass, combine, then the segments
    params.pass = ScanPass::transfer;
    params.trigger_early = false;
    launch_kernel(scan, dim3(static_cast<unsigned>(2 * (cp.segs - 1) * ctas)), dim3(Lay::kThreads),
                  Lay::kSmem, stream, p.pdl, params);
    launch_kernel(chunk_prefill_hopper_combine_kernel,
                  dim3(kD / kCombineRows, static_cast<unsigned>(p.HV)), dim3(kCombineThreads),
                  kCombineSmem, stream, p.pdl, p, params.cp, cp.segs);
    params.pass = ScanPass::segments;
    ctas *= cp.segs;
  }
  params.trigger_early = p.pdl && pdl_trigger_early(ctas, resident, p.device.index);
  launch_kernel(scan, dim3(static_cast<unsigned>(ctas)), dim3(Lay::kThreads), Lay::kSmem, stream,
                p.pdl, params);
}

// Whether the Hopper kernels run this problem: hopper_prefill_shapes, q/k/v all bf16 (or all
// fp16 in the full build) with TMA-readable strides, output rows the bulk copies can write (KDA:
// in the input dtype, its scan's staging rows), TMA coordinates in 32 bits, the scan's shared
// memory on the device.
bool hopper_prefill_applies(const ChunkPrefillProblem& p) {
  if (!hopper_prefill_shapes(p.K, p.V, p.device.index)) return false;
#if DELTASTATE_CUDA_ALL_KERNELS
  const bool dtype_ok = p.q.dtype == DType::bf16 || p.q.dtype == DType::f16;
#else
  const bool dtype_ok = p.q.dtype == DType::bf16;
#endif
  if (!dtype_ok || p.k.dtype != p.q.dtype || p.v.dtype != p.q.dtype) return false;
  if (p.gate.kda && p.out.dtype != p.q.dtype) return false;
  if (!tma_readable(p.q, p, p.H) || !tma_readable(p.k, p, p.H) || !tma_readable(p.v, p, p.HV))
    return false;
  // output rows leave as 16-byte aligned bulk copies of 64 elements
  const int64_t oe = dtype_size(p.out.dtype);
  auto row16 = [oe](int64_t stride, int64_t extent) {
    return extent <= 1 || stride * oe % 16 == 0;
  };
  if (!aligned16(p.out.ptr) || !row16(p.out.tok_stride, p.T) || !row16(p.out.head_stride, p.HV) ||
      !row16(p.out.seq_stride, p.cu_seqlens ? 1 : p.N))
    return false;
  // TMA coordinates are 32-bit: tokens, and the workspace's rows (blocks * 64)
  const int64_t slots = prefill::split_chunk_slots(p);
  const int smem =
      p.gate.kda ? std::max(ScanLayout<cutlass::bfloat16_t, 2, true>::kSmem, PrepKdaLayout::SMEM)
                 : ScanLayout<cutlass::bfloat16_t, 2>::kSmem;
  return p.T < (int64_t{1} << 31) && slots * p.HV * kC < (int64_t{1} << 31) &&
         smem <= max_smem_optin(p.device.index);
}

template <class In, class E>
void launch_shape(const ChunkPrefillProblem& p, int64_t slots, const CpPlan& cp, bool split,
                  cudaStream_t stream) {
  if (p.gate.kda) {
    if (split) launch<In, E, 1, true>(p, slots, cp, stream);
    else launch<In, E, 2, true>(p, slots, cp, stream);
  } else {
    if (split) launch<In, E, 1, false>(p, slots, cp, stream);
    else launch<In, E, 2, false>(p, slots, cp, stream);
  }
}

}  // namespace

int64_t hopper_prefill_workspace_bytes(int64_t slots, int64_t HV, bool kda) {
  return Blocks::bytes(slots * HV, kda);
}

int64_t hopper_prefill_cp_workspace_bytes(int64_t N, int64_t HV, int64_t T, bool kda, int device) {
  return cp_bytes(cp_plan(N, HV, T, kda, num_sms(device)), HV);
}

bool hopper_prefill_shapes(int K, int V, int device) {
  const PrefillChoice forced = forced_prefill_kernel();
  if (forced != PrefillChoice::automatic && forced != PrefillChoice::hopper) return false;
  return K == kD && V == kD && compute_capability(device) == 90;
}

bool run_hopper_prefill(const ChunkPrefillProblem& p, cudaStream_t stream) {
  if (!hopper_prefill_applies(p)) return false;
  const int64_t slots = prefill::split_chunk_slots(p);
  const int64_t blocks_bytes = hopper_prefill_workspace_bytes(slots, p.HV, p.gate.kda);
  if (!p.workspace || !aligned16(p.workspace) || p.workspace_bytes < blocks_bytes) return false;
  const int sms = num_sms(p.device.index);
  // context parallelism where planned and the workspace holds its states (sized by
  // hopper_prefill_cp_workspace_bytes, it does)
  CpPlan cp = cp_plan(p.N, p.HV, p.T, p.gate.kda, sms);
  if (p.workspace_bytes < blocks_bytes + cp_bytes(cp, p.HV)) cp = CpPlan{};
  // The V split where the whole heads' CTAs would fill at most half of the GPU.
  const bool split = prefill_vsplit_pays(p.num_heads_total(), sms);
  if (p.q.dtype == DType::bf16) {
    launch_shape<__nv_bfloat16, cutlass::bfloat16_t>(p, slots, cp, split, stream);
    return true;
  }
#if DELTASTATE_CUDA_ALL_KERNELS
  launch_shape<__half, cutlass::half_t>(p, slots, cp, split, stream);
  return true;
#else
  return false;
#endif
}

}  // namespace deltastate::cuda_backend
