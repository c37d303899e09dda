// CUDA kernel of ReplaySSM buffered decode (spec §5, basic mode), GDN and KDA.
//
// A CTA owns a block of rows of one (row n, value head). With the checkpoint S0 and the m live
// ring records (d_j, k_j, g_j), the state before this token is S = e*S0 + sum_j d_j kw_j^T with
// e = exp(Gtot) and kw_j = W_j*k_j, W_j = exp(Gtot - G_j) (G_j: prefix sums of g). The output
// needs only two dot products per row with that S, so the kernel never builds S on a non-flush
// step (docs/REPLAYSSM.md):
//   sk = S.(alpha*k) = S0.(e*alpha*k) + sum_j d_j ck_j,   ck_j = kw_j.(alpha*k)
//   sq = S.(alpha*q) = S0.(e*alpha*q) + sum_j d_j cq_j,   cq_j = kw_j.(alpha*q)
// ck/cq are m dot products of length K per head, computed once per CTA; each row then costs 2m
// FMAs for the ring instead of m*K. Only a flush rebuilds S (e*S0 + sum_j d_j kw_j, fp32 FMAs)
// and folds the token in: S0 <- alpha*S + d*k. Non-flush steps read the checkpoint and write only
// the ring record.
//
// The ring records are staged into shared memory with cp.async (one round trip for all of them),
// issued right after the checkpoint loads.
//
// Cursor advance (advance_write_pos): every CTA of row n takes its cursor with one
// atomicAdd(write_pos[n], 1 << 16); the low 16 bits stay the cursor and the high bits count the
// CTAs that have read it. The CTA that sees itself last (count = CTAs per row - 1) stores the new
// cursor, so every CTA reads the old one and no extra launch or scratch buffer is needed.
#include "api/backend.h"
#include "cuda/common.cuh"

namespace deltastate::cuda_backend {

using detail::ReplayProblem;

namespace {

// Shared memory, in floats: raw ring bytes as staged (g, k, d), then the derived
// kw [L][KT], decay e [KT], W [L] (GDN), the token's alpha*k and alpha*q [KT], ck/cq [L].
struct SmemLayout {
  int g_raw, k_raw, d_raw, kw, e, w, ak, aq, ck, cq, bytes;
  __host__ __device__ SmemLayout(int L, int KT, int gw, int k_bytes, int d_bytes, int rows_cta) {
    g_raw = 0;
    k_raw = g_raw + L * gw;
    k_raw = (k_raw + 3) & ~3;  // 16-byte aligned sections
    d_raw = k_raw + (L * KT * k_bytes + 15) / 16 * 4;
    kw = d_raw + (L * rows_cta * d_bytes + 15) / 16 * 4;
    e = kw + L * KT;
    w = e + KT;
    ak = w + ((L + 3) & ~3);
    aq = ak + KT;
    ck = aq + KT;
    cq = ck + L;
    bytes = (cq + L) * 4;
  }
  // The layout a kernel instantiation uses (kernel and launcher must agree): the vector path
  // stages d raw in its dtype, the generic path as floats.
  __host__ __device__ static SmemLayout of(const ReplayProblem& p, int KT, bool vec, int rows_cta) {
    return SmemLayout(p.L, KT, p.gate.kda ? p.K : 1, static_cast<int>(dtype_size(p.k_dtype)),
                      vec ? static_cast<int>(dtype_size(p.d_dtype)) : 4, rows_cta);
  }
};

// Copies `bytes` (a multiple of 4) from global to shared memory with 4-byte cp.async spread over
// the CTA's threads.
__device__ __forceinline__ void stage_words(void* smem, const void* gmem, int bytes) {
  const int words = bytes >> 2;
  auto* s = static_cast<uint32_t*>(smem);
  auto* g = static_cast<const uint32_t*>(gmem);
  for (int i = threadIdx.x; i < words; i += blockDim.x) cp_async4(s + i, g + i);
}

template <class StateT, int KT, bool VEC, class In>
__global__ void __launch_bounds__(128, 4) replay_kernel(const ReplayProblem p) {
  using Lay = RowLayout<StateT, KT>;
  constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, R = Lay::ROWS;
  extern __shared__ float smem[];
  __shared__ int cursor_sh;

  const int n = static_cast<int>(blockIdx.x) / p.HV;  // 32-bit: B*HV < 2^31 (the grid's x)
  const int hv = static_cast<int>(blockIdx.x) - n * p.HV;
  const int group = p.HV / p.H;
  const int h = hv / group;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  const int kofs = (lane % G) * EPL;
  const int valid = VEC ? EPL : max(0, min(EPL, p.K - kofs));
  const int rows_cta = nwarps * RG * R;
  const int row_base = blockIdx.y * rows_cta;
  const int local0 = warp * RG * R + lane / G;  // local row of pass 0
  const int row0 = row_base + local0;
  const int L = p.L, K = p.K, V = p.V;
  const int gw = p.gate.kda ? K : 1;
  const int k_bytes = static_cast<int>(dtype_size(p.k_dtype));
  const int d_bytes = static_cast<int>(dtype_size(p.d_dtype));
  const DType d_staged = VEC ? p.d_dtype : DType::f32;
  const SmemLayout sm = SmemLayout::of(p, KT, VEC, rows_cta);

  // This token's inputs and the head's gate constants do not depend on the slot: issue first.
  TokenInputs<EPL, R> x;
  load_token<In>(p, p.a, p.b, n, 0, h, hv, kofs, valid, row0, RG, x);
  GateConsts<EPL> gc;
  load_gate_consts(p.gate, hv, K, kofs, valid, gc);

  const int64_t slot = p.indices[n];
  if (slot < 0) {  // padded: zero output, no state, ring or cursor access
    if (lane % G == 0) zero_output_rows<R>(p.out, V, head_offset(p.out, n, 0, hv), row0, RG);
    return;
  }
  if (p.check_indices && slot >= p.state.num_slots)
    trap_bad_slot("replayssm_decode", n, slot, p.state.num_slots);
  const bool forced = p.force_flush && p.force_flush[n] != 0;

  // 1. The checkpoint rows: every load in flight at once.
  const int64_t head_elems = static_cast<int64_t>(V) * K;
  StateT* s0 = static_cast<StateT*>(p.state.ptr) + slot * p.state.slot_stride + hv * head_elems;
  float S[R][EPL];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = row0 + r * RG;
    if (row < V) {
      load_state<StateT, EPL, VEC>(s0 + static_cast<int64_t>(row) * K + kofs, valid, S[r]);
    } else {
#pragma unroll
      for (int i = 0; i < EPL; ++i) S[r][i] = 0.0f;
    }
  }

  // The cursor m (and, with advance_write_pos, its advance by the last CTA of the row).
  if (threadIdx.x == 0) {
    int m;
    if (p.advance_write_pos) {
      const int old = atomicAdd(p.write_pos + n, 1 << 16);
      m = min(max(old & 0xffff, 0), L - 1);
      if ((old >> 16) == p.HV * static_cast<int>(gridDim.y) - 1)
        p.write_pos[n] = detail::replay_flushes(m, L, forced) ? 0 : m + 1;
    } else {
      m = p.write_pos[n];
      if (p.check_indices && (m < 0 || m >= L)) {
        printf("deltastate replayssm_decode: write_pos[%lld]=%d is outside the ring [0, %d]\n",
               static_cast<long long>(n), m, L - 1);
        __trap();
      }
      m = min(max(m, 0), L - 1);
    }
    cursor_sh = m;
  }

  // 2. The token: q, k normalized (q scaled), gate, beta; alpha*k and alpha*q to shared memory.
  const float kq = prepare_qk<EPL, G>(x.q, x.k, p.l2norm, p.scale, lane);
  float g[EPL], alpha[EPL];
  token_gate(p.gate, gc, x.g, g, alpha);
  const float beta = detail::beta_value(x.b, true, true, p.b.dtype);
  if (warp == 0 && lane < G) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      if (i < valid) {
        smem[sm.ak + kofs + i] = alpha[i] * x.k[i];
        smem[sm.aq + kofs + i] = alpha[i] * x.q[i];
      }
    }
  }
  __syncthreads();  // cursor_sh, ak, aq
  const int m = cursor_sh;
  const bool flush = detail::replay_flushes(m, L, forced);

  // 3. Stage the m ring records (raw) with one round trip of cp.async, then derive kw, e, W.
  float* g_ring = p.g_cache + (slot * p.HV + hv) * static_cast<int64_t>(L) * gw;
  const int64_t k_ring = (slot * p.H + h) * static_cast<int64_t>(L) * K;
  const int64_t d_ring = (slot * p.HV + hv) * static_cast<int64_t>(L) * V;
  const int rows_here = min(rows_cta, V - row_base);
  if (m > 0) {
    if constexpr (VEC) {
      stage_words(smem + sm.g_raw, g_ring, m * gw * 4);
      stage_words(smem + sm.k_raw, static_cast<const char*>(p.k_cache) + k_ring * k_bytes,
                  m * K * k_bytes);
      for (int j = 0; j < m; ++j)
        stage_words(reinterpret_cast<char*>(smem + sm.d_raw) + j * rows_cta * d_bytes,
                    static_cast<const char*>(p.d_cache) + (d_ring + j * V + row_base) * d_bytes,
                    rows_here * d_bytes);
      cp_async_commit();
      cp_async_wait<0>();
    } else {
      for (int i = threadIdx.x; i < m * gw; i += blockDim.x) smem[sm.g_raw + i] = g_ring[i];
      for (int i = threadIdx.x; i < m * K; i += blockDim.x)
        smem[sm.kw + (i / K) * KT + i % K] = detail::load_float(p.k_cache, p.k_dtype, k_ring + i);
      for (int i = threadIdx.x; i < m * rows_cta; i += blockDim.x) {
        const int j = i / rows_cta, r = i - j * rows_cta;
        smem[sm.d_raw + i] =
            r < rows_here ? detail::load_float(p.d_cache, p.d_dtype, d_ring + j * V + row_base + r)
                          : 0.0f;
      }
    }
    __syncthreads();
    // Decay: KDA per column (thread per column), GDN one scalar W_j per record.
    if (p.gate.kda) {
      for (int col = threadIdx.x; col < K; col += blockDim.x) {
        float gtot = 0.0f;
        for (int j = 0; j < m; ++j) gtot += smem[sm.g_raw + j * gw + col];
        smem[sm.e + col] = expf(gtot);
        float prefix = 0.0f;
        for (int j = 0; j < m; ++j) {
          prefix += smem[sm.g_raw + j * gw + col];
          const float kr = VEC ? detail::load_float(smem + sm.k_raw, p.k_dtype, j * K + col)
                               : smem[sm.kw + j * KT + col];
          smem[sm.kw + j * KT + col] = expf(gtot - prefix) * kr;
        }
      }
    } else {
      float gtot = 0.0f;
      for (int j = 0; j < m; ++j) gtot += smem[sm.g_raw + j];
      if (threadIdx.x == 0) smem[sm.e] = expf(gtot);
      for (int j = threadIdx.x; j < m; j += blockDim.x) {
        float prefix = 0.0f;
        for (int i = 0; i <= j; ++i) prefix += smem[sm.g_raw + i];
        smem[sm.w + j] = expf(gtot - prefix);
      }
      if constexpr (VEC) {
        for (int i = threadIdx.x; i < m * K; i += blockDim.x)
          smem[sm.kw + (i / K) * KT + i % K] = detail::load_float(smem + sm.k_raw, p.k_dtype, i);
      }
    }
    __syncthreads();
    // ck_j = kw_j.(alpha*k), cq_j = kw_j.(alpha*q) (GDN: times W_j): one warp per record.
    for (int j = warp; j < m; j += nwarps) {
      float part[2] = {0.0f, 0.0f};
      for (int col = lane; col < K; col += 32) {
        const float kw = smem[sm.kw + j * KT + col];
        part[0] += kw * smem[sm.ak + col];
        part[1] += kw * smem[sm.aq + col];
      }
      const float red = transpose_reduce<32, 2>(part, lane);
      const float wj = p.gate.kda ? 1.0f : smem[sm.w + j];
      if (lane == holder_lane<32, 2>(0)) smem[sm.ck + j] = red * wj;
      if (lane == holder_lane<32, 2>(1)) smem[sm.cq + j] = red * wj;
    }
    __syncthreads();
  }

  // 4. sk, sq per row: S0 dotted with e*alpha*k and e*alpha*q, plus the ring terms.
  float ek[EPL], eq[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const float e = m > 0 ? smem[sm.e + (p.gate.kda ? min(kofs + i, KT - 1) : 0)] : 1.0f;
    ek[i] = i < valid ? e * alpha[i] * x.k[i] : 0.0f;
    eq[i] = i < valid ? e * alpha[i] * x.q[i] : 0.0f;
  }
  float dots[2 * R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float sk = 0.0f, sq = 0.0f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      sk += S[r][i] * ek[i];
      sq += S[r][i] * eq[i];
    }
    dots[r] = sk;
    dots[R + r] = sq;
  }
  // The lane holding value idx (sk_r for idx < R, sq_r after) adds sum_j d_j[row_r] * c_j.
  auto ring_term = [&](int idx) {
    const int r = idx < R ? idx : idx - R;
    const float* c = smem + (idx < R ? sm.ck : sm.cq);
    const int local = local0 + r * RG;  // row r of this lane's row group
    float t = 0.0f;
    for (int j = 0; j < m; ++j) t += detail::load_float(smem + sm.d_raw, d_staged, j * rows_cta + local) * c[j];
    return t;
  };
  float d[R], o;
  const int mine = finish_rows<G, R>(dots, x.v, beta, kq, lane, d, o, ring_term);
  if (mine >= 0 && row0 + mine * RG < V)
    detail::store_float(p.out.ptr, p.out.dtype, head_offset(p.out, n, 0, hv) + row0 + mine * RG, o);

  // 5. Flush: rebuild S, fold the token in, store the checkpoint. Otherwise append the record.
  if (flush) {
    if (m > 0) {
      float e[EPL];
#pragma unroll
      for (int i = 0; i < EPL; ++i)
        e[i] = i < valid ? smem[sm.e + (p.gate.kda ? kofs + i : 0)] : 1.0f;
#pragma unroll
      for (int r = 0; r < R; ++r) detail::scale_row(S[r], e, std::integral_constant<int, EPL>{});
      for (int j = 0; j < m; ++j) {
        float kw[EPL];
#pragma unroll
        for (int i = 0; i < EPL; ++i) kw[i] = i < valid ? smem[sm.kw + j * KT + kofs + i] : 0.0f;
        const float wj = p.gate.kda ? 1.0f : smem[sm.w + j];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float dj = detail::load_float(smem + sm.d_raw, d_staged, j * rows_cta + local0 + r * RG);
          detail::rank1_update(S[r], kw, std::integral_constant<int, EPL>{}, dj * wj);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      detail::scale_row(S[r], alpha, std::integral_constant<int, EPL>{});  // S0 <- alpha*S + d*k
      detail::rank1_update(S[r], x.k, std::integral_constant<int, EPL>{}, d[r]);
      const int row = row0 + r * RG;
      if (row < V) store_state<StateT, EPL, VEC>(s0 + static_cast<int64_t>(row) * K + kofs, valid, S[r]);
    }
  } else {
    if (lane % G == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int row = row0 + r * RG;
        if (row < V) detail::store_float(p.d_cache, p.d_dtype, d_ring + m * V + row, d[r]);
      }
    }
    if (blockIdx.y == 0 && warp == 0 && lane < G) {  // one writer of this head's g and k
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        if (i < valid) {
          if (p.gate.kda) g_ring[m * gw + kofs + i] = g[i];
          if (hv % group == 0)
            detail::store_float(p.k_cache, p.k_dtype, k_ring + m * K + kofs + i, x.k[i]);
        }
      }
      if (!p.gate.kda && lane == 0) g_ring[m] = g[0];
    }
  }
}

template <class StateT, int KT, bool VEC, class In>
void launch(const ReplayProblem& p, cudaStream_t stream) {
  using Lay = RowLayout<StateT, KT>;
  const int rows_per_warp = Lay::RG * Lay::ROWS;
  const int warps_needed = (p.V + rows_per_warp - 1) / rows_per_warp;
  const int64_t heads = static_cast<int64_t>(p.B) * p.HV;
  int warps = warps_needed < 4 ? warps_needed : 4;
  if (heads * ((warps_needed + 3) / 4) < 2LL * num_sms(p.device.index)) warps = 1;
  const int vblocks = (warps_needed + warps - 1) / warps;
  if (static_cast<int64_t>(p.HV) * vblocks >= (1 << 15))
    throw Error(ErrorKind::not_implemented,
                "replayssm_decode: HV * V-blocks must stay below 2^15 for the in-kernel cursor "
                "advance");
  const SmemLayout sm = SmemLayout::of(p, KT, VEC, warps * rows_per_warp);
  if (sm.bytes > 48 * 1024) {  // opt in once per device (and instantiation) to the maximum
    static PerDeviceOnce opted;
    const int max_optin = opted.get(p.device.index, [&p] {
      int max = 0;
      DS_CUDA_CHECK(cudaDeviceGetAttribute(&max, cudaDevAttrMaxSharedMemoryPerBlockOptin, p.device.index));
      DS_CUDA_CHECK(cudaFuncSetAttribute(replay_kernel<StateT, KT, VEC, In>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, max));
      return max;
    });
    if (sm.bytes > max_optin)
      throw Error(ErrorKind::not_implemented,
                  "replayssm_decode: ring length L=" + std::to_string(p.L) +
                      " needs more shared memory than this GPU offers");
  }
  dim3 grid(static_cast<unsigned>(heads), static_cast<unsigned>(vblocks));
  replay_kernel<StateT, KT, VEC, In><<<grid, warps * 32, sm.bytes, stream>>>(p);
  DS_CUDA_CHECK(cudaGetLastError());
}

#if DELTASTATE_CUDA_ALL_KERNELS
bool inputs_are(const ReplayProblem& p, DType t) {
  return p.q.dtype == t && p.a.dtype == t && p.b.dtype == t;
}

// The cp.async staging copies 4-byte words: every ring section must start and end on one.
bool ring_words_aligned(const ReplayProblem& p, int rows_cta) {
  const int64_t kb = dtype_size(p.k_dtype), db = dtype_size(p.d_dtype);
  return (p.K * kb) % 4 == 0 && (p.V * db) % 4 == 0 && (rows_cta * db) % 4 == 0 &&
         reinterpret_cast<uintptr_t>(p.k_cache) % 4 == 0 &&
         reinterpret_cast<uintptr_t>(p.d_cache) % 4 == 0 && (p.V % 2 == 0 || db == 4);
}

template <class StateT, class In>
bool launch_fast(const ReplayProblem& p, cudaStream_t stream) {
  if (!state_rows_aligned<StateT>(p.state) || !ring_words_aligned(p, 32)) return false;
  if (p.K == 128) return launch<StateT, 128, true, In>(p, stream), true;
  if (p.K == 64) return launch<StateT, 64, true, In>(p, stream), true;
  return false;
}
#endif

// Kernel choice as for the recurrent op (src/cuda/recurrent.cu).
template <class StateT>
void dispatch(const ReplayProblem& p, cudaStream_t stream) {
  require_supported_k(p.K);
#if DELTASTATE_CUDA_ALL_KERNELS
  if (inputs_are(p, DType::bf16) && launch_fast<StateT, TypedInput<__nv_bfloat16>>(p, stream)) return;
  if (inputs_are(p, DType::f32) && launch_fast<StateT, TypedInput<float>>(p, stream)) return;
#endif
  launch<StateT, 256, false, AnyInput>(p, stream);
}

}  // namespace

void run_replayssm_decode(const ReplayProblem& p, void* stream) {
  DeviceGuard guard(p.device.index);
  auto s = static_cast<cudaStream_t>(stream);
  switch (p.state.dtype) {
    case DType::bf16: return dispatch<__nv_bfloat16>(p, s);
    case DType::f16: return dispatch<__half>(p, s);
    default: return dispatch<float>(p, s);
  }
}

}  // namespace deltastate::cuda_backend
