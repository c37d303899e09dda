#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <sstream>
#include <stdexcept>

namespace dstest {

// ---- storage dtypes ---------------------------------------------------------------------------
double round_to(DType t, double x) {
  switch (t) {
    case DType::f32:
      return static_cast<double>(static_cast<float>(x));
    case DType::bf16:
      return fmt::bf16_value(fmt::bf16_bits(x));
    case DType::f16:
      return fmt::f16_value(fmt::f16_bits(x));
    default:
      return std::nearbyint(x);
  }
}

void store_value(void* base, DType t, int64_t i, double x) {
  switch (t) {
    case DType::f32:
      static_cast<float*>(base)[i] = static_cast<float>(x);
      break;
    case DType::bf16:
      static_cast<uint16_t*>(base)[i] = fmt::bf16_bits(x);
      break;
    case DType::f16:
      static_cast<uint16_t*>(base)[i] = fmt::f16_bits(x);
      break;
    case DType::i32:
      static_cast<int32_t*>(base)[i] = static_cast<int32_t>(x);
      break;
    case DType::i64:
      static_cast<int64_t*>(base)[i] = static_cast<int64_t>(x);
      break;
    case DType::f8e4m3:
    case DType::i8:  // raw codes (quantized states are written by the tests byte by byte)
      static_cast<int8_t*>(base)[i] = static_cast<int8_t>(x);
      break;
  }
}

double load_value(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::f32:
      return static_cast<const float*>(base)[i];
    case DType::bf16:
      return fmt::bf16_value(static_cast<const uint16_t*>(base)[i]);
    case DType::f16:
      return fmt::f16_value(static_cast<const uint16_t*>(base)[i]);
    case DType::i32:
      return static_cast<const int32_t*>(base)[i];
    case DType::i64:
      return static_cast<double>(static_cast<const int64_t*>(base)[i]);
    case DType::f8e4m3:
    case DType::i8:  // raw codes
      return static_cast<const int8_t*>(base)[i];
  }
  return 0.0;
}

double half_ulp(DType t, double magnitude) {
  int mant = 0, emin = 0;
  switch (t) {
    case DType::f32:
      mant = 23;
      emin = -126;
      break;
    case DType::bf16:
      mant = 7;
      emin = -126;
      break;
    case DType::f16:
      mant = 10;
      emin = -14;
      break;
    default:
      return 0.0;
  }
  int e = emin + 1;
  if (magnitude > 0.0 && std::isfinite(magnitude)) std::frexp(magnitude, &e);
  const int E = std::max(e - 1, emin);
  return std::ldexp(1.0, E - mant - 1);
}

// ---- randomness -------------------------------------------------------------------------------
uint64_t test_seed(uint64_t salt) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "none";
  uint64_t h = 1469598103934665603ULL;  // FNV-1a
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h ^ (salt * 0x9e3779b97f4a7c15ULL);
}

// ---- host tensors -----------------------------------------------------------------------------
namespace {
std::shared_ptr<uint8_t> allocate_bytes(int64_t bytes) {
  const size_t n = static_cast<size_t>((std::max<int64_t>(bytes, 1) + 255) / 256 * 256);
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(256, n));
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, n);
  return std::shared_ptr<uint8_t>(p, [](uint8_t* q) { std::free(q); });
}
}  // namespace

Tensor Tensor::contiguous(DType dtype, std::vector<int64_t> shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    strides[d] = s;
    s *= shape[d];
  }
  return strided(dtype, std::move(shape), std::move(strides));
}

Tensor Tensor::strided(DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides,
                       int64_t offset, int64_t alloc) {
  int64_t extent = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 0) extent = 0;
  }
  if (extent) {
    for (size_t d = 0; d < shape.size(); ++d) extent += (shape[d] - 1) * strides[d];
  }
  if (alloc == 0) alloc = offset + extent;
  Tensor t;
  t.alloc_bytes_ = alloc * deltastate::dtype_size(dtype);
  t.storage_ = allocate_bytes(t.alloc_bytes_);
  return t.alias(dtype, std::move(shape), std::move(strides), offset);
}

Tensor Tensor::empty_like() const {
  Tensor t = *this;
  t.storage_ = allocate_bytes(alloc_bytes_);
  return t;
}

Tensor Tensor::alias(DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides,
                     int64_t offset) const {
  Tensor t = *this;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.strides_ = std::move(strides);
  t.offset_ = offset;
  return t;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

TensorView Tensor::view() const { return view_at(alloc_base(), Device::cpu()); }

TensorView Tensor::view_at(void* alloc_base, Device device) const {
  TensorView v;
  v.data = static_cast<char*>(alloc_base) + offset_ * itemsize();
  v.dtype = dtype_;
  v.device = device;
  v.ndim = ndim();
  for (int d = 0; d < ndim(); ++d) {
    v.shape[d] = shape_[d];
    v.stride[d] = strides_[d];
  }
  return v;
}

int64_t Tensor::offset_of(std::initializer_list<int64_t> idx) const {
  int64_t off = 0;
  int d = 0;
  for (int64_t i : idx) off += i * strides_[d++];
  return off;
}

double Tensor::get(std::initializer_list<int64_t> idx) const {
  return load_value(alloc_base(), dtype_, offset_ + offset_of(idx));
}

void Tensor::set(std::initializer_list<int64_t> idx, double x) {
  store_value(alloc_base(), dtype_, offset_ + offset_of(idx), x);
}

int64_t Tensor::linear_to_offset(int64_t i) const {
  int64_t off = 0;
  for (int d = ndim() - 1; d >= 0; --d) {
    off += (i % shape_[d]) * strides_[d];
    i /= shape_[d];
  }
  return off;
}

double Tensor::get_linear(int64_t i) const {
  return load_value(alloc_base(), dtype_, offset_ + linear_to_offset(i));
}

void Tensor::set_linear(int64_t i, double x) {
  store_value(alloc_base(), dtype_, offset_ + linear_to_offset(i), x);
}

std::vector<double> Tensor::values() const {
  std::vector<double> v(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) v[i] = get_linear(i);
  return v;
}

void Tensor::fill_all(double x) {
  const int64_t n = alloc_bytes_ / itemsize();
  for (int64_t i = 0; i < n; ++i) store_value(alloc_base(), dtype_, i, x);
}

void Tensor::fill_uniform(Rng& rng, double lo, double hi) {
  for (int64_t i = 0; i < numel(); ++i) set_linear(i, rng.uniform(lo, hi));
}

void Tensor::fill_normal(Rng& rng, double stddev) {
  for (int64_t i = 0; i < numel(); ++i) set_linear(i, rng.normal(stddev));
}

std::vector<uint8_t> Tensor::bytes() const {
  const auto* p = static_cast<const uint8_t*>(alloc_base());
  return std::vector<uint8_t>(p, p + alloc_bytes_);
}

Tensor index_tensor(const std::vector<int64_t>& values, DType dtype) {
  Tensor t = Tensor::contiguous(dtype, {static_cast<int64_t>(values.size())});
  for (size_t i = 0; i < values.size(); ++i)
    t.set_linear(static_cast<int64_t>(i), static_cast<double>(values[i]));
  return t;
}

std::vector<int64_t> index_values(const Tensor& t) {
  std::vector<int64_t> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = static_cast<int64_t>(t.get_linear(i));
  return v;
}

// ---- memory snapshots -------------------------------------------------------------------------
MemRange range_of(const TensorView& t, int64_t elem_offset, int64_t count) {
  const char* b = static_cast<const char*>(t.data) + elem_offset * t.element_size();
  return {b, b + count * t.element_size()};
}

Snapshot& Snapshot::add(const void* base, int64_t bytes) {
  const auto* p = static_cast<const uint8_t*>(base);
  regions_.push_back({p, std::vector<uint8_t>(p, p + bytes)});
  return *this;
}

::testing::AssertionResult Snapshot::unchanged_except(const std::vector<MemRange>& allowed) const {
  for (size_t r = 0; r < regions_.size(); ++r) {
    const Region& reg = regions_[r];
    ::testing::AssertionResult res =
        equal_except(reg.base, reg.copy.data(), static_cast<int64_t>(reg.copy.size()), allowed);
    if (!res) return ::testing::AssertionFailure() << "region " << r << ": " << res.message();
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult Snapshot::equal_except(const void* now_base, const void* then_base,
                                                  int64_t bytes,
                                                  const std::vector<MemRange>& allowed) {
  const auto* now = static_cast<const uint8_t*>(now_base);
  const auto* then = static_cast<const uint8_t*>(then_base);
  std::vector<MemRange> sorted = allowed;
  std::sort(sorted.begin(), sorted.end(),
            [](const MemRange& a, const MemRange& b) { return a.begin < b.begin; });
  // The allowed range containing addr (ranges do not overlap), or null.
  auto containing = [&](const char* addr) -> const MemRange* {
    auto it = std::upper_bound(sorted.begin(), sorted.end(), addr,
                               [](const char* a, const MemRange& m) { return a < m.begin; });
    if (it == sorted.begin()) return nullptr;
    --it;
    return addr < it->end ? &*it : nullptr;
  };
  int64_t changed = 0;
  std::ostringstream first;
  for (int64_t i = 0; i < bytes; ++i) {
    if (now[i] == then[i]) continue;
    const char* addr = reinterpret_cast<const char*>(now + i);
    if (const MemRange* m = containing(addr)) {  // skip the rest of the allowed range
      i = std::min<int64_t>(bytes, m->end - reinterpret_cast<const char*>(now)) - 1;
      continue;
    }
    if (changed == 0)
      first << "byte " << i << ": 0x" << std::hex << int(then[i]) << " -> 0x" << int(now[i])
            << std::dec;
    ++changed;
  }
  if (changed == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << changed << " byte(s) outside the ranges that may change differ; first: " << first.str();
}

// ---- comparisons ------------------------------------------------------------------------------
Tol state_tol(DType state_dtype) {
  switch (state_dtype) {
    case DType::bf16:
      return {2e-3, 1e-4};
    case DType::f16:
      return {5e-4, 1e-4};
    default:
      return {1e-5, 1e-4};
  }
}

::testing::AssertionResult all_close(const std::vector<double>& got,
                                     const std::vector<double>& want, Tol tol, DType stored_as,
                                     int rounded) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure()
           << "sizes differ: got " << got.size() << ", want " << want.size();
  int64_t bad = 0;
  double worst = 0.0;
  std::ostringstream detail;
  for (size_t i = 0; i < got.size(); ++i) {
    const double w = want[i];
    const double base = tol.atol + tol.rtol * std::fabs(w);
    const double allowed = base + rounded * half_ulp(stored_as, std::fabs(w) + base);
    const double err = got[i] == w ? 0.0 : std::fabs(got[i] - w);  // equal infinities match
    if (!(err <= allowed)) {                                       // NaN fails
      if (bad < 5)
        detail << "\n  [" << i << "] got " << got[i] << ", want " << w << " (|err| " << err << " > "
               << allowed << ")";
      ++bad;
      if (!(err <= worst)) worst = err;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " elements out of tolerance (atol " << tol.atol
         << ", rtol " << tol.rtol << ", stored as " << dtype_short_name(stored_as)
         << "); worst |err| " << worst << detail.str();
}

::testing::AssertionResult all_zero(const std::vector<double>& got) {
  for (size_t i = 0; i < got.size(); ++i)
    if (!(got[i] == 0.0))
      return ::testing::AssertionFailure() << "element " << i << " is " << got[i] << ", not 0";
  return ::testing::AssertionSuccess();
}

std::vector<double> slice(const std::vector<double>& v, int64_t begin, int64_t count) {
  return std::vector<double>(v.begin() + begin, v.begin() + begin + count);
}

// ---- shapes and pools -------------------------------------------------------------------------
Tensor make_pool(DType dtype, int64_t slots, const Shape& s, int64_t slot_pad, int64_t lead) {
  const int64_t stride = s.state_elems() + slot_pad;
  Tensor t = Tensor::strided(dtype, {slots, s.HV, s.V, s.K},
                             {stride, static_cast<int64_t>(s.V) * s.K, s.K, 1}, lead,
                             lead + slots * stride);
  t.fill_all(kSentinel);
  return t;
}

namespace {
// The elements of one slot of a view whose dims below the slot are dense (a pool layer's state,
// a ReplaySSM ring of any rank): a view that is not is refused, so no helper reads or fills only
// part of a slot.
int64_t slot_elems(const TensorView& pool) {
  int64_t n = 1;
  for (int d = pool.ndim - 1; d >= 1; --d) {
    if (pool.stride[d] != n)
      throw std::invalid_argument("slot_elems: the view is not dense below its slot dim");
    n *= pool.shape[d];
  }
  return n;
}
}  // namespace

std::vector<double> view_values(const TensorView& t, int64_t elem_offset, int64_t count) {
  std::vector<double> v(static_cast<size_t>(count));
  for (int64_t e = 0; e < count; ++e) v[e] = load_value(t.data, t.dtype, elem_offset + e);
  return v;
}

std::vector<double> slot_values(const TensorView& pool, int64_t slot) {
  return view_values(pool, slot * pool.stride[0], slot_elems(pool));
}

void set_slot_values(const TensorView& pool, int64_t slot, const std::vector<double>& v) {
  for (size_t e = 0; e < v.size(); ++e)
    store_value(pool.data, pool.dtype, slot * pool.stride[0] + e, v[e]);
}

void fill_slot(const TensorView& pool, int64_t slot, Rng& rng, double lo, double hi) {
  for (int64_t e = 0; e < slot_elems(pool); ++e)
    store_value(pool.data, pool.dtype, slot * pool.stride[0] + e, rng.uniform(lo, hi));
}

MemRange slot_range(const TensorView& pool, int64_t slot) {
  return range_of(pool, slot * pool.stride[0], slot_elems(pool));
}

void fill_sentinel(void* base, int64_t bytes, DType dtype) {
  const int64_t n = bytes / deltastate::dtype_size(dtype);
  for (int64_t i = 0; i < n; ++i) store_value(base, dtype, i, kSentinel);
}

std::vector<int64_t> pick_slots(Rng& rng, int64_t rows, int64_t slots,
                                const std::vector<int64_t>& padded) {
  std::vector<int64_t> all(static_cast<size_t>(slots));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng.engine());
  std::vector<int64_t> out(static_cast<size_t>(rows));
  size_t next = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const bool pad = std::find(padded.begin(), padded.end(), r) != padded.end();
    out[r] = pad ? -1 : all.at(next++);
  }
  return out;
}

// ---- op inputs --------------------------------------------------------------------------------
namespace {
// Nudge a beta logit until sigmoid(b) is not within 1e-5 (relative) of a rounding boundary of
// `dtype` (see DecodeBatch::randomize).
double away_from_beta_ties(double b, DType dtype) {
  if (dtype == DType::f32) return b;
  for (int i = 0; i < 1000; ++i) {
    const double s = ref::sigmoid(b);
    if (round_to(dtype, s * (1 - 1e-5)) == round_to(dtype, s * (1 + 1e-5))) return b;
    b = round_to(dtype, b + 0.01 * (1.0 + std::fabs(b)));
  }
  return b;
}

ref::Token read_token(const Tensor& x, int64_t row, const Tensor& a, const Tensor& b,
                      const Shape& s, bool kda) {
  ref::Token t;
  const int64_t HK = static_cast<int64_t>(s.H) * s.K;
  for (int64_t i = 0; i < HK; ++i) {
    t.q.push_back(x.get({row, i}));
    t.k.push_back(x.get({row, HK + i}));
  }
  for (int64_t i = 0; i < static_cast<int64_t>(s.HV) * s.V; ++i)
    t.v.push_back(x.get({row, 2 * HK + i}));
  const int64_t gw = kda ? static_cast<int64_t>(s.HV) * s.K : s.HV;
  for (int64_t i = 0; i < gw; ++i) t.g.push_back(a.get({row, i}));
  for (int64_t i = 0; i < s.HV; ++i) t.beta.push_back(b.get({row, i}));
  return t;
}
}  // namespace

void DecodeBatch::randomize(Rng& rng) {
  const int64_t HK = static_cast<int64_t>(s.H) * s.K;
  for (int64_t r = 0; r < B; ++r) {
    for (int64_t i = 0; i < 2 * HK; ++i) x.set({r, i}, rng.normal());
    for (int64_t i = 2 * HK; i < s.width(); ++i) x.set({r, i}, rng.uniform(-0.5, 0.5));
    for (int64_t i = 0; i < a.size(1); ++i) a.set({r, i}, rng.normal(1.5));
    for (int64_t i = 0; i < s.HV; ++i)
      b.set({r, i}, away_from_beta_ties(round_to(act, rng.normal(1.5)), act));
  }
}

ref::Token DecodeBatch::token(int64_t row) const { return read_token(x, row, a, b, s, kda); }

ref::Config DecodeBatch::config(std::optional<double> lower_bound, double scale,
                                bool round_beta) const {
  ref::Config c;
  c.H = s.H;
  c.HV = s.HV;
  c.K = s.K;
  c.V = s.V;
  c.kda = kda;
  c.gate = lower_bound ? ref::Gate::safe : ref::Gate::standard;
  c.lower_bound = lower_bound.value_or(0.0);
  c.A_log = A_log.values();
  c.dt_bias = dt_bias.values();
  c.beta_is_logit = true;
  if (round_beta && act != DType::f32) {
    const DType t = act;
    c.round_beta = [t](double v) { return round_to(t, v); };
  }
  c.scale = scale;
  return c;
}

std::vector<double> DecodeBatch::out_row(int64_t row) const {
  std::vector<double> o;
  for (int64_t hv = 0; hv < s.HV; ++hv)
    for (int64_t v = 0; v < s.V; ++v) o.push_back(out.get({row, 0, hv, v}));
  return o;
}

DecodeBatch make_decode_batch(Rng& rng, const Shape& s, bool kda, const std::vector<int64_t>& slots,
                              DType act, int64_t row_pad, DType index_dtype) {
  DecodeBatch d;
  d.s = s;
  d.kda = kda;
  d.act = act;
  d.B = static_cast<int64_t>(slots.size());
  const int64_t gw = kda ? static_cast<int64_t>(s.HV) * s.K : s.HV;
  d.x = Tensor::strided(act, {d.B, s.width()}, {s.width() + row_pad, 1});
  d.a = Tensor::strided(act, {d.B, gw}, {gw + row_pad, 1});
  d.b = Tensor::strided(act, {d.B, s.HV}, {s.HV + row_pad, 1});
  for (Tensor* t : {&d.x, &d.a, &d.b}) t->fill_all(kSentinel);  // row gaps: never read
  d.A_log = Tensor::contiguous(DType::f32, {s.HV});
  d.dt_bias = Tensor::contiguous(DType::f32, {gw});
  d.A_log.fill_uniform(rng, -2.0, 0.5);
  d.dt_bias.fill_uniform(rng, -1.0, 1.0);
  d.out = Tensor::contiguous(act, {d.B, 1, s.HV, s.V});
  d.idx = index_tensor(slots, index_dtype);
  d.randomize(rng);
  d.poison_out();
  return d;
}

ref::Ring ring_of_slot(const TensorView& d, const TensorView& k, const TensorView& g,
                       int64_t slot) {
  auto per_slot = [](const TensorView& t) {
    int64_t n = 1;
    for (int i = 1; i < t.ndim; ++i) n *= t.shape[i];
    return n;
  };
  ref::Ring r;
  r.L = static_cast<int>(d.shape[2]);
  r.d = view_values(d, slot * per_slot(d), per_slot(d));
  r.k = view_values(k, slot * per_slot(k), per_slot(k));
  r.g = view_values(g, slot * per_slot(g), per_slot(g));
  return r;
}

Rings make_rings(const Shape& s, bool kda, int64_t slots, int L, DType d_dtype, DType k_dtype) {
  Rings r;
  r.L = L;
  r.d = Tensor::contiguous(d_dtype, {slots, s.HV, L, s.V});
  r.k = Tensor::contiguous(k_dtype, {slots, s.H, L, s.K});
  r.g = kda ? Tensor::contiguous(DType::f32, {slots, s.HV, L, s.K})
            : Tensor::contiguous(DType::f32, {slots, s.HV, L});
  for (Tensor* t : {&r.d, &r.k, &r.g}) t->fill_all(kSentinel);
  return r;
}

// ---- recurrent inputs -------------------------------------------------------------------------
RecurrentBatch make_recurrent_batch(Rng& rng, const RecurrentSpec& spec) {
  RecurrentBatch r;
  r.spec = spec;
  const Shape& s = spec.s;
  int64_t B = spec.B, T = spec.T;
  if (!spec.seqlens.empty()) {
    B = 1;
    T = std::accumulate(spec.seqlens.begin(), spec.seqlens.end(), int64_t{0});
    std::vector<int64_t> cu{0};
    for (int64_t l : spec.seqlens) cu.push_back(cu.back() + l);
    r.cu = index_tensor(cu, spec.index_dtype);
    r.N = static_cast<int64_t>(spec.seqlens.size());
  } else {
    r.N = B;
  }
  const int64_t H = s.H, HV = s.HV, K = s.K, V = s.V;
  if (spec.packed_qkv) {
    const int64_t W = s.width() + 8;  // a gap after each token's [q | k | v]
    Tensor buf = Tensor::strided(spec.act, {B, T, W}, {T * W, W, 1});
    buf.fill_all(kSentinel);
    r.q = buf.alias(spec.act, {B, T, H, K}, {T * W, W, K, 1}, 0);
    r.k = buf.alias(spec.act, {B, T, H, K}, {T * W, W, K, 1}, H * K);
    r.v = buf.alias(spec.act, {B, T, HV, V}, {T * W, W, V, 1}, 2 * H * K);
  } else {
    r.q = Tensor::contiguous(spec.act, {B, T, H, K});
    r.k = Tensor::contiguous(spec.act, {B, T, H, K});
    r.v = Tensor::contiguous(spec.act, {B, T, HV, V});
  }
  const DType g_dtype = spec.g_dtype.value_or(spec.act);
  r.g = spec.kda ? Tensor::contiguous(g_dtype, {B, T, HV, K})
                 : Tensor::contiguous(g_dtype, {B, T, HV});
  r.beta = Tensor::contiguous(spec.act, {B, T, HV});
  r.out = Tensor::contiguous(spec.act, {B, T, HV, V});
  r.A_log = Tensor::contiguous(DType::f32, {HV});
  r.dt_bias = spec.kda ? (spec.dt_bias_2d ? Tensor::contiguous(DType::f32, {HV, K})
                                          : Tensor::contiguous(DType::f32, {HV * K}))
                       : Tensor::contiguous(DType::f32, {HV});
  r.A_log.fill_uniform(rng, -2.0, 0.5);
  r.dt_bias.fill_uniform(rng, -1.0, 1.0);
  r.randomize(rng);
  r.poison_out();
  return r;
}

void RecurrentBatch::randomize(Rng& rng) {
  q.fill_normal(rng, 1.0);
  k.fill_normal(rng, 1.0);
  v.fill_uniform(rng, -0.5, 0.5);
  if (spec.gate_in_kernel) g.fill_normal(rng, 1.5);
  else g.fill_uniform(rng, -2.5, 0.0);
  if (spec.beta_is_logit) beta.fill_normal(rng, 1.5);
  else beta.fill_uniform(rng, 0.05, 0.95);
}

int64_t RecurrentBatch::seq_len(int64_t n) const {
  return spec.seqlens.empty() ? spec.T : spec.seqlens[n];
}

std::pair<int64_t, int64_t> RecurrentBatch::coord(int64_t n, int64_t t) const {
  if (spec.seqlens.empty()) return {n, t};
  int64_t start = 0;
  for (int64_t i = 0; i < n; ++i) start += spec.seqlens[i];
  return {0, start + t};
}

ref::Token RecurrentBatch::token(int64_t n, int64_t t) const {
  const auto [b, tok] = coord(n, t);
  const Shape& s = spec.s;
  ref::Token x;
  for (int64_t h = 0; h < s.H; ++h)
    for (int64_t i = 0; i < s.K; ++i) {
      x.q.push_back(q.get({b, tok, h, i}));
      x.k.push_back(k.get({b, tok, h, i}));
    }
  for (int64_t hv = 0; hv < s.HV; ++hv) {
    for (int64_t i = 0; i < s.V; ++i) x.v.push_back(v.get({b, tok, hv, i}));
    if (spec.kda) {
      for (int64_t i = 0; i < s.K; ++i) x.g.push_back(g.get({b, tok, hv, i}));
    } else {
      x.g.push_back(g.get({b, tok, hv}));
    }
    x.beta.push_back(beta.get({b, tok, hv}));
  }
  return x;
}

ref::Config RecurrentBatch::config(double scale) const {
  ref::Config c;
  c.H = spec.s.H;
  c.HV = spec.s.HV;
  c.K = spec.s.K;
  c.V = spec.s.V;
  c.kda = spec.kda;
  c.gate = !spec.gate_in_kernel ? ref::Gate::log_decay
           : spec.lower_bound   ? ref::Gate::safe
                                : ref::Gate::standard;
  c.lower_bound = spec.lower_bound.value_or(0.0);
  if (spec.gate_in_kernel) {
    c.A_log = A_log.values();
    c.dt_bias = dt_bias.values();
  }
  c.beta_is_logit = spec.beta_is_logit;
  c.scale = scale;
  return c;
}

std::vector<double> RecurrentBatch::out_token(int64_t n, int64_t t) const {
  const auto [b, tok] = coord(n, t);
  std::vector<double> o;
  for (int64_t hv = 0; hv < spec.s.HV; ++hv)
    for (int64_t i = 0; i < spec.s.V; ++i) o.push_back(out.get({b, tok, hv, i}));
  return o;
}

}  // namespace dstest
