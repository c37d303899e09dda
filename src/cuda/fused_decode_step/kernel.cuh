// The fused decode layer step's CTA kernel: one CTA per (row n, key head h). Part of
// fused_decode_step.cu's translation unit (included there only), in its anonymous namespace.
// It runs batches whose grid (B * H CTAs) fills more than half of the GPU, the shapes whose key
// head no cluster of kFusedClusterMaxCtas CTAs holds (more value heads per key head than that, or
// more row tiles per CTA than kFusedClusterMaxWarps) and DELTASTATE_CUDA_FUSED=cta;
// cluster.cuh's kernel, which spreads the key head's rows over a cluster, runs the others
// (fused_cluster_pays, tuning.h).
//
// Why one CTA per key head: the conv windows of head h's q and k channels feed every value head
// of its group and every row tile of those heads, and each window must be read before it is
// rolled and rolled exactly once. A CTA that owns h's q/k channels and the v channels of its
// group's value heads reads and rolls all of them itself, with one barrier between the conv and
// the delta rule; no window is shared between CTAs, so the grid needs no ordering.
//
// Order inside the CTA (latency first: the state is the only large read):
//   1. the slot; every warp issues the loads of its state tiles into registers (RowLayout, as
//      the packed decode kernel; state rows do not depend on the conv);
//   2. meanwhile the CTA's threads run the conv update of the 2K + group*V owned channels
//      (core/layer_math.h, the CPU twin's function), outputs rounded to mixed_qkv's dtype into
//      shared memory; barrier;
//   3. each warp prepares q, k (L2 norm, scale, k.q) from shared memory, then per tile the gate,
//      beta and the delta step (rows.cuh delta_step_rows), the state stored in place and the
//      outputs, rounded to out's dtype, into shared memory; barrier;
//   4. optional gated RMSNorm per value head (one warp per head), then the stores of out.
// The conv part is conv_channel_update over T tokens; a multi-token (verify) variant keeps this
// structure with T conv outputs per channel in shared memory and a token loop in step 3.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/delta_math.h"
#include "core/layer_math.h"
#include "core/problem.h"
#include "cuda/conv_loads.cuh"
#include "cuda/grid.cuh"
#include "cuda/loads.cuh"
#include "cuda/reduce.cuh"
#include "cuda/rows.cuh"
#include "cuda/token.cuh"

namespace deltastate::cuda_backend {

using detail::FusedStepProblem;

namespace {

constexpr int kFusedMaxWarps = 16;  // 512 threads: up to 128 registers each

// Shared memory floats of a CTA: q, k (K each), v and the outputs (group*V each).
inline int fused_smem_floats(const FusedStepProblem& p) { return 2 * p.K + 2 * (p.HV / p.H) * p.V; }

// Step 2, shared with the ReplaySSM kernel (replay.cuh): the conv update of the channels CTA (n,
// h) owns, [q_h | k_h | v of the group's value heads], into x[0 .. 2K + group*V), each output
// rounded to mixed_qkv's dtype (as the unfused chain stores it). The CTA's threads share the
// channels; the caller's barrier publishes x.
template <int K>
__device__ __forceinline__ void fused_conv_owned(const FusedStepProblem& p, int n, int h,
                                                 int64_t slot, float* x) {
  const int rows = (p.HV / p.H) * p.V;
  const int64_t HK = static_cast<int64_t>(p.H) * K;
  const int64_t x_row = static_cast<int64_t>(n) * p.x_row_stride;
  for (int i = static_cast<int>(threadIdx.x); i < 2 * K + rows; i += static_cast<int>(blockDim.x)) {
    int part;
    int64_t local;
    if (i < K) {
      part = 0;
      local = static_cast<int64_t>(h) * K + i;
    } else if (i < 2 * K) {
      part = 1;
      local = static_cast<int64_t>(h) * K + (i - K);
    } else {
      part = 2;
      local = static_cast<int64_t>(h) * rows + (i - 2 * K);
    }
    const int64_t c = part * HK + local;  // the channel in the packed row
    conv_channel_step(detail::channel_window(p.window[part], slot, local), p.window[part].state_len,
                      p.conv, c, p.x, p.x_dtype, x_row + c,
                      [&](int, float y) { x[i] = detail::round_to(p.x_dtype, y); });
  }
}

// Step 4, shared with the ReplaySSM kernel: out of CTA (n, h) from the outputs os [group*V]
// (rounded to out's dtype), through the gated RMSNorm when it is asked for (one warp per value
// head), else as they are. After the barrier that publishes os.
__device__ __forceinline__ void fused_store_outputs(const FusedStepProblem& p, const float* os,
                                                    int n, int h, int64_t o_base) {
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int warps = static_cast<int>(blockDim.x >> 5);
  const int group = p.HV / p.H, V = p.V;
  const int rows = group * V;
  if (p.z) {
    const bool round_product = p.norm_weight_dtype == p.out.dtype;
    for (int hl = warp; hl < group; hl += warps) {
      // the sum of squares in the chain's norm kernel's order (detail::norm_lane_elements)
      const int per = detail::norm_lane_elements(V);
      float ss = 0.0f;
      for (int j = 0; j < per; ++j) {
        const int i = lane * per + j;
        if (i < V) ss += os[hl * V + i] * os[hl * V + i];
      }
#pragma unroll
      for (int d = 16; d > 0; d >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, d);
      const float inv = detail::rms_inverse(ss, V, p.norm_eps);
      const int64_t z_off = static_cast<int64_t>(n) * p.z_row_stride +
                            static_cast<int64_t>(h * group + hl) * p.z_head_stride;
      for (int i = lane; i < V; i += 32) {
        const float y = detail::gated_norm(
            os[hl * V + i], inv, detail::load_float(p.norm_weight, p.norm_weight_dtype, i),
            detail::load_float(p.z, p.z_dtype, z_off + i), p.out.dtype, round_product);
        detail::store_float(p.out.ptr, p.out.dtype, o_base + hl * V + i, y);
      }
    }
  } else {
    for (int i = static_cast<int>(threadIdx.x); i < rows; i += static_cast<int>(blockDim.x))
      detail::store_float(p.out.ptr, p.out.dtype, o_base + i, os[i]);
  }
}

template <class StateT, int K, int TPW>
__global__ void __launch_bounds__(kFusedMaxWarps * 32, 1)
    fused_decode_step_kernel(const FusedStepProblem p) {
  enter_grid(p.pdl_trigger_early);
  using Lay = RowLayout<StateT, K>;
  constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, R = Lay::ROWS;
  constexpr int RPW = RG * R;  // rows per tile
  const int n = static_cast<int>(blockIdx.x), h = static_cast<int>(blockIdx.y);
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int warps = static_cast<int>(blockDim.x >> 5);
  const int group = p.HV / p.H, V = p.V;
  const int tiles_per_head = (V + RPW - 1) / RPW;
  const int tiles = group * tiles_per_head;
  const int rows = group * V;  // this CTA's output rows (value heads h*group ..)
  const int64_t o_base = detail::head_offset(p.out, n, 0, h * group);

  const int64_t slot = detail::index_at(p.indices, p.index_dtype, p.index_stride, n);
  const bool bad = slot >= p.state.num_slots;
  if (slot < 0 || bad) {  // padding: zeros, nothing read or written; a bad index: NaN, recorded
    if (bad && threadIdx.x == 0 && h == 0)
      record_bad_row(p.errors, detail::kErrOpFusedStep, detail::kErrSlot, n, slot,
                     p.state.num_slots);
    const float fill = bad ? bad_row_output() : 0.0f;
    for (int i = static_cast<int>(threadIdx.x); i < rows; i += static_cast<int>(blockDim.x))
      detail::store_float(p.out.ptr, p.out.dtype, o_base + i, fill);
    return;
  }

  // 1. the state tiles of this warp into registers
  const int kofs = (lane % G) * EPL;
  StateT* const pool = static_cast<StateT*>(p.state.ptr) + slot * p.state.slot_stride;
  auto tile_rows = [&](int t) {  // (head in group, first row of this lane) of tile t, or -1
    const int ti = warp + t * warps;
    if (ti >= tiles) return int2{-1, 0};
    const int hl = ti / tiles_per_head;
    return int2{hl, (ti - hl * tiles_per_head) * RPW + lane / G};
  };
  auto row_ptr = [&](int hl, int row) {
    return pool + (static_cast<int64_t>(h * group + hl) * V + row) * K + kofs;
  };
  float S[TPW][R][EPL];
#pragma unroll
  for (int t = 0; t < TPW; ++t) {
    const int2 tr = tile_rows(t);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (tr.x >= 0 && tr.y + r * RG < V) {
        load_state<StateT, EPL, true>(row_ptr(tr.x, tr.y + r * RG), EPL, S[t][r]);
      } else {
#pragma unroll
        for (int i = 0; i < EPL; ++i) S[t][r][i] = 0.0f;
      }
    }
  }

  // 2. the conv update of the owned channels: [q_h | k_h | v of the group] into shared memory
  extern __shared__ float fused_smem[];
  float* const xq = fused_smem;
  float* const xk = xq + K;
  float* const xv = xk + K;
  float* const os = xv + rows;
  fused_conv_owned<K>(p, n, h, slot, fused_smem);
  __syncthreads();

  // 3. q, k prepared once per warp; the delta step per tile
  float q[EPL], k[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    q[i] = xq[kofs + i];
    k[i] = xk[kofs + i];
  }
  const float kq = prepare_qk<EPL, G>(q, k, p.l2norm, p.scale, lane);
  const int idx = reduced_index<G, 2 * R>(lane);
#pragma unroll
  for (int t = 0; t < TPW; ++t) {
    const int2 tr = tile_rows(t);
    if (tr.x < 0) break;  // warp-uniform
    const int hl = tr.x, row0 = tr.y, hv = h * group + hl;
    GateConsts<EPL> gc;
    load_gate_consts(p.gate, hv, K, kofs, EPL, gc);
    float graw[EPL], g[EPL], alpha[EPL];
    const int64_t a_off = detail::head_offset(p.a, n, 0, hv);
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      graw[i] = p.gate.kda ? detail::load_float(p.a.ptr, p.a.dtype, a_off + kofs + i)
                           : (i == 0 ? detail::load_float(p.a.ptr, p.a.dtype, a_off) : 0.0f);
    token_gate(p.gate, gc, graw, g, alpha);
    const float beta = detail::beta_value(
        detail::load_float(p.b.ptr, p.b.dtype, detail::head_offset(p.b, n, 0, hv)), true,
        p.round_beta, p.b.dtype);
    const bool v_here = idx < R && row0 + idx * RG < V;
    const float v = v_here ? xv[hl * V + row0 + idx * RG] : 0.0f;
    float u_here;
    const float red = delta_step_rows<G, R>(S[t], alpha, k, q, v, beta, lane, u_here, [&](int r) {
      if (row0 + r * RG < V)
        store_state<StateT, EPL, true>(row_ptr(hl, row0 + r * RG), EPL, S[t][r]);
    });
    finish_output_rows<G, R>(V, row0, RG, lane, red, u_here, kq, [&](int row, float o) {
      os[hl * V + row] = detail::round_to(p.out.dtype, o);
    });
  }
  __syncthreads();

  // 4. the gated RMSNorm (one warp per value head) or the plain output
  fused_store_outputs(p, os, n, h, o_base);
}

}  // namespace
}  // namespace deltastate::cuda_backend
