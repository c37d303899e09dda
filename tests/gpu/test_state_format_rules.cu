// The CUDA kernels' four-codes-at-once conversions (src/cuda/state_format.cuh: code_values4,
// encode_codes4) against the element rules they stand for (core/state_format.h, the CPU
// backend's): every e4m3 and int8 code decoded, and every fp32 bit pattern encoded to e4m3 to
// nearest, and to e4m3 and int8 stochastically (one draw for four elements, the dithered values
// through the hardware conversion), on the device, compared bit for bit (a NaN: any NaN code).
// The hardware conversions are used only where this holds.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

#include "core/state_format.h"
#include "cuda/state_format.cuh"
#include "gpu_util.h"

namespace {

using deltastate::DType;
namespace fmt = deltastate::cuda_backend::fmt;
namespace detail = deltastate::detail;

struct Mismatch {
  unsigned long long count;
  uint32_t first;  // the first mismatching input seen (any order)
};

__device__ bool same_bits_or_both_nan(float a, float b) {
  return (a != a && b != b) || __float_as_uint(a) == __float_as_uint(b);
}

// Each thread decodes one word of four codes: 64 words cover the 256 codes.
__global__ void decode_all_codes(DType t, Mismatch* m) {
  const uint32_t c0 = 4u * threadIdx.x;
  const uint32_t w = c0 | (c0 + 1) << 8 | (c0 + 2) << 16 | (c0 + 3) << 24;
  float x[4];
  fmt::code_values4(w, t, x);
  for (int i = 0; i < 4; ++i) {
    const float want = fmt::code_value(static_cast<uint8_t>(c0 + i), t);
    if (!same_bits_or_both_nan(x[i], want)) {
      atomicAdd(&m->count, 1ull);
      m->first = c0 + i;
    }
  }
}

// Every fp32 bit pattern in [base, base + 4 * threads): four consecutive patterns a thread.
__global__ void encode_e4m3_range(uint64_t base, Mismatch* m) {
  const uint64_t i0 = base + 4 * (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
  float y[4];
  for (int i = 0; i < 4; ++i) y[i] = __uint_as_float(static_cast<uint32_t>(i0 + i));
  const uint32_t w = fmt::encode_codes4(DType::f8e4m3, y, false, 0, 0);
  for (int i = 0; i < 4; ++i) {
    const uint8_t got = static_cast<uint8_t>(w >> (8 * i));
    // A NaN: a NaN code (the conversion does not keep a NaN's sign; nor does CUDA's fp32
    // division, whose NaN results are the positive canonical NaN)
    const bool ok =
        y[i] != y[i] ? (got & 0x7fu) == 0x7fu : got == detail::float_to_e4m3(y[i], false, 0);
    if (!ok) {
      atomicAdd(&m->count, 1ull);
      m->first = static_cast<uint32_t>(i0 + i);
    }
  }
}

// The same patterns stochastically, element i0 + i's bits at index i0 + i of `key`'s stream.
__global__ void encode_stochastic_range(DType t, uint64_t base, uint64_t key, Mismatch* m) {
  const uint64_t i0 = base + 4 * (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
  float y[4];
  for (int i = 0; i < 4; ++i) y[i] = __uint_as_float(static_cast<uint32_t>(i0 + i));
  const uint32_t w = fmt::encode_codes4(t, y, true, key, i0);
  for (int i = 0; i < 4; ++i) {
    const uint8_t got = static_cast<uint8_t>(w >> (8 * i));
    const uint8_t want = fmt::encode_code(t, y[i], true, key, i0 + i);
    const bool ok = t == DType::f8e4m3 && y[i] != y[i] ? (got & 0x7fu) == 0x7fu : got == want;
    if (!ok) {
      atomicAdd(&m->count, 1ull);
      m->first = static_cast<uint32_t>(i0 + i);
    }
  }
}

class StateFormatRules : public dstest::GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped()) return;
    ASSERT_EQ(cudaMalloc(&m_, sizeof(Mismatch)), cudaSuccess);
    ASSERT_EQ(cudaMemset(m_, 0, sizeof(Mismatch)), cudaSuccess);
  }
  void TearDown() override {
    if (m_) EXPECT_EQ(cudaFree(m_), cudaSuccess);
  }
  Mismatch result() {
    Mismatch h{};
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(&h, m_, sizeof h, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  Mismatch* m_ = nullptr;
};

TEST_F(StateFormatRules, HardwareCodeValuesMatchRule) {
  for (DType t : {DType::f8e4m3, DType::i8}) {
    ASSERT_EQ(cudaMemset(m_, 0, sizeof(Mismatch)), cudaSuccess);
    decode_all_codes<<<1, 64>>>(t, m_);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const Mismatch r = result();
    EXPECT_EQ(r.count, 0u) << deltastate::dtype_name(t) << ": code " << r.first;
  }
}

TEST_F(StateFormatRules, HardwareE4m3MatchesRule) {
  // 2^32 patterns: 2^30 threads in launches of 2^24.
  constexpr unsigned kThreads = 256, kBlocks = (1u << 24) / kThreads;
  for (uint64_t base = 0; base < (uint64_t{1} << 32); base += uint64_t{4} << 24)
    encode_e4m3_range<<<kBlocks, kThreads>>>(base, m_);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const Mismatch r = result();
  float first;
  std::memcpy(&first, &r.first, 4);
  EXPECT_EQ(r.count, 0u) << "first mismatch at bits 0x" << std::hex << r.first << " (" << first
                         << ")";
}

TEST_F(StateFormatRules, HardwareStochasticMatchesRule) {
  constexpr unsigned kThreads = 256, kBlocks = (1u << 24) / kThreads;
  for (DType t : {DType::f8e4m3, DType::i8}) {
    ASSERT_EQ(cudaMemset(m_, 0, sizeof(Mismatch)), cudaSuccess);
    const uint64_t key = detail::sr_key(3, 5, 7, t == DType::i8 ? 11 : 13);
    for (uint64_t base = 0; base < (uint64_t{1} << 32); base += uint64_t{4} << 24)
      encode_stochastic_range<<<kBlocks, kThreads>>>(t, base, key, m_);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const Mismatch r = result();
    float first;
    std::memcpy(&first, &r.first, 4);
    EXPECT_EQ(r.count, 0u) << deltastate::dtype_name(t) << ": first mismatch at bits 0x" << std::hex
                           << r.first << " (" << first << ")";
  }
}

}  // namespace
