// The streaming decode kernel's per-tile timeline (a trace build: cmake
// -DDELTASTATE_CUDA_STREAM_TRACE=ON; scripts/device.sh trace-stream). One decode step, bf16 state
// and inputs, in place on a pool of random slots, the same shapes as bench/bench_decode.py; then,
// from the SM-clock stamps of every traced tile (src/cuda/stream_trace.h), percentiles of each
// stage of the pipeline:
//
//   stream_trace [--model qwen3-next|kimi-linear] [--B 256] [--slots 4096] [--launches 8]
//                [--state bf16|f32] [--order random|sequential] [--reps 50]
//
// It also times --reps launches (each on the next of --launches slot sets, event-timed, median):
// --order sequential gives launch l the slots l*B .. l*B+B-1 in order (the state of one launch
// one contiguous block, as a kernel without indices reads it), random a shuffle of the pool.
// --state f32 runs the register decode kernel (no trace; timing only).
//
// Where a tile's stage spends its time decides what would raise the bytes in flight: the producer
// (waiting for a free stage, preparing the token), the bulk load (issued to full), the consumers,
// or the store (done to store issued, store issued to the stage free again).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "cuda/stream_trace.h"
#include "cuda_timing.h"
#include "deltastate/deltastate.h"

namespace {

using namespace deltastate;
using cuda_backend::kStreamTraceCtas;
using cuda_backend::kStreamTracePoints;
using cuda_backend::kStreamTraceTiles;
using Pt = cuda_backend::StreamTracePoint;

using bench::check;

void* device_bf16(const std::vector<float>& host) {
  std::vector<uint16_t> h(host.size());
  for (size_t i = 0; i < host.size(); ++i) h[i] = detail::float_to_bf16(host[i]);
  void* d = nullptr;
  check(cudaMalloc(&d, h.size() * 2), "cudaMalloc");
  check(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  return d;
}

struct Summary {
  const char* name;
  std::vector<double> v;
};

void print(const Summary& s, double cycles_per_us) {
  if (s.v.empty()) return;
  std::vector<double> v = s.v;
  std::sort(v.begin(), v.end());
  auto q = [&](double f) { return v[static_cast<size_t>(f * (v.size() - 1))]; };
  const double mean = std::accumulate(v.begin(), v.end(), 0.0) / v.size();
  std::printf("%-44s %8zu %9.0f %9.0f %9.0f %9.0f %9.3f\n", s.name, v.size(), q(0.1), q(0.5),
              q(0.9), mean, mean / cycles_per_us);
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "qwen3-next", state = "bf16", order = "random";
  int B = 256, launches = 8, reps = 50;
  int64_t slots = 4096;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--model") model = argv[i + 1];
    else if (a == "--B") B = std::atoi(argv[i + 1]);
    else if (a == "--slots") slots = std::atoll(argv[i + 1]);
    else if (a == "--launches") launches = std::atoi(argv[i + 1]);
    else if (a == "--state") state = argv[i + 1];
    else if (a == "--order") order = argv[i + 1];
    else if (a == "--reps") reps = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr,
                   "usage: stream_trace [--model qwen3-next|kimi-linear] [--B n] [--slots n] "
                   "[--launches n] [--state bf16|f32] [--order random|sequential] [--reps n]\n");
      return 2;
    }
  }
  const bool kda = model == "kimi-linear";
  const bool f32 = state == "f32";
  const DType sdt = f32 ? DType::f32 : DType::bf16;
  const int64_t esize = f32 ? 4 : 2;
  if (!kda && model != "qwen3-next") {
    std::fprintf(stderr, "stream_trace: unknown model %s\n", model.c_str());
    return 2;
  }
  const int64_t H = kda ? 32 : 16, HV = 32, K = 128, V = 128;
  if (slots < static_cast<int64_t>(B) * launches) slots = static_cast<int64_t>(B) * launches;
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  auto random = [&](int64_t n, float scale, float offset) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = offset + scale * uni(rng);
    return v;
  };

  // The pool (zeros: the timing does not depend on the values), inputs, and one set of distinct
  // random slots per launch, so that every launch reads state that is not in L2.
  void* pool = nullptr;
  const size_t pool_bytes = static_cast<size_t>(slots) * HV * V * K * esize;
  check(cudaMalloc(&pool, pool_bytes), "cudaMalloc(pool)");
  check(cudaMemset(pool, 0, pool_bytes), "cudaMemset(pool)");
  void* q = device_bf16(random(B * H * K, 1.0f, 0.0f));
  void* k = device_bf16(random(B * H * K, 1.0f, 0.0f));
  void* v = device_bf16(random(B * HV * V, 1.0f, 0.0f));
  void* g = device_bf16(random(B * HV * (kda ? K : 1), 0.02f, -0.05f));
  void* beta = device_bf16(random(B * HV, 0.2f, 0.5f));
  void* out = nullptr;
  check(cudaMalloc(&out, static_cast<size_t>(B) * HV * V * 2), "cudaMalloc(out)");
  std::vector<int32_t> perm(static_cast<size_t>(slots));
  std::iota(perm.begin(), perm.end(), 0);
  if (order == "random") std::shuffle(perm.begin(), perm.end(), rng);
  int32_t* idx = nullptr;
  check(cudaMalloc(&idx, static_cast<size_t>(B) * launches * 4), "cudaMalloc(indices)");
  check(cudaMemcpy(idx, perm.data(), static_cast<size_t>(B) * launches * 4, cudaMemcpyHostToDevice),
        "cudaMemcpy(indices)");

  const Device dev = Device::cuda(0);
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");
  auto launch = [&](int l) {
    RecurrentArgs a;
    a.q = TensorView::contiguous(q, DType::bf16, {B, 1, H, K}, dev);
    a.k = TensorView::contiguous(k, DType::bf16, {B, 1, H, K}, dev);
    a.v = TensorView::contiguous(v, DType::bf16, {B, 1, HV, V}, dev);
    a.g = kda ? TensorView::contiguous(g, DType::bf16, {B, 1, HV, K}, dev)
              : TensorView::contiguous(g, DType::bf16, {B, 1, HV}, dev);
    a.beta = TensorView::contiguous(beta, DType::bf16, {B, 1, HV}, dev);
    a.out = TensorView::contiguous(out, DType::bf16, {B, 1, HV, V}, dev);
    a.state = TensorView::contiguous(pool, sdt, {slots, HV, V, K}, dev);
    a.state_indices =
        TensorView::contiguous(idx + static_cast<int64_t>(l) * B, DType::i32, {B}, dev);
    a.stream = stream;
    if (kda) recurrent_kda(a);
    else recurrent_gdn(a);
  };
  for (int l = 0; l + 1 < launches; ++l) launch(l);
  check(cudaStreamSynchronize(stream), "warm-up");
  cuda_backend::stream_trace_reset();
  const double us = bench::median_us([&](int) { launch(launches - 1); }, 1, 0, stream);  // traced
  const std::vector<long long> tr = cuda_backend::stream_trace_read();

  // Timing: reps launches rotating over the slot sets, each event-timed, median.
  if (reps > 0) {
    const double t = bench::median_us([&](int r) { launch(r % launches); }, reps, 0, stream);
    const double state_bytes = 2.0 * B * HV * V * K * esize;
    std::printf(
        "# timing: %s %s state, B=%d, %s slots: median %.2f us over %d launches (state "
        "read + write %.1f MB: %.0f GB/s)\n",
        model.c_str(), state.c_str(), B, order.c_str(), t, reps, state_bytes / 1e6,
        state_bytes / (t * 1e3));
  }

  auto at = [&](int c, int i, Pt p) {
    return tr[(static_cast<size_t>(c) * kStreamTraceTiles + i) * kStreamTracePoints +
              static_cast<int>(p)];
  };
  constexpr int kStages = cuda_backend::kStreamTraceStages;  // tile i + kStages refills i's stage
  Summary period{"producer: enter to next enter"}, wait_stage{"producer: enter to stage free"},
      prep{"producer: stage free (load out) to prepared"},
      load{"stage free (load out) to consumer full"}, cons_wait{"consumer: wait to full"},
      compute{"consumer: full to done"}, to_store{"consumer done to store issued"},
      store_cycle{"store issued to stage free again"},
      stage_cycle{"stage: free to free again (its next tile)"},
      span{"CTA: first enter to last store"};
  int ctas = 0;
  long long tiles = 0;
  for (int c = 0; c < kStreamTraceCtas; ++c) {
    if (at(c, 0, Pt::producer_enter) == 0) continue;
    ++ctas;
    int n = 0;
    while (n < kStreamTraceTiles && at(c, n, Pt::consumer_done) != 0) ++n;
    tiles += n;
    for (int i = 0; i < n; ++i) {
      auto d = [&](Pt a, Pt b) { return static_cast<double>(at(c, i, b) - at(c, i, a)); };
      if (i + 1 < n)
        period.v.push_back(at(c, i + 1, Pt::producer_enter) - at(c, i, Pt::producer_enter));
      wait_stage.v.push_back(d(Pt::producer_enter, Pt::stage_free));
      prep.v.push_back(d(Pt::stage_free, Pt::prepared));
      load.v.push_back(d(Pt::stage_free, Pt::consumer_full));
      cons_wait.v.push_back(d(Pt::consumer_wait, Pt::consumer_full));
      compute.v.push_back(d(Pt::consumer_full, Pt::consumer_done));
      to_store.v.push_back(d(Pt::consumer_done, Pt::store_issued));
      if (i + kStages < n) {
        store_cycle.v.push_back(at(c, i + kStages, Pt::stage_free) - at(c, i, Pt::store_issued));
        stage_cycle.v.push_back(at(c, i + kStages, Pt::stage_free) - at(c, i, Pt::stage_free));
      }
    }
    if (n > 0) span.v.push_back(at(c, n - 1, Pt::store_issued) - at(c, 0, Pt::producer_enter));
  }
  if (ctas == 0) {
    std::printf(
        "# no traced tiles (the streaming kernel runs bf16 states from 512 (sequence, "
        "head) pairs for GDN, 32 for KDA; DELTASTATE_CUDA_DECODE=stream forces it)\n");
    return 0;
  }
  // Cycles per microsecond: the longest traced CTA span over the launch's event time (a lower
  // bound on the SM clock: the launch also has its ramp and its tail).
  const double cycles_per_us = *std::max_element(span.v.begin(), span.v.end()) / us;
  std::printf(
      "# stream_trace: %s %s, B=%d, pool of %lld slots; traced launch %.1f us (one launch, "
      "event-timed), %d CTAs traced, %lld tiles\n",
      model.c_str(), state.c_str(), B, static_cast<long long>(slots), us, ctas, tiles);
  std::printf(
      "# SM cycles; the us column converts the mean at %.0f cycles/us (longest traced CTA span "
      "/ launch time)\n",
      cycles_per_us);
  std::printf("%-44s %8s %9s %9s %9s %9s %9s\n", "interval", "n", "p10", "p50", "p90", "mean",
              "mean us");
  for (const Summary* s : {&period, &wait_stage, &prep, &load, &cons_wait, &compute, &to_store,
                           &store_cycle, &stage_cycle, &span})
    print(*s, cycles_per_us);
  return 0;
}
