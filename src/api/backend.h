// The seam between the framework-free API and the CUDA backend. src/cuda implements these when
// the toolkit is present at configure time; src/api/no_cuda.cpp otherwise, throwing
// ErrorKind::not_implemented with a message that says CUDA support is not built.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/problem.h"

namespace deltastate::cuda_backend {

bool built();
// At least one CUDA device is usable (cudaGetDeviceCount > 0); false, never an error, otherwise.
bool device_available();

// Ops: launch on `stream` (a cudaStream_t), no allocation, no host synchronization.
void run_recurrent(const detail::RecurrentProblem& p, void* stream);
void run_replayssm_decode(const detail::ReplayProblem& p, void* stream);
// The errors run_replayssm_decode would throw before its launch (the kernel's limits on HV, V and
// the ring's shared memory), thrown without launching: the fused step's ReplaySSM chain asks
// before its first kernel, so a call it rejects has written nothing.
void check_replayssm_decode_launch(const detail::ReplayProblem& p);
// StatePool::fork on a CUDA pool: whether the kernel takes m pending records (throws if not;
// called before fork writes anything), then cpu::run_replay_materialize's work, on `stream`.
void check_replay_materialize(const detail::ReplayProblem& p, int m);
void run_replay_materialize(const detail::ReplayProblem& p, int64_t src, int64_t dst, int m,
                            int base, void* stream);
void run_chunk_prefill(const detail::ChunkPrefillProblem& p, void* stream);
// Speculative verify and its commits, of states and of conv windows (src/cuda/verify.cu).
void run_verify(const detail::VerifyProblem& p, void* stream);
void run_commit(const detail::CommitProblem& p, void* stream);
// ReplaySSM speculative verify and its cursor commit (src/cuda/replayssm_verify.cu).
void run_replayssm_verify(const detail::ReplayVerifyProblem& p, void* stream);
void run_replayssm_commit(const detail::ReplayCommitProblem& p, void* stream);
void run_replayssm_reset_cursors(const detail::ReplayResetProblem& p, void* stream);
void run_replayssm_fold_commit(const detail::ReplayFoldProblem& p, void* stream);
void run_replayssm_circular_commit(const detail::ReplayCircularProblem& p, void* stream);
// Workspace bytes of chunk_prefill on CUDA for these shapes on this device (its SM count, cached,
// picks the kernel; no allocation).
int64_t chunk_prefill_workspace_bytes(int K, int V, int64_t N, int64_t HV, int64_t tokens, bool kda,
                                      int device);

// The device's error record (src/cuda/errors.cu), for the launchers to pass to the kernels.
detail::DeviceErrorRecord* device_errors(int device);
// Synchronizes `stream`, reads its device's error record, clears it and throws ErrorKind::value
// naming the first bad row; a no-op when no kernel has been launched on that device.
void check_errors(void* stream);
// check_errors, skipped while `stream` is being captured into a CUDA graph (ops' check_indices).
void check_errors_after_op(void* stream);

// Memory for the state pool.
void* device_alloc(size_t bytes, int device);  // zeroed, synchronously
void device_free(void* ptr, int device) noexcept;
// Zeroes or sets `rows` rows of `row_bytes` bytes, `pitch` bytes apart (device memory).
void memset_2d_async(void* ptr, size_t pitch, int value, size_t row_bytes, size_t rows, int device,
                     void* stream);
// 2D copy: `rows` rows of `row_bytes`, with the given pitches (device to device).
void copy_2d_async(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                   size_t rows, int device, void* stream);
// Blocking copies between host and device (pool bookkeeping only, never on an op's path).
void copy_to_host(void* dst, const void* src, size_t bytes, int device, void* stream);
void copy_to_device(void* dst, const void* src, size_t bytes, int device, void* stream);

// The conv update and the fused decode layer step (src/cuda/conv_update.cu,
// src/cuda/fused_decode_step.cu).
void run_conv_update(const detail::ConvUpdateProblem& p, void* stream);
void run_fused_decode_step(const detail::FusedStepProblem& p, void* stream);
// The workspace bytes of the fused step's plan for p's shapes, dtypes and device when a workspace
// is given: the chain's where it would run, else 0 (src/cuda/fused_decode_step.cu).
int64_t fused_decode_step_workspace_bytes(const detail::FusedStepProblem& p);

}  // namespace deltastate::cuda_backend
