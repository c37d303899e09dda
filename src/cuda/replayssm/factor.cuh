// The factored dots of ReplaySSM (docs/REPLAYSSM.md), shared by the decode kernel (decode.cuh)
// and the verify kernel (verify.cuh): a state S = E*S0 + sum_j d_j (W_j*k_j)^T is never built;
// a token's two dots per row are S0's dots with two decayed vectors plus per-record
// coefficients, computed once per CTA (one record, or one (record, draft) pair, per warp) into
// shared memory.
#pragma once

#include "cuda/reduce.cuh"

namespace deltastate::cuda_backend {

// The two partial dots of each of a thread's R rows of S0 with the decayed vectors ek and eq over
// the lane's EPL elements: dots[r] = S0[r].ek, dots[R + r] = S0[r].eq (the layout that
// transpose_reduce<G, 2R> finishes).
template <int R, int EPL>
__device__ __forceinline__ void factor_row_dots(const float (&S)[R][EPL], const float (&ek)[EPL],
                                                const float (&eq)[EPL], float (&dots)[2 * R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float sk = 0.0f, sq = 0.0f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      sk += S[r][i] * ek[i];
      sq += S[r][i] * eq[i];
    }
    dots[r] = sk;
    dots[R + r] = sq;
  }
}

// One coefficient pair from a warp's partial sums over its lanes' columns (part[0] for the key,
// part[1] for the query): one transposed reduction over the 32 lanes, then scale * each sum
// stored by the lane holding it.
__device__ __forceinline__ void store_factor_pair(float (&part)[2], int lane, float scale,
                                                  float* ck, float* cq) {
  const float red = transpose_reduce<32, 2>(part, lane);
  if (lane == holder_lane<32, 2>(0)) *ck = scale * red;
  if (lane == holder_lane<32, 2>(1)) *cq = scale * red;
}

}  // namespace deltastate::cuda_backend
