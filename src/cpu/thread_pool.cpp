#include "cpu/thread_pool.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace deltastate::cpu {

namespace {

class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work_loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void run(int64_t count, TaskFn fn) {
    if (count <= 0) return;
    if (workers_.empty() || count == 1) {
      for (int64_t i = 0; i < count; ++i) fn(i);
      return;
    }
    std::lock_guard<std::mutex> serial(run_mu_);  // one parallel_for at a time
    Job job;
    job.fn = &fn;
    job.count = count;
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &job;
      ++generation_;
    }
    cv_.notify_all();
    drain(job);
    {
      std::unique_lock<std::mutex> lk(mu_);
      done_cv_.wait(lk, [&] { return job.active == 0; });
      job_ = nullptr;
    }
    if (job.error) std::rethrow_exception(job.error);
  }

 private:
  struct Job {
    const TaskFn* fn = nullptr;
    int64_t count = 0;
    std::atomic<int64_t> next{0};
    int active = 0;  // workers inside drain(), guarded by mu_
    std::exception_ptr error;
    std::mutex error_mu;
  };

  static void drain(Job& job) {
    while (true) {
      const int64_t i = job.next.fetch_add(1, std::memory_order_relaxed);
      if (i >= job.count) return;
      try {
        (*job.fn)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lk(job.error_mu);
        if (!job.error) job.error = std::current_exception();
      }
    }
  }

  void work_loop() {
    uint64_t seen = 0;
    while (true) {
      Job* job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || (job_ && generation_ != seen); });
        if (stop_) return;
        seen = generation_;
        job = job_;
        ++job->active;
      }
      drain(*job);
      {
        std::lock_guard<std::mutex> lk(mu_);
        --job->active;
      }
      done_cv_.notify_all();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_, done_cv_;
  Job* job_ = nullptr;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

int configured_threads() {
  if (const char* env = std::getenv("DELTASTATE_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? static_cast<int>(hw) : 1;
}

std::unique_ptr<Pool>& pool_ptr() {
  static std::unique_ptr<Pool> p;
  return p;
}

std::mutex& pool_mu() {
  static std::mutex mu;
  return mu;
}

Pool& pool() {
  std::lock_guard<std::mutex> lk(pool_mu());  // the first CPU op may come from several threads
  std::unique_ptr<Pool>& p = pool_ptr();
  if (!p) p = std::make_unique<Pool>(configured_threads());
  return *p;
}

}  // namespace

void parallel_for(int64_t count, TaskFn fn) { pool().run(count, fn); }

int num_threads() { return pool().size(); }

void set_num_threads(int n) {
  std::lock_guard<std::mutex> lk(pool_mu());
  std::unique_ptr<Pool>& p = pool_ptr();
  p.reset();
  p = std::make_unique<Pool>(n > 0 ? n : configured_threads());
}

}  // namespace deltastate::cpu
