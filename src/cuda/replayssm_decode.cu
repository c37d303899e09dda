// CUDA kernel of ReplaySSM buffered decode (spec §5, basic mode), GDN and KDA.
//
// A CTA owns a block of rows of one (row n, value head). It issues its checkpoint loads first,
// then stages the ring into shared memory with the decay already applied (KDA: W_j folded into the
// keys, kw_j = W_j * k_j; GDN: the scalar W_j kept beside d_j), rebuilds
//   S = exp(Gtot) * S0 + sum_j d_j kw_j^T
// in registers with fp32 FMAs (exact fp32, no operand rounding), runs the current token, and
// either folds it into the checkpoint (flush) or appends its record (d, k, g). Non-flush steps
// write only the ring record: the checkpoint is read, never written.
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


struct SmemLayout {
  int kw, d, decay, w, bytes;  // float offsets, total bytes
  __host__ __device__ SmemLayout(int L, int KT, int rows_cta) {
    kw = 0;
    d = kw + L * KT;
    decay = d + L * rows_cta;
    w = decay + KT;
    bytes = (w + L) * 4;
  }
};

template <class StateT, int KT, bool VEC>
__global__ void __launch_bounds__(128) replay_kernel(const ReplayProblem p) {
  using Lay = RowLayout<StateT, KT>;
  constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, kRows = Lay::ROWS;
  extern __shared__ float smem[];
  __shared__ int cursor_sh;

  const int64_t head = blockIdx.x;
  const int64_t n = head / p.HV;
  const int hv = static_cast<int>(head - n * p.HV);
  const int group = p.HV / p.H;
  const int h = hv / group;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nthreads = blockDim.x;
  const int kofs = (lane % G) * EPL;
  const int valid = VEC ? EPL : max(0, min(EPL, p.K - kofs));
  const int rows_per_warp = RG * kRows;
  const int rows_cta = (blockDim.x >> 5) * rows_per_warp;
  const int row_base = blockIdx.y * rows_cta;
  const int local0 = warp * rows_per_warp + lane / G;  // local row of pass 0
  const int L = p.L;
  const SmemLayout sm(L, KT, rows_cta);

  const int64_t slot = p.indices[n];
  if (slot < 0) {  // padded: zero output, no state, ring or cursor access
    if (lane % G == 0) {
      const int64_t o = head_offset(p.out, n, 0, hv);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int row = row_base + local0 + r * RG;
        if (row < p.V) detail::store_float(p.out.ptr, p.out.dtype, o + row, 0.0f);
      }
    }
    return;
  }
  if (p.check_indices && slot >= p.state.num_slots)
    trap_bad_slot("replayssm_decode", n, slot, p.state.num_slots);
  const bool forced = p.force_flush && p.force_flush[n] != 0;

  // The cursor m (and, with advance_write_pos, its advance by the last CTA of the row).
  if (threadIdx.x == 0) {
    int m;
    if (p.advance_write_pos) {
      const int old = atomicAdd(p.write_pos + n, 1 << 16);
      m = min(max(old & 0xffff, 0), L - 1);
      const int arrivals = old >> 16;
      if (arrivals == p.HV * static_cast<int>(gridDim.y) - 1)
        p.write_pos[n] = (m == L - 1 || forced) ? 0 : m + 1;
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

  // 1. Issue every checkpoint load first.
  const int64_t head_elems = static_cast<int64_t>(p.V) * p.K;
  StateT* s0 = static_cast<StateT*>(p.state.ptr) + slot * p.state.slot_stride + hv * head_elems;
  float S[kRows][EPL];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = row_base + local0 + r * RG;
    if (row < p.V) {
      load_state<StateT, EPL, VEC>(s0 + static_cast<int64_t>(row) * p.K + kofs, valid, S[r]);
    } else {
#pragma unroll
      for (int i = 0; i < EPL; ++i) S[r][i] = 0.0f;
    }
  }
  __syncthreads();
  const int m = cursor_sh;
  const bool flush = m == L - 1 || forced;

  // 2. Stage the m ring records in shared memory, decay applied.
  const int gw = p.gate.kda ? p.K : 1;
  float* g_ring = p.g_cache + (static_cast<int64_t>(slot) * p.HV + hv) * L * gw;
  const int64_t k_ring = (static_cast<int64_t>(slot) * p.H + h) * L * p.K;
  const int64_t d_ring = (static_cast<int64_t>(slot) * p.HV + hv) * L * p.V;
  if (m > 0) {
    if (p.gate.kda) {
      for (int col = threadIdx.x; col < p.K; col += nthreads) {
        float gtot = 0.0f;
        for (int j = 0; j < m; ++j) gtot += g_ring[j * gw + col];
        smem[sm.decay + col] = expf(gtot);
        float prefix = 0.0f;
        for (int j = 0; j < m; ++j) {
          prefix += g_ring[j * gw + col];
          smem[sm.kw + j * KT + col] =
              expf(gtot - prefix) * detail::load_float(p.k_cache, p.k_dtype, k_ring + j * p.K + col);
        }
      }
    } else {
      float gtot = 0.0f;
      for (int j = 0; j < m; ++j) gtot += g_ring[j];
      if (threadIdx.x == 0) smem[sm.decay] = expf(gtot);
      for (int j = threadIdx.x; j < m; j += nthreads) {
        float prefix = 0.0f;
        for (int i = 0; i <= j; ++i) prefix += g_ring[i];
        smem[sm.w + j] = expf(gtot - prefix);
      }
      for (int i = threadIdx.x; i < m * p.K; i += nthreads) {
        const int j = i / p.K, col = i - j * p.K;
        smem[sm.kw + j * KT + col] = detail::load_float(p.k_cache, p.k_dtype, k_ring + j * p.K + col);
      }
    }
    for (int i = threadIdx.x; i < m * rows_cta; i += nthreads) {
      const int j = i / rows_cta, r = i - j * rows_cta;
      const int row = row_base + r;
      smem[sm.d + j * rows_cta + r] =
          row < p.V ? detail::load_float(p.d_cache, p.d_dtype, d_ring + j * p.V + row) : 0.0f;
    }
  }
  __syncthreads();

  // 3. Rebuild S in registers.
  if (m > 0) {
    float decay[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      decay[i] = i < valid ? smem[sm.decay + (p.gate.kda ? kofs + i : 0)] : 1.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int i = 0; i < EPL; ++i) S[r][i] *= decay[i];
    for (int j = 0; j < m; ++j) {
      float kw[EPL];
#pragma unroll
      for (int i = 0; i < EPL; ++i) kw[i] = i < valid ? smem[sm.kw + j * KT + kofs + i] : 0.0f;
      const float wj = p.gate.kda ? 1.0f : smem[sm.w + j];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float d = smem[sm.d + j * rows_cta + local0 + r * RG] * wj;
        detail::replay_accumulate_row(S[r], kw, std::integral_constant<int, EPL>{}, d);
      }
    }
  }

  // 4. The current token.
  float q[EPL], k[EPL], g[EPL], alpha[EPL];
  load_input<EPL>(p.q.ptr, p.q.dtype, head_offset(p.q, n, 0, h) + kofs, valid, q);
  load_input<EPL>(p.k.ptr, p.k.dtype, head_offset(p.k, n, 0, h) + kofs, valid, k);
  float v[kRows];
  const int64_t v_off = head_offset(p.v, n, 0, hv);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = row_base + local0 + r * RG;
    v[r] = row < p.V ? detail::load_float(p.v.ptr, p.v.dtype, v_off + row) : 0.0f;
  }
  gate_slice<EPL>(p.gate, p.a.ptr, p.a.dtype, head_offset(p.a, n, 0, hv), hv, p.K, kofs, valid, g,
                  alpha);
  const float beta = detail::beta_value(
      detail::load_float(p.b.ptr, p.b.dtype, head_offset(p.b, n, 0, hv)), true, true, p.b.dtype);
  prepare_qk<EPL, G>(q, k, p.l2norm, p.scale);
  float kq = 0.0f;
#pragma unroll
  for (int i = 0; i < EPL; ++i) kq += k[i] * q[i];
  kq = group_sum<G>(kq);

  float d[kRows], o[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    detail::replay_token_row(S[r], alpha, k, q, std::integral_constant<int, EPL>{}, v[r], beta, kq,
                             [](float x) { return group_sum<G>(x); }, d[r], o[r]);
  }
  if (lane % G == 0) {
    const int64_t o_off = head_offset(p.out, n, 0, hv);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = row_base + local0 + r * RG;
      if (row < p.V) detail::store_float(p.out.ptr, p.out.dtype, o_off + row, o[r]);
    }
  }

  // 5. Flush, or append the record at position m.
  if (flush) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = row_base + local0 + r * RG;
      detail::replay_flush_row(S[r], alpha, k, std::integral_constant<int, EPL>{}, d[r]);
      if (row < p.V)
        store_state<StateT, EPL, VEC>(s0 + static_cast<int64_t>(row) * p.K + kofs, valid, S[r]);
    }
  } else {
    if (lane % G == 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int row = row_base + local0 + r * RG;
        if (row < p.V) detail::store_float(p.d_cache, p.d_dtype, d_ring + m * p.V + row, d[r]);
      }
    }
    if (blockIdx.y == 0 && warp == 0 && lane < G) {  // one writer of this head's g and k
      if (p.gate.kda) {
        _Pragma("unroll") for (int i = 0; i < EPL; ++i) if (i < valid) g_ring[m * gw + kofs + i] = g[i];
      } else if (lane == 0) {
        g_ring[m] = g[0];
      }
      if (hv % group == 0)
        _Pragma("unroll") for (int i = 0; i < EPL; ++i) if (i < valid)
          detail::store_float(p.k_cache, p.k_dtype, k_ring + m * p.K + kofs + i, k[i]);
    }
  }
}

template <class StateT, int KT, bool VEC>
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
  const SmemLayout sm(p.L, KT, warps * rows_per_warp);
  static int opted_in = 48 * 1024;  // per instantiation
  if (sm.bytes > opted_in) {
    int max_optin = 0;
    DS_CUDA_CHECK(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                         p.device.index));
    if (sm.bytes > max_optin)
      throw Error(ErrorKind::not_implemented,
                  "replayssm_decode: ring length L=" + std::to_string(p.L) +
                      " needs more shared memory than this GPU offers");
    DS_CUDA_CHECK(cudaFuncSetAttribute(replay_kernel<StateT, KT, VEC>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, max_optin));
    opted_in = max_optin;
  }
  dim3 grid(static_cast<unsigned>(heads), static_cast<unsigned>(vblocks));
  replay_kernel<StateT, KT, VEC><<<grid, warps * 32, sm.bytes, stream>>>(p);
  DS_CUDA_CHECK(cudaGetLastError());
}

template <class StateT>
void dispatch_k(const ReplayProblem& p, cudaStream_t stream) {
  const bool aligned = reinterpret_cast<uintptr_t>(p.state.ptr) % 16 == 0 &&
                       (p.state.slot_stride * static_cast<int64_t>(sizeof(StateT))) % 16 == 0;
#if DELTASTATE_CUDA_ALL_KERNELS
  if (aligned && p.K == 128) return launch<StateT, 128, true>(p, stream);
  if (aligned && p.K == 64) return launch<StateT, 64, true>(p, stream);
  if (p.K <= 64) return launch<StateT, 64, false>(p, stream);
  if (p.K <= 128) return launch<StateT, 128, false>(p, stream);
#else
  (void)aligned;
#endif
  if (p.K <= 256) return launch<StateT, 256, false>(p, stream);
  throw Error(ErrorKind::not_implemented,
              "the CUDA backend supports K <= 256 (got K=" + std::to_string(p.K) + ")");
}

}  // namespace

void run_replayssm_decode(const ReplayProblem& p, void* stream) {
  DeviceGuard guard(p.device.index);
  auto s = static_cast<cudaStream_t>(stream);
  switch (p.state.dtype) {
    case DType::bf16: return dispatch_k<__nv_bfloat16>(p, s);
    case DType::f16: return dispatch_k<__half>(p, s);
    default: return dispatch_k<float>(p, s);
  }
}

}  // namespace deltastate::cuda_backend
