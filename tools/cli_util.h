// Pieces shared by `deltastate demo` and `deltastate bench`: model shapes, dtypes, a
// deterministic RNG, device memory (CPU heap or CUDA), timing and the explicit byte model.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "deltastate/deltastate.h"

namespace deltastate::cli {

// ---- models ----------------------------------------------------------------------------------
// The per-layer, per-TP-rank head shape of one linear-attention layer.
struct ModelShape {
  std::string name;
  bool kda = false;  // mixer: KDA (per-K gate) or GDN (scalar gate)
  int64_t H = 0, HV = 0, K = 0, V = 0;

  int64_t qkv_width() const { return 2 * H * K + HV * V; }  // one packed mixed_qkv row
  int64_t gate_width() const { return kda ? HV * K : HV; }  // one row of `a`
  int64_t state_elems() const { return HV * V * K; }        // one (layer, slot) state
  std::string describe() const;                             // "GDN H=4 HV=8 K=64 V=64"
};
std::vector<std::string> model_names();
ModelShape model_by_name(const std::string& name);  // name is one of model_names()

// ---- dtypes ----------------------------------------------------------------------------------
std::vector<std::string> float_dtype_names();  // {"f32", "bf16"}
DType dtype_by_name(const std::string& name);  // "f32" | "bf16"

// Host-side conversion of fp32 values to and from a floating storage dtype (round to nearest
// even), for building inputs and reading outputs.
std::vector<uint8_t> encode(const std::vector<float>& values, DType dtype);
std::vector<float> decode(const std::vector<uint8_t>& bytes, DType dtype);

// ---- deterministic random numbers (same sequence on every platform) ---------------------------
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next();   // splitmix64
  double uniform();  // [0, 1)
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  int64_t uniform_int(int64_t lo, int64_t hi);  // [lo, hi]
  double normal();                              // N(0, 1), Box-Muller
  std::vector<float> normal_vector(int64_t n);

 private:
  uint64_t state_;
};

// Gate parameters of one layer, at the scales of a trained model: A_log = log(U(1, 16)) [HV];
// dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] (the Mamba init), GDN [HV] / KDA
// [HV*K].
struct LayerGateParams {
  std::vector<float> A_log, dt_bias;
};
LayerGateParams random_gate_params(Rng& rng, const ModelShape& shape);

// The inputs that packed decode and ReplaySSM decode share. apply() sets them on either
// PackedDecodeArgs or ReplayDecodeArgs (same field names).
struct DecodeInputs {
  TensorView mixed_qkv, a, b, A_log, dt_bias;
  double scale = 0.0;

  template <class Args>
  void apply(Args& args) const {
    args.mixed_qkv = mixed_qkv;
    args.a = a;
    args.b = b;
    args.A_log = A_log;
    args.dt_bias = dt_bias;
    args.scale = scale;
  }
};

// ---- memory on a device ------------------------------------------------------------------------
// Zeroed memory on the CPU heap or (in a CUDA build) on a CUDA device; freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer(Device device, int64_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;

  void* data() const { return data_; }
  int64_t bytes() const { return bytes_; }
  // A dense view over the start of the buffer.
  TensorView view(DType dtype, std::initializer_list<int64_t> shape) const;
  void fill(uint8_t byte);  // every byte of the buffer

 private:
  Device device_;
  int64_t bytes_ = 0;
  void* data_ = nullptr;
};

// Copies between host memory and a contiguous view on any device (CUDA: blocking).
void copy_to_view(const TensorView& dst, const void* host);
void copy_from_view(void* host, const TensorView& src);
std::vector<float> read_floats(const TensorView& src);  // a floating view, decoded to fp32
void synchronize(Device device);                        // CUDA: wait for the device
// Whether this executable can run on CUDA (compiled with the CUDA runtime and the library's
// CUDA backend); and a one-line reason when not.
bool cuda_supported();
Device parse_device(const std::string& name);  // "cpu" | "cuda" (throws UsageError if unusable)

// --threads: the CPU backend sizes its thread pool from DELTASTATE_NUM_THREADS on first use.
void set_cpu_threads(int64_t threads);  // 0 = leave the library's default

// ---- timing ----------------------------------------------------------------------------------
class Stopwatch {
 public:
  void start() { t0_ = std::chrono::steady_clock::now(); }
  double stop() {  // seconds since start(), also added to total()
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    total_ += s;
    return s;
  }
  double total() const { return total_; }

 private:
  std::chrono::steady_clock::time_point t0_{};
  double total_ = 0.0;
};

// ---- the byte model
// ------------------------------------------------------------------------------ Bytes one live row
// moves through one layer for one decode token: the state read and written, plus the token's inputs
// and output. Padded rows move nothing.
struct ByteModel {
  ModelShape shape;
  DType state_dtype = DType::f32;
  DType act_dtype = DType::bf16;  // mixed_qkv, a, b, out and the k ring

  int64_t state_bytes() const;        // one [HV, V, K] state
  int64_t io_bytes() const;           // mixed_qkv + a + b rows in, one out row
  int64_t ring_record_bytes() const;  // d [HV, V] + k [H, K] + g [HV(, K)] fp32
  // Plain decode (packed or recurrent): read + write the state, plus the token's io.
  int64_t plain_decode() const { return 2 * state_bytes() + io_bytes(); }
  // Recurrent with T tokens: the state once in and out, the io of every token.
  int64_t recurrent(int64_t tokens) const { return 2 * state_bytes() + tokens * io_bytes(); }
  // ReplaySSM with m records in the ring: read the checkpoint and the m records, then write the
  // checkpoint (flush) or append one record.
  int64_t replay_step(int64_t m, bool flush) const;
  // ReplaySSM averaged over a ring cycle of L steps: m = 0..L-2 append, m = L-1 flushes.
  double replay_cycle_average(int64_t L) const;
};

// "1.23 MB", "456 kB": decimal units, as bandwidth is quoted.
std::string format_bytes(double bytes);

}  // namespace deltastate::cli
