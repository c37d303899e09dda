// prefill_timing: CPU prefill throughput, chunk_prefill against the recurrent op on the same
// inputs (one sequence, bf16 q/k/v/gates/beta, gate and beta sigmoid in the kernel, q/k L2 norm
// in the op, an fp32 state in a one-slot pool updated in place). GDN at the Qwen3-Next shape
// (H=16, HV=32, K=V=128), KDA at the Kimi-Linear shape (H=HV=32, K=V=128, lower_bound -5).
// Prints tokens/s of both (the median of --iters calls after one warm-up call).
//   prefill_timing [--tokens T] [--iters n] [--ops gdn,kda]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "deltastate/deltastate.h"

namespace {

using namespace deltastate;

uint16_t bf16_bits(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// 256-byte aligned host memory (recurrent_kda's state contract wants 32).
struct Buffer {
  std::shared_ptr<uint8_t> mem;
  int64_t n;
  DType dtype;
  Buffer(DType d, int64_t count) : n(count), dtype(d) {
    const size_t bytes =
        static_cast<size_t>((std::max<int64_t>(n * dtype_size(d), 1) + 255) / 256 * 256);
    mem.reset(static_cast<uint8_t*>(std::aligned_alloc(256, bytes)), std::free);
    std::memset(mem.get(), 0, bytes);
  }
  TensorView view(std::initializer_list<int64_t> shape) {
    return TensorView::contiguous(mem.get(), dtype, shape);
  }
  void fill(std::mt19937_64& rng, double lo, double hi, bool normal = false) {
    std::uniform_real_distribution<float> u(static_cast<float>(lo), static_cast<float>(hi));
    std::normal_distribution<float> g(0.0f, 1.0f);
    for (int64_t i = 0; i < n; ++i) {
      const float x = normal ? g(rng) : u(rng);
      if (dtype == DType::bf16) reinterpret_cast<uint16_t*>(mem.get())[i] = bf16_bits(x);
      else reinterpret_cast<float*>(mem.get())[i] = x;
    }
  }
};

struct Shape {
  const char* name;
  bool kda;
  int64_t H, HV, K, V;
};

template <class F>
double median_seconds(int iters, F&& call) {
  call();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    call();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void run(const Shape& s, int64_t T, int iters) {
  std::mt19937_64 rng(2048);
  const DType act = DType::bf16;
  const int64_t gw = s.kda ? s.HV * s.K : s.HV;
  Buffer q(act, T * s.H * s.K), k(act, T * s.H * s.K), v(act, T * s.HV * s.V), g(act, T * gw),
      beta(act, T * s.HV), out(act, T * s.HV * s.V), A_log(DType::f32, s.HV),
      dt_bias(DType::f32, gw), state(DType::f32, s.HV * s.V * s.K), cu(DType::i32, 2),
      idx(DType::i32, 1);
  q.fill(rng, 0, 0, true);
  k.fill(rng, 0, 0, true);
  v.fill(rng, -0.5, 0.5);
  g.fill(rng, 0, 0, true);
  beta.fill(rng, 0, 0, true);
  A_log.fill(rng, -2.0, 0.5);
  dt_bias.fill(rng, -1.0, 1.0);
  state.fill(rng, -0.3, 0.3);
  reinterpret_cast<int32_t*>(cu.mem.get())[1] = static_cast<int32_t>(T);
  const TensorView gv = s.kda ? g.view({1, T, s.HV, s.K}) : g.view({1, T, s.HV});

  ChunkPrefillArgs c;
  c.q = q.view({1, T, s.H, s.K});
  c.k = k.view({1, T, s.H, s.K});
  c.v = v.view({1, T, s.HV, s.V});
  c.g = gv;
  c.beta = beta.view({1, T, s.HV});
  c.out = out.view({1, T, s.HV, s.V});
  c.is_kda = s.kda;
  c.gate_in_kernel = true;
  c.A_log = A_log.view({s.HV});
  c.dt_bias = dt_bias.view({gw});
  if (s.kda) c.lower_bound = -5.0;
  c.beta_is_logit = true;
  c.cu_seqlens = cu.view({2});
  c.initial_state = state.view({1, s.HV, s.V, s.K});
  c.initial_state_indices = idx.view({1});
  Buffer ws(DType::f32, (chunk_prefill_workspace_bytes(c) + 3) / 4);
  c.workspace = ws.view({ws.n});

  RecurrentArgs r;
  r.q = c.q;
  r.k = c.k;
  r.v = c.v;
  r.g = c.g;
  r.beta = c.beta;
  r.out = c.out;
  r.A_log = c.A_log;
  r.dt_bias = c.dt_bias;
  r.gate_in_kernel = true;
  r.lower_bound = c.lower_bound;
  r.beta_is_logit = true;
  r.cu_seqlens = c.cu_seqlens;
  r.state = c.initial_state;
  r.state_indices = c.initial_state_indices;

  // Both update the state in place; a fixed decaying state keeps the values bounded call to call.
  const double chunk_s = median_seconds(iters, [&] { chunk_prefill(c); });
  const double rec_s = median_seconds(iters, [&] {
    if (s.kda) recurrent_kda(r);
    else recurrent_gdn(r);
  });
  std::printf(
      "%-4s %-10s H=%lld HV=%lld K=%lld V=%lld T=%lld: chunk_prefill %9.0f tok/s (%.3f s)   "
      "recurrent %9.0f tok/s (%.3f s)   x%.2f\n",
      s.kda ? "kda" : "gdn", s.name, static_cast<long long>(s.H), static_cast<long long>(s.HV),
      static_cast<long long>(s.K), static_cast<long long>(s.V), static_cast<long long>(T),
      T / chunk_s, chunk_s, T / rec_s, rec_s, rec_s / chunk_s);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t T = 2048;
  int iters = 3;
  std::string ops = "gdn,kda";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--tokens") T = std::atoll(argv[i + 1]);
    else if (a == "--iters") iters = std::atoi(argv[i + 1]);
    else if (a == "--ops") ops = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: prefill_timing [--tokens T] [--iters n] [--ops gdn,kda]\n");
      return 2;
    }
  }
  const char* threads = std::getenv("DELTASTATE_NUM_THREADS");
  std::printf("CPU threads: %s\n", threads ? threads : "hardware concurrency");
  if (ops.find("gdn") != std::string::npos) run({"qwen3next", false, 16, 32, 128, 128}, T, iters);
  if (ops.find("kda") != std::string::npos) run({"kimi", true, 32, 32, 128, 128}, T, iters);
  return 0;
}
