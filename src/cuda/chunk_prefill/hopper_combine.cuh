// The combine kernel of the Hopper GDN prefill's context parallelism (hopper_scan.cuh ScanPass):
// from the transfer pass's per-segment M_i and N_i and the sequence's initial state S_0, every
// segment's exact start state S_{i+1} = S_i M_i + N_i, in order, written over N_i; and S_0 itself,
// copied for segment 0 (cp_offset kind 2: the segments pass reads no pool state). Part of
// chunk_prefill_hopper.cu's translation unit.
//
// The state's rows are independent (S M acts on each row alone), so grid (V / kCombineRows, HV)
// CTAs each carry kCombineRows rows of one head through all segments, in fp32 on CUDA cores. The
// chain is latency-bound, not FLOP-bound (8 x 128 x 128 FMAs a step and CTA), so the kernel is
// laid out for latency:
// - The reduction over k is split kCombineSplit ways: thread (c, q) (c = tid % kD, q = tid / kD,
//   uniform in a warp) owns column c and the q-th quarter of k, 32 values, and accumulates the
//   partial sums of the CTA's 8 rows in 8 independent accumulators. Per k-quad a thread issues 4
//   LDS of M (a warp's lanes on 32 consecutive columns), 8 LDS.128 of S (one address in the warp:
//   a broadcast) and 32 FMAs: ~350 instructions a step, ~410 with the reduction and the staging.
//   A CTA is 16 warps, 4 a scheduler at one CTA an SM, each warp with 8 independent FMA chains
//   of 32, which hides the shared-memory and FMA latency. One thread a column over all of k
//   would be one warp a scheduler issuing ~1400 dependent instructions a step, nothing to hide
//   their latency.
// - The partials meet in shared memory P [kCombineSplit][kCombineRows][kD], and thread (c, q)
//   finishes rows q and q + 4 of column c: N_i + P_0 + P_1 + P_2 + P_3, added in that order, so
//   the result does not depend on the warps' timing. The thread loads those N_i values before
//   the wait for M_i.
// - Each M_i (64 KB) is staged into shared memory with cp.async one step ahead (two buffers): a
//   step then waits on one copy, not on dependent loads from L2.
// - 8 rows a CTA: every CTA reads all of M_i each step (16 CTAs x 64 KB a head and step at 8
//   rows, under the step before), so fewer rows mean more L2 traffic, and every CTA stays for the
//   whole chain, so the grid must be one wave: at one CTA an SM (kCombineSmem, 148 KB), TP4's 8
//   heads take 128 of an H100's 132 SMs, 4 rows would take two waves. 16 rows would leave half
//   the SMs idle and double each thread's FMAs.
#pragma once

#include <cstdint>

#include "cuda/chunk_prefill/hopper_scan.cuh"

namespace deltastate::cuda_backend::prefill::hopper {

constexpr int kCombineRows = 8;
constexpr int kCombineSplit = 4;                     // ways the reduction over k is split
constexpr int kCombineThreads = kCombineSplit * kD;  // thread (c, q): column c, k-quarter q
constexpr int kCombineSmem =                         // two M buffers, S's rows, the partial sums
    (2 * kD * kD + kCombineRows * kD + kCombineSplit * kCombineRows * kD) * 4;
static_assert(kCombineRows % kCombineSplit == 0 && kD % (4 * kCombineSplit) == 0 &&
              kD * kD % (4 * kCombineThreads) == 0);

__global__ void __launch_bounds__(kCombineThreads)
    chunk_prefill_hopper_combine_kernel(const ChunkPrefillProblem p, float* cp, int segs) {
  enter_grid(false);
  const int hv = static_cast<int>(blockIdx.y), r0 = static_cast<int>(blockIdx.x) * kCombineRows;
  const int t = static_cast<int>(threadIdx.x), c = t % kD, q = t / kD;
  const Seq s = resolve_sequence(p, hv);  // one sequence: task = hv
  // a padded sequence or a slot past the pool: the segments pass writes its outputs and reads no
  // state
  if (s.padded || (p.pooled() && s.slot >= p.state.num_slots)) return;
  constexpr int64_t E2 = int64_t{kD} * kD;
  constexpr int kOwn =
      kCombineRows / kCombineSplit;          // rows q + kCombineSplit * j a thread finishes
  constexpr int kSpan = kD / kCombineSplit;  // k values a thread reduces over
  extern __shared__ __align__(16) float smem_f[];
  float* const Mb = smem_f;                // [2][kD][kD]
  float* const S = smem_f + 2 * E2;        // [kCombineRows][kD]
  float* const P = S + kCombineRows * kD;  // [kCombineSplit][kCombineRows][kD]
  // M_i into buffer i % 2: 16-byte pieces, one commit group
  const float* const M0 = cp + cp_offset(segs, p.HV, 0, 0, hv);
  auto stage = [M0, Mb, t, HV = p.HV](int i) {
    const float* const M = M0 + int64_t{i} * HV * E2;
    float* const dst = Mb + (i % 2) * E2;
#pragma unroll
    for (int j = 0; j < static_cast<int>(E2) / (4 * kCombineThreads); ++j) {
      const int e = 4 * (t + j * kCombineThreads);
      cp_async16_zfill(dst + e, M + e, true);
    }
    cp_async_commit_group();
  };
  stage(0);
  const int64_t off = s.slot * p.state.slot_stride + s.hv * E2;
  if (s.reads_state && p.state.formatted()) {  // the pool's format (cuda/state_format.cuh)
    const fmt::HeadRows h = fmt::head_rows(p.state, s.slot, s.hv, kD, kD);
#pragma unroll
    for (int j = 0; j < kOwn; ++j) {
      const int r = q + kCombineSplit * j;
      S[r * kD + c] = fmt::load_elem(p.state.ptr, p.state.dtype, h, r0 + r, (r0 + r) * kD + c);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kOwn; ++j) {
      const int r = q + kCombineSplit * j;
      S[r * kD + c] = s.reads_state
                          ? detail::load_float(p.state.ptr, p.state.dtype, off + (r0 + r) * kD + c)
                          : 0.0f;
    }
  }
  {  // segment 0's start: each thread copies the elements it loaded
    float* const start0 = cp + cp_offset(segs, p.HV, 2, 0, hv);
#pragma unroll
    for (int j = 0; j < kOwn; ++j) {
      const int r = q + kCombineSplit * j;
      start0[(r0 + r) * kD + c] = S[r * kD + c];
    }
  }
  for (int i = 0; i + 1 < segs; ++i) {
    float* const N = cp + cp_offset(segs, p.HV, 1, i, hv);
    float n[kOwn];
#pragma unroll
    for (int j = 0; j < kOwn; ++j) n[j] = N[(r0 + q + kCombineSplit * j) * kD + c];
    if (i + 2 < segs) {  // M_{i+1} ahead, then wait for M_i alone
      stage(i + 1);
      cp_async_wait_group<1>();
    } else {
      cp_async_wait_group<0>();
    }
    __syncthreads();  // M_i and S_i (the previous step's stores) are visible
    const float* const M = Mb + (i % 2) * E2;
    float acc[kCombineRows];
#pragma unroll
    for (int r = 0; r < kCombineRows; ++r) acc[r] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kSpan; kk += 4) {
      const int k = q * kSpan + kk;
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
#pragma unroll
    for (int r = 0; r < kCombineRows; ++r) P[(q * kCombineRows + r) * kD + c] = acc[r];
    __syncthreads();  // the partials are visible; every thread has read S_i and M_i's buffer
#pragma unroll
    for (int j = 0; j < kOwn; ++j) {
      const int r = q + kCombineSplit * j;
      float v = n[j];
#pragma unroll
      for (int h = 0; h < kCombineSplit; ++h) v += P[(h * kCombineRows + r) * kD + c];
      S[r * kD + c] = v;
      N[(r0 + r) * kD + c] = v;
    }
  }
}

}  // namespace deltastate::cuda_backend::prefill::hopper
