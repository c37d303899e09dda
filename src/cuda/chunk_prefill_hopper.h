// The Hopper GDN chunked prefill (chunk_prefill_hopper.cu) as chunk_prefill.cu's dispatch sees
// it: whether a problem can take it, the workspace it needs, and the launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/problem.h"

namespace deltastate::cuda_backend {

// Whether the Hopper kernels run this problem (GDN, K = V = 128, q/k/v all bf16 or all fp16
// with TMA-readable strides, a device of compute capability 9.0), from host-known values only.
bool hopper_prefill_applies(const detail::ChunkPrefillProblem& p);
// Workspace bytes of the prep kernel's blocks for `slots` chunk slots and HV value heads.
int64_t hopper_prefill_workspace_bytes(int64_t slots, int64_t HV);
// Launches the prep and scan kernels when the problem applies and the workspace holds their
// blocks; false (nothing launched) otherwise.
bool run_hopper_prefill(const detail::ChunkPrefillProblem& p, cudaStream_t stream);

}  // namespace deltastate::cuda_backend
