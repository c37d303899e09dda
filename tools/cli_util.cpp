#include "cli_util.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "cli_args.h"

#ifdef DELTASTATE_CLI_CUDA
#include <cuda_runtime.h>
#endif

namespace deltastate::cli {

// ---- models ----------------------------------------------------------------------------------

namespace {
const std::vector<ModelShape>& models() {
  static const std::vector<ModelShape> table = {
      {"small-gdn", false, 4, 8, 64, 64},       // a small GDN layer: fast on any CPU
      {"small-kda", true, 8, 8, 64, 64},        // a small KDA layer (H == HV, as in Kimi)
      {"qwen3-next", false, 16, 32, 128, 128},  // Qwen3-Next-80B-A3B, one GDN layer, TP1
      {"kimi-linear", true, 32, 32, 128, 128},  // Kimi-Linear-48B, one KDA layer, TP1
  };
  return table;
}
}  // namespace

std::string ModelShape::describe() const {
  return std::string(kda ? "KDA" : "GDN") + " H=" + std::to_string(H) +
         " HV=" + std::to_string(HV) + " K=" + std::to_string(K) + " V=" + std::to_string(V);
}

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const ModelShape& m : models()) names.push_back(m.name);
  return names;
}

ModelShape model_by_name(const std::string& name) {
  for (const ModelShape& m : models())
    if (m.name == name) return m;
  throw UsageError("unknown model '" + name + "'");
}

// ---- dtypes ----------------------------------------------------------------------------------

std::vector<std::string> float_dtype_names() { return {"f32", "bf16"}; }

DType dtype_by_name(const std::string& name) {
  if (name == "f32") return DType::f32;
  if (name == "bf16") return DType::bf16;
  throw UsageError("unknown dtype '" + name + "'");
}

namespace {
void require_f32_or_bf16(DType dtype) {
  if (dtype != DType::f32 && dtype != DType::bf16)
    throw Error(ErrorKind::value, std::string("cli: unsupported host dtype ") + dtype_name(dtype));
}

// bfloat16 is the upper half of a float32, stored rounded to nearest even (NaN kept quiet), as
// the library stores it.
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

std::vector<uint8_t> encode(const std::vector<float>& values, DType dtype) {
  require_f32_or_bf16(dtype);
  std::vector<uint8_t> bytes(values.size() * dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::f32) {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t h = to_bf16(values[i]);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  return bytes;
}

std::vector<float> decode(const std::vector<uint8_t>& bytes, DType dtype) {
  require_f32_or_bf16(dtype);
  std::vector<float> values(bytes.size() / dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::f32) {
      std::memcpy(&values[i], bytes.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      values[i] = from_bf16(h);
    }
  }
  return values;
}

// ---- random numbers --------------------------------------------------------------------------

uint64_t Rng::next() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

int64_t Rng::uniform_int(int64_t lo, int64_t hi) {
  return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1));
}

double Rng::normal() {
  const double u1 = 1.0 - uniform();  // (0, 1]
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

std::vector<float> Rng::normal_vector(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = static_cast<float>(normal());
  return v;
}

LayerGateParams random_gate_params(Rng& rng, const ModelShape& shape) {
  LayerGateParams p;
  for (int64_t i = 0; i < shape.HV; ++i)
    p.A_log.push_back(static_cast<float>(std::log(rng.uniform(1.0, 16.0))));
  const int64_t dt_len = shape.kda ? shape.HV * shape.K : shape.HV;
  for (int64_t i = 0; i < dt_len; ++i) {
    const double dt = std::exp(rng.uniform(std::log(1e-3), std::log(1e-1)));
    p.dt_bias.push_back(static_cast<float>(std::log(std::expm1(dt))));
  }
  return p;
}

// ---- device memory -----------------------------------------------------------------------------

namespace {
#ifdef DELTASTATE_CLI_CUDA
void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw Error(ErrorKind::runtime,
                std::string("CUDA ") + what + ": " + cudaGetErrorString(status));
}
#endif
bool on_cuda(Device d) { return d.type == DeviceType::cuda; }
[[noreturn, maybe_unused]] void no_cuda() {
  throw Error(ErrorKind::not_implemented, "this deltastate CLI was built without CUDA support");
}
}  // namespace

DeviceBuffer::DeviceBuffer(Device device, int64_t bytes) : device_(device), bytes_(bytes) {
  const size_t n = static_cast<size_t>(bytes > 0 ? bytes : 1);
  if (on_cuda(device)) {
#ifdef DELTASTATE_CLI_CUDA
    cuda_check(cudaSetDevice(device.index), "cudaSetDevice");
    cuda_check(cudaMalloc(&data_, n), "cudaMalloc");
    cuda_check(cudaMemset(data_, 0, n), "cudaMemset");
#else
    no_cuda();
#endif
  } else {
    data_ = std::calloc(n, 1);
    if (!data_) throw Error(ErrorKind::runtime, "cannot allocate " + std::to_string(n) + " bytes");
  }
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : device_(other.device_), bytes_(other.bytes_), data_(other.data_) {
  other.data_ = nullptr;
}

DeviceBuffer::~DeviceBuffer() {
  if (!data_) return;
#ifdef DELTASTATE_CLI_CUDA
  if (on_cuda(device_)) {
    cudaFree(data_);
    return;
  }
#endif
  std::free(data_);
}

TensorView DeviceBuffer::view(DType dtype, std::initializer_list<int64_t> shape) const {
  TensorView v = TensorView::contiguous(data_, dtype, shape, device_);
  if (v.numel() * v.element_size() > bytes_)
    throw Error(ErrorKind::value, "cli: view " + shape_str(v) + " exceeds its buffer");
  return v;
}

void DeviceBuffer::fill(uint8_t byte) {
  if (on_cuda(device_)) {
#ifdef DELTASTATE_CLI_CUDA
    cuda_check(cudaMemset(data_, byte, static_cast<size_t>(bytes_)), "cudaMemset");
#else
    no_cuda();
#endif
  } else {
    std::memset(data_, byte, static_cast<size_t>(bytes_));
  }
}

namespace {
size_t view_bytes(const TensorView& v) {
  if (!v.is_contiguous()) throw Error(ErrorKind::value, "cli: host copies need contiguous views");
  return static_cast<size_t>(v.numel() * v.element_size());
}
}  // namespace

void copy_to_view(const TensorView& dst, const void* host) {
  if (on_cuda(dst.device)) {
#ifdef DELTASTATE_CLI_CUDA
    cuda_check(cudaMemcpy(dst.data, host, view_bytes(dst), cudaMemcpyHostToDevice), "cudaMemcpy");
#else
    no_cuda();
#endif
  } else {
    std::memcpy(dst.data, host, view_bytes(dst));
  }
}

void copy_from_view(void* host, const TensorView& src) {
  if (on_cuda(src.device)) {
#ifdef DELTASTATE_CLI_CUDA
    cuda_check(cudaMemcpy(host, src.data, view_bytes(src), cudaMemcpyDeviceToHost), "cudaMemcpy");
#else
    no_cuda();
#endif
  } else {
    std::memcpy(host, src.data, view_bytes(src));
  }
}

std::vector<float> read_floats(const TensorView& src) {
  std::vector<uint8_t> bytes(view_bytes(src));
  copy_from_view(bytes.data(), src);
  return decode(bytes, src.dtype);
}

void synchronize(Device device) {
#ifdef DELTASTATE_CLI_CUDA
  if (on_cuda(device)) cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#else
  (void)device;
#endif
}

bool cuda_supported() {
#ifdef DELTASTATE_CLI_CUDA
  return deltastate::cuda_built();  // a device is checked by parse_device, with its own message
#else
  return false;
#endif
}

Device parse_device(const std::string& name) {
  if (name == "cpu") return Device::cpu();
  if (!cuda_supported())
    throw UsageError(
        "--device cuda: this build has no CUDA support (reconfigure with nvcc "
        "available and -DDELTASTATE_CUDA=ON)");
#ifdef DELTASTATE_CLI_CUDA
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    // Without a GPU the runtime answers "no device" or, with no NVIDIA driver loaded at all,
    // "driver version is insufficient": both mean there is no device here, which is what the
    // user needs to hear. An old driver beside a GPU is the one case that blames the driver.
    const bool driver_loaded = std::ifstream("/proc/driver/nvidia/version").good();
    if (status == cudaErrorInsufficientDriver && driver_loaded)
      throw UsageError(std::string("--device cuda: the NVIDIA driver is older than this build's "
                                   "CUDA runtime (") +
                       cudaGetErrorString(status) + ")");
    throw UsageError(std::string("--device cuda: no CUDA device found (") +
                     (status == cudaSuccess ? "the CUDA runtime reports 0 devices"
                      : !driver_loaded      ? "no NVIDIA driver is loaded on this machine"
                                            : cudaGetErrorString(status)) +
                     "); run on the CPU with --device cpu (the default)");
  }
#endif
  return Device::cuda(0);
}

void set_cpu_threads(int64_t threads) {
  if (threads > 0) setenv("DELTASTATE_NUM_THREADS", std::to_string(threads).c_str(), 1);
}

// ---- byte model ------------------------------------------------------------------------------

int64_t ByteModel::state_bytes() const { return shape.state_elems() * dtype_size(state_dtype); }

int64_t ByteModel::io_bytes() const {
  const int64_t in = shape.qkv_width() + shape.gate_width() + shape.HV;  // mixed_qkv, a, b
  const int64_t out = shape.HV * shape.V;
  return (in + out) * dtype_size(act_dtype);
}

int64_t ByteModel::ring_record_bytes() const {
  return shape.HV * shape.V * dtype_size(state_dtype) + shape.H * shape.K * dtype_size(act_dtype) +
         shape.HV * (shape.kda ? shape.K : 1) * 4;
}

int64_t ByteModel::replay_step(int64_t m, bool flush) const {
  return state_bytes() + m * ring_record_bytes() + io_bytes() +
         (flush ? state_bytes() : ring_record_bytes());
}

double ByteModel::replay_cycle_average(int64_t L) const {
  double total = 0.0;
  for (int64_t m = 0; m < L; ++m) total += static_cast<double>(replay_step(m, m == L - 1));
  return total / static_cast<double>(L);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "kB", "MB", "GB", "TB"};
  int u = 0;
  while (bytes >= 1000.0 && u < 4) {
    bytes /= 1000.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

}  // namespace deltastate::cli
