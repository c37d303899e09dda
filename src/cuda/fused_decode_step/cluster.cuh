// The fused decode layer step's cluster kernel: one thread-block cluster (sm_90) per (row n, key
// head h). Part of fused_decode_step.cu's translation unit (included there only), in its anonymous
// namespace; kernel.cuh holds the one-CTA kernel for the shapes a cluster does not fit.
//
// Why a cluster: the CTA kernel owns a key head in one CTA so that each q/k conv window is read
// and rolled by exactly one CTA, which leaves a batch of one row with only H CTAs for a state read
// that needs the whole GPU's bandwidth. A cluster keeps the key head together (one barrier orders
// the conv before the delta rule) while spreading its rows over up to kFusedClusterMaxCtas CTAs of
// the packed decode kernel's tile size (RowLayout rows per tile, TPW = one or two tiles per warp).
//
// The cluster of `ctas` = group * `tiles` CTAs (FusedCluster; group = HV/H value heads, tiles =
// CTAs per value head): CTA rank r holds value head hl = r / tiles of the group and its run of
// warps*TPW row tiles number r % tiles, rows [row_lo, row_hi). Ownership, so that every window is
// read and rolled by one CTA and nothing in global memory is shared between CTAs:
//   - the 2K q/k channels of head h, as one index j in [q | k], are split in chunks of `qk_chunk`
//     (a multiple of 8, so a lane's EPL consecutive elements lie in one chunk): CTA r runs the
//     conv of channels [r*qk_chunk, (r+1)*qk_chunk) and writes each output at xqk[j] of its own
//     shared memory;
//   - the v channels of CTA r's own rows: only CTA r reads them (xv).
// Order inside a CTA (latency first: the state is the only large read):
//   1. the gate and beta inputs of its value head and the norm's inputs of its rows (they
//      depend on nothing), the slot, then every warp copies its state tiles into its own shared
//      memory (cp.async, each lane its own words: no barrier; held in registers across the conv,
//      a tile would spill at the 80-register cap);
//   2. the conv update of the owned channels (core/layer_math.h, the CPU twin's function), outputs
//      rounded to mixed_qkv's dtype into shared memory, and the norm's inputs moved from registers
//      to shared memory; cluster barrier 1 (arrive releases, wait acquires: every CTA's conv
//      outputs are visible to every CTA of the cluster);
//   3. each lane reads its K slice of q and k from the owning CTAs' shared memory (DSMEM), then
//      prepares them (L2 norm, scale, k.q), then per tile takes its rows from the staged tile and
//      runs the delta step (rows.cuh delta_step_rows), the state stored in place;
//   4. without the norm: the outputs stored as computed; the CTA arrives at cluster barrier 2
//      once it has used what it read from DSMEM and waits on it before it exits, so no CTA's shared
//      memory ends while a peer still reads it. With the gated RMSNorm (per value head over V,
//      whose rows span `tiles` CTAs): the outputs, rounded to out's dtype, into shared memory; warp
//      0 sums the squares of the CTA's rows (lane-strided, then a butterfly) and stores that
//      partial into slot r % tiles of every CTA of its value head (remote stores); cluster barrier
//      2; each CTA adds the `tiles` partials of its head in slot order and normalizes its rows.
//      After barrier 2 no CTA touches another CTA's shared memory (its pushes precede its arrive),
//      so it may exit at once.
// The reduction order is fixed (no atomics): the same inputs give the same bits on every run. It
// is not the CPU twin's (a sequential sum over V), nor the CTA kernel's (lane-strided over V):
// all three are fp32 sums of the same V squares in other orders, which the GPU tests' norm
// tolerance covers.
// Padding and bad rows: every CTA of a cluster has the same row n, so the slot test is uniform
// over the cluster; such a cluster skips both barriers together (no CTA touches DSMEM) and its
// CTAs write their rows' zeros (NaN for a bad index) and exit.
#pragma once

#include <cooperative_groups.h>

#include <cstdint>

#include "core/delta_math.h"
#include "core/layer_math.h"
#include "core/problem.h"
#include "cuda/async_copy.cuh"
#include "cuda/conv_loads.cuh"
#include "cuda/grid.cuh"
#include "cuda/loads.cuh"
#include "cuda/reduce.cuh"
#include "cuda/rows.cuh"
#include "cuda/token.cuh"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

using detail::FusedStepProblem;

namespace {

// The cluster's split of a key head (fused_cluster_shape; see the file comment).
struct FusedCluster {
  int ctas;      // CTAs per cluster: group * tiles (at most kFusedClusterMaxCtas)
  int tiles;     // CTAs per value head
  int warps;     // warps per CTA (at most kFusedClusterMaxWarps), TPW row tiles each
  int qk_chunk;  // q/k channels whose conv one CTA runs (a multiple of 8)
};

// Shared memory bytes of a cluster CTA: its warps' state tiles (RPW rows of K elements each, TPW
// per warp), then floats: q|k (2K, the owned chunk written), v, the outputs, z and the norm
// weight of its rows, the partial sums of squares of its value head (`tiles`).
template <class StateT, int K, int RPW, int TPW>
size_t fused_cluster_smem_bytes(const FusedCluster& fc) {
  const size_t rows = static_cast<size_t>(fc.warps) * TPW * RPW;
  const size_t floats = 2 * K + 4 * rows + fc.tiles;
  return rows * K * sizeof(StateT) + floats * sizeof(float);
}

// The halves of the cluster barrier (barrier.cluster): every thread of the cluster arrives; the
// arrive releases and the wait acquires at cluster scope, so what a CTA wrote to any CTA's shared
// memory before its arrive is visible to every thread of the cluster after its wait. `.aligned`:
// whole converged warps execute them (callers __syncwarp after lane-divergent code). The wait
// also orders the CTA's own threads, as __syncthreads would.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

template <class StateT, int K, int TPW>
__global__ void __launch_bounds__(kFusedClusterMaxWarps * 32, kFusedClusterCtasPerSm)
    fused_decode_step_cluster_kernel(const FusedStepProblem p, const FusedCluster fc) {
  namespace cg = cooperative_groups;
  enter_grid(p.pdl_trigger_early);
  using Lay = RowLayout<StateT, K>;
  constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, R = Lay::ROWS;
  constexpr int RPW = RG * R;  // rows per tile
  constexpr int kStateBytes = static_cast<int>(sizeof(StateT));
  static_assert(EPL % 4 == 0 && 8 % EPL == 0, "a lane's slice is whole float4s of one chunk");
  static_assert(TPW == 1 || TPW == 2, "one or two tiles per warp");
  static_assert(TPW * RPW <= 32,
                "a CTA has as many threads as rows or more (the norm's one row "
                "per thread)");
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int n = static_cast<int>(blockIdx.x) / fc.ctas, h = static_cast<int>(blockIdx.y);
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int tid = static_cast<int>(threadIdx.x), nthreads = static_cast<int>(blockDim.x);
  const int group = p.HV / p.H, V = p.V;
  const int hl = rank / fc.tiles, part = rank - hl * fc.tiles;
  const int hv = h * group + hl;
  const int span = fc.warps * TPW * RPW;  // rows per CTA
  const int row_lo = part * span;
  const int row_hi = row_lo + span < V ? row_lo + span : V;
  const int my_rows = row_hi - row_lo;  // > 0: fused_cluster_shape leaves no CTA empty
  const int64_t o_base = detail::head_offset(p.out, n, 0, hv);

  // 1. the inputs that depend on nothing, the slot, the state tile of this warp into its shared
  // memory
  const int kofs = (lane % G) * EPL;
  // The head's gate and beta inputs and the norm's inputs (independent of the slot and the conv)
  GateConsts<EPL> gc;
  load_gate_consts(p.gate, hv, K, kofs, EPL, gc);
  float graw[EPL];
  const int64_t a_off = detail::head_offset(p.a, n, 0, hv);
#pragma unroll
  for (int i = 0; i < EPL; ++i)
    graw[i] = p.gate.kda ? detail::load_float(p.a.ptr, p.a.dtype, a_off + kofs + i)
                         : (i == 0 ? detail::load_float(p.a.ptr, p.a.dtype, a_off) : 0.0f);
  const float braw = detail::load_float(p.b.ptr, p.b.dtype, detail::head_offset(p.b, n, 0, hv));
  // The norm's inputs of thread i's row row_lo + i (a CTA has no more rows than threads).
  float z_in = 0.0f, w_in = 0.0f;
  if (p.z && tid < my_rows) {
    w_in = detail::load_float(p.norm_weight, p.norm_weight_dtype, row_lo + tid);
    z_in = detail::load_float(p.z, p.z_dtype,
                              static_cast<int64_t>(n) * p.z_row_stride +
                                  static_cast<int64_t>(hv) * p.z_head_stride + row_lo + tid);
  }

  const int64_t slot = detail::index_at(p.indices, p.index_dtype, p.index_stride, n);
  const bool bad = slot >= p.state.num_slots;
  if (slot < 0 || bad) {  // uniform over the cluster (one row n): no barrier is entered
    if (bad && tid == 0 && rank == 0 && h == 0)
      record_bad_row(p.errors, detail::kErrOpFusedStep, detail::kErrSlot, n, slot,
                     p.state.num_slots);
    const float fill = bad ? bad_row_output() : 0.0f;
    for (int i = tid; i < my_rows; i += nthreads)
      detail::store_float(p.out.ptr, p.out.dtype, o_base + row_lo + i, fill);
    return;
  }

  // Tile t of this warp: rows row_lo + (warp + t*warps)*RPW .. (the CTA's first warps*RPW rows
  // are every warp's tile 0, so a partial last CTA leaves tiles 1 empty first).
  auto tile_first = [&](int t) { return row_lo + (warp + t * fc.warps) * RPW; };
  StateT* const pool = static_cast<StateT*>(p.state.ptr) + slot * p.state.slot_stride;
  auto row_ptr = [&](int row) { return pool + (static_cast<int64_t>(hv) * V + row) * K + kofs; };
  constexpr int kTileWords = RPW * K * kStateBytes / 16;  // uint4 words of one tile
  extern __shared__ uint4 fused_cluster_smem[];
  uint4* const tile_smem = fused_cluster_smem + warp * TPW * kTileWords + lane;
#pragma unroll
  for (int t = 0; t < TPW; ++t)
    if (tile_first(t) < V)  // warp-uniform
      stage_rows_async<StateT, EPL, R>(tile_smem + t * kTileWords, 32, tile_first(t) + lane / G, RG,
                                       V, [&](int, int row) { return row_ptr(row); });

  // 2. the conv update of the owned channels: the q/k chunk into xqk at its index, the v of this
  // CTA's rows into xv
  float* const xqk =  // 16-byte aligned: q, k are read as float4
      reinterpret_cast<float*>(fused_cluster_smem + fc.warps * TPW * kTileWords);
  float* const xv = xqk + 2 * K;
  float* const os = xv + span;  // the outputs, with the norm
  float* const zs = os + span;  // the norm's z and weight of the CTA's rows
  float* const ws = zs + span;
  float* const ss_part = ws + span;
  const int qk_lo = rank * fc.qk_chunk;
  const int qk_n = qk_lo >= 2 * K ? 0 : (2 * K - qk_lo < fc.qk_chunk ? 2 * K - qk_lo : fc.qk_chunk);
  const int64_t HK = static_cast<int64_t>(p.H) * K;
  const int64_t x_row = static_cast<int64_t>(n) * p.x_row_stride;
  for (int i = tid; i < qk_n + my_rows; i += nthreads) {
    int part_j;
    int64_t local;
    float* dst;
    if (i < qk_n) {
      const int j = qk_lo + i;
      part_j = j < K ? 0 : 1;
      local = static_cast<int64_t>(h) * K + (j - part_j * K);
      dst = xqk + j;
    } else {
      const int row = row_lo + (i - qk_n);
      part_j = 2;
      local = static_cast<int64_t>(hv) * V + row;
      dst = xv + (row - row_lo);
    }
    const int64_t c = part_j * HK + local;  // the channel in the packed row
    conv_channel_step(detail::channel_window(p.window[part_j], slot, local),
                      p.window[part_j].state_len, p.conv, c, p.x, p.x_dtype, x_row + c,
                      [&](int, float y) { *dst = detail::round_to(p.x_dtype, y); });
  }
  if (p.z && tid < my_rows) {  // out of registers before the delta step
    zs[tid] = z_in;
    ws[tid] = w_in;
  }
  __syncwarp();      // converged for the .aligned barrier after the lane-divergent code
  cluster_arrive();  // barrier 1: every conv output of the cluster written
  cluster_wait();

  // 3. q and k from the owning CTAs (DSMEM), prepared; the delta step on this warp's tiles
  float q[EPL], k[EPL];
  {
    const float4* qs = reinterpret_cast<const float4*>(
        cluster.map_shared_rank(xqk + kofs, static_cast<unsigned>(kofs / fc.qk_chunk)));
    const float4* ks = reinterpret_cast<const float4*>(
        cluster.map_shared_rank(xqk + K + kofs, static_cast<unsigned>((K + kofs) / fc.qk_chunk)));
#pragma unroll
    for (int c = 0; c < EPL / 4; ++c) {
      const float4 a = qs[c], b = ks[c];
      q[4 * c] = a.x;
      q[4 * c + 1] = a.y;
      q[4 * c + 2] = a.z;
      q[4 * c + 3] = a.w;
      k[4 * c] = b.x;
      k[4 * c + 1] = b.y;
      k[4 * c + 2] = b.z;
      k[4 * c + 3] = b.w;
    }
  }
  const float kq = prepare_qk<EPL, G>(q, k, p.l2norm, p.scale, lane);
  // Barrier 2 without the norm: q and k have been used, so this CTA's DSMEM reads are complete.
  if (!p.z) cluster_arrive();
  float g[EPL], alpha[EPL];
  token_gate(p.gate, gc, graw, g, alpha);
  const float beta = detail::beta_value(braw, true, p.round_beta, p.b.dtype);
  // One tile's rows in registers at a time (unrolled, the two tiles overlap and spill).
#pragma unroll 1
  for (int t = 0; t < TPW; ++t) {
    if (tile_first(t) >= V) break;              // warp-uniform
    const int row0 = tile_first(t) + lane / G;  // this lane's first row of the tile
    float S[R][EPL];
    load_staged_rows<StateT, EPL, R>(tile_smem + t * kTileWords, 32, row0, RG, V, S);
    const int idx = reduced_index<G, 2 * R>(lane);
    const bool v_here = idx < R && row0 + idx * RG < V;
    const float v = v_here ? xv[row0 + idx * RG - row_lo] : 0.0f;
    float u_here;
    const float red = delta_step_rows<G, R>(S, alpha, k, q, v, beta, lane, u_here, [&](int r) {
      if (row0 + r * RG < V) store_state<StateT, EPL, true>(row_ptr(row0 + r * RG), EPL, S[r]);
    });
    finish_output_rows<G, R>(V, row0, RG, lane, red, u_here, kq, [&](int row, float o) {
      const float y = detail::round_to(p.out.dtype, o);
      if (p.z) os[row - row_lo] = y;
      else detail::store_float(p.out.ptr, p.out.dtype, o_base + row, y);
    });
  }
  if (!p.z) {
    __syncwarp();
    cluster_wait();  // no peer reads this CTA's shared memory any more
    return;
  }

  // 4. the gated RMSNorm: the head's sum of squares from its CTAs' partials
  __syncthreads();
  if (warp == 0) {
    float ss = 0.0f;
    for (int i = lane; i < my_rows; i += 32) ss += os[i] * os[i];
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, d);
    if (lane < fc.tiles)  // into slot `part` of every CTA of this value head
      *cluster.map_shared_rank(ss_part + part, static_cast<unsigned>(hl * fc.tiles + lane)) = ss;
  }
  __syncwarp();
  cluster_arrive();  // barrier 2: every partial pushed
  cluster_wait();
  float ss = 0.0f;
  for (int j = 0; j < fc.tiles; ++j) ss += ss_part[j];
  const float inv = detail::rms_inverse(ss, V, p.norm_eps);
  if (tid < my_rows)
    detail::store_float(p.out.ptr, p.out.dtype, o_base + row_lo + tid,
                        detail::gated_norm(os[tid], inv, ws[tid], zs[tid], p.out.dtype,
                                           p.norm_weight_dtype == p.out.dtype));
}

}  // namespace
}  // namespace deltastate::cuda_backend
