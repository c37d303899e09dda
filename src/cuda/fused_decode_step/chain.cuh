// The fused decode layer step's chain plan: the step as the backend's own kernels in sequence on
// the caller's stream, through the caller's workspace. Part of fused_decode_step.cu's
// translation unit (included there only), in its anonymous namespace.
//
// Why a chain inside the fused op: from about a wave of the CTA kernel's grid up (one CTA per
// (row, key head), 1 resident per SM), the CTA kernel is latency-bound (each CTA keeps its state
// tile resident through the conv and the norm, so few state bytes are in flight per SM), and the
// separate kernels, each shaped for its own part, are faster in sequence (docs/LAYER_STEP.md has
// the figures). The chain:
//   1. the conv update (conv_update.cu's kernel, one launch over the three parts' channels; with
//      Kimi-Linear's separate windows through its split_k / split_v parts), the conv output
//      rounded to mixed_qkv's dtype into the workspace [B, conv_dim], as the unfused chain stores
//      it and as the fused kernels round it into shared memory;
//   2. the packed decode on the workspace (recurrent.cu's dispatch: the kernels and the kernel
//      choice of packed decode), the attention output into `out` in out's dtype;
//   3. with the norm, fused_chain_norm_kernel in place on `out`: one warp per (row, value head),
//      the CTA kernel's sum of squares (same lanes, same order, same butterfly) and its
//      layer_math.h functions over the rounded outputs, so the result has the CTA kernel's bits.
// Every intermediate is rounded where the fused kernels round it, so the plans agree bit for bit
// on the windows and the state, and on the output wherever the decode kernel's register layout is
// the CTA kernel's (the register decode kernel; the streaming kernel of 16-bit states at large
// batches reduces over K in another order).
//
// Rows: a padded row (slot < 0) and a bad one (slot >= slots) are skipped by each kernel (zeros,
// NaN); the conv, which runs first and meets every row the decode meets, records a bad one as
// the fused step's (err_op), so check_errors names the fused step. The norm kernel leaves both
// kinds of rows as the decode wrote them (the norm of a zero row need not be +0).
//
// The ReplaySSM chain (run_fused_replay_chain) is the same with replayssm_decode.cu's dispatch
// (its kernels and kernel choice) as step 2, on the checkpoint pool, rings and cursors: the
// unfused ReplaySSM chain conv -> replayssm_decode -> norm, through the workspace. A row whose
// cursor is outside the ring is a bad row too: the conv reads the cursor as the ReplaySSM decode
// does, skips the row (its window not rolled, as the one-launch kernel leaves it) and records
// it as the fused step's; the decode skips it by its own check, recording as the fused step's
// too (err_op), and the norm kernel leaves it as the decode wrote it.
#pragma once

#include <cstdint>
#include <type_traits>

#include "api/backend.h"
#include "core/layer_math.h"
#include "core/problem.h"
#include "cuda/grid.cuh"
#include "cuda/launch.h"
#include "cuda/loads.cuh"
#include "cuda/replayssm/ring.cuh"

namespace deltastate::cuda_backend {

using detail::FusedStepProblem;

namespace {

constexpr int kChainNormWarps = 4;  // warps per CTA of the norm kernel, one (row, value head) each

// The workspace the chain needs: the conv output [B, conv_dim] in mixed_qkv's dtype, rounded up
// to 16 bytes.
inline int64_t fused_chain_workspace_bytes(const FusedStepProblem& p) {
  const int64_t bytes =
      static_cast<int64_t>(p.B) * p.conv_dim() * static_cast<int64_t>(dtype_size(p.x_dtype));
  return (bytes + 15) / 16 * 16;
}

// One lane holds at most this many of a head's V outputs: V <= 256 (the validator's rows per key
// head). Heads of V <= 128 (both models) take a kernel of half as many, so that no lane loads
// past its share four times over.
constexpr int kChainNormPerLane = 8;

// The head's outputs, weights and gates are loaded into registers in one pass, issued beside the
// slot's load (every row's outputs are valid to read: the decode wrote them, zeros or NaN for
// padded and bad rows), so the kernel waits on memory once; the slot decides only the store.
// Lane l holds the head's elements [l*C, l*C + C), C = norm_lane_elements(V), and sums their
// squares in that order (the CTA kernels' order, so the plans agree bit for bit).
// In: TypedInput<A> where out, z and norm_weight share the element type A (run_chain_norm); else
// AnyInput (the dtype switch). PER: the elements per lane, PER >= C.
// VEC (typed inputs only): V == 32 * PER and every lane's share starts on a multiple of its size
// in bytes in all three tensors (run_chain_norm checks), so a lane reads each tensor as one
// 8-byte word or whole 16-byte words; else each element is loaded at an index clamped into the
// head (no load waits behind a bounds branch) and converted where it is used.
template <class In, int PER, bool VEC>
__global__ void __launch_bounds__(kChainNormWarps * 32)
    fused_chain_norm_kernel(const FusedStepProblem p) {
  using Elem = typename In::wide_type;
  enter_grid(p.pdl_trigger_early);
  // The grid is (B, value-head groups): no division
  const int64_t n = blockIdx.x;
  const int hv =
      static_cast<int>(blockIdx.y) * kChainNormWarps + static_cast<int>(threadIdx.x >> 5);
  const int lane = static_cast<int>(threadIdx.x & 31);
  if (hv >= p.HV) return;  // warp-uniform
  const int64_t slot = detail::index_at(p.indices, p.index_dtype, p.index_stride, n);
  const int V = p.V;
  const int per = VEC ? PER : detail::norm_lane_elements(V);
  const int i0 = lane * per;
  const int64_t o_base = detail::head_offset(p.out, n, 0, hv);
  const int64_t z_off = n * p.z_row_stride + static_cast<int64_t>(hv) * p.z_head_stride;
  // VEC: a lane's share as whole words (8 bytes, or 16-byte words) of In's type
  constexpr DType kWordType = dtype_of<typename In::type>();
  constexpr int kEB = static_cast<int>(sizeof(typename In::type));
  using Word = std::conditional_t<PER * kEB == 8, uint2, uint4>;
  constexpr int kWords = PER * kEB / static_cast<int>(sizeof(Word));
  float o[PER], wt[PER], zt[PER];
  if constexpr (VEC) {
    Word ro[kWords], rw[kWords], rz[kWords];
    load_words(static_cast<const char*>(p.out.ptr) + (o_base + i0) * kEB, ro);
    load_words(static_cast<const char*>(p.norm_weight) + i0 * kEB, rw);
    load_words(static_cast<const char*>(p.z) + (z_off + i0) * kEB, rz);
    if (slot < 0 || slot >= p.state.num_slots) return;  // padded or bad: as the decode wrote it
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      o[j] = float_of_bits(bits_at<kEB>(ro, j), kWordType);
      wt[j] = float_of_bits(bits_at<kEB>(rw, j), kWordType);
      zt[j] = float_of_bits(bits_at<kEB>(rz, j), kWordType);
    }
  } else {
    Elem ro[PER], rw[PER], rz[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      // elements past the lane's share or past V reread its last one (no bounds branch)
      const int i = min(i0 + min(j, per - 1), V - 1);
      ro[j] = load_input<In, Elem>(p.out.ptr, p.out.dtype, o_base + i);
      rw[j] = load_input<In, Elem>(p.norm_weight, p.norm_weight_dtype, i);
      rz[j] = load_input<In, Elem>(p.z, p.z_dtype, z_off + i);
    }
    if (slot < 0 || slot >= p.state.num_slots) return;  // padded or bad: as the decode wrote it
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      o[j] = to_float(ro[j]);
      wt[j] = to_float(rw[j]);
      zt[j] = to_float(rz[j]);
    }
  }
  if (p.is_replay()) {
    // A bad cursor: as the decode wrote it. The decode has advanced every cursor it accepted to
    // one inside the ring and left a bad one as it was, so the check after it sees the same rows.
    const int cursor = p.replay.write_pos[n];
    if (cursor < 0 || replay_cursor(cursor, p.replay.advance_write_pos) >= p.replay.L) return;
  }
  // kernel.cuh step 4 over this head's outputs as stored (out's dtype): the same elements per
  // lane, the same order of the sum of squares, the same butterfly
  // (silu(z) first: it does not wait for the reduction)
  float sz[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) sz[j] = detail::silu(zt[j]);
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < PER; ++j)
    if (j < per && i0 + j < V) ss += o[j] * o[j];
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, d);
  const float inv = detail::rms_inverse(ss, V, p.norm_eps);
  // Typed inputs: out, z and the weight share In's type (run_chain_norm), known here, so the
  // roundings compile to their own conversion instead of a switch over the three dtypes.
  constexpr bool kTyped = !std::is_same_v<In, AnyInput>;
  const DType act = kTyped ? kWordType : p.out.dtype;
  const bool round_product = kTyped || p.norm_weight_dtype == p.out.dtype;
  float y[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j)
    y[j] = detail::gated_norm_of_silu(o[j], inv, wt[j], sz[j], act, round_product);
  if constexpr (VEC) {  // the lane's share as the words it was read as
    Word u[kWords] = {};
#pragma unroll
    for (int j = 0; j < PER; ++j) set_bits_at<kEB>(u, j, bits_of_float(y[j], act));
    store_words<kWords>(static_cast<char*>(p.out.ptr) + (o_base + i0) * kEB, u);
  } else {
#pragma unroll
    for (int j = 0; j < PER; ++j)  // each lane rewrites only the elements of its share
      if (j < per && i0 + j < V) detail::store_float(p.out.ptr, act, o_base + i0 + j, y[j]);
  }
}

// Step 1: the conv update into the workspace; in ReplaySSM mode with the cursors' check.
void run_chain_conv(const FusedStepProblem& p, cudaStream_t stream) {
  const int64_t HK = static_cast<int64_t>(p.H) * p.K;
  const int64_t conv_dim = p.conv_dim();
  detail::ConvUpdateProblem c;
  c.B = p.B;
  c.dim = static_cast<int32_t>(conv_dim);
  c.T = 1;
  c.x = p.x;
  c.x_dtype = p.x_dtype;
  c.x_batch_stride = p.x_row_stride;
  c.x_dim_stride = 1;
  c.x_tok_stride = 0;
  c.out = p.workspace;
  c.out_dtype = p.x_dtype;
  c.out_batch_stride = conv_dim;
  c.out_dim_stride = 1;
  c.out_tok_stride = 0;
  c.conv = p.conv;
  c.state = p.window[0];  // the q part: channels [0, HK)
  c.window_k = p.window[1];
  c.window_v = p.window[2];
  c.split_k = static_cast<int32_t>(HK);
  c.split_v = static_cast<int32_t>(2 * HK);
  c.slots = p.indices;
  c.slot_dtype = p.index_dtype;
  c.slot_stride = p.index_stride;
  c.err_op = detail::kErrOpFusedStep;
  c.check_indices = false;  // the fused step's entry point checks after the chain
  if (p.is_replay()) {
    c.cursors = p.replay.write_pos;
    c.cursor_limit = p.replay.L;
    c.cursor_advance = p.replay.advance_write_pos;
  }
  c.pdl = p.pdl;
  c.device = p.device;
  run_conv_update(c, stream);
}

// Whether a lane's share of PER elements of `bytes` each starts on a multiple of its size in
// every tensor the norm kernel reads (base pointers, head and row strides): the vector kernel.
bool chain_norm_words_aligned(const FusedStepProblem& p, int per, int bytes) {
  const int64_t share = static_cast<int64_t>(per) * bytes;
  const auto al = [share](const void* q) { return reinterpret_cast<uintptr_t>(q) % share == 0; };
  const auto div = [per](int64_t stride) { return stride % per == 0; };
  return p.V == 32 * per && al(p.out.ptr) && al(p.z) && al(p.norm_weight) &&
         div(p.out.seq_stride) && div(p.out.tok_stride) && div(p.out.head_stride) &&
         div(p.z_row_stride) && div(p.z_head_stride);
}

// Step 3: with the norm, the gated RMSNorm in place on out.
void run_chain_norm(const FusedStepProblem& p, cudaStream_t stream) {
  if (!p.z) return;
  const dim3 grid(static_cast<unsigned>(p.B), (p.HV + kChainNormWarps - 1) / kChainNormWarps);
  const int64_t ctas = static_cast<int64_t>(grid.x) * grid.y;
  const DType a = p.out.dtype;
  const bool typed = p.z_dtype == a && p.norm_weight_dtype == a;
  const auto pick = [&](auto per) -> void (*)(FusedStepProblem) {
    constexpr int PER = decltype(per)::value;
    const bool vec = typed && chain_norm_words_aligned(p, PER, dtype_size(a));
    if (!typed) return fused_chain_norm_kernel<AnyInput, PER, false>;
    if (a == DType::bf16)
      return vec ? fused_chain_norm_kernel<TypedInput<__nv_bfloat16>, PER, true>
                 : fused_chain_norm_kernel<TypedInput<__nv_bfloat16>, PER, false>;
    if (a == DType::f16)
      return vec ? fused_chain_norm_kernel<TypedInput<__half>, PER, true>
                 : fused_chain_norm_kernel<TypedInput<__half>, PER, false>;
    return vec ? fused_chain_norm_kernel<TypedInput<float>, PER, true>
               : fused_chain_norm_kernel<TypedInput<float>, PER, false>;
  };
  void (*kernel)(FusedStepProblem) =
      p.V <= 128 ? pick(std::integral_constant<int, kChainNormPerLane / 2>{})
                 : pick(std::integral_constant<int, kChainNormPerLane>{});
  launch_kernel(kernel, grid, kChainNormWarps * 32, 0, stream, p.pdl,
                with_pdl_trigger(p, ctas, 2048 / (kChainNormWarps * 32)));
}

// The norm's grid, checked before the chain's first launch.
void check_chain_norm_grid(const FusedStepProblem& p) {
  if (p.z && (p.HV + kChainNormWarps - 1) / kChainNormWarps > 65535)  // the grid's y
    throw Error(ErrorKind::value, "fused_decode_step: too many rows for one launch");
}

// The chain on `stream`: no allocation, no host synchronization (graph-capturable); `pdl` on
// every launch, as the unfused chain's ops take it. The caller has checked the workspace's size.
void run_fused_chain(const FusedStepProblem& p, cudaStream_t stream) {
  check_chain_norm_grid(p);

  // 1. the conv update into the workspace
  run_chain_conv(p, stream);

  // 2. the packed decode on the workspace: packed_decode.cpp's problem over a contiguous
  // [B, conv_dim] mixed_qkv
  const detail::PackedQkv in =
      detail::packed_qkv(p.workspace, p.x_dtype, p.conv_dim(), p.H, p.K, p.V);
  detail::RecurrentProblem r;
  r.N = p.B;
  r.H = p.H;
  r.HV = p.HV;
  r.K = p.K;
  r.V = p.V;
  r.T = 1;
  r.q = in.q;
  r.k = in.k;
  r.v = in.v;
  r.g = p.a;
  r.beta = p.b;
  r.out = p.out;
  r.gate = p.gate;
  r.beta_is_logit = true;
  r.round_beta = p.round_beta;
  r.l2norm = p.l2norm;
  r.scale = p.scale;
  r.state = p.state;
  r.indices = p.indices;
  r.index_dtype = p.index_dtype;
  r.index_stride = p.index_stride;
  r.update_state = true;
  r.check_indices = false;
  r.pdl = p.pdl;
  r.device = p.device;
  run_recurrent(r, stream);

  // 3. the gated RMSNorm in place on out
  run_chain_norm(p, stream);
}

// replayssm_decode.cpp's problem for the ReplaySSM chain's decode: the fused step's
// (fused_replay_problem) on the workspace as a contiguous [B, conv_dim] mixed_qkv, bad rows
// recorded as the fused step's, the indices checked by the entry point after the chain.
detail::ReplayProblem chain_replay_problem(const FusedStepProblem& p) {
  detail::ReplayProblem r = detail::fused_replay_problem(p, p.workspace, p.x_dtype);
  r.check_indices = false;
  r.pdl = p.pdl;
  r.err_op = detail::kErrOpFusedStep;
  return r;
}

// The ReplaySSM chain on `stream`, as run_fused_chain. The decode's launch limits are checked
// before the conv's launch, so a call it rejects has written nothing.
void run_fused_replay_chain(const FusedStepProblem& p, cudaStream_t stream) {
  const detail::ReplayProblem r = chain_replay_problem(p);
  check_replayssm_decode_launch(r);
  check_chain_norm_grid(p);
  run_chain_conv(p, stream);        // 1. the conv update into the workspace
  run_replayssm_decode(r, stream);  // 2. the ReplaySSM decode on it, into out
  run_chain_norm(p, stream);        // 3. the gated RMSNorm in place on out
}

}  // namespace
}  // namespace deltastate::cuda_backend
