// The CPU backend's results are the same bits for any thread count, any batch composition and any
// of the vector ISAs the CPU has (src/cpu/simd.h): one sequence run alone on one thread is the
// baseline; the same sequence inside batches of other sequences (before and after it, of other
// lengths), on 2, 3 and 7 threads (row blocks of 16 rows then split its heads) and with each ISA
// must give identical output rows and states (ReplaySSM: its outputs over 11 steps of appends and
// flushes, then its checkpoint and rings). Shapes with K and V not multiples of 16 exercise the
// vector tails.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "cpu/simd.h"
#include "cpu/thread_pool.h"
#include "deltastate/deltastate.h"

namespace {

using namespace deltastate;

constexpr int64_t kH = 2, kHV = 4, kV = 48;
// K: 72 (vector tails) or 128 (the register-resident rows of K = 64 / 128); set by each test.
int64_t kK = 72;

// Elements of one dtype, 256-byte aligned (the pools' stride contract wants 32).
struct Buf {
  std::vector<uint8_t> mem;
  uint8_t* base;
  DType dtype;
  int64_t n;
  Buf(DType d, int64_t count)
      : mem(static_cast<size_t>(count * dtype_size(d) + 256)), dtype(d), n(count) {
    const auto addr = reinterpret_cast<uintptr_t>(mem.data());
    base = mem.data() + (256 - addr % 256) % 256;
  }
  void* data() const { return base; }
  TensorView view(std::initializer_list<int64_t> shape) {
    return TensorView::contiguous(base, dtype, shape);
  }
  void set(int64_t i, float x) {
    if (dtype == DType::bf16) static_cast<uint16_t*>(data())[i] = detail::float_to_bf16(x);
    else if (dtype == DType::i32) static_cast<int32_t*>(data())[i] = static_cast<int32_t>(x);
    else static_cast<float*>(data())[i] = x;
  }
  std::vector<uint8_t> bytes(int64_t first, int64_t count) const {
    const uint8_t* p = base + first * dtype_size(dtype);
    return std::vector<uint8_t>(p, p + count * dtype_size(dtype));
  }
};

// Sequence `id`'s tokens: fixed by its id alone, whatever batch it is put in.
struct Sequence {
  int64_t len;
  std::vector<float> q, k, v, g, beta, state;
};

Sequence make_sequence(int id, int64_t len, bool kda) {
  std::mt19937_64 rng(1000 + id);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(-0.3f, 0.3f);
  Sequence s;
  s.len = len;
  auto fill = [&](std::vector<float>& x, int64_t count, bool normal) {
    x.resize(static_cast<size_t>(count));
    for (float& e : x) e = normal ? n(rng) : u(rng);
  };
  fill(s.q, len * kH * kK, true);
  fill(s.k, len * kH * kK, true);
  fill(s.v, len * kHV * kV, false);
  fill(s.g, len * kHV * (kda ? kK : 1), true);
  fill(s.beta, len * kHV, true);
  fill(s.state, kHV * kV * kK, false);
  return s;
}

// What one sequence produced: its output rows and its state after the call.
struct Result {
  std::vector<uint8_t> out, state;
  bool operator==(const Result& o) const { return out == o.out && state == o.state; }
};

enum class Op { recurrent, chunk_prefill };

// Runs `op` on the sequences `seqs` as one varlen batch (slot i holds sequence i's state) and
// returns the result of sequence `which`.
Result run(Op op, bool kda, DType state_dtype, const std::vector<Sequence>& seqs, size_t which) {
  const int64_t N = static_cast<int64_t>(seqs.size());
  int64_t T = 0;
  std::vector<int64_t> starts;
  for (const Sequence& s : seqs) {
    starts.push_back(T);
    T += s.len;
  }
  const int64_t gw = kda ? kK : 1;
  const DType act = DType::bf16;
  Buf q(act, T * kH * kK), k(act, T * kH * kK), v(act, T * kHV * kV), g(act, T * kHV * gw),
      beta(act, T * kHV), out(act, T * kHV * kV), A_log(DType::f32, kHV),
      dt_bias(DType::f32, kHV * gw), state(state_dtype, N * kHV * kV * kK), cu(DType::i32, N + 1),
      idx(DType::i32, N);
  for (int64_t i = 0; i < kHV; ++i) A_log.set(i, -0.5f + 0.1f * static_cast<float>(i));
  for (int64_t i = 0; i < kHV * gw; ++i) dt_bias.set(i, 0.01f * static_cast<float>(i % 7));
  for (int64_t n = 0; n < N; ++n) {
    const Sequence& s = seqs[n];
    const int64_t t0 = starts[n];
    auto put = [&](Buf& b, const std::vector<float>& x, int64_t per_token) {
      for (int64_t i = 0; i < static_cast<int64_t>(x.size()); ++i) b.set(t0 * per_token + i, x[i]);
    };
    put(q, s.q, kH * kK);
    put(k, s.k, kH * kK);
    put(v, s.v, kHV * kV);
    put(g, s.g, kHV * gw);
    put(beta, s.beta, kHV);
    for (int64_t i = 0; i < kHV * kV * kK; ++i) state.set(n * kHV * kV * kK + i, s.state[i]);
    cu.set(n, static_cast<float>(t0));
    idx.set(n, static_cast<float>(n));
  }
  cu.set(N, static_cast<float>(T));
  const TensorView gv = kda ? g.view({1, T, kHV, kK}) : g.view({1, T, kHV});

  if (op == Op::recurrent) {
    RecurrentArgs r;
    r.q = q.view({1, T, kH, kK});
    r.k = k.view({1, T, kH, kK});
    r.v = v.view({1, T, kHV, kV});
    r.g = gv;
    r.beta = beta.view({1, T, kHV});
    r.out = out.view({1, T, kHV, kV});
    r.A_log = A_log.view({kHV});
    r.dt_bias = dt_bias.view({kHV * gw});
    r.gate_in_kernel = true;
    if (kda) r.lower_bound = -5.0;
    r.beta_is_logit = true;
    r.cu_seqlens = cu.view({N + 1});
    r.state = state.view({N, kHV, kV, kK});
    r.state_indices = idx.view({N});
    if (kda) recurrent_kda(r);
    else recurrent_gdn(r);
  } else {
    ChunkPrefillArgs c;
    c.q = q.view({1, T, kH, kK});
    c.k = k.view({1, T, kH, kK});
    c.v = v.view({1, T, kHV, kV});
    c.g = gv;
    c.beta = beta.view({1, T, kHV});
    c.out = out.view({1, T, kHV, kV});
    c.is_kda = kda;
    c.gate_in_kernel = true;
    c.A_log = A_log.view({kHV});
    c.dt_bias = dt_bias.view({kHV * gw});
    if (kda) c.lower_bound = -5.0;
    c.beta_is_logit = true;
    c.cu_seqlens = cu.view({N + 1});
    c.initial_state = state.view({N, kHV, kV, kK});
    c.initial_state_indices = idx.view({N});
    Buf ws(DType::f32, (chunk_prefill_workspace_bytes(c) + 3) / 4);
    c.workspace = ws.view({ws.n});
    chunk_prefill(c);
  }
  const Sequence& s = seqs[which];
  return {out.bytes(starts[which] * kHV * kV, s.len * kHV * kV),
          state.bytes(static_cast<int64_t>(which) * kHV * kV * kK, kHV * kV * kK)};
}

// ReplaySSM over 4 slots (L = 4, 11 steps: appends and flushes): rows `slots` each step, slot s's
// token of step i fixed by (s, i) alone. Returns slot 2's outputs over the steps, then its
// checkpoint and rings after them.
Result run_replay(bool kda, const std::vector<int>& slots) {
  constexpr int64_t kSlots = 4, kL = 4, kSteps = 11;
  const int64_t B = static_cast<int64_t>(slots.size());
  const int64_t W = 2 * kH * kK + kHV * kV, gw = kda ? kK : 1;
  Buf state(DType::f32, kSlots * kHV * kV * kK), d_cache(DType::f32, kSlots * kHV * kL * kV),
      k_cache(DType::bf16, kSlots * kH * kL * kK), g_cache(DType::f32, kSlots * kHV * kL * gw),
      qkv(DType::bf16, B * W), a(DType::bf16, B * kHV * gw), b(DType::bf16, B * kHV),
      out(DType::bf16, B * kHV * kV), A_log(DType::f32, kHV), dt_bias(DType::f32, kHV * gw),
      idx(DType::i32, B), pos(DType::i32, B);
  std::mt19937_64 init(7);
  std::uniform_real_distribution<float> u(-0.3f, 0.3f);
  for (int64_t i = 0; i < state.n; ++i) state.set(i, u(init));
  for (int64_t i = 0; i < kHV; ++i) A_log.set(i, -0.5f + 0.1f * static_cast<float>(i));
  for (int64_t i = 0; i < kHV * gw; ++i) dt_bias.set(i, 0.01f * static_cast<float>(i % 7));
  int64_t row_of_2 = -1;
  for (int64_t r = 0; r < B; ++r) {
    idx.set(r, static_cast<float>(slots[r]));
    pos.set(r, 0.0f);
    if (slots[r] == 2) row_of_2 = r;
  }
  ReplayDecodeArgs args;
  args.mixed_qkv = qkv.view({B, W});
  args.a = kda ? a.view({B, kHV * kK}) : a.view({B, kHV});
  args.b = b.view({B, kHV});
  args.A_log = A_log.view({kHV});
  args.dt_bias = dt_bias.view({kHV * gw});
  args.state = state.view({kSlots, kHV, kV, kK});
  args.d_cache = d_cache.view({kSlots, kHV, kL, kV});
  args.k_cache = k_cache.view({kSlots, kH, kL, kK});
  args.g_cache = kda ? g_cache.view({kSlots, kHV, kL, kK}) : g_cache.view({kSlots, kHV, kL});
  args.out = out.view({B, 1, kHV, kV});
  args.state_indices = idx.view({B});
  args.write_pos = pos.view({B});
  args.is_kda = kda;
  if (kda) args.lower_bound = -5.0;
  args.advance_write_pos = true;
  Result r;
  for (int64_t step = 0; step < kSteps; ++step) {
    for (int64_t row = 0; row < B; ++row) {
      std::mt19937_64 rng(100 * slots[row] + step);
      std::normal_distribution<float> n(0.0f, 1.0f);
      for (int64_t i = 0; i < W; ++i) qkv.set(row * W + i, i < 2 * kH * kK ? n(rng) : u(rng));
      for (int64_t i = 0; i < kHV * gw; ++i) a.set(row * kHV * gw + i, n(rng));
      for (int64_t i = 0; i < kHV; ++i) b.set(row * kHV + i, n(rng));
    }
    replayssm_decode(args);
    const std::vector<uint8_t> o = out.bytes(row_of_2 * kHV * kV, kHV * kV);
    r.out.insert(r.out.end(), o.begin(), o.end());
  }
  for (const Buf* x : {&state, &d_cache, &k_cache, &g_cache}) {
    const int64_t per_slot = x->n / kSlots;
    const std::vector<uint8_t> bytes = x->bytes(2 * per_slot, per_slot);
    r.state.insert(r.state.end(), bytes.begin(), bytes.end());
  }
  return r;
}

TEST(CpuDeterminism, ReplaySameBitsForAnyThreadsBatchAndIsa) {
  const std::string default_isa = cpu::simd::kernels().isa;
  for (int64_t K : {72, 128})
    for (bool kda : {false, true}) {
      kK = K;
      cpu::set_num_threads(1);
      cpu::simd::set_isa(default_isa.c_str());
      const Result want = run_replay(kda, {2});
      for (const char* isa : {"avx512", "avx2", "portable"}) {
        if (!cpu::simd::set_isa(isa)) continue;
        for (int threads : {1, 2, 3, 7}) {
          cpu::set_num_threads(threads);
          EXPECT_TRUE(run_replay(kda, {2}) == want) << (kda ? "KDA" : "GDN") << " K=" << K
                                                    << " alone, " << threads << " threads, " << isa;
          EXPECT_TRUE(run_replay(kda, {0, 3, 2, 1}) == want)
              << (kda ? "KDA" : "GDN") << " K=" << K << " in a batch of 4, " << threads
              << " threads, " << isa;
        }
      }
    }
  kK = 72;
  cpu::set_num_threads(0);
  cpu::simd::set_isa(default_isa.c_str());
}

struct Case {
  const char* name;
  Op op;
  bool kda;
  DType state_dtype;
  int64_t len;  // tokens of the sequence under test (1: decode)
  int64_t K = 72;
};

class CpuDeterminism : public ::testing::TestWithParam<Case> {
 protected:
  void TearDown() override {
    kK = 72;
    cpu::set_num_threads(0);
    cpu::simd::set_isa(default_isa_.c_str());
  }
  std::string default_isa_ = cpu::simd::kernels().isa;
};

TEST_P(CpuDeterminism, SameBitsForAnyThreadsBatchAndIsa) {
  const Case c = GetParam();
  kK = c.K;
  const Sequence target = make_sequence(0, c.len, c.kda);
  const std::vector<Sequence> alone = {target};
  const std::vector<Sequence> batch = {make_sequence(1, 37, c.kda), make_sequence(2, 1, c.kda),
                                       target, make_sequence(3, 130, c.kda)};
  cpu::set_num_threads(1);
  const Result want = run(c.op, c.kda, c.state_dtype, alone, 0);
  int checked = 0;
  for (const char* isa : {"avx512", "avx2", "portable"}) {
    if (!cpu::simd::set_isa(isa)) continue;
    for (int threads : {1, 2, 3, 7}) {
      cpu::set_num_threads(threads);
      EXPECT_TRUE(run(c.op, c.kda, c.state_dtype, alone, 0) == want)
          << "alone, " << threads << " threads, " << isa;
      EXPECT_TRUE(run(c.op, c.kda, c.state_dtype, batch, 2) == want)
          << "in a batch of 4, " << threads << " threads, " << isa;
      ++checked;
    }
  }
  EXPECT_GE(checked, 4);  // the portable kernels at least
}

INSTANTIATE_TEST_SUITE_P(
    Ops, CpuDeterminism,
    ::testing::Values(Case{"gdn_decode_f32", Op::recurrent, false, DType::f32, 1},
                      Case{"gdn_decode_f32_k128", Op::recurrent, false, DType::f32, 1, 128},
                      Case{"kda_recurrent_bf16_k128", Op::recurrent, true, DType::bf16, 5, 128},
                      Case{"kda_decode_bf16", Op::recurrent, true, DType::bf16, 1},
                      Case{"gdn_recurrent_f32", Op::recurrent, false, DType::f32, 9},
                      Case{"kda_recurrent_f32", Op::recurrent, true, DType::f32, 9},
                      Case{"gdn_prefill_f32", Op::chunk_prefill, false, DType::f32, 150},
                      Case{"kda_prefill_bf16", Op::chunk_prefill, true, DType::bf16, 150}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

}  // namespace
