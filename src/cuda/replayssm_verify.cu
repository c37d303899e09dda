// CUDA launch of ReplaySSM speculative verify and of its cursor commit (replayssm/verify.cuh).
// No allocation, no host synchronization: graph-safe.
#include <cstdint>

#include "api/backend.h"
#include "core/problem.h"
#include "cuda/launch.h"
#include "cuda/replayssm/verify.cuh"

namespace deltastate::cuda_backend {

void run_replayssm_verify(const detail::ReplayVerifyProblem& problem, void* stream) {
  DeviceGuard guard(problem.r.device.index);
  detail::ReplayVerifyProblem p = problem;
  p.r.errors = device_errors(p.r.device.index);
  p.r.pdl_trigger_early = false;
  if (p.r.N > 0x7fffffff || p.r.HV > 65535)
    throw Error(ErrorKind::value, "replayssm_verify: too many sequences or heads for one launch");
  const dim3 grid(static_cast<unsigned>(p.r.N), static_cast<unsigned>(p.r.HV),
                  static_cast<unsigned>((p.r.V + kRvRows - 1) / kRvRows));
  auto s = static_cast<cudaStream_t>(stream);
  // K <= 256 (the validator's CUDA limit): lane l holds elements l, l + 32, ... of a row.
  if (p.r.K <= 64) launch_kernel(replay_verify_kernel<2>, grid, kRvWarps * 32, 0, s, p.r.pdl, p);
  else if (p.r.K <= 128)
    launch_kernel(replay_verify_kernel<4>, grid, kRvWarps * 32, 0, s, p.r.pdl, p);
  else launch_kernel(replay_verify_kernel<8>, grid, kRvWarps * 32, 0, s, p.r.pdl, p);
}

void run_replayssm_commit(const detail::ReplayCommitProblem& problem, void* stream) {
  DeviceGuard guard(problem.device.index);
  detail::ReplayCommitProblem p = problem;
  p.errors = device_errors(p.device.index);
  const unsigned blocks = static_cast<unsigned>((p.B + kRvCommitThreads - 1) / kRvCommitThreads);
  launch_kernel(replay_commit_kernel, dim3(blocks), kRvCommitThreads, 0,
                static_cast<cudaStream_t>(stream), p.pdl, p);
}

}  // namespace deltastate::cuda_backend
