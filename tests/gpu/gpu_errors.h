// What the GPU tests of the slot guard share: the device's error record (cleared, read back
// with check_errors) and bit-level comparisons of the rows a guarded launch writes.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "test_util.h"

namespace dstest {

// A guard test's case: the shape, the gate, and the state, activation and index dtypes.
struct GuardCase {
  const char* name;
  Shape shape;
  bool kda;
  DType state, act, index;
};
inline void PrintTo(const GuardCase& c, std::ostream* os) { *os << c.name; }

// Clears what an earlier (failed) test may have left in the device's error record.
inline void clear_device_errors() {
  try {
    deltastate::check_errors(nullptr);
  } catch (const deltastate::Error&) {
  }
}

// check_errors(stream) throws ErrorKind::value with one of `texts` (which bad row is recorded
// first is up to the scheduler when there are several); a second call passes (cleared).
inline void expect_reported(cudaStream_t stream, const std::vector<std::string>& texts) {
  const auto e = catch_error([&] { deltastate::check_errors(stream); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->kind(), deltastate::ErrorKind::value);
  EXPECT_NE(std::find(texts.begin(), texts.end(), std::string(e->what())), texts.end())
      << "check_errors said: " << e->what();
  EXPECT_NO_THROW(deltastate::check_errors(stream)) << "the record was not cleared";
}

// An index far past any pool of the tests (the largest an index dtype holds, or 2^40).
inline int64_t far_index(DType index_dtype) {
  return index_dtype == DType::i64 ? int64_t{1} << 40 : int64_t{2147483647};
}

inline ::testing::AssertionResult bytes_equal(const Tensor& a, const Tensor& b) {
  if (a.alloc_bytes() != b.alloc_bytes()) return ::testing::AssertionFailure() << "sizes differ";
  if (std::memcmp(a.alloc_base(), b.alloc_base(), static_cast<size_t>(a.alloc_bytes())) != 0)
    return ::testing::AssertionFailure() << "bytes differ";
  return ::testing::AssertionSuccess();
}

// Element-wise bit identity of two value lists (doubles widened from the stored values: equal
// bits in, equal bits out, signed zeros distinct).
inline ::testing::AssertionResult same_bits(const std::vector<double>& a,
                                            const std::vector<double>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(double)) != 0)
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult all_nan(const std::vector<double>& v) {
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isnan(v[i])) return ::testing::AssertionFailure() << "element " << i << " = " << v[i];
  return ::testing::AssertionSuccess();
}

}  // namespace dstest
