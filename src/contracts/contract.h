// The contract layer: matchers that bind symbolic sizes (B, T, N, H, HV, K, V, L, slots) across
// tensors and throw deltastate::Error (ErrorKind::value) with messages that name the tensor and
// show what was expected and what was found. Op-specific checks whose text must match the
// reference implementation verbatim live beside the op's validator (src/contracts/*.cpp) and use
// `fail` with a formatted message (core/error_text.h).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "core/error_text.h"
#include "deltastate/error.h"
#include "deltastate/tensor.h"

namespace deltastate::detail {

class Contract {
 public:
  // The value bound to `symbol`, or -1 when unbound.
  int64_t get(std::string_view symbol) const;
  // Bind symbol = value (first binder wins; `source` names the tensor or argument it came from).
  // A later bind with another value fails with both sources named.
  void bind(std::string_view symbol, int64_t value, std::string_view source);

  // `name` must have exactly these dims. Each dim spec is a literal ("1"), a symbol ("HV") that
  // is bound on first sight, or a product of bound symbols/literals ("HV*K").
  //   `v` must have shape [B, T, HV, V]=(2, 5, 32, 128); got (2, 5, 32, 64) (V=128 from `state`)
  void shape(std::string_view name, const TensorView& t, std::initializer_list<const char*> dims);
  // One of the given dtypes:  `q` must have dtype float32, bfloat16 or float16; got int32
  void dtype(std::string_view name, const TensorView& t, std::initializer_list<DType> allowed);
  void floating(std::string_view name, const TensorView& t);  // f32 / bf16 / f16
  // A state of an op that does not take quantized states (yet): a float8_e4m3fn / int8 state is
  // NotImplementedError naming it, any other non-float dtype floating()'s error.
  void float_state(std::string_view name, const TensorView& t);
  void index_dtype(std::string_view name, const TensorView& t);  // i32 / i64
  // The last dim has stride 1:  `q` must be contiguous in its last dim; got strides (..)
  void last_dim_contiguous(std::string_view name, const TensorView& t);
  void contiguous(std::string_view name, const TensorView& t);

  // Devices: every tensor registered must be on the first one's device. `message` is the text
  // to throw; with `name_them` the two disagreeing tensors and their devices are appended
  // (ops whose message must match the reference verbatim pass false).
  void device(std::string_view name, const TensorView& t);
  void check_devices(const std::string& message, bool name_them) const;
  Device common_device() const { return device_; }

 private:
  struct Binding {
    std::string symbol;
    int64_t value;
    std::string source;
  };
  std::vector<Binding> bindings_;
  struct DeviceOf {
    std::string name;
    Device device;
  };
  std::vector<DeviceOf> devices_;
  Device device_{};
};

// The state pool's inner dims [HV, V, K] must be compact: strides (V*K, K, 1).
bool inner_strides_compact(const TensorView& pool);

// What a contiguity message appends (after the peer's own text where the op takes a peer's name):
// the strides found and the ones needed.
//   dense:       " `out` has strides (128, 64, 32, 2) for shape (3, 1, 4, 16); expected (64, 64,
//   16, 1)." last dim:    " `a` has strides (8, 2); expected a last stride of 1." inner dims:  "
//   `initial_state` has strides (600, 128, 8, 1); expected (any, 128, 8, 1)."
std::string strides_detail(std::string_view name, const TensorView& t);
std::string last_stride_detail(std::string_view name, const TensorView& t);
std::string inner_strides_detail(std::string_view name, const TensorView& pool);

// A limit of the CUDA kernels that the CPU kernels do not have (ErrorKind::not_implemented):
// a lane holds its slice of each state row in registers, over a K tile of at most 256. Validators
// apply it to CUDA tensors only, after every contract check.
void require_cuda_k(int64_t K);

// Host check of slot indices (CPU tensors only): every index < num_slots, and no live slot used
// by two rows. `name` is the argument name for the message.
void check_slot_indices_host(std::string_view name, const void* indices, DType dtype, int64_t n,
                             int64_t stride, int64_t num_slots);

// Host check of cu_seqlens (CPU tensors only): starts at 0, non-decreasing, at most
// `total_tokens`. The recurrent op's and the chunked prefill's rule, one text.
void check_cu_seqlens_host(const TensorView& cu, int64_t total_tokens);

}  // namespace deltastate::detail
