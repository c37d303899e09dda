// CUDA kernels of the pooled varlen recurrent op, GDN and KDA; packed decode is its T = 1 case.
//
// Decode is memory-bound: every state element is read once and written once. The work is cut in
// tiles: one warp's RG*R rows of one (sequence, value head). Each thread keeps R row slices of
// EPL elements in registers for the whole sequence and stores them once at the end; dot products
// over K are shuffle reductions inside the G lanes of a row (one transposed reduction for all rows).
//
// One kernel, one tile per warp, state loaded straight into registers, all loads of a tile issued
// before the first use (token inputs before the slot index resolves): the fast instantiations
// (K = 64/128, 16-byte aligned rows, typed inputs) load 16 bytes per row per thread; the generic
// one (any K <= 256, any input dtypes) loads elements. (A persistent variant that prefetched the
// next tiles' state into shared memory with cp.async measured no faster: docs/PERFORMANCE.md.)
// No allocation, no host synchronization: graph-capturable.
#include <string>

#include "api/backend.h"
#include "cuda/common.cuh"

namespace deltastate::cuda_backend {

using detail::RecurrentProblem;

namespace {

// Resident 128-thread CTAs per SM the register allocation must allow (4: at most 128 registers).
#ifndef DS_MIN_BLOCKS
#define DS_MIN_BLOCKS 4
#endif

// Where tile `w` lives: sequence n, value head hv (head = n*HV + hv), and this thread's first row.
struct TileCoords {
  int64_t n, head;
  int hv, h, row0;
};

// (32-bit division: tile and head counts are below 2^31, checked at launch; 64-bit division is
// a long software sequence on the GPU.)
__device__ __forceinline__ TileCoords tile_coords(const RecurrentProblem& p, int64_t w,
                                                  int warps_per_head, int rows_per_warp, int lane,
                                                  int G) {
  TileCoords c;
  const int head = static_cast<int>(w) / warps_per_head;
  const int wb = static_cast<int>(w) - head * warps_per_head;
  const int n = head / p.HV;
  c.head = head;
  c.n = n;
  c.hv = head - n * p.HV;
  c.h = c.hv / (p.HV / p.H);
  c.row0 = wb * rows_per_warp + lane / G;
  return c;
}

__device__ __forceinline__ int64_t slot_of(const RecurrentProblem& p, int64_t n) {
  return p.indices ? detail::load_index(p.indices, p.index_dtype, n) : n;
}

// Output rows (and final state) of a padded sequence: zeros; its state is never touched.
template <int EPL, int R, int RG, int G>
__device__ void write_padded(const RecurrentProblem& p, const TileCoords& c, int64_t seq,
                             int64_t tok0, int64_t len, int lane, int kofs, int valid) {
  if (lane % G == 0) {
    for (int64_t t = 0; t < len; ++t) {
      const int64_t o = head_offset(p.out, seq, tok0 + t, c.hv);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int row = c.row0 + r * RG;
        if (row < p.V) detail::store_float(p.out.ptr, p.out.dtype, o + row, 0.0f);
      }
    }
  }
  if (p.final_state) {
    const int64_t head_elems = static_cast<int64_t>(p.V) * p.K;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = c.row0 + r * RG;
      if (row < p.V)
#pragma unroll
        for (int i = 0; i < EPL; ++i)
          if (i < valid)
            detail::store_float(p.final_state, p.final_dtype,
                                c.head * head_elems + static_cast<int64_t>(row) * p.K + kofs + i,
                                0.0f);
    }
  }
}

// All tokens of a tile on the state rows S (registers); `x` holds token 0's inputs on entry.
template <class In, int G, int EPL, int R, int RG>
__device__ __forceinline__ void run_tokens(const RecurrentProblem& p, const TileCoords& c,
                                           int64_t seq, int64_t tok0, int64_t len, int lane,
                                           int kofs, int valid, float (&S)[R][EPL],
                                           TokenInputs<EPL, R>& x, const GateConsts<EPL>& gc) {
  for (int64_t t = 0; t < len; ++t) {
    const float kq = prepare_qk<EPL, G>(x.q, x.k, p.l2norm, p.scale, lane);
    float g[EPL], alpha[EPL];
    token_gate(p.gate, gc, x.g, g, alpha);
    const float beta = detail::beta_value(x.b, p.beta_is_logit, p.round_beta, p.beta.dtype);
    float dots[2 * R];
#pragma unroll
    for (int r = 0; r < R; ++r)
      detail::decay_and_dots(S[r], alpha, x.k, x.q, std::integral_constant<int, EPL>{}, dots[r],
                             dots[R + r]);
    float u[R], o;
    const int mine = finish_rows<G, R>(dots, x.v, beta, kq, lane, u, o);
#pragma unroll
    for (int r = 0; r < R; ++r)
      detail::rank1_update(S[r], x.k, std::integral_constant<int, EPL>{}, u[r]);
    const int64_t tok = tok0 + t;
    const int orow = c.row0 + mine * RG;
    if (mine >= 0 && orow < p.V)
      detail::store_float(p.out.ptr, p.out.dtype, head_offset(p.out, seq, tok, c.hv) + orow, o);
    if (t + 1 < len)
      load_token<In>(p, p.g, p.beta, seq, tok + 1, c.h, c.hv, kofs, valid, c.row0, RG, x);
  }
}

template <class StateT, int EPL, int R, int RG, bool VEC>
__device__ __forceinline__ void write_state(const RecurrentProblem& p, const TileCoords& c,
                                            StateT* state_head, int64_t len, int kofs, int valid,
                                            const float (&S)[R][EPL]) {
  if (state_head && p.update_state && len > 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = c.row0 + r * RG;
      if (row < p.V)
        store_state<StateT, EPL, VEC>(state_head + static_cast<int64_t>(row) * p.K + kofs, valid, S[r]);
    }
  }
  if (p.final_state) {
    const int64_t head_elems = static_cast<int64_t>(p.V) * p.K;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = c.row0 + r * RG;
      if (row < p.V)
#pragma unroll
        for (int i = 0; i < EPL; ++i)
          if (i < valid)
            detail::store_float(p.final_state, p.final_dtype,
                                c.head * head_elems + static_cast<int64_t>(row) * p.K + kofs + i,
                                S[r][i]);
    }
  }
}

// ---- direct kernel: one tile per warp, state loaded straight into registers ----------------------

template <class StateT, int KT, bool VEC, class In>
__global__ void __launch_bounds__(128, DS_MIN_BLOCKS) recurrent_direct_kernel(
    const RecurrentProblem p, int warps_per_head) {
  using Lay = RowLayout<StateT, KT>;
  constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, R = Lay::ROWS;
  const int lane = threadIdx.x & 31;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (w >= p.num_heads_total() * warps_per_head) return;
  const TileCoords c = tile_coords(p, w, warps_per_head, RG * R, lane, G);
  const int kofs = (lane % G) * EPL;
  const int valid = VEC ? EPL : max(0, min(EPL, p.K - kofs));
  const int64_t seq = p.cu_seqlens ? 0 : c.n;
  const int64_t tok0 = p.cu_seqlens ? detail::load_index(p.cu_seqlens, p.cu_dtype, c.n) : 0;
  const int64_t len =
      p.cu_seqlens ? detail::load_index(p.cu_seqlens, p.cu_dtype, c.n + 1) - tok0 : p.T;
  const int64_t slot = slot_of(p, c.n);

  TokenInputs<EPL, R> x;  // token 0's inputs do not depend on the slot: issue them first
  if (len > 0) load_token<In>(p, p.g, p.beta, seq, tok0, c.h, c.hv, kofs, valid, c.row0, RG, x);
  GateConsts<EPL> gc;
  load_gate_consts(p.gate, c.hv, p.K, kofs, valid, gc);
  if (p.indices && slot < 0) {
    write_padded<EPL, R, RG, G>(p, c, seq, tok0, len, lane, kofs, valid);
    return;
  }
  if (p.check_indices && slot >= p.state.num_slots)
    trap_bad_slot("recurrent", c.n, slot, p.state.num_slots);

  const int64_t head_elems = static_cast<int64_t>(p.V) * p.K;
  StateT* state_head = p.state.ptr ? static_cast<StateT*>(p.state.ptr) + slot * p.state.slot_stride +
                                         c.hv * head_elems
                                   : nullptr;
  float S[R][EPL];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = c.row0 + r * RG;
    if (state_head && row < p.V) {
      load_state<StateT, EPL, VEC>(state_head + static_cast<int64_t>(row) * p.K + kofs, valid, S[r]);
    } else {
#pragma unroll
      for (int i = 0; i < EPL; ++i) S[r][i] = 0.0f;
    }
  }
  run_tokens<In, G, EPL, R, RG>(p, c, seq, tok0, len, lane, kofs, valid, S, x, gc);
  write_state<StateT, EPL, R, RG, VEC>(p, c, state_head, len, kofs, valid, S);
}

template <class StateT, int KT>
int warps_per_head_of(const RecurrentProblem& p) {
  using Lay = RowLayout<StateT, KT>;
  const int rows_per_warp = Lay::RG * Lay::ROWS;
  return (p.V + rows_per_warp - 1) / rows_per_warp;
}

template <class StateT, int KT, bool VEC, class In>
void launch_direct(const RecurrentProblem& p, cudaStream_t stream) {
  const int wph = warps_per_head_of<StateT, KT>(p);
  const int64_t tiles = p.num_heads_total() * wph;
  // Small batches: one warp per CTA spreads the tiles over more SMs; otherwise 4.
  const int warps = tiles < 8LL * num_sms(p.device.index) ? 1 : 4;
  const int64_t ctas = (tiles + warps - 1) / warps;
  if (tiles > 0x7fffffffLL) throw Error(ErrorKind::value, "recurrent: too many tiles for one launch");
  recurrent_direct_kernel<StateT, KT, VEC, In><<<static_cast<unsigned>(ctas), warps * 32, 0, stream>>>(p, wph);
  DS_CUDA_CHECK(cudaGetLastError());
}

#if DELTASTATE_CUDA_ALL_KERNELS
// Inputs of one dtype (q, k, v, gate input, beta all ActT): the typed fast path.
bool inputs_are(const RecurrentProblem& p, DType t) {
  return p.q.dtype == t && p.k.dtype == t && p.v.dtype == t && p.g.dtype == t && p.beta.dtype == t;
}

template <class StateT, class In>
bool launch_fast(const RecurrentProblem& p, cudaStream_t stream) {
  if (!state_rows_aligned<StateT>(p.state)) return false;
  if (p.K == 128) return launch_direct<StateT, 128, true, In>(p, stream), true;
  if (p.K == 64) return launch_direct<StateT, 64, true, In>(p, stream), true;
  return false;
}
#endif

// Kernel choice: a fast instantiation when the inputs share one dtype (bf16 or fp32), K is 64
// or 128 and the pool rows are 16-byte aligned; otherwise the generic kernel (any K <= 256, any
// input dtypes). CI builds (DELTASTATE_CUDA_ALL_KERNELS=OFF) compile only the generic one.
template <class StateT>
void dispatch(const RecurrentProblem& p, cudaStream_t stream) {
  require_supported_k(p.K);
#if DELTASTATE_CUDA_ALL_KERNELS
  if (inputs_are(p, DType::bf16) && launch_fast<StateT, TypedInput<__nv_bfloat16>>(p, stream)) return;
  if (inputs_are(p, DType::f32) && launch_fast<StateT, TypedInput<float>>(p, stream)) return;
#endif
  launch_direct<StateT, 256, false, AnyInput>(p, stream);
}

}  // namespace

void run_recurrent(const RecurrentProblem& p, void* stream) {
  DeviceGuard guard(p.device.index);
  auto s = static_cast<cudaStream_t>(stream);
  // Without a state pool the kernel starts from zeros; the state dtype then only selects the
  // register layout, so use fp32.
  const DType sd = p.state.ptr ? p.state.dtype : DType::f32;
  switch (sd) {
    case DType::bf16: return dispatch<__nv_bfloat16>(p, s);
    case DType::f16: return dispatch<__half>(p, s);
    default: return dispatch<float>(p, s);
  }
}

}  // namespace deltastate::cuda_backend
