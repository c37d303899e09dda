// CUDA kernel of the pooled varlen recurrent op, GDN and KDA; packed decode is its T = 1 case.
//
// Decode is memory-bound: every state element is read once and written once. A CTA owns a block
// of rows of one (sequence, value head); each thread keeps ROWS row slices of EPL elements in
// registers for the whole sequence, loaded with one 16-byte load per row (coalesced: a warp reads
// RG whole rows per instruction) and all issued before the first use, then stored once at the end.
// Dot products over K are shuffle reductions inside the G lanes of a row: no shared memory, no
// block barrier. No allocation, no host synchronization: graph-capturable.
#include "api/backend.h"
#include "cuda/common.cuh"

namespace deltastate::cuda_backend {

using detail::RecurrentProblem;

namespace {


template <class StateT, int KT, bool VEC>
__global__ void __launch_bounds__(128) recurrent_kernel(const RecurrentProblem p) {
  using Lay = RowLayout<StateT, KT>;
  constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, kRows = Lay::ROWS;

  const int64_t head = blockIdx.x;  // n * HV + hv
  const int64_t n = head / p.HV;
  const int hv = static_cast<int>(head - n * p.HV);
  const int h = hv / (p.HV / p.H);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int kofs = (lane % G) * EPL;
  const int valid = VEC ? EPL : max(0, min(EPL, p.K - kofs));
  // Row of pass r: blockIdx.y's block, then this warp's RG*kRows rows, pass-major so that one
  // load instruction of a warp covers RG adjacent rows.
  const int rows_per_warp = RG * kRows;
  const int row0 = (blockIdx.y * (blockDim.x >> 5) + warp) * rows_per_warp + lane / G;

  const int64_t slot = p.indices ? detail::load_index(p.indices, p.index_dtype, n) : n;
  const int64_t seq = p.cu_seqlens ? 0 : n;
  const int64_t tok0 = p.cu_seqlens ? detail::load_index(p.cu_seqlens, p.cu_dtype, n) : 0;
  const int64_t len =
      p.cu_seqlens ? detail::load_index(p.cu_seqlens, p.cu_dtype, n + 1) - tok0 : p.T;
  const int64_t head_elems = static_cast<int64_t>(p.V) * p.K;

  if (p.indices && slot < 0) {  // padded: zero output, state untouched
    if (lane % G == 0) {
      for (int64_t t = 0; t < len; ++t) {
        const int64_t o = head_offset(p.out, seq, tok0 + t, hv);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int row = row0 + r * RG;
          if (row < p.V) detail::store_float(p.out.ptr, p.out.dtype, o + row, 0.0f);
        }
      }
    }
    if (p.final_state) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int row = row0 + r * RG;
        if (row < p.V)
          _Pragma("unroll") for (int i = 0; i < EPL; ++i) if (i < valid)
            detail::store_float(p.final_state, p.final_dtype,
                                head * head_elems + static_cast<int64_t>(row) * p.K + kofs + i, 0.0f);
      }
    }
    return;
  }
  if (p.check_indices && slot >= p.state.num_slots) trap_bad_slot("recurrent", n, slot, p.state.num_slots);

  // 1. Issue every state load first.
  float S[kRows][EPL];
  StateT* state_head = p.state.ptr ? static_cast<StateT*>(p.state.ptr) + slot * p.state.slot_stride +
                                         hv * head_elems
                                   : nullptr;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = row0 + r * RG;
    if (state_head && row < p.V) {
      load_state<StateT, EPL, VEC>(state_head + static_cast<int64_t>(row) * p.K + kofs, valid, S[r]);
    } else {
#pragma unroll
      for (int i = 0; i < EPL; ++i) S[r][i] = 0.0f;
    }
  }

  // 2. Tokens.
  for (int64_t t = 0; t < len; ++t) {
    const int64_t tok = tok0 + t;
    float q[EPL], k[EPL], g[EPL], alpha[EPL];
    load_input<EPL>(p.q.ptr, p.q.dtype, head_offset(p.q, seq, tok, h) + kofs, valid, q);
    load_input<EPL>(p.k.ptr, p.k.dtype, head_offset(p.k, seq, tok, h) + kofs, valid, k);
    float v[kRows];
    const int64_t v_off = head_offset(p.v, seq, tok, hv);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = row0 + r * RG;
      v[r] = row < p.V ? detail::load_float(p.v.ptr, p.v.dtype, v_off + row) : 0.0f;
    }
    gate_slice<EPL>(p.gate, p.g.ptr, p.g.dtype, head_offset(p.g, seq, tok, hv), hv, p.K, kofs,
                    valid, g, alpha);
    const float beta = detail::beta_value(
        detail::load_float(p.beta.ptr, p.beta.dtype, head_offset(p.beta, seq, tok, hv)),
        p.beta_is_logit, p.round_beta, p.beta.dtype);
    prepare_qk<EPL, G>(q, k, p.l2norm, p.scale);

    float o[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      o[r] = detail::delta_rule_row(S[r], alpha, k, q, std::integral_constant<int, EPL>{}, v[r],
                                    beta, [](float x) { return group_sum<G>(x); });
    }
    if (lane % G == 0) {
      const int64_t o_off = head_offset(p.out, seq, tok, hv);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int row = row0 + r * RG;
        if (row < p.V) detail::store_float(p.out.ptr, p.out.dtype, o_off + row, o[r]);
      }
    }
  }

  // 3. Store the final state once.
  if (state_head && p.update_state && len > 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = row0 + r * RG;
      if (row < p.V)
        store_state<StateT, EPL, VEC>(state_head + static_cast<int64_t>(row) * p.K + kofs, valid, S[r]);
    }
  }
  if (p.final_state) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = row0 + r * RG;
      if (row < p.V)
        _Pragma("unroll") for (int i = 0; i < EPL; ++i) if (i < valid)
          detail::store_float(p.final_state, p.final_dtype,
                              head * head_elems + static_cast<int64_t>(row) * p.K + kofs + i, S[r][i]);
    }
  }
}

template <class StateT, int KT, bool VEC>
void launch(const RecurrentProblem& p, cudaStream_t stream) {
  using Lay = RowLayout<StateT, KT>;
  const int rows_per_warp = Lay::RG * Lay::ROWS;
  const int warps_needed = (p.V + rows_per_warp - 1) / rows_per_warp;
  const int64_t heads = p.num_heads_total();
  // Small batches: one warp per CTA spreads the work over more SMs; otherwise up to 4.
  int warps = warps_needed < 4 ? warps_needed : 4;
  const int64_t ctas4 = heads * ((warps_needed + 3) / 4);
  if (ctas4 < 2LL * num_sms(p.device.index)) warps = 1;
  const int vblocks = (warps_needed + warps - 1) / warps;
  if (heads > 0x7fffffffLL)
    throw Error(ErrorKind::value, "recurrent: N*HV exceeds the CUDA grid limit (2^31 - 1)");
  dim3 grid(static_cast<unsigned>(heads), static_cast<unsigned>(vblocks));
  recurrent_kernel<StateT, KT, VEC><<<grid, warps * 32, 0, stream>>>(p);
  DS_CUDA_CHECK(cudaGetLastError());
}

template <class StateT>
void dispatch_k(const RecurrentProblem& p, cudaStream_t stream) {
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

void run_recurrent(const RecurrentProblem& p, void* stream) {
  DeviceGuard guard(p.device.index);
  auto s = static_cast<cudaStream_t>(stream);
  // Without a state pool the kernel starts from zeros; the state dtype then only selects the
  // register layout, so use fp32.
  const DType sd = p.state.ptr ? p.state.dtype : DType::f32;
  switch (sd) {
    case DType::bf16: return dispatch_k<__nv_bfloat16>(p, s);
    case DType::f16: return dispatch_k<__half>(p, s);
    default: return dispatch_k<float>(p, s);
  }
}

}  // namespace deltastate::cuda_backend
