// Helpers shared by the test files: storage dtypes, per-test seeded randomness, host tensors with
// arbitrary strides and gaps, NaN poisoning and sentinel fills, byte snapshots, tolerance checks,
// and the input batches of the three ops (built once, used by the CPU and the GPU tests).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "deltastate/deltastate.h"
#include "float_format.h"
#include "reference/reference.h"

namespace dstest {

using deltastate::Device;
using deltastate::DType;
using deltastate::TensorView;

// ---- storage dtypes ---------------------------------------------------------------------------
// The value x takes once stored as t (round to nearest even).
double round_to(DType t, double x);
void store_value(void* base, DType t, int64_t i, double x);
double load_value(const void* base, DType t, int64_t i);
// Half a unit in the last place of t at `magnitude`: the most that storing a value of about that
// magnitude in t can change it.
double half_ulp(DType t, double magnitude);

// A huge value no kernel should ever read or write: it fills unused slots, envelope gaps and
// other memory an op must leave alone (float16 cannot hold 1e30 and stores +inf).
inline constexpr double kSentinel = 1e30;

// ---- randomness -------------------------------------------------------------------------------
class Rng {
 public:
  explicit Rng(uint64_t seed) : eng_(seed) {}
  double uniform(double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(eng_);
  }
  double normal(double stddev = 1.0) { return std::normal_distribution<double>(0.0, stddev)(eng_); }
  int64_t integer(int64_t lo, int64_t hi) {  // inclusive
    return std::uniform_int_distribution<int64_t>(lo, hi)(eng_);
  }
  bool chance(double p) { return uniform(0.0, 1.0) < p; }
  std::mt19937_64& engine() { return eng_; }

 private:
  std::mt19937_64 eng_;
};
// A seed from the running test's full name (suite, name and parameter): fixed for a test, different
// between tests.
uint64_t test_seed(uint64_t salt = 0);
inline Rng test_rng(uint64_t salt = 0) { return Rng(test_seed(salt)); }

// ---- host tensors -----------------------------------------------------------------------------
// Owned, 256-byte aligned host memory with a strided view into it. Copies share the storage
// (aliases: several views into one buffer, e.g. q/k/v inside a packed qkv buffer).
class Tensor {
 public:
  Tensor() = default;
  static Tensor contiguous(DType dtype, std::vector<int64_t> shape);
  // Explicit element strides; the view starts `offset` elements into an allocation of `alloc`
  // elements (0: just enough for the view).
  static Tensor strided(DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides,
                        int64_t offset = 0, int64_t alloc = 0);
  // The same layout over new (zeroed) storage.
  Tensor empty_like() const;
  // Another view of the same storage.
  Tensor alias(DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides,
               int64_t offset) const;

  DType dtype() const { return dtype_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int d) const { return shape_[d < 0 ? d + ndim() : d]; }
  int64_t stride(int d) const { return strides_[d < 0 ? d + ndim() : d]; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const;
  int64_t offset() const { return offset_; }
  int64_t itemsize() const { return deltastate::dtype_size(dtype_); }

  TensorView view() const;  // CPU
  // The same layout over another allocation of alloc_bytes() (a device mirror).
  TensorView view_at(void* alloc_base, Device device) const;
  void* alloc_base() const { return storage_.get(); }
  int64_t alloc_bytes() const { return alloc_bytes_; }

  // Element offset (from the view's start) of an index tuple of the view.
  int64_t offset_of(std::initializer_list<int64_t> idx) const;
  double get(std::initializer_list<int64_t> idx) const;
  void set(std::initializer_list<int64_t> idx, double x);
  // The i-th element in row-major order of the view.
  double get_linear(int64_t i) const;
  void set_linear(int64_t i, double x);
  std::vector<double> values() const;  // every element, row-major
  // Element data pointer helpers for raw reads of integer tensors.
  template <class T>
  T* ptr() const {
    return reinterpret_cast<T*>(static_cast<char*>(alloc_base()) + offset_ * itemsize());
  }

  void fill_all(double x);  // every element of the allocation (gaps included), rounded
  void fill_uniform(Rng& rng, double lo, double hi);  // the view's elements, rounded
  void fill_normal(Rng& rng, double stddev);
  std::vector<uint8_t> bytes() const;  // the whole allocation

 private:
  int64_t linear_to_offset(int64_t i) const;
  std::shared_ptr<uint8_t> storage_;
  int64_t alloc_bytes_ = 0;
  DType dtype_ = DType::f32;
  std::vector<int64_t> shape_, strides_;
  int64_t offset_ = 0;
};

// An int32 / int64 1-D tensor with these values.
Tensor index_tensor(const std::vector<int64_t>& values, DType dtype = DType::i32);
std::vector<int64_t> index_values(const Tensor& t);

// ---- memory snapshots -------------------------------------------------------------------------
// A byte range of memory, absolute addresses.
struct MemRange {
  const char* begin;
  const char* end;
};
// Elements [elem_offset, elem_offset + count) of a view (from its data pointer, dense run).
MemRange range_of(const TensorView& t, int64_t elem_offset, int64_t count);

// Copies of memory regions, to prove later that a call wrote nothing outside given ranges.
class Snapshot {
 public:
  Snapshot& add(const void* base, int64_t bytes);
  Snapshot& add(const Tensor& t) { return add(t.alloc_base(), t.alloc_bytes()); }
  // Every byte of every region outside `allowed` is as it was.
  ::testing::AssertionResult unchanged_except(const std::vector<MemRange>& allowed) const;
  ::testing::AssertionResult unchanged() const { return unchanged_except({}); }
  // The same comparison between any two buffers: `now` against `then`, `allowed` in now's memory.
  static ::testing::AssertionResult equal_except(const void* now, const void* then, int64_t bytes,
                                                 const std::vector<MemRange>& allowed);

 private:
  struct Region {
    const uint8_t* base;
    std::vector<uint8_t> copy;
  };
  std::vector<Region> regions_;
};

// ---- comparisons ------------------------------------------------------------------------------
struct Tol {
  double atol, rtol;
};
// SGLang's packed-decode test tolerances: outputs 1e-4/1e-4; states 1e-5 (fp32), 2e-3 (bf16),
// 5e-4 (fp16), rtol 1e-4.
inline constexpr Tol kOutTol{1e-4, 1e-4};
Tol state_tol(DType state_dtype);

// |got - want| <= atol + rtol*|want| + rounded * half_ulp(stored_as, |want| + atol + rtol*|want|)
// for every element (NaN fails). These tolerances bound the fp32 computation; a value
// then stored in a narrower dtype (`stored_as`) is also rounded to it (round to nearest even),
// which moves it by at most half an ulp. `rounded` counts the operands so rounded: 1 against the
// fp64 reference, 2 when two implementations each rounded their own fp32 result (GPU vs CPU).
// Pass DType::f32 when the tolerance already covers the storage (bf16/fp16 state tolerances).
::testing::AssertionResult all_close(const std::vector<double>& got,
                                     const std::vector<double>& want, Tol tol,
                                     DType stored_as = DType::f32, int rounded = 1);
::testing::AssertionResult all_zero(const std::vector<double>& got);
// Element ranges of a vector.
std::vector<double> slice(const std::vector<double>& v, int64_t begin, int64_t count);

// ---- shapes and pools -------------------------------------------------------------------------
struct Shape {
  const char* name;
  int H, HV, K, V;
  int64_t state_elems() const { return static_cast<int64_t>(HV) * V * K; }
  int64_t width() const { return 2LL * H * K + static_cast<int64_t>(HV) * V; }
};
inline constexpr Shape kQwen3Next{"qwen3next", 16, 32, 128, 128};
inline constexpr Shape kKimi{"kimi", 32, 32, 128, 128};
inline constexpr Shape kOdd{"odd", 3, 6, 32, 48};
inline constexpr Shape kKgtV{"KgtV", 2, 4, 64, 32};
inline constexpr Shape kKltV{"KltV", 2, 4, 32, 64};

// Short names for the parameter tables of the op tests.
inline constexpr DType f32 = DType::f32;
inline constexpr DType bf16 = DType::bf16;
inline constexpr DType f16 = DType::f16;
inline constexpr std::optional<double> kNoLb{};    // no KDA lower bound (softplus gate)
inline constexpr std::optional<double> kLb{-5.0};  // the bounded gate

// What the op test cases share: a name, the model or odd shape, the gate (KDA or GDN, and the
// KDA lower bound), the state (or checkpoint) and activation dtypes. Cases derive from it and
// list their own fields after these six (aggregate initialization stays flat).
struct OpCase {
  const char* name;
  Shape shape;
  bool kda;
  std::optional<double> lower_bound;
  DType state, act;
};
// gtest's name generator for any case table: the case's name.
template <class Case>
std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.name;
}

// A ReplaySSM test case (CPU against the fp64 reference, CUDA against the CPU): ring length,
// steps, and a strided (envelope-like) checkpoint pool view when slot_pad / lead are set.
struct ReplayCase : OpCase {
  int L;
  int steps = 42;
  int64_t slot_pad = 0, lead = 0;
};
inline void PrintTo(const ReplayCase& c, std::ostream* os) { *os << c.name; }
// Per-row, per-step probability of a forced flush in the multi-step ReplaySSM tests: rare enough
// for long rings that rows still fill them (L > 32: more records than a warp has lanes).
inline double forced_flush_rate(int L) { return L > 32 ? 0.01 : L >= 16 ? 0.03 : 0.1; }

// A StatePool of the envelope layout over shape `s`: `layers` layers per entry, `slots` entries,
// `extra_bytes` beyond the layers in every entry.
inline deltastate::StatePoolConfig envelope_config(const Shape& s, int64_t layers, int64_t slots,
                                                   DType state_dtype, int64_t extra_bytes) {
  deltastate::StatePoolConfig cfg;
  cfg.layers = layers;
  cfg.slots = slots;
  cfg.H = s.H;
  cfg.HV = s.HV;
  cfg.V = s.V;
  cfg.K = s.K;
  cfg.state_dtype = state_dtype;
  cfg.layout = deltastate::PoolLayout::envelope;
  cfg.envelope_extra_bytes = extra_bytes;
  return cfg;
}

// A state pool [slots, HV, V, K], inner strides (V*K, K, 1), slot stride HV*V*K + slot_pad
// elements, starting `lead` elements into its allocation (envelope-like gaps before and between
// slots). Every element of the allocation is the sentinel; fill the live slots with fill_slot.
Tensor make_pool(DType dtype, int64_t slots, const Shape& s, int64_t slot_pad = 0,
                 int64_t lead = 0);
// One slot's [HV, V, K] of a pool view (host memory: a test Tensor's view or a StatePool layer).
std::vector<double> slot_values(const TensorView& pool, int64_t slot);
void set_slot_values(const TensorView& pool, int64_t slot, const std::vector<double>& v);
void fill_slot(const TensorView& pool, int64_t slot, Rng& rng, double lo = -0.3, double hi = 0.3);
// fill_slot for every live entry of `slots` (padded rows, < 0, have no slot).
inline void fill_live_slots(const TensorView& pool, const std::vector<int64_t>& slots, Rng& rng) {
  for (int64_t s : slots)
    if (s >= 0) fill_slot(pool, s, rng);
}
MemRange slot_range(const TensorView& pool, int64_t slot);
// A dense run of elements of a view as doubles.
std::vector<double> view_values(const TensorView& t, int64_t elem_offset, int64_t count);
// Fills `bytes` of memory with the sentinel of `dtype` (a StatePool's whole memory).
void fill_sentinel(void* base, int64_t bytes, DType dtype);

// Distinct random slots in [0, slots) for the live rows; -1 for the rows in `padded`.
std::vector<int64_t> pick_slots(Rng& rng, int64_t rows, int64_t slots,
                                const std::vector<int64_t>& padded);

// ---- op inputs --------------------------------------------------------------------------------
// Views of test tensors: on the CPU (host_view) or through a device mirror (GPU tests).
inline TensorView host_view(const Tensor& t) { return t.view(); }
// Entry i of a view's leading dim, as a view of the remaining dims (a pool's slot, a layer of an
// every-layer view, a scratch row's block as a 4-D pool).
inline TensorView sub_view(const TensorView& v, int64_t i) {
  TensorView r;
  r.data = static_cast<char*>(v.data) + i * v.stride[0] * v.element_size();
  r.dtype = v.dtype;
  r.device = v.device;
  r.ndim = v.ndim - 1;
  for (int d = 0; d < r.ndim; ++d) r.shape[d] = v.shape[d + 1], r.stride[d] = v.stride[d + 1];
  return r;
}

// One decode step's inputs for B rows (packed decode and ReplaySSM): mixed_qkv [B, width] with
// row stride width + row_pad, a [B, HV or HV*K] and b [B, HV] with row stride + row_pad, A_log,
// dt_bias (fp32 parameters), out [B, 1, HV, V] and the state indices.
struct DecodeBatch {
  Shape s{};
  bool kda = false;
  DType act = DType::f32;
  int64_t B = 0;
  Tensor x, a, b, A_log, dt_bias, out, idx;

  // Fresh q, k, v, a, b (A_log and dt_bias stay). b is nudged away from values whose sigmoid
  // lies within 1e-5 (relative) of a rounding boundary of its dtype, so that rounding beta to the
  // input dtype (ReplaySSM) is decided identically in fp32 and fp64.
  void randomize(Rng& rng);
  void poison_out() { out.fill_all(std::nan("")); }
  ref::Token token(int64_t row) const;
  ref::Config config(std::optional<double> lower_bound, double scale, bool round_beta) const;
  std::vector<double> out_row(int64_t row) const;  // [HV*V]

  template <class ViewOf>
  deltastate::PackedDecodeArgs packed_args(ViewOf&& view_of, const TensorView& state, double scale,
                                           std::optional<double> lower_bound = {}) const {
    deltastate::PackedDecodeArgs args;
    args.mixed_qkv = view_of(x);
    args.a = view_of(a);
    args.b = view_of(b);
    args.A_log = view_of(A_log);
    args.dt_bias = view_of(dt_bias);
    args.scale = scale;
    args.state = state;
    args.out = view_of(out);
    args.state_indices = view_of(idx);
    args.lower_bound = lower_bound;
    return args;
  }
};
// `slots`: the state index of each row (-1: padded). Parameters and inputs are random.
DecodeBatch make_decode_batch(Rng& rng, const Shape& s, bool kda, const std::vector<int64_t>& slots,
                              DType act, int64_t row_pad = 0, DType index_dtype = DType::i32);

// ReplaySSM rings for `slots` slots: d [slots, HV, L, V] (d_dtype), k [slots, H, L, K] (k_dtype),
// g [slots, HV, L(, K)] fp32; filled with the sentinel.
struct Rings {
  int L = 0;
  Tensor d, k, g;
};
Rings make_rings(const Shape& s, bool kda, int64_t slots, int L, DType d_dtype, DType k_dtype);
// The ring of one slot, as the reference reads it, from ring views (test Tensors or a StatePool).
ref::Ring ring_of_slot(const TensorView& d, const TensorView& k, const TensorView& g, int64_t slot);

template <class ViewOf>
deltastate::ReplayDecodeArgs replay_args(ViewOf&& view_of, const DecodeBatch& batch,
                                         const TensorView& state, const TensorView& d,
                                         const TensorView& k, const TensorView& g,
                                         const Tensor& write_pos, const Tensor* force_flush,
                                         double scale, std::optional<double> lower_bound = {}) {
  deltastate::ReplayDecodeArgs args;
  args.mixed_qkv = view_of(batch.x);
  args.a = view_of(batch.a);
  args.b = view_of(batch.b);
  args.A_log = view_of(batch.A_log);
  args.dt_bias = view_of(batch.dt_bias);
  args.scale = scale;
  args.state = state;
  args.d_cache = d;
  args.k_cache = k;
  args.g_cache = g;
  args.out = view_of(batch.out);
  args.state_indices = view_of(batch.idx);
  args.write_pos = view_of(write_pos);
  if (force_flush) args.force_flush = view_of(*force_flush);
  args.is_kda = batch.kda;
  args.lower_bound = lower_bound;
  return args;
}

// Inputs of the pooled varlen recurrent op.
struct RecurrentSpec {
  Shape s{};
  bool kda = false;
  DType act = DType::f32;
  int64_t B = 1, T = 1;
  std::vector<int64_t> seqlens;  // non-empty: varlen with cu_seqlens (B = 1, T = sum)
  bool gate_in_kernel = true;
  std::optional<double> lower_bound;
  bool beta_is_logit = true;
  bool packed_qkv = false;  // q, k, v are strided views into one [B, T, 2HK + HV*V] buffer
  bool dt_bias_2d = false;  // KDA dt_bias as [HV, K]
  DType index_dtype = DType::i32;
  std::optional<DType> g_dtype;  // g's dtype where it differs from the activations' (FLA: fp32)
};
// A spec from its main fields; `with(spec, f)` adjusts the others in a test table.
inline RecurrentSpec recurrent_spec(const Shape& s, bool kda, DType act, int64_t B, int64_t T,
                                    std::vector<int64_t> seqlens = {}) {
  RecurrentSpec r;
  r.s = s;
  r.kda = kda;
  r.act = act;
  r.B = B;
  r.T = T;
  r.seqlens = std::move(seqlens);
  return r;
}
inline RecurrentSpec with(RecurrentSpec r, void (*f)(RecurrentSpec&)) {
  f(r);
  return r;
}
struct RecurrentBatch {
  RecurrentSpec spec;
  int64_t N = 0;  // sequences
  Tensor q, k, v, g, beta, out, A_log, dt_bias, cu;

  void randomize(Rng& rng);
  void poison_out() { out.fill_all(std::nan("")); }
  int64_t seq_len(int64_t n) const;
  // (batch, token) coordinates of token t of sequence n.
  std::pair<int64_t, int64_t> coord(int64_t n, int64_t t) const;
  ref::Token token(int64_t n, int64_t t) const;
  ref::Config config(double scale) const;
  std::vector<double> out_token(int64_t n, int64_t t) const;  // [HV*V]

  template <class ViewOf>
  deltastate::RecurrentArgs args(ViewOf&& view_of) const {
    deltastate::RecurrentArgs a;
    a.q = view_of(q);
    a.k = view_of(k);
    a.v = view_of(v);
    a.g = view_of(g);
    a.beta = view_of(beta);
    a.out = view_of(out);
    a.gate_in_kernel = spec.gate_in_kernel;
    if (spec.gate_in_kernel) {
      a.A_log = view_of(A_log);
      a.dt_bias = view_of(dt_bias);
      a.lower_bound = spec.lower_bound;
    }
    a.beta_is_logit = spec.beta_is_logit;
    if (!spec.seqlens.empty()) a.cu_seqlens = view_of(cu);
    return a;
  }
};
RecurrentBatch make_recurrent_batch(Rng& rng, const RecurrentSpec& spec);

// Verify's token inputs and gate options from a recurrent batch's arguments (the rest unset).
inline deltastate::VerifyArgs verify_inputs(const deltastate::RecurrentArgs& ra, bool kda) {
  deltastate::VerifyArgs a;
  a.q = ra.q;
  a.k = ra.k;
  a.v = ra.v;
  a.g = ra.g;
  a.beta = ra.beta;
  a.out = ra.out;
  a.is_kda = kda;
  a.A_log = ra.A_log;
  a.dt_bias = ra.dt_bias;
  a.lower_bound = ra.lower_bound;
  a.cu_seqlens = ra.cu_seqlens;
  return a;
}

// ReplaySSM verify's token inputs and gate options from a recurrent batch's arguments (the
// checkpoint, rings and cursors unset).
inline deltastate::ReplayVerifyArgs replay_verify_inputs(const deltastate::RecurrentArgs& ra,
                                                         bool kda) {
  const deltastate::VerifyArgs va = verify_inputs(ra, kda);
  deltastate::ReplayVerifyArgs a;
  a.q = va.q;
  a.k = va.k;
  a.v = va.v;
  a.g = va.g;
  a.beta = va.beta;
  a.out = va.out;
  a.is_kda = kda;
  a.A_log = va.A_log;
  a.dt_bias = va.dt_bias;
  a.lower_bound = va.lower_bound;
  a.cu_seqlens = va.cu_seqlens;
  return a;
}

// Catches the deltastate::Error a call throws. Fails the test (and returns nullopt) if it throws
// nothing or something else.
template <class F>
std::optional<deltastate::Error> catch_error(F&& f) {
  try {
    f();
  } catch (const deltastate::Error& e) {
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-deltastate exception: " << e.what();
    return std::nullopt;
  }
  ADD_FAILURE() << "expected a deltastate::Error, but the call returned";
  return std::nullopt;
}

// `f` throws a deltastate::Error of this text and kind (a failure of the test otherwise).
template <class F>
void expect_error(F&& f, const std::string& message,
                  deltastate::ErrorKind kind = deltastate::ErrorKind::value) {
  const auto e = catch_error(f);
  if (!e) return;  // catch_error has reported it
  EXPECT_EQ(std::string(e->what()), message);
  EXPECT_EQ(e->kind(), kind);
}

}  // namespace dstest
