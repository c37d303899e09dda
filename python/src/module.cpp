// The Python binding: a tvm-ffi module over the framework-free C++ API.
//
// Every tensor argument arrives as a DLPack view (tvm::ffi::TensorView: numpy arrays, torch CPU
// and CUDA tensors, zero copy, any strides); it is turned into a deltastate::TensorView and the C++
// op runs in place on the caller's memory. For CUDA tensors the op launches on the stream that
// tvm-ffi reports for the device: torch's current stream when the arguments are torch tensors
// (docs/BINDINGS.md). deltastate::Error becomes ValueError / TypeError / NotImplementedError /
// RuntimeError with the core's exact message.
//
// Each op is bound field by field (a `Binding` of its args struct, below), under the argument
// names of the Python op table (deltastate/_surface.py), which derives the Python side.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "deltastate/deltastate.h"

namespace {

namespace ffi = tvm::ffi;
namespace ds = deltastate;

[[noreturn]] void raise(const ds::Error& e) {
  const char* kind = "RuntimeError";
  switch (e.kind()) {
    case ds::ErrorKind::value:
      kind = "ValueError";
      break;
    case ds::ErrorKind::type:
      kind = "TypeError";
      break;
    case ds::ErrorKind::not_implemented:
      kind = "NotImplementedError";
      break;
    case ds::ErrorKind::runtime:
      kind = "RuntimeError";
      break;
  }
  // The marked text: the Python side prints marked dtype names as the caller's framework does.
  throw ffi::Error(kind, e.marked(), "");
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

// A DLPack dtype's name as numpy and torch spell it (without torch's "torch." prefix).
std::string dlpack_dtype_name(DLDataType t) {
  const std::string bits = std::to_string(t.bits);
  std::string name;
  switch (t.code) {
    case kDLInt:
      name = "int" + bits;
      break;
    case kDLUInt:
      name = "uint" + bits;
      break;
    case kDLFloat:
      name = "float" + bits;
      break;
    case kDLBfloat:
      name = "bfloat" + bits;
      break;
    case kDLComplex:
      name = "complex" + bits;
      break;
    case kDLBool:
      name = "bool";
      break;
    default:
      try {
        name = std::string(ffi::DLDataTypeToString(t));  // the float8/6/4 kinds
      } catch (...) {
        name = "code " + std::to_string(t.code) + " of " + bits + " bits";
      }
  }
  if (t.lanes != 1) name += "x" + std::to_string(t.lanes);
  return name;
}

ds::DType to_dtype(DLDataType t, const char* name) {
  if (t.lanes == 1) {
    if (t.code == kDLFloat && t.bits == 32) return ds::DType::f32;
    if (t.code == kDLFloat && t.bits == 16) return ds::DType::f16;
    if (t.code == kDLBfloat && t.bits == 16) return ds::DType::bf16;
    if (t.code == kDLInt && t.bits == 32) return ds::DType::i32;
    if (t.code == kDLInt && t.bits == 64) return ds::DType::i64;
    // The 1-byte state formats (quantized pools): torch's float8_e4m3fn, int8; numpy has no
    // float8, so a uint8 state (a numpy StatePool's view) is taken as float8_e4m3fn codes. Only
    // the state arguments (and verify's scratch) may be uint8: elsewhere it is the error below.
    if (t.code == kDLFloat8_e4m3fn && t.bits == 8) return ds::DType::f8e4m3;
    if (t.code == kDLInt && t.bits == 8) return ds::DType::i8;
    const std::string_view arg = name;
    if (t.code == kDLUInt && t.bits == 8 &&
        (arg == "initial_state" || arg == "state_pool" || arg == "state" ||
         arg == "checkpoint_state" || arg == "intermediate_states"))
      return ds::DType::f8e4m3;
  }
  // What the argument takes is the op's own (a float or an index tensor, ...): the Python op
  // table appends it (deltastate/_derive.py, `spelled`), this text must end here.
  throw ds::Error(ds::ErrorKind::value, std::string("`") + name + "` has dtype " +
                                            ds::dtype_mark(dlpack_dtype_name(t).c_str()) +
                                            ", which deltastate does not take");
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

// The stream to launch on: the environment's current stream for the device (torch's current
// stream when torch tensors were passed), nullptr for CPU.
ds::Stream stream_for(const ds::TensorView& any) {
  if (any.device.type != ds::DeviceType::cuda) return nullptr;
  return TVMFFIEnvGetStream(kDLCUDA, any.device.index);
}

// ---- ops -------------------------------------------------------------------------------------
// Each op is one module function over its C++ args struct. Its Binding names the struct's fields
// with the argument names of the Python op table (deltastate/_surface.py) and takes them
// positionally in the order listed here. `op_signatures()` reports each op's "name:kind" list;
// the Python side builds its calls from it by name and checks at import that both sides name the
// same arguments with the same kinds. A value of the wrong type raises TypeError naming the
// argument's position (`argument #i`), which the Python wrapper turns into the public name.

// How each field type is read from an argument (`accepts` checks the value's type first), and
// the name of its kind.
template <class T>
struct Kind;

template <>
struct Kind<ds::TensorView> {
  static constexpr const char* name = "tensor";
  static bool accepts(ffi::AnyView v) { return v.try_cast<ffi::TensorView>().has_value(); }
  static void read(ds::TensorView& dst, ffi::AnyView v, const char* arg) {
    dst = to_view(*v.try_cast<ffi::TensorView>(), arg);
  }
};

template <>
struct Kind<std::optional<ds::TensorView>> {
  static constexpr const char* name = "tensor?";
  static bool accepts(ffi::AnyView v) { return v == nullptr || Kind<ds::TensorView>::accepts(v); }
  static void read(std::optional<ds::TensorView>& dst, ffi::AnyView v, const char* arg) {
    if (v == nullptr) dst.reset();
    else Kind<ds::TensorView>::read(dst.emplace(), v, arg);
  }
};

template <>
struct Kind<double> {
  static constexpr const char* name = "float";
  static bool accepts(ffi::AnyView v) { return v.try_cast<double>().has_value(); }
  static void read(double& dst, ffi::AnyView v, const char*) { dst = *v.try_cast<double>(); }
};

template <>
struct Kind<std::optional<double>> {
  static constexpr const char* name = "float?";
  static bool accepts(ffi::AnyView v) { return v == nullptr || Kind<double>::accepts(v); }
  static void read(std::optional<double>& dst, ffi::AnyView v, const char*) {
    if (v == nullptr) dst.reset();
    else dst = *v.try_cast<double>();
  }
};

template <>
struct Kind<bool> {
  static constexpr const char* name = "bool";
  static bool accepts(ffi::AnyView v) { return v.try_cast<bool>().has_value(); }
  static void read(bool& dst, ffi::AnyView v, const char*) { dst = *v.try_cast<bool>(); }
};

// The state layout as FLA's `state_v_first`: True = V-first [.., HV, V, K], False = K-first.
template <>
struct Kind<ds::StateLayout> {
  static constexpr const char* name = "bool";
  static bool accepts(ffi::AnyView v) { return v.try_cast<bool>().has_value(); }
  static void read(ds::StateLayout& dst, ffi::AnyView v, const char*) {
    dst = *v.try_cast<bool>() ? ds::StateLayout::v_first : ds::StateLayout::k_first;
  }
};

// check_indices: an int, -1 = the backend's default, 0 = off, 1 = on.
template <>
struct Kind<std::optional<bool>> {
  static constexpr const char* name = "check";
  static bool accepts(ffi::AnyView v) { return v.try_cast<int64_t>().has_value(); }
  static void read(std::optional<bool>& dst, ffi::AnyView v, const char*) {
    const int64_t x = *v.try_cast<int64_t>();
    if (x < 0) dst.reset();
    else dst = x != 0;
  }
};

// How a stored state is rounded: an int, 0 = the format's default, 1 = nearest, 2 = stochastic.
template <>
struct Kind<ds::StateRounding> {
  static constexpr const char* name = "rounding";
  static bool accepts(ffi::AnyView v) {
    const auto x = v.try_cast<int64_t>();
    return x && *x >= 0 && *x <= 2;
  }
  static void read(ds::StateRounding& dst, ffi::AnyView v, const char*) {
    dst = static_cast<ds::StateRounding>(*v.try_cast<int64_t>());
  }
};

// Which rows a ReplaySSM verify serves: an int (0 = all, 1 = appending, 2 = folding; the
// validator checks the range).
template <>
struct Kind<ds::ReplayRows> {
  static constexpr const char* name = "int64";
  static bool accepts(ffi::AnyView v) { return v.try_cast<int64_t>().has_value(); }
  static void read(ds::ReplayRows& dst, ffi::AnyView v, const char*) {
    dst = static_cast<ds::ReplayRows>(*v.try_cast<int64_t>());
  }
};

// An integer count (checkpoint_every_n_tokens).
template <>
struct Kind<int64_t> {
  static constexpr const char* name = "int64";
  static bool accepts(ffi::AnyView v) { return v.try_cast<int64_t>().has_value(); }
  static void read(int64_t& dst, ffi::AnyView v, const char*) { dst = *v.try_cast<int64_t>(); }
};

template <auto Member>
struct MemberOf;
template <class C, class T, T C::*Member>
struct MemberOf<Member> {
  using Class = C;
  using Type = T;
};

// The argument `name`, read into the field `Member` by the Kind of its type. A field is a type
// of its own (not a function pointer), so that reading a call's arguments inlines.
template <auto Member>
struct Field {
  using K = Kind<typename MemberOf<Member>::Type>;
  static constexpr const char* kind = K::name;
  const char* name;
  static bool accepts(ffi::AnyView v) { return K::accepts(v); }
  void read(typename MemberOf<Member>::Class& args, ffi::AnyView v) const {
    K::read(args.*Member, v, name);
  }
};

// A field of a member struct of the args (the state format's fields, ops.h StateFormatArgs).
template <auto Outer, auto Inner>
struct NestedField {
  using K = Kind<typename MemberOf<Inner>::Type>;
  static constexpr const char* kind = K::name;
  const char* name;
  static bool accepts(ffi::AnyView v) { return K::accepts(v); }
  void read(typename MemberOf<Outer>::Class& args, ffi::AnyView v) const {
    K::read((args.*Outer).*Inner, v, name);
  }
};

// The state format's arguments, last in every op that takes them: state_scales, state_rounding,
// rounding_step, rounding_seed, rounding_layer.
template <auto Format>
constexpr auto state_format_fields() {
  using F = ds::StateFormatArgs;
  return std::tuple{NestedField<Format, &F::scales>{"state_scales"},
                    NestedField<Format, &F::rounding>{"state_rounding"},
                    NestedField<Format, &F::step>{"rounding_step"},
                    NestedField<Format, &F::seed>{"rounding_seed"},
                    NestedField<Format, &F::layer>{"rounding_layer"}};
}

template <class Args, class... Fields>
struct Binding {
  using ArgsType = Args;
  const char* name;
  void (*run)(Args&);  // sets what no argument gives (the stream) and runs the op
  std::tuple<Fields...> fields;
};

template <class Args, class... Fields>
constexpr Binding<Args, Fields...> bind(const char* name, void (*run)(Args&),
                                        std::tuple<Fields...> fields) {
  return {name, run, fields};
}

[[noreturn]] void type_error(const char* op, std::size_t i, const char* name, const char* kind,
                             ffi::AnyView v) {
  throw ffi::Error("TypeError",
                   std::string(op) + ": argument #" + std::to_string(i) + " `" + name +
                       "` must be of kind " + kind + "; got " + v.GetTypeKey(),
                   "");
}

// Every argument's type is checked before any is read, so a wrong type is reported before what
// reading a tensor can reject (its dtype, its device).
template <const auto& Op>
void call(const ffi::AnyView* argv, int32_t argc) {
  constexpr std::size_t N = std::tuple_size_v<decltype(Op.fields)>;
  if (argc != static_cast<int32_t>(N))
    throw ffi::Error("TypeError",
                     std::string(Op.name) + " takes " + std::to_string(N) + " arguments (got " +
                         std::to_string(argc) + ")",
                     "");
  std::apply(
      [&](const auto&... f) {
        std::size_t i = 0;
        ((f.accepts(argv[i]) ? void(++i) : type_error(Op.name, i, f.name, f.kind, argv[i])), ...);
      },
      Op.fields);
  guarded([&] {
    typename std::remove_cvref_t<decltype(Op)>::ArgsType args;
    std::apply(
        [&](const auto&... f) {
          std::size_t i = 0;
          (f.read(args, argv[i++]), ...);
        },
        Op.fields);
    Op.run(args);
  });
}

template <class Args, class... Fields>
ffi::Array<ffi::String> signature(const Binding<Args, Fields...>& op) {
  std::vector<ffi::String> out;
  std::apply([&](const auto&... f) { (out.emplace_back(std::string(f.name) + ":" + f.kind), ...); },
             op.fields);
  return ffi::Array<ffi::String>(out.begin(), out.end());
}

using PD = ds::PackedDecodeArgs;
constexpr auto packed(const char* name, void (*run)(PD&)) {
  return bind(name, run,
              std::tuple_cat(
                  std::tuple{
                      Field<&PD::mixed_qkv>{"mixed_qkv"},
                      Field<&PD::a>{"a"},
                      Field<&PD::b>{"b"},
                      Field<&PD::A_log>{"A_log"},
                      Field<&PD::dt_bias>{"dt_bias"},
                      Field<&PD::scale>{"scale"},
                      Field<&PD::state>{"initial_state"},
                      Field<&PD::out>{"out"},
                      Field<&PD::state_indices>{"ssm_state_indices"},
                      Field<&PD::use_qk_l2norm>{"use_qk_l2norm_in_kernel"},
                      Field<&PD::lower_bound>{"lower_bound"},
                      Field<&PD::round_beta_to_input>{"round_beta"},
                      Field<&PD::check_indices>{"check_indices"},
                      Field<&PD::pdl>{"pdl"},
                  },
                  state_format_fields<&PD::state_format>()));
}

constexpr auto gdn_packed_decode = packed("gdn_packed_decode", [](PD& a) {
  a.stream = stream_for(a.state);
  ds::gdn_packed_decode(a);
});

constexpr auto kda_packed_decode = packed("kda_packed_decode", [](PD& a) {
  a.stream = stream_for(a.state);
  ds::kda_packed_decode(a);
});

// The recurrent state comes as one of two arguments: `initial_state`, only read, or
// `state_pool`, updated in place. Read in this order, a given pool replaces the start state.
using RA = ds::RecurrentArgs;
using OptTensor = Kind<std::optional<ds::TensorView>>;

struct ReadState {
  static constexpr const char* kind = OptTensor::name;
  const char* name;
  static bool accepts(ffi::AnyView v) { return OptTensor::accepts(v); }
  void read(RA& a, ffi::AnyView v) const {
    a.update_state = false;
    OptTensor::read(a.state, v, name);
  }
};

struct PooledState {
  static constexpr const char* kind = OptTensor::name;
  const char* name;
  static bool accepts(ffi::AnyView v) { return OptTensor::accepts(v); }
  void read(RA& a, ffi::AnyView v) const {
    if (v == nullptr) return;
    OptTensor::read(a.state, v, name);
    a.update_state = true;
  }
};

constexpr auto recurrent(const char* name, void (*run)(RA&)) {
  return bind(name, run,
              std::tuple_cat(
                  std::tuple{
                      Field<&RA::q>{"q"},
                      Field<&RA::k>{"k"},
                      Field<&RA::v>{"v"},
                      Field<&RA::g>{"g"},
                      Field<&RA::beta>{"beta"},
                      Field<&RA::out>{"output"},
                      Field<&RA::A_log>{"A_log"},
                      Field<&RA::dt_bias>{"dt_bias"},
                      Field<&RA::gate_in_kernel>{"use_gate_in_kernel"},
                      Field<&RA::lower_bound>{"lower_bound"},
                      Field<&RA::beta_is_logit>{"beta_is_logit"},
                      Field<&RA::round_beta_to_input>{"round_beta"},
                      Field<&RA::scale>{"scale"},
                      ReadState{"initial_state"},
                      PooledState{"state_pool"},
                      Field<&RA::state_indices>{"ssm_state_indices"},
                      Field<&RA::cu_seqlens>{"cu_seqlens"},
                      Field<&RA::final_state>{"final_state"},
                      Field<&RA::state_layout>{"state_v_first"},
                      Field<&RA::stride_contract>{"stride_contract"},
                      Field<&RA::use_qk_l2norm>{"use_qk_l2norm_in_kernel"},
                      Field<&RA::check_indices>{"check_indices"},
                      Field<&RA::pdl>{"pdl"},
                  },
                  state_format_fields<&RA::state_format>()));
}

constexpr auto recurrent_gated_delta_rule = recurrent("recurrent_gated_delta_rule", [](RA& a) {
  a.stream = stream_for(a.q);
  ds::recurrent_gdn(a);
});

constexpr auto recurrent_kda = recurrent("recurrent_kda", [](RA& a) {
  a.stream = stream_for(a.q);
  ds::recurrent_kda(a);
});

using RD = ds::ReplayDecodeArgs;
constexpr auto replayssm_decode = bind(
    "replayssm_decode",
    +[](RD& a) {
      a.stream = stream_for(a.state);
      ds::replayssm_decode(a);
    },
    std::tuple_cat(
        std::tuple{
            Field<&RD::mixed_qkv>{"mixed_qkv"},
            Field<&RD::a>{"a"},
            Field<&RD::b>{"b"},
            Field<&RD::A_log>{"A_log"},
            Field<&RD::dt_bias>{"dt_bias"},
            Field<&RD::scale>{"scale"},
            Field<&RD::state>{"initial_state"},
            Field<&RD::d_cache>{"d_cache"},
            Field<&RD::k_cache>{"k_cache"},
            Field<&RD::g_cache>{"g_cache"},
            Field<&RD::out>{"out"},
            Field<&RD::state_indices>{"ssm_state_indices"},
            Field<&RD::write_pos>{"write_pos"},
            Field<&RD::force_flush>{"force_flush"},
            Field<&RD::is_kda>{"is_kda"},
            Field<&RD::use_qk_l2norm>{"use_qk_l2norm_in_kernel"},
            Field<&RD::lower_bound>{"lower_bound"},
            Field<&RD::round_beta_to_input>{"round_beta"},
            Field<&RD::advance_write_pos>{"advance_write_pos"},
            Field<&RD::cache_base>{"cache_base"},
            Field<&RD::circular_replay>{"circular_replay"},
            Field<&RD::prefix_gate_cache>{"prefix_gate_cache"},
            Field<&RD::predecayed_k_cache>{"predecayed_k_cache"},
            Field<&RD::helion>{"helion"},
            Field<&RD::check_indices>{"check_indices"},
            Field<&RD::pdl>{"pdl"},
        },
        state_format_fields<&RD::state_format>()));

// Speculative verify and its commit (the peers' surfaces map onto these in _surface.py).
using VA = ds::VerifyArgs;
constexpr auto verify = bind(
    "verify",
    +[](VA& a) {
      a.stream = stream_for(a.q);
      ds::verify(a);
    },
    std::tuple_cat(
        std::tuple{
            Field<&VA::q>{"q"},
            Field<&VA::k>{"k"},
            Field<&VA::v>{"v"},
            Field<&VA::g>{"g"},
            Field<&VA::beta>{"beta"},
            Field<&VA::out>{"output"},
            Field<&VA::is_kda>{"is_kda"},
            Field<&VA::A_log>{"A_log"},
            Field<&VA::dt_bias>{"dt_bias"},
            Field<&VA::gate_in_kernel>{"use_gate_in_kernel"},
            Field<&VA::lower_bound>{"lower_bound"},
            Field<&VA::beta_is_logit>{"beta_is_logit"},
            Field<&VA::round_beta_to_input>{"round_beta"},
            Field<&VA::scale>{"scale"},
            Field<&VA::use_qk_l2norm>{"use_qk_l2norm_in_kernel"},
            Field<&VA::cu_seqlens>{"cu_seqlens"},
            Field<&VA::state>{"state"},
            Field<&VA::state_indices>{"state_indices"},
            Field<&VA::output_state_indices>{"output_state_indices"},
            Field<&VA::update_state>{"update_state"},
            Field<&VA::intermediate_states>{"intermediate_states"},
            Field<&VA::intermediate_state_indices>{"intermediate_state_indices"},
            Field<&VA::parent_tokens>{"parent_tokens"},
            Field<&VA::token_state_indices>{"token_state_indices"},
            Field<&VA::num_accepted_tokens>{"num_accepted_tokens"},
            Field<&VA::source_state>{"source_state"},
            Field<&VA::source_state_indices>{"source_state_indices"},
            Field<&VA::ring_v>{"ring_v"},
            Field<&VA::ring_k>{"ring_k"},
            Field<&VA::ring_g>{"ring_g"},
            Field<&VA::ring_beta>{"ring_beta"},
            Field<&VA::keep_padded_outputs>{"keep_padded_outputs"},
            Field<&VA::check_indices>{"check_indices"},
            Field<&VA::pdl>{"pdl"},
        },
        state_format_fields<&VA::state_format>(),
        std::tuple{Field<&VA::intermediate_state_scales>{"intermediate_state_scales"}}));

using CA = ds::CommitArgs;
constexpr auto update_state_after_verify = bind(
    "update_state_after_verify",
    +[](CA& a) {
      a.stream = stream_for(a.state);
      ds::update_state_after_verify(a);
    },
    std::tuple_cat(
        std::tuple{
            Field<&CA::state>{"state"},
            Field<&CA::intermediate_states>{"intermediate_states"},
            Field<&CA::state_indices>{"state_indices"},
            Field<&CA::accepted>{"accepted"},
            Field<&CA::intermediate_state_indices>{"intermediate_state_indices"},
            Field<&CA::accepted_is_step>{"accepted_is_step"},
            Field<&CA::check_indices>{"check_indices"},
            Field<&CA::pdl>{"pdl"},
        },
        state_format_fields<&CA::state_format>(),
        std::tuple{Field<&CA::intermediate_state_scales>{"intermediate_state_scales"}}));

using CCA = ds::ConvCommitArgs;
constexpr auto update_conv_state_after_verify = bind(
    "update_conv_state_after_verify",
    +[](CCA& a) {
      a.stream = stream_for(a.conv_state);
      ds::update_conv_state_after_verify(a);
    },
    std::tuple{
        Field<&CCA::conv_state>{"conv_state"},
        Field<&CCA::intermediate_conv_window>{"intermediate_conv_window"},
        Field<&CCA::state_indices>{"state_indices"},
        Field<&CCA::accepted>{"accepted"},
        Field<&CCA::intermediate_state_indices>{"intermediate_state_indices"},
        Field<&CCA::accepted_is_step>{"accepted_is_step"},
        Field<&CCA::check_indices>{"check_indices"},
        Field<&CCA::pdl>{"pdl"},
    });

// Chunked prefill (FLA's chunk_gated_delta_rule / chunk_kda), one module function per gate kind.
using CP = ds::ChunkPrefillArgs;
constexpr auto chunk(const char* name, void (*run)(CP&)) {
  return bind(name, run,
              std::tuple_cat(
                  std::tuple{
                      Field<&CP::q>{"q"},
                      Field<&CP::k>{"k"},
                      Field<&CP::v>{"v"},
                      Field<&CP::g>{"g"},
                      Field<&CP::beta>{"beta"},
                      Field<&CP::out>{"output"},
                      Field<&CP::A_log>{"A_log"},
                      Field<&CP::dt_bias>{"dt_bias"},
                      Field<&CP::gate_in_kernel>{"use_gate_in_kernel"},
                      Field<&CP::lower_bound>{"lower_bound"},
                      Field<&CP::beta_is_logit>{"beta_is_logit"},
                      Field<&CP::scale>{"scale"},
                      Field<&CP::use_qk_l2norm>{"use_qk_l2norm_in_kernel"},
                      Field<&CP::cu_seqlens>{"cu_seqlens"},
                      Field<&CP::initial_state>{"initial_state"},
                      Field<&CP::initial_state_indices>{"initial_state_indices"},
                      Field<&CP::has_initial_state>{"has_initial_state"},
                      Field<&CP::output_state_indices>{"output_state_indices"},
                      Field<&CP::final_state>{"final_state"},
                      Field<&CP::checkpoint_every_n_tokens>{"checkpoint_every_n_tokens"},
                      Field<&CP::checkpoint_cu_starts>{"checkpoint_cu_starts"},
                      Field<&CP::state_checkpoints>{"state_checkpoints"},
                      Field<&CP::checkpoint_slot_indices>{"checkpoint_slot_indices"},
                      Field<&CP::workspace>{"workspace"},
                      Field<&CP::check_indices>{"check_indices"},
                      Field<&CP::pdl>{"pdl"},
                  },
                  state_format_fields<&CP::state_format>()));
}

constexpr auto chunk_gated_delta_rule = chunk("chunk_gated_delta_rule", [](CP& a) {
  a.is_kda = false;
  a.stream = stream_for(a.q);
  ds::chunk_prefill(a);
});

constexpr auto chunk_kda = chunk("chunk_kda", [](CP& a) {
  a.is_kda = true;
  a.stream = stream_for(a.q);
  ds::chunk_prefill(a);
});

// ---- the conv update and the fused decode layer step -------------------------------------------
using CU = ds::CausalConv1dUpdateArgs;
constexpr auto causal_conv1d_update = bind(
    "causal_conv1d_update",
    +[](CU& a) {
      a.stream = stream_for(a.x);
      ds::causal_conv1d_update(a);
    },
    std::tuple{
        Field<&CU::x>{"x"},
        Field<&CU::conv_state>{"conv_state"},
        Field<&CU::weight>{"weight"},
        Field<&CU::bias>{"bias"},
        Field<&CU::silu>{"silu"},
        Field<&CU::cache_seqlens>{"cache_seqlens"},
        Field<&CU::conv_state_indices>{"conv_state_indices"},
        Field<&CU::num_accept_tokens>{"num_accept_tokens"},
        Field<&CU::intermediate_conv_window>{"intermediate_conv_window"},
        Field<&CU::intermediate_state_indices>{"intermediate_state_indices"},
        Field<&CU::retrieve_next_token>{"retrieve_next_token"},
        Field<&CU::retrieve_next_sibling>{"retrieve_next_sibling"},
        Field<&CU::retrieve_parent_token>{"retrieve_parent_token"},
        Field<&CU::out>{"out"},
        Field<&CU::check_indices>{"check_indices"},
        Field<&CU::pdl>{"pdl"},
    });

using FS = ds::FusedDecodeStepArgs;
constexpr auto fused_step(const char* name, void (*run)(FS&)) {
  return bind(name, run,
              std::tuple_cat(
                  std::tuple{
                      Field<&FS::mixed_qkv>{"mixed_qkv"},
                      Field<&FS::conv_weight>{"conv_weight"},
                      Field<&FS::conv_bias>{"conv_bias"},
                      Field<&FS::conv_silu>{"conv_silu"},
                      Field<&FS::conv_state>{"conv_state"},
                      Field<&FS::conv_state_k>{"conv_state_k"},
                      Field<&FS::conv_state_v>{"conv_state_v"},
                      Field<&FS::a>{"a"},
                      Field<&FS::b>{"b"},
                      Field<&FS::A_log>{"A_log"},
                      Field<&FS::dt_bias>{"dt_bias"},
                      Field<&FS::scale>{"scale"},
                      Field<&FS::state>{"initial_state"},
                      Field<&FS::state_indices>{"ssm_state_indices"},
                      Field<&FS::norm_weight>{"norm_weight"},
                      Field<&FS::z>{"z"},
                      Field<&FS::norm_eps>{"norm_eps"},
                      Field<&FS::out>{"out"},
                      Field<&FS::use_qk_l2norm>{"use_qk_l2norm_in_kernel"},
                      Field<&FS::lower_bound>{"lower_bound"},
                      Field<&FS::round_beta_to_input>{"round_beta"},
                      Field<&FS::check_indices>{"check_indices"},
                      Field<&FS::pdl>{"pdl"},
                      Field<&FS::d_cache>{"d_cache"},
                      Field<&FS::k_cache>{"k_cache"},
                      Field<&FS::g_cache>{"g_cache"},
                      Field<&FS::write_pos>{"write_pos"},
                      Field<&FS::force_flush>{"force_flush"},
                      Field<&FS::advance_write_pos>{"advance_write_pos"},
                      Field<&FS::cache_base>{"cache_base"},
                      Field<&FS::circular_replay>{"circular_replay"},
                      Field<&FS::prefix_gate_cache>{"prefix_gate_cache"},
                      Field<&FS::predecayed_k_cache>{"predecayed_k_cache"},
                      Field<&FS::workspace>{"workspace"},
                  },
                  state_format_fields<&FS::state_format>()));
}

constexpr auto gdn_fused_decode_step = fused_step("gdn_fused_decode_step", [](FS& a) {
  a.stream = stream_for(a.state);
  ds::gdn_fused_decode_step(a);
});

constexpr auto kda_fused_decode_step = fused_step("kda_fused_decode_step", [](FS& a) {
  a.stream = stream_for(a.state);
  ds::kda_fused_decode_step(a);
});

// chunk_prefill_workspace_bytes from what it reads: K, V, the number of sequences N, the value
// heads HV, the gate kind, the device and the number of token rows of q (B * T; the CUDA split
// kernels' workspace grows with the chunk count), no tensor, so that the Python side can size
// the workspace before it has the data, also while torch.compile traces with fake tensors.
int64_t chunk_prefill_workspace_bytes(int64_t K, int64_t V, int64_t N, int64_t HV, bool kda,
                                      int64_t cuda_device, int64_t tokens) {
  return guarded([&] {
    CP a;
    a.is_kda = kda;
    const ds::Device dev = cuda_device < 0 ? ds::Device::cpu() : ds::Device::cuda(cuda_device);
    for (auto [t, last] : {std::pair{&a.q, K}, std::pair{&a.v, V}}) {
      t->ndim = 4;
      t->shape[0] = N;  // sequences: no cu_seqlens here
      // at least `tokens` rows in all: N rows of ceil(tokens / N) tokens
      t->shape[1] = N > 0 ? (tokens + N - 1) / N : tokens;
      t->shape[2] = 1;
      t->shape[3] = last;
      t->device = dev;
    }
    a.v.shape[2] = HV;
    return ds::chunk_prefill_workspace_bytes(a);
  });
}

// ReplaySSM speculative verify and its cursor commit.
using RVA = ds::ReplayVerifyArgs;
constexpr auto replayssm_verify = bind(
    "replayssm_verify",
    +[](RVA& a) {
      a.stream = stream_for(a.q);
      ds::replayssm_verify(a);
    },
    std::tuple_cat(
        std::tuple{
            Field<&RVA::q>{"q"},
            Field<&RVA::k>{"k"},
            Field<&RVA::v>{"v"},
            Field<&RVA::g>{"g"},
            Field<&RVA::beta>{"beta"},
            Field<&RVA::out>{"output"},
            Field<&RVA::is_kda>{"is_kda"},
            Field<&RVA::A_log>{"A_log"},
            Field<&RVA::dt_bias>{"dt_bias"},
            Field<&RVA::gate_in_kernel>{"use_gate_in_kernel"},
            Field<&RVA::lower_bound>{"lower_bound"},
            Field<&RVA::beta_is_logit>{"beta_is_logit"},
            Field<&RVA::round_beta_to_input>{"round_beta"},
            Field<&RVA::scale>{"scale"},
            Field<&RVA::use_qk_l2norm>{"use_qk_l2norm_in_kernel"},
            Field<&RVA::cu_seqlens>{"cu_seqlens"},
            Field<&RVA::state>{"checkpoint_state"},
            Field<&RVA::state_indices>{"state_indices"},
            Field<&RVA::d_cache>{"d_cache"},
            Field<&RVA::k_cache>{"k_cache"},
            Field<&RVA::g_cache>{"g_cache"},
            Field<&RVA::write_pos>{"write_pos"},
            Field<&RVA::cache_base>{"cache_base"},
            Field<&RVA::is_flush>{"is_flush"},
            Field<&RVA::replay_indices>{"replay_indices"},
            Field<&RVA::rawv_cache>{"rawv_cache"},
            Field<&RVA::rawk_cache>{"rawk_cache"},
            Field<&RVA::beta_cache>{"beta_cache"},
            Field<&RVA::rows>{"rows"},
            Field<&RVA::null_block_id>{"null_block_id"},
            Field<&RVA::check_indices>{"check_indices"},
            Field<&RVA::pdl>{"pdl"},
        },
        state_format_fields<&RVA::state_format>()));

using RCA = ds::ReplayCommitArgs;
constexpr auto replayssm_commit = bind(
    "replayssm_commit",
    +[](RCA& a) {
      a.stream = stream_for(a.write_pos);
      ds::replayssm_commit(a);
    },
    std::tuple{
        Field<&RCA::write_pos>{"write_pos"},
        Field<&RCA::cache_base>{"cache_base"},
        Field<&RCA::is_flush>{"is_flush"},
        Field<&RCA::num_accepted>{"num_accepted"},
        Field<&RCA::state_indices>{"state_indices"},
        Field<&RCA::max_cache_len>{"max_cache_len"},
        Field<&RCA::max_spec_len>{"max_spec_len"},
        Field<&RCA::cache_buf_len>{"cache_buf_len"},
        Field<&RCA::fold_every_commit>{"fold_every_commit"},
        Field<&RCA::null_block_id>{"null_block_id"},
        Field<&RCA::check_indices>{"check_indices"},
        Field<&RCA::pdl>{"pdl"},
    });

using RRA = ds::ReplayResetArgs;
constexpr auto replayssm_reset_cursors = bind(
    "replayssm_reset_cursors",
    +[](RRA& a) {
      a.stream = stream_for(a.write_pos);
      ds::replayssm_reset_cursors(a);
    },
    std::tuple{
        Field<&RRA::write_pos>{"write_pos"},
        Field<&RRA::cache_base>{"cache_base"},
        Field<&RRA::is_flush>{"is_flush"},
        Field<&RRA::do_reset>{"do_reset"},
        Field<&RRA::state_indices>{"state_indices"},
        Field<&RRA::max_cache_len>{"max_cache_len"},
        Field<&RRA::max_spec_len>{"max_spec_len"},
        Field<&RRA::null_block_id>{"null_block_id"},
        Field<&RRA::check_indices>{"check_indices"},
        Field<&RRA::pdl>{"pdl"},
    });

using RFA = ds::ReplayFoldArgs;
constexpr auto replayssm_fold_commit = bind(
    "replayssm_fold_commit",
    +[](RFA& a) {
      a.stream = stream_for(a.state);
      ds::replayssm_fold_commit(a);
    },
    std::tuple{
        Field<&RFA::state>{"state"},
        Field<&RFA::rawv>{"rawv"},
        Field<&RFA::rawk>{"rawk"},
        Field<&RFA::g>{"g"},
        Field<&RFA::beta>{"beta"},
        Field<&RFA::state_indices>{"state_indices"},
        Field<&RFA::accept_lens>{"accept_lens"},
        Field<&RFA::track_indices>{"track_indices"},
        Field<&RFA::steps_to_track>{"steps_to_track"},
        Field<&RFA::is_kda>{"is_kda"},
        Field<&RFA::use_qk_l2norm>{"use_qk_l2norm_in_kernel"},
        Field<&RFA::null_block_id>{"null_block_id"},
        Field<&RFA::check_indices>{"check_indices"},
        Field<&RFA::pdl>{"pdl"},
    });

using RCC = ds::ReplayCircularCommitArgs;
constexpr auto replayssm_circular_commit = bind(
    "replayssm_circular_commit",
    +[](RCC& a) {
      a.stream = stream_for(a.state);
      ds::replayssm_circular_commit(a);
    },
    std::tuple{
        Field<&RCC::state>{"state"},
        Field<&RCC::d_cache>{"d_cache"},
        Field<&RCC::k_cache>{"k_cache"},
        Field<&RCC::g_cache>{"g_cache"},
        Field<&RCC::d_residual>{"d_residual"},
        Field<&RCC::k_residual>{"k_residual"},
        Field<&RCC::state_indices>{"state_indices"},
        Field<&RCC::replay_indices>{"replay_indices"},
        Field<&RCC::write_pos>{"write_pos"},
        Field<&RCC::cache_base>{"cache_base"},
        Field<&RCC::is_flush>{"is_flush"},
        Field<&RCC::accept_lens>{"accept_lens"},
        Field<&RCC::track_indices>{"track_indices"},
        Field<&RCC::steps_to_track>{"steps_to_track"},
        Field<&RCC::null_block_id>{"null_block_id"},
        Field<&RCC::check_indices>{"check_indices"},
        Field<&RCC::pdl>{"pdl"},
    });

ffi::Map<ffi::String, ffi::Array<ffi::String>> op_signatures() {
  ffi::Map<ffi::String, ffi::Array<ffi::String>> m;
  m.Set(gdn_packed_decode.name, signature(gdn_packed_decode));
  m.Set(kda_packed_decode.name, signature(kda_packed_decode));
  m.Set(recurrent_gated_delta_rule.name, signature(recurrent_gated_delta_rule));
  m.Set(recurrent_kda.name, signature(recurrent_kda));
  m.Set(replayssm_decode.name, signature(replayssm_decode));
  m.Set(chunk_gated_delta_rule.name, signature(chunk_gated_delta_rule));
  m.Set(chunk_kda.name, signature(chunk_kda));
  m.Set(causal_conv1d_update.name, signature(causal_conv1d_update));
  m.Set(gdn_fused_decode_step.name, signature(gdn_fused_decode_step));
  m.Set(kda_fused_decode_step.name, signature(kda_fused_decode_step));
  m.Set(verify.name, signature(verify));
  m.Set(update_state_after_verify.name, signature(update_state_after_verify));
  m.Set(update_conv_state_after_verify.name, signature(update_conv_state_after_verify));
  m.Set(replayssm_verify.name, signature(replayssm_verify));
  m.Set(replayssm_commit.name, signature(replayssm_commit));
  m.Set(replayssm_reset_cursors.name, signature(replayssm_reset_cursors));
  m.Set(replayssm_fold_commit.name, signature(replayssm_fold_commit));
  m.Set(replayssm_circular_commit.name, signature(replayssm_circular_commit));
  return m;
}

bool cuda_available() { return ds::cuda_available(); }
// check_errors on a raw cudaStream_t (0: the legacy default stream of the current device).
void check_errors(int64_t stream) {
  guarded([&] { ds::check_errors(reinterpret_cast<ds::Stream>(static_cast<intptr_t>(stream))); });
}
bool cuda_built() { return ds::cuda_built(); }

// ---- the state pool --------------------------------------------------------------------------
// The framework allocates the storage (so views are the caller's tensors); the C++ StatePool does
// the layout and the bookkeeping over it. A pool is handed to Python as a map of closures.

ds::DType dtype_from_name(const std::string& s, const char* what) {
  if (s == "float32") return ds::DType::f32;
  if (s == "bfloat16") return ds::DType::bf16;
  if (s == "float16") return ds::DType::f16;
  if (s == "float8_e4m3fn") return ds::DType::f8e4m3;  // quantized pool states
  if (s == "int8") return ds::DType::i8;
  throw ds::Error(ds::ErrorKind::value, std::string(what) +
                                            " must be float32, bfloat16 or "
                                            "float16; got " +
                                            s);
}

// fused_decode_step_workspace_bytes from what it reads: the shapes of mixed_qkv [B, conv_dim]
// and of the state's [HV, V, K], their dtypes, the device, whether the call is in ReplaySSM
// mode (d_cache given) and the state's rounding (0 the format's default, 1 nearest, 2
// stochastic: a stochastically rounded pool runs the chain plan on CUDA), no tensor (fake
// tensors too).
int64_t fused_decode_step_workspace_bytes(int64_t B, int64_t conv_dim, int64_t HV, int64_t V,
                                          int64_t K, const std::string& x_dtype,
                                          const std::string& state_dtype, int64_t cuda_device,
                                          bool replay, int64_t state_rounding) {
  return guarded([&] {
    if (state_rounding < 0 || state_rounding > 2)
      throw ds::Error(ds::ErrorKind::value,
                      "state_rounding must be 0 (the format's default), 1 (nearest) or 2 "
                      "(stochastic); got " +
                          std::to_string(state_rounding));
    FS a;
    const ds::Device dev = cuda_device < 0 ? ds::Device::cpu() : ds::Device::cuda(cuda_device);
    a.mixed_qkv.ndim = 2;
    a.mixed_qkv.shape[0] = B;
    a.mixed_qkv.shape[1] = conv_dim;
    a.mixed_qkv.dtype = dtype_from_name(x_dtype, "mixed_qkv's dtype");
    a.mixed_qkv.device = dev;
    a.state.ndim = 4;
    a.state.shape[0] = 1;
    a.state.shape[1] = HV;
    a.state.shape[2] = V;
    a.state.shape[3] = K;
    a.state.dtype = dtype_from_name(state_dtype, "initial_state's dtype");
    a.state.device = dev;
    if (replay) a.d_cache.emplace();  // the query reads only that it is given
    a.state_format.rounding = static_cast<ds::StateRounding>(state_rounding);
    return ds::fused_decode_step_workspace_bytes(a);
  });
}

ds::StatePoolConfig pool_config(int64_t layers, int64_t slots, int64_t HV, int64_t V, int64_t K,
                                const std::string& state_dtype, bool envelope,
                                int64_t envelope_extra_bytes, int64_t replay_len, int64_t H,
                                const std::string& ring_k_dtype, bool kda, bool null_slot,
                                int64_t conv_dim, int64_t conv_width, const std::string& conv_dtype,
                                bool conv_dim_contiguous, bool conv_split_qkv, int64_t spec_rows,
                                int64_t spec_steps, int64_t state_rounding, int64_t rounding_seed) {
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
  c.conv_dim = conv_dim;
  c.conv_width = conv_width;
  c.conv_dtype = dtype_from_name(conv_dtype, "conv_dtype");
  c.conv_layout =
      conv_dim_contiguous ? ds::ConvLayout::dim_contiguous : ds::ConvLayout::window_contiguous;
  c.conv_split_qkv = conv_split_qkv;
  c.spec_rows = spec_rows;
  c.spec_steps = spec_steps;
  if (state_rounding < 0 || state_rounding > 2)
    throw ds::Error(ds::ErrorKind::value, "StatePool state_rounding must be 0, 1 or 2");
  c.state_rounding = static_cast<ds::StateRounding>(state_rounding);
  c.rounding_seed = static_cast<uint64_t>(rounding_seed);
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

// [required_bytes, bytes_per_slot, slots_for_budget(budget), spec_bytes] of a configuration.
ffi::Array<int64_t> pool_sizes(int64_t layers, int64_t slots, int64_t HV, int64_t V, int64_t K,
                               ffi::String state_dtype, bool envelope, int64_t extra,
                               int64_t replay_len, int64_t H, ffi::String ring_k_dtype, bool kda,
                               bool null_slot, int64_t conv_dim, int64_t conv_width,
                               ffi::String conv_dtype, bool conv_dim_contiguous,
                               bool conv_split_qkv, int64_t spec_rows, int64_t spec_steps,
                               int64_t state_rounding, int64_t rounding_seed, int64_t budget) {
  return guarded([&] {
    const ds::StatePoolConfig c = pool_config(
        layers, slots, HV, V, K, state_dtype, envelope, extra, replay_len, H, ring_k_dtype, kda,
        null_slot, conv_dim, conv_width, conv_dtype, conv_dim_contiguous, conv_split_qkv, spec_rows,
        spec_steps, state_rounding, rounding_seed);
    const std::vector<int64_t> v{ds::StatePool::required_bytes(c), ds::StatePool::bytes_per_slot(c),
                                 ds::StatePool::slots_for_budget(c, budget),
                                 ds::StatePool::spec_bytes(c)};
    return ffi::Array<int64_t>(v.begin(), v.end());
  });
}

// The conv part a view name ends in: _q, _k, _v (0, 1, 2), else the packed window (-1).
int conv_part(const std::string& w) {
  const auto ends = [&](const char* e) {
    return w.size() > 2 && w.compare(w.size() - 2, 2, e) == 0;
  };
  return ends("_q") ? 0 : ends("_k") ? 1 : ends("_v") ? 2 : -1;
}

// A pool over `storage` (a 256-byte aligned uint8 buffer of required_bytes on its device).
ffi::Map<ffi::String, ffi::Function> pool_new(
    ffi::TensorView storage, int64_t layers, int64_t slots, int64_t HV, int64_t V, int64_t K,
    ffi::String state_dtype, bool envelope, int64_t extra, int64_t replay_len, int64_t H,
    ffi::String ring_k_dtype, bool kda, bool null_slot, int64_t conv_dim, int64_t conv_width,
    ffi::String conv_dtype, bool conv_dim_contiguous, bool conv_split_qkv, int64_t spec_rows,
    int64_t spec_steps, int64_t state_rounding, int64_t rounding_seed) {
  return guarded([&] {
    ds::StatePoolConfig c = pool_config(layers, slots, HV, V, K, state_dtype, envelope, extra,
                                        replay_len, H, ring_k_dtype, kda, null_slot, conv_dim,
                                        conv_width, conv_dtype, conv_dim_contiguous, conv_split_qkv,
                                        spec_rows, spec_steps, state_rounding, rounding_seed);
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
    m.Set("free",
          ffi::Function::FromTyped([pool](int64_t slot) { guarded([&] { pool->free(slot); }); }));
    m.Set("is_allocated", ffi::Function::FromTyped(
                              [pool](int64_t slot) -> bool { return pool->is_allocated(slot); }));
    m.Set("num_free", ffi::Function::FromTyped([pool]() -> int64_t { return pool->num_free(); }));
    m.Set("fork",
          ffi::Function::FromTyped([pool, stream](int64_t src, int64_t dst, int64_t cache_base,
                                                  bool prefix, bool predecay) {
            guarded([&] {
              if (cache_base < INT32_MIN || cache_base > INT32_MAX)
                throw ds::Error(ds::ErrorKind::value,
                                "StatePool.fork: cache_base is outside the int32 range");
              ds::StatePool::ForkRing ring;
              ring.cache_base = static_cast<int32_t>(cache_base);
              ring.prefix_gate_cache = prefix;
              ring.predecayed_k_cache = predecay;
              pool->fork(src, dst, stream(), ring);
            });
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
              else if (w == "conv_state") v = pool->conv_state(layer, -1);
              else if (w == "conv_q") v = pool->conv_state(layer, 0);
              else if (w == "conv_k") v = pool->conv_state(layer, 1);
              else if (w == "conv_v") v = pool->conv_state(layer, 2);
              else if (w == "states") v = pool->states();
              else if (w == "scales") v = pool->layer_scales(layer);
              else if (w == "all_scales") v = pool->scales();
              else if (w == "rounding_step") v = pool->rounding_step(layer);
              else if (w == "rounding_steps") v = pool->rounding_steps();
              else if (w == "inter_states")
                v = layer < 0 ? pool->intermediate_states() : pool->intermediate_states(layer);
              else if (w.rfind("conv_states", 0) == 0) v = pool->conv_states(conv_part(w));
              else if (w.rfind("inter_conv", 0) == 0)
                v = layer < 0 ? pool->intermediate_conv_windows(conv_part(w))
                              : pool->intermediate_conv_window(layer, conv_part(w));
              else throw ds::Error(ds::ErrorKind::value, "unknown StatePool view " + w);
              return describe(v, pool->data());
            });
          }));
    return m;
  });
}

}  // namespace

// An op's binding exported as the module function of its name (the C symbol tvm-ffi looks up).
#define DELTASTATE_EXPORT_OP(Name)                                                   \
  extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_##Name(void*, const TVMFFIAny* args,   \
                                                     int32_t num_args, TVMFFIAny*) { \
    TVM_FFI_SAFE_CALL_BEGIN();                                                       \
    call<Name>(reinterpret_cast<const tvm::ffi::AnyView*>(args), num_args);          \
    TVM_FFI_SAFE_CALL_END();                                                         \
  }

DELTASTATE_EXPORT_OP(gdn_packed_decode)
DELTASTATE_EXPORT_OP(kda_packed_decode)
DELTASTATE_EXPORT_OP(recurrent_gated_delta_rule)
DELTASTATE_EXPORT_OP(recurrent_kda)
DELTASTATE_EXPORT_OP(replayssm_decode)
DELTASTATE_EXPORT_OP(chunk_gated_delta_rule)
DELTASTATE_EXPORT_OP(chunk_kda)
DELTASTATE_EXPORT_OP(causal_conv1d_update)
DELTASTATE_EXPORT_OP(gdn_fused_decode_step)
DELTASTATE_EXPORT_OP(kda_fused_decode_step)
DELTASTATE_EXPORT_OP(verify)
DELTASTATE_EXPORT_OP(update_state_after_verify)
DELTASTATE_EXPORT_OP(update_conv_state_after_verify)
DELTASTATE_EXPORT_OP(replayssm_verify)
DELTASTATE_EXPORT_OP(replayssm_commit)
DELTASTATE_EXPORT_OP(replayssm_reset_cursors)
DELTASTATE_EXPORT_OP(replayssm_fold_commit)
DELTASTATE_EXPORT_OP(replayssm_circular_commit)
TVM_FFI_DLL_EXPORT_TYPED_FUNC(chunk_prefill_workspace_bytes, chunk_prefill_workspace_bytes);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fused_decode_step_workspace_bytes, fused_decode_step_workspace_bytes);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(op_signatures, op_signatures);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(cuda_available, cuda_available);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(check_errors, check_errors);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(cuda_built, cuda_built);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pool_sizes, pool_sizes);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pool_new, pool_new);
