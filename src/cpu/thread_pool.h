// A small persistent thread pool for the CPU backend: parallel_for over independent tasks
// (one task = one (sequence, value head) pair). Threads: DELTASTATE_NUM_THREADS, else the
// hardware concurrency. The calling thread takes part, so a 1-thread pool runs inline.
#pragma once

#include <cstdint>
#include <functional>

namespace deltastate::cpu {

// Runs fn(i) for every i in [0, count), spread over the pool; returns when all are done. An
// exception thrown by fn is rethrown here (the first one; the remaining tasks still run).
void parallel_for(int64_t count, const std::function<void(int64_t)>& fn);

int num_threads();

}  // namespace deltastate::cpu
