// deltastate bench: CPU throughput of every decode op, with the bytes each call moves counted by
// the explicit byte model (cli_util.h) rather than measured.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "cli_args.h"
#include "cli_util.h"
#include "commands.h"

namespace deltastate::cli {

namespace {

enum class OpKind { packed, recurrent, replay };

struct OpSpec {
  const char* name;
  bool kda;
  OpKind kind;
  bool multi_token;  // recurrent with --tokens tokens per sequence (else T = 1)
};

const std::vector<OpSpec>& op_specs() {
  static const std::vector<OpSpec> specs = {
      {"gdn_packed", false, OpKind::packed, false},
      {"kda_packed", true, OpKind::packed, false},
      {"gdn_recurrent", false, OpKind::recurrent, false},
      {"kda_recurrent", true, OpKind::recurrent, false},
      {"gdn_recurrent_multi", false, OpKind::recurrent, true},
      {"kda_recurrent_multi", true, OpKind::recurrent, true},
      {"gdn_replay", false, OpKind::replay, false},
      {"kda_replay", true, OpKind::replay, false},
  };
  return specs;
}

std::vector<std::string> op_names() {
  std::vector<std::string> names;
  for (const OpSpec& s : op_specs()) names.push_back(s.name);
  return names;
}

const OpSpec& op_by_name(const std::string& name) {
  for (const OpSpec& s : op_specs())
    if (name == s.name) return s;
  throw UsageError("unknown op '" + name + "'");
}

struct BenchOptions {
  std::vector<std::string> ops = op_names();
  std::vector<int64_t> batches = {1, 8, 32};
  std::string model = "small-gdn", state_dtype = "f32";
  int64_t iters = 20, tokens = 4, replay_len = 8, threads = 0;
};

constexpr DType kActDtype = DType::bf16;  // activations, outputs and the k ring
constexpr int kWarmupCalls = 2;

// Random inputs of one op call: B sequences of T tokens, packed rows [B, T, 2HK + HV*V].
struct OpInputs {
  ModelShape shape;
  int64_t B, T;
  DeviceBuffer qkv, a, b, A_log, dt_bias, out, indices, write_pos;

  OpInputs(const ModelShape& s, int64_t batch, int64_t tokens, Rng& rng)
      : shape(s),
        B(batch),
        T(tokens),
        qkv(Device::cpu(), 2 * B * T * s.qkv_width()),
        a(Device::cpu(), 2 * B * T * s.gate_width()),
        b(Device::cpu(), 2 * B * T * s.HV),
        A_log(Device::cpu(), 4 * s.HV),
        dt_bias(Device::cpu(), 4 * (s.kda ? s.HV * s.K : s.HV)),
        out(Device::cpu(), 2 * B * T * s.HV * s.V),
        indices(Device::cpu(), 4 * B),
        write_pos(Device::cpu(), 4 * B) {
    const auto fill = [](const DeviceBuffer& buf, const std::vector<float>& values, DType dtype) {
      copy_to_view(buf.view(dtype, {static_cast<int64_t>(values.size())}),
                   encode(values, dtype).data());
    };
    fill(qkv, rng.normal_vector(B * T * s.qkv_width()), kActDtype);
    fill(a, rng.normal_vector(B * T * s.gate_width()), kActDtype);
    fill(b, rng.normal_vector(B * T * s.HV), kActDtype);
    const LayerGateParams gate = random_gate_params(rng, s);
    fill(A_log, gate.A_log, DType::f32);
    fill(dt_bias, gate.dt_bias, DType::f32);
    std::vector<int32_t> slots(static_cast<size_t>(B));
    for (int64_t i = 0; i < B; ++i) slots[i] = static_cast<int32_t>(i);
    copy_to_view(rows(indices), slots.data());
  }

  TensorView rows(const DeviceBuffer& buf) const { return buf.view(DType::i32, {B}); }
  TensorView A_log_view() const { return A_log.view(DType::f32, {shape.HV}); }
  TensorView dt_bias_view() const { return dt_bias.view(DType::f32, {dt_bias.bytes() / 4}); }
  TensorView decode_out() const { return out.view(kActDtype, {B, 1, shape.HV, shape.V}); }

  // The T = 1 inputs of packed decode and ReplaySSM.
  DecodeInputs decode_inputs() const {
    DecodeInputs in;
    in.mixed_qkv = qkv.view(kActDtype, {B, shape.qkv_width()});
    in.a = a.view(kActDtype, {B, shape.gate_width()});
    in.b = b.view(kActDtype, {B, shape.HV});
    in.A_log = A_log_view();
    in.dt_bias = dt_bias_view();
    in.scale = 1.0 / std::sqrt(static_cast<double>(shape.K));
    return in;
  }

  // q, k and v as strided views into the packed rows (token stride = one packed row).
  TensorView head_view(int64_t offset, int64_t heads, int64_t dim) const {
    const int64_t W = shape.qkv_width();
    return TensorView::strided(static_cast<char*>(qkv.data()) + offset * dtype_size(kActDtype),
                               kActDtype, {B, T, heads, dim}, {T * W, W, dim, 1});
  }
};

PackedDecodeArgs packed_args(const OpInputs& in, const StatePool& pool) {
  PackedDecodeArgs args;
  in.decode_inputs().apply(args);
  args.state = pool.layer_state(0);
  args.out = in.decode_out();
  args.state_indices = in.rows(in.indices);
  return args;
}

RecurrentArgs recurrent_args(const OpInputs& in, const StatePool& pool) {
  const ModelShape& s = in.shape;
  RecurrentArgs args;
  args.q = in.head_view(0, s.H, s.K);
  args.k = in.head_view(s.H * s.K, s.H, s.K);
  args.v = in.head_view(2 * s.H * s.K, s.HV, s.V);
  args.g = s.kda ? in.a.view(kActDtype, {in.B, in.T, s.HV, s.K})
                 : in.a.view(kActDtype, {in.B, in.T, s.HV});
  args.beta = in.b.view(kActDtype, {in.B, in.T, s.HV});
  args.out = in.out.view(kActDtype, {in.B, in.T, s.HV, s.V});
  args.A_log = in.A_log_view();
  args.dt_bias = in.dt_bias_view();
  args.gate_in_kernel = true;
  args.beta_is_logit = true;
  args.state = pool.layer_state(0);
  args.state_indices = in.rows(in.indices);
  return args;
}

ReplayDecodeArgs replay_args(const OpInputs& in, const StatePool& pool) {
  ReplayDecodeArgs args;
  in.decode_inputs().apply(args);
  args.state = pool.layer_state(0);
  args.d_cache = pool.d_cache(0);
  args.k_cache = pool.k_cache(0);
  args.g_cache = pool.g_cache(0);
  args.out = in.decode_out();
  args.state_indices = in.rows(in.indices);
  args.write_pos = in.rows(in.write_pos);
  args.is_kda = in.shape.kda;
  args.advance_write_pos = true;  // cursors cycle 0, 1, ..., L-1 (flush), 0, ...
  return args;
}

// One benchmark row: `run` does `calls` op calls; bytes are per call.
struct Measurement {
  double median_us_per_call;
  double bytes_per_call;
};

Measurement measure(const std::function<void()>& run, int64_t calls, int64_t iters, double bytes) {
  for (int i = 0; i < kWarmupCalls; ++i) run();
  std::vector<double> seconds;
  for (int64_t i = 0; i < iters; ++i) {
    Stopwatch sw;
    sw.start();
    run();
    seconds.push_back(sw.stop() / static_cast<double>(calls));
  }
  std::sort(seconds.begin(), seconds.end());
  return {seconds[seconds.size() / 2] * 1e6, bytes};
}

Measurement bench_op(const OpSpec& op, const BenchOptions& o, ModelShape shape, int64_t B,
                     DType state_dtype, Rng& rng) {
  shape.kda = op.kda;
  const int64_t T = op.multi_token ? o.tokens : 1;
  const int64_t L = op.kind == OpKind::replay ? o.replay_len : 0;
  StatePoolConfig config;
  config.slots = B;
  config.HV = shape.HV;
  config.V = shape.V;
  config.K = shape.K;
  config.state_dtype = state_dtype;
  config.replay_len = L;
  config.H = shape.H;
  config.ring_k_dtype = kActDtype;
  config.kda = shape.kda;
  const StatePool pool(config);
  const OpInputs in(shape, B, T, rng);
  const ByteModel bytes{shape, state_dtype, kActDtype};

  switch (op.kind) {
    case OpKind::packed: {
      const PackedDecodeArgs args = packed_args(in, pool);
      const auto call = op.kda ? kda_packed_decode : gdn_packed_decode;
      return measure([&] { call(args); }, 1, o.iters,
                     static_cast<double>(B * bytes.plain_decode()));
    }
    case OpKind::recurrent: {
      const RecurrentArgs args = recurrent_args(in, pool);
      const auto call = op.kda ? recurrent_kda : recurrent_gdn;
      return measure([&] { call(args); }, 1, o.iters, static_cast<double>(B * bytes.recurrent(T)));
    }
    case OpKind::replay: {
      // One iteration is a whole ring cycle: L-1 appending steps and one flush.
      const ReplayDecodeArgs args = replay_args(in, pool);
      const auto cycle = [&] {
        for (int64_t i = 0; i < L; ++i) replayssm_decode(args);
      };
      return measure(cycle, L, o.iters, B * bytes.replay_cycle_average(L));
    }
  }
  return {};
}

}  // namespace

int run_bench(const std::vector<std::string>& args) {
  BenchOptions o;
  ArgParser parser("bench",
                   "CPU throughput of the decode ops: median time per call over --iters "
                   "iterations, bytes moved per call (explicit byte model) and GB/s.");
  parser.add_choice_list("ops", &o.ops, op_names(), "ops to run");
  parser.add_int_list("batch", &o.batches, 1, 4096, "batch sizes (sequences per call)");
  parser.add_choice("model", &o.model, model_names(), "head shape (used by GDN and KDA ops alike)");
  parser.add_choice("state-dtype", &o.state_dtype, float_dtype_names(), "state pool dtype");
  parser.add_int("iters", &o.iters, 1, 100000, "timed iterations per row");
  parser.add_int("tokens", &o.tokens, 2, 4096, "tokens per sequence of the *_recurrent_multi ops");
  parser.add_int("replay-len", &o.replay_len, 1, 1024, "ReplaySSM ring length L");
  parser.add_int("threads", &o.threads, 0, 1024, "CPU threads (0: the library's default)");
  if (!parser.parse(args)) return 0;
  set_cpu_threads(o.threads);

  const ModelShape model = model_by_name(o.model);
  const DType state_dtype = dtype_by_name(o.state_dtype);
  std::printf(
      "deltastate bench: CPU, model %s (H=%lld HV=%lld K=%lld V=%lld), state %s, "
      "activations %s, median of %lld iterations\n",
      model.name.c_str(), static_cast<long long>(model.H), static_cast<long long>(model.HV),
      static_cast<long long>(model.K), static_cast<long long>(model.V),
      dtype_short_name(state_dtype), dtype_short_name(kActDtype), static_cast<long long>(o.iters));
  std::printf("replay rows: per call averaged over a ring cycle (L-1 appends + 1 flush)\n\n");
  std::printf("%-20s %-24s %5s %12s %12s %9s\n", "op", "shape", "B", "us/call", "bytes/call",
              "GB/s");
  Rng rng(1);
  for (const std::string& name : o.ops) {
    const OpSpec& op = op_by_name(name);
    char shape[64];  // e.g. "H4 HV8 K64 V64 T=1"; replay ops show their ring length L
    std::snprintf(shape, sizeof shape, "H%lld HV%lld K%lld V%lld %s=%lld",
                  static_cast<long long>(model.H), static_cast<long long>(model.HV),
                  static_cast<long long>(model.K), static_cast<long long>(model.V),
                  op.kind == OpKind::replay ? "L" : "T",
                  static_cast<long long>(op.kind == OpKind::replay ? o.replay_len
                                         : op.multi_token          ? o.tokens
                                                                   : 1));
    for (int64_t B : o.batches) {
      const Measurement m = bench_op(op, o, model, B, state_dtype, rng);
      std::printf("%-20s %-24s %5lld %12.1f %12s %9.2f\n", op.name, shape,
                  static_cast<long long>(B), m.median_us_per_call,
                  format_bytes(m.bytes_per_call).c_str(),
                  m.bytes_per_call / (m.median_us_per_call * 1e-6) / 1e9);
    }
  }
  return 0;
}

}  // namespace deltastate::cli
