// The Python binding: a tvm-ffi module over the framework-free C++ API.
//
// Every tensor argument arrives as a DLPack view (tvm::ffi::TensorView: numpy arrays, torch CPU
// and CUDA tensors, zero copy, any strides); it is turned into a deltastate::TensorView and the C++
// op runs in place on the caller's memory. For CUDA tensors the op launches on the stream that
// tvm-ffi reports for the device: torch's current stream when the arguments are torch tensors
// (docs/BINDINGS.md). deltastate::Error becomes ValueError / TypeError / NotImplementedError /
// RuntimeError with the core's exact message.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/string.h>

#include <memory>
#include <string>

#include "deltastate/deltastate.h"

namespace {

namespace ffi = tvm::ffi;
namespace ds = deltastate;

[[noreturn]] void raise(const ds::Error& e) {
  const char* kind = "RuntimeError";
  switch (e.kind()) {
    case ds::ErrorKind::value: kind = "ValueError"; break;
    case ds::ErrorKind::type: kind = "TypeError"; break;
    case ds::ErrorKind::not_implemented: kind = "NotImplementedError"; break;
    case ds::ErrorKind::runtime: kind = "RuntimeError"; break;
  }
  throw ffi::Error(kind, e.what(), "");
}

// Runs fn, translating deltastate errors into Python exceptions.
template <class F>
auto guarded(F&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const ds::Error& e) {
    raise(e);
  }
}

ds::DType to_dtype(DLDataType t, const char* name) {
  if (t.lanes == 1) {
    if (t.code == kDLFloat && t.bits == 32) return ds::DType::f32;
    if (t.code == kDLFloat && t.bits == 16) return ds::DType::f16;
    if (t.code == kDLBfloat && t.bits == 16) return ds::DType::bf16;
    if (t.code == kDLInt && t.bits == 32) return ds::DType::i32;
    if (t.code == kDLInt && t.bits == 64) return ds::DType::i64;
  }
  throw ds::Error(ds::ErrorKind::value,
                  std::string("`") + name + "` has a dtype deltastate does not take (DLPack code " +
                      std::to_string(t.code) + ", " + std::to_string(t.bits) +
                      " bits); use float32, bfloat16, float16, int32 or int64");
}

ds::TensorView to_view(const ffi::TensorView& t, const char* name) {
  ds::TensorView v;
  const int nd = t.ndim();
  if (nd > ds::kMaxDims)
    throw ds::Error(ds::ErrorKind::value, std::string("`") + name + "` has " + std::to_string(nd) +
                                              " dims; deltastate takes at most 6");
  v.dtype = to_dtype(t.dtype(), name);
  const DLDevice dev = t.device();
  if (dev.device_type == kDLCPU || dev.device_type == kDLCUDAHost) {
    v.device = ds::Device::cpu();
  } else if (dev.device_type == kDLCUDA || dev.device_type == kDLCUDAManaged) {
    v.device = ds::Device::cuda(dev.device_id);
  } else {
    throw ds::Error(ds::ErrorKind::value, std::string("`") + name +
                                              "` is on a device deltastate does not run on "
                                              "(DLPack device type " +
                                              std::to_string(dev.device_type) + ")");
  }
  v.data = static_cast<char*>(t.data_ptr()) + t.byte_offset();
  v.ndim = nd;
  // DLPack may leave strides null for compact tensors: then they are the row-major ones.
  const bool compact = t.IsContiguous();
  const ffi::ShapeView shape = t.shape();
  int64_t running = 1;
  for (int d = nd - 1; d >= 0; --d) {
    v.shape[d] = shape[d];
    v.stride[d] = compact ? running : t.strides()[d];
    running *= shape[d];
  }
  return v;
}

std::optional<ds::TensorView> to_view(const ffi::Optional<ffi::TensorView>& t, const char* name) {
  if (!t) return std::nullopt;
  return to_view(t.value(), name);
}

std::optional<double> to_opt(const ffi::Optional<double>& x) {
  if (!x) return std::nullopt;
  return x.value();
}

// check_indices: -1 = the backend's default, 0 = off, 1 = on.
std::optional<bool> to_check(int64_t check) {
  if (check < 0) return std::nullopt;
  return check != 0;
}

// The stream to launch on: the environment's current stream for the device (torch's current
// stream when torch tensors were passed), nullptr for CPU.
ds::Stream stream_for(const ds::TensorView& any) {
  if (any.device.type != ds::DeviceType::cuda) return nullptr;
  return TVMFFIEnvGetStream(kDLCUDA, any.device.index);
}

// ---- ops -------------------------------------------------------------------------------------

void packed_decode(bool is_kda, ffi::TensorView mixed_qkv, ffi::TensorView a, ffi::TensorView b,
                   ffi::TensorView A_log, ffi::TensorView dt_bias, double scale,
                   ffi::TensorView state, ffi::TensorView out, ffi::TensorView indices,
                   bool use_qk_l2norm, ffi::Optional<double> lower_bound, bool round_beta,
                   int64_t check_indices, bool pdl) {
  guarded([&] {
    ds::PackedDecodeArgs args;
    args.mixed_qkv = to_view(mixed_qkv, "mixed_qkv");
    args.a = to_view(a, "a");
    args.b = to_view(b, "b");
    args.A_log = to_view(A_log, "A_log");
    args.dt_bias = to_view(dt_bias, "dt_bias");
    args.scale = scale;
    args.state = to_view(state, "initial_state");
    args.out = to_view(out, "out");
    args.state_indices = to_view(indices, "ssm_state_indices");
    args.use_qk_l2norm = use_qk_l2norm;
    args.lower_bound = to_opt(lower_bound);
    args.round_beta_to_input = round_beta;
    args.check_indices = to_check(check_indices);
    args.stream = stream_for(args.state);
    args.pdl = pdl;
    if (is_kda) ds::kda_packed_decode(args);
    else ds::gdn_packed_decode(args);
  });
}

void recurrent(bool is_kda, ffi::TensorView q, ffi::TensorView k, ffi::TensorView v,
               ffi::TensorView g, ffi::TensorView beta, ffi::TensorView out,
               ffi::Optional<ffi::TensorView> A_log, ffi::Optional<ffi::TensorView> dt_bias,
               bool gate_in_kernel, ffi::Optional<double> lower_bound, bool beta_is_logit,
               ffi::Optional<double> scale, ffi::Optional<ffi::TensorView> state,
               ffi::Optional<ffi::TensorView> indices, ffi::Optional<ffi::TensorView> cu_seqlens,
               ffi::Optional<ffi::TensorView> final_state, bool update_state, bool use_qk_l2norm,
               int64_t check_indices, bool pdl) {
  guarded([&] {
    ds::RecurrentArgs args;
    args.q = to_view(q, "q");
    args.k = to_view(k, "k");
    args.v = to_view(v, "v");
    args.g = to_view(g, "g");
    args.beta = to_view(beta, "beta");
    args.out = to_view(out, "output");
    args.A_log = to_view(A_log, "A_log");
    args.dt_bias = to_view(dt_bias, "dt_bias");
    args.gate_in_kernel = gate_in_kernel;
    args.lower_bound = to_opt(lower_bound);
    args.beta_is_logit = beta_is_logit;
    args.scale = to_opt(scale);
    args.state = to_view(state, "initial_state");
    args.state_indices = to_view(indices, "ssm_state_indices");
    args.cu_seqlens = to_view(cu_seqlens, "cu_seqlens");
    args.final_state = to_view(final_state, "final_state");
    args.update_state = update_state;
    args.use_qk_l2norm = use_qk_l2norm;
    args.check_indices = to_check(check_indices);
    args.stream = stream_for(args.q);
    args.pdl = pdl;
    if (is_kda) ds::recurrent_kda(args);
    else ds::recurrent_gdn(args);
  });
}

void replayssm_decode(ffi::TensorView mixed_qkv, ffi::TensorView a, ffi::TensorView b,
                      ffi::TensorView A_log, ffi::TensorView dt_bias, double scale,
                      ffi::TensorView state, ffi::TensorView d_cache, ffi::TensorView k_cache,
                      ffi::TensorView g_cache, ffi::TensorView out, ffi::TensorView indices,
                      ffi::TensorView write_pos, ffi::Optional<ffi::TensorView> force_flush,
                      bool is_kda, bool use_qk_l2norm, ffi::Optional<double> lower_bound,
                      bool advance_write_pos, int64_t check_indices, bool pdl) {
  guarded([&] {
    ds::ReplayDecodeArgs args;
    args.mixed_qkv = to_view(mixed_qkv, "mixed_qkv");
    args.a = to_view(a, "a");
    args.b = to_view(b, "b");
    args.A_log = to_view(A_log, "A_log");
    args.dt_bias = to_view(dt_bias, "dt_bias");
    args.scale = scale;
    args.state = to_view(state, "initial_state");
    args.d_cache = to_view(d_cache, "d_cache");
    args.k_cache = to_view(k_cache, "k_cache");
    args.g_cache = to_view(g_cache, "g_cache");
    args.out = to_view(out, "out");
    args.state_indices = to_view(indices, "ssm_state_indices");
    args.write_pos = to_view(write_pos, "write_pos");
    args.force_flush = to_view(force_flush, "force_flush");
    args.is_kda = is_kda;
    args.use_qk_l2norm = use_qk_l2norm;
    args.lower_bound = to_opt(lower_bound);
    args.advance_write_pos = advance_write_pos;
    args.check_indices = to_check(check_indices);
    args.stream = stream_for(args.state);
    args.pdl = pdl;
    ds::replayssm_decode(args);
  });
}

bool cuda_available() { return ds::cuda_available(); }
bool cuda_built() { return ds::cuda_built(); }

// ---- the state pool --------------------------------------------------------------------------
// The framework allocates the storage (so views are the caller's tensors); the C++ StatePool does
// the layout and the bookkeeping over it. A pool is handed to Python as a map of closures.

ds::DType dtype_from_name(const std::string& s, const char* what) {
  if (s == "float32") return ds::DType::f32;
  if (s == "bfloat16") return ds::DType::bf16;
  if (s == "float16") return ds::DType::f16;
  throw ds::Error(ds::ErrorKind::value, std::string(what) + " must be float32, bfloat16 or "
                                                           "float16; got " + s);
}

ds::StatePoolConfig pool_config(int64_t layers, int64_t slots, int64_t HV, int64_t V, int64_t K,
                                const std::string& state_dtype, bool envelope,
                                int64_t envelope_extra_bytes, int64_t replay_len, int64_t H,
                                const std::string& ring_k_dtype, bool kda, bool null_slot) {
  ds::StatePoolConfig c;
  c.layers = layers;
  c.slots = slots;
  c.HV = HV;
  c.V = V;
  c.K = K;
  c.state_dtype = dtype_from_name(state_dtype, "state_dtype");
  c.layout = envelope ? ds::PoolLayout::envelope : ds::PoolLayout::per_layer;
  c.envelope_extra_bytes = envelope_extra_bytes;
  c.replay_len = replay_len;
  c.H = H;
  c.ring_k_dtype = dtype_from_name(ring_k_dtype, "ring_k_dtype");
  c.kda = kda;
  c.null_slot = null_slot;
  return c;
}

// [byte offset, shape..., strides...] of a view relative to the pool's base.
ffi::Array<int64_t> describe(const ds::TensorView& v, const void* base) {
  std::vector<int64_t> out;
  out.push_back(static_cast<const char*>(v.data) - static_cast<const char*>(base));
  for (int d = 0; d < v.ndim; ++d) out.push_back(v.shape[d]);
  for (int d = 0; d < v.ndim; ++d) out.push_back(v.stride[d]);
  return ffi::Array<int64_t>(out.begin(), out.end());
}

// [required_bytes, bytes_per_slot, slots_for_budget(budget)] of a configuration.
ffi::Array<int64_t> pool_sizes(int64_t layers, int64_t slots, int64_t HV, int64_t V, int64_t K,
                               ffi::String state_dtype, bool envelope, int64_t extra,
                               int64_t replay_len, int64_t H, ffi::String ring_k_dtype, bool kda,
                               bool null_slot, int64_t budget) {
  return guarded([&] {
    const ds::StatePoolConfig c = pool_config(layers, slots, HV, V, K, state_dtype, envelope, extra,
                                              replay_len, H, ring_k_dtype, kda, null_slot);
    const std::vector<int64_t> v{ds::StatePool::required_bytes(c), ds::StatePool::bytes_per_slot(c),
                                 ds::StatePool::slots_for_budget(c, budget)};
    return ffi::Array<int64_t>(v.begin(), v.end());
  });
}

// A pool over `storage` (a 256-byte aligned uint8 buffer of required_bytes on its device).
ffi::Map<ffi::String, ffi::Function> pool_new(ffi::TensorView storage, int64_t layers,
                                              int64_t slots, int64_t HV, int64_t V, int64_t K,
                                              ffi::String state_dtype, bool envelope, int64_t extra,
                                              int64_t replay_len, int64_t H,
                                              ffi::String ring_k_dtype, bool kda, bool null_slot) {
  return guarded([&] {
    ds::StatePoolConfig c = pool_config(layers, slots, HV, V, K, state_dtype, envelope, extra,
                                        replay_len, H, ring_k_dtype, kda, null_slot);
    const DLDevice dev = storage.device();
    c.device = dev.device_type == kDLCUDA ? ds::Device::cuda(dev.device_id) : ds::Device::cpu();
    void* base = static_cast<char*>(storage.data_ptr()) + storage.byte_offset();
    if (storage.numel() < ds::StatePool::required_bytes(c))
      throw ds::Error(ds::ErrorKind::value, "StatePool storage is smaller than required_bytes");
    auto pool = std::make_shared<ds::StatePool>(c, base);
    auto stream = [c]() -> ds::Stream {
      return c.device.type == ds::DeviceType::cuda ? TVMFFIEnvGetStream(kDLCUDA, c.device.index)
                                                   : nullptr;
    };
    ffi::Map<ffi::String, ffi::Function> m;
    m.Set("allocate", ffi::Function::FromTyped([pool, stream](bool clear) -> int64_t {
            return guarded([&] { return pool->allocate(clear, stream()); });
          }));
    m.Set("free", ffi::Function::FromTyped([pool](int64_t slot) {
            guarded([&] { pool->free(slot); });
          }));
    m.Set("is_allocated", ffi::Function::FromTyped([pool](int64_t slot) -> bool {
            return pool->is_allocated(slot);
          }));
    m.Set("num_free", ffi::Function::FromTyped([pool]() -> int64_t { return pool->num_free(); }));
    m.Set("fork", ffi::Function::FromTyped([pool, stream](int64_t src, int64_t dst) {
            guarded([&] { pool->fork(src, dst, stream()); });
          }));
    m.Set("cursor", ffi::Function::FromTyped([pool, stream](int64_t slot) -> int64_t {
            return guarded([&] { return static_cast<int64_t>(pool->cursor(slot, stream())); });
          }));
    m.Set("set_cursor", ffi::Function::FromTyped([pool, stream](int64_t slot, int64_t value) {
            guarded([&] { pool->set_cursor(slot, static_cast<int32_t>(value), stream()); });
          }));
    m.Set("view", ffi::Function::FromTyped([pool](ffi::String what, int64_t layer) {
            return guarded([&] {
              const std::string w = what;
              ds::TensorView v;
              if (w == "state") v = pool->layer_state(layer);
              else if (w == "d_cache") v = pool->d_cache(layer);
              else if (w == "k_cache") v = pool->k_cache(layer);
              else if (w == "g_cache") v = pool->g_cache(layer);
              else if (w == "write_pos") v = pool->write_pos();
              else throw ds::Error(ds::ErrorKind::value, "unknown StatePool view " + w);
              return describe(v, pool->data());
            });
          }));
    return m;
  });
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(packed_decode, packed_decode);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(recurrent, recurrent);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(replayssm_decode, replayssm_decode);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(cuda_available, cuda_available);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(cuda_built, cuda_built);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pool_sizes, pool_sizes);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pool_new, pool_new);
