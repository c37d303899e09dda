// simd.h's primitives compiled three times from simd_impl.inc, each inside a target region (GCC
// `#pragma GCC target`, Clang `#pragma clang attribute`) so that only these functions use the
// wider instructions: nothing outside the regions, inline functions of shared headers included,
// is compiled for more than the build's baseline, and one binary runs on any x86-64 CPU.
#include "cpu/simd.h"

#include <algorithm>
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
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
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
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
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

Kernels choose() {
  constexpr Kernels kPortable = portable::table();
#if DS_SIMD_X86
  constexpr Kernels kAvx2 = avx2::table();
  constexpr Kernels kAvx512 = avx512::table();
  const char* forced = std::getenv("DELTASTATE_CPU_ISA");
  const std::string want = forced ? forced : "";
  if (want == "portable") return kPortable;
  if (want == "avx2" && has_avx2()) return kAvx2;
  if ((want.empty() || want == "avx512") && has_avx512()) return kAvx512;
  if (has_avx2()) return kAvx2;
#endif
  return kPortable;
}

}  // namespace

const Kernels& kernels() {
  static const Kernels k = choose();
  return k;
}

}  // namespace deltastate::cpu::simd
