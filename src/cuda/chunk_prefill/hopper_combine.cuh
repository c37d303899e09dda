// The combine kernel of the Hopper GDN prefill's context parallelism (hopper_scan.cuh ScanPass):
// from the transfer pass's per-segment M_i and N_i and the sequence's initial state S_0, every
// segment's exact start state S_{i+1} = S_i M_i + N_i, in order, written over N_i; and S_0 itself,
// copied for segment 0 (cp_offset kind 2: the segments pass reads no pool state). Part of
// chunk_prefill_hopper.cu's translation unit.
//
// The state's rows are independent (S M acts on each row alone), so grid (V / kCombineRows, HV)
// CTAs each carry kCombineRows rows of one head through all segments, in fp32 on CUDA cores:
// thread c owns column c of its rows. The chain is latency-bound, not FLOP-bound (8 x 128 x 128
// FMAs a step and CTA), so each M_i (64 KB) is staged into shared memory with cp.async one step
// ahead (two buffers), and N_i's values are loaded before the wait: a step then waits on one
// copy, not on 128 dependent loads from L2.
#pragma once

#include <cstdint>

#include "cuda/chunk_prefill/hopper_scan.cuh"

namespace deltastate::cuda_backend::prefill::hopper {

constexpr int kCombineRows = 8;
constexpr int kCombineSmem = (2 * kD * kD + kCombineRows * kD) * 4;  // two M buffers, S's rows

__global__ void __launch_bounds__(kD)
    chunk_prefill_hopper_combine_kernel(const ChunkPrefillProblem p, float* cp, int segs) {
  enter_grid(false);
  const int hv = static_cast<int>(blockIdx.y), r0 = static_cast<int>(blockIdx.x) * kCombineRows;
  const int c = static_cast<int>(threadIdx.x);
  const Seq s = resolve_sequence(p, hv);  // one sequence: task = hv
  // a padded sequence or a slot past the pool: the segments pass writes its outputs and reads no
  // state
  if (s.padded || (p.pooled() && s.slot >= p.state.num_slots)) return;
  constexpr int64_t E2 = int64_t{kD} * kD;
  extern __shared__ __align__(16) float smem_f[];
  float* const Mb = smem_f;          // [2][kD][kD]
  float* const S = smem_f + 2 * E2;  // [kCombineRows][kD]
  // M_i into buffer i % 2: 16-byte pieces, one commit group
  const float* const M0 = cp + cp_offset(segs, p.HV, 0, 0, hv);
  auto stage = [M0, Mb, c, HV = p.HV](int i) {
    const float* const M = M0 + int64_t{i} * HV * E2;
    float* const dst = Mb + (i % 2) * E2;
#pragma unroll 4
    for (int e = 4 * c; e < static_cast<int>(E2); e += 4 * kD)
      cp_async16_zfill(dst + e, M + e, true);
    cp_async_commit_group();
  };
  stage(0);
  const int64_t off = s.slot * p.state.slot_stride + s.hv * E2;
  if (s.reads_state && p.state.formatted()) {  // the pool's format (cuda/state_format.cuh)
    const fmt::HeadRows h = fmt::head_rows(p.state, s.slot, s.hv, kD, kD);
#pragma unroll
    for (int r = 0; r < kCombineRows; ++r)
      S[r * kD + c] = fmt::load_elem(p.state.ptr, p.state.dtype, h, r0 + r, (r0 + r) * kD + c);
  } else {
#pragma unroll
    for (int r = 0; r < kCombineRows; ++r)
      S[r * kD + c] = s.reads_state
                          ? detail::load_float(p.state.ptr, p.state.dtype, off + (r0 + r) * kD + c)
                          : 0.0f;
  }
  {  // segment 0's start: each thread copies the elements it loaded
    float* const start0 = cp + cp_offset(segs, p.HV, 2, 0, hv);
#pragma unroll
    for (int r = 0; r < kCombineRows; ++r) start0[(r0 + r) * kD + c] = S[r * kD + c];
  }
  for (int i = 0; i + 1 < segs; ++i) {
    float* const N = cp + cp_offset(segs, p.HV, 1, i, hv);
    float acc[kCombineRows];
#pragma unroll
    for (int r = 0; r < kCombineRows; ++r) acc[r] = N[(r0 + r) * kD + c];
    if (i + 2 < segs) {  // M_{i+1} ahead, then wait for M_i alone
      stage(i + 1);
      cp_async_wait_group<1>();
    } else {
      cp_async_wait_group<0>();
    }
    __syncthreads();  // M_i and S_i (the previous step's stores) are visible
    const float* const M = Mb + (i % 2) * E2;
#pragma unroll 2
    for (int k = 0; k < kD; k += 4) {
      float m[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) m[j] = M[(k + j) * kD + c];
#pragma unroll
      for (int r = 0; r < kCombineRows; ++r) {
        const float4 x = *reinterpret_cast<const float4*>(S + r * kD + k);  // broadcast
        acc[r] = fmaf(x.x, m[0], acc[r]);
        acc[r] = fmaf(x.y, m[1], acc[r]);
        acc[r] = fmaf(x.z, m[2], acc[r]);
        acc[r] = fmaf(x.w, m[3], acc[r]);
      }
    }
    __syncthreads();  // every thread has read S_i and M_i's buffer
#pragma unroll
    for (int r = 0; r < kCombineRows; ++r) {
      S[r * kD + c] = acc[r];
      N[(r0 + r) * kD + c] = acc[r];
    }
  }
}

}  // namespace deltastate::cuda_backend::prefill::hopper
