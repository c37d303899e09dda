// Loads of the kernels' inputs and their conversion to fp32: the storage dtypes' conversions,
// 16-bit elements in their own 32-bit registers (Wide), input loaders for typed and mixed dtypes,
// and loads issued where they stand and converted where their value is used.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "core/numeric.h"
#include "deltastate/tensor.h"

namespace deltastate::cuda_backend {

using deltastate::DType;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <class T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(x);
  else return __float2half_rn(x);
}

// The DType of an element type.
template <class T>
__host__ __device__ constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return DType::bf16;
  else return DType::f16;
}

// A 16-bit input element loaded zero-extended into a 32-bit register. Held as the type itself,
// nvcc packs two of them into one register, and the packing (a PRMT) waits for the load: a
// kernel loading ahead then waits at the load (in the streaming kernel's producer, a third of its
// stalls).
template <class T>
struct Wide {
  uint32_t bits;
};
// A read-only 16-bit load into a 32-bit register (zero-extended), in asm: with __ldg of an
// unsigned short, nvcc keeps a 16-bit register and converts it where it is used.
__device__ __forceinline__ uint32_t load_u16_wide(const void* p) {
  uint32_t v;
  asm("ld.global.nc.u16 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float to_float(Wide<__nv_bfloat16> x) {
  return __uint_as_float(x.bits << 16);
}
__device__ __forceinline__ float to_float(Wide<__half> x) {
  return to_float(__ushort_as_half(static_cast<unsigned short>(x.bits)));
}

// Input loaders. TypedInput<T> reads inputs known to be of type T (the fast path: one plain load
// per element, so all of a token's loads issue back to back); AnyInput switches on the runtime
// dtype (the generic path, for callers whose inputs mix dtypes).
// load_wide returns the element unconverted, 16-bit types zero-extended into their own register
// (`wide_type`, Wide), so that a kernel can issue its loads now and convert them where it uses
// them (a conversion right after a load makes the warp wait for it; so does packing two 16-bit
// values into one register). `type` is the element type as stored (ReplaySSM stages its k
// records in it).
template <class T>
struct TypedInput {
  using type = T;
  using wide_type = std::conditional_t<sizeof(T) == 2, Wide<T>, T>;  // T, never packed
  __device__ __forceinline__ static float load(const void* p, DType, int64_t i) {
    return to_float(__ldg(static_cast<const T*>(p) + i));
  }
  __device__ __forceinline__ static wide_type load_wide(const void* p, DType, int64_t i) {
    if constexpr (sizeof(T) == 2) return {load_u16_wide(static_cast<const T*>(p) + i)};
    else return __ldg(static_cast<const T*>(p) + i);
  }
};
struct AnyInput {
  using type = float;  // what generic kernels convert to
  using wide_type = float;
  __device__ __forceinline__ static float load(const void* p, DType t, int64_t i) {
    return detail::load_float(p, t, i);
  }
  __device__ __forceinline__ static float load_wide(const void* p, DType t, int64_t i) {
    return detail::load_float(p, t, i);
  }
};

// An input element as T: converted as loaded (T = float) or unconverted (T = In::wide_type, for
// a kernel that converts it later, where it is used).
template <class In, class T>
__device__ __forceinline__ T load_input(const void* p, DType t, int64_t i) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, typename In::wide_type>,
                "inputs: converted (float) or wide");
  if constexpr (std::is_same_v<T, float>) return In::load(p, t, i);
  else return In::load_wide(p, t, i);
}

// A 32-bit load issued where it stands (read-only data; _cg: data other CTAs of the launch write,
// read at L2). Volatile asm is neither deleted nor sunk past a branch, so a load whose value only
// a later test uses still leaves first: nvcc moved the ReplaySSM cursor load behind the slot's
// padding test, two DRAM round trips in a row.
__device__ __forceinline__ int load_int_now(const int32_t* p) {
  int v;
  asm volatile("ld.global.nc.b32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ int load_int_now_cg(const int32_t* p) {
  int v;
  asm volatile("ld.global.cg.b32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

// Loads whose conversion waits for them (a sign extension, a dtype switch's join): the bits
// issued where they stand, converted where the value is used, so that a kernel loading ahead does
// not wait at the load (the streaming kernel's producer stalls there otherwise). Nor may a value
// that is either loaded or zero be zeroed after the load is issued: the zeroing waits for the
// load's register, so such loads read kZeroWord.
__device__ const uint64_t kZeroWord = 0;
// Index i of an int32 or int64 index tensor, not yet sign-extended (index_of_bits).
__device__ __forceinline__ uint64_t load_index_bits(const void* p, DType t, int64_t i) {
  return t == DType::i64 ? static_cast<uint64_t>(__ldg(static_cast<const long long*>(p) + i))
                         : static_cast<uint64_t>(__ldg(static_cast<const unsigned*>(p) + i));
}
__device__ __forceinline__ int64_t index_of_bits(uint64_t b, DType t) {
  return t == DType::i64 ? static_cast<int64_t>(b) : static_cast<int64_t>(static_cast<int32_t>(b));
}
// Index i of an int32 or int64 index tensor, issued where it stands (volatile asm: not sunk
// behind later code) into registers of its own per dtype: load_index_bits joins the two dtypes'
// loads into one register, and a join (or a predicated second load into the same register) waits
// for the load. index_now converts where the value is used, as index_of_bits does (written out:
// through index_of_bits ptxas allocates the 16-bit decode kernels' registers differently). A kernel
// whose first dependent load is the slot's issues this first: any load issued before it whose
// register is spilled or moved makes the warp wait a whole round trip before the slot's load
// leaves.
struct IndexNow {
  uint64_t wide = 0;    // int64 tables
  uint32_t narrow = 0;  // int32 tables
};
__device__ __forceinline__ IndexNow load_index_now(const void* p, DType t, int64_t i) {
  IndexNow x;
  if (t == DType::i64)
    asm volatile("ld.global.nc.b64 %0, [%1];\n"
                 : "=l"(x.wide)
                 : "l"(static_cast<const long long*>(p) + i));
  else
    asm volatile("ld.global.nc.b32 %0, [%1];\n"
                 : "=r"(x.narrow)
                 : "l"(static_cast<const int32_t*>(p) + i));
  return x;
}
__device__ __forceinline__ int64_t index_now(const IndexNow& x, DType t) {
  return t == DType::i64 ? static_cast<int64_t>(x.wide)
                         : static_cast<int64_t>(static_cast<int32_t>(x.narrow));
}
// Element i of a float tensor of dtype t as stored (zero-extended to 32 bits; float_of_bits).
__device__ __forceinline__ uint32_t load_float_bits(const void* p, DType t, int64_t i) {
  return t == DType::f32 ? __ldg(static_cast<const unsigned*>(p) + i)
                         : load_u16_wide(static_cast<const uint16_t*>(p) + i);
}
__device__ __forceinline__ float float_of_bits(uint32_t b, DType t) {
  switch (t) {
    case DType::bf16:
      return to_float(Wide<__nv_bfloat16>{b});
    case DType::f16:
      return to_float(Wide<__half>{b});
    default:
      return __uint_as_float(b);
  }
}

// ---- words: elements read and written as whole 8- or 16-byte words ------------------------------
// (the vector conv kernel, conv_update.cu; the chain's norm kernel, fused_decode_step/chain.cuh)
// N words W (uint2 or uint4) from p (aligned to W), read-only (__ldg) or read once before being
// written (_cs: in place, streamed), and their stores.
template <class W, int N>
__device__ __forceinline__ void load_words(const void* p, W (&w)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) w[i] = __ldg(static_cast<const W*>(p) + i);
}
template <int N>
__device__ __forceinline__ void load_words_cs(const void* p, uint4* w) {
#pragma unroll
  for (int i = 0; i < N; ++i) w[i] = __ldcs(static_cast<const uint4*>(p) + i);
}
template <int N, class W>
__device__ __forceinline__ void store_words(void* p, const W* w) {
#pragma unroll
  for (int i = 0; i < N; ++i) static_cast<W*>(p)[i] = w[i];
}
// Element e (a constant once unrolled) of words holding EB-byte elements, as stored (zero-extended
// to 32 bits; float_of_bits), and its replacement.
template <int EB, class W, int N>
__device__ __forceinline__ uint32_t bits_at(const W (&w)[N], int e) {
  static_assert(EB == 2 || EB == 4, "16- or 32-bit elements");
  const uint32_t u = reinterpret_cast<const uint32_t*>(w)[e * EB / 4];
  if constexpr (EB == 4) return u;
  else return e % 2 ? u >> 16 : u & 0xffffu;
}
template <int EB, class W, int N>
__device__ __forceinline__ void set_bits_at(W (&w)[N], int e, uint32_t b) {
  uint32_t& u = reinterpret_cast<uint32_t*>(w)[e * EB / 4];
  if constexpr (EB == 4) u = b;
  else u = e % 2 ? (u & 0xffffu) | (b << 16) : (u & 0xffff0000u) | b;
}
// fp32 v rounded to dtype t as stored (detail::store_float's rounding; float_of_bits reads it).
__device__ __forceinline__ uint32_t bits_of_float(float v, DType t) {
  switch (t) {
    case DType::bf16:
      return detail::float_to_bf16(v);
    case DType::f16:
      return detail::float_to_f16(v);
    default:
      return __float_as_uint(v);
  }
}

}  // namespace deltastate::cuda_backend
