// The multi-token kernel's entry for the recurrent op (src/cuda/verify.cu): recurrent.cu's
// dispatcher hands it multi-token sequences and falls back to the direct kernel where it declines.
#pragma once

#include "core/problem.h"

namespace deltastate::cuda_backend {

// Launches `p` on the multi-token kernel and returns true where it applies (a pool updated in
// place or read only, no dense final state, V-first, K = 64 or 128 with 16-byte aligned rows,
// T > 1 or cu_seqlens, DELTASTATE_CUDA_MULTI not `direct`); otherwise returns false, launching
// nothing.
bool run_recurrent_multi_token(const detail::RecurrentProblem& p, void* stream);

}  // namespace deltastate::cuda_backend
