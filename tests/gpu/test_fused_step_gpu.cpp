// The CUDA causal_conv1d_update and fused decode layer step against the CPU backend on the same
// inputs. The windows store inputs only, so they must agree bit for bit; the conv outputs, states
// and outputs within the GPU-vs-CPU tolerances of tests/gpu/test_cuda_ops.cpp (fp32 1e-4/1e-4 on
// outputs, 1e-5/1e-4 on fp32 states, the state dtype's tolerance otherwise, plus one ulp of the
// storage dtype on each side), the gated norm adding the fp32 reduction order (1e-4). Padded rows
// are zeros, unused slots bit-untouched, and an out-of-range index is skipped and reported by
// check_errors. The fused step has three plans (a cluster per key head, one CTA per key head, or
// the chain of conv, packed decode and norm kernels through the workspace, which these tests
// pass whenever the call's plan asks for one): scripts/device.sh runs these tests with each
// forced (DELTASTATE_CUDA_FUSED=cluster | cta | chain) and with the default choice, and
// FusedStepGpuPlans compares the plans with each other bit for bit. ReplaySSM calls run their
// one-launch kernel, or under DELTASTATE_CUDA_FUSED=chain the ReplaySSM chain through the
// workspace the query asks for (these tests attach it); FusedReplayGpuPlans compares the fused
// ReplaySSM step with our unfused ReplaySSM chain bit for bit. A quantized or stochastically
// rounded pool runs the chain plan (FusedStepFmtGpu, against the CPU backend on the same pool
// bytes, as tests/gpu/test_state_format_gpu.cpp compares the other ops). Skips without a CUDA
// device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/gpu_util.h"
#include "gpu/quant_pools.h"
#include "layer_step_util.h"
#include "test_util.h"

namespace dstest {
namespace {

// A layer batch's inputs, weights, output and conv windows onto the device mirror, and its state
// pool unless the test's state is a pool of its own (`with_state` false).
void upload_layer_batch(Mirror& dev, const LayerBatch& b, bool with_state) {
  for (const Tensor* t : {&b.d.x, &b.d.a, &b.d.b, &b.d.A_log, &b.d.dt_bias, &b.d.idx, &b.weight,
                          &b.bias, &b.z, &b.norm_w, &b.out})
    dev.upload(*t);
  if (with_state) dev.upload(b.state);
  for (const Tensor& w : b.win) dev.upload(w);
}

// The workspace the call's plan asks for (fused_decode_step_workspace_bytes), on the device, set
// in the arguments; none where the plan needs none.
class DeviceWorkspace {
 public:
  DeviceWorkspace() = default;
  DeviceWorkspace(const DeviceWorkspace&) = delete;
  DeviceWorkspace& operator=(const DeviceWorkspace&) = delete;
  ~DeviceWorkspace() { cudaFree(ptr_); }
  // `bytes` < 0: the query's size; else exactly `bytes` (rounded down to whole floats).
  void attach(deltastate::FusedDecodeStepArgs& a, int64_t bytes = -1) {
    const int64_t need = deltastate::fused_decode_step_workspace_bytes(a);
    if (bytes < 0) bytes = need;
    if (bytes <= 0) return;
    if (!ptr_) CUDA_CHECK(cudaMalloc(&ptr_, static_cast<size_t>(need > bytes ? need : bytes)));
    a.workspace = TensorView::contiguous(ptr_, DType::f32, {bytes / 4}, Device::cuda(0));
  }

 private:
  void* ptr_ = nullptr;
};

// The device call of a test: skipped (GTEST_SKIP; the caller returns on IsSkipped()) where this
// build has no kernel for the shape (K = 64 outside DELTASTATE_CUDA_ALL_KERNELS builds), else
// run to completion with no bad row recorded.
void run_fused_on_device(const LayerBatch& b, const deltastate::FusedDecodeStepArgs& a) {
  try {
    b.run_fused(a);
  } catch (const deltastate::Error& e) {
    if (e.kind() == deltastate::ErrorKind::not_implemented) GTEST_SKIP() << e.what();
    throw;
  }
  sync();
  EXPECT_NO_THROW(deltastate::check_errors());
}

void expect_error_text(const std::function<void()>& f, const std::string& message) {
  const auto e = catch_error(f);
  ASSERT_TRUE(e.has_value()) << "no error; expected: " << message;
  EXPECT_EQ(std::string(e->what()), message);
}

inline bool fused_forced() { return std::getenv("DELTASTATE_CUDA_FUSED") != nullptr; }
inline std::string fused_forced_as() {
  const char* e = std::getenv("DELTASTATE_CUDA_FUSED");
  return e ? e : "";
}

class FusedStepGpu : public GpuParamTest<LayerCase> {};

TEST_P(FusedStepGpu, MatchesCpu) {
  const LayerCase& c = GetParam();
  Rng rng = test_rng();
  for (int64_t B : {1, 3, 17}) {
    std::vector<int64_t> padded{1};
    const std::vector<int64_t> idx =
        pick_slots(rng, B, B + 4, B > 1 ? padded : std::vector<int64_t>{});
    LayerBatch b = make_layer_batch(rng, c, idx, B + 4);
    Mirror dev;
    upload_layer_batch(dev, b, true);
    DeviceWorkspace ws;
    deltastate::FusedDecodeStepArgs a = b.args([&](const Tensor& t) { return dev.view(t); });
    ws.attach(a);
    run_fused_on_device(b, a);
    if (IsSkipped()) return;
    b.run_fused(b.args(host_view));  // the CPU twin on the host copies
    const Tensor out = dev.download(b.out), state = dev.download(b.state);
    for (size_t j = 0; j < b.win.size(); ++j)
      EXPECT_EQ(dev.download(b.win[j]).bytes(), b.win[j].bytes()) << "window " << j << ", B=" << B;
    const Tol out_tol = c.norm ? Tol{2e-4, 2e-4} : Tol{1e-4, 1e-4};
    // Half-ulps of the activation dtype allowed beyond out_tol. Both backends round o to it
    // before the norm (as the unfused chain stores o); their fp32 sums over K run in other
    // orders, so o can round one ulp apart, and the norm's two further roundings (y = x * inv,
    // then w * y) carry that flip to at most two ulps of the result (seen on the H200: 2 ulps
    // in 3 of 69632 bf16 outputs). Without the norm o is the result: one rounding apart.
    const int half_ulps = c.norm ? 5 : 3;
    EXPECT_TRUE(all_close(out.values(), b.out.values(), out_tol, c.act, half_ulps))
        << "out, B=" << B;
    const Tol st_tol = c.state == f32 ? Tol{1e-5, 1e-4} : state_tol(c.state);
    for (int64_t sl = 0; sl < b.slots; ++sl) {
      const bool live = std::find(idx.begin(), idx.end(), sl) != idx.end();
      const std::vector<double> g = slot_values(state.view(), sl),
                                h = slot_values(b.state.view(), sl);
      if (live) EXPECT_TRUE(all_close(g, h, st_tol, c.state, 2)) << "slot " << sl << ", B=" << B;
      else EXPECT_EQ(g, h) << "unused slot " << sl << " (sentinel), B=" << B;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layer, FusedStepGpu,
    ::testing::Values(
        LayerCase{{"qwen3next_f32state_bf16", kQwen3Next, false, kNoLb, f32, bf16}, bf16},
        LayerCase{{"qwen3next_bf16", kQwen3Next, false, kNoLb, bf16, bf16}, bf16},
        LayerCase{{"qwen3next_f32_nonorm_vllm", kQwen3Next, false, kNoLb, f32, f32},
                  f32,
                  4,
                  true,
                  false,
                  true,
                  false,
                  64},
        LayerCase{{"kimi_bf16_split", kKimi, true, kNoLb, bf16, bf16}, bf16, 4, false, true},
        LayerCase{{"kimi_f32_lb_packed", kKimi, true, kLb, f32, f32}, f32, 4, true},
        LayerCase{{"k64_bf16", Shape{"k64", 2, 4, 64, 64}, false, kNoLb, bf16, bf16}, bf16},
        LayerCase{{"k64_kda_f32", Shape{"k64kda", 4, 4, 64, 64}, true, kLb, f32, f32},
                  f32,
                  4,
                  false,
                  true},
        LayerCase{{"gqa_odd_v_f16", Shape{"odd_v", 2, 4, 128, 48}, false, kNoLb, f16, f16},
                  f16,
                  3,
                  false,
                  false,
                  false},
        // The cluster kernel's other splits (cluster.cuh): four value heads of two CTAs each; a
        // KDA cluster of four one-warp CTAs; and a group of 16 value heads, which no cluster of
        // at most 8 CTAs holds (the CTA kernel, whichever DELTASTATE_CUDA_FUSED asks for).
        LayerCase{{"group4_f32", Shape{"g4", 2, 8, 128, 64}, false, kNoLb, f32, bf16}, bf16},
        LayerCase{{"kda_cluster4_bf16", Shape{"kda4", 4, 4, 128, 32}, true, kNoLb, bf16, bf16},
                  bf16},
        LayerCase{{"group16_f32", Shape{"g16", 1, 16, 128, 16}, false, kNoLb, f32, f32}, f32}),
    case_name<LayerCase>);

// ---- the ReplaySSM fused step (its one-launch kernel, replay.cuh, or its chain) ---------------
struct ReplayGpuCase {
  LayerCase layer;
  int L = 8;
  DType d_dtype = DType::f32, k_dtype = DType::f32;
  bool advance = true;
};
inline void PrintTo(const ReplayGpuCase& c, std::ostream* os) { *os << c.layer.name; }

class FusedReplayGpu : public GpuParamTest<ReplayGpuCase> {};

// L + 3 steps from cursor 0 (forced flushes on some rows, every live row reaching L-1): each
// step starts CUDA from the CPU twin's checkpoints and rings (so each comparison is one step from
// the same inputs, with the one-step tolerances), then compares windows bit for bit, outputs,
// checkpoints and ring records within the tolerances, and the cursors exactly.
TEST_P(FusedReplayGpu, MatchesCpuOverSteps) {
  const ReplayGpuCase& rc = GetParam();
  const LayerCase& c = rc.layer;
  Rng rng = test_rng();
  for (int64_t B : {1, 5, 40}) {
    const int64_t slots = B + 3;
    const std::vector<int64_t> idx =
        pick_slots(rng, B, slots, B > 1 ? std::vector<int64_t>{1} : std::vector<int64_t>{});
    LayerBatch b = make_layer_batch(rng, c, idx, slots);
    Rings rings = make_rings(c.shape, c.kda, slots, rc.L, rc.d_dtype, rc.k_dtype);
    std::vector<int64_t> zeros(static_cast<size_t>(B), 0);
    Tensor wp = index_tensor(zeros);
    Mirror dev;
    for (const Tensor* t : {&b.d.A_log, &b.d.dt_bias, &b.d.idx, &b.weight, &b.bias, &b.norm_w,
                            &b.state, &rings.d, &rings.k, &rings.g, &wp})
      dev.upload(*t);
    for (const Tensor& w : b.win) dev.upload(w);
    DeviceWorkspace ws;
    for (int step = 0; step < rc.L + 3; ++step) {
      if (step > 0) {
        b.d.randomize(rng);
        b.z.fill_normal(rng, 1.0);
      }
      b.poison_out();
      std::vector<int64_t> force;
      for (int64_t r = 0; r < B; ++r) force.push_back(step > 0 && rng.chance(0.15) ? 1 : 0);
      Tensor ff = index_tensor(force);
      for (const Tensor* t :
           {&b.d.x, &b.d.a, &b.d.b, &b.z, &b.out, &ff, &b.state, &rings.d, &rings.k, &rings.g})
        dev.upload(*t);
      if (!rc.advance) dev.upload(wp);  // the host moves the cursors
      auto args = [&](auto&& view) {
        deltastate::FusedDecodeStepArgs a = b.args(view);
        // No SiLU here: the CPU's libm expf and CUDA's expf differ by an ulp at times, which
        // flips the conv output's rounding to the activation dtype in a few of the ~5 M conv
        // outputs this test makes (the k ring, fp32, then differs by an ulp of bf16, and the
        // state column it feeds follows; seen on the H200). Without it the conv is the same
        // fused multiply-adds on both, and every comparison below keeps the one-step ReplaySSM
        // tolerances. The SiLU conv (the same device function) is FusedStepGpu's and
        // ConvUpdateGpu's, with their ulp bounds.
        a.conv_silu = false;
        add_replay(a, view, rings, wp, &ff, rc.advance);
        return a;
      };
      deltastate::FusedDecodeStepArgs a = args([&](const Tensor& t) { return dev.view(t); });
      ws.attach(a);  // the chain's under DELTASTATE_CUDA_FUSED=chain, else none
      run_fused_on_device(b, a);
      if (IsSkipped()) return;
      const std::vector<int64_t> cursors = index_values(wp);
      b.run_fused(args(host_view));
      const std::string at = "B=" + std::to_string(B) + ", step " + std::to_string(step);
      for (size_t j = 0; j < b.win.size(); ++j)
        EXPECT_EQ(dev.download(b.win[j]).bytes(), b.win[j].bytes()) << "window " << j << ", " << at;
      // o is rounded to the activation dtype before the norm; its fp32 dots (over K and the
      // ring's terms) sum in other orders here, so o can round one ulp apart. A one-ulp flip is
      // up to 2^-7 relative in bf16, i.e. up to two ulps of the normalized result, and the
      // norm's three roundings (y = o * inv, w * y, then * silu(z) on the store) add half an ulp
      // each: 3.5 ulps (seen on the H200: 3 ulps in one of 20480 outputs). Without the norm o
      // is the result: one rounding apart.
      const Tol out_tol = c.norm ? Tol{2e-4, 2e-4} : Tol{1e-4, 1e-4};
      EXPECT_TRUE(
          all_close(dev.download(b.out).values(), b.out.values(), out_tol, c.act, c.norm ? 7 : 3))
          << "out, " << at;
      const Tensor state = dev.download(b.state);
      const Tol st_tol = c.state == f32 ? Tol{1e-5, 1e-4} : state_tol(c.state);
      for (int64_t sl = 0; sl < slots; ++sl) {
        const bool live = std::find(idx.begin(), idx.end(), sl) != idx.end();
        const std::vector<double> g = slot_values(state.view(), sl),
                                  h = slot_values(b.state.view(), sl);
        if (live) EXPECT_TRUE(all_close(g, h, st_tol, c.state, 2)) << "slot " << sl << ", " << at;
        else EXPECT_EQ(g, h) << "unused slot " << sl << " (sentinel), " << at;
      }
      // Ring records: d within the outputs' tolerance in its dtype; k and g as the CPU's (the
      // same normalization and gate formulas, other fp32 reduction orders).
      const Tol d_tol = rc.d_dtype == f32 ? Tol{1e-4, 1e-4} : state_tol(rc.d_dtype);
      EXPECT_TRUE(all_close(dev.download(rings.d).values(), rings.d.values(), d_tol, rc.d_dtype, 3))
          << "d ring, " << at;
      EXPECT_TRUE(
          all_close(dev.download(rings.k).values(), rings.k.values(), {1e-5, 1e-5}, rc.k_dtype, 2))
          << "k ring, " << at;
      EXPECT_TRUE(all_close(dev.download(rings.g).values(), rings.g.values(), {1e-5, 1e-5}, f32, 2))
          << "g ring, " << at;
      EXPECT_EQ(index_values(dev.download(wp)), index_values(wp)) << "cursors, " << at;
      if (!rc.advance) {  // the caller's advance
        std::vector<int64_t> next = cursors;
        for (int64_t r = 0; r < B; ++r)
          if (idx[r] >= 0) next[r] = cursors[r] == rc.L - 1 || force[r] ? 0 : cursors[r] + 1;
        wp = index_tensor(next);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layer, FusedReplayGpu,
    ::testing::Values(
        ReplayGpuCase{
            LayerCase{{"qwen3next_f32state_bf16", kQwen3Next, false, kNoLb, f32, bf16}, bf16}, 8,
            f32, f32, true},
        ReplayGpuCase{
            LayerCase{{"qwen3next_f32_nonorm_vllm_pad", kQwen3Next, false, kNoLb, f32, f32},
                      f32,
                      4,
                      true,
                      false,
                      true,
                      false,
                      64},
            6, f32, f32, false},
        ReplayGpuCase{
            LayerCase{{"qwen3next_bf16_bf16rings", kQwen3Next, false, kNoLb, bf16, bf16}, bf16}, 4,
            bf16, bf16, true},
        ReplayGpuCase{
            LayerCase{
                {"kimi_f32state_bf16_split", kKimi, true, kNoLb, f32, bf16}, bf16, 4, false, true},
            8, f32, f32, true},
        ReplayGpuCase{LayerCase{{"kimi_f32_lb_packed_nonorm", kKimi, true, kLb, f32, f32},
                                f32,
                                4,
                                true,
                                false,
                                true,
                                false},
                      5, f32, f32, false},
        ReplayGpuCase{LayerCase{{"k64_kda_f32", Shape{"k64kda", 4, 4, 64, 64}, true, kLb, f32, f32},
                                f32,
                                4,
                                false,
                                true},
                      6, f32, f32, true},
        // two tiles per warp (4 value heads x 8 tiles of 8 rows over 16 warps) and a ring whose
        // shared memory passes 48 KB (the opt-in)
        ReplayGpuCase{
            LayerCase{{"group4_f32_long", Shape{"g4", 2, 8, 128, 64}, false, kNoLb, f32, f32}, f32},
            40, f32, f32, true}),
    [](const ::testing::TestParamInfo<ReplayGpuCase>& i) {
      return std::string(i.param.layer.name);
    });

// A ReplaySSM fused step's batch, rings and cursors uploaded to `dev`, and its arguments on the
// device copies (cursors advanced on the device).
deltastate::FusedDecodeStepArgs replay_step_on_device(Mirror& dev, LayerBatch& b,
                                                      const Rings& rings, const Tensor& wp) {
  upload_layer_batch(dev, b, true);
  for (const Tensor* t : {&rings.d, &rings.k, &rings.g, &wp}) dev.upload(*t);
  const auto view = [&](const Tensor& t) { return dev.view(t); };
  deltastate::FusedDecodeStepArgs a = b.args(view);
  add_replay(a, view, rings, wp, nullptr, true);
  return a;
}

// A bad cursor and a bad slot on CUDA: the rows are skipped (NaN output; windows, checkpoint,
// rings and cursor untouched) and check_errors names the first.
TEST(FusedReplayGpuErrors, BadCursorIsReported) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Rng rng = test_rng();
  const LayerCase c{{"bad", kQwen3Next, false, kNoLb, f32, bf16}, bf16};
  LayerBatch b = make_layer_batch(rng, c, {-1, 2, 0}, 3);  // row 0 padded
  Rings rings = make_rings(c.shape, false, 3, 4, f32, f32);
  Tensor wp = index_tensor({9, 4, 0});  // row 1's cursor past the ring; row 0 padded
  Mirror dev;
  deltastate::FusedDecodeStepArgs a = replay_step_on_device(dev, b, rings, wp);
  a.check_indices = false;
  DeviceWorkspace ws;
  ws.attach(a);  // the chain's under DELTASTATE_CUDA_FUSED=chain, else none
  b.run_fused(a);
  const auto e = catch_error([] { deltastate::check_errors(); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(std::string(e->what()),
            "fused_decode_step: `write_pos`[1]=4 is outside the ring [0, L-1=3]; the row was "
            "skipped (state, rings and cursor untouched) and its output is NaN");
  const Tensor out = dev.download(b.out);
  for (int64_t i = 0; i < 32 * 128; ++i) {
    ASSERT_EQ(out.get_linear(i), 0.0) << "padded row";
    ASSERT_TRUE(std::isnan(out.get_linear(32 * 128 + i))) << "bad row";
  }
  // row 2 ran: its slot 0 was written, and its cursor advanced; the bad row's stayed
  EXPECT_EQ(index_values(dev.download(wp)), (std::vector<int64_t>{9, 4, 1}));
  const Tensor state = dev.download(b.state);
  EXPECT_EQ(slot_values(state.view(), 2), slot_values(b.state.view(), 2)) << "slot 2 untouched";
  // the bad row's slot 2 in the windows and rings untouched
  const Tensor win = dev.download(b.win[0]);
  EXPECT_EQ(window_values(win, 2), window_values(b.win[0], 2)) << "windows of slot 2";
  const Tensor d = dev.download(rings.d);
  EXPECT_EQ(view_values(d.view(), 2 * 32 * 4 * 128, 32 * 4 * 128),
            view_values(rings.d.view(), 2 * 32 * 4 * 128, 32 * 4 * 128))
      << "d ring of slot 2";
  // a bad slot on another call
  b.d.idx.set({1}, 7);
  dev.upload(b.d.idx);
  Tensor wp2 = index_tensor({0, 0, 0});
  dev.upload(wp2);
  a.write_pos = dev.view(wp2);
  b.run_fused(a);
  const auto e2 = catch_error([] { deltastate::check_errors(); });
  ASSERT_TRUE(e2.has_value());
  EXPECT_EQ(std::string(e2->what()),
            "fused_decode_step: `ssm_state_indices`[1]=7 is out of range for a state pool of 3 "
            "slots (valid: 0..2; < 0 marks a padded row); the row was skipped (state, rings and "
            "cursor untouched) and its output is NaN");
}

// Two fused steps with PDL captured in a CUDA graph on a stream and replayed (each kernel's launch
// attributes, the cluster's among them, inside a graph; a padded row) against two CPU steps. fp32
// states: a 16-bit state's one-ulp flips of the first step would compound in the second beyond
// the one-step tolerances.
TEST(FusedStepGpuGraph, TwoStepsWithPdlReplayed) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Rng rng = test_rng();
  const LayerCase cases[] = {
      LayerCase{{"qwen3next_f32state_bf16", kQwen3Next, false, kNoLb, f32, bf16}, bf16},
      LayerCase{{"kimi_f32state_nonorm", kKimi, true, kNoLb, f32, bf16},
                bf16,
                4,
                false,
                false,
                true,
                false}};
  for (const LayerCase& c : cases) {
    const std::vector<int64_t> idx{2, -1, 0};
    LayerBatch b = make_layer_batch(rng, c, idx, 4);
    Mirror dev;
    upload_layer_batch(dev, b, true);
    cudaStream_t stream = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    deltastate::FusedDecodeStepArgs a = b.args([&](const Tensor& t) { return dev.view(t); });
    a.stream = stream;
    a.pdl = true;
    a.check_indices = false;
    DeviceWorkspace ws;
    ws.attach(a);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    b.run_fused(a);
    b.run_fused(a);
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    CUDA_CHECK(cudaStreamDestroy(stream));
    deltastate::check_errors();
    b.run_fused(b.args(host_view));
    b.run_fused(b.args(host_view));
    for (size_t j = 0; j < b.win.size(); ++j)
      EXPECT_EQ(dev.download(b.win[j]).bytes(), b.win[j].bytes()) << c.name << ", window " << j;
    const Tol out_tol = c.norm ? Tol{2e-4, 2e-4} : Tol{1e-4, 1e-4};
    EXPECT_TRUE(
        all_close(dev.download(b.out).values(), b.out.values(), out_tol, c.act, c.norm ? 5 : 3))
        << c.name << ", out";
    const Tensor state = dev.download(b.state);
    const Tol st_tol = c.state == f32 ? Tol{1e-5, 1e-4} : state_tol(c.state);
    for (int64_t sl = 0; sl < b.slots; ++sl) {
      const std::vector<double> g = slot_values(state.view(), sl),
                                h = slot_values(b.state.view(), sl);
      if (sl == 0 || sl == 2) EXPECT_TRUE(all_close(g, h, st_tol, c.state, 2)) << c.name << sl;
      else EXPECT_EQ(g, h) << c.name << ", unused slot " << sl;
    }
  }
}

// ---- the fused step on a quantized / stochastically rounded pool (plain mode) ------------------
// CUDA runs it through the chain plan (its packed decode the recurrent op's formatted paths),
// the CPU backend is the oracle on the same pool bytes; tolerances as test_state_format_gpu.cpp's
// (expect_pools_match: codes within one quantum, scales to 1e-4 relative, the step counter and
// every other byte equal), the outputs and windows as FusedStepGpu's.
struct FusedFmtCase {
  const char* name;
  bool kda;
  DType dtype;
  StateRounding rounding;
  deltastate::PoolLayout layout;
};
inline void PrintTo(const FusedFmtCase& c, std::ostream* os) { *os << c.name; }

// The layer case of a formatted-pool case: its batch's own state pool (bf16) is unused.
LayerCase fmt_layer_case(const FusedFmtCase& c) {
  return c.kda ? LayerCase{{c.name, kKimi, true, kLb, bf16, bf16}, bf16}
               : LayerCase{{c.name, kQwen3Next, false, kNoLb, bf16, bf16}, bf16};
}

// The layer batch's arguments through `view_of` on layer `layer` of pool p in its format.
template <class ViewOf>
deltastate::FusedDecodeStepArgs fmt_args(LayerBatch& b, ViewOf&& view_of, const StatePool& p,
                                         int64_t layer, StateRounding rounding) {
  deltastate::FusedDecodeStepArgs a = b.args(view_of);
  a.state = p.layer_state(layer);
  a.state_format = format_of(p, layer, rounding);
  return a;
}

class FusedStepFmtGpu : public GpuParamTest<FusedFmtCase> {};

// Two steps of the fused step on a host pool and its device copy (a padded row among them):
// outputs, windows bit for bit, the pools by expect_pools_match (codes, scales, step counter,
// sentinel bytes of the slots no row uses and of the other layer), the counter advanced once
// per call.
TEST_P(FusedStepFmtGpu, MatchesCpu) {
  const FusedFmtCase& c = GetParam();
  const LayerCase lc = fmt_layer_case(c);
  const int64_t layer = 1, slots = 9;
  const std::vector<int64_t> idx{7, -1, 2, 5, 0};
  Rng rng = test_rng();
  LayerBatch b = make_layer_batch(rng, lc, idx, slots);
  const QuantPools q = make_quant_pools(lc.shape, c.dtype, c.rounding, c.layout, 2, slots,
                                        blocks_of(layer, idx), rng);
  Mirror dev;
  for (const Tensor* t : {&b.d.A_log, &b.d.dt_bias, &b.d.idx, &b.weight, &b.bias, &b.norm_w})
    dev.upload(*t);
  DeviceWorkspace ws;
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step) {
      b.d.randomize(rng);
      b.z.fill_normal(rng, 1.0);
    }
    b.poison_out();
    for (const Tensor* t : {&b.d.x, &b.d.a, &b.d.b, &b.z, &b.out}) dev.upload(*t);
    for (const Tensor& w : b.win) dev.upload(w);  // both backends from the CPU's windows
    deltastate::FusedDecodeStepArgs a = fmt_args(
        b, [&](const Tensor& t) { return dev.view(t); }, *q.dev, layer, c.rounding);
    // the plan is the chain whatever the batch: the query asks for its workspace
    ASSERT_GT(deltastate::fused_decode_step_workspace_bytes(a), 0);
    ws.attach(a);
    run_fused_on_device(b, a);
    if (IsSkipped()) return;
    b.run_fused(fmt_args(b, host_view, *q.host, layer, c.rounding));  // the CPU twin
    for (size_t j = 0; j < b.win.size(); ++j)
      EXPECT_EQ(dev.download(b.win[j]).bytes(), b.win[j].bytes()) << "window " << j;
    const Tensor out = dev.download(b.out);
    EXPECT_TRUE(all_close(out.values(), b.out.values(), Tol{2e-4, 2e-4}, lc.act, 5)) << "out";
    std::vector<double> padded;
    for (int64_t hv = 0; hv < lc.shape.HV; ++hv)
      for (int64_t v = 0; v < lc.shape.V; ++v) padded.push_back(out.get({1, hv, v}));
    EXPECT_TRUE(all_zero(padded)) << "the padded row's output";
    if (q.stochastic) {
      EXPECT_EQ(host_step(q, layer), kStep0 + step + 1);
    }
    expect_pools_match(q, c.dtype, blocks_of(layer, idx));
    q.push();  // the next step starts both backends from the CPU's pool
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, FusedStepFmtGpu,
    ::testing::Values(FusedFmtCase{"gdn_fp8_sr", false, DType::f8e4m3,
                                   StateRounding::format_default,
                                   deltastate::PoolLayout::per_layer},
                      FusedFmtCase{"gdn_int8_rn_envelope", false, DType::i8, StateRounding::nearest,
                                   deltastate::PoolLayout::envelope},
                      FusedFmtCase{"gdn_bf16_sr", false, DType::bf16, StateRounding::stochastic,
                                   deltastate::PoolLayout::per_layer},
                      FusedFmtCase{"kda_fp8_sr_envelope", true, DType::f8e4m3,
                                   StateRounding::format_default, deltastate::PoolLayout::envelope},
                      FusedFmtCase{"kda_int8_rn", true, DType::i8, StateRounding::nearest,
                                   deltastate::PoolLayout::per_layer},
                      FusedFmtCase{"kda_bf16_sr", true, DType::bf16, StateRounding::stochastic,
                                   deltastate::PoolLayout::per_layer}),
    case_name<FusedFmtCase>);

// Without a workspace a formatted pool on CUDA is a NotImplementedError naming it, raised before
// any launch: the pool (codes, scales, step counter), the windows and out keep their bytes.
TEST(FusedStepFmtGpuErrors, NoWorkspaceChangesNothing) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const struct {
    FusedFmtCase c;
    const char* message;
  } cases[] = {
      {{"gdn_fp8_sr", false, DType::f8e4m3, StateRounding::format_default,
        deltastate::PoolLayout::per_layer},
       "gdn_fused_decode_step: float8_e4m3fn states on CUDA run the chain plan (the conv, packed "
       "decode, the norm), which needs a `workspace` of fused_decode_step_workspace_bytes bytes; "
       "none was given"},
      {{"kda_bf16_sr", true, DType::bf16, StateRounding::stochastic,
        deltastate::PoolLayout::per_layer},
       "kda_fused_decode_step: bfloat16 states with stochastic rounding on CUDA run the chain plan "
       "(the conv, packed decode, the norm), which needs a `workspace` of "
       "fused_decode_step_workspace_bytes bytes; none was given"}};
  for (const auto& [c, message] : cases) {
    SCOPED_TRACE(c.name);
    const LayerCase lc = fmt_layer_case(c);
    const std::vector<int64_t> idx{3, -1, 1};
    Rng rng = test_rng();
    LayerBatch b = make_layer_batch(rng, lc, idx, 4);
    const QuantPools q =
        make_quant_pools(lc.shape, c.dtype, c.rounding, c.layout, 1, 4, blocks_of(0, idx), rng);
    Mirror dev;
    upload_layer_batch(dev, b, false);  // the state: the quantized pool
    deltastate::FusedDecodeStepArgs a = fmt_args(
        b, [&](const Tensor& t) { return dev.view(t); }, *q.dev, 0, c.rounding);
    const auto e = catch_error([&] { b.run_fused(a); });
    ASSERT_TRUE(e.has_value()) << "no error; expected: " << message;
    EXPECT_EQ(e->kind(), deltastate::ErrorKind::not_implemented);
    EXPECT_EQ(std::string(e->what()), message);
    sync();
    expect_pools_match(q, c.dtype, {});  // every byte as pushed, the step counter too
    for (size_t j = 0; j < b.win.size(); ++j)
      EXPECT_EQ(dev.download(b.win[j]).bytes(), b.win[j].bytes()) << "window " << j;
    EXPECT_EQ(dev.download(b.out).bytes(), b.out.bytes()) << "out";
  }
}

// CUDA-graph replay of the fused step on a stochastically rounded float8 pool: a captured call
// (the chain plan: conv, formatted decode and its step advance, norm) replayed three times
// advances the device's counter by one each time, and each replay agrees with an eager CPU call
// from the same pool bytes (the host pool pushed before each replay: one-step tolerances).
TEST(FusedStepFmtGpuGraph, ReplayAdvancesTheStep) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const FusedFmtCase c{"gdn_fp8_sr", false, DType::f8e4m3, StateRounding::format_default,
                       deltastate::PoolLayout::per_layer};
  const LayerCase lc = fmt_layer_case(c);
  const std::vector<int64_t> idx{2, -1, 0};
  Rng rng = test_rng();
  LayerBatch b = make_layer_batch(rng, lc, idx, 4);
  const QuantPools q =
      make_quant_pools(lc.shape, c.dtype, c.rounding, c.layout, 1, 4, blocks_of(0, idx), rng);
  Mirror dev;
  upload_layer_batch(dev, b, false);  // the state: the quantized pool
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  deltastate::FusedDecodeStepArgs a = fmt_args(
      b, [&](const Tensor& t) { return dev.view(t); }, *q.dev, 0, c.rounding);
  a.stream = stream;
  a.pdl = true;
  a.check_indices = false;
  DeviceWorkspace ws;
  ws.attach(a);
  ASSERT_TRUE(a.workspace.has_value());
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  b.run_fused(a);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  // capture launched nothing: the device counter is where make_quant_pools left it
  int64_t step = 0;
  CUDA_CHECK(cudaMemcpy(&step, q.dev->rounding_step(0).data, 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(step, kStep0);
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE("replay " + std::to_string(i));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    deltastate::check_errors();
    CUDA_CHECK(cudaMemcpy(&step, q.dev->rounding_step(0).data, 8, cudaMemcpyDeviceToHost));
    EXPECT_EQ(step, kStep0 + i + 1);
    b.run_fused(fmt_args(b, host_view, *q.host, 0, c.rounding));  // the CPU twin
    EXPECT_EQ(host_step(q, 0), kStep0 + i + 1);
    for (size_t j = 0; j < b.win.size(); ++j)
      EXPECT_EQ(dev.download(b.win[j]).bytes(), b.win[j].bytes()) << "window " << j;
    EXPECT_TRUE(all_close(dev.download(b.out).values(), b.out.values(), Tol{2e-4, 2e-4}, lc.act, 5))
        << "out";
    expect_pools_match(q, c.dtype, blocks_of(0, idx));
    q.push();  // the next replay starts both backends from the CPU's pool
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// ---- the fused step's ReplaySSM mode on a quantized / stochastically rounded pool -------------
// CUDA runs it through the ReplaySSM chain (conv, replayssm_decode's formatted kernels, norm)
// whatever the plan would otherwise be; the CPU backend on the same pool bytes is the oracle, with
// FusedStepFmtGpu's tolerances (outputs, windows bit for bit) and GpuQuantizedReplay's for the
// pool (expect_replay_pools_match: cursors, rings, codes within one quantum, scales, the step
// counter, every other byte).
struct FusedReplayFmtCase {
  FusedFmtCase fmt;
  bool circular = false;  // SGLang's circular rings (history checkpoints at natural flushes)
};
inline void PrintTo(const FusedReplayFmtCase& c, std::ostream* os) { *os << c.fmt.name; }

class FusedReplayFmtGpu : public GpuParamTest<FusedReplayFmtCase> {};

// Five steps from cursor 0 with L = 3 (natural flushes at L-1, a forced one), the cursors (and
// circular bases) advanced by the op, each step from the CPU's pool on both backends. No SiLU in
// the conv: FusedReplayGpu's reason (libm's and CUDA's expf differ by an ulp at times, flipping
// a conv output's rounding to the activation dtype, which the fp32 k ring then records).
TEST_P(FusedReplayFmtGpu, MatchesCpu) {
  const FusedReplayFmtCase& rc = GetParam();
  const FusedFmtCase& c = rc.fmt;
  const LayerCase lc = fmt_layer_case(c);
  const int64_t layer = 1, slots = 9;
  const int L = 3;
  const std::vector<int64_t> idx{7, -1, 2, 5};
  Rng rng = test_rng();
  LayerBatch b = make_layer_batch(rng, lc, idx, slots);
  const QuantPools q = make_quant_pools(lc.shape, c.dtype, c.rounding, c.layout, 2, slots,
                                        blocks_of(layer, idx), rng, L, c.kda);
  const StatePool& host = *q.host;
  const std::vector<TensorView> rings = ring_views(host, layer);
  Mirror dev;
  for (const Tensor* t : {&b.d.A_log, &b.d.dt_bias, &b.d.idx, &b.weight, &b.bias, &b.norm_w})
    dev.upload(*t);
  std::vector<int64_t> cursor(idx.size(), 0), bases(idx.size(), 0);
  if (rc.circular) bases = {1, 0, 2, 0};
  DeviceWorkspace ws;
  int flushes = 0;
  for (int step = 0; step < 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step) {
      b.d.randomize(rng);
      b.z.fill_normal(rng, 1.0);
    }
    b.poison_out();
    Tensor wp = index_tensor(cursor), base = index_tensor(bases);
    Tensor ff = index_tensor({0, 0, step == 0 ? 1 : 0, 0});
    std::vector<Block> flushed;
    for (size_t n = 0; n < idx.size(); ++n)
      if (idx[n] >= 0 && (cursor[n] == L - 1 || ff.get_linear(static_cast<int64_t>(n)) != 0))
        flushed.push_back({layer, idx[n]});
    flushes += static_cast<int>(flushed.size());
    for (const Tensor* t : {&b.d.x, &b.d.a, &b.d.b, &b.z, &b.out, &wp, &ff, &base}) dev.upload(*t);
    for (const Tensor& w : b.win) dev.upload(w);  // both backends from the CPU's windows
    auto args = [&](auto&& view, const StatePool& p) {
      deltastate::FusedDecodeStepArgs a = fmt_args(b, view, p, layer, c.rounding);
      a.conv_silu = false;
      a.d_cache = p.d_cache(layer);
      a.k_cache = p.k_cache(layer);
      a.g_cache = p.g_cache(layer);
      a.write_pos = view(wp);
      a.force_flush = view(ff);
      a.advance_write_pos = true;
      if (rc.circular) {
        a.cache_base = view(base);
        a.circular_replay = true;
      }
      return a;
    };
    deltastate::FusedDecodeStepArgs a = args([&](const Tensor& t) { return dev.view(t); }, *q.dev);
    // the ReplaySSM chain whatever the plan: the query asks for its workspace
    ASSERT_GT(deltastate::fused_decode_step_workspace_bytes(a), 0);
    ws.attach(a);
    run_fused_on_device(b, a);
    if (IsSkipped()) return;
    b.run_fused(args(host_view, host));  // the CPU twin
    for (size_t j = 0; j < b.win.size(); ++j)
      EXPECT_EQ(dev.download(b.win[j]).bytes(), b.win[j].bytes()) << "window " << j;
    const Tensor out = dev.download(b.out);
    EXPECT_TRUE(all_close(out.values(), b.out.values(), Tol{2e-4, 2e-4}, lc.act, 5)) << "out";
    std::vector<double> padded;
    for (int64_t hv = 0; hv < lc.shape.HV; ++hv)
      for (int64_t v = 0; v < lc.shape.V; ++v) padded.push_back(out.get({1, hv, v}));
    EXPECT_TRUE(all_zero(padded)) << "the padded row's output";
    EXPECT_EQ(dev.download(base).values(), base.values()) << "cache_base";
    expect_replay_pools_match(dev, q, c.dtype, wp, rings, flushed, layer, step);
    cursor = index_values(wp);
    bases = index_values(base);
  }
  EXPECT_GE(flushes, 4);
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, FusedReplayFmtGpu,
    ::testing::Values(
        FusedReplayFmtCase{{"gdn_fp8_sr", false, DType::f8e4m3, StateRounding::format_default,
                            deltastate::PoolLayout::per_layer}},
        FusedReplayFmtCase{{"gdn_int8_rn_envelope", false, DType::i8, StateRounding::nearest,
                            deltastate::PoolLayout::envelope}},
        FusedReplayFmtCase{{"gdn_bf16_sr_circular", false, DType::bf16, StateRounding::stochastic,
                            deltastate::PoolLayout::per_layer},
                           true},
        FusedReplayFmtCase{{"kda_fp8_rn_envelope", true, DType::f8e4m3, StateRounding::nearest,
                            deltastate::PoolLayout::envelope}},
        FusedReplayFmtCase{{"kda_int8_sr_circular", true, DType::i8, StateRounding::stochastic,
                            deltastate::PoolLayout::per_layer},
                           true}),
    [](const ::testing::TestParamInfo<FusedReplayFmtCase>& i) {
      return std::string(i.param.fmt.name);
    });

// CUDA-graph replay of the ReplaySSM fused step on a stochastically rounded int8 pool: a captured
// call (the ReplaySSM chain: conv, formatted decode and its step advance, norm) replayed four
// times (L = 3: a flush on the third) against four eager calls on a second device pool with its
// own cursors: pools, cursors and outputs bit-identical, the device counter one on per replay.
TEST(FusedReplayFmtGpuGraph, ReplayMatchesEagerCalls) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const FusedFmtCase c{"gdn_int8_sr", false, DType::i8, StateRounding::stochastic,
                       deltastate::PoolLayout::per_layer};
  const LayerCase lc = fmt_layer_case(c);
  const std::vector<int64_t> idx{2, -1, 0};
  const int64_t layer = 0;
  Rng rng = test_rng();
  LayerBatch b = make_layer_batch(rng, lc, idx, 4);
  const QuantPools q = make_quant_pools(lc.shape, c.dtype, c.rounding, c.layout, 1, 4,
                                        blocks_of(layer, idx), rng, 3, false);
  StatePool eager(q.dev->config());
  CUDA_CHECK(cudaMemcpy(eager.data(), q.dev->data(), static_cast<size_t>(q.bytes),
                        cudaMemcpyDeviceToDevice));
  Tensor wp_eager = index_tensor({0, 0, 0}), wp_graph = index_tensor({0, 0, 0});
  Tensor out_eager = clone(b.out);
  Mirror dev;
  upload_layer_batch(dev, b, false);  // the state: the quantized pools
  for (const Tensor* t : {&wp_eager, &wp_graph, &out_eager}) dev.upload(*t);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceWorkspace ws;
  auto args = [&](const StatePool& p, const Tensor& wp, const Tensor& out) {
    deltastate::FusedDecodeStepArgs a = fmt_args(
        b, [&](const Tensor& t) { return dev.view(t); }, p, layer, c.rounding);
    a.d_cache = p.d_cache(layer);
    a.k_cache = p.k_cache(layer);
    a.g_cache = p.g_cache(layer);
    a.write_pos = dev.view(wp);
    a.advance_write_pos = true;
    a.out = dev.view(out);
    a.stream = stream;
    a.pdl = true;
    a.check_indices = false;
    ws.attach(a);
    return a;
  };
  // the two pools' windows: the eager calls roll b's windows; the graph gets copies
  std::vector<Tensor> win_graph;
  for (const Tensor& w : b.win) {
    win_graph.push_back(clone(w));
    dev.upload(win_graph.back());
  }
  auto graph_args = [&] {
    deltastate::FusedDecodeStepArgs a = args(*q.dev, wp_graph, b.out);
    a.conv_state = dev.view(win_graph[0]);
    return a;
  };
  ASSERT_EQ(b.win.size(), 1u);  // GDN: one packed window
  for (int i = 0; i < 4; ++i) b.run_fused(args(eager, wp_eager, out_eager));
  {
    const deltastate::FusedDecodeStepArgs a = graph_args();
    ASSERT_TRUE(a.workspace.has_value());
  }
  replay_graph(stream, 4, [&] { b.run_fused(graph_args()); });
  deltastate::check_errors();
  int64_t got = 0;
  CUDA_CHECK(cudaMemcpy(&got, q.dev->rounding_step(layer).data, 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, kStep0 + 4);
  EXPECT_EQ(dev.download(wp_graph).values(), dev.download(wp_eager).values()) << "cursors";
  EXPECT_EQ(dev.download(wp_graph).values(), (std::vector<double>{1, 0, 1})) << "cursors";
  EXPECT_EQ(dev.download(b.out).bytes(), dev.download(out_eager).bytes()) << "the last outputs";
  EXPECT_EQ(dev.download(win_graph[0]).bytes(), dev.download(b.win[0]).bytes()) << "windows";
  EXPECT_TRUE(same_device_bytes(q.dev->data(), eager.data(), q.bytes))
      << "graph replays against eager calls";
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// causal_conv1d_update on CUDA against the CPU (shifted, circular, seqlen 3, vLLM layout).
TEST(ConvUpdateGpu, MatchesCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Rng rng = test_rng();
  for (int variant = 0; variant < 4; ++variant) {
    const DType dt = variant % 2 ? bf16 : f32;
    const int64_t B = 5, dim = 300, T = variant >= 2 ? 3 : 1;
    Tensor x = Tensor::contiguous(dt, {B, dim, T});
    x.fill_normal(rng, 1.0);
    Tensor st = make_window(dt, 8, dim, 4, variant == 1, 2);
    for (int64_t e = 0; e < 8; ++e) fill_window(st, e, rng);
    Tensor w = Tensor::contiguous(dt, {dim, 4}), bias = Tensor::contiguous(dt, {dim});
    w.fill_uniform(rng, -0.7, 0.7);
    bias.fill_uniform(rng, -0.2, 0.2);
    Tensor idx = index_tensor({6, -1, 0, 3, 2}), cs = index_tensor({5, 1, 2, 9, 0});
    Tensor out = Tensor::contiguous(dt, {B, dim, T});
    out.fill_all(std::nan(""));
    Mirror dev;
    for (const Tensor* t : {&x, &st, &w, &bias, &idx, &cs, &out}) dev.upload(*t);
    auto args = [&](auto&& view) {
      deltastate::CausalConv1dUpdateArgs a;
      a.x = view(x);
      a.conv_state = view(st);
      a.weight = view(w);
      a.bias = view(bias);
      a.silu = true;
      a.conv_state_indices = view(idx);
      if (variant == 3) a.cache_seqlens = view(cs);
      a.out = view(out);
      return a;
    };
    deltastate::causal_conv1d_update(args([&](const Tensor& t) { return dev.view(t); }));
    CUDA_CHECK(cudaDeviceSynchronize());
    deltastate::causal_conv1d_update(args(host_view));
    EXPECT_EQ(dev.download(st).bytes(), st.bytes()) << "windows, variant " << variant;
    EXPECT_TRUE(all_close(dev.download(out).values(), out.values(), {1e-5, 1e-5}, dt, 2))
        << "out, variant " << variant;
  }
}

// causal_conv1d_update from the same inputs on CUDA and on the CPU (bias optional, `out` poisoned
// by the caller): the windows, with their padding and sentinel slots, bit for bit; the outputs bit
// for bit without SiLU (the same fused multiply-adds) and within its ulps with it (expf differs by
// an ulp between libm and CUDA).
void expect_conv_update_matches_cpu(Tensor& x, Tensor& st, const Tensor& w, const Tensor* bias,
                                    const Tensor& idx, Tensor& out, bool silu,
                                    const std::string& at) {
  Mirror dev;
  for (const Tensor* t : std::initializer_list<const Tensor*>{&x, &st, &w, &idx, &out})
    dev.upload(*t);
  if (bias) dev.upload(*bias);
  auto args = [&](auto&& view) {
    deltastate::CausalConv1dUpdateArgs a;
    a.x = view(x);
    a.conv_state = view(st);
    a.weight = view(w);
    if (bias) a.bias = view(*bias);
    a.silu = silu;
    a.conv_state_indices = view(idx);
    a.out = view(out);
    return a;
  };
  deltastate::causal_conv1d_update(args([&](const Tensor& t) { return dev.view(t); }));
  CUDA_CHECK(cudaDeviceSynchronize());
  deltastate::causal_conv1d_update(args(host_view));
  EXPECT_EQ(dev.download(st).bytes(), st.bytes()) << "windows, " << at;
  if (silu)
    EXPECT_TRUE(all_close(dev.download(out).values(), out.values(), {1e-5, 1e-5}, x.dtype(), 2))
        << "out, " << at;
  else EXPECT_EQ(dev.download(out).bytes(), out.bytes()) << "out, " << at;
}

// causal_conv1d_update on CUDA against the CPU on the shapes whose inputs the kernel loads ahead
// with clamped indices (conv_loads.cuh): widths 2, 3 and 4, windows of width - 1 entries
// (SGLang's) and longer ones, no bias, the weights in another dtype than the window and input,
// one and two tokens. Windows bit for bit; the outputs within SiLU's ulps.
TEST(ConvUpdateGpu, LoadedAheadShapes) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Rng rng = test_rng();
  struct Shape {
    int width, state_len;
    bool bias;
    DType x, weight;  // the window has x's dtype (the validator's rule)
    int64_t T;
  };
  const Shape shapes[] = {{2, 1, false, bf16, bf16, 1}, {3, 2, true, f32, bf16, 1},
                          {4, 3, false, f16, f32, 1},   {4, 3, true, bf16, f32, 2},
                          {3, 5, false, bf16, f16, 1},  {2, 3, true, f32, f32, 2}};
  for (const Shape& sh : shapes) {
    const int64_t B = 4, dim = 260;
    const std::string at = "width " + std::to_string(sh.width) + ", state_len " +
                           std::to_string(sh.state_len) + ", T " + std::to_string(sh.T);
    Tensor x = Tensor::contiguous(sh.x, {B, dim, sh.T});
    x.fill_normal(rng, 1.0);
    Tensor st = make_window(sh.x, 6, dim, sh.state_len, false, 2);
    for (int64_t e = 0; e < 6; ++e) fill_window(st, e, rng);
    Tensor w = Tensor::contiguous(sh.weight, {dim, sh.width});
    Tensor bias = Tensor::contiguous(sh.weight, {dim});
    w.fill_uniform(rng, -0.7, 0.7);
    bias.fill_uniform(rng, -0.2, 0.2);
    Tensor idx = index_tensor({5, -1, 0, 3});
    Tensor out = Tensor::contiguous(sh.x, {B, dim, sh.T});
    out.fill_all(std::nan(""));
    expect_conv_update_matches_cpu(x, st, w, sh.bias ? &bias : nullptr, idx, out, true, at);
  }
}

// causal_conv1d_update on CUDA against the CPU on the shapes the vector kernel takes (one token,
// width 4 on 3-entry windows, 16-byte aligned rows, dim a multiple of 8; conv_update.cu): SGLang's
// entries-contiguous and vLLM's channels-contiguous windows, 16- and 32-bit windows and weights,
// with and without bias and SiLU, padded rows, slots past the batch's. Windows (and the sentinel
// slots) bit for bit; the outputs bit for bit without SiLU, within its ulps with it. A batch this
// small takes the scalar kernel by default: the GPU run forces each, DELTASTATE_CUDA_CONV=vector
// and =scalar (scripts/device.sh test-layer).
TEST(ConvUpdateGpu, VectorShapes) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Rng rng = test_rng();
  struct Shape {
    DType x, weight;  // the window has x's dtype (the validator's rule)
    bool dim_contiguous, bias, silu;
  };
  const Shape shapes[] = {{bf16, bf16, false, true, true}, {bf16, f32, true, false, true},
                          {f32, f32, false, true, false},  {f16, bf16, true, true, true},
                          {f32, bf16, true, false, false}, {bf16, bf16, false, false, false}};
  for (const Shape& sh : shapes) {
    const int64_t B = 5, dim = 264;  // 33 groups of 8 channels: one partial CTA
    const std::string at = std::string("x ") + dtype_name(sh.x) + ", weight " +
                           dtype_name(sh.weight) + (sh.dim_contiguous ? ", vLLM" : ", SGLang") +
                           " layout";
    Tensor x = Tensor::contiguous(sh.x, {B, dim});
    x.fill_normal(rng, 1.0);
    Tensor st = make_window(sh.x, 8, dim, 3, sh.dim_contiguous, 8);
    for (int64_t e = 0; e < 7; ++e) fill_window(st, e, rng);  // slot 7 keeps its sentinel
    Tensor w = Tensor::contiguous(sh.weight, {dim, 4});
    Tensor bias = Tensor::contiguous(sh.weight, {dim});
    w.fill_uniform(rng, -0.7, 0.7);
    bias.fill_uniform(rng, -0.2, 0.2);
    Tensor idx = index_tensor({6, -1, 0, 3, 2});
    Tensor out = Tensor::contiguous(sh.x, {B, dim});
    out.fill_all(std::nan(""));
    expect_conv_update_matches_cpu(x, st, w, sh.bias ? &bias : nullptr, idx, out, sh.silu, at);
  }
}

// causal_conv1d_update's speculative options on CUDA against the CPU: a chain with scratch
// windows, an EAGLE tree, num_accept_tokens with a tree, bf16 in vLLM's layout. Windows, scratch
// windows and parents bit for bit; outputs too without SiLU (the same fused multiply-adds), within
// the conv tolerance with it (expf differs by an ulp between libm and CUDA).
TEST(ConvVerifyGpu, MatchesCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Rng rng = test_rng();
  for (int variant = 0; variant < 4; ++variant) {
    const DType dt = variant == 3 ? bf16 : f32;
    const bool tree = variant == 1 || variant == 2, accept = variant == 2, silu = variant != 1;
    const int64_t B = 5, dim = 300, T = 4, W1 = 3;
    const int L = accept ? static_cast<int>(W1 - 1 + T) : static_cast<int>(W1);
    Tensor x = Tensor::contiguous(dt, {B, dim, T});
    x.fill_normal(rng, 1.0);
    Tensor st = make_window(dt, 8, dim, L, variant == 3, 2);
    for (int64_t e = 0; e < 8; ++e) fill_window(st, e, rng);
    Tensor w = Tensor::contiguous(dt, {dim, 4}), bias = Tensor::contiguous(dt, {dim});
    w.fill_uniform(rng, -0.7, 0.7);
    bias.fill_uniform(rng, -0.2, 0.2);
    Tensor idx = index_tensor({6, -1, 0, 3, 2}), rows = index_tensor({3, 0, -1, 1, 4});
    Tensor acc = index_tensor({1, 2, 3, 2, 1}, DType::i64);
    Tensor inter = Tensor::contiguous(dt, {5, T, dim, W1});
    inter.fill_all(kSentinel);
    // row 0 a chain, the others 0 -> {1, 2}, 1 -> 3
    std::vector<std::vector<int>> trees(B, std::vector<int>{0, 0, 0, 1});
    trees[0] = {0, 0, 1, 2};
    const TreeTables tables = tree_tables(T, trees);
    const Tensor &next = tables.next, &sib = tables.sibling;
    Tensor parents = Tensor::contiguous(DType::i32, {B, T});
    parents.fill_all(-7);
    Tensor out = Tensor::contiguous(dt, {B, dim, T});
    out.fill_all(std::nan(""));
    Mirror dev;
    dev.upload_all(x, st, w, bias, idx, rows, acc, inter, next, sib, parents, out);
    auto args = [&](auto&& view) {
      deltastate::CausalConv1dUpdateArgs a;
      a.x = view(x);
      a.conv_state = view(st);
      a.weight = view(w);
      a.bias = view(bias);
      a.silu = silu;
      a.conv_state_indices = view(idx);
      a.intermediate_conv_window = view(inter);
      a.intermediate_state_indices = view(rows);
      if (accept) a.num_accept_tokens = view(acc);
      if (tree) {
        a.retrieve_next_token = view(next);
        a.retrieve_next_sibling = view(sib);
        a.retrieve_parent_token = view(parents);
      }
      a.out = view(out);
      return a;
    };
    deltastate::causal_conv1d_update(args([&](const Tensor& t) { return dev.view(t); }));
    CUDA_CHECK(cudaDeviceSynchronize());
    deltastate::causal_conv1d_update(args(host_view));
    EXPECT_EQ(dev.download(st).bytes(), st.bytes()) << "windows, variant " << variant;
    EXPECT_EQ(dev.download(inter).bytes(), inter.bytes()) << "scratch windows, variant " << variant;
    EXPECT_EQ(dev.download(parents).bytes(), parents.bytes()) << "parents, variant " << variant;
    if (silu)
      EXPECT_TRUE(all_close(dev.download(out).values(), out.values(), {1e-5, 1e-5}, dt, 2))
          << "out, variant " << variant;
    else EXPECT_EQ(dev.download(out).bytes(), out.bytes()) << "out, variant " << variant;
  }
}

// A conv verify (per-draft windows of an EAGLE tree) and the commit of the accepted windows,
// captured into a CUDA graph and replayed, give the bytes of the same calls eager: no host
// synchronization, allocation or host-side branch on device data in either op.
TEST(ConvVerifyGpu, VerifyAndCommitReplayInAGraph) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Rng rng = test_rng();
  const int64_t B = 3, dim = 256, T = 4, W1 = 3, slots = 6;
  Tensor x = Tensor::contiguous(bf16, {B, dim, T});
  x.fill_normal(rng, 1.0);
  Tensor st = make_window(bf16, slots, dim, W1, false, 0);
  for (int64_t e = 0; e < slots; ++e) fill_window(st, e, rng);
  Tensor w = Tensor::contiguous(bf16, {dim, 4});
  w.fill_uniform(rng, -0.7, 0.7);
  Tensor idx = index_tensor({4, -1, 1}), rows = index_tensor({2, 0, 1});
  Tensor steps = index_tensor({3, -1, 1}, DType::i64);
  Tensor inter = Tensor::contiguous(bf16, {B, T, dim, W1});
  inter.fill_all(kSentinel);
  const TreeTables tables = tree_tables(T, std::vector<std::vector<int>>(B, {0, 0, 0, 1}));
  const Tensor &next = tables.next, &sib = tables.sibling;  // 0 -> {1, 2}, 1 -> 3
  Tensor parents = Tensor::contiguous(DType::i32, {B, T});
  Tensor out = Tensor::contiguous(bf16, {B, dim, T});
  Mirror eager, graph;
  for (Mirror* m : {&eager, &graph})
    m->upload_all(x, st, w, idx, rows, steps, inter, next, sib, parents, out);
  cudaStream_t stream = nullptr;
  auto step = [&](Mirror& m) {
    deltastate::CausalConv1dUpdateArgs a;
    a.x = m.view(x);
    a.conv_state = m.view(st);
    a.weight = m.view(w);
    a.silu = true;
    a.conv_state_indices = m.view(idx);
    a.intermediate_conv_window = m.view(inter);
    a.intermediate_state_indices = m.view(rows);
    a.retrieve_next_token = m.view(next);
    a.retrieve_next_sibling = m.view(sib);
    a.retrieve_parent_token = m.view(parents);
    a.out = m.view(out);
    a.stream = stream;
    deltastate::causal_conv1d_update(a);
    deltastate::ConvCommitArgs c;
    c.conv_state = m.view(st);
    c.intermediate_conv_window = m.view(inter);
    c.state_indices = m.view(idx);
    c.accepted = m.view(steps);
    c.intermediate_state_indices = m.view(rows);
    c.accepted_is_step = true;
    c.stream = stream;
    deltastate::update_conv_state_after_verify(c);
  };
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  run_eager_and_graph(step, eager, graph, stream, 3);
  for (const Tensor* t : {&st, &inter, &parents, &out})
    EXPECT_EQ(eager.download(*t).bytes(), graph.download(*t).bytes());
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// A num_accept_tokens entry outside the window on CUDA: the row is skipped (NaN output, nothing
// written) and check_errors names it.
TEST(ConvVerifyGpu, BadEntryIsReported) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Rng rng = test_rng();
  const int64_t B = 2, dim = 40, T = 3;
  Tensor x = Tensor::contiguous(f32, {B, dim, T});
  x.fill_normal(rng, 1.0);
  Tensor st = make_window(f32, 3, dim, 5, false, 0);
  for (int64_t e = 0; e < 3; ++e) fill_window(st, e, rng);
  Tensor w = Tensor::contiguous(f32, {dim, 4});
  w.fill_uniform(rng, -0.7, 0.7);
  Tensor idx = index_tensor({2, 0}), acc = index_tensor({1, 4});
  Tensor inter = Tensor::contiguous(f32, {2, T, dim, 3});
  inter.fill_all(kSentinel);
  Tensor out = Tensor::contiguous(f32, {B, dim, T});
  Mirror dev;
  for (const Tensor* t : {&x, &st, &w, &idx, &acc, &inter, &out}) dev.upload(*t);
  deltastate::CausalConv1dUpdateArgs a;
  a.x = dev.view(x);
  a.conv_state = dev.view(st);
  a.weight = dev.view(w);
  a.conv_state_indices = dev.view(idx);
  a.num_accept_tokens = dev.view(acc);
  a.intermediate_conv_window = dev.view(inter);
  a.out = dev.view(out);
  deltastate::causal_conv1d_update(a);
  const auto e = catch_error([] { deltastate::check_errors(); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(std::string(e->what()),
            "causal_conv1d_update: row 1: a step, length, accepted count or parent (4) is outside "
            "its buffer or table (limit 3); the row was skipped (state, rings and cursor "
            "untouched) and its output is NaN");
  const Tensor got = dev.download(out);
  for (int64_t i = 0; i < dim * T; ++i) ASSERT_TRUE(std::isnan(got.get_linear(dim * T + i)));
  const Tensor win = dev.download(st), scratch = dev.download(inter);
  EXPECT_EQ(window_values(win, 0), window_values(st, 0)) << "the bad row's window untouched";
  for (int64_t i = 0; i < T * dim * 3; ++i)
    ASSERT_EQ(scratch.get_linear(T * dim * 3 + i), round_to(f32, kSentinel)) << "its scratch row";
}

// A bad slot index on CUDA: the row is skipped (NaN output, nothing written) and check_errors
// names it.
TEST(FusedStepGpuErrors, BadIndexIsReported) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Rng rng = test_rng();
  const LayerCase c{{"bad", kQwen3Next, false, kNoLb, f32, bf16}, bf16};
  LayerBatch b = make_layer_batch(rng, c, {-1, 2}, 3);  // row 0 padded
  b.d.idx.set({1}, 7);
  Mirror dev;
  upload_layer_batch(dev, b, true);
  deltastate::FusedDecodeStepArgs a = b.args([&](const Tensor& t) { return dev.view(t); });
  a.check_indices = false;
  DeviceWorkspace ws;
  ws.attach(a);
  b.run_fused(a);
  const auto e = catch_error([] { deltastate::check_errors(); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(std::string(e->what()),
            "fused_decode_step: `ssm_state_indices`[1]=7 is out of range for a state pool of 3 "
            "slots (valid: 0..2; < 0 marks a padded row); the row was skipped (state, rings and "
            "cursor untouched) and its output is NaN");
  const Tensor out = dev.download(b.out);
  for (int64_t i = 0; i < 32 * 128; ++i) ASSERT_TRUE(std::isnan(out.get_linear(32 * 128 + i)));
  EXPECT_EQ(dev.download(b.state).bytes(), b.state.bytes()) << "state untouched";
  EXPECT_EQ(dev.download(b.win[0]).bytes(), b.win[0].bytes()) << "windows untouched";
}

// Row r of a view whose dim 0 is the batch, as a batch of one.
TensorView row_of(TensorView v, int64_t r) {
  v.data = static_cast<char*>(v.data) + r * v.stride[0] * v.element_size();
  v.shape[0] = 1;
  return v;
}

int sm_count() {
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  return sms;
}

// The three plans on the same inputs, each from the same starting pool: the chain (a batch the
// cluster kernel does not take, with the workspace), the CTA kernel (the same batch without it)
// and the cluster kernel (each row as a batch of one). The windows and the state agree bit for
// bit; so does the output without the norm, and with it between the chain and the CTA kernel
// (the same sum of squares; the cluster kernel adds its CTAs' partial sums in another order).
// fp32 states: the register decode kernel runs the chain's decode, whose row layout is the fused
// kernels'. The plans come from the default choice only: skipped when DELTASTATE_CUDA_FUSED
// forces one.
TEST(FusedStepGpuPlans, SameBitsEveryPlan) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (fused_forced()) GTEST_SKIP() << "DELTASTATE_CUDA_FUSED forces one plan";
  Rng rng = test_rng();
  const LayerCase cases[] = {
      LayerCase{{"qwen3next_f32", kQwen3Next, false, kNoLb, f32, f32}, f32},
      LayerCase{{"qwen3next_f32state_bf16_nonorm", kQwen3Next, false, kNoLb, f32, bf16},
                bf16,
                4,
                false,
                false,
                true,
                false},
      LayerCase{{"kimi_f32_lb_split_nonorm", kKimi, true, kLb, f32, f32},
                f32,
                4,
                false,
                true,
                true,
                false},
      LayerCase{{"kimi_bf16act_packed", kKimi, true, kNoLb, f32, bf16}, bf16},
      // the chain's norm kernel reading its share of a head as one 8-byte word (bf16, V = 128),
      // and element by element (V = 48: 2 elements per lane, f16, the width-3 conv)
      LayerCase{{"qwen3next_bf16act_norm", kQwen3Next, false, kNoLb, f32, bf16}, bf16},
      LayerCase{{"odd_v_f16_norm", Shape{"odd_v", 2, 4, 128, 48}, false, kNoLb, f32, f16}, f16, 3},
  };
  for (const LayerCase& c : cases) {
    // enough rows that 2 * B * H exceeds the SMs (fused_cluster_pays is false), one padded
    const int64_t B = std::max<int64_t>(8, sm_count() / c.shape.H + 1);
    std::vector<int64_t> idx;
    for (int64_t i = 0; i < B; ++i) idx.push_back(i == 2 ? -1 : B + 2 - i);  // distinct slots
    LayerBatch b = make_layer_batch(rng, c, idx, B + 3);
    Mirror dev;
    auto put_all = [&] { upload_layer_batch(dev, b, true); };
    struct Result {
      std::vector<uint8_t> out, state;
      std::vector<std::vector<uint8_t>> win;
    };
    auto result = [&] {
      CUDA_CHECK(cudaDeviceSynchronize());
      deltastate::check_errors();
      Result r{dev.download(b.out).bytes(), dev.download(b.state).bytes(), {}};
      for (const Tensor& w : b.win) r.win.push_back(dev.download(w).bytes());
      return r;
    };
    const auto view = [&](const Tensor& t) { return dev.view(t); };

    put_all();
    deltastate::FusedDecodeStepArgs a = b.args(view);
    DeviceWorkspace ws;
    ASSERT_GT(deltastate::fused_decode_step_workspace_bytes(a), 0) << c.name << ": the chain";
    ws.attach(a);
    b.run_fused(a);
    const Result chain = result();

    put_all();
    b.run_fused(b.args(view));  // no workspace: the CTA kernel
    const Result cta = result();

    put_all();
    for (int64_t r = 0; r < B; ++r) {
      deltastate::FusedDecodeStepArgs one = b.args(view);
      for (TensorView* t : {&one.mixed_qkv, &one.a, &one.b, &one.state_indices, &one.out})
        *t = row_of(*t, r);
      if (one.z) one.z = row_of(*one.z, r);
      ASSERT_EQ(deltastate::fused_decode_step_workspace_bytes(one), 0) << c.name << ": cluster";
      b.run_fused(one);
    }
    const Result cluster = result();

    EXPECT_EQ(chain.state, cta.state) << c.name << ": state, chain vs CTA";
    EXPECT_EQ(cluster.state, cta.state) << c.name << ": state, cluster vs CTA";
    EXPECT_EQ(chain.win, cta.win) << c.name << ": windows, chain vs CTA";
    EXPECT_EQ(cluster.win, cta.win) << c.name << ": windows, cluster vs CTA";
    EXPECT_EQ(chain.out, cta.out) << c.name << ": out, chain vs CTA";
    if (!c.norm) {
      EXPECT_EQ(cluster.out, cta.out) << c.name << ": out, cluster vs CTA";
    }
  }
}

// The workspace on CUDA: the query says 0 where the cluster kernel runs and the chain's bytes
// where the chain does; a workspace too small is an error naming it before anything is written;
// a chain forced without one is an error saying so.
TEST(FusedStepGpuPlans, Workspace) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Rng rng = test_rng();
  const LayerCase c{{"ws", kQwen3Next, false, kNoLb, f32, bf16}, bf16};
  const std::string forced = fused_forced_as();
  const int64_t big = std::max<int64_t>(8, sm_count() / c.shape.H + 1);
  for (const int64_t B : {int64_t{1}, big}) {
    std::vector<int64_t> idx;
    for (int64_t i = 0; i < B; ++i) idx.push_back(i);
    LayerBatch b = make_layer_batch(rng, c, idx, B + 1);
    Mirror dev;
    upload_layer_batch(dev, b, true);
    deltastate::FusedDecodeStepArgs a = b.args([&](const Tensor& t) { return dev.view(t); });
    const int64_t chain_bytes = (B * b.conv_dim * 2 + 15) / 16 * 16;  // bf16 conv output
    const bool chain = forced == "chain" || (forced.empty() && B == big);
    EXPECT_EQ(deltastate::fused_decode_step_workspace_bytes(a), chain ? chain_bytes : 0)
        << "B=" << B << ", DELTASTATE_CUDA_FUSED=" << forced;
    if (!chain) continue;
    DeviceWorkspace ws;
    ws.attach(a, chain_bytes - 16);
    expect_error_text([&] { b.run_fused(a); },
                      "`workspace` has " + std::to_string(chain_bytes - 16) +
                          " bytes; fused_decode_step needs " + std::to_string(chain_bytes) +
                          " (fused_decode_step_workspace_bytes)");
    if (forced == "chain") {
      a.workspace.reset();
      expect_error_text([&] { b.run_fused(a); },
                        "fused_decode_step: DELTASTATE_CUDA_FUSED=chain needs a `workspace` of " +
                            std::to_string(chain_bytes) +
                            " bytes (fused_decode_step_workspace_bytes); none was given");
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(dev.download(b.state).bytes(), b.state.bytes()) << "state untouched, B=" << B;
    EXPECT_EQ(dev.download(b.win[0]).bytes(), b.win[0].bytes()) << "windows untouched, B=" << B;
  }
}

// ---- the ReplaySSM chain plan against the one-launch kernel -------------------------------------
#if defined(DELTASTATE_TEST_ALL_KERNELS)
constexpr bool kAllKernels = true;
#else
constexpr bool kAllKernels = false;
#endif

struct ReplayPlanCase {
  LayerCase layer;
  DType d_dtype, k_dtype;
};

// Whether replayssm_decode takes its vector path (replayssm_decode.cu launch_fast) on the chain's
// decode: the full build; the conv output (mixed_qkv's dtype), a, b and the k ring all fp32 or
// all bf16; the d ring in the state dtype; V a multiple of 8 (the rows here are aligned).
bool replay_vector_path(const ReplayPlanCase& rc) {
  const LayerCase& c = rc.layer;
  const bool inputs = (c.act == f32 || c.act == bf16) && rc.k_dtype == c.act;
  return kAllKernels && inputs && rc.d_dtype == c.state && c.shape.V % 8 == 0 &&
         (c.shape.K == 64 || c.shape.K == 128);
}

// The ReplaySSM fused step against our unfused ReplaySSM chain (causal_conv1d_update into a
// [B, conv_dim] buffer, then replayssm_decode into [B, 1, HV, V]) on the same inputs over L + 2
// steps (appends, flushes at L-1, forced flushes, a padded row), each side on its own copies of
// the windows, checkpoints, rings and cursors. No norm: the unfused chain has no norm op.
//  - The windows and the cursors agree bit for bit on every plan (the same conv device function,
//    the same flush rule).
//  - On the fused step's ReplaySSM chain (the default; DELTASTATE_CUDA_FUSED=chain) it runs the
//    unfused chain's own kernels through the same dispatch: the checkpoints, ring records and
//    outputs agree bit for bit too, on every case.
//  - On the one-launch kernel (DELTASTATE_CUDA_FUSED=cta) they agree bit for bit where
//  replayssm_decode takes
//    its vector path (replay_vector_path): its rows then have the one-launch kernel's
//    RowLayout<StateT, K> and every fp32 sum runs in the same order (the q/k norms and k.q by
//    prepare_qk, the per-record pass's G_j and Gtot in record order with the same lane columns,
//    the checkpoint dots, the ring terms of lane l's records l, l + G, .., one transposed
//    reduction, the flush's rebuild in record order). Its generic kernel (the only one of
//    DELTASTATE_CUDA_ALL_KERNELS=OFF builds, and of mixed dtypes) is RowLayout<StateT, 256>: K
//    splits over the lanes in other slices, so those sums run in other orders and only the
//    windows and cursors are compared (the values within tolerance: FusedReplayGpu).
// scripts/device.sh test-layer runs this in both modes, so together they compare the chain with
// the one-launch kernel. With the norm the two plans also agree on the vector path: the chain's
// norm kernel is the plain chain's, whose bits FusedStepGpuPlans shows equal to the CTA kernel's
// norm (fused_store_outputs), which the one-launch ReplaySSM kernel runs.
TEST(FusedReplayGpuPlans, SameBitsAsUnfusedChain) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::string forced = fused_forced_as();
  if (forced == "cluster") GTEST_SKIP() << "ReplaySSM's forced cluster is the forced CTA run's";
  const bool chain = forced != "cta";  // the chain by default; the one-launch kernel forced
  Rng rng = test_rng();
  const ReplayPlanCase cases[] = {
      {LayerCase{{"qwen3next_f32_nonorm", kQwen3Next, false, kNoLb, f32, f32},
                 f32,
                 4,
                 false,
                 false,
                 true,
                 false},
       f32, f32},
      {LayerCase{{"kimi_bf16_bf16rings_nonorm", kKimi, true, kNoLb, bf16, bf16},
                 bf16,
                 4,
                 false,
                 false,
                 true,
                 false},
       bf16, bf16},
      {LayerCase{{"qwen3next_f32state_bf16_nonorm", kQwen3Next, false, kNoLb, f32, bf16},
                 bf16,
                 4,
                 false,
                 false,
                 true,
                 false},
       f32, f32},
  };
  const int L = 4;
  for (const ReplayPlanCase& rc : cases) {
    const LayerCase& c = rc.layer;
    const Shape& s = c.shape;
    const bool all_bits = chain || replay_vector_path(rc);
    const int64_t B = 24, slots = B + 3;
    const std::vector<int64_t> idx = pick_slots(rng, B, slots, std::vector<int64_t>{1});
    LayerBatch b = make_layer_batch(rng, c, idx, slots);
    Rings rings = make_rings(s, c.kda, slots, L, rc.d_dtype, rc.k_dtype);
    Tensor wp = index_tensor(std::vector<int64_t>(static_cast<size_t>(B), 0));
    // the unfused chain's own copies, its conv output and its contiguous `a`
    Tensor state2 = clone(b.state), win2 = clone(b.win[0]), wp2 = clone(wp);
    Rings rings2{L, clone(rings.d), clone(rings.k), clone(rings.g)};
    Tensor y = Tensor::contiguous(c.act, {B, b.conv_dim});
    const int64_t gw = c.kda ? static_cast<int64_t>(s.HV) * s.K : s.HV;
    Tensor a2 = Tensor::contiguous(c.act, {B, gw});
    Tensor o2 = Tensor::contiguous(c.act, {B, 1, s.HV, s.V});
    Mirror dev;
    for (const Tensor* t :
         {&b.d.A_log, &b.d.dt_bias, &b.d.idx, &b.weight, &b.bias, &b.state, &b.win[0], &rings.d,
          &rings.k, &rings.g, &wp, &state2, &win2, &rings2.d, &rings2.k, &rings2.g, &wp2, &y})
      dev.upload(*t);
    const auto view = [&](const Tensor& t) { return dev.view(t); };
    DeviceWorkspace ws;
    for (int step = 0; step < L + 2; ++step) {
      if (step > 0) b.d.randomize(rng);
      std::vector<int64_t> force;
      for (int64_t r = 0; r < B; ++r) force.push_back(step > 0 && rng.chance(0.2) ? 1 : 0);
      Tensor ff = index_tensor(force);
      for (int64_t r = 0; r < B; ++r)
        for (int64_t i = 0; i < gw; ++i) a2.set({r, i}, b.d.a.get({r, i}));
      b.poison_out();
      o2.fill_all(std::nan(""));
      for (const Tensor* t : {&b.d.x, &b.d.a, &b.d.b, &b.out, &ff, &a2, &o2}) dev.upload(*t);

      deltastate::FusedDecodeStepArgs fa = b.args(view);
      add_replay(fa, view, rings, wp, &ff, true);
      ws.attach(fa);
      if (chain) {
        ASSERT_NE(fa.workspace, std::nullopt) << c.name << ": the chain's workspace";
      } else {
        ASSERT_EQ(fa.workspace, std::nullopt) << c.name << ": the one-launch kernel needs none";
      }
      b.run_fused(fa);

      deltastate::CausalConv1dUpdateArgs ca;
      ca.x = view(b.d.x);
      ca.conv_state = view(win2);
      ca.weight = view(b.weight);
      if (c.bias) ca.bias = view(b.bias);
      ca.silu = fa.conv_silu;
      ca.conv_state_indices = view(b.d.idx);
      ca.out = view(y);
      deltastate::causal_conv1d_update(ca);
      deltastate::ReplayDecodeArgs ra;
      ra.mixed_qkv = view(y);
      ra.a = view(a2);
      ra.b = view(b.d.b);
      ra.A_log = view(b.d.A_log);
      ra.dt_bias = view(b.d.dt_bias);
      ra.state = view(state2);
      ra.d_cache = view(rings2.d);
      ra.k_cache = view(rings2.k);
      ra.g_cache = view(rings2.g);
      ra.out = view(o2);
      ra.state_indices = view(b.d.idx);
      ra.write_pos = view(wp2);
      ra.force_flush = view(ff);
      ra.is_kda = c.kda;
      ra.lower_bound = c.lower_bound;
      ra.advance_write_pos = true;
      deltastate::replayssm_decode(ra);
      CUDA_CHECK(cudaDeviceSynchronize());
      deltastate::check_errors();

      const std::string at = std::string(c.name) + ", step " + std::to_string(step);
      EXPECT_EQ(dev.download(b.win[0]).bytes(), dev.download(win2).bytes()) << "windows, " << at;
      EXPECT_EQ(index_values(dev.download(wp)), index_values(dev.download(wp2)))
          << "cursors, " << at;
      if (!all_bits) continue;
      EXPECT_EQ(dev.download(b.out).bytes(), dev.download(o2).bytes()) << "out, " << at;
      EXPECT_EQ(dev.download(b.state).bytes(), dev.download(state2).bytes())
          << "checkpoints, " << at;
      EXPECT_EQ(dev.download(rings.d).bytes(), dev.download(rings2.d).bytes()) << "d ring, " << at;
      EXPECT_EQ(dev.download(rings.k).bytes(), dev.download(rings2.k).bytes()) << "k ring, " << at;
      EXPECT_EQ(dev.download(rings.g).bytes(), dev.download(rings2.g).bytes()) << "g ring, " << at;
    }
  }
}

// The ReplaySSM workspace on CUDA: the query says the chain's bytes by default and under
// DELTASTATE_CUDA_FUSED=chain and 0 for the one-launch kernel (=cta, =cluster); a workspace too
// small is an error naming it and, with the chain forced, none at all the plain mode's error,
// each before anything is written.
TEST(FusedReplayGpuPlans, Workspace) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Rng rng = test_rng();
  const LayerCase c{{"ws", kQwen3Next, false, kNoLb, f32, bf16}, bf16};
  // The chain by default and where forced; DELTASTATE_CUDA_FUSED=cta or =cluster: the one-launch
  // kernel, no workspace.
  const std::string forced = fused_forced_as();
  const bool chain = forced.empty() || forced == "chain";
  const int64_t B = 3;
  LayerBatch b = make_layer_batch(rng, c, {0, -1, 2}, 4);
  Rings rings = make_rings(c.shape, false, 4, 4, f32, f32);
  Tensor wp = index_tensor({0, 0, 3});
  Mirror dev;
  deltastate::FusedDecodeStepArgs a = replay_step_on_device(dev, b, rings, wp);
  const int64_t chain_bytes = (B * b.conv_dim * 2 + 15) / 16 * 16;  // bf16 conv output
  EXPECT_EQ(deltastate::fused_decode_step_workspace_bytes(a), chain ? chain_bytes : 0)
      << "DELTASTATE_CUDA_FUSED=" << fused_forced_as();
  if (!chain) return;
  DeviceWorkspace ws;
  ws.attach(a, chain_bytes - 16);
  expect_error_text([&] { b.run_fused(a); }, "`workspace` has " + std::to_string(chain_bytes - 16) +
                                                 " bytes; fused_decode_step needs " +
                                                 std::to_string(chain_bytes) +
                                                 " (fused_decode_step_workspace_bytes)");
  a.workspace.reset();
  if (forced == "chain") {  // by default, no workspace is the one-launch kernel
    expect_error_text([&] { b.run_fused(a); },
                      "fused_decode_step: DELTASTATE_CUDA_FUSED=chain needs a `workspace` of " +
                          std::to_string(chain_bytes) +
                          " bytes (fused_decode_step_workspace_bytes); none was given");
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(dev.download(b.state).bytes(), b.state.bytes()) << "checkpoints untouched";
  EXPECT_EQ(dev.download(b.win[0]).bytes(), b.win[0].bytes()) << "windows untouched";
  EXPECT_EQ(dev.download(rings.d).bytes(), rings.d.bytes()) << "d ring untouched";
  EXPECT_EQ(index_values(dev.download(wp)), index_values(wp)) << "cursors untouched";
}

}  // namespace
}  // namespace dstest
