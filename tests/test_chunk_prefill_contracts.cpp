// Every error of chunk_prefill's validator (src/contracts/chunk_prefill.cpp), each from a minimal
// bad input: the exact message, ErrorKind::value, and no change to any caller memory (every buffer
// is snapshotted before the call and compared byte for byte after it). Then the calls it must
// accept: negative indices, a padded sequence's ignored slots, in-place states, envelope pools.
#include <cmath>
#include <functional>
#include <limits>

#include "test_util.h"
#include "view_edits.h"

namespace dstest {
namespace {

using deltastate::ChunkPrefillArgs;
using deltastate::Error;
using deltastate::ErrorKind;

constexpr double kInf = std::numeric_limits<double>::infinity();

void write_indices(const Tensor& idx, std::initializer_list<int64_t> values) {
  int64_t i = 0;
  for (int64_t v : values) idx.ptr<int32_t>()[i++] = static_cast<int32_t>(v);
}

// H=2, HV=4, K=16, V=8; two sequences of 64 and 70 tokens (cu_seqlens {0, 64, 134}); a pool of 8
// slots with initial_state_indices {1, 3}, has_initial_state {1, 0}, output_state_indices
// {5, 6}; final_state; a checkpoint every 64 tokens (one per sequence, checkpoint_cu_starts
// {0, 1, 2}) into slots {0, 2}, or into `dense` [2, HV, V, K] when a case swaps them.
constexpr Shape kSmall{"small", 2, 4, 16, 8};

struct Fixture {
  bool kda;
  RecurrentBatch rb;
  Tensor pool, idx, has, out_idx, final_state, ck_cu, ck_slots, dense, ws;
  ChunkPrefillArgs args;
  explicit Fixture(bool kda_) : kda(kda_) {
    Rng rng = test_rng(kda);
    RecurrentSpec spec = recurrent_spec(kSmall, kda, DType::f32, 1, 1, {64, 70});
    rb = make_recurrent_batch(rng, spec);
    pool = make_pool(DType::f32, 8, kSmall);
    fill_slot(pool.view(), 1, rng);
    fill_slot(pool.view(), 3, rng);
    idx = index_tensor({1, 3});
    has = index_tensor({1, 0});
    out_idx = index_tensor({5, 6});
    final_state = Tensor::contiguous(DType::f32, {2, kSmall.HV, kSmall.V, kSmall.K});
    ck_cu = index_tensor({0, 1, 2});
    ck_slots = index_tensor({0, 2});
    dense = Tensor::contiguous(DType::f32, {2, kSmall.HV, kSmall.V, kSmall.K});
    args.q = rb.q.view();
    args.k = rb.k.view();
    args.v = rb.v.view();
    args.g = rb.g.view();
    args.beta = rb.beta.view();
    args.out = rb.out.view();
    args.is_kda = kda;
    args.gate_in_kernel = true;
    args.A_log = rb.A_log.view();
    args.dt_bias = rb.dt_bias.view();
    args.beta_is_logit = true;
    args.cu_seqlens = rb.cu.view();
    args.initial_state = pool.view();
    args.initial_state_indices = idx.view();
    args.has_initial_state = has.view();
    args.output_state_indices = out_idx.view();
    args.final_state = final_state.view();
    args.checkpoint_every_n_tokens = 64;
    args.checkpoint_cu_starts = ck_cu.view();
    args.checkpoint_slot_indices = ck_slots.view();
    ws = Tensor::contiguous(DType::f32, {workspace_bytes() / 4});
    args.workspace = ws.view();
  }
  int64_t workspace_bytes() const { return deltastate::chunk_prefill_workspace_bytes(args); }
  void use_dense_checkpoints(ChunkPrefillArgs& a) const {
    a.checkpoint_slot_indices.reset();
    a.state_checkpoints = dense.view();
  }
  // initial_state as a dense [N, ...] (the pool's first two slots), no pool arguments.
  void use_dense_state(ChunkPrefillArgs& a) const {
    a.initial_state = with_size(pool.view(), 0, 2);
    a.initial_state_indices.reset();
  }
  void run(const ChunkPrefillArgs& a) const { deltastate::chunk_prefill(a); }
  Snapshot snapshot() const {
    Snapshot s;
    for (const Tensor* t :
         {&rb.q, &rb.k, &rb.v, &rb.g, &rb.beta, &rb.out, &rb.A_log, &rb.dt_bias, &rb.cu, &pool,
          &idx, &has, &out_idx, &final_state, &ck_cu, &ck_slots, &dense, &ws})
      s.add(*t);
    return s;
  }
};

struct Case {
  const char* what;
  std::function<void(Fixture&, ChunkPrefillArgs&)> mutate;
  std::string message;
};

void expect_rejections(const std::vector<Case>& cases, bool kda) {
  {
    Fixture f(kda);
    EXPECT_NO_THROW(f.run(f.args)) << "the unmutated arguments must be valid";
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Fixture f(kda);
    ChunkPrefillArgs args = f.args;
    c.mutate(f, args);
    const Snapshot before = f.snapshot();
    const std::optional<Error> e = catch_error([&] { f.run(args); });
    if (!e) continue;
    EXPECT_EQ(std::string(e->what()), c.message);
    EXPECT_EQ(e->kind(), ErrorKind::value);
    EXPECT_TRUE(before.unchanged()) << "a rejected call changed caller memory";
  }
}

std::vector<Case> cases(bool kda) {
  const std::string op = kda ? "chunk_kda" : "chunk_gated_delta_rule";
  const int64_t need = Fixture(kda).workspace_bytes();
  const std::string ws_shape = "(" + std::to_string(need / 4) + ",)";
  const std::string pool_stride_note = "an arbitrary slot stride is supported.";
  std::vector<Case> list = {
      // ---- shapes, strides, dtypes, devices of the token inputs
      {"q 3D", [](auto&, auto& a) { a.q = with_ndim(a.q, 3); },
       "`q` must be a 4D tensor [B, T, H, K]; got shape (1, 134, 2)"},
      {"v 3D", [](auto&, auto& a) { a.v = with_ndim(a.v, 3); },
       "`v` must be a 4D tensor [B, T, HV, V]; got shape (1, 134, 4)"},
      {"k K", [](auto&, auto& a) { a.k = with_size(a.k, 3, 15); },
       "`k` must have shape [B, T, H, K]=(1, 134, 2, 16); got (1, 134, 2, 15) (K=16 from `q`)"},
      {"v T", [](auto&, auto& a) { a.v = with_size(a.v, 1, 133); },
       "`v` must have shape [B, T, HV, V]=(1, 134, 4, 8); got (1, 133, 4, 8) (T=134 from `q`)"},
      {"beta 4D", [](auto&, auto& a) { a.beta = with_ndim(a.beta, 4); },
       "`beta` must be a 3D tensor [B, T, HV]; got shape (1, 134, 4, 1)"},
      {"out V", [](auto&, auto& a) { a.out = with_size(a.out, 3, 9); },
       "`out` must have shape [B, T, HV, V]=(1, 134, 4, 8); got (1, 134, 4, 9) (V=8 from `v`)"},
      {"HV not a multiple of H",
       [](auto&, auto& a) {
         a.v = with_size(a.v, 2, 3);
         a.g = with_size(a.g, 2, 3);
         a.beta = with_size(a.beta, 2, 3);
         a.out = with_size(a.out, 2, 3);
       },
       op + ": `v` has HV=3 heads and `q`/`k` have H=2; HV must be a positive multiple of H"},
      {"q last-dim stride", [](auto&, auto& a) { a.q = with_stride(a.q, 3, 2); },
       "`q` must be contiguous in its last dim; got strides (4288, 32, 16, 2)"},
      {"k last-dim stride", [](auto&, auto& a) { a.k = with_stride(a.k, 3, 3); },
       "`k` must be contiguous in its last dim; got strides (4288, 32, 16, 3)"},
      {"v last-dim stride", [](auto&, auto& a) { a.v = with_stride(a.v, 3, 2); },
       "`v` must be contiguous in its last dim; got strides (4288, 32, 8, 2)"},
      {"out last-dim stride", [](auto&, auto& a) { a.out = with_stride(a.out, 3, 2); },
       "`out` must be contiguous in its last dim; got strides (4288, 32, 8, 2)"},
      {"q dtype", [](auto&, auto& a) { a.q = with_dtype(a.q, DType::i32); },
       "`q` must have dtype float32, bfloat16 or float16; got int32"},
      {"k dtype", [](auto&, auto& a) { a.k = with_dtype(a.k, DType::i64); },
       "`k` must have dtype float32, bfloat16 or float16; got int64"},
      {"v dtype", [](auto&, auto& a) { a.v = with_dtype(a.v, DType::i32); },
       "`v` must have dtype float32, bfloat16 or float16; got int32"},
      {"g dtype", [](auto&, auto& a) { a.g = with_dtype(a.g, DType::i32); },
       "`g` must have dtype float32, bfloat16 or float16; got int32"},
      {"beta dtype", [](auto&, auto& a) { a.beta = with_dtype(a.beta, DType::i32); },
       "`beta` must have dtype float32, bfloat16 or float16; got int32"},
      {"out dtype", [](auto&, auto& a) { a.out = with_dtype(a.out, DType::i32); },
       "`out` must have dtype float32, bfloat16 or float16; got int32"},
      {"k on another device", [](auto&, auto& a) { a.k = on_cuda(a.k); },
       "All inputs must be on the same device: `q` is on cpu, `k` is on cuda:0"},
      // ---- cu_seqlens (the recurrent op's texts)
      {"cu_seqlens with B > 1",
       [](auto& f, auto& a) {
         a.q = reshaped(a.q, {2, 67, 2, 16});
         a.k = reshaped(a.k, {2, 67, 2, 16});
         a.v = reshaped(a.v, {2, 67, 4, 8});
         a.g = f.kda ? reshaped(a.g, {2, 67, 4, 16}) : reshaped(a.g, {2, 67, 4});
         a.beta = reshaped(a.beta, {2, 67, 4});
         a.out = reshaped(a.out, {2, 67, 4, 8});
       },
       "The batch size is expected to be 1 rather than 2 when using `cu_seqlens`.Please flatten "
       "variable-length inputs before processing."},
      {"cu_seqlens 2D", [](auto&, auto& a) { a.cu_seqlens = reshaped(*a.cu_seqlens, {3, 1}); },
       "`cu_seqlens` must be a 1D tensor [N+1]; got shape (3, 1)"},
      {"cu_seqlens dtype", [](auto&, auto& a) { a.cu_seqlens = with_dtype(*a.cu_seqlens, DType::f32); },
       "`cu_seqlens` must have dtype int32 or int64; got float32"},
      {"cu_seqlens strided",
       [](auto&, auto& a) { a.cu_seqlens = with_size(with_stride(*a.cu_seqlens, 0, 2), 0, 2); },
       "`cu_seqlens` must be contiguous; got shape (2,) with strides (2,)"},
      {"cu_seqlens on another device", [](auto&, auto& a) { a.cu_seqlens = on_cuda(*a.cu_seqlens); },
       "All inputs must be on the same device: `q` is on cpu, `cu_seqlens` is on cuda:0"},
      {"cu_seqlens not starting at 0", [](auto& f, auto&) { write_indices(f.rb.cu, {1, 64, 134}); },
       "`cu_seqlens` must start at 0 and be non-decreasing within [0, T=134]; got cu_seqlens[0]=1"},
      {"cu_seqlens decreasing", [](auto& f, auto&) { write_indices(f.rb.cu, {0, 70, 64}); },
       "`cu_seqlens` must start at 0 and be non-decreasing within [0, T=134]; got cu_seqlens[2]=64 after 70"},
      {"cu_seqlens past T", [](auto& f, auto&) { write_indices(f.rb.cu, {0, 64, 135}); },
       "`cu_seqlens` must start at 0 and be non-decreasing within [0, T=134]; got cu_seqlens[2]=135 after 64"},
      // ---- states
      {"state 3D", [](auto&, auto& a) { a.initial_state = with_ndim(*a.initial_state, 3); },
       "`initial_state` must be a 4D tensor [slots, HV, V, K]; got shape (8, 4, 8)"},
      {"state K", [](auto&, auto& a) { a.initial_state = with_size(*a.initial_state, 3, 15); },
       "`initial_state` must have shape [slots, HV, V, K]=(8, 4, 8, 16); got (8, 4, 8, 15) (K=16 from `q`)"},
      {"state inner strides", [](auto&, auto& a) { a.initial_state = with_stride(*a.initial_state, 2, 17); },
       "`initial_state` must be contiguous in its [HV, V, K] inner dimensions; " + pool_stride_note +
           " `initial_state` has strides (512, 128, 17, 1); expected (any, 128, 16, 1)."},
      {"state head stride", [](auto&, auto& a) { a.initial_state = with_stride(*a.initial_state, 1, 256); },
       "`initial_state` must be contiguous in its [HV, V, K] inner dimensions; " + pool_stride_note +
           " `initial_state` has strides (512, 256, 16, 1); expected (any, 128, 16, 1)."},
      {"state dtype", [](auto&, auto& a) { a.initial_state = with_dtype(*a.initial_state, DType::i32); },
       "`initial_state` must have dtype float32, bfloat16 or float16; got int32"},
      {"state on another device", [](auto&, auto& a) { a.initial_state = on_cuda(*a.initial_state); },
       "All inputs must be on the same device: `q` is on cpu, `initial_state` is on cuda:0"},
      {"dense state count", [](auto&, auto& a) { a.initial_state_indices.reset(); },
       "The number of initial states is expected to be equal to the number of input sequences, i.e., 2 "
       "rather than 8."},
      {"indices without a state", [](auto&, auto& a) { a.initial_state.reset(); },
       "`initial_state_indices` index a state pool, but no `initial_state` pool was given"},
      {"indices length", [](auto& f, auto& a) { a.initial_state_indices = reshaped(f.idx.view(), {1}); },
       "`initial_state_indices` must have shape [N]=(2,); got (1,) (N=2 from `cu_seqlens`)"},
      {"indices dtype", [](auto&, auto& a) { a.initial_state_indices = with_dtype(*a.initial_state_indices, DType::f32); },
       "`initial_state_indices` must have dtype int32 or int64; got float32"},
      {"indices strided", [](auto&, auto& a) { a.initial_state_indices = with_stride(*a.initial_state_indices, 0, 2); },
       "`initial_state_indices` must be contiguous; got shape (2,) with strides (2,)"},
      {"has_initial_state without a state",
       [](auto& f, auto& a) {
         a.initial_state.reset();
         a.initial_state_indices.reset();
         a.output_state_indices.reset();
         f.use_dense_checkpoints(a);
       },
       "`has_initial_state` says which sequences read `initial_state`, but none was given"},
      {"has_initial_state length", [](auto&, auto& a) { a.has_initial_state = with_size(*a.has_initial_state, 0, 3); },
       "`has_initial_state` must have shape [N]=(2,); got (3,) (N=2 from `cu_seqlens`)"},
      {"has_initial_state dtype", [](auto&, auto& a) { a.has_initial_state = with_dtype(*a.has_initial_state, DType::bf16); },
       "`has_initial_state` must have dtype int32 or int64; got bfloat16"},
      {"output indices without a pool",
       [](auto& f, auto& a) {
         f.use_dense_state(a);
         f.use_dense_checkpoints(a);
       },
       "`output_state_indices` name slots of the `initial_state` pool, but no `initial_state_indices` were "
       "given"},
      {"output indices length", [](auto&, auto& a) { a.output_state_indices = with_size(*a.output_state_indices, 0, 1); },
       "`output_state_indices` must have shape [N]=(2,); got (1,) (N=2 from `cu_seqlens`)"},
      {"output indices dtype", [](auto&, auto& a) { a.output_state_indices = with_dtype(*a.output_state_indices, DType::f16); },
       "`output_state_indices` must have dtype int32 or int64; got float16"},
      {"output indices on another device", [](auto&, auto& a) { a.output_state_indices = on_cuda(*a.output_state_indices); },
       "All inputs must be on the same device: `q` is on cpu, `output_state_indices` is on cuda:0"},
      {"final_state N", [](auto&, auto& a) { a.final_state = with_size(*a.final_state, 0, 3); },
       "`final_state` must have shape [N, HV, V, K]=(2, 4, 8, 16); got (3, 4, 8, 16) (N=2 from `cu_seqlens`)"},
      {"final_state strided", [](auto&, auto& a) { a.final_state = with_stride(*a.final_state, 0, 1024); },
       "`final_state` must be contiguous; got shape (2, 4, 8, 16) with strides (1024, 128, 16, 1)"},
      {"final_state dtype", [](auto&, auto& a) { a.final_state = with_dtype(*a.final_state, DType::i32); },
       "`final_state` must have dtype float32, bfloat16 or float16; got int32"},
      // ---- gates and scale (the recurrent op's texts)
      {"in-kernel gate without A_log", [](auto&, auto& a) { a.A_log.reset(); },
       op + ": the in-kernel gate (use_gate_in_kernel) needs `A_log`"},
      {"A_log numel", [](auto&, auto& a) { a.A_log = with_size(*a.A_log, 0, 3); },
       "`A_log` must have 4 elements (got 3)."},
      {"A_log dtype", [](auto&, auto& a) { a.A_log = with_dtype(*a.A_log, DType::i64); },
       "`A_log` must have dtype float32, bfloat16 or float16; got int64"},
      {"dt_bias numel", [](auto&, auto& a) { a.dt_bias = with_size(*a.dt_bias, 0, 5); },
       kda ? "`dt_bias` must have 64 elements (got 5)." : "`dt_bias` must have 4 elements (got 5)."},
      {"dt_bias strided", [](auto&, auto& a) { a.dt_bias = with_stride(*a.dt_bias, 0, 2); },
       kda ? "`dt_bias` must be contiguous; got shape (64,) with strides (2,)"
           : "`dt_bias` must be contiguous; got shape (4,) with strides (2,)"},
      {"lower_bound inf", [](auto&, auto& a) { a.lower_bound = kInf; }, "lower_bound must be finite (got inf)"},
      {"gate params without the in-kernel gate", [](auto&, auto& a) { a.gate_in_kernel = false; },
       op + ": `A_log`, `dt_bias` and lower_bound apply only with the in-kernel gate "
            "(use_gate_in_kernel=True); `g` is otherwise the log-space decay itself"},
      {"scale negative", [](auto&, auto& a) { a.scale = -1.0; }, "scale must be positive (got -1)"},
      {"scale 0", [](auto&, auto& a) { a.scale = 0.0; }, "scale must be positive (got 0)"},
      {"scale nan", [](auto&, auto& a) { a.scale = std::nan(""); }, "scale must be positive (got nan)"},
      // ---- checkpoints (FlashInfer's texts where it has one)
      {"checkpoint_every negative", [](auto&, auto& a) { a.checkpoint_every_n_tokens = -64; },
       "checkpoint_every_n_tokens must be non-negative, got -64"},
      {"checkpoint_every not a multiple of 64", [](auto&, auto& a) { a.checkpoint_every_n_tokens = 96; },
       "checkpoint_every_n_tokens must be a multiple of the chunk size (64), got 96"},
      {"checkpoint_every too large", [](auto&, auto& a) { a.checkpoint_every_n_tokens = int64_t{1} << 31; },
       "checkpoint_every_n_tokens must be below 2^31, got 2147483648"},
      {"checkpoint arguments without checkpoint_every", [](auto&, auto& a) { a.checkpoint_every_n_tokens = 0; },
       "`checkpoint_cu_starts`, `state_checkpoints` and `checkpoint_slot_indices` must be None when "
       "checkpoint_every_n_tokens == 0"},
      {"checkpoint_every without cu_starts", [](auto&, auto& a) { a.checkpoint_cu_starts.reset(); },
       "checkpoint_every_n_tokens > 0 needs `checkpoint_cu_starts`"},
      {"two checkpoint destinations", [](auto& f, auto& a) { a.state_checkpoints = f.dense.view(); },
       "checkpoint_every_n_tokens > 0 needs one destination: `state_checkpoints` (dense) or "
       "`checkpoint_slot_indices` (pool slots), not both"},
      {"no checkpoint destination", [](auto&, auto& a) { a.checkpoint_slot_indices.reset(); },
       "checkpoint_every_n_tokens > 0 needs one destination: `state_checkpoints` (dense) or "
       "`checkpoint_slot_indices` (pool slots), not both"},
      {"cu_starts length", [](auto&, auto& a) { a.checkpoint_cu_starts = with_size(*a.checkpoint_cu_starts, 0, 2); },
       "`checkpoint_cu_starts` must have shape [N+1]=(3,); got (2,) (N=2 from `cu_seqlens`)"},
      {"cu_starts dtype", [](auto&, auto& a) { a.checkpoint_cu_starts = with_dtype(*a.checkpoint_cu_starts, DType::f32); },
       "`checkpoint_cu_starts` must have dtype int32 or int64; got float32"},
      {"cu_starts strided",
       [](auto&, auto& a) { a.checkpoint_cu_starts = with_stride(*a.checkpoint_cu_starts, 0, 2); },
       "`checkpoint_cu_starts` must be contiguous; got shape (3,) with strides (2,)"},
      {"dense checkpoints HV",
       [](auto& f, auto& a) {
         f.use_dense_checkpoints(a);
         a.state_checkpoints = with_size(*a.state_checkpoints, 1, 3);
       },
       "`state_checkpoints` must have shape [checkpoints, HV, V, K]=(2, 4, 8, 16); got (2, 3, 8, 16) (HV=4 "
       "from `v`)"},
      {"dense checkpoints strided",
       [](auto& f, auto& a) {
         f.use_dense_checkpoints(a);
         a.state_checkpoints = with_stride(*a.state_checkpoints, 0, 1024);
       },
       "`state_checkpoints` must be contiguous; got shape (2, 4, 8, 16) with strides (1024, 128, 16, 1)"},
      {"dense checkpoints dtype",
       [](auto& f, auto& a) {
         f.use_dense_checkpoints(a);
         a.state_checkpoints = with_dtype(*a.state_checkpoints, DType::i32);
       },
       "`state_checkpoints` must have dtype float32, bfloat16 or float16; got int32"},
      {"dense checkpoints on another device",
       [](auto& f, auto& a) {
         f.use_dense_checkpoints(a);
         a.state_checkpoints = on_cuda(*a.state_checkpoints);
       },
       "All inputs must be on the same device: `q` is on cpu, `state_checkpoints` is on cuda:0"},
      {"checkpoint slots without a pool",
       [](auto& f, auto& a) {
         f.use_dense_state(a);
         a.output_state_indices.reset();
       },
       "`checkpoint_slot_indices` name slots of the `initial_state` pool, but no `initial_state_indices` "
       "were given"},
      {"checkpoint slots 2D", [](auto&, auto& a) { a.checkpoint_slot_indices = with_ndim(*a.checkpoint_slot_indices, 2); },
       "`checkpoint_slot_indices` must be a 1D tensor [checkpoints]; got shape (2, 1)"},
      {"checkpoint slots dtype",
       [](auto&, auto& a) { a.checkpoint_slot_indices = with_dtype(*a.checkpoint_slot_indices, DType::f32); },
       "`checkpoint_slot_indices` must have dtype int32 or int64; got float32"},
      // ---- workspace
      {"no workspace", [](auto&, auto& a) { a.workspace.reset(); },
       op + " needs a workspace of " + std::to_string(need) + " bytes (chunk_prefill_workspace_bytes); none "
            "was given"},
      {"workspace too small", [](auto&, auto& a) { a.workspace = with_size(*a.workspace, 0, 3); },
       "`workspace` has 12 bytes; " + op + " needs " + std::to_string(need) + " (chunk_prefill_workspace_bytes)"},
      {"workspace strided", [](auto&, auto& a) { a.workspace = with_stride(*a.workspace, 0, 2); },
       "`workspace` must be contiguous; got shape " + ws_shape + " with strides (2,)"},
      {"workspace misaligned",
       [need](auto& f, auto& a) {  // the allocation is 256-byte aligned; 4 bytes in, same size
         a.workspace = TensorView::contiguous(static_cast<char*>(f.ws.view().data) + 4, DType::f32, {need / 4});
       },
       "`workspace` must be 16-byte aligned; its address is 4 bytes past a multiple of 16"},
      {"workspace on another device", [](auto&, auto& a) { a.workspace = on_cuda(*a.workspace); },
       "All inputs must be on the same device: `q` is on cpu, `workspace` is on cuda:0"},
      // ---- host data: checkpoint counts and slots
      {"cu_starts not starting at 0", [](auto& f, auto&) { write_indices(f.ck_cu, {1, 2, 3}); },
       "`checkpoint_cu_starts` must start at 0; got checkpoint_cu_starts[0]=1"},
      {"cu_starts count", [](auto& f, auto&) { write_indices(f.ck_cu, {0, 2, 3}); },
       "`checkpoint_cu_starts` must count len / 64 checkpoints per sequence: sequence 0 has 64 tokens and so "
       "1, but checkpoint_cu_starts[1] - checkpoint_cu_starts[0] = 2 - 0"},
      {"cu_starts count of the second sequence", [](auto& f, auto&) { write_indices(f.ck_cu, {0, 1, 1}); },
       "`checkpoint_cu_starts` must count len / 64 checkpoints per sequence: sequence 1 has 70 tokens and so "
       "1, but checkpoint_cu_starts[2] - checkpoint_cu_starts[1] = 1 - 1"},
      {"dense checkpoints too few rows",
       [](auto& f, auto& a) {
         f.use_dense_checkpoints(a);
         a.state_checkpoints = with_size(*a.state_checkpoints, 0, 1);
       },
       "`state_checkpoints` has 1 rows; checkpoint_cu_starts counts 2 checkpoints"},
      {"checkpoint slots too few",
       [](auto&, auto& a) { a.checkpoint_slot_indices = with_size(*a.checkpoint_slot_indices, 0, 1); },
       "`checkpoint_slot_indices` has 1 entries; checkpoint_cu_starts counts 2 checkpoints"},
      {"initial slot out of range", [](auto& f, auto&) { write_indices(f.idx, {1, 8}); },
       "`initial_state_indices`[1]=8 is out of range for a state pool of 8 slots (valid: 0..7; < 0 marks a "
       "padded row)"},
      {"duplicate initial slot", [](auto& f, auto&) { write_indices(f.idx, {3, 3}); },
       "`initial_state_indices` uses slot 3 for rows 0 and 1; each live row needs its own slot"},
      {"output slot out of range", [](auto& f, auto&) { write_indices(f.out_idx, {5, 8}); },
       "`output_state_indices`[1]=8 is out of range for a state pool of 8 slots (valid: 0..7; < 0 stores no "
       "final state)"},
      {"checkpoint slot out of range", [](auto& f, auto&) { write_indices(f.ck_slots, {0, 9}); },
       "`checkpoint_slot_indices`[1]=9 is out of range for a state pool of 8 slots (valid: 0..7; < 0 skips "
       "the checkpoint)"},
      {"two final states in one slot", [](auto& f, auto&) { write_indices(f.out_idx, {5, 5}); },
       "slot 5 would receive both the final state of sequence 0 and the final state of sequence 1; every "
       "written slot needs its own"},
      {"a checkpoint in a final state's slot", [](auto& f, auto&) { write_indices(f.ck_slots, {5, 2}); },
       "slot 5 would receive both the final state of sequence 0 and checkpoint 0 of sequence 0; every "
       "written slot needs its own"},
      {"two checkpoints in one slot", [](auto& f, auto&) { write_indices(f.ck_slots, {2, 2}); },
       "slot 2 would receive both checkpoint 0 of sequence 0 and checkpoint 0 of sequence 1; every written "
       "slot needs its own"},
      {"a final state in another sequence's initial slot", [](auto& f, auto&) { write_indices(f.out_idx, {3, 6}); },
       "slot 3 is the initial state of sequence 1 and would receive the final state of sequence 0; a "
       "sequence's initial slot may only receive its own final state"},
      {"a checkpoint in its own initial slot", [](auto& f, auto&) { write_indices(f.ck_slots, {1, 2}); },
       "slot 1 is the initial state of sequence 0 and would receive checkpoint 0 of sequence 0; a "
       "sequence's initial slot may only receive its own final state"},
      {"in place with a checkpoint in the slot",
       [](auto& f, auto& a) {
         a.output_state_indices.reset();
         write_indices(f.ck_slots, {0, 3});
       },
       "slot 3 is the initial state of sequence 1 and would receive checkpoint 0 of sequence 1; a "
       "sequence's initial slot may only receive its own final state"},
  };
  if (kda) {
    list.push_back(
        {"g shape", [](auto&, auto& a) { a.g = with_size(a.g, 3, 8); },
         "`g` must have shape [B, T, HV, K]=(1, 134, 4, 16); got (1, 134, 4, 8) (K=16 from `q`)"});
    list.push_back({"g last-dim stride", [](auto&, auto& a) { a.g = with_stride(a.g, 3, 2); },
                    "`g` must be contiguous in its last dim; got strides (8576, 64, 16, 2)"});
  } else {
    list.push_back({"g shape", [](auto&, auto& a) { a.g = with_size(a.g, 2, 5); },
                    "`g` must have shape [B, T, HV]=(1, 134, 4); got (1, 134, 5) (HV=4 from `v`)"});
  }
  return list;
}

TEST(ChunkPrefillContracts, Gdn) { expect_rejections(cases(false), false); }
TEST(ChunkPrefillContracts, Kda) { expect_rejections(cases(true), true); }

// Calls the validator accepts: padded sequences (any negative index) whose output and checkpoint
// slots are ignored, even out of range; skipped checkpoints; final states in place; a skipped
// final state; envelope pools; dense checkpoints and states; no state at all; unchecked indices.
TEST(ChunkPrefillContracts, Accepts) {
  for (bool kda : {false, true}) {
    SCOPED_TRACE(kda ? "kda" : "gdn");
    auto accepts = [&](const char* what,
                       const std::function<void(Fixture&, ChunkPrefillArgs&)>& mutate) {
      SCOPED_TRACE(what);
      Fixture f(kda);
      ChunkPrefillArgs a = f.args;
      mutate(f, a);
      EXPECT_NO_THROW(f.run(a));
    };
    accepts("padded sequence with out-of-range slots", [](auto& f, auto&) {
      write_indices(f.idx, {-7, 3});
      write_indices(f.out_idx, {99, 6});
      write_indices(f.ck_slots, {99, 2});
    });
    accepts("skipped checkpoints and final state", [](auto& f, auto&) {
      write_indices(f.out_idx, {-1, 6});
      write_indices(f.ck_slots, {-1, -5});
    });
    accepts("in place", [](auto&, auto& a) { a.output_state_indices.reset(); });
    accepts("final state in place via output_state_indices", [](auto& f, auto&) {
      write_indices(f.out_idx, {1, 3});
    });
    accepts("last slot", [](auto& f, auto&) { write_indices(f.out_idx, {7, 6}); });
    accepts("dense checkpoints and state", [](auto& f, auto& a) {
      f.use_dense_state(a);
      f.use_dense_checkpoints(a);
      a.output_state_indices.reset();
    });
    accepts("no state", [](auto& f, auto& a) {
      a.initial_state.reset();
      a.initial_state_indices.reset();
      a.has_initial_state.reset();
      a.output_state_indices.reset();
      f.use_dense_checkpoints(a);
    });
    accepts("no checkpoints", [](auto&, auto& a) {
      a.checkpoint_every_n_tokens = 0;
      a.checkpoint_cu_starts.reset();
      a.checkpoint_slot_indices.reset();
    });
    // Twice the size, in another dtype.
    const Tensor big = Tensor::contiguous(DType::bf16, {Fixture(kda).workspace_bytes()});
    accepts("workspace larger than needed, another dtype",
            [&big](auto&, auto& a) { a.workspace = big.view(); });
  }
}

// An envelope pool (slot stride far beyond HV*V*K) is a pool like any other.
TEST(ChunkPrefillContracts, AcceptsEnvelopePool) {
  Fixture f(true);
  Tensor envelope = make_pool(DType::bf16, 8, kSmall, 1000, 24);
  ChunkPrefillArgs a = f.args;
  a.initial_state = envelope.view();
  EXPECT_NO_THROW(f.run(a));
}

// CUDA tensors, before any write: in a build without CUDA the workspace query and the op say so
// (not_implemented); in a CUDA build the query answers from the shapes alone (no device needed)
// and the op refuses the mixed devices.
TEST(ChunkPrefillContracts, CudaTensors) {
  Fixture f(false);
  ChunkPrefillArgs a = f.args;
  a.q = on_cuda(a.q);
  const Snapshot before = f.snapshot();
  if (deltastate::cuda_built()) {
    EXPECT_EQ(deltastate::chunk_prefill_workspace_bytes(a), 0) << "small states need no workspace";
    const auto e = catch_error([&] { deltastate::chunk_prefill(a); });
    ASSERT_TRUE(e);
    EXPECT_EQ(e->kind(), ErrorKind::value);
    EXPECT_EQ(std::string(e->what()),
              "All inputs must be on the same device: `q` is on cuda:0, `k` is on cpu");
  } else {
    for (int op = 0; op < 2; ++op) {
      const auto e = catch_error([&] {
        if (op) deltastate::chunk_prefill(a);
        else deltastate::chunk_prefill_workspace_bytes(a);
      });
      ASSERT_TRUE(e);
      EXPECT_EQ(e->kind(), ErrorKind::not_implemented);
      EXPECT_EQ(std::string(e->what()),
                "deltastate was built without CUDA support (no CUDA toolkit at configure time); "
                "CUDA tensors cannot be used. Rebuild with nvcc available, or pass CPU tensors.");
    }
  }
  EXPECT_TRUE(before.unchanged());
}

}  // namespace
}  // namespace dstest
