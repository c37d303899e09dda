// The tensor-core row phase of ReplaySSM decode with bf16 checkpoints (issue #37's tensor-core
// design; replayssm/decode.cuh's replay_tc_kernel runs it). Part of replayssm_decode.cu's
// translation unit (included by decode.cuh only), in its anonymous namespace.
//
// An appending step needs two dots per checkpoint row, S0.(e*alpha*k) and S0.(e*alpha*q)
// (decode.cuh's 3a). The rows kernel takes them element by element on CUDA cores: a bf16
// element's conversion and two FMAs, then a reduction over 16 lanes. Here a warp owns 16 rows
// and takes all of their dots as one [16, 128] x [128, 8] product on mma.sync.m16n8k16 with
// bf16 operands: the checkpoint's codes are the A operand as loaded (exact: no conversion), and
// the B operand's columns are the two decayed token vectors, each split into three bf16 parts
// (split_bf16x3), so the dots keep an fp32 dot's error while every product is exact.
//
// Fragments (PTX ISA, "Matrix fragments for mma.m16n8k16" with .bf16; g = lane / 4, t = lane % 4;
// a register holds two consecutive k, the lower k in the low half): A's registers are (row g, k
// 2t..2t+1), (row g+8, k 2t..2t+1), (row g, k 2t+8..2t+9), (row g+8, k 2t+8..2t+9); B's are
// (k 2t..2t+1, column g), (k 2t+8..2t+9, column g); C's c0, c1 = (row g, columns 2t, 2t+1), c2, c3
// = (row g+8, the same columns). The dot runs over K in any order, so the kernel permutes it: the
// lane's 16-byte chunk of a row at physical columns 32c + 8t .. 32c + 8t + 7 is its A operand of
// k-steps 2c (words 0 and 1) and 2c + 1 (words 2 and 3), and B's column vectors are stored in the
// same physical order, so a lane reads its B operand of the same two steps as one 16-byte chunk.
// A lane's checkpoint data are then 8 chunks: rows g and g + 8, c = 0..3, staged in shared
// memory; a flush reads the CTA's tile back in the rows kernel's layout (load_tc_tile_rows) and
// runs the rows kernel's element work, which reads each record's kw once for a lane's 4 rows.
//
// B's columns: 2s + 0 is part s of e*alpha*k, 2s + 1 part s of e*alpha*q (s = 0, 1, 2: hi, mid,
// lo), 6 and 7 zero. So lane t's c0 / c1 are part t of row g's sk / sq (lane 3's are zero), and
// the quad's sum is the dot; the lanes add the records' terms d_j*ck_j, d_j*cq_j of records
// j = t, t + 4, ... before that sum.
//
// Precision: x = hi + mid + lo exactly, each part the bf16 nearest to what is left (a float's
// 24 significant bits in three 8-bit parts; bf16 has fp32's exponent range, so only a part below
// 2^-126 can round); a bf16 product is exact in fp32, and the tensor core adds them in fp32.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "core/delta_math.h"
#include "cuda/async_copy.cuh"
#include "cuda/chunk_prefill/mma.cuh"
#include "cuda/replayssm/ring.cuh"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {
namespace {

constexpr int kTcTileRows = 16;  // rows per warp
// Bytes per B column: 256 and a 64-byte pad, so that the 16-byte reads of a quarter warp (two
// columns, four chunks each) cover all 32 banks once.
constexpr int kTcColPitch = 128 * 2 + 64;
constexpr int kTcBBytes = 6 * kTcColPitch;  // columns 0..5 (6 and 7 are zero, never stored)

// x = hi + mid + lo (exact but for parts below bf16's normal range), each part the bf16 nearest
// to what is left of x.
__device__ __forceinline__ void split_bf16x3(float x, __nv_bfloat16 (&part)[3]) {
  part[0] = __float2bfloat16_rn(x);
  const float r1 = x - __bfloat162float(part[0]);  // exact
  part[1] = __float2bfloat16_rn(r1);
  part[2] = __float2bfloat16_rn(r1 - __bfloat162float(part[1]));
}

// The B operand of a lane's CPL = 4 columns from col0 of two vectors x (columns 2s: part s) and
// y (columns 2s + 1), each value split into its three bf16 parts (split_bf16x3).
template <int CPL>
__device__ __forceinline__ void store_tc_b_operand(const float (&x)[CPL], const float (&y)[CPL],
                                                   int col0, unsigned char* bop) {
  static_assert(CPL == 4, "K = 128: four columns a lane, one 8-byte word a part");
  __nv_bfloat16 pk[3][CPL], pq[3][CPL];
#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    __nv_bfloat16 sk[3], sq[3];
    split_bf16x3(x[c], sk);
    split_bf16x3(y[c], sq);
#pragma unroll
    for (int s = 0; s < 3; ++s) {
      pk[s][c] = sk[s];
      pq[s][c] = sq[s];
    }
  }
#pragma unroll
  for (int s = 0; s < 3; ++s) {
    *reinterpret_cast<uint2*>(bop + (2 * s) * kTcColPitch + col0 * 2) =
        *reinterpret_cast<const uint2*>(pk[s]);
    *reinterpret_cast<uint2*>(bop + (2 * s + 1) * kTcColPitch + col0 * 2) =
        *reinterpret_cast<const uint2*>(pq[s]);
  }
}

// Warp 0's decayed token as the B operand (an appending step), its lane's CPL columns from col0:
// ek = e*(alpha*k), eq = e*(alpha*q) (decayed_token_entry) at columns 2s / 2s + 1 of `bop`.
// K = 128: every column exists.
template <int CPL>
__device__ __forceinline__ void store_decayed_token_tc(const float (&e)[CPL], int col0,
                                                       const float* s_alpha, const float* s_kn,
                                                       const float* s_qn, unsigned char* bop) {
  float ek[CPL], eq[CPL];
#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    const float alpha = s_alpha[col0 + c];
    ek[c] = decayed_token_entry(e[c], alpha, s_kn[col0 + c]);
    eq[c] = decayed_token_entry(e[c], alpha, s_qn[col0 + c]);
  }
  store_tc_b_operand<CPL>(ek, eq, col0, bop);
}

// The warp's 16-row tile of a bf16 checkpoint, staged by each lane for itself: its chunks of
// rows g and g + 8 (`rows` = the lane's row g at its column 8t) by cp.async (one group) into its
// words mine[tc_tile_word(h, c)] (consecutive lanes, consecutive words), so the tile holds no
// registers through the CTA's ring work and barriers. An appending step's lane waits for its own
// group (cp_async_wait) and reads back only its own words (no barrier); a flush reads the whole
// tile after every thread's wait and a CTA barrier (load_tc_tile_rows).
constexpr int kTcThreads = kReplayWarps * 32;
constexpr int kTcTileBytes = kReplayWarps * kTcTileRows * 128 * 2;
__device__ __forceinline__ int tc_tile_word(int h, int c) { return (2 * c + h) * kTcThreads; }
__device__ __forceinline__ void stage_tc_tile(const __nv_bfloat16* rows, int K, uint4* mine) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int c = 0; c < 4; ++c) cp_async16(mine + tc_tile_word(h, c), rows + h * 8 * K + 32 * c);
  cp_async_commit();
}

// The appending step's dots of the tile with the B operand (columns 2s / 2s + 1: part s of
// e*alpha*k / e*alpha*q): acc = C of the lane (c0, c1 row g; c2, c3 row g + 8).
__device__ __forceinline__ void tc_tile_dots(const uint4 (&A)[2][4], const unsigned char* bop,
                                             int lane, float (&acc)[4]) {
  const int g = lane >> 2, t = lane & 3;
  uint4 b[4];
#pragma unroll
  for (int c = 0; c < 4; ++c)
    b[c] = g < 6 ? *reinterpret_cast<const uint4*>(bop + g * kTcColPitch + (32 * c + 8 * t) * 2)
                 : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const uint32_t a0[4] = {A[0][c].x, A[1][c].x, A[0][c].y, A[1][c].y};
    const uint32_t a1[4] = {A[0][c].z, A[1][c].z, A[0][c].w, A[1][c].w};
    prefill::Mma<__nv_bfloat16>::mma(acc, a0, b[c].x, b[c].y);
    prefill::Mma<__nv_bfloat16>::mma(acc, a1, b[c].z, b[c].w);
  }
}

// The 8 bf16 values of a 16-byte chunk as floats.
__device__ __forceinline__ void unpack_bf16x8(const uint4& u, float (&x)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = prefill::Mma<__nv_bfloat16>::unpack(w[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void unpack_bf16x4(const uint2& u, float (&x)[4]) {
  const float2 lo = prefill::Mma<__nv_bfloat16>::unpack(u.x);
  const float2 hi = prefill::Mma<__nv_bfloat16>::unpack(u.y);
  x[0] = lo.x;
  x[1] = lo.y;
  x[2] = hi.x;
  x[3] = hi.y;
}

// The sum over the lane's quad (every lane gets it).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// A flush's rows in the rows kernel's layout (R rows lrow0 + r*RG, the 8 columns from kofs: one
// chunk) read from the CTA's staged tile (each chunk where tc_tile_word put it: row l's chunk at
// columns 32c + 8t is word (2c + (l % 16) / 8) * kTcThreads of thread (l / 16) * 32 + (l % 8) * 4
// + t), after a CTA barrier that follows every thread's cp_async_wait.
template <int R, int RG>
__device__ __forceinline__ void load_tc_tile_rows(const unsigned char* tile, int lrow0, int kofs,
                                                  float (&S)[R][8]) {
  const uint4* words = reinterpret_cast<const uint4*>(tile);
  const int c = kofs >> 5, t = (kofs >> 3) & 3;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int l = lrow0 + r * RG;
    unpack_bf16x8(words[tc_tile_word((l >> 3) & 1, c) + (l >> 4) * 32 + (l & 7) * 4 + t], S[r]);
  }
}

}  // namespace
}  // namespace deltastate::cuda_backend
