#include "deltastate/tensor.h"
#include "deltastate/error.h"

#include <string>

namespace deltastate {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "float32";
    case DType::bf16:
      return "bfloat16";
    case DType::f16:
      return "float16";
    case DType::i32:
      return "int32";
    case DType::i64:
      return "int64";
    case DType::f8e4m3:
      return "float8_e4m3fn";
    case DType::i8:
      return "int8";
  }
  return "unknown";
}

const char* dtype_short_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::f8e4m3:
      return "f8e4m3";
    case DType::i8:
      return "i8";
  }
  return "unknown";
}

std::string to_string(const Device& d) {
  if (d.type == DeviceType::cpu) return "cpu";
  return "cuda:" + std::to_string(d.index);
}

namespace {
TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  if (shape.size() > static_cast<size_t>(kMaxDims)) {
    throw_value_error("a TensorView has at most " + std::to_string(kMaxDims) + " dims; got " +
                      std::to_string(shape.size()));
  }
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  return t;
}
}  // namespace

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  TensorView t = make_view(data, dtype, shape, device);
  int64_t s = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = s;
    s *= t.shape[d];
  }
  return t;
}

TensorView TensorView::strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> strides, Device device) {
  if (strides.size() != shape.size()) {
    throw_value_error("TensorView::strided: " + std::to_string(shape.size()) + " sizes but " +
                      std::to_string(strides.size()) + " strides");
  }
  TensorView t = make_view(data, dtype, shape, device);
  int i = 0;
  for (int64_t s : strides) t.stride[i++] = s;
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string tuple_str(const int64_t* v, int n) {
  std::string s = "(";
  for (int i = 0; i < n; ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  if (n == 1) s += ",";
  s += ")";
  return s;
}

std::string tuple_str(std::initializer_list<int64_t> v) {
  return tuple_str(v.begin(), static_cast<int>(v.size()));
}

std::string shape_str(const TensorView& t) { return tuple_str(t.shape, t.ndim); }
std::string stride_str(const TensorView& t) { return tuple_str(t.stride, t.ndim); }

}  // namespace deltastate
