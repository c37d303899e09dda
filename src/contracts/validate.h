// One validator per op: every check of the op's contract, in one place, run before any memory is
// written. Each returns the backend-neutral problem the kernels run.
#pragma once

#include "core/problem.h"
#include "deltastate/ops.h"

namespace deltastate::detail {

RecurrentProblem validate_packed_decode(const PackedDecodeArgs& args, bool kda);
RecurrentProblem validate_recurrent(const RecurrentArgs& args, bool kda);
ReplayProblem validate_replayssm_decode(const ReplayDecodeArgs& args);
// `workspace_needed`: chunk_prefill_workspace_bytes of the same arguments.
ChunkPrefillProblem validate_chunk_prefill(const ChunkPrefillArgs& args, int64_t workspace_needed);

}  // namespace deltastate::detail
