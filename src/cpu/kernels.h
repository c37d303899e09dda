// The CPU backend: one entry point per op, each running a validated problem on the thread pool.
#pragma once

#include "core/problem.h"

namespace deltastate::cpu {

void run_recurrent(const detail::RecurrentProblem& p);      // recurrent.cpp (packed decode too)
void run_replayssm_decode(const detail::ReplayProblem& p);  // replayssm_decode.cpp
// Prefix caching (StatePool::fork): the checkpoint of slot `dst` (a copy of src's) becomes the
// state after src's m ring records from position `base` (p's rings, modes and state in its
// format; p's row fields unused), rebuilt exactly as a ReplaySSM fold rebuilds the state before
// its token; a formatted state is stored as src's history checkpoint at the counter's step would
// be (src's key, the counter not advanced).
void run_replay_materialize(const detail::ReplayProblem& p, int64_t src, int64_t dst, int m,
                            int base);
// chunk_prefill.cpp: the op, and the workspace it needs (num_threads() scratch blocks).
void run_chunk_prefill(const detail::ChunkPrefillProblem& p);
int64_t chunk_prefill_workspace_bytes(int K, int V, bool kda);

// conv_update.cpp: causal_conv1d_update; fused_decode_step.cpp: the fused decode layer step.
void run_conv_update(const detail::ConvUpdateProblem& p);
void run_fused_decode_step(const detail::FusedStepProblem& p);
// verify.cpp: speculative verify and its commits (states and conv windows).
void run_verify(const detail::VerifyProblem& p);
void run_commit(const detail::CommitProblem& p);
// replayssm_verify.cpp: ReplaySSM speculative verify and its cursor commit.
void run_replayssm_verify(const detail::ReplayVerifyProblem& p);
void run_replayssm_commit(const detail::ReplayCommitProblem& p);
void run_replayssm_reset_cursors(const detail::ReplayResetProblem& p);
void run_replayssm_fold_commit(const detail::ReplayFoldProblem& p);
void run_replayssm_circular_commit(const detail::ReplayCircularProblem& p);

}  // namespace deltastate::cpu
