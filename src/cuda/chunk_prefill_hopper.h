// The Hopper chunked prefill, GDN and KDA (chunk_prefill_hopper.cu) as chunk_prefill.cu's
// dispatch sees it: whether a problem can take it, the workspace it needs, and the launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/problem.h"

namespace deltastate::cuda_backend {

// Whether the Hopper kernels take problems of this kind on `device` (GDN or KDA, K = V = 128,
// compute capability 9.0, no other kernel forced); per call, the dtypes, strides and the
// workspace decide the rest (run_hopper_prefill). Needs a device.
bool hopper_prefill_shapes(int K, int V, int device);
// Workspace bytes of the prep kernel's blocks for `slots` chunk slots and HV value heads.
int64_t hopper_prefill_workspace_bytes(int64_t slots, int64_t HV, bool kda);
// Workspace bytes of the context-parallel states (after the blocks) where a call of N sequences
// of T tokens in all with HV value heads takes context parallelism on `device` (GDN only); 0
// otherwise.
int64_t hopper_prefill_cp_workspace_bytes(int64_t N, int64_t HV, int64_t T, bool kda, int device);
// Launches the prep and scan kernels when the problem applies and the workspace holds their
// blocks; false (nothing launched) otherwise.
bool run_hopper_prefill(const detail::ChunkPrefillProblem& p, cudaStream_t stream);

}  // namespace deltastate::cuda_backend
