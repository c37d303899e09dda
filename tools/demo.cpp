// deltastate demo: a continuous-batching simulation. Requests arrive over time, take a slot in a
// StatePool and decode one token per step through every layer, by plain packed decode on one pool
// and by ReplaySSM (checkpoint + ring) on a second pool, on the same inputs. The demo checks that
// both paths agree, and reports their throughput and the bytes they move.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cli_args.h"
#include "cli_util.h"
#include "commands.h"

namespace deltastate::cli {

namespace {

constexpr double kForkProbability = 0.3;  // share of arrivals that hit the prefix cache
constexpr int64_t kConvKernel = 4;        // conv1d width: a slot keeps 3 window columns per layer

struct DemoOptions {
  std::string model = "small-gdn";
  int64_t requests = 12, steps = 40, replay_len = 8, seed = 1, layers = 2, batch = 8, threads = 0;
  std::string device = "cpu", state_dtype = "f32", act_dtype = "bf16";
};

// SGLang's test tolerance for ReplaySSM vs packed decode with L > 1:
// |replay - plain| <= atol + rtol * |plain|.
struct Tolerance {
  double atol, rtol;
};
Tolerance tolerance_for(DType state_dtype, DType act_dtype) {
  if (state_dtype == DType::f32 && act_dtype == DType::f32) return {1e-4, 1e-3};
  return {1e-3, 1e-2};
}

struct Request {
  int id = 0;
  int64_t arrival = 0;    // the step it arrives at
  int64_t remaining = 0;  // tokens left to decode
  int64_t slot = -1;      // its slot (the same in both pools); -1 until it joins
  int fork_source = -1;   // a prefix-cache hit: the request whose state it copies; else -1
};

// The plain pool and the ReplaySSM pool (same layout, plus rings). Both see the same allocate /
// free sequence, so a request holds the same slot in both.
class TwinPools {
 public:
  TwinPools(const StatePoolConfig& plain, const StatePoolConfig& replay)
      : plain_(plain), replay_(replay) {}
  int64_t allocate() {
    const int64_t slot = plain_.allocate();
    if (replay_.allocate() != slot)
      throw Error(ErrorKind::runtime, "demo: the pools' slots diverged");
    return slot;
  }
  void free(int64_t slot) {
    plain_.free(slot);
    replay_.free(slot);
  }
  // Prefix caching; the replay pool requires a flushed source (cursor 0).
  void fork(int64_t src, int64_t dst) {
    plain_.fork(src, dst);
    replay_.fork(src, dst);
  }
  StatePool& plain() { return plain_; }
  StatePool& replay() { return replay_; }

 private:
  StatePool plain_, replay_;
};

// One layer's gate parameters, this step's inputs and both paths' outputs.
struct LayerBuffers {
  DeviceBuffer A_log, dt_bias, mixed_qkv, a, b, out_plain, out_replay;
};

class Demo {
 public:
  explicit Demo(const DemoOptions& options);
  int run();

 private:
  StatePoolConfig pool_config(int64_t replay_len) const;
  void schedule_requests();
  int pick_fork_source();
  void admit(int64_t step, std::vector<std::string>& events);
  void build_batch(std::vector<std::string>& events);
  void warm_up();
  void generate_inputs();
  DecodeInputs layer_inputs(int64_t layer) const;
  void run_plain();
  void run_replay();
  void count_bytes();
  void compare_outputs();
  void retire(std::vector<std::string>& events);
  void print_header();
  bool print_summary() const;  // returns whether the paths agree

  // Views of this step's tensors.
  TensorView rows_i32(const DeviceBuffer& buf) const { return buf.view(DType::i32, {batch_}); }
  TensorView out_view(const DeviceBuffer& buf) const {
    return buf.view(act_dtype_, {batch_, 1, shape_.HV, shape_.V});
  }

  DemoOptions opt_;
  ModelShape shape_;
  Device device_;
  DType state_dtype_, act_dtype_;
  int64_t batch_;
  Tolerance tol_;
  ByteModel bytes_;
  TwinPools pools_;
  std::vector<LayerBuffers> layers_;
  DeviceBuffer row_slots_, row_cursors_, row_force_flush_;  // [batch] int32, the op's row inputs
  std::vector<int32_t> slots_, cursors_, force_flush_;      // host copies of the above
  std::vector<int32_t> pool_cursors_;                       // the pool's cursors, gathered per step
  Rng schedule_rng_, input_rng_;

  std::vector<Request> requests_;
  size_t next_arrival_ = 0;
  std::vector<int> active_;         // requests in the batch, in row order
  std::vector<int> pending_forks_;  // join next step, after their source's forced flush
  std::vector<int> flush_now_;      // fork sources to flush this step

  // Statistics.
  int64_t steps_run_ = 0, tokens_ = 0, rows_ = 0, forks_ = 0, finished_ = 0;
  double plain_bytes_ = 0, replay_bytes_ = 0;
  Stopwatch plain_time_, replay_time_;
  double max_abs_diff_ = 0, worst_ratio_ = 0, step_max_diff_ = 0;
  int64_t nonzero_padding_ = 0, nonfinite_ = 0, cursor_errors_ = 0;
};

Demo::Demo(const DemoOptions& options)
    : opt_(options),
      shape_(model_by_name(options.model)),
      device_(parse_device(options.device)),
      state_dtype_(dtype_by_name(options.state_dtype)),
      act_dtype_(dtype_by_name(options.act_dtype)),
      batch_(options.batch),
      tol_(tolerance_for(state_dtype_, act_dtype_)),
      bytes_{shape_, state_dtype_, act_dtype_},
      pools_(pool_config(0), pool_config(options.replay_len)),
      row_slots_(device_, 4 * batch_),
      row_cursors_(device_, 4 * batch_),
      row_force_flush_(device_, 4 * batch_),
      slots_(batch_),
      cursors_(batch_),
      force_flush_(batch_),
      schedule_rng_(options.seed),
      input_rng_(options.seed ^ 0x5eedf00dull) {
  Rng param_rng(options.seed + 1);
  const int64_t act = dtype_size(act_dtype_);
  for (int64_t l = 0; l < opt_.layers; ++l) {
    const LayerGateParams gate = random_gate_params(param_rng, shape_);
    LayerBuffers buf{
        DeviceBuffer(device_, 4 * shape_.HV),
        DeviceBuffer(device_, 4 * static_cast<int64_t>(gate.dt_bias.size())),
        DeviceBuffer(device_, act * batch_ * shape_.qkv_width()),
        DeviceBuffer(device_, act * batch_ * shape_.gate_width()),
        DeviceBuffer(device_, act * batch_ * shape_.HV),
        DeviceBuffer(device_, act * batch_ * shape_.HV * shape_.V),
        DeviceBuffer(device_, act * batch_ * shape_.HV * shape_.V),
    };
    copy_to_view(buf.A_log.view(DType::f32, {shape_.HV}), gate.A_log.data());
    copy_to_view(buf.dt_bias.view(DType::f32, {static_cast<int64_t>(gate.dt_bias.size())}),
                 gate.dt_bias.data());
    layers_.push_back(std::move(buf));
  }
  schedule_requests();
}

// Envelope layout: one entry per slot holds the slot's conv windows (bf16, every layer) and
// then every layer's recurrent state, as page-major engine pools do (SGLang's unified pools).
StatePoolConfig Demo::pool_config(int64_t replay_len) const {
  StatePoolConfig c;
  c.layers = opt_.layers;
  c.slots = batch_;
  c.HV = shape_.HV;
  c.V = shape_.V;
  c.K = shape_.K;
  c.state_dtype = state_dtype_;
  c.layout = PoolLayout::envelope;
  c.envelope_extra_bytes = opt_.layers * shape_.qkv_width() * (kConvKernel - 1) * 2;
  c.replay_len = replay_len;
  c.H = shape_.H;
  c.ring_k_dtype = act_dtype_;
  c.kda = shape_.kda;
  c.device = device_;
  return c;
}

// Arrivals spread over the first two thirds of the run; each wants steps/8 .. steps/2 tokens.
void Demo::schedule_requests() {
  const int64_t last_arrival = std::max<int64_t>(0, opt_.steps * 2 / 3 - 1);
  const int64_t min_tokens = std::max<int64_t>(1, opt_.steps / 8);
  const int64_t max_tokens = std::max<int64_t>(min_tokens, opt_.steps / 2);
  for (int i = 0; i < opt_.requests; ++i) {
    Request r;
    r.arrival = schedule_rng_.uniform_int(0, last_arrival);
    r.remaining = schedule_rng_.uniform_int(min_tokens, max_tokens);
    requests_.push_back(r);
  }
  std::stable_sort(requests_.begin(), requests_.end(),
                   [](const Request& x, const Request& y) { return x.arrival < y.arrival; });
  for (size_t i = 0; i < requests_.size(); ++i) requests_[i].id = static_cast<int>(i);
}

// A live request that is still live next step (so its slot can be forked then), or -1.
int Demo::pick_fork_source() {
  std::vector<int> candidates;
  for (int id : active_)
    if (requests_[id].remaining >= 2) candidates.push_back(id);
  if (candidates.empty()) return -1;
  return candidates[schedule_rng_.uniform_int(0, static_cast<int64_t>(candidates.size()) - 1)];
}

void Demo::admit(int64_t step, std::vector<std::string>& events) {
  // Forks whose source flushed last step join now, copying the source's state.
  for (int id : pending_forks_) {
    Request& r = requests_[id];
    const Request& source = requests_[r.fork_source];
    r.slot = pools_.allocate();
    pools_.fork(source.slot, r.slot);
    active_.push_back(id);
    ++forks_;
    events.push_back("fork r" + std::to_string(id) + "<-r" + std::to_string(source.id) + "@" +
                     std::to_string(r.slot));
  }
  pending_forks_.clear();

  // Arrivals, while the batch has room (a pending fork holds its row from now on).
  while (next_arrival_ < requests_.size() && requests_[next_arrival_].arrival <= step &&
         static_cast<int64_t>(active_.size() + pending_forks_.size()) < batch_) {
    Request& r = requests_[next_arrival_++];
    const bool hit = schedule_rng_.uniform() < kForkProbability;
    const int source = hit ? pick_fork_source() : -1;
    if (source >= 0) {  // the fork rule wants a flushed source: force its flush this step
      r.fork_source = source;
      pending_forks_.push_back(r.id);
      flush_now_.push_back(source);
    } else {
      r.slot = pools_.allocate();
      active_.push_back(r.id);
      events.push_back("+r" + std::to_string(r.id) + "@" + std::to_string(r.slot));
    }
  }
}

// Row n of the batch is active_[n]; rows past them are padding (slot -1). Each row's cursor is
// gathered from the pool's per-slot cursors.
void Demo::build_batch(std::vector<std::string>& events) {
  TensorView pool_cursor_view = pools_.replay().write_pos();
  pool_cursors_.resize(static_cast<size_t>(pool_cursor_view.numel()));
  copy_from_view(pool_cursors_.data(), pool_cursor_view);
  for (int64_t n = 0; n < batch_; ++n) {
    const bool live = n < static_cast<int64_t>(active_.size());
    const int id = live ? active_[n] : -1;
    const bool flush = live && std::count(flush_now_.begin(), flush_now_.end(), id) > 0;
    slots_[n] = live ? static_cast<int32_t>(requests_[id].slot) : -1;
    cursors_[n] = live ? pool_cursors_[slots_[n]] : 0;
    force_flush_[n] = flush ? 1 : 0;
    if (flush)
      events.push_back("flush r" + std::to_string(id) + "@" + std::to_string(slots_[n]) + "(wp " +
                       std::to_string(cursors_[n]) + ")");
  }
  copy_to_view(rows_i32(row_slots_), slots_.data());
  copy_to_view(rows_i32(row_cursors_), cursors_.data());
  copy_to_view(rows_i32(row_force_flush_), force_flush_.data());
}

// One untimed step of both paths with every row padded: it touches no state, ring or cursor,
// but takes one-time costs (thread start-up, CUDA module loading) out of the timings.
void Demo::warm_up() {
  std::fill(slots_.begin(), slots_.end(), -1);
  std::fill(cursors_.begin(), cursors_.end(), 0);
  std::fill(force_flush_.begin(), force_flush_.end(), 0);
  copy_to_view(rows_i32(row_slots_), slots_.data());
  copy_to_view(rows_i32(row_cursors_), cursors_.data());
  copy_to_view(rows_i32(row_force_flush_), force_flush_.data());
  run_plain();  // on the zeroed input buffers
  run_replay();
  synchronize(device_);
}

// N(0, 1) activations for every row, padding included (engines pad with garbage too); outputs
// pre-filled with NaN bytes so that an unwritten row shows.
void Demo::generate_inputs() {
  for (LayerBuffers& l : layers_) {
    copy_to_view(l.mixed_qkv.view(act_dtype_, {batch_, shape_.qkv_width()}),
                 encode(input_rng_.normal_vector(batch_ * shape_.qkv_width()), act_dtype_).data());
    copy_to_view(l.a.view(act_dtype_, {batch_, shape_.gate_width()}),
                 encode(input_rng_.normal_vector(batch_ * shape_.gate_width()), act_dtype_).data());
    copy_to_view(l.b.view(act_dtype_, {batch_, shape_.HV}),
                 encode(input_rng_.normal_vector(batch_ * shape_.HV), act_dtype_).data());
    l.out_plain.fill(0xff);
    l.out_replay.fill(0xff);
  }
}

DecodeInputs Demo::layer_inputs(int64_t layer) const {
  const LayerBuffers& buf = layers_[layer];
  DecodeInputs in;
  in.mixed_qkv = buf.mixed_qkv.view(act_dtype_, {batch_, shape_.qkv_width()});
  in.a = buf.a.view(act_dtype_, {batch_, shape_.gate_width()});
  in.b = buf.b.view(act_dtype_, {batch_, shape_.HV});
  in.A_log = buf.A_log.view(DType::f32, {shape_.HV});
  in.dt_bias = buf.dt_bias.view(DType::f32, {buf.dt_bias.bytes() / 4});
  in.scale = 1.0 / std::sqrt(static_cast<double>(shape_.K));
  return in;
}

void Demo::run_plain() {
  for (int64_t l = 0; l < opt_.layers; ++l) {
    PackedDecodeArgs args;
    layer_inputs(l).apply(args);
    args.state = pools_.plain().layer_state(l);
    args.out = out_view(layers_[l].out_plain);
    args.state_indices = rows_i32(row_slots_);
    args.round_beta_to_input = true;          // ReplaySSM rounds sigmoid(b) to b's dtype: match it
    if (shape_.kda) kda_packed_decode(args);  // standard gate: lower_bound unset
    else gdn_packed_decode(args);
  }
}

// The cursor is shared by all layers and advances once per step, so only the last layer's call
// advances the row cursors; every layer reads the same snapshot.
void Demo::run_replay() {
  for (int64_t l = 0; l < opt_.layers; ++l) {
    ReplayDecodeArgs args;
    layer_inputs(l).apply(args);
    args.state = pools_.replay().layer_state(l);
    args.d_cache = pools_.replay().d_cache(l);
    args.k_cache = pools_.replay().k_cache(l);
    args.g_cache = pools_.replay().g_cache(l);
    args.out = out_view(layers_[l].out_replay);
    args.state_indices = rows_i32(row_slots_);
    args.write_pos = rows_i32(row_cursors_);
    args.force_flush = rows_i32(row_force_flush_);
    args.is_kda = shape_.kda;
    args.advance_write_pos = l == opt_.layers - 1;
    replayssm_decode(args);
  }
}

void Demo::count_bytes() {
  for (size_t n = 0; n < active_.size(); ++n) {
    const bool flush = cursors_[n] == opt_.replay_len - 1 || force_flush_[n] != 0;
    plain_bytes_ += static_cast<double>(opt_.layers * bytes_.plain_decode());
    replay_bytes_ += static_cast<double>(opt_.layers * bytes_.replay_step(cursors_[n], flush));
  }
}

void Demo::compare_outputs() {
  const int64_t row = shape_.HV * shape_.V;
  const int64_t live = static_cast<int64_t>(active_.size());
  step_max_diff_ = 0;
  for (const LayerBuffers& l : layers_) {
    const std::vector<float> plain = read_floats(out_view(l.out_plain));
    const std::vector<float> replay = read_floats(out_view(l.out_replay));
    for (int64_t i = 0; i < batch_ * row; ++i) {
      const float p = plain[i], r = replay[i];
      if (i >= live * row) {  // padded row: both outputs must be exactly zero
        nonzero_padding_ += (p != 0.0f || r != 0.0f);
        continue;
      }
      if (!std::isfinite(p) || !std::isfinite(r)) {
        ++nonfinite_;
        continue;
      }
      const double diff = std::fabs(static_cast<double>(p) - r);
      step_max_diff_ = std::max(step_max_diff_, diff);
      worst_ratio_ = std::max(worst_ratio_, diff / (tol_.atol + tol_.rtol * std::fabs(p)));
    }
  }
  max_abs_diff_ = std::max(max_abs_diff_, step_max_diff_);
}

// Scatter the advanced row cursors back into the pool, then retire finished requests.
void Demo::retire(std::vector<std::string>& events) {
  std::vector<int32_t> advanced(static_cast<size_t>(batch_));
  copy_from_view(advanced.data(), rows_i32(row_cursors_));
  for (size_t n = 0; n < active_.size(); ++n) {
    const bool flushed = cursors_[n] == opt_.replay_len - 1 || force_flush_[n] != 0;
    cursor_errors_ += advanced[n] != (flushed ? 0 : cursors_[n] + 1);
    pool_cursors_[slots_[n]] = advanced[n];
  }
  copy_to_view(pools_.replay().write_pos(), pool_cursors_.data());

  tokens_ += static_cast<int64_t>(active_.size());
  rows_ += batch_;
  std::vector<int> still_active;
  for (int id : active_) {
    Request& r = requests_[id];
    if (--r.remaining > 0) {
      still_active.push_back(id);
      continue;
    }
    pools_.free(r.slot);
    ++finished_;
    events.push_back("done r" + std::to_string(id));
  }
  active_ = std::move(still_active);
  flush_now_.clear();
}

void Demo::print_header() {
  const int64_t conv_bytes = pools_.plain().config().envelope_extra_bytes;
  std::printf("deltastate demo: continuous batching, plain packed decode vs ReplaySSM (L=%lld)\n",
              static_cast<long long>(opt_.replay_len));
  std::printf(
      "  model   %s (%s), %lld layers, batch %lld rows, state %s, activations %s, "
      "device %s\n",
      shape_.name.c_str(), shape_.describe().c_str(), static_cast<long long>(opt_.layers),
      static_cast<long long>(batch_), dtype_short_name(state_dtype_), dtype_short_name(act_dtype_),
      to_string(device_).c_str());
  std::printf(
      "  pools   envelope layout, %lld slots: each slot's entry holds its conv windows "
      "(%s) then every layer's state (%lld x %s)\n",
      static_cast<long long>(batch_), format_bytes(conv_bytes).c_str(),
      static_cast<long long>(opt_.layers), format_bytes(bytes_.state_bytes()).c_str());
  std::printf("          plain pool %s; replay pool %s (same entries + d/k/g rings)\n",
              format_bytes(pools_.plain().total_bytes()).c_str(),
              format_bytes(pools_.replay().total_bytes()).c_str());
  std::printf(
      "  events  +rN@S arrives in slot S; flush rN@S(wp M) forced flush of a fork source "
      "with M ring records; fork rN<-rM@S prefix-cache copy of rM into slot S; done rN\n");
}

bool Demo::print_summary() const {
  const bool agree = worst_ratio_ <= 1.0 && nonzero_padding_ == 0 && nonfinite_ == 0 &&
                     cursor_errors_ == 0 && tokens_ > 0;
  std::printf("summary\n");
  std::printf(
      "  requests   %lld arrived (%lld by prefix-cache fork), %lld finished; %lld tokens "
      "in %lld steps; %lld of %lld rows padded\n",
      static_cast<long long>(next_arrival_), static_cast<long long>(forks_),
      static_cast<long long>(finished_), static_cast<long long>(tokens_),
      static_cast<long long>(steps_run_), static_cast<long long>(rows_ - tokens_),
      static_cast<long long>(rows_));
  std::printf(
      "  agreement  max |replay - plain| = %.3g; worst |diff| / (atol + rtol*|plain|) = "
      "%.3g with atol %g, rtol %g (SGLang's ReplaySSM test tolerance)\n",
      max_abs_diff_, worst_ratio_, tol_.atol, tol_.rtol);
  std::printf(
      "             padded rows nonzero: %lld, non-finite outputs: %lld, cursor "
      "errors: %lld -> %s\n",
      static_cast<long long>(nonzero_padding_), static_cast<long long>(nonfinite_),
      static_cast<long long>(cursor_errors_), agree ? "AGREE" : "DISAGREE");
  std::printf("  %-22s %10s %12s %12s %11s\n", "path", "op time", "tokens/s", "bytes moved",
              "bytes/s");
  const auto line = [&](const char* name, double seconds, double bytes) {
    std::printf("  %-22s %7.1f ms %12.0f %12s %9s/s\n", name, seconds * 1e3,
                static_cast<double>(tokens_) / seconds, format_bytes(bytes).c_str(),
                format_bytes(bytes / seconds).c_str());
  };
  const std::string replay_name = "replayssm (L=" + std::to_string(opt_.replay_len) + ")";
  line(shape_.kda ? "kda_packed_decode" : "gdn_packed_decode", plain_time_.total(), plain_bytes_);
  line(replay_name.c_str(), replay_time_.total(), replay_bytes_);
  // Both facts on one line: fewer bytes is not faster where the bytes are not the bound.
  const double speed = plain_time_.total() / replay_time_.total();  // replay tokens/s over plain's
  std::printf("  ReplaySSM moves %.2fx fewer bytes than packed decode, at %.2fx its tokens/s%s\n",
              plain_bytes_ / replay_bytes_, speed,
              device_.type == DeviceType::cpu && speed < 1.0
                  ? " (on the CPU both are compute-bound, not memory-bound: the ring's extra "
                    "arithmetic costs more time than its fewer bytes save)"
                  : "");
  return agree;
}

int Demo::run() {
  print_header();
  warm_up();
  const int64_t report_every = std::max<int64_t>(1, opt_.steps / 10);
  for (int64_t step = 0; step < opt_.steps; ++step) {
    std::vector<std::string> events;
    admit(step, events);
    if (active_.empty() && pending_forks_.empty() && next_arrival_ == requests_.size()) break;
    ++steps_run_;
    build_batch(events);
    generate_inputs();

    synchronize(device_);
    plain_time_.start();
    run_plain();
    synchronize(device_);
    plain_time_.stop();
    replay_time_.start();
    run_replay();
    synchronize(device_);
    replay_time_.stop();

    count_bytes();
    compare_outputs();
    const size_t live = active_.size();
    retire(events);
    if (!events.empty() || step % report_every == 0 || step == opt_.steps - 1) {
      std::string joined;
      for (const std::string& e : events) joined += " " + e;
      std::printf("step %4lld  active %2zu/%lld  max|diff| %.2e %s\n", static_cast<long long>(step),
                  live, static_cast<long long>(batch_), step_max_diff_, joined.c_str());
    }
  }
  return print_summary() ? 0 : 1;
}

}  // namespace

int run_demo(const std::vector<std::string>& args) {
  DemoOptions o;
  ArgParser parser("demo",
                   "Continuous-batching simulation: requests take slots in a StatePool and decode "
                   "through plain packed decode and ReplaySSM side by side; exits 0 when both "
                   "agree, 1 when not.");
  parser.add_choice("model", &o.model, model_names(), "layer shape");
  parser.add_int("requests", &o.requests, 1, 100000, "requests to simulate");
  parser.add_int("steps", &o.steps, 1, 1000000, "decode steps");
  parser.add_int("replay-len", &o.replay_len, 1, 1024, "ReplaySSM ring length L");
  parser.add_choice("device", &o.device, {"cpu", "cuda"}, "where the pools and ops run");
  parser.add_int("seed", &o.seed, 0, INT64_MAX, "random seed (inputs and schedule)");
  parser.add_choice("state-dtype", &o.state_dtype, float_dtype_names(), "state pool dtype");
  parser.add_choice("act-dtype", &o.act_dtype, float_dtype_names(),
                    "activation dtype (mixed_qkv, a, b, out, k ring)");
  parser.add_int("layers", &o.layers, 1, 256, "linear-attention layers");
  parser.add_int("batch", &o.batch, 1, 4096, "rows per step (= pool slots)");
  parser.add_int("threads", &o.threads, 0, 1024, "CPU threads (0: the library's default)");
  if (!parser.parse(args)) return 0;
  set_cpu_threads(o.threads);
  return Demo(o).run();
}

}  // namespace deltastate::cli
