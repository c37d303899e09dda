#include "contracts/contract.h"

#include <algorithm>
#include <unordered_map>

#include "core/numeric.h"

namespace deltastate::detail {

namespace {
std::string quoted(std::string_view name) {
  std::string r;
  r.reserve(name.size() + 2);
  r += '`';
  r += name;
  r += '`';
  return r;
}

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t pos = s.find(sep, start);
    out.emplace_back(s.substr(start, pos == std::string_view::npos ? pos : pos - start));
    if (pos == std::string_view::npos) break;
    start = pos + 1;
  }
  return out;
}

bool is_literal(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}
}  // namespace

int64_t Contract::get(std::string_view symbol) const {
  for (const auto& b : bindings_)
    if (b.symbol == symbol) return b.value;
  return -1;
}

void Contract::bind(std::string_view symbol, int64_t value, std::string_view source) {
  for (const auto& b : bindings_) {
    if (b.symbol == symbol) {
      if (b.value != value) {
        fail(format("%s gives %.*s=%lld but %s gives %.*s=%lld", std::string(source).c_str(),
                    static_cast<int>(symbol.size()), symbol.data(), static_cast<long long>(value),
                    b.source.c_str(), static_cast<int>(symbol.size()), symbol.data(),
                    static_cast<long long>(b.value)));
      }
      return;
    }
  }
  bindings_.push_back({std::string(symbol), value, std::string(source)});
}

void Contract::shape(std::string_view name, const TensorView& t,
                     std::initializer_list<const char*> dims) {
  const int nd = static_cast<int>(dims.size());
  std::string spec = "[";
  {
    int i = 0;
    for (const char* d : dims) spec += (i++ ? ", " : "") + std::string(d);
  }
  spec += "]";
  if (t.ndim != nd) {
    fail(format("%s must be a %dD tensor %s; got shape %s", quoted(name).c_str(), nd, spec.c_str(),
                shape_str(t).c_str()));
  }
  // First pass: evaluate each dim (binding new single symbols from this tensor).
  struct Eval {
    int64_t expected;  // -1: bound from this tensor
    std::string note;  // "V=128 from `state`"
  };
  std::vector<Eval> evals;
  bool ok = true;
  int i = 0;
  for (const char* d : dims) {
    const int64_t actual = t.shape[i];
    std::vector<std::string> factors = split(d, '*');
    if (factors.size() == 1 && !is_literal(factors[0]) && get(factors[0]) < 0) {
      bindings_.push_back({factors[0], actual, quoted(name)});
      evals.push_back({actual, ""});
    } else {
      int64_t expected = 1;
      std::string note;
      for (const auto& f : factors) {
        if (is_literal(f)) {
          expected *= std::stoll(f);
          continue;
        }
        const Binding* b = nullptr;
        for (const auto& bb : bindings_)
          if (bb.symbol == f) b = &bb;
        if (!b)
          fail(format("internal: symbol %s of %s used before it is bound", f.c_str(),
                      quoted(name).c_str()));
        expected *= b->value;
        if (!note.empty()) note += ", ";
        note += format("%s=%lld from %s", f.c_str(), static_cast<long long>(b->value),
                       b->source.c_str());
      }
      if (expected != actual) ok = false;
      evals.push_back({expected, expected != actual ? note : ""});
    }
    ++i;
  }
  if (ok) return;
  std::vector<int64_t> expected;
  std::string notes;
  for (const auto& e : evals) {
    expected.push_back(e.expected);
    if (!e.note.empty()) notes += (notes.empty() ? "" : "; ") + e.note;
  }
  fail(format("%s must have shape %s=%s; got %s%s", quoted(name).c_str(), spec.c_str(),
              tuple_str(expected.data(), nd).c_str(), shape_str(t).c_str(),
              notes.empty() ? "" : (" (" + notes + ")").c_str()));
}

void Contract::dtype(std::string_view name, const TensorView& t,
                     std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype == d) return;
  std::string list;
  size_t i = 0;
  for (DType d : allowed) {
    if (i) list += (i + 1 == allowed.size()) ? " or " : ", ";
    list += dtype_mark(dtype_name(d));
    ++i;
  }
  fail(format("%s must have dtype %s; got %s", quoted(name).c_str(), list.c_str(),
              dtype_mark(dtype_name(t.dtype)).c_str()));
}

void Contract::floating(std::string_view name, const TensorView& t) {
  dtype(name, t, {DType::f32, DType::bf16, DType::f16});
}

void Contract::float_state(std::string_view name, const TensorView& t) {
  if (is_quantized(t.dtype))
    throw Error(ErrorKind::not_implemented,
                format("%s is a quantized state (%s): this op does not take quantized states yet "
                       "(issue #36; docs/STATE_FORMATS.md lists the ops that do); its states are "
                       "float32, bfloat16 or float16",
                       quoted(name).c_str(), dtype_mark(dtype_name(t.dtype)).c_str()));
  floating(name, t);
}

void Contract::index_dtype(std::string_view name, const TensorView& t) {
  dtype(name, t, {DType::i32, DType::i64});
}

void Contract::last_dim_contiguous(std::string_view name, const TensorView& t) {
  if (t.ndim > 0 && t.size(-1) > 1 && t.stride_of(-1) != 1) {
    fail(format("%s must be contiguous in its last dim; got strides %s", quoted(name).c_str(),
                stride_str(t).c_str()));
  }
}

void Contract::contiguous(std::string_view name, const TensorView& t) {
  if (!t.is_contiguous()) {
    fail(format("%s must be contiguous; got shape %s with strides %s", quoted(name).c_str(),
                shape_str(t).c_str(), stride_str(t).c_str()));
  }
}

void Contract::device(std::string_view name, const TensorView& t) {
  if (devices_.empty()) device_ = t.device;
  devices_.push_back({std::string(name), t.device});
}

void Contract::check_devices(const std::string& message, bool name_them) const {
  for (const auto& d : devices_) {
    if (!(d.device == device_)) {
      if (!name_them) fail(message);
      fail(format("%s: %s is on %s, %s is on %s", message.c_str(), quoted(devices_[0].name).c_str(),
                  to_string(device_).c_str(), quoted(d.name).c_str(), to_string(d.device).c_str()));
    }
  }
}

void require_cuda_k(int64_t K) {
  if (K > 256)
    throw Error(
        ErrorKind::not_implemented,
        format("the CUDA backend supports K <= 256 (got K=%lld)", static_cast<long long>(K)));
}

bool inner_strides_compact(const TensorView& pool) {
  if (pool.ndim != 4) return false;
  const int64_t V = pool.shape[2], K = pool.shape[3];
  auto ok = [](int64_t size, int64_t stride, int64_t want) { return size <= 1 || stride == want; };
  return ok(pool.shape[1], pool.stride[1], V * K) && ok(V, pool.stride[2], K) &&
         ok(K, pool.stride[3], 1);
}

std::string strides_detail(std::string_view name, const TensorView& t) {
  int64_t dense[kMaxDims] = {};
  int64_t running = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    dense[d] = running;
    running *= t.shape[d];
  }
  return format(" %s has strides %s for shape %s; expected %s.", quoted(name).c_str(),
                stride_str(t).c_str(), shape_str(t).c_str(), tuple_str(dense, t.ndim).c_str());
}

std::string last_stride_detail(std::string_view name, const TensorView& t) {
  return format(" %s has strides %s; expected a last stride of 1.", quoted(name).c_str(),
                stride_str(t).c_str());
}

std::string inner_strides_detail(std::string_view name, const TensorView& pool) {
  return format(" %s has strides %s; expected (any, %lld, %lld, 1).", quoted(name).c_str(),
                stride_str(pool).c_str(), static_cast<long long>(pool.shape[2] * pool.shape[3]),
                static_cast<long long>(pool.shape[3]));
}

void check_slot_indices_host(std::string_view name, const void* indices, DType dtype, int64_t n,
                             int64_t stride, int64_t num_slots) {
  std::unordered_map<int64_t, int64_t> first_row;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t idx = load_index(indices, dtype, i * stride);
    if (idx < 0) continue;
    if (idx >= num_slots) {
      fail(
          format("%s[%lld]=%lld is out of range for a state pool of %lld slots (valid: 0..%lld; "
                 "< 0 marks a padded row)",
                 quoted(name).c_str(), static_cast<long long>(i), static_cast<long long>(idx),
                 static_cast<long long>(num_slots), static_cast<long long>(num_slots - 1)));
    }
    auto [it, inserted] = first_row.emplace(idx, i);
    if (!inserted) {
      fail(format("%s uses slot %lld for rows %lld and %lld; each live row needs its own slot",
                  quoted(name).c_str(), static_cast<long long>(idx),
                  static_cast<long long>(it->second), static_cast<long long>(i)));
    }
  }
}

void check_cu_seqlens_host(const TensorView& cu, int64_t total_tokens) {
  const int64_t n = cu.shape[0];
  int64_t prev = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = load_index(cu.data, cu.dtype, i);
    if (v < prev || v > total_tokens || (i == 0 && v != 0)) {
      fail(
          format("`cu_seqlens` must start at 0 and be non-decreasing within [0, T=%lld]; got "
                 "cu_seqlens[%lld]=%lld%s",
                 static_cast<long long>(total_tokens), static_cast<long long>(i),
                 static_cast<long long>(v),
                 i ? format(" after %lld", static_cast<long long>(prev)).c_str() : ""));
    }
    prev = v;
  }
}

}  // namespace deltastate::detail
