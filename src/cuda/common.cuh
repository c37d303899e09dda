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

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

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

// A kernel-variant override from the environment (benchmarks and tests force variants): the
// value of `name` when it is one of `allowed`, else 0 (none). Callers read it once (a static).
inline int env_override(const char* name, std::initializer_list<int> allowed) {
  const char* e = std::getenv(name);
  const int v = e ? std::atoi(e) : 0;
  for (const int a : allowed)
    if (v == a) return v;
  return 0;
}

// Device queries, cached per device (src/cuda/memory.cu).
int num_sms(int device);
int max_smem_optin(int device);  // shared memory per block a kernel may opt in to

// A value computed once per device and then cached (thread-safe). Kernel attributes such as the
// dynamic shared-memory opt-in are per device: a process driving several GPUs must set them on
// each, so a launcher keeps one of these per kernel instantiation. Launches read it on every
// call: a cached value is one atomic load, the mutex is taken only to compute it. Values are
// positive (0 marks "not yet"); device ordinals past kMaxDevices are computed on every call.
class PerDeviceOnce {
 public:
  template <class F>
  int get(int device, F&& compute) {
    if (device < 0 || device >= kMaxDevices) return compute();
    std::atomic<int>& value = values_[device];
    int v = value.load(std::memory_order_acquire);
    if (v > 0) return v;
    std::lock_guard<std::mutex> lk(mu_);
    v = value.load(std::memory_order_relaxed);
    if (v <= 0) {
      v = compute();
      value.store(v, std::memory_order_release);
    }
    return v;
  }

 private:
  static constexpr int kMaxDevices = 64;
  std::array<std::atomic<int>, kMaxDevices> values_{};
  std::mutex mu_;
};

// Programmatic dependent launch (PDL, compute capability 9.0). Every kernel of the backend starts
// with enter_grid(): it waits until the grids this one depends on have completed and their memory
// is visible (launched without the PDL attribute, the wait returns at once: the stream already
// ordered the grids, so the kernels need no second variant; nothing before it may touch global
// memory). With `trigger_early` it then lets the next PDL-launched grid on the stream be scheduled
// at once (its CTAs wait in their own enter_grid); otherwise that happens as this grid's CTAs exit.
// Launchers trigger early only for grids that leave room on the GPU for the next one
// (pdl_trigger_early): early triggers made one-wave grids slower (B=4 decode 7.3 -> 8.2 us, B=8
// 12.2 -> 14.0) and small ones faster (B=1 4.1 -> 3.6); seventh session, runs 1-2.
__device__ __forceinline__ void enter_grid(bool trigger_early) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (trigger_early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether a launch of `ctas` CTAs, at most `resident_per_sm` of them resident per SM, triggers the
// next PDL grid early (enter_grid): when it fills at most half of the GPU's CTA slots.
// DELTASTATE_CUDA_PDL_TRIGGER=1 (early) | 2 (at exit) forces it (benchmarks).
bool pdl_trigger_early(int64_t ctas, int resident_per_sm, int device);
// The problem as one launch passes it to its kernel: pdl_trigger_early set for that launch (only
// with pdl; without it the next grid is let in as this one's CTAs exit).
template <class Problem>
Problem with_pdl_trigger(Problem p, int64_t ctas, int resident_per_sm) {
  p.pdl_trigger_early = p.pdl && pdl_trigger_early(ctas, resident_per_sm, p.device.index);
  return p;
}

// Launches `kernel` on `stream`, with programmatic stream serialization when `pdl` (the grid may
// be scheduled while the stream's previous kernel is still running; enter_grid orders memory).
// Kernel parameters are passed by value, as with <<<...>>>.
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                   cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = pdl ? attr : nullptr;
  config.numAttrs = pdl ? 1 : 0;
  DS_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
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

using detail::head_offset;

// A 16-bit input element loaded zero-extended into a 32-bit register. Held as the type itself,
// nvcc packs two of them into one register, and the packing (a PRMT) waits for the load: a
// kernel loading ahead then waits at the load (ncu, eighth session: the streaming kernel's
// producer, 30% of its stall samples).
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
__device__ __forceinline__ float to_float(Wide<__nv_bfloat16> x) { return __uint_as_float(x.bits << 16); }
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
// padding test, two DRAM round trips in a row (ncu, sixth session).
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

// One token's inputs for one lane: its K slice of q and k, the gate input (its K slice for KDA,
// one scalar for GDN) and beta's input (TokenHeadInputs), plus its rows' v (TokenInputs). T: float
// (converted as loaded), or the input's own type (loaded raw; widen() converts).
template <int EPL, class T = float>
struct TokenHeadInputs {
  T q[EPL], k[EPL], g[EPL], b;
};
template <int EPL, class T>
__device__ __forceinline__ TokenHeadInputs<EPL> widen(const TokenHeadInputs<EPL, T>& r) {
  TokenHeadInputs<EPL> x;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    x.q[i] = to_float(r.q[i]);
    x.k[i] = to_float(r.k[i]);
    x.g[i] = to_float(r.g[i]);
  }
  x.b = to_float(r.b);
  return x;
}
template <int EPL, int R>
struct TokenInputs : TokenHeadInputs<EPL> {
  float v[R];
};

// Loads whose conversion waits for them (a sign extension, a dtype switch's join): the bits
// issued where they stand, converted where the value is used, so that a kernel loading ahead does
// not wait at the load (ncu, eighth session: the streaming kernel's producer stalled there). Nor
// may a value that is either loaded or zero be zeroed after the load is issued: the zeroing
// waits for the load's register (ncu, eighth session, runs 3-4), so such loads read kZeroWord.
__device__ const uint64_t kZeroWord = 0;
// Index i of an int32 or int64 index tensor, not yet sign-extended (index_of_bits).
__device__ __forceinline__ uint64_t load_index_bits(const void* p, DType t, int64_t i) {
  return t == DType::i64 ? static_cast<uint64_t>(__ldg(static_cast<const long long*>(p) + i))
                         : static_cast<uint64_t>(__ldg(static_cast<const unsigned*>(p) + i));
}
__device__ __forceinline__ int64_t index_of_bits(uint64_t b, DType t) {
  return t == DType::i64 ? static_cast<int64_t>(b) : static_cast<int64_t>(static_cast<int32_t>(b));
}
// Element i of a float tensor of dtype t as stored (zero-extended to 32 bits; float_of_bits).
__device__ __forceinline__ uint32_t load_float_bits(const void* p, DType t, int64_t i) {
  return t == DType::f32 ? __ldg(static_cast<const unsigned*>(p) + i)
                         : load_u16_wide(static_cast<const uint16_t*>(p) + i);
}
__device__ __forceinline__ float float_of_bits(uint32_t b, DType t) {
  switch (t) {
    case DType::bf16: return to_float(Wide<__nv_bfloat16>{b});
    case DType::f16: return to_float(Wide<__half>{b});
    default: return __uint_as_float(b);
  }
}

template <class In, int EPL, class T, class Problem>
__device__ __forceinline__ void load_token_head(const Problem& p, const detail::HeadInput& gate_in,
                                                const detail::HeadInput& beta_in, int64_t seq,
                                                int64_t tok, int h, int hv, int kofs, int valid,
                                                TokenHeadInputs<EPL, T>& x) {
  auto ld = [](const void* ptr, DType dt, int64_t i) { return load_input<In, T>(ptr, dt, i); };
  const int64_t q_off = head_offset(p.q, seq, tok, h) + kofs;
  const int64_t k_off = head_offset(p.k, seq, tok, h) + kofs;
  const int64_t g_off = head_offset(gate_in, seq, tok, hv);
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    x.q[i] = i < valid ? ld(p.q.ptr, p.q.dtype, q_off + i) : T{};
    x.k[i] = i < valid ? ld(p.k.ptr, p.k.dtype, k_off + i) : T{};
  }
  if (p.gate.kda) {
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      x.g[i] = i < valid ? ld(gate_in.ptr, gate_in.dtype, g_off + kofs + i) : T{};
  } else {
    x.g[0] = ld(gate_in.ptr, gate_in.dtype, g_off);
    if constexpr (!std::is_same_v<T, float>)  // defined values for widen()
#pragma unroll
      for (int i = 1; i < EPL; ++i) x.g[i] = T{};
  }
  x.b = ld(beta_in.ptr, beta_in.dtype, head_offset(beta_in, seq, tok, hv));
}

template <class In, int EPL, int R, class Problem>
__device__ __forceinline__ void load_token(const Problem& p, const detail::HeadInput& gate_in,
                                           const detail::HeadInput& beta_in, int64_t seq,
                                           int64_t tok, int h, int hv, int kofs, int valid,
                                           int row0, int rg, TokenInputs<EPL, R>& x) {
  const int64_t v_off = head_offset(p.v, seq, tok, hv);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = row0 + r * rg;
    x.v[r] = row < p.V ? In::load(p.v.ptr, p.v.dtype, v_off + row) : 0.0f;
  }
  load_token_head<In>(p, gate_in, beta_in, seq, tok, h, hv, kofs, valid, x);
}

// Per-head gate constants: A_log[hv] and the lane's dt_bias (its K slice for KDA; for GDN the
// head's scalar in every entry, each entry its own cached load: loading it once and copying it
// measured more register pressure, and spills, in the 16-bit-state kernels).
// T = uint32_t: their bits as stored (load_float_bits), for a kernel loading ahead; widen()
// converts.
template <int EPL, class T = float>
struct GateConsts {
  T A_log, dt[EPL];
};
template <int EPL, class T>
__device__ __forceinline__ void load_gate_consts(const detail::GateParams& gate, int hv, int K,
                                                 int kofs, int valid, GateConsts<EPL, T>& c) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint32_t>, "floats or their bits");
  if constexpr (std::is_same_v<T, float>) {
    c.A_log = gate.A_log ? detail::load_float(gate.A_log, gate.A_log_dtype, hv) : 0.0f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int64_t idx = gate.kda ? static_cast<int64_t>(hv) * K + kofs + i : hv;
      c.dt[i] = gate.dt_bias && (!gate.kda || i < valid)
                    ? detail::load_float(gate.dt_bias, gate.dt_bias_dtype, idx)
                    : 0.0f;
    }
  } else {  // every load unconditional: an absent tensor or element reads kZeroWord
    c.A_log = load_float_bits(gate.A_log ? gate.A_log : &kZeroWord, gate.A_log_dtype, gate.A_log ? hv : 0);
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const bool here = gate.dt_bias && (!gate.kda || i < valid);
      const int64_t idx = gate.kda ? static_cast<int64_t>(hv) * K + kofs + i : hv;
      c.dt[i] = load_float_bits(here ? gate.dt_bias : &kZeroWord, gate.dt_bias_dtype, here ? idx : 0);
    }
  }
}
template <int EPL>
__device__ __forceinline__ GateConsts<EPL> widen(const detail::GateParams& gate,
                                                 const GateConsts<EPL, uint32_t>& r) {
  GateConsts<EPL> c;
  c.A_log = float_of_bits(r.A_log, gate.A_log_dtype);
#pragma unroll
  for (int i = 0; i < EPL; ++i) c.dt[i] = float_of_bits(r.dt[i], gate.dt_bias_dtype);
  return c;
}

// Zeros the output of a padded tile's rows row0, row0 + step, ... (R of them, those below V);
// o_off is the element offset of the token's output vector for the head.
template <int R>
__device__ __forceinline__ void zero_output_rows(const detail::HeadOutput& out, int V,
                                                 int64_t o_off, int row0, int step) {
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (row0 + r * step < V) detail::store_float(out.ptr, out.dtype, o_off + row0 + r * step, 0.0f);
}

// The gate of one token: log decay g and alpha = exp(g) for the lane's K slice (GDN: broadcast).
template <int EPL>
__device__ __forceinline__ void token_gate(const detail::GateParams& gate, const GateConsts<EPL>& c,
                                           const float (&graw)[EPL], float (&g)[EPL],
                                           float (&alpha)[EPL]) {
  if (gate.kda) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      g[i] = detail::gate_value(gate.mode, graw[i], c.dt[i], c.A_log, gate.lower_bound);
      alpha[i] = expf(g[i]);
    }
  } else {
    const float g0 = detail::gate_value(gate.mode, graw[0], c.dt[0], c.A_log, gate.lower_bound);
    const float a0 = expf(g0);
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      g[i] = g0;
      alpha[i] = a0;
    }
  }
}

// Sums N values, each partial over the G lanes of a row group, with log2(G) shuffle stages that
// halve the number of values while N > 1 (N - 1 + log2(G/N) shuffles instead of N log2(G)). Lane
// `l` of the group ends with the full sum of value (l >> log2(G/N)) & (N-1).
template <int G, int N, int C = N>
__device__ __forceinline__ void halving_stages(float (&v)[N], int lane) {
  if constexpr (C > 1) {
    constexpr int d = G * C / (2 * N);  // the lane distance of this stage
    const bool upper = (lane & d) != 0;
#pragma unroll
    for (int i = 0; i < C / 2; ++i) {
      const float send = upper ? v[i] : v[i + C / 2];
      const float keep = upper ? v[i + C / 2] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, d);
    }
    halving_stages<G, N, C / 2>(v, lane);
  }
}
template <int G, int N>
__device__ __forceinline__ float transpose_reduce(float (&v)[N], int lane) {
  static_assert(N >= 1 && N <= G && (N & (N - 1)) == 0, "N must be a power of two <= G");
  halving_stages<G, N>(v, lane);
  float x = v[0];
#pragma unroll
  for (int d = G / N / 2; d > 0; d >>= 1) x += __shfl_xor_sync(0xffffffffu, x, d);
  return x;
}
template <int G, int N>
__device__ __forceinline__ int reduced_index(int lane) {
  constexpr int kShift = __builtin_ctz(G / N);
  return (lane >> kShift) & (N - 1);
}
// Lane (within its group of G) that holds value `idx` after transpose_reduce<G, N>.
template <int G, int N>
__device__ __forceinline__ int holder_lane(int idx) {
  return idx << __builtin_ctz(G / N);
}

// Normalizes q and k (optionally), scales q, and returns kq = k.q over the whole K, with one
// 4-value transposed reduction for |q|^2, |k|^2 and q.k.
template <int EPL, int G>
__device__ __forceinline__ float prepare_qk(float (&q)[EPL], float (&k)[EPL], bool l2norm,
                                            float scale, int lane) {
  float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    part[0] += q[i] * q[i];
    part[1] += k[i] * k[i];
    part[2] += q[i] * k[i];
  }
  const float red = transpose_reduce<G, 4>(part, lane);
  const float qq = __shfl_sync(0xffffffffu, red, holder_lane<G, 4>(0), G);
  const float kk = __shfl_sync(0xffffffffu, red, holder_lane<G, 4>(1), G);
  const float qk = __shfl_sync(0xffffffffu, red, holder_lane<G, 4>(2), G);
  if (!l2norm) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) q[i] *= scale;
    return qk * scale;
  }
  // The division form x / den, as divide_by: one IEEE division per vector, not per element
  // (~14% of the decode kernel's instructions went to the per-element divisions).
  const float qd = detail::l2norm_denominator(qq);
  const float kd = detail::l2norm_denominator(kk);
  const float qr = 1.0f / qd, kr = 1.0f / kd;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    q[i] = detail::divide_by(q[i], qd, qr) * scale;
    k[i] = detail::divide_by(k[i], kd, kr);
  }
  return detail::divide_by(detail::divide_by(qk, qd, qr), kd, kr) * scale;
}

// Completes one token on R rows from the partial dots [sk_0.., sq_0..] (each partial over the
// lane's K slice): one transposed reduction; every lane gets u_r = beta*(v_r - sk_r) for all its
// rows; the lane holding sq_r (first of its copies) gets o_r = sq_r + u_r*kq and returns r, the
// others return -1.
template <int G, int R>
__device__ __forceinline__ int finish_rows(float (&dots)[2 * R], const float (&v)[R], float beta,
                                           float kq, int lane, float (&u)[R], float& o) {
  static_assert(2 * R <= G, "a row group must hold all 2R partial dots");
  const int idx = reduced_index<G, 2 * R>(lane);
  const float red = transpose_reduce<G, 2 * R>(dots, lane);
#pragma unroll
  for (int r = 0; r < R; ++r)
    u[r] = detail::delta_u(v[r], __shfl_sync(0xffffffffu, red, holder_lane<G, 2 * R>(r), G), beta);
  const bool first_copy = (lane & (G / (2 * R) - 1)) == 0;
  int mine = -1;
  float u_mine = 0.0f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (idx == R + r) {
      mine = r;
      u_mine = u[r];
    }
  }
  o = detail::delta_output(red, u_mine, kq);
  return first_copy ? mine : -1;
}

// One token's delta-rule step on R state rows held in registers (the register decode kernels):
// decay and the 2R dots, one transposed reduction; the lane holding sk_r computes u_r = beta*(v -
// sk_r) from the v it was given (that row's), broadcasts it for the rank-1 update of row r, and
// `store_row(r)` runs once row r is final. Returns this lane's reduced value; its u in `u_here`.
template <int G, int R, int EPL, class StoreRow>
__device__ __forceinline__ float delta_step_rows(float (&S)[R][EPL], const float (&alpha)[EPL],
                                                 const float (&k)[EPL], const float (&q)[EPL],
                                                 float v, float beta, int lane, float& u_here,
                                                 StoreRow store_row) {
  float dots[2 * R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    detail::decay_and_dots(S[r], alpha, k, q, std::integral_constant<int, EPL>{}, dots[r], dots[R + r]);
  const float red = transpose_reduce<G, 2 * R>(dots, lane);
  u_here = detail::delta_u(v, red, beta);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float u = __shfl_sync(0xffffffffu, u_here, holder_lane<G, 2 * R>(r), G);
    detail::rank1_update(S[r], k, std::integral_constant<int, EPL>{}, u);
    store_row(r);
  }
  return red;
}

// The other finish (register decode kernels): after transpose_reduce<G, 2R>, the lane holding
// sk_r has u_r = beta*(v_r - sk_r) in `u_here`; the lane holding sq_r (first of its copies)
// takes u_r from it and stores o_r = sq_r + u_r*kq at out[o_off + row0 + r*rg] (rows below V).
template <int G, int R>
__device__ __forceinline__ void store_output_rows(const detail::HeadOutput& out, int64_t o_off,
                                                  int V, int row0, int rg, int lane, float red,
                                                  float u_here, float kq) {
  const int sq_r = reduced_index<G, 2 * R>(lane) - R;  // this lane's row, if it holds sq
  const float u_o = __shfl_sync(0xffffffffu, u_here, holder_lane<G, 2 * R>(sq_r < 0 ? 0 : sq_r), G);
  const bool first_copy = (lane & (G / (2 * R) - 1)) == 0;
  if (sq_r >= 0 && first_copy && row0 + sq_r * rg < V)
    detail::store_float(out.ptr, out.dtype, o_off + row0 + sq_r * rg, detail::delta_output(red, u_o, kq));
}

// cp.async: asynchronous 4- or 16-byte global -> shared copies, grouped. (The 16-byte form
// bypasses L1: staged data is read from shared memory only.)
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// A lane's R rows of a state tile (rows row, row + rg, ...; `row_src(r, row + r*rg)` points at
// the lane's EPL elements of its row r), staged through shared memory by the lane alone: stage_rows_async
// copies them with 16-byte cp.async (one group) into the lane's words dst[(r*W + c)*stride] (W
// 16-byte words per row; stride = the lanes sharing the buffer, so consecutive lanes hit
// consecutive words), skipping rows at or past V; load_staged_rows waits for every group of this
// thread and converts them to floats (rows past V read as zeros). kCheckRows = false: the caller
// guarantees every row is below V (no checks). No barrier: each lane reads
// back only what it copied. The register kernels use this to have a second tile in flight while
// they compute the first.
template <class StateT, int EPL, int R, bool kCheckRows = true, class RowSrc>
__device__ __forceinline__ void stage_rows_async(uint4* dst, unsigned stride, int row, int rg, int V,
                                                 RowSrc row_src) {
  constexpr int W = EPL * static_cast<int>(sizeof(StateT)) / 16;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row_r = row + r * rg;
    if (!kCheckRows || row_r < V)
#pragma unroll
      for (int c = 0; c < W; ++c)
        cp_async16(dst + (r * W + c) * stride, reinterpret_cast<const uint4*>(row_src(r, row_r)) + c);
  }
  cp_async_commit();
}
template <class StateT, int EPL, int R, bool kCheckRows = true>
__device__ __forceinline__ void load_staged_rows(const uint4* src, unsigned stride, int row, int rg,
                                                 int V, float (&S)[R][EPL]) {
  constexpr int W = EPL * static_cast<int>(sizeof(StateT)) / 16;
  constexpr int kPer16 = 16 / static_cast<int>(sizeof(StateT));
  cp_async_wait<0>();
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int c = 0; c < W; ++c) {
      const uint4 u = src[(r * W + c) * stride];
      const StateT* e = reinterpret_cast<const StateT*>(&u);
#pragma unroll
      for (int i = 0; i < kPer16; ++i)
        S[r][c * kPer16 + i] = !kCheckRows || row + r * rg < V ? to_float(e[i]) : 0.0f;
    }
  }
}

// Whether every state row of the pool starts on a 16-byte boundary (the vector-load kernels).
template <class StateT>
bool state_rows_aligned(const detail::StatePoolRef& s) {
  return reinterpret_cast<uintptr_t>(s.ptr) % 16 == 0 &&
         (s.slot_stride * static_cast<int64_t>(sizeof(StateT))) % 16 == 0;
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
