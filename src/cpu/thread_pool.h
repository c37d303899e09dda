// A small persistent thread pool for the CPU backend: parallel_for over independent tasks.
// Threads: DELTASTATE_NUM_THREADS, else the hardware concurrency. The calling thread takes part,
// so a 1-thread pool runs inline. A call allocates nothing: the task function is passed by
// reference (TaskFn) and the pool's threads and job record persist.
#pragma once

#include <cstdint>
#include <type_traits>

namespace deltastate::cpu {

// A non-owning reference to a callable void(int64_t), valid while the call that takes it runs.
class TaskFn {
 public:
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, TaskFn>>>
  TaskFn(
      const F& f)  // NOLINT: implicit, so that parallel_for(n, [&](int64_t i) {...}) reads plainly
      : obj_(&f), call_([](const void* o, int64_t i) { (*static_cast<const F*>(o))(i); }) {}
  void operator()(int64_t i) const { call_(obj_, i); }

 private:
  const void* obj_;
  void (*call_)(const void*, int64_t);
};

// Runs fn(i) for every i in [0, count), spread over the pool; returns when all are done. An
// exception thrown by fn is rethrown here (the first one; the remaining tasks still run).
// Which thread runs which task is not fixed; the kernels make every task's result independent of
// that.
void parallel_for(int64_t count, TaskFn fn);

int num_threads();

// Replaces the pool by one of n threads (n <= 0: the default above). Not while a parallel_for
// runs; for tests and benchmarks that compare thread counts in one process.
void set_num_threads(int n);

}  // namespace deltastate::cpu
