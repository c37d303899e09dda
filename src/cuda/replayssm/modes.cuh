// The CUDA kernel of ReplaySSM decode with SGLang's ring modes (circular replay with cache_base
// and history checkpoints, prefix gates, pre-decayed keys; docs/REPLAYSSM.md "Ring modes"), GDN
// and KDA, and of the pool's materialization of pending records (StatePool::fork). A plain,
// generic kernel (any K <= the shared memory, any dtypes, plain loads): the basic ring keeps its
// tuned kernel (decode.cuh); this one computes what the CPU kernel (src/cpu/replayssm_decode.cpp)
// computes, step for step, to fp32 rounding. Part of replayssm_decode.cu's translation unit.
//
// One CTA of kModeThreads threads per (row n, value head hv). Shared memory (floats): the token
// (q, k normalized, q scaled; alpha; its log decay g) [4K], Gtot and e = exp(Gtot) [2K], the ring
// records' kw_j [m][K] and w_j, ck_j, cq_j [L each], a reduction scratch [32]. Each thread then
// owns state rows v = tid, tid + blockDim, ...: an appending step reads its checkpoint row once
// (the factored dots); a fold or a history checkpoint rebuilds the row element by element,
// S_i = e_i*S0_i + sum_j d_j w_j kw_ji, twice for a fold (the dots, then the update), once for a
// history checkpoint (stored as it is formed).
#pragma once

#include <cstdint>

#include "core/delta_math.h"
#include "core/numeric.h"
#include "core/problem.h"
#include "cuda/grid.cuh"
#include "cuda/replayssm/ring.cuh"
#include "cuda/state_format.cuh"

namespace deltastate::cuda_backend {

namespace {

constexpr int kModeThreads = 128;

// Shared-memory floats of the modes kernel for K and L (the launcher checks them against the
// device's per-block maximum).
__host__ __device__ inline int64_t mode_smem_floats(int K, int L) {
  return 6 * int64_t{K} + int64_t{L} * K + 3 * int64_t{L} + 32;
}

// Sum of x over the CTA (every thread gets it); `red` holds 32 floats.
__device__ __forceinline__ float cta_sum(float x, float* red) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  __syncthreads();  // red free from a previous sum
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float t = 0.0f;
  for (int w = 0; w < nwarps; ++w) t += red[w];
  return t;
}

// The ring of (slot, hv) with m records from `base` into shared memory: gtot, e, kw, w (the CPU
// kernel's prepare_ring). Every thread takes K columns; thread 0 the GDN scalars.
__device__ __forceinline__ void mode_prepare_ring(const detail::ReplayProblem& p, int64_t slot,
                                                  int hv, int m, int base, float* s_gtot,
                                                  float* s_e, float* s_kw, float* s_w) {
  const int K = p.K, L = p.L, HV = p.HV, H = p.H;
  const int h = hv / (HV / H);
  const bool kda = p.gate.kda, prefix = p.modes.prefix_gates, predecay = p.modes.predecayed_k;
  const int gw = kda ? K : 1;
  const float* g_ring = p.g_cache + (slot * HV + hv) * int64_t{L} * gw;
  const int64_t k_ring = (slot * H + h) * int64_t{L} * K;
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    const int c = kda ? i : 0;
    float gt = 0.0f;
    if (prefix) {
      if (m > 0) gt = g_ring[int64_t{detail::replay_position(base, m - 1, L)} * gw + c];
    } else {
      for (int j = 0; j < m; ++j)
        gt += g_ring[int64_t{detail::replay_position(base, j, L)} * gw + c];
    }
    s_gtot[i] = gt;
    const float e = expf(gt);
    s_e[i] = e;
    float gj = 0.0f;
    for (int j = 0; j < m; ++j) {
      const int64_t at = detail::replay_position(base, j, L);
      if (prefix) gj = g_ring[at * gw + c];
      else gj += g_ring[at * gw + c];
      float kv = detail::load_float(p.k_cache, p.k_dtype, k_ring + at * K + i);
      if (predecay) kv *= e;
      else if (kda) kv *= expf(gt - gj);
      s_kw[int64_t{j} * K + i] = kv;
      if (!kda && i == 0) s_w[j] = expf(gt - gj);
    }
  }
  if (kda)
    for (int j = threadIdx.x; j < m; j += blockDim.x) s_w[j] = 1.0f;
  __syncthreads();
}

// One rebuilt element S_i of state row v (the CPU kernel's rebuild_rows: e*S0, then each record's
// multiply-add in order).
__device__ __forceinline__ float mode_rebuilt(float s0, int i, int v, int m, int K,
                                              const float* s_e, const float* s_kw, const float* s_w,
                                              const void* d_cache, DType d_dtype, int64_t d_ring,
                                              int base, int L, int V) {
  float s = s0 * s_e[i];
  for (int j = 0; j < m; ++j) {
    const int64_t at = detail::replay_position(base, j, L);
    const float dj = detail::load_float(d_cache, d_dtype, d_ring + at * V + v);
    s = fmaf(dj * s_w[j], s_kw[int64_t{j} * K + i], s);
  }
  return s;
}

// Row v of a head in its storage format (fh: the head's rows, scales and key), element i formed by
// value(i): once for the row's amax (quantized), then each element stored with the row's fresh
// scale; the scale written last, since each element reads only its own code before its store and
// value(i) may read the old row.
template <class Value>
__device__ __forceinline__ void store_formatted_row(const detail::StatePoolRef& state,
                                                    fmt::HeadRows& fh, int v, int K,
                                                    Value&& value) {
  float scale = 0.0f;
  if (fh.scales) {
    float amax = 0.0f;
    for (int i = 0; i < K; ++i) amax = detail::amax_step(amax, value(i));
    scale = fmt::fresh_scale(state.dtype, amax);
  }
  for (int i = 0; i < K; ++i)
    fmt::store_elem(state.ptr, state.dtype, fh, int64_t{v} * K + i, value(i), scale);
  if (fh.scales) fh.scales[v] = scale;
}

// FMT: a checkpoint in its storage format (quantized, or rounded stochastically;
// docs/STATE_FORMATS.md) through cuda/state_format.cuh's element rules: its elements loaded
// dequantized; a row stored (a fold, a history checkpoint) formed once more per pass, for its
// amax (quantized), then each element with the row's fresh scale and the slot's key, the scale
// written last (the row's loads read the old one until then). The step counter advances after the
// grid.
template <bool FMT>
__global__ void __launch_bounds__(kModeThreads) replay_modes_kernel(const detail::ReplayProblem p) {
  enter_grid(p.pdl_trigger_early);
  extern __shared__ __align__(16) unsigned char mode_smem_bytes[];
  float* smem = reinterpret_cast<float*>(mode_smem_bytes);
  const int K = p.K, V = p.V, HV = p.HV, H = p.H, L = p.L;
  float* s_q = smem;
  float* s_k = s_q + K;
  float* s_alpha = s_k + K;
  float* s_g = s_alpha + K;
  float* s_gtot = s_g + K;
  float* s_e = s_gtot + K;
  float* s_kw = s_e + K;
  float* s_w = s_kw + int64_t{L} * K;
  float* s_ck = s_w + L;
  float* s_cq = s_ck + L;
  float* s_red = s_cq + L;

  const int n = blockIdx.x, hv = blockIdx.y;
  const int group = HV / H, h = hv / group;
  const int64_t slot = p.indices[n * p.index_stride];
  const int64_t out_off = detail::head_offset(p.out, n, 0, hv);
  if (slot < 0) {  // padded: zero output, nothing else read or written
    for (int v = threadIdx.x; v < V; v += blockDim.x)
      detail::store_float(p.out.ptr, p.out.dtype, out_off + v, 0.0f);
    return;
  }
  const int cursor = p.write_pos[n];
  const int m = replay_cursor(cursor, p.advance_write_pos);
  const bool circular = p.modes.circular;
  const int base = circular ? p.modes.cache_base[n] : 0;
  const bool bad_slot = slot >= p.state.num_slots, bad_m = cursor < 0 || m >= L,
             bad_base = circular && (base < 0 || base >= L);
  if (bad_slot || bad_m || bad_base) {
    if (threadIdx.x == 0 && hv == 0)
      record_bad_row(p.errors, p.err_op,
                     bad_slot ? detail::kErrSlot
                     : bad_m  ? detail::kErrCursor
                              : detail::kErrCacheBase,
                     n,
                     bad_slot ? slot
                     : bad_m  ? m
                              : base,
                     bad_slot ? p.state.num_slots : L);
    for (int v = threadIdx.x; v < V; v += blockDim.x)
      detail::store_float(p.out.ptr, p.out.dtype, out_off + v, bad_row_output());
    return;
  }
  const bool forced = p.force_flush && p.force_flush[n] != 0;
  const bool full = detail::replay_full_flush(m, L, forced, circular);
  const bool history = detail::replay_history_flush(m, L, forced, circular);
  const bool predecay = p.modes.predecayed_k, prefix = p.modes.prefix_gates, kda = p.gate.kda;

  // 1. The token: q, k normalized (q scaled), the gate, beta.
  const int64_t q_off = detail::head_offset(p.q, n, 0, h),
                k_off = detail::head_offset(p.k, n, 0, h);
  float qq = 0.0f, kk = 0.0f;
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    const float qv = detail::load_float(p.q.ptr, p.q.dtype, q_off + i);
    const float kv = detail::load_float(p.k.ptr, p.k.dtype, k_off + i);
    s_q[i] = qv;
    s_k[i] = kv;
    qq += qv * qv;
    kk += kv * kv;
  }
  qq = cta_sum(qq, s_red);
  kk = cta_sum(kk, s_red);
  const float qden = p.l2norm ? detail::l2norm_denominator(qq) : 1.0f;
  const float kden = p.l2norm ? detail::l2norm_denominator(kk) : 1.0f;
  const float A_log =
      p.gate.A_log ? detail::load_float(p.gate.A_log, p.gate.A_log_dtype, hv) : 0.0f;
  const int64_t a_off = detail::head_offset(p.a, n, 0, hv);
  float kq = 0.0f;
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    const float qv = s_q[i] / qden * p.scale, kv = s_k[i] / kden;
    s_q[i] = qv;
    s_k[i] = kv;
    kq += kv * qv;
    const int c = kda ? i : 0;
    const float x = detail::load_float(p.a.ptr, p.a.dtype, a_off + c);
    const float dt = p.gate.dt_bias ? detail::load_float(p.gate.dt_bias, p.gate.dt_bias_dtype,
                                                         kda ? int64_t{hv} * K + i : hv)
                                    : 0.0f;
    const float g = detail::gate_value(p.gate.mode, x, dt, A_log, p.gate.lower_bound);
    s_g[i] = g;
    s_alpha[i] = expf(g);
  }
  kq = cta_sum(kq, s_red);  // also the barrier after the token's shared stores
  // Every thread has read the cursor and the base: the device advance, one count per CTA of the
  // row (the high 16 bits of write_pos), the last CTA storing the caller's rule (replay_advance):
  // the new cursor and, with circular rings, the new base.
  if (p.advance_write_pos && threadIdx.x == 0) {
    const int old = atomicAdd(p.write_pos + n, 1 << 16);
    if ((old >> 16) == HV - 1) {
      int new_wp = 0, new_base = base;
      detail::replay_advance(m, L, forced, circular, new_wp, new_base);
      if (circular) p.modes.cache_base[n] = new_base;
      p.write_pos[n] = new_wp;
    }
  }
  const float beta =
      detail::beta_value(detail::load_float(p.b.ptr, p.b.dtype, detail::head_offset(p.b, n, 0, hv)),
                         true, p.round_beta && !predecay, p.b.dtype);

  // 2. The ring.
  mode_prepare_ring(p, slot, hv, m, base, s_gtot, s_e, s_kw, s_w);
  const int records = history ? 0 : m;  // an appending step's records (none after a history)
  if (!full) {                          // the coefficients ck_j, cq_j, one warp per record
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
    for (int j = warp; j < records; j += nwarps) {
      float ck = 0.0f, cq = 0.0f;
      for (int i = lane; i < K; i += 32) {
        const float kw = s_kw[int64_t{j} * K + i];
        ck += kw * (s_alpha[i] * s_k[i]);
        cq += kw * (s_alpha[i] * s_q[i]);
      }
      for (int o = 16; o > 0; o >>= 1) {
        ck += __shfl_xor_sync(0xffffffffu, ck, o);
        cq += __shfl_xor_sync(0xffffffffu, cq, o);
      }
      if (lane == 0) {
        s_ck[j] = s_w[j] * ck;
        s_cq[j] = s_w[j] * cq;
      }
    }
    __syncthreads();
  }

  // 3. The rows.
  const int64_t row0 = slot * p.state.slot_stride + int64_t{hv} * V * K;
  const int64_t d_ring = (slot * HV + hv) * int64_t{L} * V;
  const int64_t pos = detail::replay_position(base, m, L);  // an appended record's position
  fmt::HeadRows fh;                                         // FMT: the head's rows, scales and key
  if constexpr (FMT) fh = fmt::head_rows(p.state, slot, hv, V, K);
  auto load_s0 = [&](int v, int i) {  // checkpoint element (v, i)
    if constexpr (FMT) return fmt::load_elem(p.state.ptr, p.state.dtype, fh, v, int64_t{v} * K + i);
    else return detail::load_float(p.state.ptr, p.state.dtype, row0 + int64_t{v} * K + i);
  };
  // FMT: row v stored, element i formed by value(i)
  auto store_row_fmt = [&](int v, auto&& value) { store_formatted_row(p.state, fh, v, K, value); };
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    const int64_t row = row0 + int64_t{v} * K;
    const float vv = detail::load_float(p.v.ptr, p.v.dtype, detail::head_offset(p.v, n, 0, hv) + v);
    auto rebuilt = [&](int i) {
      return mode_rebuilt(load_s0(v, i), i, v, m, K, s_e, s_kw, s_w, p.d_cache, p.d_dtype, d_ring,
                          base, L, V);
    };
    float sk = 0.0f, sq = 0.0f;
    if (full || history) {
      for (int i = 0; i < K; ++i) {
        float s = rebuilt(i);
        if (!FMT && history) detail::store_float(p.state.ptr, p.state.dtype, row + i, s);
        if (full) {
          s *= s_alpha[i];
          sk += s * s_k[i];
          sq += s * s_q[i];
        } else {
          sk += s * (s_alpha[i] * s_k[i]);
          sq += s * (s_alpha[i] * s_q[i]);
        }
      }
      if constexpr (FMT) {
        if (history) store_row_fmt(v, rebuilt);
      }
    } else {
      for (int i = 0; i < K; ++i) {
        const float s0 = load_s0(v, i);
        sk += s0 * (s_e[i] * (s_alpha[i] * s_k[i]));
        sq += s0 * (s_e[i] * (s_alpha[i] * s_q[i]));
      }
      for (int j = 0; j < records; ++j) {
        const int64_t at = detail::replay_position(base, j, L);
        const float dj = detail::load_float(p.d_cache, p.d_dtype, d_ring + at * V + v);
        sk += dj * s_ck[j];
        sq += dj * s_cq[j];
      }
    }
    const float u = detail::delta_u(vv, sk, beta);
    detail::store_float(p.out.ptr, p.out.dtype, detail::head_offset(p.out, n, 0, hv) + v,
                        detail::delta_output(sq, u, kq));
    if (full) {  // S0 <- alpha*S + u*k (the rebuild formed again, the same values)
      auto folded = [&](int i) {
        float s = rebuilt(i);
        s = s * s_alpha[i];
        s += u * s_k[i];
        return s;
      };
      if constexpr (FMT) {
        store_row_fmt(v, folded);
      } else {
        for (int i = 0; i < K; ++i)
          detail::store_float(p.state.ptr, p.state.dtype, row + i, folded(i));
      }
    } else {
      detail::store_float(p.d_cache, p.d_dtype, d_ring + pos * V + v, u);
    }
  }
  // The record's g (every head) and k (the first value head of its key head).
  if (!full) {
    const int gw = kda ? K : 1;
    float* g_out = p.g_cache + ((slot * HV + hv) * int64_t{L} + pos) * gw;
    for (int i = threadIdx.x; i < gw; i += blockDim.x)
      g_out[i] = prefix && !history ? s_gtot[i] + s_g[i] : s_g[i];
    if (hv % group == 0) {
      const int64_t k_at = ((slot * H + h) * int64_t{L} + pos) * K;
      for (int i = threadIdx.x; i < K; i += blockDim.x) {
        const float decay = history ? s_alpha[i] : s_e[i] * s_alpha[i];
        detail::store_float(p.k_cache, p.k_dtype, k_at + i, predecay ? s_k[i] / decay : s_k[i]);
      }
    }
  }
}

// StatePool::fork on a CUDA pool: dst's checkpoint (a copy of src's) becomes the state after src's
// m records from `base`; one CTA per value head. FMT: a checkpoint in its storage format, loaded
// dequantized and each row stored as the modes kernel stores a history checkpoint (formed once
// for its amax, once more for the store, the fresh scale written last), rounded with src's key at
// the counter's step (the CPU's rule: the fork equals src's flush copied to dst; the counter is
// not advanced).
template <bool FMT>
__global__ void __launch_bounds__(kModeThreads)
    replay_materialize_kernel(const detail::ReplayProblem p, int64_t src, int64_t dst, int m,
                              int base) {
  enter_grid(false);
  extern __shared__ __align__(16) unsigned char mode_smem_bytes[];
  float* smem = reinterpret_cast<float*>(mode_smem_bytes);
  const int K = p.K, V = p.V, HV = p.HV, L = p.L;
  float* s_gtot = smem;  // gtot, e [K each], kw [m][K], w [m]
  float* s_e = s_gtot + K;
  float* s_kw = s_e + K;
  float* s_w = s_kw + int64_t{m} * K;  // the launcher sizes the memory for m records
  const int hv = blockIdx.x;
  mode_prepare_ring(p, src, hv, m, base, s_gtot, s_e, s_kw, s_w);
  const int64_t row0 = dst * p.state.slot_stride + int64_t{hv} * V * K;
  const int64_t d_ring = (src * HV + hv) * int64_t{L} * V;
  fmt::HeadRows fh;  // FMT: dst's rows and scales, src's key
  if constexpr (FMT) {
    fh = fmt::head_rows(p.state, dst, hv, V, K);
    if (fh.stochastic)
      fh.key = detail::sr_key(p.state.seed, static_cast<uint64_t>(src), p.state.layer,
                              static_cast<uint64_t>(*p.state.step));
  }
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    const int64_t row = row0 + int64_t{v} * K;
    auto rebuilt = [&](int i) {
      const float s0 = FMT ? fmt::load_elem(p.state.ptr, p.state.dtype, fh, v, int64_t{v} * K + i)
                           : detail::load_float(p.state.ptr, p.state.dtype, row + i);
      return mode_rebuilt(s0, i, v, m, K, s_e, s_kw, s_w, p.d_cache, p.d_dtype, d_ring, base, L, V);
    };
    if constexpr (FMT) {
      store_formatted_row(p.state, fh, v, K, rebuilt);
    } else {
      for (int i = 0; i < K; ++i)
        detail::store_float(p.state.ptr, p.state.dtype, row + i, rebuilt(i));
    }
  }
}

}  // namespace
}  // namespace deltastate::cuda_backend
