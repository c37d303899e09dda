// Device helpers shared by the CUDA kernels: error checks, the lane layout of a state row, vector
// loads/stores of state rows, group reductions, and the per-token preparation of q, k, gate and
// beta (from the shared math in core/delta_math.h).
//
// Lane layout. A state row S[v, 0:K] is held by a group of G lanes, each holding EPL consecutive
// elements (EPL = 16 bytes of state, so every lane does one 16-byte load per row). A warp holds
// RG = 32/G rows at once; a thread keeps ROWS such rows in registers (register blocking: 32 state
// floats per thread), so a warp owns RG*ROWS rows. KT is the K tile: K == KT on the vector path, K <= KT (masked, element loads)
// on the generic path.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "core/delta_math.h"
#include "core/problem.h"
#include "deltastate/error.h"

namespace deltastate::cuda_backend {

using deltastate::DType;

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorKind::runtime, std::string("CUDA error in ") + what + ": " +
                                        cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}
#define DS_CUDA_CHECK(expr) ::deltastate::cuda_backend::check_cuda((expr), #expr)

// Sets the current device for the scope (only when it differs: cudaSetDevice is not free).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    DS_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) DS_CUDA_CHECK(cudaSetDevice(device));
    else previous_ = -1;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
};

int num_sms(int device);

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return DType::bf16;
  else return DType::f16;
}

template <class StateT, int KT>
struct RowLayout {
  static constexpr int kElemBytes = static_cast<int>(sizeof(StateT));
  static constexpr int G = (KT * kElemBytes / 16) < 32 ? (KT * kElemBytes / 16) : 32;
  static constexpr int EPL = KT / G;  // elements per lane
  static constexpr int RG = 32 / G;   // rows per warp per pass
  static constexpr int ROWS = 32 / EPL;  // rows per thread: 32 state floats in registers
  static_assert(G >= 1 && (G & (G - 1)) == 0, "lanes per row must be a power of two");
  static_assert(EPL * G == KT, "K tile must split evenly over the lanes");
};

// Sum over the G lanes that share a row (all 32 lanes must be converged).
template <int G>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <class T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(x);
  else return __float2half_rn(x);
}

// Load / store EPL consecutive state elements at `p` (the lane's first element). VEC: one or more
// 16-byte accesses (p 16-byte aligned, all elements valid); else element accesses, masked by
// `valid` (elements at or past K).
template <class StateT, int EPL, bool VEC>
__device__ __forceinline__ void load_state(const StateT* p, int valid, float (&x)[EPL]) {
  if constexpr (VEC) {
    constexpr int kPer16 = 16 / static_cast<int>(sizeof(StateT));
#pragma unroll
    for (int c = 0; c < EPL / kPer16; ++c) {
      const uint4 u = __ldcs(reinterpret_cast<const uint4*>(p) + c);
      const StateT* e = reinterpret_cast<const StateT*>(&u);
#pragma unroll
      for (int i = 0; i < kPer16; ++i) x[c * kPer16 + i] = to_float(e[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < EPL; ++i) x[i] = i < valid ? to_float(p[i]) : 0.0f;
  }
}

template <class StateT, int EPL, bool VEC>
__device__ __forceinline__ void store_state(StateT* p, int valid, const float (&x)[EPL]) {
  if constexpr (VEC) {
    constexpr int kPer16 = 16 / static_cast<int>(sizeof(StateT));
#pragma unroll
    for (int c = 0; c < EPL / kPer16; ++c) {
      uint4 u;
      StateT* e = reinterpret_cast<StateT*>(&u);
#pragma unroll
      for (int i = 0; i < kPer16; ++i) e[i] = from_float<StateT>(x[c * kPer16 + i]);
      __stcs(reinterpret_cast<uint4*>(p) + c, u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      if (i < valid) p[i] = from_float<StateT>(x[i]);
  }
}

template <class Head>
__device__ __forceinline__ int64_t head_offset(const Head& t, int64_t seq, int64_t tok, int64_t head) {
  return seq * t.seq_stride + tok * t.tok_stride + head * t.head_stride;
}

// EPL consecutive elements of a per-head input vector starting at element `off`, masked by
// `valid`, as fp32.
template <int EPL>
__device__ __forceinline__ void load_input(const void* base, DType dtype, int64_t off, int valid,
                                           float (&x)[EPL]) {
#pragma unroll
  for (int i = 0; i < EPL; ++i) x[i] = i < valid ? detail::load_float(base, dtype, off + i) : 0.0f;
}

// The lane's slice of one token's q, k (normalized, q scaled), its gate (log decay g and
// alpha = exp(g)) and beta. kofs: the lane's first K index; valid: how many of its EPL are < K.
template <int EPL>
struct TokenSlice {
  float q[EPL], k[EPL], g[EPL], alpha[EPL];
  float beta;
};

template <int EPL, int G>
__device__ __forceinline__ void prepare_qk(float (&q)[EPL], float (&k)[EPL], bool l2norm,
                                           float scale) {
  if (l2norm) {
    float qq = 0.0f, kk = 0.0f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      qq += q[i] * q[i];
      kk += k[i] * k[i];
    }
    const float qd = detail::l2norm_denominator(group_sum<G>(qq));
    const float kd = detail::l2norm_denominator(group_sum<G>(kk));
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      q[i] = q[i] / qd;
      k[i] = k[i] / kd;
    }
  }
#pragma unroll
  for (int i = 0; i < EPL; ++i) q[i] *= scale;
}

// Gate of one (token, value head): `in_off` is the element offset of this head's gate input (g or
// raw a); KDA reads the lane's EPL elements, GDN one broadcast scalar.
template <int EPL>
__device__ __forceinline__ void gate_slice(const detail::GateParams& gate, const void* in,
                                           DType in_dtype, int64_t in_off, int hv, int K, int kofs,
                                           int valid, float (&g)[EPL], float (&alpha)[EPL]) {
  const float A_log = gate.A_log ? detail::load_float(gate.A_log, gate.A_log_dtype, hv) : 0.0f;
  if (gate.kda) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      if (i < valid) {
        const float dt = gate.dt_bias ? detail::load_float(gate.dt_bias, gate.dt_bias_dtype,
                                                           static_cast<int64_t>(hv) * K + kofs + i)
                                      : 0.0f;
        g[i] = detail::gate_value(gate.mode, detail::load_float(in, in_dtype, in_off + kofs + i), dt,
                                  A_log, gate.lower_bound);
      } else {
        g[i] = 0.0f;
      }
      alpha[i] = expf(g[i]);
    }
  } else {
    const float dt = gate.dt_bias ? detail::load_float(gate.dt_bias, gate.dt_bias_dtype, hv) : 0.0f;
    const float gv = detail::gate_value(gate.mode, detail::load_float(in, in_dtype, in_off), dt,
                                        A_log, gate.lower_bound);
    const float a = expf(gv);
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      g[i] = gv;
      alpha[i] = a;
    }
  }
}

// A kernel's report of an out-of-range slot index (debug bounds checking): message, then trap.
__device__ __forceinline__ void trap_bad_slot(const char* op, int64_t row, int64_t slot,
                                              int64_t num_slots) {
  printf("deltastate %s: ssm_state_indices[%lld]=%lld is out of range for a state pool of %lld "
         "slots\n",
         op, static_cast<long long>(row), static_cast<long long>(slot),
         static_cast<long long>(num_slots));
  __trap();
}

}  // namespace deltastate::cuda_backend
