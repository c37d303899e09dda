// The validated, backend-neutral description of one op call: plain structs of pointers, dtypes
// and int64 element strides. The contract layer (src/contracts) builds them from TensorViews; the
// CPU kernels read them on the host and the CUDA kernels receive them by value as kernel params.
#pragma once

#include <cstdint>

#include "core/numeric.h"  // DS_HD
#include "deltastate/tensor.h"

namespace deltastate::detail {

// A per-head vector input (q, k, v, g, beta, a, b) addressed per (sequence, token, head). The
// element stride inside one head's vector is 1. Element e of head h of token t of sequence n lives
// at  ptr + seq*seq_stride + tok*tok_stride + h*head_stride + e,  where (seq, tok) = (n, t)
// without cu_seqlens and (0, cu[n] + t) with them.
struct HeadInput {
  const void* ptr = nullptr;
  DType dtype = DType::f32;
  int64_t seq_stride = 0;
  int64_t tok_stride = 0;
  int64_t head_stride = 0;
};
struct HeadOutput {
  void* ptr = nullptr;
  DType dtype = DType::f32;
  int64_t seq_stride = 0;
  int64_t tok_stride = 0;
  int64_t head_stride = 0;
};

// The q, k and v of a packed mixed_qkv [B, 2*H*K + HV*V] (q at 0, k at H*K, v at 2*H*K; `row`
// elements between rows), one token per sequence: the packed decode ops' and the fused step's
// decode inputs.
struct PackedQkv {
  HeadInput q, k, v;
};
inline PackedQkv packed_qkv(const void* x, DType dtype, int64_t row, int64_t H, int64_t K,
                            int64_t V) {
  const char* base = static_cast<const char*>(x);
  const int64_t es = dtype_size(dtype);
  return {{base, dtype, row, 0, K},
          {base + H * K * es, dtype, row, 0, K},
          {base + 2 * H * K * es, dtype, row, 0, V}};
}

enum class GateMode : uint8_t {
  log_decay,  // g is given: alpha = exp(g)
  softplus,   // g = -exp(A_log) * softplus(a + dt_bias)
  safe,       // g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))
};

// Element offset of head `head`'s vector for token `tok` of batch row `seq` (HeadInput or
// HeadOutput; see HeadInput for the convention).
template <class Head>
DS_HD int64_t head_offset(const Head& t, int64_t seq, int64_t tok, int64_t head) {
  return seq * t.seq_stride + tok * t.tok_stride + head * t.head_stride;
}

// Gate parameters shared by every op.
struct GateParams {
  GateMode mode = GateMode::log_decay;
  bool kda = false;             // g is a K-vector per value head (else one scalar per value head)
  const void* A_log = nullptr;  // [HV]
  DType A_log_dtype = DType::f32;
  const void* dt_bias = nullptr;  // GDN [HV], KDA [HV*K]
  DType dt_bias_dtype = DType::f32;
  float lower_bound = 0.0f;
};

// The slot pool of states: [slots, HV, V, K] with compact inner strides and a free slot stride.
// K-first (FLA's layout, recurrent op on the CPU only): [slots, HV, K, V], element (v, k) of a
// head at k*V + v instead of v*K + k.
// A quantized pool (dtype f8e4m3 / i8) has fp32 scales [slots, HV, V] (inner strides (V, 1)).
// Stochastic rounding draws the bits of element e of slot s from
// sr_bits(sr_key(seed, s, layer, *step), e) (core/state_format.h); the op adds 1 to *step.
struct StatePoolRef {
  void* ptr = nullptr;
  DType dtype = DType::f32;
  int64_t slot_stride = 0;  // elements
  int64_t num_slots = 0;
  bool k_first = false;
  float* scales = nullptr;
  int64_t scale_slot_stride = 0;  // elements
  bool stochastic = false;
  int64_t* step = nullptr;
  uint64_t seed = 0, layer = 0;
  // Stored through the format's rules (quantized codes with scales, or stochastic rounding),
  // not by a plain dtype conversion.
  DS_HD bool formatted() const {
    return dtype == DType::f8e4m3 || dtype == DType::i8 || stochastic;
  }
};

// Entry i of a 1-D index tensor with element stride `stride` (any stride, as SGLang passes
// them: a strided view of a wider index table).
DS_HD int64_t index_at(const void* p, DType t, int64_t stride, int64_t i) {
  return load_index(p, t, i * stride);
}

// The CUDA backend's per-device error record (src/cuda/errors.cu): a kernel that meets a bad
// row (a slot index >= the pool's slots, a ReplaySSM cursor outside the ring) skips it and records
// the first such row here; check_errors (ops.h) reads and clears it. `flag` is 0 while empty.
struct DeviceErrorRecord {
  unsigned int flag;
  int op;    // DeviceErrorOp
  int kind;  // DeviceErrorKind
  int pad_;
  long long row;    // the batch row (sequence)
  long long index;  // the bad value (slot index or cursor)
  long long limit;  // the pool's slots (or the ring length L)
};
enum DeviceErrorOp : int {
  kErrOpRecurrent = 1,
  kErrOpReplay = 2,
  kErrOpChunkGdn = 3,         // chunk_prefill, GDN (chunk_gated_delta_rule)
  kErrOpChunkKda = 4,         // chunk_prefill, KDA (chunk_kda)
  kErrOpConv = 5,             // causal_conv1d_update
  kErrOpFusedStep = 6,        // gdn_/kda_fused_decode_step
  kErrOpVerify = 7,           // verify
  kErrOpCommit = 8,           // update_state_after_verify
  kErrOpReplayVerify = 9,     // replayssm_verify
  kErrOpReplayCommit = 10,    // replayssm_commit
  kErrOpConvCommit = 11,      // update_conv_state_after_verify
  kErrOpReplayFold = 12,      // replayssm_fold_commit
  kErrOpReplayCircular = 13,  // replayssm_circular_commit
  kErrOpReplayReset = 14      // replayssm_reset_cursors
};
// kErrSlot: ssm_state_indices. The chunked prefill's slot arrays have their own kinds; `row` is
// then the entry's position in that array. kErrRow: a verify scratch row >= N_scr; kErrStep: a
// step or length past T_alloc or a table's columns, num_accepted outside [1, columns], a parent
// token >= its token (verify and commit).
enum DeviceErrorKind : int {
  kErrSlot = 1,
  kErrCursor = 2,
  kErrInitialSlot = 3,     // initial_state_indices
  kErrOutputSlot = 4,      // output_state_indices
  kErrCheckpointSlot = 5,  // checkpoint_slot_indices
  kErrRow = 6,
  kErrStep = 7,
  kErrRing = 8,        // ReplaySSM verify: a cursor outside the ring
  kErrCacheBase = 9,   // ReplaySSM decode, circular rings: cache_base outside the ring
  kErrTrackSlot = 10,  // ReplaySSM fold and circular commits: mamba_track_indices past the pool
  kErrReplayRow = 11,  // ReplaySSM circular commit: replay_indices past the rings or cursors
};

// Pooled varlen recurrent problem; packed decode is the case T = 1 with q/k/v views into mixed_qkv.
struct RecurrentProblem {
  int32_t N = 0, H = 0, HV = 0, K = 0, V = 0;
  int32_t T = 1;                     // tokens per sequence when cu_seqlens is null
  const void* cu_seqlens = nullptr;  // [N+1]
  DType cu_dtype = DType::i32;
  HeadInput q, k, v, g, beta;  // g: log decay or raw `a` (see gate.mode)
  HeadOutput out;
  GateParams gate;
  bool beta_is_logit = false;
  bool round_beta = false;  // round beta to beta.dtype after the sigmoid
  bool l2norm = true;
  float scale = 1.0f;
  StatePoolRef state;             // ptr null: every sequence starts from S = 0
  const void* indices = nullptr;  // [N] slot per sequence; null: sequence n uses slot n
  DType index_dtype = DType::i32;
  int64_t index_stride = 1;     // elements between consecutive entries of `indices`
  bool update_state = false;    // write final S back into the pool
  void* final_state = nullptr;  // [N, HV, V, K] dense (state.k_first: [N, HV, K, V])
  DType final_dtype = DType::f32;
  bool check_indices = false;           // CUDA: synchronize and check_errors after the launch
  bool pdl = false;                     // CUDA: programmatic dependent launch (ops.h)
  bool pdl_trigger_early = false;       // CUDA, set per launch: enter_grid (cuda/grid.cuh)
  DeviceErrorRecord* errors = nullptr;  // CUDA, set per launch: the device's error record
  Device device{};

  DS_HD int64_t num_heads_total() const { return static_cast<int64_t>(N) * HV; }
};

// ReplaySSM buffered decode (T = 1) over a checkpoint pool and per-slot rings.
// SGLang's ReplaySSM ring modes (ops.h ReplayDecodeArgs); all off: the basic ring.
struct ReplayModes {
  int32_t* cache_base = nullptr;  // [B], set when circular (advanced with advance_write_pos)
  bool circular = false;
  bool prefix_gates = false;  // KDA only (SGLang's GDN path ignores the flag)
  bool predecayed_k = false;
};

struct ReplayProblem {
  int32_t B = 0, H = 0, HV = 0, K = 0, V = 0, L = 0;
  ReplayModes modes;
  HeadInput q, k, v, a, b;  // views into mixed_qkv, a, b
  HeadOutput out;
  GateParams gate;          // mode softplus or safe
  bool round_beta = false;  // round beta = sigmoid(b) to b.dtype
  bool l2norm = true;
  float scale = 1.0f;
  StatePoolRef state;       // the checkpoint pool
  void* d_cache = nullptr;  // [slots, HV, L, V], records stored in d_dtype
  DType d_dtype = DType::f32;
  void* k_cache = nullptr;  // [slots, H, L, K], records stored in k_dtype
  DType k_dtype = DType::f32;
  float* g_cache = nullptr;          // [slots, HV, L] or [slots, HV, L, K]
  const int32_t* indices = nullptr;  // [B], entry i at indices[i * index_stride]
  int64_t index_stride = 1;
  int32_t* write_pos = nullptr;          // [B]
  const int32_t* force_flush = nullptr;  // [B] or null
  bool advance_write_pos = false;
  bool check_indices = false;  // as RecurrentProblem
  bool pdl = false;            // as RecurrentProblem
  bool pdl_trigger_early = false;
  DeviceErrorRecord* errors = nullptr;  // as RecurrentProblem
  Device device{};
  // The op a bad row is recorded under: fused_decode_step's ReplaySSM chain runs these kernels as
  // its decode, and check_errors names the op the caller called.
  int err_op = kErrOpReplay;
};

// Chunked prefill (GDN and KDA) over varlen sequences, 64 tokens per chunk (ops.h
// ChunkPrefillArgs). Index arrays are read with load_index; null pointers mark absent arguments.
struct ChunkPrefillProblem {
  static constexpr int32_t kChunk = 64;  // tokens per chunk; checkpoints fall on chunk ends
  int32_t N = 0, H = 0, HV = 0, K = 0, V = 0;
  int32_t T = 0;                     // tokens per sequence when cu_seqlens is null
  const void* cu_seqlens = nullptr;  // [N+1]
  DType cu_dtype = DType::i32;
  HeadInput q, k, v, g, beta;  // g: log decay or raw `a` (see gate.mode)
  HeadOutput out;
  GateParams gate;
  bool beta_is_logit = false;
  bool l2norm = true;
  float scale = 1.0f;
  StatePoolRef state;  // pool (initial_indices set) or dense [N, ...]; null: S0 = 0
  const void* initial_indices = nullptr;  // [N] slot per sequence (< 0: padded)
  DType initial_index_dtype = DType::i32;
  const void* has_initial = nullptr;  // [N] 0 = start from zero; null: every state is read
  DType has_initial_dtype = DType::i32;
  const void* output_indices = nullptr;  // [N] final states' slots (< 0: none); null: in place
  DType output_index_dtype = DType::i32;
  void* final_state = nullptr;  // [N, HV, V, K] dense, optional
  DType final_dtype = DType::f32;
  int32_t checkpoint_every = 0;                // tokens; 0: no checkpoints
  const void* checkpoint_cu_starts = nullptr;  // [N+1]
  DType checkpoint_cu_dtype = DType::i32;
  void* checkpoints = nullptr;  // dense [total, HV, V, K], or null
  DType checkpoint_dtype = DType::f32;
  const void* checkpoint_slots = nullptr;  // [total] pool slots (< 0: skipped), or null
  DType checkpoint_slot_dtype = DType::i32;
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  bool check_indices = false;           // as RecurrentProblem
  bool pdl = false;                     // CUDA: programmatic dependent launch (ops.h)
  DeviceErrorRecord* errors = nullptr;  // as RecurrentProblem
  Device device{};

  DS_HD bool pooled() const { return initial_indices != nullptr; }
  DS_HD int64_t num_heads_total() const { return static_cast<int64_t>(N) * HV; }
};

struct IndexTable {  // [rows, cols] int32/int64, entry (r, c) at r*row_stride + c*col_stride
  const void* ptr = nullptr;
  DType dtype = DType::i32;
  int64_t row_stride = 0, col_stride = 1;
  int64_t cols = 0;
  DS_HD int64_t at(int64_t r, int64_t c) const {
    return load_index(ptr, dtype, r * row_stride + c * col_stride);
  }
};

// ---- the conv window and the fused decode layer step (causal_conv1d_update, fused_decode_step) --
// A conv window tensor [slots, dim, state_len], any strides: SGLang's [.., dim, W-1] (the window
// contiguous) and vLLM's dim-contiguous layout are both plain strides here. `ptr` is channel 0's
// window in slot 0.
struct ConvWindowRef {
  void* ptr = nullptr;
  DType dtype = DType::f32;
  int64_t slot_stride = 0, dim_stride = 0, tok_stride = 0;
  int64_t num_slots = 0;
  int32_t state_len = 0;
};

// The depthwise conv's parameters: weight [dim, width], optional bias [dim], optional SiLU.
struct ConvParams {
  const void* weight = nullptr;
  DType weight_dtype = DType::f32;
  int64_t weight_dim_stride = 0, weight_width_stride = 0;
  const void* bias = nullptr;  // null: no bias
  DType bias_dtype = DType::f32;
  int64_t bias_stride = 0;
  int32_t width = 0;
  bool silu = false;
};

// causal_conv1d_update: x [B, dim, T] (T = 1 for a 2-D x) into out [B, dim, T], the window of
// row b at entry indices[b] (null: entry b) of `state`, a circular buffer at cache_seqlens[b]
// when that is given.
struct ConvUpdateProblem {
  int32_t B = 0, dim = 0, T = 1;
  const void* x = nullptr;
  DType x_dtype = DType::f32;
  int64_t x_batch_stride = 0, x_dim_stride = 0, x_tok_stride = 0;
  void* out = nullptr;
  DType out_dtype = DType::f32;
  int64_t out_batch_stride = 0, out_dim_stride = 0, out_tok_stride = 0;
  ConvParams conv;
  ConvWindowRef state;
  const int32_t* cache_seqlens = nullptr;  // [B] or null
  const int32_t* indices = nullptr;        // [B] or null
  bool check_indices = false;
  bool pdl = false;
  bool pdl_trigger_early = false;
  DeviceErrorRecord* errors = nullptr;
  Device device{};
  // fused_decode_step's chain plan (CUDA) runs its conv through this problem: the slot of row b
  // from `slots` (any index dtype and stride; `indices` is null then), bad rows recorded as
  // `err_op`'s, and with split_k > 0 the channels from split_k on in window_k (channel
  // c - split_k) and from split_v on in window_v (Kimi-Linear's separate k and v windows; `state`
  // holds the channels below split_k). The causal_conv1d_update validator leaves them unset.
  const void* slots = nullptr;
  DType slot_dtype = DType::i32;
  int64_t slot_stride = 1;
  int err_op = kErrOpConv;
  int32_t split_k = 0, split_v = 0;
  ConvWindowRef window_k, window_v;
  // SGLang's speculative-verify options of causal_conv1d_update (ops.h): with num_accept
  // ([B, 1]) row b's window starts at entry num_accept - 1 of `state` (accept_limit: its largest
  // value the window holds); with inter, the window after each draft token t goes to
  // inter[row, t] (row: inter_indices[b], or b; < 0: none), in `state`'s dtype; with next_token /
  // next_sibling ([B, >= T], EAGLE's first child and next sibling) the drafts are a tree, its
  // parents written to parent_out [B, >= T]. The fused step leaves them unset.
  IndexTable num_accept;
  int64_t accept_limit = 0;
  void* inter = nullptr;
  int64_t inter_row_stride = 0, inter_step_stride = 0, inter_dim_stride = 0, inter_win_stride = 0;
  int64_t inter_rows = 0;
  IndexTable inter_indices;
  IndexTable next_token, next_sibling;
  void* parent_out = nullptr;
  DType parent_dtype = DType::i32;
  int64_t parent_row_stride = 0, parent_col_stride = 1;
  DS_HD bool speculative() const { return num_accept.ptr || inter || next_token.ptr; }
  // The fused step's ReplaySSM chain: with `cursors` ([B], read as the ReplaySSM kernels read them
  // with `cursor_advance` = advance_write_pos), a row whose cursor is outside [0, cursor_limit)
  // is bad too (kErrCursor): skipped as the ReplaySSM decode skips it, so the chain rolls no
  // window of a row whose state, rings and cursor it leaves untouched.
  const int32_t* cursors = nullptr;
  int32_t cursor_limit = 0;
  bool cursor_advance = false;
};

// The rings and cursors of a ReplaySSM step (ReplayProblem's fields of the same names), for the
// fused decode layer step in ReplaySSM mode. L = 0: no ReplaySSM (the validator's L is >= 1).
struct ReplayRings {
  int32_t L = 0;
  void* d_cache = nullptr;  // [slots, HV, L, V], records stored in d_dtype
  DType d_dtype = DType::f32;
  void* k_cache = nullptr;  // [slots, H, L, K], records stored in k_dtype
  DType k_dtype = DType::f32;
  float* g_cache = nullptr;              // [slots, HV, L] or [slots, HV, L, K]
  int32_t* write_pos = nullptr;          // [B]
  const int32_t* force_flush = nullptr;  // [B] or null
  bool advance_write_pos = false;
  ReplayModes modes;
};

// fused_decode_step: one decode token per row through the whole recurrent half of a GDN / KDA
// layer. The projected row x [B, conv_dim] = [q (H*K) | k (H*K) | v (HV*V)] before the conv;
// window[0..2] are the q, k, v parts' windows (views into one packed window, or three tensors),
// channel c of part j at window[j] channel c - first channel of part j. The recurrent state and
// the conv windows share the slot index. z / norm_weight null: no norm, out is the attention
// output.
struct FusedStepProblem {
  int32_t B = 0, H = 0, HV = 0, K = 0, V = 0;
  const void* x = nullptr;
  DType x_dtype = DType::f32;
  int64_t x_row_stride = 0;
  ConvParams conv;
  ConvWindowRef window[3];
  HeadInput a, b;  // a: GDN [B, HV] (head stride 1), KDA [B, HV*K] (head stride K)
  GateParams gate;
  bool round_beta = false;
  bool l2norm = true;
  float scale = 1.0f;
  StatePoolRef state;
  const void* indices = nullptr;  // [B]
  DType index_dtype = DType::i32;
  int64_t index_stride = 1;
  const void* z = nullptr;  // [B, HV, V], V contiguous; null: no gated norm
  DType z_dtype = DType::f32;
  int64_t z_row_stride = 0, z_head_stride = 0;
  const void* norm_weight = nullptr;  // [V]
  DType norm_weight_dtype = DType::f32;
  float norm_eps = 1e-6f;
  HeadOutput out;      // [B, HV, V]
  ReplayRings replay;  // replay.L > 0: `state` is the checkpoint pool (indices int32)
  bool check_indices = false;
  bool pdl = false;
  bool pdl_trigger_early = false;
  DeviceErrorRecord* errors = nullptr;
  Device device{};
  // CUDA: the caller's scratch for the chain plan (ops.h fused_decode_step_workspace_bytes);
  // null: none given.
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;

  DS_HD int32_t conv_dim() const { return 2 * H * K + HV * V; }
  // By L, not by d_cache's address: a ring of no slots may have none, and the workspace query
  // marks the mode without tensors.
  DS_HD bool is_replay() const { return replay.L > 0; }
};

// The ReplaySSM decode of a fused step in ReplaySSM mode, on its conv output `qkv` (a contiguous
// [B, conv_dim] packed row of dtype `qkv_dtype`): replayssm_decode's problem with the step's
// gate, beta, checkpoint pool, rings, cursors and `out` ([B, HV, V], replayssm_decode's
// [B, 1, HV, V] over the same memory). The CPU twin and the CUDA chain plan both run it.
inline ReplayProblem fused_replay_problem(const FusedStepProblem& p, const void* qkv,
                                          DType qkv_dtype) {
  ReplayProblem r;
  r.B = p.B;
  r.H = p.H;
  r.HV = p.HV;
  r.K = p.K;
  r.V = p.V;
  r.L = p.replay.L;
  const PackedQkv in = packed_qkv(qkv, qkv_dtype, p.conv_dim(), p.H, p.K, p.V);
  r.q = in.q;
  r.k = in.k;
  r.v = in.v;
  r.a = p.a;
  r.b = p.b;
  r.out = p.out;
  r.gate = p.gate;
  r.round_beta = p.round_beta;
  r.l2norm = p.l2norm;
  r.scale = p.scale;
  r.state = p.state;
  r.d_cache = p.replay.d_cache;
  r.d_dtype = p.replay.d_dtype;
  r.k_cache = p.replay.k_cache;
  r.k_dtype = p.replay.k_dtype;
  r.g_cache = p.replay.g_cache;
  r.indices = static_cast<const int32_t*>(p.indices);  // int32: the validator's rule
  r.index_stride = p.index_stride;
  r.write_pos = p.replay.write_pos;
  r.force_flush = p.replay.force_flush;
  r.advance_write_pos = p.replay.advance_write_pos;
  r.modes = p.replay.modes;
  r.check_indices = p.check_indices;
  r.device = p.device;
  return r;
}

// Speculative verify (ops.h VerifyArgs): the recurrent problem (its `indices` are the slots the
// sequences start from, `update_state` the final write-back) plus where the per-token states go.
// Index tables are read with index_at / load_index; null pointers mark absent arguments.
struct VerifyProblem {
  RecurrentProblem r;         // final_state is null; r.state is the pool (never null)
  IndexTable output_indices;  // [N, 1]: final state's slot; null: the starting slot
  void* inter = nullptr;      // [rows, steps, HV, V, K]
  DType inter_dtype = DType::f32;
  int64_t inter_row_stride = 0, inter_step_stride = 0;  // elements
  int64_t inter_rows = 0, inter_steps = 0;
  IndexTable inter_indices;  // [N, 1] scratch row; null: row n
  // A quantized scratch (inter_dtype f8e4m3 / i8; only with a quantized pool): its fp32 scales
  // [rows, steps, HV, V] (strides in floats, inner (V, 1)); each entry stored with fresh row
  // scales and r.state's rounding, the key's slot field scratch_key_slot(row * inter_steps +
  // step). inter_entry gives an entry as a one-slot pool.
  float* inter_scales = nullptr;
  int64_t inter_scale_row_stride = 0, inter_scale_step_stride = 0;
  IndexTable parents;         // [N, cols]: tree
  IndexTable token_slots;     // [N, cols]: pool slot of the state after token t
  IndexTable num_accepted;    // [N, 1]: with token_slots, the starting slot's column + 1
  StatePoolRef source;        // read-only start pool (ptr null: none); r.state's dtype
  IndexTable source_indices;  // [N, 1]: with source, the start row (r.indices: the final slot)
  int err_op = kErrOpVerify;  // the op a bad row is recorded under (the recurrent op runs here too)
  bool keep_padded_outputs = false;  // ops.h VerifyArgs: a padded sequence's outputs untouched
  // SGLang's cache_ring (ops.h VerifyArgs ring_*; ring_v null: none), steps t < ring_len.
  void* ring_v = nullptr;  // [S, HV, L, V]
  DType ring_v_dtype = DType::f32;
  void* ring_k = nullptr;  // [S, H, L, K]
  DType ring_k_dtype = DType::f32;
  float* ring_g = nullptr;     // [S, HV, L(, K)]
  float* ring_beta = nullptr;  // [S, HV, L]
  int32_t ring_len = 0;

  // Entry (row, step) of a quantized scratch as a pool of one slot (slot 0): its codes and row
  // scales, r.state's rounding (the key is the caller's: scratch_key_slot of the entry).
  DS_HD StatePoolRef inter_entry(int64_t row, int64_t step) const {
    StatePoolRef e = r.state;
    e.ptr = static_cast<char*>(inter) + row * inter_row_stride + step * inter_step_stride;
    e.dtype = inter_dtype;
    e.slot_stride = 0;
    e.num_slots = 1;
    e.k_first = false;
    e.scales = inter_scales + row * inter_scale_row_stride + step * inter_scale_step_stride;
    e.scale_slot_stride = 0;
    return e;
  }
  DS_HD int64_t inter_entry_index(int64_t row, int64_t step) const {
    return row * inter_steps + step;
  }
};

// The CUDA commits' launch limits (checked by their validators): the circular commit keeps a
// ring's history sums in shared memory (fold.cuh), and both grids take layers x HV in one
// dimension.
constexpr int kReplayCircularMaxL = 1024;
constexpr int64_t kReplayCommitMaxHeads = 65535;

// One ring of the fold and circular commits, [layers?, rows, ...] compact below its rows: row r
// of layer l starts at element l * layer_stride + r * row_stride (layer_stride 0 without a layer
// dimension). ptr null: an absent ring (the circular commit's residuals).
struct CommitRing {
  const void* ptr = nullptr;
  DType dtype = DType::f32;
  int64_t layer_stride = 0, row_stride = 0;
  DS_HD int64_t at(int64_t layer, int64_t row) const {
    return layer * layer_stride + row * row_stride;
  }
  DS_HD const float* f32() const { return static_cast<const float*>(ptr); }  // fp32 rings
};

// The compact circular commit (ops.h ReplayCircularCommitArgs): per (layer, row, value head),
// then the folded rows' cursors.
struct ReplayCircularProblem {
  int32_t B = 0, layers = 1, H = 0, HV = 0, K = 0, V = 0, L = 0;
  void* state = nullptr;
  DType state_dtype = DType::f32;
  int64_t state_layer_stride = 0, state_slot_stride = 0, num_slots = 0;
  CommitRing d, k;               // [layers, R, HV, L, V], [layers, R, H, L, K]
  CommitRing g;                  // [layers, R, HV, L] fp32
  CommitRing d_res, k_res;       // like d, k; ptr null: no residuals
  int32_t* write_pos = nullptr;  // [R]
  int32_t* cache_base = nullptr;
  void* is_flush = nullptr;
  DType flush_dtype = DType::i32;
  int64_t ring_rows = 0;
  IndexTable slots, rows, accepted, track, steps;  // [B, 1]; track.ptr null: none
  int64_t null_block_id = -1;
  bool check_indices = false;
  bool pdl = false;
  DeviceErrorRecord* errors = nullptr;  // CUDA, set per launch
  Device device{};
};

// The fold-every-commit commit (ops.h ReplayFoldArgs): per (layer, row, value head).
struct ReplayFoldProblem {
  int32_t B = 0, layers = 1, H = 0, HV = 0, K = 0, V = 0, L = 0;
  bool kda = false, l2norm = true;
  void* state = nullptr;
  DType state_dtype = DType::f32;
  int64_t state_layer_stride = 0, state_slot_stride = 0, num_slots = 0;
  CommitRing rawv;                           // [layers, slots, HV, L, V]
  CommitRing rawk;                           // [layers, slots, H, L, K]
  CommitRing g;                              // [layers, slots, HV, L(, K)] fp32
  CommitRing beta;                           // [layers, slots, HV, L] fp32
  IndexTable slots, accepted, track, steps;  // [B, 1]; track.ptr null: no track slots
  int64_t null_block_id = -1;
  bool check_indices = false;
  bool pdl = false;
  DeviceErrorRecord* errors = nullptr;  // CUDA, set per launch
  Device device{};
};

// The commit after a verify, every layer in one launch: of the states (ops.h CommitArgs) and of
// the conv windows (ConvCommitArgs). One entry (a state, a window) is a [inner_rows, inner_cols]
// block of head_elems elements, element (r, c) at r * row stride + c * col stride from the
// entry's start in each tensor. flat: both blocks are the same dense range [0, head_elems) (a
// state always is), so an entry is one contiguous copy.
struct CommitProblem {
  int32_t B = 0, layers = 1;
  int64_t head_elems = 0;  // HV*V*K, or dim*W1
  bool flat = true;
  int64_t inner_rows = 1, inner_cols = 0;
  int64_t state_inner_row_stride = 0, state_inner_col_stride = 1;
  int64_t inter_inner_row_stride = 0, inter_inner_col_stride = 1;
  void* state = nullptr;
  const void* inter = nullptr;
  DType dtype = DType::f32;
  int64_t state_layer_stride = 0, state_slot_stride = 0, num_slots = 0;
  int64_t inter_layer_stride = 0, inter_row_stride = 0, inter_step_stride = 0;
  int64_t inter_rows = 0, inter_steps = 0;
  IndexTable slots, accepted, rows;  // [B, 1] each; rows null: row b
  bool accepted_is_step = false;
  bool check_indices = false;
  bool pdl = false;
  bool pdl_trigger_early = false;
  DeviceErrorRecord* errors = nullptr;
  int err_op = kErrOpCommit;  // the op a bad row is recorded under
  Device device{};
  // A quantized state (dtype f8e4m3 / i8) from a float scratch of inter_dtype: each entry's
  // head_elems / K rows of K elements requantized with fresh scales (layer / slot strides in
  // floats; a row's scale at row index within the entry). Stochastic: layer l's bits keyed by
  // (seed, slot, layer0 + l, steps[l]), each step advanced once per call.
  DType inter_dtype = DType::f32;
  int32_t K = 0;
  float* scales = nullptr;
  int64_t scales_layer_stride = 0, scales_slot_stride = 0;
  bool stochastic = false;
  int64_t* steps = nullptr;
  uint64_t seed = 0, layer0 = 0;
  // A quantized scratch (inter_dtype f8e4m3 / i8, with a quantized state): its fp32 scales
  // [layers?, rows, steps, HV, V] (strides in floats, inner (V, 1)). Of the state's dtype: the
  // entry's codes and scales are copied; of the other: dequantized, then requantized as above.
  const float* inter_scales = nullptr;
  int64_t inter_scale_layer_stride = 0, inter_scale_row_stride = 0, inter_scale_step_stride = 0;
};

// ReplaySSM speculative verify (ops.h ReplayVerifyArgs): the token inputs as the recurrent
// problem (r.state is the checkpoint pool, r.indices the slots, update_state false) plus the
// rings and the slot-keyed cursors.
struct ReplayVerifyProblem {
  RecurrentProblem r;
  int32_t L = 0;
  void* d_cache = nullptr;  // [slots, HV, L, V]
  DType d_dtype = DType::f32;
  void* k_cache = nullptr;  // [slots, H, L, K]
  DType k_dtype = DType::f32;
  float* g_cache = nullptr;             // [slots, HV, L(, K)]
  const int32_t* write_pos = nullptr;   // [slots]
  const int32_t* cache_base = nullptr;  // [slots]
  const void* is_flush = nullptr;       // [slots] int32 or int8 (flag_at)
  DType flush_dtype = DType::i32;
  int64_t null_block_id = -1;  // a slot <= null_block_id marks a padded sequence
  // The ring/cursor row of sequence n (ops.h replay_indices); null: the checkpoint slot.
  const void* replay = nullptr;
  DType replay_dtype = DType::i32;
  int64_t replay_stride = 1;
  int64_t ring_rows = 0;  // R: rows of the rings and cursor tables
  // Exact-raw ring (all three) or hi/lo residual ring (rawv, rawk; beta_ring null): ops.h.
  void* rawv = nullptr;  // [R, HV, L, V]
  DType rawv_dtype = DType::f32;
  void* rawk = nullptr;  // [R, H, L, K]
  DType rawk_dtype = DType::f32;
  float* beta_ring = nullptr;   // [R, HV, L]
  int32_t rows = 0;             // ops.h ReplayRows: 0 all, 1 append (not folding), 2 fold
  bool history_folded = false;  // CUDA: the exact fold ran first (folding rows: empty history)
};

// Entry i of a cursor flag table (int32 or int8).
DS_HD bool flag_at(const void* p, DType t, int64_t i) {
  return t == DType::i8 ? static_cast<const int8_t*>(p)[i] != 0
                        : static_cast<const int32_t*>(p)[i] != 0;
}
DS_HD void set_flag(void* p, DType t, int64_t i, bool v) {
  if (t == DType::i8) static_cast<int8_t*>(p)[i] = v ? 1 : 0;
  else static_cast<int32_t*>(p)[i] = v ? 1 : 0;
}

// The cursor commit after a ReplaySSM verify (ops.h ReplayCommitArgs).
struct ReplayCommitProblem {
  int32_t B = 0, L = 0, max_spec_len = 0;
  int32_t* write_pos = nullptr;  // [slots]
  int32_t* cache_base = nullptr;
  void* is_flush = nullptr;  // int32 or int8
  DType flush_dtype = DType::i32;
  int32_t buf_len = 0;  // where cache_base wraps (ops.h cache_buf_len)
  bool fold_every_commit = false;
  int64_t num_slots = 0;
  IndexTable accepted, slots;  // [B, 1]
  int64_t null_block_id = -1;
  bool check_indices = false;
  bool pdl = false;
  DeviceErrorRecord* errors = nullptr;  // CUDA, set per launch
  Device device{};
};

// The cursor reset of rows that start decoding (ops.h ReplayResetArgs).
struct ReplayResetProblem {
  int32_t B = 0;
  int32_t* write_pos = nullptr;  // [slots]
  int32_t* cache_base = nullptr;
  void* is_flush = nullptr;  // int32 or int8
  DType flush_dtype = DType::i32;
  bool init_flush = false;         // is_flush after the reset
  const void* do_reset = nullptr;  // [B] int8, int32 or int64
  DType reset_dtype = DType::i32;
  int64_t reset_stride = 1;
  int64_t num_slots = 0;
  IndexTable slots;  // [B, 1]
  int64_t null_block_id = -1;
  bool check_indices = false;
  bool pdl = false;
  DeviceErrorRecord* errors = nullptr;  // CUDA, set per launch
  Device device{};
};

// Row b's reset flag.
DS_HD bool reset_row(const ReplayResetProblem& p, int64_t b) {
  const int64_t i = b * p.reset_stride;
  return p.reset_dtype == DType::i8 ? static_cast<const int8_t*>(p.do_reset)[i] != 0
                                    : load_index(p.do_reset, p.reset_dtype, i) != 0;
}

// The reset of row b's live slot.
DS_HD void reset_cursors(const ReplayResetProblem& p, int64_t slot) {
  p.write_pos[slot] = 0;
  p.cache_base[slot] = 0;
  set_flag(p.is_flush, p.flush_dtype, slot, p.init_flush);
}

}  // namespace deltastate::detail
