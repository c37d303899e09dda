// simd.h's primitives compiled three times from simd_impl.inc, each inside a target region (GCC
// `#pragma GCC target`, Clang `#pragma clang attribute`) so that only these functions use the
// wider instructions: nothing outside the regions, inline functions of shared headers included,
// is compiled for more than the build's baseline, and one binary runs on any x86-64 CPU.
#include "cpu/simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/delta_math.h"
#include "core/numeric.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define DS_SIMD_X86 1
#else
#define DS_SIMD_X86 0
#endif

// GCC 12 reports its own AVX-512 intrinsics' _mm512_undefined_* operands as uninitialized.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace deltastate::cpu::simd {

namespace portable {
#define DS_SIMD_ISA 0
#define DS_SIMD_NAME "portable"
#include "cpu/simd_impl.inc"
#undef DS_SIMD_NAME
#undef DS_SIMD_ISA
}  // namespace portable

#if DS_SIMD_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
#define DS_SIMD_ISA 1
#define DS_SIMD_NAME "avx2"
#include "cpu/simd_impl.inc"
#undef DS_SIMD_NAME
#undef DS_SIMD_ISA
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(                                                    \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif
namespace avx512 {
#define DS_SIMD_ISA 2
#define DS_SIMD_NAME "avx512"
#include "cpu/simd_impl.inc"
#undef DS_SIMD_NAME
#undef DS_SIMD_ISA
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // DS_SIMD_X86

namespace {

bool has_avx2() {
#if DS_SIMD_X86
  // F16C is not asked for (Clang's __builtin_cpu_supports does not know it): every CPU with
  // AVX2 and FMA has it.
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}
bool has_avx512() {
#if DS_SIMD_X86
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

const Kernels* table_of(const std::string& isa) {
  static constexpr Kernels kPortable = portable::table();
  if (isa == "portable") return &kPortable;
#if DS_SIMD_X86
  static constexpr Kernels kAvx2 = avx2::table();
  static constexpr Kernels kAvx512 = avx512::table();
  if (isa == "avx2" && has_avx2()) return &kAvx2;
  if (isa == "avx512" && has_avx512()) return &kAvx512;
#endif
  return nullptr;
}

const Kernels* choose() {
  const char* forced = std::getenv("DELTASTATE_CPU_ISA");
  if (forced)
    if (const Kernels* k = table_of(forced)) return k;
  for (const char* isa : {"avx512", "avx2"})
    if (const Kernels* k = table_of(isa)) return k;
  return table_of("portable");
}

std::atomic<const Kernels*>& current() {
  static std::atomic<const Kernels*> k{choose()};
  return k;
}

}  // namespace

const Kernels& kernels() { return *current().load(std::memory_order_relaxed); }

bool set_isa(const char* isa) {
  const Kernels* k = table_of(isa);
  if (k) current().store(k, std::memory_order_relaxed);
  return k != nullptr;
}

}  // namespace deltastate::cpu::simd
