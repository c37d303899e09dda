// The CUDA backend's error record: one per device, in device memory. A kernel that meets a bad
// row skips it (no state, ring or cursor access; output row NaN) and records the first one
// (grid.cuh record_bad_row); check_errors reads it on the host, clears it and throws. Kernels
// reach the record through a pointer in their problem struct: without relocatable device code a
// __device__ variable is per translation unit, so this file holds the one definition and the
// launchers pass its address (cudaGetSymbolAddress once per device, cached).
#include <array>
#include <atomic>
#include <mutex>
#include <string>

#include "api/backend.h"
#include "core/problem.h"
#include "cuda/launch.h"
#include "deltastate/error.h"

namespace deltastate::cuda_backend {

namespace {

__device__ detail::DeviceErrorRecord g_device_errors;  // zero at module load

constexpr int kMaxDevices = 64;
std::array<std::atomic<detail::DeviceErrorRecord*>, kMaxDevices> g_records{};
std::atomic<bool> g_any_device{false};
std::mutex g_mu;

detail::DeviceErrorRecord* symbol_address(int device) {
  DeviceGuard guard(device);
  void* ptr = nullptr;
  DS_CUDA_CHECK(cudaGetSymbolAddress(&ptr, g_device_errors));
  return static_cast<detail::DeviceErrorRecord*>(ptr);
}

// The record of `device` if a launch has used it, else null.
detail::DeviceErrorRecord* used_record(int device) {
  if (device < 0) return nullptr;
  if (device >= kMaxDevices) return symbol_address(device);
  return g_records[device].load(std::memory_order_acquire);
}

// The validator's text of an out-of-range slot (contracts/chunk_prefill.cpp, contract.cpp).
std::string out_of_range(const char* name, const detail::DeviceErrorRecord& r,
                         const char* negative) {
  return std::string("`") + name + "`[" + std::to_string(r.row) + "]=" + std::to_string(r.index) +
         " is out of range for a state pool of " + std::to_string(r.limit) + " slots (valid: 0.." +
         std::to_string(r.limit - 1) + "; < 0 " + negative + ")";
}

// A chunked-prefill sequence that names a slot past the pool (any of its three slot arrays).
std::string prefill_message(const detail::DeviceErrorRecord& r) {
  std::string m = r.op == detail::kErrOpChunkKda ? "chunk_kda: " : "chunk_gated_delta_rule: ";
  if (r.kind == detail::kErrOutputSlot)
    m += out_of_range("output_state_indices", r, "stores no final state");
  else if (r.kind == detail::kErrCheckpointSlot)
    m += out_of_range("checkpoint_slot_indices", r, "skips the checkpoint");
  else m += out_of_range("initial_state_indices", r, "marks a padded row");
  return m + "; its sequence was skipped (no pool slot written) and its outputs are NaN";
}

std::string message(const detail::DeviceErrorRecord& r) {
  if (r.op == detail::kErrOpChunkGdn || r.op == detail::kErrOpChunkKda) return prefill_message(r);
  if (r.op == detail::kErrOpReplayReset)  // the CPU validator's text; a reset has no output
    return "replayssm_reset_cursors: `state_indices`[" + std::to_string(r.row) +
           "]=" + std::to_string(r.index) + " is out of range for a pool of " +
           std::to_string(r.limit) + " slots; its cursors were not reset";
  const char* op = r.op == detail::kErrOpReplay           ? "replayssm_decode"
                   : r.op == detail::kErrOpConv           ? "causal_conv1d_update"
                   : r.op == detail::kErrOpFusedStep      ? "fused_decode_step"
                   : r.op == detail::kErrOpVerify         ? "verify"
                   : r.op == detail::kErrOpCommit         ? "update_state_after_verify"
                   : r.op == detail::kErrOpReplayVerify   ? "replayssm_verify"
                   : r.op == detail::kErrOpReplayCommit   ? "replayssm_commit"
                   : r.op == detail::kErrOpConvCommit     ? "update_conv_state_after_verify"
                   : r.op == detail::kErrOpReplayFold     ? "replayssm_fold_commit"
                   : r.op == detail::kErrOpReplayCircular ? "commit_gdn_replayssm_circular"
                                                          : "recurrent";
  const char* index_name = r.op == detail::kErrOpConv             ? "conv_state_indices"
                           : r.op == detail::kErrOpConvCommit     ? "state_indices"
                           : r.op == detail::kErrOpReplayCircular ? "state_batch_indices"
                                                                  : "ssm_state_indices";
  std::string m = std::string(op) + ": ";
  if (r.kind == detail::kErrRow) {
    m += "row " + std::to_string(r.row) + ": scratch row " + std::to_string(r.index) +
         " is out of range for an intermediate-state buffer of " + std::to_string(r.limit) +
         " rows";
  } else if (r.kind == detail::kErrStep) {
    m += "row " + std::to_string(r.row) + ": a step, length, accepted count or parent (" +
         std::to_string(r.index) + ") is outside its buffer or table (limit " +
         std::to_string(r.limit) + ")";
  } else if (r.kind == detail::kErrRing) {
    m += "sequence " + std::to_string(r.row) + ": a cursor (write_pos or cache_base) is " +
         std::to_string(r.index) + ", outside the ring of L=" + std::to_string(r.limit);
  } else if (r.kind == detail::kErrCacheBase) {
    m += "`cache_base`[" + std::to_string(r.row) + "]=" + std::to_string(r.index) +
         " is outside the ring [0, L-1=" + std::to_string(r.limit - 1) + "]";
  } else if (r.kind == detail::kErrTrackSlot) {  // the CPU validator's text
    m += "`mamba_track_indices`[" + std::to_string(r.row) + "]=" + std::to_string(r.index) +
         " is out of range for a pool of " + std::to_string(r.limit) + " slots";
  } else if (r.kind == detail::kErrReplayRow) {
    m += "`replay_indices`[" + std::to_string(r.row) + "]=" + std::to_string(r.index) +
         " is out of range for rings and cursor tables of " + std::to_string(r.limit) + " rows";
  } else if (r.kind == detail::kErrCursor) {
    m += "`write_pos`[" + std::to_string(r.row) + "]=" + std::to_string(r.index) +
         " is outside the ring [0, L-1=" + std::to_string(r.limit - 1) + "]";
  } else {
    m += out_of_range(index_name, r, "marks a padded row");
  }
  return m + "; the row was skipped (state, rings and cursor untouched) and its output is NaN";
}

}  // namespace

detail::DeviceErrorRecord* device_errors(int device) {
  if (device < 0 || device >= kMaxDevices) {
    g_any_device.store(true, std::memory_order_release);
    return symbol_address(device);
  }
  detail::DeviceErrorRecord* r = g_records[device].load(std::memory_order_acquire);
  if (r) return r;
  std::lock_guard<std::mutex> lk(g_mu);
  r = g_records[device].load(std::memory_order_relaxed);
  if (!r) {
    r = symbol_address(device);
    g_records[device].store(r, std::memory_order_release);
    g_any_device.store(true, std::memory_order_release);
  }
  return r;
}

void check_errors(void* stream) {
  if (!g_any_device.load(std::memory_order_acquire)) return;  // no launch yet: touch nothing
  auto s = static_cast<cudaStream_t>(stream);
  int device = -1;
  if (cudaStreamGetDevice(s, &device) != cudaSuccess) {
    cudaGetLastError();
    DS_CUDA_CHECK(cudaGetDevice(&device));
  }
  detail::DeviceErrorRecord* ptr = used_record(device);
  if (!ptr) return;  // nothing launched on this stream's device
  DeviceGuard guard(device);
  detail::DeviceErrorRecord rec{};
  DS_CUDA_CHECK(cudaStreamSynchronize(s));
  DS_CUDA_CHECK(cudaMemcpyAsync(&rec, ptr, sizeof rec, cudaMemcpyDeviceToHost, s));
  DS_CUDA_CHECK(cudaStreamSynchronize(s));
  if (rec.flag == 0) return;
  DS_CUDA_CHECK(cudaMemsetAsync(ptr, 0, sizeof rec, s));
  DS_CUDA_CHECK(cudaStreamSynchronize(s));
  throw Error(ErrorKind::value, message(rec));
}

void check_errors_after_op(void* stream) {
  // A stream being captured into a CUDA graph cannot be synchronized: the captured op is checked
  // by a check_errors after the graph's replay.
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  DS_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
  if (status != cudaStreamCaptureStatusNone) return;
  check_errors(stream);
}

}  // namespace deltastate::cuda_backend
