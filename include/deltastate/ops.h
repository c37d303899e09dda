// deltastate: the decode ops of gated delta-rule linear attention (GDN and KDA).
//
// Every op validates all of its arguments before it touches memory (a rejected call changes no
// caller memory), then runs on the device its tensors live on (CPU or CUDA). State pools are
// `[slots, HV, V, K]` with K contiguous, inner strides (V*K, K, 1) and any slot stride; they are
// updated in place. One padding rule everywhere: a state index < 0 marks a padded row, whose
// output is zeroed and whose state is never read or written. Index tensors are 1-D with any
// element stride (SGLang passes strided views of a wider table).
//
// Rules shared by every op:
//   scale   unset: K^-0.5; otherwise it must be finite and > 0.
//   beta    kept in fp32 after the sigmoid (as SGLang's kernels); `round_beta_to_input` rounds it
//           to the beta input's dtype first (the rounding SGLang's ReplaySSM used to apply).
// Error messages may mark dtype names for bindings (Error::marked()); what() is plain text.
//
// Math (fp32 throughout, results rounded on store), per token and value head:
//   q, k <- q/sqrt(sum q^2 + 1e-6), k/sqrt(sum k^2 + 1e-6) (when use_qk_l2norm); q <- q*scale
//   S <- S*alpha;  u = beta*(v - S k);  S <- S + u k^T;  o = S q
// with alpha = exp(g), and g either given (log space) or computed from raw `a`:
//   standard gate: g = -exp(A_log) * softplus(a + dt_bias)          (softplus threshold 20)
//   safe gate:     g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))
// GDN has one g per value head; KDA has a K-vector per value head.
//
// The CPU backend spreads (sequence, value head) pairs (decode: and blocks of state rows) over a
// thread pool of DELTASTATE_NUM_THREADS threads (default: the hardware concurrency), read when the
// first CPU op runs. Its vector kernels (AVX-512, AVX2 or portable, chosen from the CPU;
// DELTASTATE_CPU_ISA forces one) give the same bits for any thread count, batch composition and
// ISA (docs/CPU.md).
#pragma once

#include <optional>

#include "deltastate/error.h"
#include "deltastate/stream.h"
#include "deltastate/tensor.h"

namespace deltastate {

// ---------------------------------------------------------------------------------------------
// The storage format of a state an op reads and writes (docs/STATE_FORMATS.md). Every op runs its
// math in fp32: it loads the state (dequantized: code * the row's scale), computes, and stores it
// rounded to the state's dtype, a quantized state with a fresh scale per (slot, head, V row).
//   scales    float8_e4m3fn / int8 states only, where they are required: the fp32 scales
//             [slots, HV, V] of the state's rows, inner strides (V, 1), any slot stride
//             (StatePool::layer_scales), rewritten with the state. Unused slots are untouched.
//   rounding  format_default: stochastic for float8_e4m3fn, nearest otherwise.
//   step      stochastic rounding: int64 [1] on the state's device (StatePool::rounding_step):
//             the step of the key (seed, slot, layer, step) of the element's random bits; the op
//             adds 1 to it once per call, in stream order (CUDA-graph replay advances it);
//             ReplaySSM verify once per call that serves folding rows (ReplayVerifyArgs).
// Today: the CPU backend runs quantized states in packed decode, the recurrent op (a V-first pool
// updated in place), the fused decode step, ReplaySSM decode (the checkpoint), ReplaySSM verify
// (the checkpoint), the chunked prefill (a pool), speculative verify (float or quantized scratch;
// a float source_state) and its state commit. The CUDA backend runs packed decode and the
// recurrent op (a generic kernel, src/cuda/recurrent/direct.cuh), verify (cache_ring and a float
// source_state included) and its state commit (generic kernels, src/cuda/verify/fmt.cuh),
// ReplaySSM decode's checkpoint (basic rings: replay_fmt_kernel, src/cuda/replayssm/decode.cuh;
// SGLang's ring modes: replay_modes_kernel<true>, src/cuda/replayssm/modes.cuh), ReplaySSM
// verify's checkpoint (its folds a launch of their own, src/cuda/replayssm/fold.cuh; the generic
// verify kernel's rows loaded dequantized, verify.cuh) and the chunked prefill (a pool; every
// prefill kernel's state I/O) on them, and rejects them in every other op (NotImplementedError).
// GPU tests: tests/gpu/test_state_format_gpu.cpp (they pass on an H100, but for ReplaySSM
// verify's and verify's source_state cases, GpuQuantizedReplayVerify and
// QuantizedVerifySourceStateMatchesCpu, which have not run on a GPU yet).
struct StateFormatArgs {
  std::optional<TensorView> scales;
  StateRounding rounding = StateRounding::format_default;
  std::optional<TensorView> step;
  int64_t seed = 0;
  int64_t layer = 0;
};

// ---------------------------------------------------------------------------------------------
// Packed decode (T = 1), GDN and KDA: q, k and v come packed in one `mixed_qkv` row.
//   mixed_qkv [B, 2*H*K + HV*V]  rows `[q(H*K) | k(H*K) | v(HV*V)]`, last-dim stride 1
//   a         GDN [B, HV]; KDA [B, HV*K]                raw gate logits
//   b         [B, HV]                                    raw beta logits (beta = sigmoid(b))
//   A_log     [HV];  dt_bias GDN [HV], KDA [HV*K]
//   state     [slots, HV, V, K] pool, updated in place
//   out       [B, 1, HV, V] contiguous
//   state_indices [B] int32/int64 (index < 0: padded row)
// H is inferred from the width of mixed_qkv, HV/V/K from the state pool.
struct PackedDecodeArgs {
  TensorView mixed_qkv, a, b, A_log, dt_bias;
  std::optional<double> scale;  // unset: K^-0.5
  TensorView state;
  StateFormatArgs state_format;  // quantized state: its scales; stochastic rounding (above)
  TensorView out;
  TensorView state_indices;
  bool use_qk_l2norm = true;
  std::optional<double> lower_bound;  // KDA only: selects the safe gate
  bool round_beta_to_input = false;   // round sigmoid(b) to b's dtype (see the top of this file)
  // Slot index checks. CPU tensors (default on): every index is checked before anything is
  // written; an index >= slots, or a live slot used by two rows, is a ValueError. CUDA tensors:
  // the kernels always check the range on the device (check_errors below): a row whose index is
  // >= slots (ReplaySSM: or whose write_pos is outside the ring) is skipped (its state, rings and
  // cursor untouched), its output is NaN, and it is recorded in the device's error record, with
  // no host synchronization. check_indices=true (default off) is the debug mode: the op then
  // synchronizes its stream after the launch and calls check_errors, so the bad call itself
  // raises (skipped while the stream is being captured into a CUDA graph: call check_errors after
  // the replay). Duplicate live slots are not checked on CUDA: a device-side check needs a sort of
  // the batch's indices (O(B log B) work) or a per-slot scratch table (O(slots) memory, cleared
  // each step) on every call.
  std::optional<bool> check_indices;
  Stream stream = nullptr;
  // Programmatic dependent launch (CUDA; ignored on the CPU): the kernel is launched with
  // cudaLaunchAttributeProgrammaticStreamSerialization, so its CTAs may be scheduled while the
  // stream's previous kernel is still running, which hides the launch latency between dependent
  // kernels (also inside CUDA graphs). The kernel reads and writes no global memory before the
  // previous grid has completed and its writes are visible (griddepcontrol.wait), so results are
  // the same as without it. With it, a launch that fills at most half of the GPU also lets the
  // next PDL-launched kernel on the stream be scheduled right away (larger ones let it in as
  // their CTAs exit). Measured on the H200 (docs/PERFORMANCE.md): it pays at small batches.
  bool pdl = false;
};
void gdn_packed_decode(const PackedDecodeArgs& args);
void kda_packed_decode(const PackedDecodeArgs& args);

// ---------------------------------------------------------------------------------------------
// Pooled varlen recurrent op (GDN and KDA); decode is the T = 1 case.
//   q, k [B, T, H, K];  v [B, T, HV, V];  out [B, T, HV, V]
//     or, with cu_seqlens [N+1] (int32/int64): B = 1 and sequence n is tokens [cu[n], cu[n+1]).
//   g     GDN [B, T, HV]; KDA [B, T, HV, K]: log-space decay, or the raw gate input `a` when
//         gate_in_kernel (then A_log [HV] and dt_bias GDN [HV] / KDA [HV*K] or [HV, K] are used).
//         The GDN entry also takes a per-K log decay [B, T, HV, K] without gate_in_kernel (FLA's
//         `gk`): GDN with a per-K decay is KDA's math.
//   A_log is required by the standard gate; the safe gate (lower_bound) without A_log uses the
//         factor 1: g = lower_bound * sigmoid(a + dt_bias) (FLA's KDA gate with A_log=None).
//   beta  [B, T, HV]: a probability, or a logit when beta_is_logit
//   state (optional) [slots, HV, V, K]: with state_indices [N] a pool indexed per sequence
//         (index < 0: padded), without them [N, HV, V, K] read per sequence. Absent: S starts at 0.
//   update_state: write each sequence's final state back into `state` (in place).
//   final_state (optional) [N, HV, V, K]: receives each sequence's final state (zeros for
//         padded sequences).
//   state_layout: k_first takes `state` and `final_state` as [.., HV, K, V] (FLA's default
//         layout, V contiguous) instead; the CPU backend runs it natively, the CUDA backend
//         rejects it (NotImplementedError naming `state_v_first`): a state is never transposed
//         or copied behind the caller's back.
// Vector dims (K of q/k/g, V of v/out) must have stride 1; all other strides are free.
enum class StateLayout : uint8_t { v_first, k_first };

struct RecurrentArgs {
  TensorView q, k, v, g, beta, out;
  std::optional<TensorView> A_log, dt_bias;
  bool gate_in_kernel = false;
  std::optional<double> lower_bound;  // safe gate (with gate_in_kernel)
  bool beta_is_logit = false;
  bool round_beta_to_input = false;  // as PackedDecodeArgs
  std::optional<double> scale;       // unset: K^-0.5
  std::optional<TensorView> state, state_indices, cu_seqlens, final_state;
  // `state`'s format (above): a quantized state needs a pool (state_indices) updated in place,
  // V-first, without final_state.
  StateFormatArgs state_format;
  bool update_state = true;
  StateLayout state_layout = StateLayout::v_first;
  // recurrent_kda: enforce FlashInfer's compiled stride contract on `state` (below).
  bool stride_contract = true;
  bool use_qk_l2norm = true;
  std::optional<bool> check_indices;  // as PackedDecodeArgs
  Stream stream = nullptr;
  bool pdl = false;  // as PackedDecodeArgs
};
void recurrent_gdn(const RecurrentArgs& args);
// KDA also enforces, with stride_contract, the compiled stride contract on its `state` (pooled
// or not): slot stride a multiple of 16 elements and base address 32-byte aligned, as FlashInfer's
// recurrent_kda does, with the texts of SGLang's wrapper around it. StatePool views and torch
// allocations meet it; plain numpy arrays are only 16-byte aligned.
void recurrent_kda(const RecurrentArgs& args);

// ---------------------------------------------------------------------------------------------
// ReplaySSM buffered decode (T = 1), GDN and KDA. Reads the checkpoint `state` every step, but
// writes it only on a flush; otherwise appends the record (d, k, g) at ring position write_pos.
//   mixed_qkv, b, A_log, scale, out: as packed decode (b: any row stride, last-dim stride 1).
//   a / dt_bias: GDN [B, HV] / [HV]; KDA [B, HV, K] or [B, HV*K] / [HV, K] or [HV*K].
//   state    [slots, HV, V, K] checkpoint pool (inner strides compact, any slot stride)
//   d_cache  [slots, HV, L, V];  k_cache [slots, H, L, K];  any float dtype each: a record is
//            stored rounded to its ring's dtype (d: the delta d = beta*(v - S k); k: the
//            normalized key). SGLang's Helion twin does the same; SGLang's Triton kernel rounds
//            the key to out's dtype whatever k_cache's dtype, which is this rule when k_cache has
//            out's dtype. A float32 k ring is exact (StatePool's default); a 16-bit one costs about
//            1e-3 relative error in the output of fp32 activations.
//   g_cache  [slots, HV, L] (GDN) or [slots, HV, L, K] (KDA), float32; rings contiguous.
//   state_indices [B] int32 (any stride), write_pos [B] int32; force_flush [B] int32 or absent.
// Beta is kept in fp32 unless round_beta_to_input (the rule of every op, top of this file): with
// equal options, an fp32 checkpoint and fp32 rings, ReplaySSM gives plain decode's results to
// fp32 rounding.
// A row flushes when write_pos == L-1 or force_flush != 0. With advance_write_pos the op also
// advances each live row's cursor (write_pos <- flushed ? 0 : write_pos + 1) on the device
// (padded rows keep theirs). The op advances the buffer it is given on every call: when several
// layers share one cursor per slot, set advance_write_pos on the step's last layer only, or give
// each layer its own cursor buffer.
struct ReplayDecodeArgs {
  TensorView mixed_qkv, a, b, A_log, dt_bias;
  std::optional<double> scale;  // unset: K^-0.5
  TensorView state, d_cache, k_cache, g_cache;
  // the checkpoint's format (above); the rings stay float. CUDA: the basic rings and SGLang's
  // ring modes alike.
  StateFormatArgs state_format;
  TensorView out;
  TensorView state_indices, write_pos;
  std::optional<TensorView> force_flush;
  bool is_kda = false;
  bool use_qk_l2norm = true;
  std::optional<double> lower_bound;
  bool round_beta_to_input = false;  // as PackedDecodeArgs (ignored with predecayed_k_cache)
  bool advance_write_pos = false;
  // SGLang's ring modes (docs/REPLAYSSM.md, "Ring modes"). circular_replay: record j of row n
  // lies at ring position (cache_base[n] + j) mod L (cache_base [B] int32, contiguous; each live
  // row's value in [0, L-1]); a natural flush (write_pos == L-1, not forced, L > 1) stores the
  // state before the token as the checkpoint and still appends the token's record (a history
  // checkpoint); a forced flush, or any flush at L = 1, folds the token in and appends nothing.
  // The caller then advances: forced -> (base 0, wp 0); natural -> (base (base+wp) mod L, wp 1);
  // otherwise wp + 1 (advance_write_pos applies that rule to write_pos and cache_base on the
  // device). prefix_gate_cache (KDA; SGLang's GDN path ignores it): the g ring holds
  // the cumulative gate of the records since the checkpoint. predecayed_k_cache (KDA, circular
  // and prefix gates, H == HV, float32 checkpoint, a finite lower_bound < 0 with
  // (L-1)|lower_bound| <= 80, 2 <= L <= 16): the k ring holds k / exp(G_j), beta stays fp32.
  // CUDA: a generic kernel (src/cuda/replayssm/modes.cuh).
  std::optional<TensorView> cache_base;
  bool circular_replay = false;
  bool prefix_gate_cache = false;
  bool predecayed_k_cache = false;
  // Validate as SGLang's Helion KDA twin (helion_fused_recurrent_kda_replayssm_decode) does: KDA
  // only, its argument forms and its error texts; otherwise SGLang's Triton function's texts.
  bool helion = false;
  std::optional<bool> check_indices;  // as PackedDecodeArgs
  Stream stream = nullptr;
  bool pdl = false;  // as PackedDecodeArgs
};
void replayssm_decode(const ReplayDecodeArgs& args);

// Reports bad rows the CUDA kernels skipped (see PackedDecodeArgs::check_indices): synchronizes
// `stream`, reads the error record of its device, clears it and throws Error(ErrorKind::value)
// naming the op, the row, the bad value and the pool size (or ring length) of the first bad row
// since the last check, e.g. "recurrent: `ssm_state_indices`[3]=4100 is out of range for a state
// pool of 4096 slots (valid: 0..4095; < 0 marks a padded row); the row was skipped (state, rings
// and cursor untouched) and its output is NaN". The record is per device: it holds the first
// bad row of any stream's ops on that device. A no-op without CUDA or before any CUDA op ran on
// the stream's device. Not the hot path (it synchronizes): call it where the caller already
// waits (after a step, in tests) or use check_indices=true while debugging.
void check_errors(Stream stream = nullptr);

// Whether a CUDA device can run this build's CUDA backend: built with CUDA and
// cudaGetDeviceCount reports at least one device (never throws; false on a machine without a
// GPU or driver, and in a CPU-only build).
bool cuda_available();
// Whether this build contains the CUDA backend (compiled with nvcc), whether or not a device is
// present.
bool cuda_built();

// ---------------------------------------------------------------------------------------------
// Chunked prefill, GDN and KDA: the recurrence above over whole prompts, 64 tokens at a time
// (FLA's chunk_gated_delta_rule / chunk_kda, FlashInfer's chunk_gated_delta_rule with its state
// checkpoints), straight from and into the slot pool. Same math, argument names and defaults as
// RecurrentArgs where the two ops share an argument.
//   q, k [B, T, H, K];  v [B, T, HV, V];  out [B, T, HV, V] (GVA: HV a multiple of H)
//     or, with cu_seqlens [N+1] (int32/int64): B = 1 and sequence n is tokens [cu[n], cu[n+1]).
//   g     GDN [B, T, HV]; KDA [B, T, HV, K]: log-space decay, or the raw gate input `a` when
//         gate_in_kernel (then A_log [HV] and dt_bias GDN [HV] / KDA [HV*K] or [HV, K] are used;
//         lower_bound selects the safe gate)
//   beta  [B, T, HV]: a probability, or a logit when beta_is_logit
// State (absent: every sequence starts from S = 0):
//   initial_state [slots, HV, V, K] with initial_state_indices [N]: a pool (any slot stride,
//         compact inner dims). Index < 0 marks a padded sequence: output rows zero, nothing read
//         or written, checkpoints skipped. A live sequence's final state goes to
//         output_state_indices[n] when given (< 0: not stored), else back in place.
//   initial_state [N, HV, V, K] without indices: dense and read only (FLA's initial_state in its
//         state_v_first layout, FlashInfer's layout).
//   has_initial_state [N] int32/int64 (optional): 0 starts that sequence from S = 0 without
//         reading its state; its final state is still stored (SGLang's extend contract).
//   final_state [N, HV, V, K] (optional): every sequence's final state (FLA's output_final_state;
//         zeros for padded sequences).
// Slots a call writes (final states and checkpoint slots of live sequences) must be distinct,
// and none may be a live sequence's initial slot except that sequence's own final state.
// Checkpoints (prefix caching), when checkpoint_every_n_tokens > 0 (a multiple of 64): a
// sequence of L tokens has L / every of them; its checkpoint j is the state after (j+1)*every
// tokens, at position checkpoint_cu_starts[n] + j, where checkpoint_cu_starts [N+1] (int32/int64)
// starts at 0 and counts them per sequence (FlashInfer's convention). They go either into
//   state_checkpoints [>= total, HV, V, K] (dense, contiguous), or
//   checkpoint_slot_indices [>= total]: one slot of the initial_state pool per checkpoint
//         (< 0: that checkpoint is not stored; SGLang's track slots).
// Every state is carried in fp32 and rounded on store to its destination's dtype, as decode
// stores a state; a padded sequence's dense checkpoint rows are zeroed.
// workspace: scratch of at least chunk_prefill_workspace_bytes(args) bytes (numel * element
// size, any dtype), contiguous and 16-byte aligned, on the tensors' device; the op allocates
// nothing. Vector dims (K of q/k/g, V of v/out) must have stride 1; other strides are free.
struct ChunkPrefillArgs {
  TensorView q, k, v, g, beta, out;
  bool is_kda = false;  // KDA (g a K-vector per value head) or GDN
  std::optional<TensorView> A_log, dt_bias;
  bool gate_in_kernel = false;        // FLA's use_gate_in_kernel
  std::optional<double> lower_bound;  // safe gate (with gate_in_kernel)
  bool beta_is_logit = false;         // FLA's use_beta_sigmoid_in_kernel
  std::optional<double> scale;        // default K^-0.5; must be positive
  bool use_qk_l2norm = true;          // FLA's use_qk_l2norm_in_kernel
  std::optional<TensorView> cu_seqlens;
  std::optional<TensorView> initial_state, initial_state_indices, has_initial_state,
      output_state_indices, final_state;
  // initial_state's format (above): a quantized pool (with initial_state_indices) is read
  // dequantized and its final states and checkpoint slots stored requantized; dense final states
  // and dense checkpoints keep their float dtypes.
  StateFormatArgs state_format;
  int64_t checkpoint_every_n_tokens = 0;
  std::optional<TensorView> checkpoint_cu_starts, state_checkpoints, checkpoint_slot_indices;
  std::optional<TensorView> workspace;
  // Slot index checks, as PackedDecodeArgs; cu_seqlens and the checkpoint counts of CPU tensors
  // are always checked.
  std::optional<bool> check_indices;
  Stream stream = nullptr;
  bool pdl = false;  // as PackedDecodeArgs
};
void chunk_prefill(const ChunkPrefillArgs& args);
// The workspace chunk_prefill needs for these arguments. Reads only the shapes, the device and
// the gate kind (never tensor data), so it can run before the inputs hold data. CPU: one scratch
// block per thread of the CPU thread pool (the fp32 state and one chunk's q, k, v, gates, A, T, w,
// u, v' and outputs), num_threads * per-thread bytes, a function of K, V, the gate kind and
// DELTASTATE_NUM_THREADS only. CUDA: where the split kernels run (K = V = 128, and 64 where the
// tensor-core kernels are built for it, and N * HV below half the device's SM count), their
// blocks, about (B * T / 64 + N) * HV * 7 K * V bytes for GDN (W, U, v', chunk-start states) and
// 9.5 K * V for KDA (also the decayed q, k and P); else 0 (the kernels keep their scratch on
// chip) up to K * V = 16384, beyond that N * HV * K * V * 4 (the fallback kernel's fp32 states).
int64_t chunk_prefill_workspace_bytes(const ChunkPrefillArgs& args);

// ---------------------------------------------------------------------------------------------
// The causal depthwise conv update of decode, causal-conv1d's `causal_conv1d_update` (the
// package's signature and semantics, csrc/causal_conv1d.cpp and causal_conv1d_update_ref):
//   x       [B, dim] or [B, dim, seqlen], any strides
//   conv_state [batch, dim, state_len] (state_len >= width - 1), any strides (SGLang's
//           [.., dim, W-1] and vLLM's dim-contiguous layout alike), its dtype x's; updated in
//           place: the window becomes the last state_len values of [window, x], or, with
//           cache_seqlens [B] int32, a circular buffer written from cache_seqlens[b] % state_len.
//   weight  [dim, width], width 2..4; bias [dim] (weight's dtype) or absent; silu: SiLU after.
//   conv_state_indices [B] int32 (contiguous) or absent (row b uses entry b): < 0 is a padded
//           row (output zeros, window untouched); CPU: an index >= batch is a ValueError before
//           anything is written; CUDA: the row is skipped, its output NaN, and recorded for
//           check_errors (as PackedDecodeArgs::check_indices).
//   out     x's shape and dtype (the op's result; the Python wrapper allocates it).
// The conv accumulates in fp32 (bias, then the taps oldest first, fused multiply-adds) and
// rounds once to out's dtype, as causal-conv1d's CUDA kernel does.
//
// Speculative verify: SGLang's causal_conv1d_update options (same names and semantics; x then
// holds each row's seqlen = T draft tokens; none combines with cache_seqlens):
//   intermediate_conv_window [N_scr, >= T, dim, width - 1] (conv_state's dtype, any strides:
//           SGLang's deduplicated overlapping view too) with intermediate_state_indices [B]
//           (absent: row b; < 0: none): the window after each draft token t is stored at
//           [row, t], for the commit (update_conv_state_after_verify) to copy the accepted one;
//   num_accept_tokens [B] (vLLM's and SGLang's in-place scheme): conv_state holds width - 2
//           older entries and the previous step's drafts (state_len >= width - 2 + T); row b's
//           window is its entries a-1 .. a+width-3 for a = num_accept_tokens[b] in [1,
//           state_len - width + 2], and the update writes [entries a .. a+width-3, x] from entry 0;
//   retrieve_next_token, retrieve_next_sibling [B, >= T] (an EAGLE tree: each token's first
//           child and next sibling, -1: none; both later tokens) and retrieve_parent_token
//           [B, >= T] (written: each token's parent, 0 for token 0): token t convolves its path
//           token 0, ..., parent(t), t after the window, and its stored window is that path's.
//   Without num_accept_tokens the window rolls by the T tokens as above (the commit overwrites
//   it). T <= 64 with a tree. Bad entries (num_accept_tokens out of range, a row >= N_scr, a
//   tree table naming an earlier token or one past T) as a bad conv_state_indices entry: a
//   ValueError on CPU tensors, a skipped and recorded row on CUDA.
struct CausalConv1dUpdateArgs {
  TensorView x, conv_state, weight;
  std::optional<TensorView> bias;
  bool silu = false;
  std::optional<TensorView> cache_seqlens, conv_state_indices;
  std::optional<TensorView> num_accept_tokens, intermediate_conv_window, intermediate_state_indices;
  std::optional<TensorView> retrieve_next_token, retrieve_next_sibling, retrieve_parent_token;
  TensorView out;
  std::optional<bool> check_indices;
  Stream stream = nullptr;
  bool pdl = false;
};
void causal_conv1d_update(const CausalConv1dUpdateArgs& args);

// ---------------------------------------------------------------------------------------------
// One decode step of a GDN (Qwen3-Next) or KDA (Kimi-Linear) layer's recurrent half in one
// launch: the conv update of the projected row, q/k/v split, gates and beta, the q/k L2 norm,
// the delta rule in place, and optionally the gated RMSNorm. The same math as the unfused chain
// causal_conv1d_update (SiLU) -> packed decode -> Qwen3NextRMSNormGated, every intermediate
// rounded where the chain stores it (the conv output to mixed_qkv's dtype, the attention output
// to out's dtype).
//   mixed_qkv   [B, conv_dim], conv_dim = 2*H*K + HV*V, rows [q | k | v] before the conv
//   conv_weight [conv_dim, width] (width 2..4), conv_bias [conv_dim] or absent; conv_silu
//   conv_state  [slots, conv_dim, state_len] (any strides, state_len >= width - 1), or with
//               conv_state_k / conv_state_v the q part's window [slots, H*K, state_len] beside
//               k's [slots, H*K, .] and v's [slots, HV*V, .] (Kimi-Linear's three convs); the
//               conv weight stays packed [conv_dim, width]. Updated in place (shifted windows).
//   a, b, A_log, dt_bias, scale, use_qk_l2norm, lower_bound, round_beta_to_input: as packed
//               decode (KDA: a [B, HV*K]).
//   state       [slots, HV, V, K] pool (compact inner strides, any slot stride), in place
//   state_indices [B] int32/int64: one slot for the windows and the state (< 0: padded row:
//               nothing read or written, output zeros); the windows and the state have the same
//               number of slots. Bad indices as PackedDecodeArgs::check_indices.
//   norm_weight [V] with z [B, HV, V] (V contiguous): out = Qwen3NextRMSNormGated(o, z) per value
//               head (norm_eps); both absent: out = o.
//   out         [B, HV, V] contiguous, the activation dtype
// ReplaySSM (d_cache given; then k_cache, g_cache and write_pos are required too, and
// state_indices must be int32): `state` is the checkpoint pool and the delta rule is
// replayssm_decode's step on the conv output: the chain causal_conv1d_update (SiLU) ->
// replayssm_decode -> Qwen3NextRMSNormGated. The rings, cursors and flags have
// ReplayDecodeArgs' names, shapes, dtypes and semantics:
//   d_cache [slots, HV, L, V], k_cache [slots, H, L, K] (any float dtype each), g_cache
//               [slots, HV, L] (GDN) or [slots, HV, L, K] (KDA) float32; rings contiguous, with
//               the state pool's number of slots
//   write_pos   [B] int32; force_flush [B] int32 or absent; a row flushes (writes its
//               checkpoint) when write_pos == L-1 or force_flush != 0, otherwise appends the
//               record (d, k, g) at write_pos; advance_write_pos advances each live row's
//               cursor (flushed ? 0 : write_pos + 1) on the device (padded rows keep theirs).
//   CPU: a live row's write_pos outside [0, L-1] is a ValueError before anything is written;
//   CUDA: such a row is skipped (windows, checkpoint, rings and cursor untouched), its output
//   NaN, and recorded for check_errors, as a bad slot index. CUDA: L <= 4096 and the ring within
//   the GPU's shared memory per block of the plan's kernel (not_implemented otherwise).
//   workspace   optional scratch on the state's device: a contiguous 1-D tensor of at least
//               fused_decode_step_workspace_bytes(args) bytes (numel * element size, any dtype),
//               16-byte aligned; fewer is an error naming it. The op allocates nothing.
// CUDA: K in {64, 128}, (HV/H) * V at most 256 rows per key head. Three plans, one result (every
// intermediate rounded where the unfused chain stores it; docs/LAYER_STEP.md): small batches
// whose one-CTA-per-(row, key head) grid fills at most half of the SMs run one cluster kernel;
// the others, given a workspace, run the chain plan: the conv kernel into the workspace, the
// packed decode kernels, and the gated-norm kernel, on `stream` in sequence (no allocation, no
// host synchronization, `pdl` on each launch); without a workspace one CTA per (row, key head),
// one launch, slower there. ReplaySSM calls given a workspace (or under
// DELTASTATE_CUDA_FUSED=chain) run the ReplaySSM chain: the conv kernel into the workspace,
// replayssm_decode's kernels, the gated-norm kernel; without one (or under =cta / =cluster) one
// launch, one CTA per (row, key head); the same result (docs/LAYER_STEP.md). A quantized or
// stochastically rounded pool (`state_format` as packed decode's; in ReplaySSM mode the
// checkpoint, loaded and stored on a flush as replayssm_decode does) runs the chain plan (in
// ReplaySSM mode the ReplaySSM chain) on CUDA whatever the batch, so it needs `workspace` there
// (NotImplementedError without one); the rounding step counter advances once per call, as on the
// CPU.
struct FusedDecodeStepArgs {
  TensorView mixed_qkv, conv_weight;
  std::optional<TensorView> conv_bias;
  bool conv_silu = true;
  TensorView conv_state;
  std::optional<TensorView> conv_state_k, conv_state_v;
  TensorView a, b, A_log, dt_bias;
  std::optional<double> scale;
  TensorView state, state_indices;
  StateFormatArgs state_format;  // a quantized state, stochastic rounding (both modes)
  std::optional<TensorView> norm_weight, z;
  double norm_eps = 1e-6;
  TensorView out;
  bool use_qk_l2norm = true;
  std::optional<double> lower_bound;
  bool round_beta_to_input = false;
  // ReplaySSM (see above); all absent: the plain delta rule in place on `state`.
  std::optional<TensorView> d_cache, k_cache, g_cache, write_pos, force_flush;
  bool advance_write_pos = false;
  // SGLang's ring modes, as ReplayDecodeArgs. CUDA: they run the ReplaySSM chain (conv,
  // replayssm_decode's ring-modes kernel, norm), which needs `workspace`.
  std::optional<TensorView> cache_base;
  bool circular_replay = false, prefix_gate_cache = false, predecayed_k_cache = false;
  std::optional<bool> check_indices;
  Stream stream = nullptr;
  bool pdl = false;
  std::optional<TensorView> workspace;
};
void gdn_fused_decode_step(const FusedDecodeStepArgs& args);
void kda_fused_decode_step(const FusedDecodeStepArgs& args);
// The workspace the fused step's plan needs for these arguments on this device. Reads only the
// shapes of mixed_qkv and state, their dtypes, state_format.rounding and the device (never tensor
// data), so it can run before the inputs hold data; in ReplaySSM mode only whether d_cache is
// given. CPU: 0. CUDA: 0 where the cluster kernel runs (and under DELTASTATE_CUDA_FUSED=cta), and
// for ReplaySSM calls unless DELTASTATE_CUDA_FUSED=chain; elsewhere (a quantized or
// stochastically rounded pool always, in either mode) the chain plan's conv output, B * conv_dim
// elements of mixed_qkv's dtype rounded up to 16 bytes.
int64_t fused_decode_step_workspace_bytes(const FusedDecodeStepArgs& args);

// ---------------------------------------------------------------------------------------------
// Speculative verify (GDN and KDA): T draft tokens per sequence through the recurrent math, each
// token's state kept where the engine wants it, so that any accepted prefix can be restored.
// One op covers the engines' three conventions:
//   SGLang   intermediate_states [N_scr, T_alloc, HV, V, K] with intermediate_state_indices [N]
//            (the scratch row of each sequence), update_state = false (disable_state_update);
//            parent_tokens [N, T] (retrieve_parent_token) makes it an EAGLE tree: token t > 0
//            starts from the state after token parent[t] (< 0: from the initial state), read
//            back from its scratch row; a sequence without a scratch row runs as a chain. A
//            parent < 0 re-reads the start slot: combined with vLLM's per-token slots (below)
//            whose start slot is also a slot the call writes (num_accepted_tokens[n] - 1 <
//            T), it reads what the call stored there, not the initial state.
//   FlashInfer  intermediate_states [>= B, T_alloc, HV, V, K] indexed by batch row (no
//            intermediate_state_indices); or token_state_indices [B, T] (its ssm_state_indices):
//            the state after token t goes to pool slot token_state_indices[n, t] and the final
//            write-back is skipped; output_state_indices [B] sends the final state elsewhere.
//   vLLM     token_state_indices [N, >= T] (spec_state_indices) with num_accepted_tokens [N]:
//            the initial state is read from slot token_state_indices[n, num_accepted[n] - 1],
//            the state after token t is written to token_state_indices[n, t] (no commit copy).
// Inputs and options as RecurrentArgs (q, k [B, T, H, K]; v, out [B, T, HV, V]; g, beta
// [B, T, HV(, K)]; cu_seqlens for varlen; the gate in log space or raw with A_log/dt_bias; beta
// as logit or probability), with `is_kda` choosing the gate's shape. state is the pool
// [slots, HV, V, K] (compact inner strides, any slot stride); state_indices [N] the slot each
// sequence starts from (< 0: padded: output rows zero, nothing read or written, no intermediate
// or per-token state stored), unless num_accepted_tokens selects it from token_state_indices.
// intermediate_states has the state's dtype, any strides in its first two dims and compact inner
// dims (each state rounded on store, as the pool's). Per-token slot entries < 0 are skipped.
// source_state [N0, HV, V, K] (FlashInfer's initial_state_source): a read-only pool the start
// states come from instead (the state's dtype, HV, V, K; compact inner dims, any slot stride;
// with a quantized or stochastically rounded `state` the caller's float pool in any float dtype,
// read as it is, while every state the call stores goes to `state` through its format):
// sequence n starts from its row source_state_indices[n] (< 0: padded as above; FlashInfer reads
// row 0 instead), and num_accepted_tokens is not given. The pool `state` is then only written:
// the per-token slots, or the final state at output_state_indices[n], else in place at
// state_indices[n] (absent: slot n; < 0: not stored). source_state is never written; it must not
// overlap the slots the call writes (not checked).
// A bad index (a slot >= slots, a scratch row >= N_scr, a sequence longer than T_alloc or than
// a table's columns, num_accepted outside [1, columns], a parent >= t): on CPU tensors a
// ValueError before anything is written; on CUDA the row is skipped as padded, its outputs NaN,
// and it is recorded for check_errors (ops.h below).
struct VerifyArgs {
  TensorView q, k, v, g, beta, out;
  bool is_kda = false;
  std::optional<TensorView> A_log, dt_bias;
  bool gate_in_kernel = true;         // g is the raw gate input a (A_log required)
  std::optional<double> lower_bound;  // safe gate (KDA)
  bool beta_is_logit = true;
  bool round_beta_to_input = false;  // as PackedDecodeArgs
  std::optional<double> scale;       // unset: K^-0.5
  bool use_qk_l2norm = true;
  std::optional<TensorView> cu_seqlens;
  TensorView state;
  // state's format (above). A quantized pool takes intermediate_states in any float dtype (the
  // caller's scratch) or quantized (float8_e4m3fn / int8, either: intermediate_state_scales
  // below), and source_state as a float pool of any float dtype (cache_ring records raw v / k /
  // g / beta as with a float pool, on both backends).
  StateFormatArgs state_format;
  std::optional<TensorView> state_indices;         // [N]; absent: sequence n reads slot n
  std::optional<TensorView> output_state_indices;  // [N] final state's slot (< 0: not stored)
  bool update_state = true;  // store the final state (output_state_indices, else in place)
  std::optional<TensorView> intermediate_states;         // [N_scr, T_alloc, HV, V, K]
  std::optional<TensorView> intermediate_state_indices;  // [N] scratch row (< 0: none)
  // A quantized intermediate_states (a quantized pool only; a float pool: NotImplementedError):
  // its fp32 scales [N_scr, T_alloc, HV, V] (inner strides (V, 1), any strides in the first two
  // dims), one per state row of each entry, rewritten with it. Each entry is stored as the pool
  // stores a slot (fresh scale amax / qmax per row, the pool's rounding; the stochastic key
  // (seed, ~(row * T_alloc + step), layer, step): core/state_format.h scratch_key_slot), and a
  // tree token reloads its parent's entry dequantized. docs/STATE_FORMATS.md.
  std::optional<TensorView> intermediate_state_scales;
  std::optional<TensorView> parent_tokens;         // [N, >= T] int32/int64
  std::optional<TensorView> token_state_indices;   // [N, >= T] pool slot per token
  std::optional<TensorView> num_accepted_tokens;   // [N] (with token_state_indices)
  std::optional<TensorView> source_state;          // [N0, HV, V, K] read-only start pool
  std::optional<TensorView> source_state_indices;  // [N] its row per sequence (< 0: pad)
  // SGLang's cache_ring (fold-every-commit, replayssm_fold_commit): the raw inputs of each
  // sequence's steps t < L at its slot (state_indices; a slot < 0 records nothing): ring_v [S,
  // HV, L, V] the raw v, ring_k [S, H, L, K] the raw (pre-norm) k (floating, any dtype: rounded
  // to it), ring_g [S, HV, L] (GDN) / [S, HV, L, K] (KDA) the fp32 log decay, ring_beta [S, HV,
  // L] the fp32 beta, each contiguous, all four or none. CUDA: the generic verify kernel runs
  // (not the vector kernels).
  std::optional<TensorView> ring_v, ring_k, ring_g, ring_beta;
  // A padded sequence's (start row < 0) output rows are left as the caller wrote them
  // (FlashInfer's gated_delta_rule_mtp); off: zeroed. A bad index's rows are NaN either way.
  bool keep_padded_outputs = false;
  std::optional<bool> check_indices;  // as PackedDecodeArgs
  Stream stream = nullptr;
  bool pdl = false;  // as PackedDecodeArgs
};
void verify(const VerifyArgs& args);

// The commit after a verify (update_state_after_verify): for each request b with accepted
// length a = accepted[b] > 0, copy intermediate_states[:, row_b, a - 1] into state[:, slot_b]
// for every layer in one launch, where slot_b = state_indices[b] (< 0: skipped) and row_b =
// intermediate_state_indices[b] (absent: b; < 0: skipped). With accepted_is_step the entries
// are SGLang's last accepted step (a - 1; < 0: nothing), as update_mamba_state_after_mtp_verify
// passes them (a tree's last accepted node).
//   state               [layers, slots, HV, V, K] or one layer [slots, HV, V, K]: any layer and
//                       slot strides (envelope pools), compact inner dims
//   intermediate_states [layers, N_scr, T_alloc, HV, V, K] or [N_scr, T_alloc, HV, V, K]: any
//                       strides in the leading dims, compact inner dims, state's dtype
//   state_indices, accepted [B] int32/int64 (any stride); intermediate_state_indices [B]
// Rejected drafts leave the pool bit-unchanged; no host synchronization (graph-safe). A bad
// entry (slot >= slots, row >= N_scr, step >= T_alloc) is a ValueError on CPU tensors and a
// skipped, recorded row on CUDA (check_errors).
struct CommitArgs {
  TensorView state, intermediate_states, state_indices, accepted;
  // A quantized `state` (with state_format.scales [layers, slots, HV, V] or [slots, HV, V],
  // StatePool::scales / layer_scales) takes a float intermediate_states (any float dtype): each
  // accepted state is requantized into its slot with fresh scales, layer l's stochastic bits keyed
  // by (seed, slot, rounding_layer + l, step[l]) with `step` int64 [layers] (or [1] for one
  // layer; StatePool::rounding_steps), each advanced once per call (CUDA: K <= 256). A float
  // state is copied. A quantized intermediate_states (verify's quantized scratch) comes with
  // intermediate_state_scales [layers, N_scr, T_alloc, HV, V] (or [N_scr, T_alloc, HV, V]) fp32:
  // of the state's dtype, the entry's codes and scales are copied (the pool's rule applied once
  // to the accepted state, as verify rounded it); of the other 1-byte dtype, the entry is
  // dequantized and requantized as a float scratch's. Not with a float state
  // (NotImplementedError).
  StateFormatArgs state_format;
  std::optional<TensorView> intermediate_state_scales;
  std::optional<TensorView> intermediate_state_indices;
  bool accepted_is_step = false;
  std::optional<bool> check_indices;  // as PackedDecodeArgs
  Stream stream = nullptr;
  bool pdl = false;
};
void update_state_after_verify(const CommitArgs& args);

// The commit of the conv windows after a verify (update_conv_state_after_verify): the windows'
// twin of update_state_after_verify, with CommitArgs' index conventions (accepted a > 0 copies
// step a - 1; with accepted_is_step the entry is the step, < 0: nothing; slot < 0 or row < 0:
// skipped; a bad entry is a ValueError on CPU tensors before anything is written, and a skipped,
// recorded row on CUDA). For each such request b, intermediate_conv_window[:, row_b, step_b] is
// copied into conv_state[:, slot_b], every layer in one launch.
//   conv_state [layers, slots, dim, W1] or [slots, dim, W1], any strides: SGLang's
//              window-contiguous windows, vLLM's dim-contiguous ones, envelope slot strides.
//              Written in place; its windows must not overlap each other (not checked).
//   intermediate_conv_window [layers, N_scr, T_alloc, dim, W1] or [N_scr, T_alloc, dim, W1],
//              conv_state's dtype, any strides, overlapping views included (it is only read):
//              SGLang's deduplicated view, one [dim, T_alloc + W1 - 1] buffer per row whose step
//              t is the window at column t (step stride = the window's column stride).
//   state_indices, accepted [B] int32/int64 (any stride); intermediate_state_indices [B]
// A window is copied as one contiguous range where both windows are one dense block with the
// same strides (SGLang's pools and dense scratch), element by element otherwise.
struct ConvCommitArgs {
  TensorView conv_state, intermediate_conv_window, state_indices, accepted;
  std::optional<TensorView> intermediate_state_indices;
  bool accepted_is_step = false;
  std::optional<bool> check_indices;  // as PackedDecodeArgs
  Stream stream = nullptr;
  bool pdl = false;
};
void update_conv_state_after_verify(const ConvCommitArgs& args);

// ---------------------------------------------------------------------------------------------
// ReplaySSM speculative verify (linear chains; SGLang's gdn_replayssm_spec_decode scheme): the
// T draft tokens of each sequence are verified from the checkpoint and the ring alone, no state
// is written, and the commit is a cursor move.
//   q, k, v, g, beta, out, the gate and beta options, scale, use_qk_l2norm, cu_seqlens: as
//         VerifyArgs (q, k [B, T, H, K]; v, out [B, T, HV, V]; or B = 1 with cu_seqlens [N+1]).
//   state [slots, HV, V, K] the checkpoint pool (compact inner dims, any slot stride), written
//         only by a fold; state_indices [N] int32/int64: the slot of sequence n (an entry
//         <= null_block_id marks a padded sequence: output rows zero, nothing read or written).
//   d_cache [slots, HV, L, V], k_cache [slots, H, L, K] (floating), g_cache [slots, HV, L]
//         (GDN) or [slots, HV, L, K] (KDA) fp32: the rings of replayssm_decode, circular:
//         logical record c of slot s lies at position (cache_base[s] + c) % L.
//   write_pos, cache_base, is_flush [slots] int32, keyed by slot: write_pos[s] committed records
//         since the checkpoint; is_flush[s] != 0 folds them first (set by replayssm_commit).
// Per live sequence with m = write_pos[s]: the state after the m records is rebuilt from the
// checkpoint by replaying them in the recurrent op's order (per record s *= exp(g); s += d k^T,
// the two operations of the recurrent step), the draft tokens run through the recurrent step
// from it (each token's output row; its record (u, k, g) appended at logical position m + t),
// and with is_flush the rebuilt state is stored into the checkpoint first (the fold). With fp32
// rings the outputs and a folded checkpoint equal the recurrent op run over the same committed
// and draft tokens in one call bit for bit (for fp32 checkpoints, token-by-token plain decode
// too). A draft's records past the ring (m + t >= L) are dropped, as SGLang drops them (its
// output is still computed). A bad entry (a slot >= slots, a cursor outside [0, L], a duplicated
// live slot): a ValueError on CPU tensors before anything is written; CUDA: the row is skipped
// (nothing written), its outputs NaN, and it is recorded for check_errors (duplicates are not
// checked, as PackedDecodeArgs::check_indices says). The CUDA kernel
// (src/cuda/replayssm/verify.cuh) computes the same math in its own reduction order.
//   replay_indices [N] (optional, SGLang's replay_indices): the ring and cursor row of sequence n
//         when the rings and cursors are keyed by request rather than by checkpoint slot (the
//         rings then have R rows and the cursor tables C entries, any R and C); default:
//         state_indices.
//   rawv_cache [R, HV, L, V], rawk_cache [R, H, L, K] (floating), beta_cache [R, HV, L] fp32:
//         SGLang's exact-raw ring (all three): each draft also records its raw v, its raw
//         (pre-norm) k and its fp32 beta, and a fold replays the raw records through the
//         recurrent step itself, so the folded checkpoint is the recurrent op's state bit for bit
//         whatever the d/k rings' dtype. rawv and rawk without beta_cache: the hi/lo residual
//         mode: rawv records d - round(d to d_cache's dtype), rawk k^ - round(k^ to k_cache's
//         dtype), each rounded to its own dtype (commit_gdn_replayssm_circular reads them); a
//         fold then rebuilds from d and k as without them. CUDA: the exact-raw fold is a launch of
//         its own before the verify kernel; the residual ring is written by the verify kernel
//         beside each d and k record.
//   is_flush may be int8 (SGLang's) or int32.
//   rows: which live sequences this call serves (SGLang's launch_mode): ReplayRows::all; append:
//         those not folding (padded ones get zero outputs), SGLang's launch_mode="verify"; fold:
//         the folding ones only (padded ones untouched), launch_mode="flush".
//   state_format: a checkpoint pool in its storage format (StateFormatArgs above: float8_e4m3fn
//         or int8 codes with their fp32 scales, or bf16 / fp16 rounded stochastically), on both
//         backends. Its rows are loaded dequantized (code x row scale), the math is the fp32
//         math above, and a fold stores the rebuilt rows through the format as replayssm_decode's
//         flush does: a fresh scale per (slot, head, V row), stochastic bits keyed by (seed,
//         slot, layer, step) (the exact-raw fold too); a folding row's drafts then run from the
//         checkpoint as stored (loaded back dequantized), the state later verifies rebuild from.
//         The step counter advances once per call that serves folding rows (rows all or fold);
//         an append-only call stores no state and leaves it, so append then fold stores what one
//         all call stores.
enum class ReplayRows : int { all = 0, append = 1, fold = 2 };
struct ReplayVerifyArgs {
  TensorView q, k, v, g, beta, out;
  bool is_kda = false;
  std::optional<TensorView> A_log, dt_bias;
  bool gate_in_kernel = true;
  std::optional<double> lower_bound;
  bool beta_is_logit = true;
  bool round_beta_to_input = false;
  std::optional<double> scale;
  bool use_qk_l2norm = true;
  std::optional<TensorView> cu_seqlens;
  TensorView state, state_indices;
  StateFormatArgs state_format;  // a formatted checkpoint: its scales; stochastic rounding (above)
  TensorView d_cache, k_cache, g_cache;
  TensorView write_pos, cache_base, is_flush;
  std::optional<TensorView> replay_indices;
  std::optional<TensorView> rawv_cache, rawk_cache, beta_cache;
  ReplayRows rows = ReplayRows::all;
  int64_t null_block_id = -1;
  std::optional<bool> check_indices;  // as PackedDecodeArgs
  Stream stream = nullptr;
  bool pdl = false;
};
void replayssm_verify(const ReplayVerifyArgs& args);

// The commit after a ReplaySSM verify (SGLang's commit_gdn_replayssm_spec), on the cursors'
// device: for each row b with live slot s = state_indices[b] (> null_block_id) and a =
// num_accepted[b] (the accepted drafts, the bonus token included):
//   is_flush[s] != 0:  write_pos[s] = a; cache_base[s] = (cache_base[s] + write_pos[s]) % L
//                      when a > 0 (the step's records follow the folded checkpoint)
//   otherwise:         write_pos[s] += a
//   then is_flush[s] = write_pos[s] + 2 * max_spec_len > L (SGLang's early fold: the next
//   verify's records always fit).
// Rejected drafts are left behind the cursor (never read again). write_pos, cache_base [slots]
// int32, is_flush [slots] int32 or int8 (SGLang's); num_accepted, state_indices [B] int32/int64
// (any stride); L = max_cache_len, max_spec_len >= 1 with 2 * max_spec_len <= L.
// cache_buf_len (0: L): the rings' length, where cache_base wraps (SGLang's cache_buf_len; a
// power of two >= L); L then only sets the early-fold margin. fold_every_commit: is_flush[s] =
// write_pos[s] > 0 instead (SGLang's fold-every-commit flag). An accepted count outside [0,
// max_spec_len] or a slot >= slots: a ValueError on CPU tensors; CUDA: one thread per row on the
// device (no host synchronization), a bad row skipped and recorded for check_errors.
struct ReplayCommitArgs {
  TensorView write_pos, cache_base, is_flush, num_accepted, state_indices;
  int64_t max_cache_len = 0, max_spec_len = 0;
  int64_t cache_buf_len = 0;
  bool fold_every_commit = false;
  int64_t null_block_id = -1;
  std::optional<bool> check_indices;
  Stream stream = nullptr;
  bool pdl = false;  // as PackedDecodeArgs
};
void replayssm_commit(const ReplayCommitArgs& args);

// The cursors of rows that start decoding (SGLang's reset_gdn_replayssm_spec_cursors: the prefill
// -> decode handoff), on the cursors' device: for each row b with live slot s = state_indices[b]
// (> null_block_id) and do_reset[b] != 0: write_pos[s] = 0, cache_base[s] = 0 and is_flush[s] =
// 2 * max_spec_len > max_cache_len (the commit's early-fold rule at write_pos 0). write_pos,
// cache_base [slots] int32, is_flush [slots] int32 or int8; do_reset [B] int8 (a bool tensor's
// bytes), int32 or int64, state_indices [B] int32/int64 (any strides); max_cache_len and
// max_spec_len in [1, 2^30] (2 * max_spec_len > max_cache_len allowed, as SGLang's reset: the
// row then starts folding). A live, reset row's slot >= slots: a ValueError on CPU tensors;
// CUDA: the row skipped and recorded for check_errors.
struct ReplayResetArgs {
  TensorView write_pos, cache_base, is_flush, do_reset, state_indices;
  int64_t max_cache_len = 0, max_spec_len = 0;
  int64_t null_block_id = -1;  // as ReplayCommitArgs (SGLang's name passes its 0)
  std::optional<bool> check_indices;
  Stream stream = nullptr;
  bool pdl = false;  // as PackedDecodeArgs
};
void replayssm_reset_cursors(const ReplayResetArgs& args);

// The commit of SGLang's fold-every-commit scheme (commit_gdn_replayssm_fold_all_layers,
// commit_kda_replayssm_spec[_all_layers]): the verify recorded each draft's raw inputs in a ring
// (VerifyArgs::ring_*, positions 0..T-1), and the commit replays the accepted prefix into the
// checkpoint, every layer in one call. For each layer l, row b with live slot s =
// state_indices[b] (> null_block_id) and a = accept_lens[b] > 0, per value head: the state
// state[l, s] runs the recurrent step over the raw records t = 0..a-1 (the key L2-normalized when
// use_qk_l2norm, the decay exp(g), beta), in the recurrent op's order, so that with the ring
// written by the verify the result is the recurrent op's state after the a accepted tokens, bit
// for bit (CPU); it is stored back into state[l, s], and with track_indices/steps_to_track given,
// the state after step steps_to_track[b] (when >= 0 and < a, and track_indices[b] >
// null_block_id) is also stored into state[l, track_indices[b]].
//   state [layers, slots, HV, V, K] (or [slots, HV, V, K]: one layer), floating, compact inner
//         dimensions, any layer and slot strides.
//   rawv [layers, slots, HV, L, V], rawk [layers, slots, H, L, K] (floating), g [layers, slots,
//         HV, L] (GDN) / [layers, slots, HV, L, K] (KDA) fp32, beta [layers, slots, HV, L] fp32:
//         compact below the slot, any layer and slot strides (the layer dimension as state's).
//   state_indices, accept_lens [B] (and track_indices, steps_to_track [B]) int32/int64, any
//         stride. accept_lens[b] <= L.
// A bad row (a slot or track slot >= slots, an accepted count > L): a ValueError on CPU tensors,
// before anything is written; CUDA: the row is skipped and recorded for check_errors. A track
// slot that is a live slot of the batch or another row's track slot: a ValueError on CPU tensors
// (beyond SGLang: those stores race with the checkpoints' reads); the caller's duty on CUDA.
struct ReplayFoldArgs {
  TensorView state, rawv, rawk, g, beta;
  TensorView state_indices, accept_lens;
  std::optional<TensorView> track_indices, steps_to_track;
  bool is_kda = false;
  bool use_qk_l2norm = true;
  int64_t null_block_id = -1;
  std::optional<bool> check_indices;  // as PackedDecodeArgs
  Stream stream = nullptr;
  bool pdl = false;
};
void replayssm_fold_commit(const ReplayFoldArgs& args);

// SGLang's compact circular commit (commit_gdn_replayssm_circular, GDN): after the cursor commit,
// materialize the circular history only where needed, every layer in one call. For each layer,
// row b with live slot s = state_indices[b] (> null_block_id) and ring row r = replay_indices[b],
// n = write_pos[r] (already advanced by this step's accept_lens[b]), per value head, with
// G_j = g_0 + .. + g_j over the records at ring positions (cache_base[r] + j) % L:
//   fold (is_flush[r] != 0): state[s] = e^{G_{n-1}} state[s] + sum_{j<n} e^{G_{n-1} - G_j}
//                            (d_j + d_res_j) (k_j + k_res_j)^T  (fp32; the records j < n only)
//   track (track_indices[b] > null_block_id, steps_to_track[b] >= 0): the same over the first
//                            m = n - accept_lens[b] + steps_to_track[b] + 1 records (all m <= 0:
//                            the checkpoint itself), stored into state[track_indices[b]];
// then for each folded row: cache_base[r] = (cache_base[r] + n) % L, write_pos[r] = 0,
// is_flush[r] = 0. d_cache [layers?, R, HV, L, V], k_cache [layers?, R, H, L, K] (floating),
// g_cache [layers?, R, HV, L] fp32, d_residual / k_residual (optional, together) like d / k;
// compact below the ring row, any layer and row strides; state as ReplayFoldArgs.
// write_pos, cache_base [R] int32, is_flush [R] int32 or int8; the index vectors [B] int32/int64.
// A bad row (a slot or track slot past the pool, a replay row past the rings or cursor tables, a
// cursor outside the ring): a ValueError on CPU tensors before anything is written; CUDA: the row
// is skipped whole (no checkpoint, track slot or cursor written) and recorded for check_errors.
// Track slots as ReplayFoldArgs (not a live slot of the batch, not shared between rows).
struct ReplayCircularCommitArgs {
  TensorView state, d_cache, k_cache, g_cache;
  std::optional<TensorView> d_residual, k_residual;
  TensorView state_indices, replay_indices, write_pos, cache_base, is_flush, accept_lens;
  std::optional<TensorView> track_indices, steps_to_track;
  int64_t null_block_id = -1;
  std::optional<bool> check_indices;  // as PackedDecodeArgs
  Stream stream = nullptr;
  bool pdl = false;
};
void replayssm_circular_commit(const ReplayCircularCommitArgs& args);

}  // namespace deltastate
