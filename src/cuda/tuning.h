// The CUDA backend's tuning choices and their overrides, in one place.
#pragma once

#include <cstdlib>
#include <initializer_list>

namespace deltastate::cuda_backend {

// A kernel-variant override from the environment (benchmarks and tests force variants): the
// value of `name` when it is one of `allowed`, else 0 (none). Callers read it once (a static).
inline int env_override(const char* name, std::initializer_list<int> allowed) {
  const char* e = std::getenv(name);
  const int v = e ? std::atoi(e) : 0;
  for (const int a : allowed)
    if (v == a) return v;
  return 0;
}

}  // namespace deltastate::cuda_backend
