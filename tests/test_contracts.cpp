// Every error of the three validators (src/contracts/packed_decode.cpp, recurrent.cpp,
// replayssm_decode.cpp), each from a minimal bad input: the exact message (the reference
// implementation's text where it defines one), ErrorKind::value, and no change to any caller
// memory (every buffer is snapshotted before the call and compared byte for byte after it); and
// the CUDA kernels' limits, which the validators check for CUDA tensors (not_implemented).
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>

#include "test_util.h"
#include "view_edits.h"

namespace dstest {
namespace {

using deltastate::Error;
using deltastate::ErrorKind;
using deltastate::PackedDecodeArgs;
using deltastate::RecurrentArgs;
using deltastate::ReplayDecodeArgs;

constexpr double kInf = std::numeric_limits<double>::infinity();

void write_indices(const TensorView& idx, std::initializer_list<int64_t> values) {
  int64_t i = 0;
  for (int64_t v : values)
    store_value(idx.data, idx.dtype, i++ * idx.stride[0], static_cast<double>(v));
}

template <class Fixture, class Args>
struct Case {
  const char* what;
  std::function<void(Fixture&, Args&)> mutate;
  std::string message;
};

// The fixture's own arguments are valid; each case's mutation must be rejected with its message,
// leaving every buffer of the fixture unchanged.
template <class Fixture, class Args>
void expect_rejections(const std::vector<Case<Fixture, Args>>& cases, bool kda) {
  {
    Fixture f(kda);
    EXPECT_NO_THROW(f.run(f.args)) << "the unmutated arguments must be valid";
  }
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    Fixture f(kda);
    Args args = f.args;
    c.mutate(f, args);
    const Snapshot before = f.snapshot();
    const std::optional<Error> e = catch_error([&] { f.run(args); });
    if (!e) continue;
    EXPECT_EQ(std::string(e->what()), c.message);
    EXPECT_EQ(e->kind(), ErrorKind::value);
    EXPECT_TRUE(before.unchanged()) << "a rejected call changed caller memory";
  }
}

// ==== packed decode ============================================================================
// H=2, HV=4, K=8, V=16 (width 96), B=3 (row 1 padded), 5 slots.
constexpr Shape kSmall{"small", 2, 4, 8, 16};

struct PackedFixture {
  bool kda;
  Tensor pool;
  DecodeBatch batch;
  PackedDecodeArgs args;
  explicit PackedFixture(bool kda_) : kda(kda_) {
    Rng rng = test_rng(kda);
    pool = make_pool(DType::f32, 5, kSmall);
    const std::vector<int64_t> slots{3, -1, 0};
    fill_live_slots(pool.view(), slots, rng);
    batch = make_decode_batch(rng, kSmall, kda, slots, DType::f32);
    args = batch.packed_args(host_view, pool.view(), 0.35,
                             kda ? std::optional<double>(-5.0) : std::nullopt);
  }
  void run(const PackedDecodeArgs& a) const {
    if (kda) deltastate::kda_packed_decode(a);
    else deltastate::gdn_packed_decode(a);
  }
  Snapshot snapshot() const {
    Snapshot s;
    for (const Tensor* t : {&pool, &batch.x, &batch.a, &batch.b, &batch.A_log, &batch.dt_bias,
                            &batch.out, &batch.idx})
      s.add(*t);
    return s;
  }
};
using PCase = Case<PackedFixture, PackedDecodeArgs>;

// Checks shared by GDN and KDA, in the validator's order.
std::vector<PCase> packed_common_cases(bool kda) {
  const std::string suffix =
      kda ? " KDA packed decode requires num_q_heads == num_k_heads and head_q_dim == head_k_dim."
          : "";
  return {
      {"mixed_qkv 3D", [](auto&, auto& a) { a.mixed_qkv = with_ndim(a.mixed_qkv, 3); },
       "`mixed_qkv` must be a 2D tensor (got ndim=3)."},
      {"mixed_qkv last-dim stride",
       [](auto&, auto& a) { a.mixed_qkv = with_stride(a.mixed_qkv, 1, 2); },
       "`mixed_qkv` must be contiguous in the last dim. `mixed_qkv` has strides (96, 2); expected "
       "a "
       "last stride of 1."},
      {"a 1D", [](auto&, auto& a) { a.a = with_ndim(a.a, 1); },
       "`a` and `b` must be 2D tensors (got a.ndim=1, b.ndim=2)."},
      {"b 3D", [](auto&, auto& a) { a.b = with_ndim(a.b, 3); },
       "`a` and `b` must be 2D tensors (got a.ndim=2, b.ndim=3)."},
      {"a last-dim stride", [](auto&, auto& a) { a.a = with_stride(a.a, 1, 2); },
       std::string("`a`/`b` must be contiguous in the last dim. `a` has strides (") +
           (kda ? "32" : "4") + ", 2); expected a last stride of 1."},
      {"b last-dim stride", [](auto&, auto& a) { a.b = with_stride(a.b, 1, 3); },
       "`a`/`b` must be contiguous in the last dim. `b` has strides (4, 3); expected a last stride "
       "of 1."},
      {"A_log 2D", [](auto&, auto& a) { a.A_log = with_ndim(a.A_log, 2); },
       "`A_log`/`dt_bias` must be 1D tensors."},
      {"dt_bias 0D", [](auto&, auto& a) { a.dt_bias = with_ndim(a.dt_bias, 0); },
       "`A_log`/`dt_bias` must be 1D tensors."},
      {"A_log strided", [](auto&, auto& a) { a.A_log = with_stride(a.A_log, 0, 2); },
       "`A_log`/`dt_bias` must be contiguous. `A_log` has strides (2,) for shape (4,); expected "
       "(1,)."},
      {"dt_bias strided", [](auto&, auto& a) { a.dt_bias = with_stride(a.dt_bias, 0, 2); },
       std::string("`A_log`/`dt_bias` must be contiguous. `dt_bias` has strides (2,) for shape (") +
           (kda ? "32" : "4") + ",); expected (1,)."},
      {"indices 2D", [](auto&, auto& a) { a.state_indices = with_ndim(a.state_indices, 2); },
       "`ssm_state_indices` must be 1D for packed decode (got ndim=2)."},
      {"out strided", [](auto&, auto& a) { a.out = with_stride(a.out, 3, 2); },
       "`out` must be contiguous."
       " `out` has strides (64, 64, 16, 2) for shape (3, 1, 4, 16); expected (64, 64, 16, 1)."},
      {"a on another device", [](auto&, auto& a) { a.a = on_cuda(a.a); },
       "All inputs must be on the same device."},
      {"state on another device", [](auto&, auto& a) { a.state = on_cuda(a.state); },
       "All inputs must be on the same device."},
      {"indices on another device",
       [](auto&, auto& a) { a.state_indices = on_cuda(a.state_indices); },
       "All inputs must be on the same device."},
      {"a batch", [](auto&, auto& a) { a.a = with_size(a.a, 0, 2); },
       "Mismatched batch sizes: mixed_qkv.shape[0]=3, a.shape[0]=2, b.shape[0]=3."},
      {"b batch", [](auto&, auto& a) { a.b = with_size(a.b, 0, 4); },
       "Mismatched batch sizes: mixed_qkv.shape[0]=3, a.shape[0]=3, b.shape[0]=4."},
      {"indices length", [](auto&, auto& a) { a.state_indices = with_size(a.state_indices, 0, 2); },
       "`ssm_state_indices` must have shape [B] (got (2,); expected (3,))."},
      {"state 3D", [](auto&, auto& a) { a.state = with_ndim(a.state, 3); },
       "`initial_state` must be a 4D tensor (got ndim=3)."},
      {"state last-dim stride", [](auto&, auto& a) { a.state = with_stride(a.state, 3, 2); },
       "`initial_state` must be contiguous in the last dim."
       " `initial_state` has strides (512, 128, 8, 2); expected a last stride of 1."},
      {"state inner strides", [](auto&, auto& a) { a.state = with_stride(a.state, 2, 9); },
       "`initial_state` must be contiguous in its [HV, V, K] inner dimensions; an arbitrary slot "
       "stride is supported."
       " `initial_state` has strides (512, 128, 9, 1); expected (any, 128, 8, 1)."},
      {"state head stride", [](auto&, auto& a) { a.state = with_stride(a.state, 1, 136); },
       "`initial_state` must be contiguous in its [HV, V, K] inner dimensions; an arbitrary slot "
       "stride is supported."
       " `initial_state` has strides (512, 136, 8, 1); expected (any, 128, 8, 1)."},
      {"out shape",
       [](auto&, auto& a) {
         a.out = reshaped(a.out, {3, 4, 16});
       },
       "`out` must have shape (3, 1, 4, 16) (got out.shape=(3, 4, 16))."},
      {"out V",
       [](auto&, auto& a) {
         a.out = reshaped(a.out, {3, 1, 4, 15});
       },
       "`out` must have shape (3, 1, 4, 16) (got out.shape=(3, 1, 4, 15))."},
      {"width = HV*V", [](auto&, auto& a) { a.mixed_qkv = with_size(a.mixed_qkv, 1, 64); },
       "Invalid packed `mixed_qkv` last dim=64 for HV=4, V=16."},
      {"width odd", [](auto&, auto& a) { a.mixed_qkv = with_size(a.mixed_qkv, 1, 95); },
       "Invalid packed `mixed_qkv` last dim=95 for HV=4, V=16."},
      {"q size not a multiple of K",
       [](auto&, auto& a) { a.mixed_qkv = with_size(a.mixed_qkv, 1, 82); },
       "Invalid packed Q size 9: must be divisible by K=8." + suffix},
      {"HV not a multiple of H",
       [](auto&, auto& a) { a.mixed_qkv = with_size(a.mixed_qkv, 1, 112); },
       "Invalid head config inferred from mixed_qkv: H=3, HV=4."},
      {"mixed_qkv dtype", [](auto&, auto& a) { a.mixed_qkv = with_dtype(a.mixed_qkv, DType::i32); },
       "`mixed_qkv` must have dtype float32, bfloat16 or float16; got int32"},
      {"a dtype", [](auto&, auto& a) { a.a = with_dtype(a.a, DType::i32); },
       "`a` must have dtype float32, bfloat16 or float16; got int32"},
      {"b dtype", [](auto&, auto& a) { a.b = with_dtype(a.b, DType::i64); },
       "`b` must have dtype float32, bfloat16 or float16; got int64"},
      {"A_log dtype", [](auto&, auto& a) { a.A_log = with_dtype(a.A_log, DType::i32); },
       "`A_log` must have dtype float32, bfloat16 or float16; got int32"},
      {"dt_bias dtype", [](auto&, auto& a) { a.dt_bias = with_dtype(a.dt_bias, DType::i32); },
       "`dt_bias` must have dtype float32, bfloat16 or float16; got int32"},
      {"state dtype", [](auto&, auto& a) { a.state = with_dtype(a.state, DType::i32); },
       "`initial_state` must have dtype float32, bfloat16 or float16; got int32"},
      {"out dtype", [](auto&, auto& a) { a.out = with_dtype(a.out, DType::i32); },
       "`out` must have dtype float32, bfloat16 or float16; got int32"},
      {"indices dtype",
       [](auto&, auto& a) { a.state_indices = with_dtype(a.state_indices, DType::f32); },
       "`ssm_state_indices` must have dtype int32 or int64; got float32"},
      {"scale 0", [](auto&, auto& a) { a.scale = 0.0; }, "scale must be positive (got 0)"},
      {"scale negative", [](auto&, auto& a) { a.scale = -1.0; }, "scale must be positive (got -1)"},
      {"scale inf", [](auto&, auto& a) { a.scale = kInf; }, "scale must be positive (got inf)"},
      {"scale nan", [](auto&, auto& a) { a.scale = std::nan(""); },
       "scale must be positive (got nan)"},
      {"slot out of range",
       [](auto& f, auto&) {
         write_indices(f.batch.idx.view(), {3, -1, 5});
       },
       "`ssm_state_indices`[2]=5 is out of range for a state pool of 5 slots (valid: 0..4; < 0 "
       "marks a "
       "padded row)"},
      {"duplicate slot",
       [](auto& f, auto&) {
         write_indices(f.batch.idx.view(), {3, 3, -1});
       },
       "`ssm_state_indices` uses slot 3 for rows 0 and 1; each live row needs its own slot"},
  };
}

TEST(Contracts, GdnPackedDecode) {
  std::vector<PCase> cases = packed_common_cases(false);
  const std::vector<PCase> gdn = {
      {"a cols", [](auto&, auto& a) { a.a = with_size(a.a, 1, 5); },
       "`a`/`b` must have shape [B, HV] with HV=4 (got a.shape=(3, 5), b.shape=(3, 4))."},
      {"b cols", [](auto&, auto& a) { a.b = with_size(a.b, 1, 3); },
       "`a`/`b` must have shape [B, HV] with HV=4 (got a.shape=(3, 4), b.shape=(3, 3))."},
      {"A_log numel", [](auto&, auto& a) { a.A_log = with_size(a.A_log, 0, 3); },
       "`A_log` and `dt_bias` must have 4 elements (got A_log.numel()=3, dt_bias.numel()=4)."},
      {"dt_bias numel", [](auto&, auto& a) { a.dt_bias = with_size(a.dt_bias, 0, 5); },
       "`A_log` and `dt_bias` must have 4 elements (got A_log.numel()=4, dt_bias.numel()=5)."},
      // FLA's default layout [slots, HV, K, V] with K != V: SGLang's text, then the cause.
      {"K-first state",
       [](auto&, auto& a) {
         a.state = reshaped(a.state, {5, 4, 8, 16});
       },
       "`out` must have shape (3, 1, 4, 8) (got out.shape=(3, 1, 4, 16)). `initial_state` (5, 4, "
       "8, 16) looks K-first [slots, HV, K, V]: packed decode takes the pool's V-first layout "
       "[slots, HV, V, K] (FLA: state_v_first=True; deltastate never transposes a state behind "
       "the caller's back)."},
  };
  cases.insert(cases.end(), gdn.begin(), gdn.end());
  expect_rejections(cases, false);
}

TEST(Contracts, KdaPackedDecode) {
  std::vector<PCase> cases = packed_common_cases(true);
  const std::vector<PCase> kda = {
      {"a cols", [](auto&, auto& a) { a.a = with_size(a.a, 1, 4); },
       "`a` must have shape [B, HV*K] with HV=4, K=8 (got a.shape=(3, 4))."},
      {"b cols", [](auto&, auto& a) { a.b = with_size(a.b, 1, 5); },
       "`b` must have shape [B, HV] with HV=4 (got b.shape=(3, 5))."},
      {"A_log numel", [](auto&, auto& a) { a.A_log = with_size(a.A_log, 0, 3); },
       "`A_log` must have 4 elements (got 3)."},
      {"dt_bias numel", [](auto&, auto& a) { a.dt_bias = with_size(a.dt_bias, 0, 4); },
       "`dt_bias` must have 32 elements (got 4)."},
      {"lower_bound inf", [](auto&, auto& a) { a.lower_bound = -kInf; },
       "lower_bound must be finite (got -inf)"},
  };
  cases.insert(cases.end(), kda.begin(), kda.end());
  expect_rejections(cases, true);
}

// Padded rows may repeat (-1 twice) and an index equal to slots-1 is in range.
TEST(Contracts, PackedDecodeAcceptsRepeatedPaddingAndLastSlot) {
  PackedFixture f(false);
  write_indices(f.batch.idx.view(), {-1, 4, -1});
  EXPECT_NO_THROW(f.run(f.args));
}

// ==== recurrent ================================================================================
// B=2, T=3 (or varlen: B=1, T=5, cu_seqlens {0, 2, 5}), H=2, HV=4, K=16, V=8; pool of 4 slots,
// indices {1, 3}; in-kernel gate; final_state.
constexpr Shape kRec{"rec", 2, 4, 16, 8};

struct RecurrentFixture {
  bool kda;
  RecurrentBatch rb;
  Tensor pool, idx, final_state;
  RecurrentArgs args;
  explicit RecurrentFixture(bool kda_, bool varlen = false) : kda(kda_) {
    Rng rng = test_rng(kda + 2 * varlen);
    RecurrentSpec spec;
    spec.s = kRec;
    spec.kda = kda;
    spec.B = 2;
    spec.T = 3;
    if (varlen) spec.seqlens = {2, 3};
    rb = make_recurrent_batch(rng, spec);
    pool = make_pool(DType::f32, 4, kRec);
    fill_slot(pool.view(), 1, rng);
    fill_slot(pool.view(), 3, rng);
    idx = index_tensor({1, 3});
    final_state = Tensor::contiguous(DType::f32, {2, kRec.HV, kRec.V, kRec.K});
    args = rb.args(host_view);
    args.state = pool.view();
    args.state_indices = idx.view();
    args.final_state = final_state.view();
  }
  void run(const RecurrentArgs& a) const {
    if (kda) deltastate::recurrent_kda(a);
    else deltastate::recurrent_gdn(a);
  }
  Snapshot snapshot() const {
    Snapshot s;
    for (const Tensor* t : {&rb.q, &rb.k, &rb.v, &rb.g, &rb.beta, &rb.out, &rb.A_log, &rb.dt_bias,
                            &pool, &idx, &final_state})
      s.add(*t);
    if (!rb.spec.seqlens.empty()) s.add(rb.cu);
    return s;
  }
};
struct VarlenFixture : RecurrentFixture {
  explicit VarlenFixture(bool kda_) : RecurrentFixture(kda_, true) {}
};
using RCase = Case<RecurrentFixture, RecurrentArgs>;
using VCase = Case<VarlenFixture, RecurrentArgs>;

std::vector<RCase> recurrent_cases(bool kda) {
  const std::string op = kda ? "recurrent_kda" : "recurrent_gated_delta_rule";
  std::vector<RCase> cases = {
      {"q 3D", [](auto&, auto& a) { a.q = with_ndim(a.q, 3); },
       "`q` must be a 4D tensor [B, T, H, K]; got shape (2, 3, 2)"},
      {"k K", [](auto&, auto& a) { a.k = with_size(a.k, 3, 15); },
       "`k` must have shape [B, T, H, K]=(2, 3, 2, 16); got (2, 3, 2, 15) (K=16 from `q`)"},
      {"k B and T",
       [](auto&, auto& a) {
         a.k = reshaped(a.k, {1, 6, 2, 16});
       },
       "`k` must have shape [B, T, H, K]=(2, 3, 2, 16); got (1, 6, 2, 16) (B=2 from `q`; T=3 from "
       "`q`)"},
      {"v B", [](auto&, auto& a) { a.v = with_size(a.v, 0, 3); },
       "`v` must have shape [B, T, HV, V]=(2, 3, 4, 8); got (3, 3, 4, 8) (B=2 from `q`)"},
      {"beta 4D", [](auto&, auto& a) { a.beta = with_ndim(a.beta, 4); },
       "`beta` must be a 3D tensor [B, T, HV]; got shape (2, 3, 4, 1)"},
      {"out V", [](auto&, auto& a) { a.out = with_size(a.out, 3, 9); },
       "`out` must have shape [B, T, HV, V]=(2, 3, 4, 8); got (2, 3, 4, 9) (V=8 from `v`)"},
      {"HV not a multiple of H",
       [](auto&, auto& a) {
         a.v = with_size(a.v, 2, 3);
         a.g = with_size(a.g, 2, 3);
         a.beta = with_size(a.beta, 2, 3);
         a.out = with_size(a.out, 2, 3);
       },
       op + ": `v` has HV=3 heads and `q`/`k` have H=2; HV must be a positive multiple of H"},
      {"q last-dim stride", [](auto&, auto& a) { a.q = with_stride(a.q, 3, 2); },
       "`q` must be contiguous in its last dim; got strides (96, 32, 16, 2)"},
      {"k last-dim stride", [](auto&, auto& a) { a.k = with_stride(a.k, 3, 3); },
       "`k` must be contiguous in its last dim; got strides (96, 32, 16, 3)"},
      {"v last-dim stride", [](auto&, auto& a) { a.v = with_stride(a.v, 3, 2); },
       "`v` must be contiguous in its last dim; got strides (96, 32, 8, 2)"},
      {"out last-dim stride", [](auto&, auto& a) { a.out = with_stride(a.out, 3, 2); },
       "`out` must be contiguous in its last dim; got strides (96, 32, 8, 2)"},
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
      {"state K", [](auto&, auto& a) { a.state = with_size(*a.state, 3, 15); },
       "`initial_state` must have shape [slots, HV, V, K]=(4, 4, 8, 16); got (4, 4, 8, 15) (K=16 "
       "from `q`)"},
      {"state dtype", [](auto&, auto& a) { a.state = with_dtype(*a.state, DType::i32); },
       "`initial_state` must have dtype float32, bfloat16 or float16; got int32"},
      {"indices without a state",
       [](auto&, auto& a) {
         a.state.reset();
         a.update_state = false;
       },
       "`ssm_state_indices` index a state pool, but no `initial_state` pool was given"},
      {"indices length", [](auto& f, auto& a) { a.state_indices = reshaped(f.idx.view(), {1}); },
       "The number of initial states is expected to be equal to the number of input sequences, "
       "i.e., 2 rather than 1."},
      {"indices dtype",
       [](auto&, auto& a) { a.state_indices = with_dtype(*a.state_indices, DType::f32); },
       "`ssm_state_indices` must have dtype int32 or int64; got float32"},
      {"per-sequence state count", [](auto&, auto& a) { a.state_indices.reset(); },
       "The number of initial states is expected to be equal to the number of input sequences, "
       "i.e., 2 rather than 4."},
      {"final_state N", [](auto&, auto& a) { a.final_state = with_size(*a.final_state, 0, 3); },
       "`final_state` must have shape [N, HV, V, K]=(2, 4, 8, 16); got (3, 4, 8, 16) (N=2 from "
       "`q`)"},
      {"final_state strided",
       [](auto&, auto& a) { a.final_state = with_stride(*a.final_state, 0, 1024); },
       "`final_state` must be contiguous; got shape (2, 4, 8, 16) with strides (1024, 128, 16, 1)"},
      {"final_state dtype",
       [](auto&, auto& a) { a.final_state = with_dtype(*a.final_state, DType::i32); },
       "`final_state` must have dtype float32, bfloat16 or float16; got int32"},
      {"update_state without a state",
       [](auto&, auto& a) {
         a.state.reset();
         a.state_indices.reset();
       },
       op + ": update_state needs a state pool (`initial_state`)"},
      {"in-kernel gate without A_log", [](auto&, auto& a) { a.A_log.reset(); },
       op + ": the in-kernel gate (use_gate_in_kernel) needs `A_log`"},
      {"A_log numel", [](auto&, auto& a) { a.A_log = with_size(*a.A_log, 0, 3); },
       "`A_log` must have 4 elements (got 3)."},
      {"A_log strided", [](auto&, auto& a) { a.A_log = with_stride(*a.A_log, 0, 2); },
       "`A_log` must be contiguous; got shape (4,) with strides (2,)"},
      {"A_log dtype", [](auto&, auto& a) { a.A_log = with_dtype(*a.A_log, DType::i64); },
       "`A_log` must have dtype float32, bfloat16 or float16; got int64"},
      {"dt_bias numel", [](auto&, auto& a) { a.dt_bias = with_size(*a.dt_bias, 0, 5); },
       kda ? "`dt_bias` must have 64 elements (got 5)."
           : "`dt_bias` must have 4 elements (got 5)."},
      {"dt_bias strided", [kda](auto&, auto& a) { a.dt_bias = with_stride(*a.dt_bias, 0, 2); },
       kda ? "`dt_bias` must be contiguous; got shape (64,) with strides (2,)"
           : "`dt_bias` must be contiguous; got shape (4,) with strides (2,)"},
      {"dt_bias dtype", [](auto&, auto& a) { a.dt_bias = with_dtype(*a.dt_bias, DType::i32); },
       "`dt_bias` must have dtype float32, bfloat16 or float16; got int32"},
      {"lower_bound inf", [](auto&, auto& a) { a.lower_bound = kInf; },
       "lower_bound must be finite (got inf)"},
      {"gate params without the in-kernel gate", [](auto&, auto& a) { a.gate_in_kernel = false; },
       op + ": `A_log`, `dt_bias` and lower_bound apply only with the in-kernel gate "
            "(use_gate_in_kernel=True); `g` is otherwise the log-space decay itself"},
      {"lower_bound without the in-kernel gate",
       [](auto&, auto& a) {
         a.gate_in_kernel = false;
         a.A_log.reset();
         a.dt_bias.reset();
         a.lower_bound = -5.0;
       },
       op + ": `A_log`, `dt_bias` and lower_bound apply only with the in-kernel gate "
            "(use_gate_in_kernel=True); `g` is otherwise the log-space decay itself"},
      {"scale negative", [](auto&, auto& a) { a.scale = -1.0; }, "scale must be positive (got -1)"},
      {"scale 0", [](auto&, auto& a) { a.scale = 0.0; }, "scale must be positive (got 0)"},
      {"k on another device", [](auto&, auto& a) { a.k = on_cuda(a.k); },
       "All inputs must be on the same device: `q` is on cpu, `k` is on cuda:0"},
      {"state on another device", [](auto&, auto& a) { a.state = on_cuda(*a.state); },
       "All inputs must be on the same device: `q` is on cpu, `initial_state` is on cuda:0"},
      {"final_state on another device",
       [](auto&, auto& a) { a.final_state = on_cuda(*a.final_state); },
       "All inputs must be on the same device: `q` is on cpu, `final_state` is on cuda:0"},
      {"slot out of range",
       [](auto& f, auto&) {
         write_indices(f.idx.view(), {1, 4});
       },
       "`ssm_state_indices`[1]=4 is out of range for a state pool of 4 slots (valid: 0..3; < 0 "
       "marks "
       "a padded row)"},
      {"duplicate slot",
       [](auto& f, auto&) {
         write_indices(f.idx.view(), {2, 2});
       },
       "`ssm_state_indices` uses slot 2 for rows 0 and 1; each live row needs its own slot"},
  };
  if (kda) {
    const std::vector<RCase> k = {
        {"g shape", [](auto&, auto& a) { a.g = with_size(a.g, 3, 8); },
         "`g` must have shape [B, T, HV, K]=(2, 3, 4, 16); got (2, 3, 4, 8) (K=16 from `q`)"},
        {"g last-dim stride", [](auto&, auto& a) { a.g = with_stride(a.g, 3, 2); },
         "`g` must be contiguous in its last dim; got strides (192, 64, 16, 2)"},
        // FlashInfer recurrent_kda's layout contract (_check_state_stride_contract)
        {"state 3D", [](auto&, auto& a) { a.state = with_ndim(*a.state, 3); },
         "recurrent_kda needs a [N, HV, V, K] state pool; got shape (4, 4, 8)"},
        {"state 5D", [](auto&, auto& a) { a.state = with_ndim(*a.state, 5); },
         "recurrent_kda needs a [N, HV, V, K] state pool; got shape (4, 4, 8, 16, 1)"},
        {"state inner strides", [](auto&, auto& a) { a.state = with_stride(*a.state, 2, 17); },
         "recurrent_kda state inner strides must be compact (V*K, K, 1)=(128, 16, 1); got (128, "
         "17, 1) "
         "(only the slot stride may be non-compact)"},
        {"state head stride", [](auto&, auto& a) { a.state = with_stride(*a.state, 1, 256); },
         "recurrent_kda state inner strides must be compact (V*K, K, 1)=(128, 16, 1); got (256, "
         "16, 1) "
         "(only the slot stride may be non-compact)"},
        {"state last stride", [](auto&, auto& a) { a.state = with_stride(*a.state, 3, 2); },
         "recurrent_kda state inner strides must be compact (V*K, K, 1)=(128, 16, 1); got (128, "
         "16, 2) "
         "(only the slot stride may be non-compact)"},
        {"slot stride not a multiple of 16",
         [](auto&, auto& a) { a.state = with_stride(*a.state, 0, 520); },
         "recurrent_kda state pool breaks the compiled stride contract: slot stride 520 elements "
         "must be "
         "a multiple of 16 and the base byte offset 0 a multiple of 32 (sym_int64(divisibility=16) "
         "/ "
         "assumed_align=32)"},
        {"base not 32-byte aligned",
         [](auto&, auto& a) {
           TensorView s = *a.state;  // the pool's allocation is 256-byte aligned
           s.data = static_cast<char*>(s.data) + 16;
           a.state = s;
         },
         "recurrent_kda state pool breaks the compiled stride contract: slot stride 512 elements "
         "must be "
         "a multiple of 16 and the base byte offset 16 a multiple of 32 "
         "(sym_int64(divisibility=16) / "
         "assumed_align=32)"},
    };
    cases.insert(cases.end(), k.begin(), k.end());
  } else {
    const std::vector<RCase> g = {
        {"g shape", [](auto&, auto& a) { a.g = with_size(a.g, 2, 5); },
         "`g` must have shape [B, T, HV]=(2, 3, 4); got (2, 3, 5) (HV=4 from `v`)"},
        {"state 3D", [](auto&, auto& a) { a.state = with_ndim(*a.state, 3); },
         "`initial_state` must be a 4D tensor (got ndim=3)."},
        {"state inner strides", [](auto&, auto& a) { a.state = with_stride(*a.state, 2, 17); },
         "`initial_state` must be contiguous in its [HV, V, K] inner dimensions; an arbitrary slot "
         "stride is supported."
         " `initial_state` has strides (512, 128, 17, 1); expected (any, 128, 16, 1)."},
    };
    cases.insert(cases.end(), g.begin(), g.end());
  }
  return cases;
}

std::vector<VCase> varlen_cases() {
  return {
      {"cu_seqlens with B > 1",
       [](auto& f, auto& a) {
         a.q = reshaped(a.q, {5, 1, 2, 16});
         a.k = reshaped(a.k, {5, 1, 2, 16});
         a.v = reshaped(a.v, {5, 1, 4, 8});
         a.g = f.kda ? reshaped(a.g, {5, 1, 4, 16}) : reshaped(a.g, {5, 1, 4});
         a.beta = reshaped(a.beta, {5, 1, 4});
         a.out = reshaped(a.out, {5, 1, 4, 8});
       },
       "The batch size is expected to be 1 rather than 5 when using `cu_seqlens`.Please flatten "
       "variable-length inputs before processing."},
      {"cu_seqlens 2D",
       [](auto&, auto& a) {
         a.cu_seqlens = reshaped(*a.cu_seqlens, {3, 1});
       },
       "`cu_seqlens` must be a 1D tensor [N+1]; got shape (3, 1)"},
      {"cu_seqlens empty", [](auto&, auto& a) { a.cu_seqlens = with_size(*a.cu_seqlens, 0, 0); },
       "`cu_seqlens` must be a 1D tensor [N+1]; got shape (0,)"},
      {"cu_seqlens dtype",
       [](auto&, auto& a) { a.cu_seqlens = with_dtype(*a.cu_seqlens, DType::f32); },
       "`cu_seqlens` must have dtype int32 or int64; got float32"},
      {"cu_seqlens strided",
       [](auto&, auto& a) { a.cu_seqlens = with_size(with_stride(*a.cu_seqlens, 0, 2), 0, 2); },
       "`cu_seqlens` must be contiguous; got shape (2,) with strides (2,)"},
      {"cu_seqlens on another device",
       [](auto&, auto& a) { a.cu_seqlens = on_cuda(*a.cu_seqlens); },
       "All inputs must be on the same device: `q` is on cpu, `cu_seqlens` is on cuda:0"},
      {"cu_seqlens not starting at 0",
       [](auto& f, auto&) {
         write_indices(f.rb.cu.view(), {1, 2, 5});
       },
       "`cu_seqlens` must start at 0 and be non-decreasing within [0, T=5]; got cu_seqlens[0]=1"},
      {"cu_seqlens decreasing",
       [](auto& f, auto&) {
         write_indices(f.rb.cu.view(), {0, 3, 2});
       },
       "`cu_seqlens` must start at 0 and be non-decreasing within [0, T=5]; got cu_seqlens[2]=2 "
       "after 3"},
      {"cu_seqlens past T",
       [](auto& f, auto&) {
         write_indices(f.rb.cu.view(), {0, 2, 6});
       },
       "`cu_seqlens` must start at 0 and be non-decreasing within [0, T=5]; got cu_seqlens[2]=6 "
       "after 2"},
      {"indices vs sequences",
       [](auto& f, auto& a) { a.cu_seqlens = with_size(f.rb.cu.view(), 0, 2); },
       "The number of initial states is expected to be equal to the number of input sequences, "
       "i.e., 1 rather than 2."},
  };
}

TEST(Contracts, RecurrentGdn) { expect_rejections(recurrent_cases(false), false); }
TEST(Contracts, RecurrentKda) { expect_rejections(recurrent_cases(true), true); }
TEST(Contracts, RecurrentVarlenGdn) { expect_rejections(varlen_cases(), false); }
TEST(Contracts, RecurrentVarlenKda) { expect_rejections(varlen_cases(), true); }

// The five messages the project's issue names, each checked on its own as well.
TEST(Contracts, NamedIssueMessages) {
  {
    RecurrentFixture f(true);
    RecurrentArgs a = f.args;
    a.state = reshaped(*a.state, {4, 32, 16});
    const auto e = catch_error([&] { f.run(a); });
    ASSERT_TRUE(e);
    EXPECT_EQ(std::string(e->what()),
              "recurrent_kda needs a [N, HV, V, K] state pool; got shape (4, 32, 16)");
  }
  {
    RecurrentFixture f(false);
    RecurrentArgs a = f.args;
    a.state = reshaped(*a.state, {4, 32, 16});
    const auto e = catch_error([&] { f.run(a); });
    ASSERT_TRUE(e);
    EXPECT_EQ(std::string(e->what()), "`initial_state` must be a 4D tensor (got ndim=3).");
  }
  {
    PackedFixture f(false);
    PackedDecodeArgs a = f.args;
    a.state = reshaped(a.state, {5, 32, 16});
    const auto e = catch_error([&] { f.run(a); });
    ASSERT_TRUE(e);
    EXPECT_EQ(std::string(e->what()), "`initial_state` must be a 4D tensor (got ndim=3).");
  }
}

// A padded sequence's index may be anything negative; slots-1 is in range.
TEST(Contracts, RecurrentAcceptsNegativeIndicesAndLastSlot) {
  RecurrentFixture f(true);
  write_indices(f.idx.view(), {-7, 3});
  EXPECT_NO_THROW(f.run(f.args));
}

// ==== ReplaySSM ================================================================================
// H=2, HV=4, K=8, V=16, B=3 (row 1 padded), L=4, 5 slots; force_flush given.
struct ReplayFixture {
  bool kda;
  Tensor pool, wp, ff;
  Rings rings;
  DecodeBatch batch;
  ReplayDecodeArgs args;
  explicit ReplayFixture(bool kda_, const Shape& shape = kSmall) : kda(kda_) {
    Rng rng = test_rng(kda);
    pool = make_pool(DType::f32, 5, shape);
    const std::vector<int64_t> slots{3, -1, 0};
    fill_live_slots(pool.view(), slots, rng);
    rings = make_rings(shape, kda, 5, 4, DType::f32, DType::f32);
    batch = make_decode_batch(rng, shape, kda, slots, DType::f32);
    wp = index_tensor({0, 0, 0});
    ff = index_tensor({0, 0, 1});
    args = replay_args(host_view, batch, pool.view(), rings.d.view(), rings.k.view(),
                       rings.g.view(), wp, &ff, 0.35);
  }
  void run(const ReplayDecodeArgs& a) const { deltastate::replayssm_decode(a); }
  Snapshot snapshot() const {
    Snapshot s;
    for (const Tensor* t : {&pool, &wp, &ff, &rings.d, &rings.k, &rings.g, &batch.x, &batch.a,
                            &batch.b, &batch.A_log, &batch.dt_bias, &batch.out, &batch.idx})
      s.add(*t);
    return s;
  }
};
using RSCase = Case<ReplayFixture, ReplayDecodeArgs>;

std::vector<RSCase> replay_cases(bool kda) {
  std::vector<RSCase> cases = {
      {"mixed_qkv 1D", [](auto&, auto& a) { a.mixed_qkv = with_ndim(a.mixed_qkv, 1); },
       "`mixed_qkv` must be 2D (got ndim=1)."},
      {"b 1D", [](auto&, auto& a) { a.b = with_ndim(a.b, 1); }, "`b` must be 2D (got b.ndim=1)."},
      {"A_log 2D", [](auto&, auto& a) { a.A_log = with_ndim(a.A_log, 2); },
       "`A_log` must be a 1D tensor."},
      {"state 3D", [](auto&, auto& a) { a.state = with_ndim(a.state, 3); },
       "`initial_state` must be 4D (got ndim=3)."},
      {"mixed_qkv last-dim stride",
       [](auto&, auto& a) { a.mixed_qkv = with_stride(a.mixed_qkv, 1, 2); },
       "`mixed_qkv` must be contiguous in the last dim."
       " `mixed_qkv` has strides (96, 2); expected a last stride of 1."},
      {"out strided", [](auto&, auto& a) { a.out = with_stride(a.out, 0, 1000); },
       "`out` must be contiguous."
       " `out` has strides (1000, 64, 16, 1) for shape (3, 1, 4, 16); expected (64, 64, 16, 1)."},
      {"write_pos int64", [](auto&, auto& a) { a.write_pos = with_dtype(a.write_pos, DType::i64); },
       "`write_pos` must be a contiguous 1D int32 tensor."},
      {"write_pos 2D",
       [](auto&, auto& a) {
         a.write_pos = reshaped(a.write_pos, {3, 1});
       },
       "`write_pos` must be a contiguous 1D int32 tensor."},
      {"write_pos strided",
       [](auto&, auto& a) { a.write_pos = with_size(with_stride(a.write_pos, 0, 2), 0, 2); },
       "`write_pos` must be a contiguous 1D int32 tensor."},
      {"force_flush int64",
       [](auto&, auto& a) { a.force_flush = with_dtype(*a.force_flush, DType::i64); },
       "`force_flush` must be a contiguous 1D int32 tensor or None."},
      {"force_flush 2D",
       [](auto&, auto& a) {
         a.force_flush = reshaped(*a.force_flush, {1, 3});
       },
       "`force_flush` must be a contiguous 1D int32 tensor or None."},
      {"state inner strides", [](auto&, auto& a) { a.state = with_stride(a.state, 2, 9); },
       "`initial_state` must be contiguous in its [HV, V, K] inner dimensions; an arbitrary slot "
       "stride "
       "is supported."
       " `initial_state` has strides (512, 128, 9, 1); expected (any, 128, 8, 1)."},
      {"state last stride", [](auto&, auto& a) { a.state = with_stride(a.state, 3, 2); },
       "`initial_state` must be contiguous in its [HV, V, K] inner dimensions; an arbitrary slot "
       "stride "
       "is supported."
       " `initial_state` has strides (512, 128, 8, 2); expected (any, 128, 8, 1)."},
      {"width = HV*V", [](auto&, auto& a) { a.mixed_qkv = with_size(a.mixed_qkv, 1, 64); },
       "Invalid packed `mixed_qkv` last dim=64 for HV=4, V=16."},
      {"width odd", [](auto&, auto& a) { a.mixed_qkv = with_size(a.mixed_qkv, 1, 97); },
       "Invalid packed `mixed_qkv` last dim=97 for HV=4, V=16."},
      {"q size not a multiple of K",
       [](auto&, auto& a) { a.mixed_qkv = with_size(a.mixed_qkv, 1, 82); },
       "Invalid packed `mixed_qkv` last dim=82 for HV=4, V=16, K=8."},
      {"HV not a multiple of H",
       [](auto&, auto& a) { a.mixed_qkv = with_size(a.mixed_qkv, 1, 112); },
       "Invalid head config inferred from mixed_qkv: H=3, HV=4."},
      {"b cols",
       [](auto&, auto& a) {
         a.b = reshaped(a.b, {3, 5});
       },
       "`b` must have contiguous shape (3, 4)."},
      {"b rows",
       [](auto&, auto& a) {
         a.b = reshaped(a.b, {2, 4});
       },
       "`b` must have contiguous shape (3, 4)."},
      {"b last dim strided", [](auto&, auto& a) { a.b = with_stride(a.b, 1, 2); },
       "`b` must have contiguous shape (3, 4)."},
      {"A_log numel", [](auto&, auto& a) { a.A_log = with_size(a.A_log, 0, 3); },
       "`A_log` must have contiguous shape (4,)."},
      {"A_log strided", [](auto&, auto& a) { a.A_log = with_stride(a.A_log, 0, 2); },
       "`A_log` must have contiguous shape (4,)."},
      {"d_cache V",
       [](auto&, auto& a) {
         a.d_cache = reshaped(a.d_cache, {5, 4, 4, 15});
       },
       "`d_cache` shape must be (5, 4, 4, 16) (got (5, 4, 4, 15))."},
      {"d_cache slots",
       [](auto&, auto& a) {
         a.d_cache = reshaped(a.d_cache, {4, 4, 4, 16});
       },
       "`d_cache` shape must be (5, 4, 4, 16) (got (4, 4, 4, 16))."},
      {"d_cache 3D",
       [](auto&, auto& a) {
         a.d_cache = reshaped(a.d_cache, {5, 4, 64});
       },
       "`d_cache` shape must be (5, 4, 64, 16) (got (5, 4, 64))."},
      {"L = 0",
       [](auto&, auto& a) {
         a.d_cache = reshaped(a.d_cache, {5, 4, 0, 16});
       },
       "ReplaySSM cache length must be at least 1."},
      {"d_cache strided", [](auto&, auto& a) { a.d_cache = with_stride(a.d_cache, 2, 32); },
       "ReplaySSM ring caches must be contiguous."
       " `d_cache` has strides (256, 64, 32, 1) for shape (5, 4, 4, 16); expected (256, 64, 16, "
       "1)."},
      {"k_cache strided", [](auto&, auto& a) { a.k_cache = with_stride(a.k_cache, 0, 100); },
       "ReplaySSM ring caches must be contiguous."
       " `k_cache` has strides (100, 32, 8, 1) for shape (5, 2, 4, 8); expected (64, 32, 8, 1)."},
      {"g_cache strided", [](auto&, auto& a) { a.g_cache = with_stride(a.g_cache, 1, 100); },
       "ReplaySSM ring caches must be contiguous." +
           std::string(kda ? " `g_cache` has strides (128, 100, 8, 1) for shape (5, 4, 4, 8); "
                             "expected (128, 32, 8, 1)."
                           : " `g_cache` has strides (16, 100, 1) for shape (5, 4, 4); expected "
                             "(16, 4, 1).")},
      {"k_cache K",
       [](auto&, auto& a) {
         a.k_cache = reshaped(a.k_cache, {5, 2, 4, 7});
       },
       "`k_cache` shape must be (5, 2, 4, 8) (got (5, 2, 4, 7))."},
      {"k_cache H",
       [](auto&, auto& a) {
         a.k_cache = reshaped(a.k_cache, {5, 4, 4, 8});
       },
       "`k_cache` shape must be (5, 2, 4, 8) (got (5, 4, 4, 8))."},
      {"k_cache L",
       [](auto&, auto& a) {
         a.k_cache = reshaped(a.k_cache, {5, 2, 3, 8});
       },
       "`k_cache` shape must be (5, 2, 4, 8) (got (5, 2, 3, 8))."},
      {"g_cache bf16", [](auto&, auto& a) { a.g_cache = with_dtype(a.g_cache, DType::bf16); },
       "`g_cache` must be float32 (got bfloat16)."},
      {"g_cache f16", [](auto&, auto& a) { a.g_cache = with_dtype(a.g_cache, DType::f16); },
       "`g_cache` must be float32 (got float16)."},
      {"out shape",
       [](auto&, auto& a) {
         a.out = reshaped(a.out, {3, 4, 16});
       },
       "`out` must have shape (3, 1, 4, 16) (got (3, 4, 16))."},
      {"indices int64",
       [](auto&, auto& a) { a.state_indices = with_dtype(a.state_indices, DType::i64); },
       "`ssm_state_indices` must be a 1D int32 tensor."},
      {"indices 2D",
       [](auto&, auto& a) {
         a.state_indices = reshaped(a.state_indices, {3, 1});
       },
       "`ssm_state_indices` must be a 1D int32 tensor."},
      {"write_pos length", [](auto&, auto& a) { a.write_pos = with_size(a.write_pos, 0, 2); },
       "`write_pos` and `ssm_state_indices` must both have length B=3 (got 2, 3)."},
      {"indices length", [](auto&, auto& a) { a.state_indices = with_size(a.state_indices, 0, 4); },
       "`write_pos` and `ssm_state_indices` must both have length B=3 (got 3, 4)."},
      {"force_flush length",
       [](auto&, auto& a) { a.force_flush = with_size(*a.force_flush, 0, 2); },
       "`force_flush` must have length B=3."},
      {"a on another device", [](auto&, auto& a) { a.a = on_cuda(a.a); },
       "ReplaySSM inputs must be on the same device."},
      {"g_cache on another device", [](auto&, auto& a) { a.g_cache = on_cuda(a.g_cache); },
       "ReplaySSM inputs must be on the same device."},
      {"force_flush on another device",
       [](auto&, auto& a) { a.force_flush = on_cuda(*a.force_flush); },
       "ReplaySSM inputs must be on the same device."},
      {"mixed_qkv dtype", [](auto&, auto& a) { a.mixed_qkv = with_dtype(a.mixed_qkv, DType::i32); },
       "`mixed_qkv` must have dtype float32, bfloat16 or float16; got int32"},
      {"a dtype", [](auto&, auto& a) { a.a = with_dtype(a.a, DType::i32); },
       "`a` must have dtype float32, bfloat16 or float16; got int32"},
      {"b dtype", [](auto&, auto& a) { a.b = with_dtype(a.b, DType::i32); },
       "`b` must have dtype float32, bfloat16 or float16; got int32"},
      {"A_log dtype", [](auto&, auto& a) { a.A_log = with_dtype(a.A_log, DType::i32); },
       "`A_log` must have dtype float32, bfloat16 or float16; got int32"},
      {"dt_bias dtype", [](auto&, auto& a) { a.dt_bias = with_dtype(a.dt_bias, DType::i32); },
       "`dt_bias` must have dtype float32, bfloat16 or float16; got int32"},
      {"state dtype", [](auto&, auto& a) { a.state = with_dtype(a.state, DType::i32); },
       "`initial_state` must have dtype float32, bfloat16 or float16; got int32"},
      {"d_cache dtype", [](auto&, auto& a) { a.d_cache = with_dtype(a.d_cache, DType::i32); },
       "`d_cache` must have dtype float32, bfloat16 or float16; got int32"},
      {"k_cache dtype", [](auto&, auto& a) { a.k_cache = with_dtype(a.k_cache, DType::i32); },
       "`k_cache` must have dtype float32, bfloat16 or float16; got int32"},
      {"out dtype", [](auto&, auto& a) { a.out = with_dtype(a.out, DType::i32); },
       "`out` must have dtype float32, bfloat16 or float16; got int32"},
      {"scale 0", [](auto&, auto& a) { a.scale = 0.0; }, "scale must be positive (got 0)"},
      {"scale nan", [](auto&, auto& a) { a.scale = std::nan(""); },
       "scale must be positive (got nan)"},
      {"lower_bound nan", [](auto&, auto& a) { a.lower_bound = std::nan(""); },
       "lower_bound must be finite (got nan)"},
      {"slot out of range",
       [](auto& f, auto&) {
         write_indices(f.batch.idx.view(), {5, -1, 0});
       },
       "`ssm_state_indices`[0]=5 is out of range for a state pool of 5 slots (valid: 0..4; < 0 "
       "marks a "
       "padded row)"},
      {"duplicate slot",
       [](auto& f, auto&) {
         write_indices(f.batch.idx.view(), {0, -1, 0});
       },
       "`ssm_state_indices` uses slot 0 for rows 0 and 2; each live row needs its own slot"},
      {"write_pos past the ring",
       [](auto& f, auto&) {
         write_indices(f.wp.view(), {0, 0, 4});
       },
       "`write_pos`[2]=4 is outside the ring [0, L-1=3]"},
      {"write_pos negative",
       [](auto& f, auto&) {
         write_indices(f.wp.view(), {-1, 0, 0});
       },
       "`write_pos`[0]=-1 is outside the ring [0, L-1=3]"},
  };
  if (kda) {
    const std::vector<RSCase> k = {
        {"KDA a shape", [](auto&, auto& a) { a.a = with_size(a.a, 1, 31); },
         "KDA `a` must have shape (3, 4, 8) (got (3, 31))."},
        {"KDA a 3D shape",
         [](auto&, auto& a) {
           a.a = reshaped(a.a, {3, 8, 4});
         },
         "KDA `a` must have shape (3, 4, 8) (got (3, 8, 4))."},
        {"KDA dt_bias shape", [](auto&, auto& a) { a.dt_bias = with_size(a.dt_bias, 0, 31); },
         "KDA `dt_bias` must have shape (4, 8) (got (31,))."},
        {"KDA a strided", [](auto&, auto& a) { a.a = with_stride(a.a, 0, 33); },
         "KDA `a`/`dt_bias` must be contiguous."
         " `a` has strides (33, 1) for shape (3, 32); expected (32, 1)."},
        {"KDA dt_bias strided",
         [](auto&, auto& a) {
           a.dt_bias = TensorView::strided(a.dt_bias.data, DType::f32, {4, 8}, {4, 1});
         },
         "KDA `a`/`dt_bias` must be contiguous."
         " `dt_bias` has strides (4, 1) for shape (4, 8); expected (8, 1)."},
        {"g_cache without K",
         [](auto&, auto& a) {
           a.g_cache = reshaped(a.g_cache, {5, 4, 32});
         },
         "`g_cache` shape must be (5, 4, 4, 8) (got (5, 4, 32))."},
        {"g_cache K",
         [](auto&, auto& a) {
           a.g_cache = reshaped(a.g_cache, {5, 4, 4, 7});
         },
         "`g_cache` shape must be (5, 4, 4, 8) (got (5, 4, 4, 7))."},
    };
    cases.insert(cases.end(), k.begin(), k.end());
  } else {
    const std::vector<RSCase> g = {
        {"GDN a shape",
         [](auto&, auto& a) {
           a.a = reshaped(a.a, {3, 5});
         },
         "GDN `a` must have shape (3, 4) (got (3, 5))."},
        {"GDN a 3D",
         [](auto&, auto& a) {
           a.a = reshaped(a.a, {3, 4, 1});
         },
         "GDN `a` must have shape (3, 4) (got (3, 4, 1))."},
        {"GDN a strided", [](auto&, auto& a) { a.a = with_stride(a.a, 1, 2); },
         "GDN `a` must be contiguous in the last dim. `a` has strides (4, 2); expected a last "
         "stride of 1."},
        {"GDN dt_bias shape", [](auto&, auto& a) { a.dt_bias = with_size(a.dt_bias, 0, 5); },
         "GDN `dt_bias` must have shape (4,) (got (5,))."},
        {"g_cache with K",
         [](auto&, auto& a) {
           a.g_cache = reshaped(a.g_cache, {5, 4, 4, 1});
         },
         "`g_cache` shape must be (5, 4, 4) (got (5, 4, 4, 1))."},
        {"g_cache L",
         [](auto&, auto& a) {
           a.g_cache = reshaped(a.g_cache, {5, 4, 3});
         },
         "`g_cache` shape must be (5, 4, 4) (got (5, 4, 3))."},
    };
    cases.insert(cases.end(), g.begin(), g.end());
  }
  return cases;
}

TEST(Contracts, ReplaySsmGdn) { expect_rejections(replay_cases(false), false); }
TEST(Contracts, ReplaySsmKda) { expect_rejections(replay_cases(true), true); }

// SGLang's ring modes (KDA, H == HV: every mode valid; L = 4): pre-decayed keys on a circular ring
// with prefix gates, a safe gate of -5; each mutation hits one text, SGLang's where it has one.
constexpr Shape kSquare{"square", 4, 4, 8, 16};
struct ReplayModeFixture : ReplayFixture {
  Tensor base;
  explicit ReplayModeFixture(bool kda_) : ReplayFixture(kda_, kSquare) {
    base = index_tensor({3, 0, 1}, DType::i32);
    args.cache_base = base.view();
    args.circular_replay = args.prefix_gate_cache = args.predecayed_k_cache = true;
    args.lower_bound = -5.0;
  }
};
using RMCase = Case<ReplayModeFixture, ReplayDecodeArgs>;

TEST(Contracts, ReplaySsmRingModes) {
  const std::vector<RMCase> cases = {
      {"circular without cache_base", [](auto&, auto& a) { a.cache_base.reset(); },
       "`cache_base` must be a contiguous 1D int32 tensor for circular replay."},
      {"cache_base int64",
       [](auto&, auto& a) { a.cache_base = with_dtype(*a.cache_base, DType::i64); },
       "`cache_base` must be a contiguous 1D int32 tensor for circular replay."},
      {"cache_base strided",
       [](auto&, auto& a) { a.cache_base = with_size(with_stride(*a.cache_base, 0, 2), 0, 2); },
       "`cache_base` must be a contiguous 1D int32 tensor for circular replay."},
      {"cache_base length", [](auto&, auto& a) { a.cache_base = with_size(*a.cache_base, 0, 2); },
       "`cache_base` must have shape (3,) (got (2,))."},
      {"predecay without prefix gates", [](auto&, auto& a) { a.prefix_gate_cache = false; },
       "Pre-decayed K requires KDA circular replay with prefix gates."},
      {"predecay without circular", [](auto&, auto& a) { a.circular_replay = false; },
       "Pre-decayed K requires KDA circular replay with prefix gates."},
      {"predecay without a lower bound", [](auto&, auto& a) { a.lower_bound.reset(); },
       "Pre-decayed K requires a finite negative safe-gate lower bound."},
      {"predecay positive lower bound", [](auto&, auto& a) { a.lower_bound = 1.0; },
       "Pre-decayed K requires a finite negative safe-gate lower bound."},
      {"predecay unsafe lower bound", [](auto&, auto& a) { a.lower_bound = -27.0; },
       "Pre-decayed K inverse-prefix scaling is unsafe: (cache_len - 1) * abs(lower_bound) must "
       "be <= 80."},
      {"cache_base on another device",
       [](auto&, auto& a) { a.cache_base = on_cuda(*a.cache_base); },
       "ReplaySSM inputs must be on the same device."},
      {"cache_base outside the ring",
       [](auto& f, auto&) {
         write_indices(f.base.view(), {3, 0, 4});
       },
       "`cache_base`[2]=4 is outside the ring [0, L-1=3]"},
  };
  expect_rejections(cases, true);
  // One K head per value head: kSmall has H = 2, HV = 4.
  ReplayFixture f(true);
  Tensor base = index_tensor({0, 0, 0}, DType::i32);
  ReplayDecodeArgs a = f.args;
  a.cache_base = base.view();
  a.circular_replay = a.prefix_gate_cache = a.predecayed_k_cache = true;
  a.lower_bound = -5.0;
  const auto e = catch_error([&] { f.run(a); });
  ASSERT_TRUE(e);
  EXPECT_EQ(std::string(e->what()), "Pre-decayed K requires one K head per value head.");
  // A padded row's cache_base is never read.
  ReplayModeFixture g(true);
  write_indices(g.base.view(), {3, 99, 1});
  EXPECT_NO_THROW(g.run(g.args));
}

// A padded row's cursor is not checked (it is never read); force_flush may be absent.
TEST(Contracts, ReplaySsmIgnoresPaddedRowCursorAndOptionalForceFlush) {
  ReplayFixture f(false);
  write_indices(f.wp.view(), {0, 99, 3});
  ReplayDecodeArgs a = f.args;
  a.force_flush.reset();
  EXPECT_NO_THROW(f.run(a));
  EXPECT_EQ(f.wp.ptr<int32_t>()[1], 99);
}

// ==== limits of the CUDA kernels ===============================================================
// Shapes the CPU kernels run and the CUDA kernels do not. The validator rejects them for CUDA
// tensors (ErrorKind::not_implemented, the text the CUDA backend gives) before any backend runs,
// so no GPU is needed: cuda_view labels host memory cuda:0, which a rejected call never reads.
TensorView cuda_view(const Tensor& t) { return on_cuda(t.view()); }

void expect_not_implemented(const std::function<void()>& call, const std::string& message) {
  const std::optional<Error> e = catch_error(call);
  ASSERT_TRUE(e);
  EXPECT_EQ(std::string(e->what()), message);
  EXPECT_EQ(e->kind(), ErrorKind::not_implemented);
}

// K = 264: a lane's slices of a state row exceed the CUDA kernels' K tile of 256.
constexpr Shape kWideK{"wide_k", 1, 2, 264, 8};
const char* const kWideKMessage = "the CUDA backend supports K <= 256 (got K=264)";

TEST(Contracts, CudaKLimitPackedDecode) {
  for (const bool kda : {false, true}) {
    SCOPED_TRACE(kda ? "kda" : "gdn");
    Rng rng = test_rng(kda);
    Tensor pool = make_pool(DType::f32, 2, kWideK);
    const DecodeBatch batch = make_decode_batch(rng, kWideK, kda, {1, 0}, DType::f32);
    const std::optional<double> lb = kda ? std::optional<double>(-5.0) : std::nullopt;
    auto run = [kda](const PackedDecodeArgs& a) {
      if (kda) deltastate::kda_packed_decode(a);
      else deltastate::gdn_packed_decode(a);
    };
    EXPECT_NO_THROW(run(batch.packed_args(host_view, pool.view(), 0.35, lb)));
    expect_not_implemented(
        [&] { run(batch.packed_args(cuda_view, on_cuda(pool.view()), 0.35, lb)); }, kWideKMessage);
  }
}

TEST(Contracts, CudaKLimitRecurrent) {
  for (const bool kda : {false, true}) {
    SCOPED_TRACE(kda ? "kda" : "gdn");
    Rng rng = test_rng(kda);
    const RecurrentBatch rb =
        make_recurrent_batch(rng, recurrent_spec(kWideK, kda, DType::f32, 2, 2));
    Tensor pool = make_pool(DType::f32, 2, kWideK);
    auto run = [kda](const RecurrentArgs& a) {
      if (kda) deltastate::recurrent_kda(a);
      else deltastate::recurrent_gdn(a);
    };
    RecurrentArgs cpu = rb.args(host_view);
    cpu.state = pool.view();
    EXPECT_NO_THROW(run(cpu));
    RecurrentArgs gpu = rb.args(cuda_view);
    gpu.state = on_cuda(pool.view());
    expect_not_implemented([&] { run(gpu); }, kWideKMessage);
    gpu.state.reset();  // without a state pool too: K comes from q and k
    gpu.update_state = false;
    expect_not_implemented([&] { run(gpu); }, kWideKMessage);
  }
}

// ReplaySSM: K as above; L = 4097 rings exceed the CUDA kernel's ring limit of 4096.
TEST(Contracts, CudaLimitsReplaySsm) {
  for (const bool kda : {false, true}) {
    SCOPED_TRACE(kda ? "kda" : "gdn");
    for (const auto& [shape, L, message] :
         {std::tuple{kWideK, 2, std::string(kWideKMessage)},
          std::tuple{kSmall, 4097,
                     std::string("replayssm_decode: ring length L=4097 is above the CUDA kernel's "
                                 "limit of 4096")}}) {
      SCOPED_TRACE(message);
      Rng rng = test_rng(kda);
      Tensor pool = make_pool(DType::f32, 2, shape);
      const Rings rings = make_rings(shape, kda, 2, L, DType::f32, DType::f32);
      const DecodeBatch batch = make_decode_batch(rng, shape, kda, {1, 0}, DType::f32);
      const Tensor wp = index_tensor({0, 0});
      EXPECT_NO_THROW(deltastate::replayssm_decode(replay_args(host_view, batch, pool.view(),
                                                               rings.d.view(), rings.k.view(),
                                                               rings.g.view(), wp, nullptr, 0.35)));
      const ReplayDecodeArgs gpu =
          replay_args(cuda_view, batch, on_cuda(pool.view()), cuda_view(rings.d),
                      cuda_view(rings.k), cuda_view(rings.g), wp, nullptr, 0.35);
      expect_not_implemented([&] { deltastate::replayssm_decode(gpu); }, message);
    }
  }
}

}  // namespace
}  // namespace dstest

// ==== the state's storage format (src/contracts/state_format.cpp) ===============================
namespace dstest {
namespace {

using deltastate::StatePool;
using deltastate::StatePoolConfig;
using deltastate::StateRounding;

// Packed decode on a float8_e4m3fn StatePool layer (kSmall, 5 slots), rounded stochastically (the
// format's default) with the pool's step counter.
struct QuantFixture {
  bool kda;
  std::unique_ptr<StatePool> pool;
  DecodeBatch batch;
  PackedDecodeArgs args;
  explicit QuantFixture(bool kda_) : kda(kda_) {
    Rng rng = test_rng(kda);
    StatePoolConfig c;
    c.slots = 5;
    c.HV = kSmall.HV;
    c.V = kSmall.V;
    c.K = kSmall.K;
    c.state_dtype = DType::f8e4m3;
    pool = std::make_unique<StatePool>(c);
    std::memset(pool->data(), 0x3a, static_cast<size_t>(pool->total_bytes()));  // nonzero bytes
    *static_cast<int64_t*>(pool->rounding_step(0).data) = 0;
    batch = make_decode_batch(rng, kSmall, kda, {3, -1, 0}, DType::f32);
    args = batch.packed_args(host_view, pool->layer_state(0), 0.35,
                             kda ? std::optional<double>(-5.0) : std::nullopt);
    args.state_format.scales = pool->layer_scales(0);
    args.state_format.step = pool->rounding_step(0);
    args.state_format.seed = 7;
  }
  void run(const PackedDecodeArgs& a) const {
    if (kda) deltastate::kda_packed_decode(a);
    else deltastate::gdn_packed_decode(a);
  }
  Snapshot snapshot() const {
    Snapshot s;
    s.add(pool->data(), pool->total_bytes());
    for (const Tensor* t :
         {&batch.x, &batch.a, &batch.b, &batch.A_log, &batch.dt_bias, &batch.out, &batch.idx})
      s.add(*t);
    return s;
  }
};
using QCase = Case<QuantFixture, PackedDecodeArgs>;

std::vector<QCase> state_format_cases(bool kda) {
  const std::string op =
      kda ? "fused_recurrent_kda_packed_decode" : "fused_recurrent_gated_delta_rule_packed_decode";
  return {
      {"no scales", [](auto&, auto& a) { a.state_format.scales.reset(); },
       op + ": `state_scales` is required for the float8_e4m3fn state `initial_state`: its fp32 "
            "scales [slots, HV, V] (StatePool.layer_scales)"},
      {"scales slots",
       [](auto&, auto& a) { a.state_format.scales = with_size(*a.state_format.scales, 0, 4); },
       "`state_scales` must have shape [slots, HV, V]=(5, 4, 16) (one per row of "
       "`initial_state`); got (4, 4, 16)"},
      {"scales 4D",
       [](auto&, auto& a) { a.state_format.scales = with_ndim(*a.state_format.scales, 4); },
       "`state_scales` must have shape [slots, HV, V]=(5, 4, 16) (one per row of "
       "`initial_state`); got (5, 4, 16, 1)"},
      {"scales dtype",
       [](auto&, auto& a) {
         a.state_format.scales = with_dtype(*a.state_format.scales, DType::bf16);
       },
       "`state_scales` must have dtype float32; got bfloat16"},
      {"scales inner strides",
       [](auto&, auto& a) { a.state_format.scales = with_stride(*a.state_format.scales, 1, 17); },
       "`state_scales` must be contiguous in its [HV, V] inner dimensions (strides (16, 1)); got "
       "strides (" +
           std::to_string(QuantFixture(false).pool->layer_scales(0).stride[0]) +
           ", 17, 1) (an arbitrary slot stride is supported)"},
      {"scales on another device",
       [](auto&, auto& a) { a.state_format.scales = on_cuda(*a.state_format.scales); },
       "All inputs must be on the same device: `mixed_qkv` is on cpu, `state_scales` is on "
       "cuda:0"},
      {"no step", [](auto&, auto& a) { a.state_format.step.reset(); },
       op + ": stochastic rounding of the float8_e4m3fn state `initial_state` needs "
            "`rounding_step`, an int64 [1] step counter on the state's device "
            "(StatePool.rounding_step)"},
      {"step of two",
       [](auto&, auto& a) { a.state_format.step = with_size(*a.state_format.step, 0, 2); },
       "`rounding_step` must have one element (an int64 [1] counter); got shape (2,)"},
      {"step dtype",
       [](auto&, auto& a) { a.state_format.step = with_dtype(*a.state_format.step, DType::i32); },
       "`rounding_step` must have dtype int64; got int32"},
      {"negative layer", [](auto&, auto& a) { a.state_format.layer = -1; },
       op + ": `rounding_layer` must be >= 0; got -1"},
      {"step with nearest rounding",
       [](auto&, auto& a) { a.state_format.rounding = StateRounding::nearest; },
       op + ": `rounding_step` is given, but the float8_e4m3fn state `initial_state` is rounded "
            "to nearest (pass state_rounding stochastic, or no step)"},
      {"scales with a float state",
       [](auto&, auto& a) {
         a.state = with_dtype(a.state, DType::f32);
         a.state = with_stride(a.state, 0, 4);  // any slot stride (in elements)
       },
       op + ": `state_scales` applies to float8_e4m3fn and int8 states; `initial_state` is "
            "float32"},
      {"stochastic float32",
       [](auto&, auto& a) {
         a.state = with_dtype(a.state, DType::f32);
         a.state_format.scales.reset();
         a.state_format.rounding = StateRounding::stochastic;
       },
       op + ": stochastic rounding applies to bfloat16, float16, float8_e4m3fn and int8 states; "
            "`initial_state` is float32 (stored exactly)"},
  };
}

TEST(Contracts, StateFormatGdn) { expect_rejections(state_format_cases(false), false); }
TEST(Contracts, StateFormatKda) { expect_rejections(state_format_cases(true), true); }

// What the CUDA backend does not take quantized states in yet; ops without a quantized path reject
// such a state by name. NotImplementedError, nothing written.
TEST(Contracts, StateFormatNotBuiltYet) {
  // the recurrent op: a quantized pool only V-first, in place, without final_state
  RecurrentFixture rf(false);
  const Snapshot rbefore = rf.snapshot();
  RecurrentArgs rargs = rf.args;  // with final_state
  rargs.state = with_dtype(*rargs.state, DType::i8);
  Tensor scales = Tensor::contiguous(DType::f32, {rargs.state->shape[0], kRec.HV, kRec.V});
  rargs.state_format.scales = scales.view();
  expect_error([&] { rf.run(rargs); },
               "recurrent_gated_delta_rule: int8 states run as a V-first pool updated in place "
               "(ssm_state_indices, no final_state) for now (issue #36)",
               ErrorKind::not_implemented);
  EXPECT_TRUE(rbefore.unchanged());
}

// A quantized verify scratch (intermediate_states in float8_e4m3fn / int8 with its fp32
// intermediate_state_scales), verify's and the commit's: each malformed argument named, nothing
// written (ValueError; NotImplementedError for a quantized scratch with a float pool).
TEST(Contracts, QuantizedScratch) {
  RecurrentFixture rf(false);
  const int64_t R = 3, TA = 4;  // N_scr, T_alloc
  Tensor pool = Tensor::contiguous(DType::f8e4m3, {4, kRec.HV, kRec.V, kRec.K});
  Tensor scales = Tensor::contiguous(DType::f32, {4, kRec.HV, kRec.V});
  Tensor inter = Tensor::contiguous(DType::i8, {R, TA, kRec.HV, kRec.V, kRec.K});
  Tensor iscales = Tensor::contiguous(DType::f32, {R, TA, kRec.HV, kRec.V});
  Tensor iscales16 = Tensor::contiguous(DType::f16, {R, TA, kRec.HV, kRec.V});
  Tensor fscratch = Tensor::contiguous(DType::f32, {R, TA, kRec.HV, kRec.V, kRec.K});
  pool.fill_all(3);
  inter.fill_all(5);
  scales.fill_all(7);
  iscales.fill_all(9);
  Snapshot before = rf.snapshot();
  before.add(pool).add(scales).add(inter).add(iscales).add(iscales16).add(fscratch);
  deltastate::VerifyArgs ok = verify_inputs(rf.args, false);
  ok.state = pool.view();
  ok.state_format.scales = scales.view();
  ok.state_format.rounding = StateRounding::nearest;
  ok.state_indices = rf.idx.view();
  ok.update_state = false;
  ok.intermediate_states = inter.view();
  ok.intermediate_state_scales = iscales.view();
  auto verify_error = [&](auto edit, const std::string& text, ErrorKind kind = ErrorKind::value) {
    deltastate::VerifyArgs a = ok;
    edit(a);
    expect_error([&] { deltastate::verify(a); }, text, kind);
    EXPECT_TRUE(before.unchanged()) << text;
  };
  verify_error([](auto& a) { a.intermediate_state_scales.reset(); },
               "verify: `intermediate_state_scales` is required for the int8 scratch "
               "`intermediate_states`: its fp32 scales [N_scr, T_alloc, HV, V], one per state row");
  verify_error(
      [](auto& a) { a.intermediate_state_scales = with_size(*a.intermediate_state_scales, 1, 3); },
      "`intermediate_state_scales` must have shape [N_scr, T_alloc, HV, V]=(3, 4, 4, 8) (one per "
      "row of `intermediate_states`); got (3, 3, 4, 8)");
  verify_error(
      [](auto& a) { a.intermediate_state_scales = with_ndim(*a.intermediate_state_scales, 5); },
      "`intermediate_state_scales` must have shape [N_scr, T_alloc, HV, V]=(3, 4, 4, 8) (one per "
      "row of `intermediate_states`); got (3, 4, 4, 8, 1)");
  verify_error([&](auto& a) { a.intermediate_state_scales = iscales16.view(); },
               "`intermediate_state_scales` must have dtype float32; got float16");
  verify_error(
      [](auto& a) {
        a.intermediate_state_scales = with_stride(*a.intermediate_state_scales, 3, 2);
      },
      "`intermediate_state_scales` must be contiguous in its [HV, V] inner dimensions (strides "
      "(8, 1)); got strides (128, 32, 8, 2)");
  verify_error(
      [](auto& a) { a.intermediate_state_scales = on_cuda(*a.intermediate_state_scales); },
      "All inputs must be on the same device: `q` is on cpu, `intermediate_state_scales` is on "
      "cuda:0");
  verify_error([&](auto& a) { a.intermediate_states = fscratch.view(); },
               "verify: `intermediate_state_scales` applies to a float8_e4m3fn or int8 "
               "`intermediate_states`; it is float32");
  verify_error([](auto& a) { a.intermediate_states.reset(); },
               "`intermediate_state_scales` are the scales of a quantized `intermediate_states` "
               "buffer, which was not given");
  verify_error(
      [&](auto& a) {
        a.state = rf.pool.view();
        a.state_format.scales.reset();
        a.state_format.rounding = StateRounding::format_default;
      },
      "verify: a quantized `intermediate_states` (here int8) is built for float8_e4m3fn and "
      "int8 pools; `state` is float32 (give a float32 scratch)",
      ErrorKind::not_implemented);

  // the commit: [layers, N_scr, T_alloc, HV, V, K] and its scales [layers, N_scr, T_alloc, HV, V]
  Tensor lpool = Tensor::contiguous(DType::i8, {2, 4, kRec.HV, kRec.V, kRec.K});
  Tensor lscales = Tensor::contiguous(DType::f32, {2, 4, kRec.HV, kRec.V});
  Tensor linter = Tensor::contiguous(DType::f8e4m3, {2, R, TA, kRec.HV, kRec.V, kRec.K});
  Tensor liscales = Tensor::contiguous(DType::f32, {2, R, TA, kRec.HV, kRec.V});
  Tensor fpool = Tensor::contiguous(DType::f32, {2, 4, kRec.HV, kRec.V, kRec.K});
  Tensor idx = index_tensor({1, 2}), acc = index_tensor({1, 1});
  lpool.fill_all(1);
  linter.fill_all(2);
  Snapshot cbefore;
  cbefore.add(lpool).add(lscales).add(linter).add(liscales).add(fpool);
  deltastate::CommitArgs cok;
  cok.state = lpool.view();
  cok.intermediate_states = linter.view();
  cok.state_indices = idx.view();
  cok.accepted = acc.view();
  cok.state_format.scales = lscales.view();
  cok.intermediate_state_scales = liscales.view();
  auto commit_error = [&](auto edit, const std::string& text, ErrorKind kind = ErrorKind::value) {
    deltastate::CommitArgs a = cok;
    edit(a);
    expect_error([&] { deltastate::update_state_after_verify(a); }, text, kind);
    EXPECT_TRUE(cbefore.unchanged()) << text;
  };
  commit_error([](auto& a) { a.intermediate_state_scales.reset(); },
               "update_state_after_verify: `intermediate_state_scales` is required for the "
               "float8_e4m3fn scratch `intermediate_states`: its fp32 scales [layers, N_scr, "
               "T_alloc, HV, V], one per state row");
  commit_error(
      [](auto& a) { a.intermediate_state_scales = with_size(*a.intermediate_state_scales, 0, 1); },
      "`intermediate_state_scales` must have shape [layers, N_scr, T_alloc, HV, V]=(2, 3, 4, 4, "
      "8) (one per row of `intermediate_states`); got (1, 3, 4, 4, 8)");
  commit_error(
      [](auto& a) {
        a.intermediate_state_scales = with_dtype(*a.intermediate_state_scales, DType::i32);
      },
      "`intermediate_state_scales` must have dtype float32; got int32");
  commit_error(
      [&](auto& a) {
        a.state = fpool.view();
        a.state_format.scales.reset();
      },
      "update_state_after_verify: a quantized `intermediate_states` (here float8_e4m3fn) is "
      "built for float8_e4m3fn and int8 pools; `state` is float32 (give a float32 scratch)",
      ErrorKind::not_implemented);
  commit_error(
      [&](auto& a) {
        a.state = fpool.view();
        a.state_format.scales.reset();
        a.intermediate_states = with_dtype(a.intermediate_states, DType::f32);
      },
      "update_state_after_verify: `intermediate_state_scales` applies to a float8_e4m3fn or "
      "int8 `intermediate_states`; it is float32");
  commit_error(
      [&](auto& a) {
        a.state = fpool.view();
        a.state_format.scales.reset();
        a.intermediate_states = with_dtype(a.intermediate_states, DType::f16);
        a.intermediate_state_scales.reset();
      },
      "`intermediate_states` must have the dtype of `state` (float32); got float16");
}

// FlashInfer's source pool (source_state) with a pool in its storage format: the source is the
// caller's float pool, of any float dtype (the states verify writes go to `state` through its
// format); a quantized source is a NotImplementedError naming it; with a plain float pool the
// source keeps the pool's dtype. Nothing written.
TEST(Contracts, SourceStateWithFormattedPool) {
  RecurrentFixture rf(false);
  Tensor pool = Tensor::contiguous(DType::f8e4m3, {4, kRec.HV, kRec.V, kRec.K});
  Tensor pool16 = Tensor::contiguous(DType::bf16, {4, kRec.HV, kRec.V, kRec.K});
  Tensor scales = Tensor::contiguous(DType::f32, {4, kRec.HV, kRec.V});
  Tensor step = index_tensor({0}, DType::i64);
  Tensor src8 = Tensor::contiguous(DType::i8, {3, kRec.HV, kRec.V, kRec.K});
  Tensor src16 = Tensor::contiguous(DType::bf16, {3, kRec.HV, kRec.V, kRec.K});
  Tensor src_idx = index_tensor({2, 0});
  pool.fill_all(3);
  scales.fill_all(7);
  Snapshot before = rf.snapshot();
  before.add(pool).add(pool16).add(scales).add(step).add(src8).add(src16);
  deltastate::VerifyArgs ok = verify_inputs(rf.args, false);
  ok.state = pool.view();
  ok.state_format.scales = scales.view();
  ok.state_format.step = step.view();
  ok.state_indices = rf.idx.view();
  ok.source_state = src8.view();
  ok.source_state_indices = src_idx.view();
  auto verify_error = [&](auto edit, const std::string& text, ErrorKind kind = ErrorKind::value) {
    deltastate::VerifyArgs a = ok;
    edit(a);
    expect_error([&] { deltastate::verify(a); }, text, kind);
    EXPECT_TRUE(before.unchanged()) << text;
  };
  verify_error([](auto&) {},
               "verify: `source_state` is int8: the read-only source pool of a float8_e4m3fn "
               "`state` is a float pool (float32, bfloat16 or float16; issue #36)",
               ErrorKind::not_implemented);
  verify_error(
      [&](auto& a) {
        a.state = pool16.view();
        a.state_format.scales.reset();
        a.state_format.rounding = StateRounding::stochastic;
      },
      "verify: `source_state` is int8: the read-only source pool of a bfloat16 `state` rounded "
      "stochastically is a float pool (float32, bfloat16 or float16; issue #36)",
      ErrorKind::not_implemented);
  verify_error(
      [&](auto& a) {
        a.state = rf.pool.view();
        a.state_format = {};
        a.source_state = src16.view();
      },
      "`source_state` must have the dtype of `state` (float32); got bfloat16");
}

// Verify and the state commit run quantized pools on CUDA (verify/fmt.cuh; verify with SGLang's
// cache_ring too, tests/gpu/test_verify_gpu.cpp), with one limit of those kernels that the CPU does
// not have: the commit's rows take K <= 256. NotImplementedError, nothing written.
TEST(Contracts, QuantizedCommitCudaLimit) {
  const int64_t K = 320;
  Tensor st = Tensor::contiguous(DType::f8e4m3, {4, 1, 2, K});
  Tensor sc = Tensor::contiguous(DType::f32, {4, 1, 2});
  Tensor inter = Tensor::contiguous(DType::f32, {2, 2, 1, 2, K});
  Tensor idx = index_tensor({1, 2}), acc = index_tensor({1, 1});
  Tensor step = index_tensor({0}, DType::i64);
  deltastate::CommitArgs ca;
  ca.state = on_cuda(st.view());
  ca.intermediate_states = on_cuda(inter.view());
  ca.state_indices = on_cuda(idx.view());
  ca.accepted = on_cuda(acc.view());
  ca.state_format.scales = on_cuda(sc.view());
  ca.state_format.step = on_cuda(step.view());
  Snapshot cbefore;
  cbefore.add(st).add(sc).add(inter).add(step);
  expect_error([&] { deltastate::update_state_after_verify(ca); },
               "the CUDA backend supports K <= 256 (got K=320)", ErrorKind::not_implemented);
  EXPECT_TRUE(cbefore.unchanged());
}

}  // namespace
}  // namespace dstest
