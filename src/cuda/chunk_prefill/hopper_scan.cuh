// The Hopper scan kernel of GDN chunked prefill (K = V = 128, q/k/v all bf16 or all fp16): one
// CTA per (sequence, value head) walks the sequence's chunks in order with the fp32 state on
// chip, on wgmma with TMA loads through an mbarrier pipeline (CUTLASS's CuTe). Part of
// chunk_prefill_hopper.cu's translation unit; hopper_prep.cuh makes what it reads besides q, k, v.
// One sequence with few heads takes context parallelism instead (ScanPass below): its segments
// scanned in parallel from their exact start states (hopper_combine.cuh chains them).
//
// ---- design ------------------------------------------------------------------------------------
// Warp specialization, 384 threads: warp group 0 is the producer (one thread issues the TMA
// loads of a chunk into a free stage: q, k, v straight from the caller's tensors, and the prep
// kernel's Tb, P and per-token factors from the workspace; warps 1 and 2 store the output),
// warp groups 1 and 2 are the consumers, each holding 64 of the 128 rows of the transposed state
// S [V, K] as fp32 wgmma accumulators (64 registers a thread) for the whole sequence. setmaxnreg
// moves registers from the producer (56) to the consumers (224). The consumers can take turns
// issuing their products (ordered math, named barriers: one's epilogue under the other's
// products), off by default: it measured no faster than the two issuing freely. Per chunk of
// C = 64 tokens a consumer runs five products (m64, its rows v; the chunk algebra of
// src/cpu/chunk_prefill.cpp, its names):
//   X1 = S K^T,  X2 = S Q^T                        RS: A = bf16(S) from the accumulators
//   v'^T = V^T Tb^T - bf16(a * X1) Tb^T           SS (A = v, MN-major) then RS, one accumulator
//   o^T = b * X2 + bf16(v'^T) P^T                  RS, onto X2's accumulator
//   S = gamma S + bf16(v'^T d) K                   RS, B = k MN-major (the same bytes as X1's B)
// with the per-token factors a_t = rk_t e^{G_t}, b_t = rq_t e^{G_t}, d_s = rk_s e^{G_L - G_s},
// gamma = e^{G_L}, Tb = (I + A)^{-1} diag(beta) and P_ts = rq_t rk_s e^{G_t - G_s} (q_t . k_s),
// s <= t, all from the prep kernel (zeros for tokens past the sequence's end, so the rows a tail
// chunk's TMA box reads beyond it contribute exact zeros). An accumulator's fp32 values become
// the next product's A operand in registers: the m64nNk16 accumulator layout holds, per 16
// columns, exactly the k16 A fragment (see acc_to_a). Every product's B operand and V^T are read
// from the stage by the tensor cores; nothing but the output goes through shared memory: o^T is
// staged [t][v] in the output dtype (two buffers a consumer), and the consumer's storer warp
// sends it out, so no consumer waits on a store: a whole chunk of an output in the input dtype by
// one TMA store of the group's 64 x 64 box (128-byte swizzled, out_box_byte), a partial last
// chunk or another output dtype by bulk copies (cp.async.bulk) of its valid rows.
//
// Precision: the state, every accumulation and the factors are fp32; the tensor-core operands
// that are not raw inputs are rounded to the input dtype (S, a * X1, v', v' d, Tb, P), as
// FlashInfer's SM90 kernel rounds them.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/problem.h"
#include "cuda/chunk_prefill/split.cuh"
#include "cuda/grid.cuh"
#include "cuda/state_format.cuh"

namespace deltastate::cuda_backend::prefill::hopper {

using namespace cute;

constexpr int kC = detail::ChunkPrefillProblem::kChunk;  // 64 tokens per chunk
constexpr int kD = 128;                                  // K = V
constexpr int kStages = 2;
// The output staging of one consumer warp group: two buffers (chunks alternate) of 64 token rows
// of its 64 columns in the output dtype, rows padded by 16 bytes so that the warp's writes of
// one accumulator value (4 token rows 2 apart, 8 columns) fall in distinct banks: room for fp32
// rows, or (KDA, whose stage holds a third [C][D] tile: the output in the input dtype only) for
// 16-bit rows.
template <bool KDA>
struct OutStaging {
  static constexpr int kRow = 64 * (KDA ? 2 : 4) + 16;  // bytes per staged row
  static constexpr int kBuf = kC * kRow;
};
static_assert(OutStaging<false>::kBuf % 1024 == 0 && OutStaging<true>::kBuf % 1024 == 0,
              "staging buffers at 1024-byte boundaries");

// Named barriers (ids 1-15; no CUTLASS collective of this kernel uses them): per consumer warp
// group g and staging buffer b, "full" (the group wrote it; the storer warp may copy it out) and
// "empty" (the copy has read it); per group, its turn to issue products (ordered math).
__device__ __forceinline__ int bar_full(int g, int b) { return 1 + 2 * g + b; }
__device__ __forceinline__ int bar_empty(int g, int b) { return 5 + 2 * g + b; }
__device__ __forceinline__ int bar_turn(int g) { return 9 + g; }
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The prep kernel's blocks in the workspace, one per (value head, chunk slot) b = hv * slots + j:
// three arrays, Tb [blocks][C][C] and P [blocks][C][C] in the input dtype, then the per-token
// factors [blocks][4][C] fp32 (GDN: rows a, b, d; row 3 holds gamma in its first entry; KDA:
// rows 2 and 3 hold gamma = e^{G_L} per key channel, [D]); KDA then has three more arrays
// [blocks][C][D] in the input dtype: the decayed queries q^ e^{G}, keys k^ e^{G} and the update's
// keys k^ e^{G_L - G} (hopper_prep_kda.cuh).
struct Blocks {
  static constexpr int64_t kMatBytes = int64_t{kC} * kC * 2;
  static constexpr int64_t kScalBytes = 4 * int64_t{kC} * 4;
  static constexpr int64_t kRowsBytes = int64_t{kC} * kD * 2;  // KDA: one [C][D] array's block
  static constexpr int64_t kBytes = 2 * kMatBytes + kScalBytes;
  static constexpr int64_t bytes(int64_t blocks, bool kda = false) {
    return blocks * (kBytes + (kda ? 3 * kRowsBytes : 0));
  }
  static constexpr int64_t p_offset(int64_t blocks) { return blocks * kMatBytes; }
  static constexpr int64_t scal_offset(int64_t blocks) { return 2 * blocks * kMatBytes; }
  // KDA's array i (0: q^ e^{G}, 1: k^ e^{G}, 2: k^ e^{G_L - G})
  static constexpr int64_t rows_offset(int64_t blocks, int i) {
    return blocks * kBytes + i * blocks * kRowsBytes;
  }
};
// Block b's parts (b = hv * slots + j; b = 0: the arrays' starts); qg, kg, kd only with KDA.
struct BlockPtrs {
  void* t;
  void* p;
  float* scal;
  void* qg;
  void* kg;
  void* kd;
};
__host__ __device__ __forceinline__ BlockPtrs block_ptrs(void* workspace, int64_t blocks,
                                                         int64_t b) {
  unsigned char* const w = static_cast<unsigned char*>(workspace);
  auto rows = [&](int i) { return w + Blocks::rows_offset(blocks, i) + b * Blocks::kRowsBytes; };
  return {w + b * Blocks::kMatBytes,
          w + Blocks::p_offset(blocks) + b * Blocks::kMatBytes,
          reinterpret_cast<float*>(w + Blocks::scal_offset(blocks)) + b * 4 * kC,
          rows(0),
          rows(1),
          rows(2)};
}

// The shape of one scan CTA: G consumer warp groups (64 state rows each) of a value head's
// 128, so 2 / G CTAs per (sequence, value head). G = 2 takes the whole head; G = 1 half of it
// (the V split: the state's rows are independent, so two CTAs run a head's halves with no
// communication, each reading the chunk's q, k and its half of v). Shared-memory layouts of one
// element type E (cutlass::bfloat16_t or half_t). KDA: q and k are the prep's decayed q^ e^{G}
// and k^ e^{G} (no per-token factors a, b, d), and a third tile, the update's keys
// k^ e^{G_L - G}, follows k's stages in the same array.
template <class E, int G, bool KDA = false>
struct ScanLayout {
  static_assert(G == 1 || G == 2, "one or two consumer warp groups");
  static constexpr int kSplit = 2 / G, kThreads = 128 * (1 + G);
  static constexpr int kVCols = 64 * G;  // the CTA's state rows (its columns of v and o)
  // q, k, v chunk tiles [t][c] (c contiguous; K-major for the products' B), 128-byte swizzle
  using In = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{},
                                    Shape<Int<kC>, Int<kD>, Int<kStages>>{}));
  using Vt = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{},
                                    Shape<Int<kC>, Int<kVCols>, Int<kStages>>{}));
  // The same bytes as [c][t]: k as the state update's B (N = c, K = s) and v as V^T's A
  // (M = v, K = s), both MN-major; the tiles' order (t blocks of 8 first) matches In's.
  using InT = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<E>{},
                                     Shape<Int<kD>, Int<kC>, Int<kStages>>{}, Step<_2, _1, _3>{}));
  using VtT =
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<E>{},
                             Shape<Int<kVCols>, Int<kC>, Int<kStages>>{}, Step<_2, _1, _3>{}));
  // Tb and P [t][s] (s contiguous: K-major B)
  using Mat = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{},
                                     Shape<Int<kC>, Int<kC>, Int<kStages>>{}));
  // the per-token factors [4][C] fp32 (TMA: (C, 4) column-major)
  using Scal = Layout<Shape<Int<kC>, _4, Int<kStages>>>;
  using InTile = decltype(take<0, 2>(In{}));
  using VTile = decltype(take<0, 2>(Vt{}));
  using MatTile = decltype(take<0, 2>(Mat{}));
  using ScalTile = decltype(take<0, 2>(Scal{}));
  // One consumer group's output of a chunk, o [t][v] (64 tokens x its 64 columns) in the input
  // dtype, 128-byte swizzled: the box of one TMA store (an output in the input dtype).
  using OutTile = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{}, Shape<Int<kC>, _64>{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  struct alignas(1024) Storage {
    cute::array_aligned<E, cosize_v<In>, 1024> q;
    cute::array_aligned<E, cosize_v<In>*(KDA ? 2 : 1), 1024> k;  // KDA: k^ e^{G}, then k^ e^{G_L-G}
    cute::array_aligned<E, cosize_v<Vt>, 1024> v;
    cute::array_aligned<E, cosize_v<Mat>, 1024> t, p;
    cute::array_aligned<float, cosize_v<Scal>, 128> scal;
    cute::array_aligned<unsigned char, G * 2 * OutStaging<KDA>::kBuf, 1024> out;  // o staged [t][v]
    typename Pipeline::SharedStorage pipe;
  };
  static constexpr int kSmem = static_cast<int>(sizeof(Storage));
  static_assert(offsetof(Storage, out) % 1024 == 0, "the output staging 1024-byte aligned");
  static constexpr uint32_t kStageBytes = static_cast<uint32_t>(
      ((KDA ? 3 : 2) * cosize_v<InTile> + cosize_v<VTile> + 2 * cosize_v<MatTile>)*sizeof(E) +
      cosize_v<ScalTile> * sizeof(float));

  // The products of one consumer warp group (its 64 rows of S): X1, X2, v' P^T and the second
  // half of v' (RS 64x64), V^T Tb^T (SS, A MN-major), the state update (RS 64x128, B MN-major).
  using MmaX = decltype(make_tiled_mma(
      GMMA::rs_op_selector<E, E, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::K>()));
  using MmaV = decltype(make_tiled_mma(
      GMMA::ss_op_selector<E, E, float, Shape<_64, _64, _16>, GMMA::Major::MN, GMMA::Major::K>()));
  using MmaS = decltype(make_tiled_mma(
      GMMA::rs_op_selector<E, E, float, Shape<_64, _128, _16>, GMMA::Major::K, GMMA::Major::MN>()));
};

// The global tensors the TMA reads and writes, as CuTe views: a per-token tensor [T, D, heads, N]
// with the caller's strides (c contiguous; E const for the inputs q, k, v, E for the output o the
// TMA store writes), and the workspace's [blocks * C, C] matrices and [C, blocks * 4] factors.
template <class E>
auto head_view(E* ptr, int T, int heads, int N, int64_t tok, int64_t head, int64_t seq) {
  return make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(T, Int<kD>{}, heads, N),
                                                     make_stride(tok, _1{}, head, seq)));
}
template <class E>
auto matrix_view(const E* ptr, int blocks) {
  return make_tensor(make_gmem_ptr(ptr),
                     make_layout(make_shape(blocks * kC, Int<kC>{}), make_stride(Int<kC>{}, _1{})));
}
inline auto scalar_view(const float* ptr, int blocks) {
  return make_tensor(make_gmem_ptr(ptr),
                     make_layout(make_shape(Int<kC>{}, blocks * 4), make_stride(_1{}, Int<kC>{})));
}

// What a scan launch computes. `whole`: every (sequence, value head) from its initial state.
// Context parallelism for one sequence (hopper_cp.cuh) splits it into `segs` segments of
// `seg_chunks` chunks and takes three launches: `transfer` scans every segment but the last twice
// from its own start, once from the identity with v = 0 (its transfer matrix M, as the state
// update is affine: S_end = S_start M + N) and once from zero (N), without outputs, into the
// workspace; the combine kernel chains them into every segment's exact start state; `segments`
// then scans every segment from that state with its outputs, checkpoints and (the last) final
// state.
enum class ScanPass { whole, transfer, segments };

template <class E, int G, bool KDA = false>
struct ScanParams {
  using Lay = ScanLayout<E, G, KDA>;
  using TmaIn = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, head_view<const E>(nullptr, 1, 1, 1, 8, 8, 8), typename Lay::InTile{}));
  using TmaV = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, head_view<const E>(nullptr, 1, 1, 1, 8, 8, 8), typename Lay::VTile{}));
  using TmaMat =
      decltype(make_tma_copy(SM90_TMA_LOAD{}, matrix_view<E>(nullptr, 1), typename Lay::MatTile{}));
  using TmaScal =
      decltype(make_tma_copy(SM90_TMA_LOAD{}, scalar_view(nullptr, 1), typename Lay::ScalTile{}));
  using TmaOut = decltype(make_tma_copy(SM90_TMA_STORE{}, head_view<E>(nullptr, 1, 1, 1, 8, 8, 8),
                                        typename Lay::OutTile{}));
  detail::ChunkPrefillProblem p;
  TmaIn q, k;  // KDA: the workspace's q^ e^{G}, k^ e^{G} as [slots * C, D, HV, 1]
  TmaIn kd;    // KDA: the workspace's k^ e^{G_L - G}
  TmaV v;
  TmaMat t, pm;
  TmaScal scal;
  TmaOut o;            // the output's TMA store, where `tma_out`
  bool tma_out;        // o in the input dtype, TMA-writable: whole chunks leave by one TMA store
  int in_T, in_N;      // the inputs' token and sequence extents (TMA coordinates)
  int64_t slots;       // chunk slots (hopper_prep.cuh)
  bool trigger_early;  // PDL (grid.cuh enter_grid)
  bool ordered;        // the consumers take turns issuing products (G = 2)
  ScanPass pass;
  int segs, seg_chunks;  // context parallelism (segs > 1)
  float* cp;  // [2][segs - 1][HV][V][K] fp32: the segments' M, then their N (replaced by the
              // next segment's start state by the combine kernel); then [HV][V][K], segment 0's
              // start: the combine's copy of the initial state
};

// Element offset of segment i's M (kind 0) or N (kind 1) head hv in ScanParams::cp; kind 2, i = 0:
// segment 0's start. Segment 0 reads its start there, not from the pool: the last segment stores
// the final state into the same pool slot in the same launch, and nothing orders the two when the
// segments' CTAs are not all resident at once (another stream's kernels on the SMs, or more
// segments than a wave).
__host__ __device__ __forceinline__ int64_t cp_offset(int segs, int HV, int kind, int i, int hv) {
  return ((int64_t{kind} * (segs - 1) + i) * HV + hv) * kD * kD;
}

// Where value i of thread t (of its warp group) sits in an m64nNk16 accumulator: CuTe's
// CLayout_64xN, written out so that the compiler sees a per-thread base plus a constant per value
// (tests/gpu/test_hopper_layouts.cu checks it against CuTe's layout).
__host__ __device__ __forceinline__ int acc_row(int t, int i) {
  return (t / 4) % 8 + 16 * (t / 32) + 8 * ((i / 2) % 2);
}
__host__ __device__ __forceinline__ int acc_col(int t, int i) {
  return 2 * (t % 4) + i % 2 + 8 * (i / 4);
}

// Byte offset of o's (token t, column v) in a consumer group's TMA-store box (OutTile: 16-bit
// elements, [t][v] with the 128-byte swizzle: row t's 16-byte chunk v / 8 at chunk (v / 8) ^
// (t % 8); the TMA applies it by the address bits of the 1024-byte aligned buffer). Written out
// so that a thread's 32 values are four per-thread bases plus constants (CuTe's layout function
// evaluated per element spilled); tests/gpu/test_hopper_layouts.cu checks it against OutTile.
__host__ __device__ __forceinline__ int out_box_byte(int t, int v) {
  return t * 128 + (((v >> 3) ^ (t & 7)) << 4) + (v & 7) * 2;
}

// The k16 A fragments of an m64nNk16 accumulator, rounded to E: CuTe's accumulator layout
// ((2, 2, N/8), 1, 1) holds per thread the values (row g + 8 i1, column 2 q + i0 + 8 i2), and
// the k16 A fragment ((2, 2, 2), 1, 1) of columns 16 kb.. the values (row g + 8 j1, column
// 16 kb + 2 q + j0 + 8 j2): the same registers in the same order, kb = i2 / 2. `f(i, x)` maps
// accumulator value i (its flat index) to the operand value.
template <class E, int N, class Acc, class F>
__device__ __forceinline__ auto acc_to_a(const Acc& acc, F&& f) {
  static_assert(N % 16 == 0, "whole k16 blocks");
  Tensor a = make_tensor<E>(
      Layout<Shape<Shape<_2, _2, _2>, _1, Int<N / 16>>, Stride<Stride<_1, _2, _4>, _0, _8>>{});
  CUTE_UNROLL
  for (int i = 0; i < N / 2; ++i) a(i) = static_cast<E>(f(i, acc(i)));
  return a;
}

// One warp group's product C (+)= A B over every k block of its operands: the wgmma of each k
// block issued in order, the accumulator (and a register A) fenced against reordering. The caller
// brackets a batch of these with warpgroup_arrive() and warpgroup_commit_batch() + wait.
// `zero_init` at run time: the first k block's scale-d operand (no branch around a wgmma: ptxas
// serializes the wgmma of a divergent path).
template <class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void wg_gemm(Mma& mma, TA&& A, const TB& B, TC& C, bool zero_init) {
  constexpr int KB = decltype(size<2>(A))::value;
  constexpr bool kRegA =
      !std::is_same_v<typename std::remove_reference_t<TA>::iterator, GMMA::DescriptorIterator>;
  if constexpr (kRegA) warpgroup_fence_operand(A);
  warpgroup_fence_operand(C);
  if (zero_init) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb = 0; kb < KB; ++kb) {
    cute::gemm(mma, A(_, _, kb), B(_, _, kb), C);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_fence_operand(C);
  if constexpr (kRegA) warpgroup_fence_operand(A);
}
template <bool ZeroInit, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void wg_gemm(Mma& mma, TA&& A, const TB& B, TC& C) {
  wg_gemm(mma, std::forward<TA>(A), B, C, ZeroInit);
}

// A consumer thread's 64 state values (its accumulator elements of 64 rows x 128 columns, rows
// from v0) between a [.., V, K] float tensor at element offset `off` and `vals`, out of line:
// they run once per sequence or checkpoint, and inlined at every call site, each element through
// every dtype's conversion, they made most of the kernel's code (the consumers' loop then misses
// the instruction cache: no-instruction stalls 32%, docs/PERFORMANCE.md). Inside, every load of
// a float state is issued before the first value is used (registers, then `vals`): one element
// at a time, each waiting on its load, the state's I/O took a quarter of the scan's stall samples
// (8x1024, H100). A pool slot in the pool's storage format comes as run-time data
// (cuda/state_format.cuh): `h` the head's rows (h.scales: quantized codes, dequantized on load;
// h.off replaces `off`), `formatted` set, 8 elements in flight at a time. A quantized row's
// amax: the thread's 32 values of the row and two quad shuffles (the 4 threads of a quad hold the
// row's 128 columns); all 128 threads of the warp group call it.
constexpr int kStateVals = 64;
constexpr int kFmtBatch = 8;
__device__ __forceinline__ int64_t state_val_offset(int v0, int ct, int i) {
  return int64_t{v0 + acc_row(ct, i)} * kD + acc_col(ct, i);
}
static __device__ __noinline__ void load_state_vals(const void* base, DType dtype, int64_t off,
                                                    int v0, int ct, float* vals, bool formatted,
                                                    fmt::HeadRows h) {
  if (formatted) {
#pragma unroll 1
    for (int i0 = 0; i0 < kStateVals; i0 += kFmtBatch) {
      float x[kFmtBatch];
#pragma unroll
      for (int j = 0; j < kFmtBatch; ++j) {
        const int i = i0 + j;
        x[j] = fmt::load_elem(base, dtype, h, v0 + acc_row(ct, i), state_val_offset(v0, ct, i));
      }
#pragma unroll
      for (int j = 0; j < kFmtBatch; ++j) vals[i0 + j] = x[j];
    }
    return;
  }
  float x[kStateVals];
  if (dtype == DType::f32) {
    const float* p = static_cast<const float*>(base) + off;
#pragma unroll
    for (int i = 0; i < kStateVals; ++i) x[i] = p[state_val_offset(v0, ct, i)];
  } else {  // bf16 or fp16 (a float state is one of the three: the contracts check it)
    const uint16_t* p = static_cast<const uint16_t*>(base) + off;
    const bool bf = dtype == DType::bf16;
#pragma unroll
    for (int i = 0; i < kStateVals; ++i) {
      const uint16_t u = p[state_val_offset(v0, ct, i)];
      x[i] = bf ? detail::bf16_to_float(u) : detail::f16_to_float(u);
    }
  }
#pragma unroll
  for (int i = 0; i < kStateVals; ++i) vals[i] = x[i];
}
static __device__ __noinline__ void store_state_vals(void* base, DType dtype, int64_t off, int v0,
                                                     int ct, const float* vals, bool formatted,
                                                     fmt::HeadRows h) {
  if (formatted) {
    // value i is in the thread's row (i / 2) % 2: v0 + acc_row(ct, 0), then 8 rows below
    float scale0 = 1.0f, scale1 = 1.0f;
    if (fmt::quantized(dtype)) {
      float a0 = 0.0f, a1 = 0.0f;
#pragma unroll 1
      for (int i = 0; i < kStateVals; i += 4) {
        a0 = detail::amax_step(detail::amax_step(a0, vals[i]), vals[i + 1]);
        a1 = detail::amax_step(detail::amax_step(a1, vals[i + 2]), vals[i + 3]);
      }
      a0 = detail::amax_step(a0, __shfl_xor_sync(0xffffffffu, a0, 1));
      a1 = detail::amax_step(a1, __shfl_xor_sync(0xffffffffu, a1, 1));
      a0 = detail::amax_step(a0, __shfl_xor_sync(0xffffffffu, a0, 2));
      a1 = detail::amax_step(a1, __shfl_xor_sync(0xffffffffu, a1, 2));
      scale0 = fmt::fresh_scale(dtype, a0);
      scale1 = fmt::fresh_scale(dtype, a1);
      if (ct % 4 == 0) {
        h.scales[v0 + acc_row(ct, 0)] = scale0;
        h.scales[v0 + acc_row(ct, 2)] = scale1;
      }
    }
#pragma unroll 1
    for (int i0 = 0; i0 < kStateVals; i0 += kFmtBatch) {
      float x[kFmtBatch];
#pragma unroll
      for (int j = 0; j < kFmtBatch; ++j) x[j] = vals[i0 + j];
#pragma unroll
      for (int j = 0; j < kFmtBatch; ++j)
        fmt::store_elem(base, dtype, h, state_val_offset(v0, ct, i0 + j), x[j],
                        ((i0 + j) & 2) ? scale1 : scale0);
    }
    return;
  }
  float x[kStateVals];
#pragma unroll
  for (int i = 0; i < kStateVals; ++i) x[i] = vals[i];
  if (dtype == DType::f32) {
    float* p = static_cast<float*>(base) + off;
#pragma unroll
    for (int i = 0; i < kStateVals; ++i) p[state_val_offset(v0, ct, i)] = x[i];
  } else {  // bf16 or fp16, rounded to nearest even
    uint16_t* p = static_cast<uint16_t*>(base) + off;
    const bool bf = dtype == DType::bf16;
#pragma unroll
    for (int i = 0; i < kStateVals; ++i)
      p[state_val_offset(v0, ct, i)] =
          bf ? detail::float_to_bf16(x[i]) : detail::float_to_f16(x[i]);
  }
}

template <class E, int G, bool KDA = false>
__global__ void __launch_bounds__(ScanLayout<E, G, KDA>::kThreads, 1)
    chunk_prefill_hopper_scan_kernel(const __grid_constant__ ScanParams<E, G, KDA> P) {
  using Lay = ScanLayout<E, G, KDA>;
  constexpr int kThreads = Lay::kThreads;
  using Pipeline = typename Lay::Pipeline;
  const detail::ChunkPrefillProblem& p = P.p;
  enter_grid(P.trigger_early);
  // The dynamic shared memory starts 1024-byte aligned (the swizzled tiles need it; no static
  // shared memory precedes it). A pointer cast from the array keeps the accesses in the shared
  // state space (ld.shared / st.shared), which integer arithmetic on its address would lose.
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<typename Lay::Storage*>(smem_raw);
  const int tid = threadIdx.x, wg = tid / 128;
  if (tid == 0) {
    prefetch_tma_descriptor(P.q.get_tma_descriptor());
    prefetch_tma_descriptor(P.k.get_tma_descriptor());
    if constexpr (KDA) prefetch_tma_descriptor(P.kd.get_tma_descriptor());
    prefetch_tma_descriptor(P.v.get_tma_descriptor());
    prefetch_tma_descriptor(P.t.get_tma_descriptor());
    prefetch_tma_descriptor(P.pm.get_tma_descriptor());
    prefetch_tma_descriptor(P.scal.get_tma_descriptor());
    if (P.tma_out) prefetch_tma_descriptor(P.o.get_tma_descriptor());
  }
  // The CTA's task: (sequence, value head); with context parallelism also its segment and, in
  // the transfer pass, which of M (kind 0) and N it makes (only one sequence: task = hv).
  const int part = static_cast<int>(blockIdx.x % Lay::kSplit);  // the head's rows (V split)
  int64_t task = blockIdx.x / Lay::kSplit;
  int seg = 0, kind = 0;
  if (P.pass == ScanPass::transfer) {
    const int64_t per = int64_t{P.segs - 1} * p.HV;
    kind = static_cast<int>(task / per);
    seg = static_cast<int>(task % per / p.HV);
    task %= p.HV;
  } else if (P.pass == ScanPass::segments) {
    seg = static_cast<int>(task / p.HV);
    task %= p.HV;
  }
  const bool transfer = P.pass == ScanPass::transfer, m_pass = transfer && kind == 0;
  constexpr uint32_t kInBytes = cosize_v<typename Lay::InTile> * sizeof(E),
                     kVBytes = cosize_v<typename Lay::VTile> * sizeof(E),
                     kMatBytes = cosize_v<typename Lay::MatTile> * sizeof(E);
  typename Pipeline::Params pp;
  // the transfer pass loads no q and no P (no outputs), M no v either (v = 0)
  pp.transaction_bytes =
      Lay::kStageBytes - (transfer ? kInBytes + kMatBytes : 0) - (m_pass ? kVBytes : 0);
  pp.role = wg == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = tid == 0;
  pp.num_consumers = 128 * G;
  Pipeline pipe(ss.pipe, pp, Shape<_1, _1, _1>{});
  __syncthreads();  // the barriers' initialization is visible to every thread

  const Seq s = resolve_sequence(p, task);
  if (skip_sequence(p, s, tid, kThreads)) return;
  const int nchunks = static_cast<int>((s.len + kC - 1) / kC);
  // the CTA's chunks [cb, ce) (a segment past the sequence's end has none)
  const bool cp = P.pass != ScanPass::whole;
  const int cb = cp ? min(nchunks, seg * P.seg_chunks) : 0;
  const int ce = cp ? min(nchunks, (seg + 1) * P.seg_chunks) : nchunks;
  const int64_t slot0 = split_chunk_offset(p, s.n);  // the sequence's first chunk slot

  if (wg == 0) {  // ---- producer -------------------------------------------------------------
    if constexpr (G == 2) cutlass::arch::warpgroup_reg_dealloc<56>();
    if (tid == 0) {  // the pipeline's leader (pp.is_leader): its acquire arms the stage
      const int tok0 = static_cast<int>(s.tok0), seq = static_cast<int>(s.seq);
      auto tile = [&](const auto& tma, auto mtensor, auto stensor, auto coord) {
        Tensor g = local_tile(mtensor, product_each(shape(stensor(_, _, 0))), coord);
        return tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(stensor),
                             group_modes<0, 2>(g));
      };
      Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Lay::In{});
      Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Lay::In{});
      Tensor sKd =
          make_tensor(make_smem_ptr(ss.k.data() + cosize_v<typename Lay::In>), typename Lay::In{});
      Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Lay::Vt{});
      Tensor sT = make_tensor(make_smem_ptr(ss.t.data()), typename Lay::Mat{});
      Tensor sP = make_tensor(make_smem_ptr(ss.p.data()), typename Lay::Mat{});
      Tensor sS = make_tensor(make_smem_ptr(ss.scal.data()), typename Lay::Scal{});
      // KDA: q and k are the workspace's rows [slots * C, D, HV, 1] of the sequence's chunk slots
      auto in_shape = KDA ? make_shape(static_cast<int>(P.slots * kC), Int<kD>{}, p.HV, 1)
                          : make_shape(P.in_T, Int<kD>{}, p.H, P.in_N);
      const int qk_tok = KDA ? static_cast<int>(slot0) * kC : tok0;
      const int qk_head = KDA ? s.hv : s.h, qk_seq = KDA ? 0 : seq;
      auto v_shape = make_shape(P.in_T, Int<kD>{}, p.HV, P.in_N);
      const int blocks = static_cast<int>(P.slots * p.HV);
      // (tile, chunk) over the sequence's tokens; (tile, block) over the workspace
      auto [gq, sq] = tile(
          P.q,
          domain_offset(make_coord(qk_tok, 0), P.q.get_tma_tensor(in_shape)(_, _, qk_head, qk_seq)),
          sQ, make_coord(_, 0));
      auto [gk, sk] = tile(
          P.k,
          domain_offset(make_coord(qk_tok, 0), P.k.get_tma_tensor(in_shape)(_, _, qk_head, qk_seq)),
          sK, make_coord(_, 0));
      auto [gkd, skd] = tile(P.kd,
                             domain_offset(make_coord(qk_tok, 0),
                                           P.kd.get_tma_tensor(in_shape)(_, _, qk_head, qk_seq)),
                             sKd, make_coord(_, 0));
      auto [gv, sv] = tile(
          P.v, domain_offset(make_coord(tok0, 0), P.v.get_tma_tensor(v_shape)(_, _, s.hv, seq)), sV,
          make_coord(_, part));
      auto [gt, st] =
          tile(P.t, P.t.get_tma_tensor(make_shape(blocks * kC, Int<kC>{})), sT, make_coord(_, 0));
      auto [gp, sp] =
          tile(P.pm, P.pm.get_tma_tensor(make_shape(blocks * kC, Int<kC>{})), sP, make_coord(_, 0));
      auto [gs, sc] = tile(P.scal, P.scal.get_tma_tensor(make_shape(Int<kC>{}, blocks * 4)), sS,
                           make_coord(0, _));
      const int block0 = static_cast<int>(s.hv * P.slots + slot0);
      auto state = cutlass::make_producer_start_state<Pipeline>();
      for (int ci = cb; ci < ce; ++ci) {
        pipe.producer_acquire(state);
        auto* bar = pipe.producer_get_barrier(state);
        const int stage = state.index();
        if (!transfer) copy(P.q.with(*bar), gq(_, ci), sq(_, stage));
        copy(P.k.with(*bar), gk(_, ci), sk(_, stage));
        if constexpr (KDA) copy(P.kd.with(*bar), gkd(_, ci), skd(_, stage));
        if (!m_pass) copy(P.v.with(*bar), gv(_, ci), sv(_, stage));
        copy(P.t.with(*bar), gt(_, block0 + ci), st(_, stage));
        if (!transfer) copy(P.pm.with(*bar), gp(_, block0 + ci), sp(_, stage));
        copy(P.scal.with(*bar), gs(_, block0 + ci), sc(_, stage));
        ++state;
      }
    } else if (tid >= 32 && tid / 32 <= G && !transfer) {  // ---- storer of group tid / 32 - 1 --
      // Copies each chunk's staged output to the output, so the consumers never wait on global
      // stores: a whole chunk of an output in the input dtype by one TMA store of the group's
      // 64 x 64 box (lane 0), else (a partial last chunk, other outputs) its valid rows by bulk
      // copies, two rows a lane. Row copies of whole chunks (64 of 128 bytes a group and chunk)
      // hold the TMA unit, which also issues the producer's loads, long enough that the consumers
      // wait for their staging buffer (9% of the stall samples at 8x1024; the V-split scan of
      // 1x8192 takes 343 us with them, 191 with one store a chunk, docs/PERFORMANCE.md).
      const int g = tid / 32 - 1, lane = tid % 32;
      const int64_t esize = dtype_size(p.out.dtype);
      const int v0 = Lay::kVCols * part + 64 * g;
      for (int ci = cb; ci < ce; ++ci) {
        const int b = ci & 1;
        const int64_t c0 = int64_t{ci} * kC;
        const int cv = static_cast<int>(s.len - c0 < kC ? s.len - c0 : kC);
        bar_sync(bar_full(g, b), 160);
        unsigned char* const buf = ss.out.data() + (2 * g + b) * OutStaging<KDA>::kBuf;
        if (P.tma_out && cv == kC) {
          if (lane == 0) {
            Tensor sO =
                make_tensor(make_smem_ptr(reinterpret_cast<E*>(buf)), typename Lay::OutTile{});
            Tensor mO =
                domain_offset(make_coord(static_cast<int>(s.tok0), 0),
                              P.o.get_tma_tensor(make_shape(P.in_T, Int<kD>{}, p.HV, P.in_N))(
                                  _, _, s.hv, static_cast<int>(s.seq)));
            Tensor gO = local_tile(mO, Shape<Int<kC>, _64>{}, make_coord(ci, v0 / 64));
            auto thr = P.o.get_slice(Int<0>{});
            copy(P.o, thr.partition_S(sO), thr.partition_D(gO));
          }
        } else {
          for (int t = lane; t < cv; t += 32) {
            unsigned char* row = static_cast<unsigned char*>(p.out.ptr) +
                                 (head_offset(p.out, s.seq, s.tok0 + c0 + t, s.hv) + v0) * esize;
            SM90_BULK_COPY_S2G::copy(buf + t * OutStaging<KDA>::kRow, row,
                                     static_cast<int32_t>(64 * esize));
          }
        }
        tma_store_arrive();
        tma_store_wait<0>();  // the staging has been read
        __syncwarp();         // bar.arrive is warp-aligned: after every lane's wait
        if (ci + 2 < ce) bar_arrive(bar_empty(g, b), 160);
      }
    }
    return;
  }

  // ---- consumers ------------------------------------------------------------------------------
  if constexpr (G == 2) cutlass::arch::warpgroup_reg_alloc<224>();
  const int cw = wg - 1, ct = tid % 128;  // consumer index, thread within the warp group
  const int64_t E2 = int64_t{kD} * kD;
  typename Lay::MmaX mma_x;
  typename Lay::MmaV mma_v;
  typename Lay::MmaS mma_s;
  auto thr_x = mma_x.get_thread_slice(ct);
  auto thr_v = mma_v.get_thread_slice(ct);
  auto thr_s = mma_s.get_thread_slice(ct);

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Lay::In{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Lay::In{});
  // the update's B: k (GDN) or the second tile of k's array, k^ e^{G_L - G} (KDA)
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data() + (KDA ? cosize_v<typename Lay::In> : 0)),
                           typename Lay::InT{});
  // this warp group's 64 rows v of V^T: the second 64-column swizzle atom of v for cw = 1
  Tensor sVt = local_tile(make_tensor(make_smem_ptr(ss.v.data()), typename Lay::VtT{}),
                          Shape<_64, Int<kC>, Int<kStages>>{}, make_coord(cw, 0, 0));
  Tensor sT = make_tensor(make_smem_ptr(ss.t.data()), typename Lay::Mat{});
  Tensor sP = make_tensor(make_smem_ptr(ss.p.data()), typename Lay::Mat{});
  // operand descriptors (MMA, 1, k blocks, stage)
  Tensor dK = thr_x.partition_fragment_B(sK);
  Tensor dQ = thr_x.partition_fragment_B(sQ);
  Tensor dT = thr_x.partition_fragment_B(sT);
  Tensor dP = thr_x.partition_fragment_B(sP);
  Tensor dVt = thr_v.partition_fragment_A(sVt);
  Tensor dTv = thr_v.partition_fragment_B(sT);
  Tensor dKt = thr_s.partition_fragment_B(sKt);

  // S: this warp group's rows v = 64 cw + m, all columns, in the accumulators
  Tensor S = partition_fragment_C(mma_s, Shape<_64, Int<kD>>{});
  const int c0w = 64 * cw;                  // its columns of the CTA's v tile and output staging
  const int v0 = Lay::kVCols * part + c0w;  // its first state row
  if (transfer) {                           // M from the identity's rows, N from zero
    CUTE_UNROLL
    for (int i = 0; i < size(S); ++i)
      S(i) = m_pass && v0 + acc_row(ct, i) == acc_col(ct, i) ? 1.0f : 0.0f;
  } else if (seg > 0 || s.reads_state) {  // a segment's start (combine kernel), or the pool's
    float vals[kStateVals];
    if (cp)  // segments pass: the combine kernel's start states (segment 0's a copy)
      load_state_vals(
          P.cp, DType::f32,
          seg > 0 ? cp_offset(P.segs, p.HV, 1, seg - 1, s.hv) : cp_offset(P.segs, p.HV, 2, 0, s.hv),
          v0, ct, vals, false, fmt::HeadRows{});
    else if (p.state.formatted())
      load_state_vals(p.state.ptr, p.state.dtype, 0, v0, ct, vals, true,
                      fmt::head_rows(p.state, s.slot, s.hv, kD, kD));
    else
      load_state_vals(p.state.ptr, p.state.dtype, s.slot * p.state.slot_stride + s.hv * E2, v0, ct,
                      vals, false, fmt::HeadRows{});
    CUTE_UNROLL
    for (int i = 0; i < size(S); ++i) S(i) = vals[i];
  } else {
    clear(S);
  }
  static_assert(decltype(size(S))::value == kStateVals, "64 state values a consumer thread");
  // `slot` >= 0: a pool slot (sequence.cuh store_final_states), in the pool's format
  auto store_state = [&](void* base, DType dtype, int64_t off, int64_t slot) {
    float vals[kStateVals];
    CUTE_UNROLL
    for (int i = 0; i < size(S); ++i) vals[i] = S(i);
    const bool f = slot >= 0 && p.state.formatted();
    store_state_vals(base, dtype, off, v0, ct, vals, f,
                     f ? fmt::head_rows(p.state, slot, s.hv, kD, kD) : fmt::HeadRows{});
  };

  // Ordered math (G = 2): the two groups take turns issuing their products, so that one group's
  // epilogue runs while the other's products keep the tensor cores busy. Group 1 gives group 0
  // the first turn and takes no turn back after its last batch (every arrival is matched).
  const int batches = 3 * (ce - cb);
  int batch = 0;
  const bool ordered = G == 2 && P.ordered;
  auto turn_begin = [&] {
    if (ordered) bar_sync(bar_turn(cw), 256);
  };
  auto turn_end = [&] {
    if (ordered && (cw == 0 || ++batch < batches)) bar_arrive(bar_turn(1 - cw), 256);
  };
  if (ordered && cw == 1 && batches > 0) bar_arrive(bar_turn(0), 256);

  auto state = typename Pipeline::PipelineState{};
  for (int ci = cb; ci < ce; ++ci) {
    pipe.consumer_wait(state);
    const int stage = state.index();
    const float* scal = ss.scal.data() + stage * 4 * kC;  // rows a, b, d; gamma (KDA: rows 2-3)

    // X1 = S K^T, X2 = S Q^T
    Tensor Sa = acc_to_a<E, kD>(S, [](int, float x) { return x; });
    Tensor X1 = partition_fragment_C(mma_x, Shape<_64, Int<kC>>{});
    Tensor X2 = partition_fragment_C(mma_x, Shape<_64, Int<kC>>{});
    turn_begin();
    warpgroup_arrive();
    wg_gemm<true>(mma_x, Sa, dK(_, _, _, stage), X1);
    wg_gemm<true>(mma_x, Sa, dQ(_, _, _, stage), X2);  // transfer: unused (no q loaded)
    warpgroup_commit_batch();
    turn_end();
    warpgroup_wait<0>();

    // v'^T = V^T Tb^T + bf16(-a X1) Tb^T; X2 becomes b X2 (KDA: a = b = 1)
    Tensor Ya = acc_to_a<E, kC>(X1, [&](int i, float x) {
      if constexpr (KDA) return -x;
      else return -scal[acc_col(ct, i)] * x;
    });
    if constexpr (!KDA) {
      CUTE_UNROLL
      for (int i = 0; i < size(X2); ++i) X2(i) *= scal[kC + acc_col(ct, i)];
    }
    Tensor U = partition_fragment_C(mma_x, Shape<_64, Int<kC>>{});
    turn_begin();
    warpgroup_arrive();
    // M (v = 0): the second product's scale-d 0 drops the first's (no v loaded), no branch
    wg_gemm<true>(mma_v, dVt(_, _, _, stage), dTv(_, _, _, stage), U);
    wg_gemm(mma_x, Ya, dT(_, _, _, stage), U, m_pass);
    warpgroup_commit_batch();
    turn_end();
    warpgroup_wait<0>();

    // o^T = b X2 + bf16(v'^T) P^T;  S = gamma S + bf16(v'^T d) K (KDA: S diag(gamma) +
    // bf16(v'^T) (k^ e^{G_L - G}))
    Tensor Ua = acc_to_a<E, kC>(U, [](int, float x) { return x; });
    Tensor Ud = acc_to_a<E, kC>(U, [&](int i, float x) {
      if constexpr (KDA) return x;
      else return x * scal[2 * kC + acc_col(ct, i)];
    });
    if constexpr (KDA) {
      CUTE_UNROLL
      for (int i = 0; i < size(S); ++i) S(i) *= scal[2 * kC + acc_col(ct, i)];
    } else {
      const float gamma = scal[3 * kC];
      CUTE_UNROLL
      for (int i = 0; i < size(S); ++i) S(i) *= gamma;
    }
    turn_begin();
    warpgroup_arrive();
    wg_gemm<false>(mma_x, Ua, dP(_, _, _, stage), X2);  // transfer: unused (no P loaded)
    wg_gemm<false>(mma_s, Ud, dKt(_, _, _, stage), S);
    warpgroup_commit_batch();
    turn_end();
    warpgroup_wait<0>();
    pipe.consumer_release(state);  // every read of the stage is done
    ++state;

    if (transfer) continue;
    // the output: o^T staged [t][v] in the output dtype, then the storer warp's bulk copies
    const int64_t c0 = int64_t{ci} * kC;
    const int cv = static_cast<int>(s.len - c0 < kC ? s.len - c0 : kC);
    const int b = ci & 1;
    if (ci >= cb + 2) bar_sync(bar_empty(cw, b), 160);  // chunk ci - 2's copy has read it
    unsigned char* const buf = ss.out.data() + (2 * cw + b) * OutStaging<KDA>::kBuf;
    auto stage_out = [&](auto zero) {
      using O = decltype(zero);
      CUTE_UNROLL
      for (int i = 0; i < size(X2); ++i)
        reinterpret_cast<O*>(buf + acc_col(ct, i) * OutStaging<KDA>::kRow)[acc_row(ct, i)] =
            static_cast<O>(X2(i));
    };
    if (P.tma_out && cv == kC) {
      // the TMA store's swizzled box: value i at token acc_col(ct, i), whose row moves by 8
      // (1024 bytes, the same swizzle phase) per i / 4, and column acc_row(ct, i)
      int base[4];
      CUTE_UNROLL
      for (int j = 0; j < 4; ++j) base[j] = out_box_byte(acc_col(ct, j), acc_row(ct, j));
      CUTE_UNROLL
      for (int i = 0; i < size(X2); ++i)
        *reinterpret_cast<E*>(buf + base[i % 4] + (i / 4) * 1024) = static_cast<E>(X2(i));
    } else if (p.out.dtype == DType::bf16) {
      stage_out(cutlass::bfloat16_t{});
    } else if (p.out.dtype == DType::f16) {
      stage_out(cutlass::half_t{});
    } else if constexpr (!KDA) {  // (KDA's rows have room for 16-bit outputs only)
      stage_out(0.0f);
    }
    tma_store_fence();  // the bulk copies (the async proxy) read what these stores wrote
    bar_arrive(bar_full(cw, b), 160);
    const int64_t end = c0 + cv;
    if (checkpoint_at(p, end)) store_checkpoint(p, s, end / p.checkpoint_every - 1, store_state);
  }
  if (transfer) {
    store_state(P.cp, DType::f32, cp_offset(P.segs, p.HV, kind, seg, s.hv), int64_t{-1});
  } else if (!cp || (ce == nchunks && (cb < nchunks || seg == 0))) {  // the sequence's end
    store_final_states(p, s, store_state);
  }
}

}  // namespace deltastate::cuda_backend::prefill::hopper
