// deltastate bench: CPU throughput of every decode op, with the bytes each call moves counted by
// the explicit byte model (cli_util.h) rather than measured, and of chunked prefill against the
// token-by-token recurrence on the same inputs. Yardstick measured in the same run: an in-place
// pass (read, scale by a runtime 1.0, write) over the bytes of the states the call updates, on
// as many threads as the library uses. Prints min / median / max; --json writes the rows.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "cli_args.h"
#include "cli_util.h"
#include "commands.h"

namespace deltastate::cli {

namespace {

enum class OpKind { packed, recurrent, replay, prefill, prefill_recurrent };

struct OpSpec {
  const char* name;
  bool kda;
  OpKind kind;
  bool multi_token;      // recurrent with --tokens tokens per sequence (else T = 1)
  bool prefill = false;  // --prefill-tokens tokens per sequence
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
      {"gdn_prefill", false, OpKind::prefill, false, true},
      {"kda_prefill", true, OpKind::prefill, false, true},
      {"gdn_prefill_recurrent", false, OpKind::prefill_recurrent, false, true},
      {"kda_prefill_recurrent", true, OpKind::prefill_recurrent, false, true},
  };
  return specs;
}

std::vector<std::string> op_names() {
  std::vector<std::string> names;
  for (const OpSpec& s : op_specs()) names.push_back(s.name);
  return names;
}

std::vector<std::string> default_ops() {  // the decode ops (prefill rows take seconds)
  std::vector<std::string> names;
  for (const OpSpec& s : op_specs())
    if (!s.prefill) names.push_back(s.name);
  return names;
}

const OpSpec& op_by_name(const std::string& name) {
  for (const OpSpec& s : op_specs())
    if (name == s.name) return s;
  throw UsageError("unknown op '" + name + "'");
}

struct BenchOptions {
  std::vector<std::string> ops = default_ops();
  std::vector<int64_t> batches = {1, 8, 32};
  std::string model = "small-gdn", state_dtype = "f32";
  int64_t iters = 20, tokens = 4, replay_len = 8, threads = 0, prefill_tokens = 2048;
  std::string json;
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

// The threads of the in-place pass: as many as the library's pool, kept for the whole run.
class PassThreads {
 public:
  explicit PassThreads(int n) : n_(n), start_(n), done_(n) {
    for (int i = 1; i < n; ++i) workers_.emplace_back([this, i] { loop(i); });
  }
  ~PassThreads() {
    stop_ = true;
    start_.arrive_and_wait();
    for (auto& t : workers_) t.join();
  }
  // x *= one over `bytes` bytes of `data` (floats), each thread its contiguous share.
  void pass(float* data, int64_t floats, float one) {
    data_ = data;
    floats_ = floats;
    one_ = one;
    start_.arrive_and_wait();
    share(0);
    done_.arrive_and_wait();
  }

 private:
  void loop(int i) {
    while (true) {
      start_.arrive_and_wait();
      if (stop_) return;
      share(i);
      done_.arrive_and_wait();
    }
  }
  void share(int i) {
    const int64_t per = (floats_ + n_ - 1) / n_;
    const int64_t lo = std::min(floats_, i * per), hi = std::min(floats_, lo + per);
    float* d = data_;
    const float one = one_;
    for (int64_t j = lo; j < hi; ++j) d[j] *= one;
  }
  int n_;
  std::barrier<> start_, done_;
  std::vector<std::thread> workers_;
  float* data_ = nullptr;
  int64_t floats_ = 0;
  float one_ = 1.0f;
  std::atomic<bool> stop_{false};
};

int library_threads() {
  if (const char* env = std::getenv("DELTASTATE_NUM_THREADS"))
    if (std::atoi(env) > 0) return std::atoi(env);
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? static_cast<int>(hw) : 1;
}

struct Timing {
  double min_us = 0, median_us = 0, max_us = 0;
};

// `run` does `calls` op calls; the times are per call.
Timing time_calls(const std::function<void()>& run, int64_t calls, int64_t iters) {
  for (int i = 0; i < kWarmupCalls; ++i) run();
  std::vector<double> us;
  for (int64_t i = 0; i < iters; ++i) {
    Stopwatch sw;
    sw.start();
    run();
    us.push_back(sw.stop() / static_cast<double>(calls) * 1e6);
  }
  std::sort(us.begin(), us.end());
  return {us.front(), us[us.size() / 2], us.back()};
}

// One benchmark row: the op, bytes per call (decode) or flops and tokens (prefill), and the
// in-place pass over the state bytes the call updates.
struct Measurement {
  Timing op, pass;
  double bytes_per_call = 0, state_bytes = 0, flops = 0, tokens = 0;
};

// Multiply-adds of the chunk algorithm per chunk of C tokens and head (src/cpu/chunk_prefill.cpp):
// K K^T and Q K^T lower triangles, the triangular solve, w, u, v' = u - w S^T, the outputs
// S (q e^G) + P v', the state update; flops = 2 x that.
double chunk_flops(const ModelShape& s, int64_t T) {
  const double K = static_cast<double>(s.K), V = static_cast<double>(s.V);
  double fma = 0;
  for (int64_t c0 = 0; c0 < T; c0 += 64) {
    const double C = static_cast<double>(std::min<int64_t>(64, T - c0)), tri = C * (C + 1) / 2;
    fma += 2 * tri * K + C * C * C / 6 + tri * K + tri * V + 3 * C * K * V + tri * V;
  }
  return 2 * fma * static_cast<double>(s.HV);
}

Measurement bench_op(const OpSpec& op, const BenchOptions& o, ModelShape shape, int64_t B,
                     DType state_dtype, Rng& rng, PassThreads& pass) {
  shape.kda = op.kda;
  const int64_t T = op.prefill ? o.prefill_tokens : op.multi_token ? o.tokens : 1;
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

  Measurement m;
  m.state_bytes = static_cast<double>(B * bytes.state_bytes());
  switch (op.kind) {
    case OpKind::packed: {
      const PackedDecodeArgs args = packed_args(in, pool);
      const auto call = op.kda ? kda_packed_decode : gdn_packed_decode;
      m.op = time_calls([&] { call(args); }, 1, o.iters);
      m.bytes_per_call = static_cast<double>(B * bytes.plain_decode());
      break;
    }
    case OpKind::recurrent:
    case OpKind::prefill_recurrent: {
      const RecurrentArgs args = recurrent_args(in, pool);
      const auto call = op.kda ? recurrent_kda : recurrent_gdn;
      m.op = time_calls([&] { call(args); }, 1, o.iters);
      m.bytes_per_call = static_cast<double>(B * bytes.recurrent(T));
      break;
    }
    case OpKind::replay: {
      // One iteration is a whole ring cycle: L-1 appending steps and one flush.
      const ReplayDecodeArgs args = replay_args(in, pool);
      const auto cycle = [&] {
        for (int64_t i = 0; i < L; ++i) replayssm_decode(args);
      };
      m.op = time_calls(cycle, L, o.iters);
      m.bytes_per_call = B * bytes.replay_cycle_average(L);
      break;
    }
    case OpKind::prefill: {
      const RecurrentArgs r = recurrent_args(in, pool);
      ChunkPrefillArgs c;
      c.q = r.q;
      c.k = r.k;
      c.v = r.v;
      c.g = r.g;
      c.beta = r.beta;
      c.out = r.out;
      c.is_kda = op.kda;
      c.A_log = r.A_log;
      c.dt_bias = r.dt_bias;
      c.gate_in_kernel = true;
      c.beta_is_logit = true;
      c.initial_state = r.state;
      c.initial_state_indices = r.state_indices;
      c.lower_bound = r.lower_bound;
      const int64_t ws_floats = (chunk_prefill_workspace_bytes(c) + 3) / 4 + 1;
      DeviceBuffer ws(Device::cpu(), 4 * ws_floats);
      c.workspace = ws.view(DType::f32, {ws_floats});
      m.op = time_calls([&] { chunk_prefill(c); }, 1, o.iters);
      m.bytes_per_call = static_cast<double>(B * bytes.recurrent(T));
      break;
    }
  }
  if (op.prefill) m.tokens = static_cast<double>(B * T);
  if (op.kind == OpKind::prefill) m.flops = static_cast<double>(B) * chunk_flops(shape, T);
  // The yardstick: the same state bytes, read and written in place by as many threads.
  float* states = static_cast<float*>(pool.layer_state(0).data);
  const int64_t floats = B * bytes.state_bytes() / 4;
  m.pass = time_calls([&] { pass.pass(states, floats, 1.0f); }, 1, o.iters);
  return m;
}

void print_json_row(FILE* f, bool first, const OpSpec& op, int64_t B, int64_t T,
                    const Measurement& m) {
  std::fprintf(f,
               "%s    {\"op\": \"%s\", \"B\": %lld, \"T\": %lld, \"min_us\": %.1f, "
               "\"median_us\": %.1f, \"max_us\": %.1f, \"bytes_per_call\": %.0f, "
               "\"state_bytes\": %.0f, \"inplace_min_us\": %.1f, \"inplace_median_us\": %.1f, "
               "\"inplace_max_us\": %.1f, \"flops\": %.0f}",
               first ? "" : ",\n", op.name, static_cast<long long>(B), static_cast<long long>(T),
               m.op.min_us, m.op.median_us, m.op.max_us, m.bytes_per_call, m.state_bytes,
               m.pass.min_us, m.pass.median_us, m.pass.max_us, m.flops);
}

}  // namespace

int run_bench(const std::vector<std::string>& args) {
  BenchOptions o;
  ArgParser parser("bench",
                   "CPU throughput: min / median / max time per call over --iters iterations; "
                   "decode ops with bytes moved per call (explicit byte model), GB/s and an "
                   "in-place pass over the same state bytes on as many threads (the yardstick); "
                   "prefill ops (gdn_prefill, kda_prefill and their *_recurrent token-by-token "
                   "runs on the same inputs) with tokens/s and the chunk algorithm's GFLOP/s.");
  parser.add_choice_list("ops", &o.ops, op_names(), "ops to run (default: the decode ops)");
  parser.add_int_list("batch", &o.batches, 1, 4096, "batch sizes (sequences per call)");
  parser.add_choice("model", &o.model, model_names(), "head shape (used by GDN and KDA ops alike)");
  parser.add_choice("state-dtype", &o.state_dtype, float_dtype_names(), "state pool dtype");
  parser.add_int("iters", &o.iters, 1, 100000, "timed iterations per row");
  parser.add_int("tokens", &o.tokens, 2, 4096, "tokens per sequence of the *_recurrent_multi ops");
  parser.add_int("prefill-tokens", &o.prefill_tokens, 1, 65536,
                 "tokens per sequence of the *_prefill ops");
  parser.add_int("replay-len", &o.replay_len, 1, 1024, "ReplaySSM ring length L");
  parser.add_int("threads", &o.threads, 0, 1024, "CPU threads (0: the library's default)");
  parser.add_string("json", &o.json, "also write the rows to this JSON file");
  if (!parser.parse(args)) return 0;
  set_cpu_threads(o.threads);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // rows appear as they are measured, piped too

  const ModelShape model = model_by_name(o.model);
  const DType state_dtype = dtype_by_name(o.state_dtype);
  const int threads = library_threads();
  PassThreads pass(threads);
  std::printf(
      "deltastate bench: CPU, %d threads, model %s (H=%lld HV=%lld K=%lld V=%lld), state %s, "
      "activations %s, %lld iterations per row\n",
      threads, model.name.c_str(), static_cast<long long>(model.H),
      static_cast<long long>(model.HV), static_cast<long long>(model.K),
      static_cast<long long>(model.V), dtype_short_name(state_dtype), dtype_short_name(kActDtype),
      static_cast<long long>(o.iters));
  std::printf(
      "replay rows: per call averaged over a ring cycle (L-1 appends + 1 flush); inplace: a pass "
      "reading and writing the state bytes; op/inplace: median time over the pass's\n\n");
  // GFLOP/s only where it means something: the chunked prefill's matmul work. Decode ops are
  // bound by the bytes they move (GB/s); their rows print "-" when a prefill op shares the table.
  const bool show_flops = std::any_of(o.ops.begin(), o.ops.end(), [](const std::string& n) {
    return op_by_name(n).kind == OpKind::prefill;
  });
  std::printf("%-22s %5s %6s %10s %10s %10s %11s %8s %10s %8s%s\n", "op", "B", "T", "min_us",
              "median_us", "max_us", "bytes/call", "GB/s", "inplace_us", "op/pass",
              show_flops ? "   GFLOP/s" : "");
  FILE* json = nullptr;
  if (!o.json.empty()) {
    json = std::fopen(o.json.c_str(), "w");
    if (!json) throw UsageError("cannot write '" + o.json + "'");
    std::fprintf(json,
                 "{\"threads\": %d, \"model\": \"%s\", \"state_dtype\": \"%s\", "
                 "\"activations\": \"%s\", \"iters\": %lld, \"replay_len\": %lld, "
                 "\"rows\": [\n",
                 threads, model.name.c_str(), dtype_short_name(state_dtype),
                 dtype_short_name(kActDtype), static_cast<long long>(o.iters),
                 static_cast<long long>(o.replay_len));
  }
  bool first = true;
  Rng rng(1);
  for (const std::string& name : o.ops) {
    const OpSpec& op = op_by_name(name);
    const int64_t T = op.kind == OpKind::replay ? o.replay_len
                      : op.prefill              ? o.prefill_tokens
                      : op.multi_token          ? o.tokens
                                                : 1;
    for (int64_t B : o.batches) {
      const Measurement m = bench_op(op, o, model, B, state_dtype, rng, pass);
      char gflops[32] = "";
      if (show_flops && m.flops > 0)
        std::snprintf(gflops, sizeof gflops, " %9.1f", m.flops / (m.op.median_us * 1e3));
      else if (show_flops) std::snprintf(gflops, sizeof gflops, " %9s", "-");
      std::printf("%-22s %5lld %6lld %10.1f %10.1f %10.1f %11s %8.2f %10.1f %8.2f%s\n", op.name,
                  static_cast<long long>(B), static_cast<long long>(T), m.op.min_us, m.op.median_us,
                  m.op.max_us, format_bytes(m.bytes_per_call).c_str(),
                  m.bytes_per_call / (m.op.median_us * 1e-6) / 1e9, m.pass.median_us,
                  m.op.median_us / m.pass.median_us, gflops);
      if (json) print_json_row(json, first, op, B, T, m);
      first = false;
    }
  }
  if (json) {
    std::fprintf(json, "\n]}\n");
    std::fclose(json);
  }
  return 0;
}

}  // namespace deltastate::cli
