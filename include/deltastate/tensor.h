// deltastate: framework-free tensor views.
//
// A TensorView is a non-owning description of memory: pointer, dtype, device, up to 6 dims and
// int64 element strides. Every op takes its tensors as TensorViews; nothing here depends on a
// framework. Views are never copied, reshaped or made contiguous behind the caller's back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace deltastate {

// f8e4m3 (torch's float8_e4m3fn) and i8 are storage formats of a quantized state pool only
// (StatePool state_dtype, with fp32 scales; docs/STATE_FORMATS.md): no op takes them as inputs.
enum class DType : uint8_t { f32, bf16, f16, i32, i64, f8e4m3, i8 };

// Bytes per element.
constexpr int64_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::bf16:
      return 2;
    case DType::f16:
      return 2;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::f8e4m3:
    case DType::i8:
      return 1;
  }
  return 0;
}
constexpr bool is_floating(DType t) {
  return t == DType::f32 || t == DType::bf16 || t == DType::f16;
}
constexpr bool is_integer(DType t) { return t == DType::i32 || t == DType::i64; }
// The 1-byte state formats, stored with one fp32 scale per (slot, head, V row).
constexpr bool is_quantized(DType t) { return t == DType::f8e4m3 || t == DType::i8; }

// How a stored state is rounded (StatePool::state_rounding, the ops' `state_rounding`):
// format_default is stochastic for float8_e4m3fn and to nearest for every other dtype
// (docs/STATE_FORMATS.md). Stochastic rounding draws its bits from a counter-based generator keyed
// by (seed, slot, layer, step).
enum class StateRounding : uint8_t { format_default, nearest, stochastic };
constexpr bool rounds_stochastically(DType state, StateRounding r) {
  return r == StateRounding::stochastic ||
         (r == StateRounding::format_default && state == DType::f8e4m3);
}

// Names as frameworks print them ("float32", "bfloat16", ..., "float8_e4m3fn", "int8").
const char* dtype_name(DType t);
// Short names ("f32", "bf16", "f16", "i32", "i64", "f8e4m3", "i8"), as the CLI spells them.
const char* dtype_short_name(DType t);

enum class DeviceType : uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;
  friend bool operator==(const Device& a, const Device& b) {
    return a.type == b.type && (a.type == DeviceType::cpu || a.index == b.index);
  }
  static Device cpu() { return {}; }
  static Device cuda(int index = 0) { return {DeviceType::cuda, index}; }
};
std::string to_string(const Device& d);  // "cpu", "cuda:0"

constexpr int kMaxDims = 6;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device{};
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};  // in elements

  // Dense row-major view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = {});
  // Explicit strides (elements).
  static TensorView strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> strides, Device device = {});

  // Python-style negative dims are accepted.
  int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
  int64_t stride_of(int dim) const { return stride[dim < 0 ? dim + ndim : dim]; }
  int64_t numel() const;
  int64_t element_size() const { return dtype_size(dtype); }
  bool is_contiguous() const;  // row-major dense (size-1 dims may have any stride)
  template <class T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

// "(4, 512)", "(5,)", "()" -- shapes and strides printed like Python tuples.
std::string shape_str(const TensorView& t);
std::string stride_str(const TensorView& t);
std::string tuple_str(const int64_t* v, int n);
std::string tuple_str(std::initializer_list<int64_t> v);

}  // namespace deltastate
