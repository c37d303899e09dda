// The CUDA seam of a build without the CUDA toolkit: every entry says so.
#include "api/backend.h"
#include "deltastate/error.h"

namespace deltastate::cuda_backend {

namespace {
[[noreturn]] void not_built() {
  throw Error(ErrorKind::not_implemented,
              "deltastate was built without CUDA support (no CUDA toolkit at configure time); "
              "CUDA tensors cannot be used. Rebuild with nvcc available, or pass CPU tensors.");
}
}  // namespace

bool built() { return false; }
bool device_available() { return false; }
void run_recurrent(const detail::RecurrentProblem&, void*) { not_built(); }
void run_replayssm_decode(const detail::ReplayProblem&, void*) { not_built(); }
void check_replayssm_decode_launch(const detail::ReplayProblem&) { not_built(); }
void check_replay_materialize(const detail::ReplayProblem&, int) { not_built(); }
void run_replay_materialize(const detail::ReplayProblem&, int64_t, int64_t, int, int, void*) {
  not_built();
}
void run_chunk_prefill(const detail::ChunkPrefillProblem&, void*) { not_built(); }
void run_verify(const detail::VerifyProblem&, void*) { not_built(); }
void run_commit(const detail::CommitProblem&, void*) { not_built(); }
void run_replayssm_verify(const detail::ReplayVerifyProblem&, void*) { not_built(); }
void run_replayssm_commit(const detail::ReplayCommitProblem&, void*) { not_built(); }
void run_replayssm_reset_cursors(const detail::ReplayResetProblem&, void*) { not_built(); }
void run_replayssm_fold_commit(const detail::ReplayFoldProblem&, void*) { not_built(); }
void run_replayssm_circular_commit(const detail::ReplayCircularProblem&, void*) { not_built(); }
int64_t chunk_prefill_workspace_bytes(int, int, int64_t, int64_t, int64_t, bool, int) {
  not_built();
}
detail::DeviceErrorRecord* device_errors(int) { not_built(); }
void check_errors(void*) {}  // no CUDA: no kernel has run, nothing to report
void check_errors_after_op(void*) {}
void* device_alloc(size_t, int) { not_built(); }
void device_free(void*, int) noexcept {}
void memset_2d_async(void*, size_t, int, size_t, size_t, int, void*) { not_built(); }
void copy_2d_async(void*, size_t, const void*, size_t, size_t, size_t, int, void*) { not_built(); }
void copy_to_host(void*, const void*, size_t, int, void*) { not_built(); }
void copy_to_device(void*, const void*, size_t, int, void*) { not_built(); }

void run_conv_update(const detail::ConvUpdateProblem&, void*) { not_built(); }
void run_fused_decode_step(const detail::FusedStepProblem&, void*) { not_built(); }
int64_t fused_decode_step_workspace_bytes(const detail::FusedStepProblem&) { not_built(); }

}  // namespace deltastate::cuda_backend
