// ReplaySSM decode with SGLang's ring modes (circular replay with cache_base, prefix gates) on a
// checkpoint in its storage format (float8_e4m3fn / int8 with per-row fp32 scales, bf16 rounded
// stochastically) on the CUDA backend (src/cuda/replayssm/modes.cuh, replay_modes_kernel<true>)
// against the CPU backend, the oracle. Tolerances as tests/gpu/test_state_format_gpu.cpp's
// GpuQuantizedReplay: outputs, the pool's float rings to fp32 tolerance, a flushed row's
// checkpoint (a history checkpoint or a fold) within one quantum, every other byte untouched, the
// cursors and cache_base exact, the step counter once per call. Every test skips when no CUDA
// device is present.
#include <cmath>
#include <string>
#include <vector>

#include "gpu/gpu_util.h"
#include "gpu/quant_pools.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::StateRounding;

struct ModesFmtCase {
  const char* name;
  bool kda;
  Shape shape;
  DType dtype;
  StateRounding rounding;
  bool circular, prefix;
};
void PrintTo(const ModesFmtCase& c, std::ostream* os) { *os << c.name; }

class GpuReplayModesFormat : public GpuParamTest<ModesFmtCase> {};

// Six steps (L = 3) from random ring origins, natural flushes (a history checkpoint when
// circular) and a forced one (a fold), the cursors and bases advanced by the op; each step from
// the CPU's pool on both backends.
TEST_P(GpuReplayModesFormat, CheckpointMatchesCpu) {
  const ModesFmtCase& c = GetParam();
  const Shape& s = c.shape;
  const int64_t layer = 1, L = 3;
  Rng rng = test_rng();
  const std::vector<int64_t> slots{7, -1, 2, 5};
  const QuantPools q = make_quant_pools(s, c.dtype, c.rounding, deltastate::PoolLayout::per_layer,
                                        2, 9, blocks_of(layer, slots), rng, L, c.kda);
  DecodeBatch batch = make_decode_batch(rng, s, c.kda, slots, bf16);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.K));
  std::vector<int64_t> cursor(slots.size(), 0), bases(slots.size(), 0);
  for (size_t n = 0; n < slots.size(); ++n)
    if (slots[n] >= 0 && c.circular) bases[n] = rng.integer(0, L - 1);
  Tensor wp = index_tensor(cursor), ff = index_tensor({0, 0, 0, 0}), cb = index_tensor(bases);
  const deltastate::StatePool& host = *q.host;
  const std::vector<TensorView> rings = ring_views(host, layer);
  Mirror m;
  int flushes = 0;
  for (int step = 0; step < 6; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step) batch.randomize(rng);
    batch.poison_out();
    for (size_t n = 0; n < slots.size(); ++n) {
      wp.set_linear(static_cast<int64_t>(n), cursor[n]);
      cb.set_linear(static_cast<int64_t>(n), bases[n]);
    }
    ff.set_linear(2, step == 4 ? 1 : 0);
    std::vector<Block> flushed;
    for (size_t n = 0; n < slots.size(); ++n)
      if (slots[n] >= 0 && (cursor[n] == L - 1 || ff.get_linear(static_cast<int64_t>(n)) != 0))
        flushed.push_back({layer, slots[n]});
    flushes += static_cast<int>(flushed.size());
    m.upload_all(batch.x, batch.a, batch.b, batch.A_log, batch.dt_bias, batch.idx, batch.out, wp,
                 ff, cb);
    auto run = [&](auto&& view_of, const deltastate::StatePool& p) {
      deltastate::ReplayDecodeArgs a =
          replay_args(view_of, batch, p.layer_state(layer), p.d_cache(layer), p.k_cache(layer),
                      p.g_cache(layer), wp, &ff, scale);
      a.state_format = format_of(p, layer, c.rounding);
      a.advance_write_pos = true;
      if (c.circular) {
        a.circular_replay = true;
        a.cache_base = view_of(cb);
      }
      a.prefix_gate_cache = c.prefix;
      deltastate::replayssm_decode(a);
    };
    run(host_view, host);
    run(m.views(), *q.dev);
    expect_replay_step_matches(m, batch, slots, q, c.dtype, wp, rings, flushed, layer, step);
    EXPECT_EQ(m.download(cb).values(), cb.values()) << "cache_base";
    for (size_t n = 0; n < slots.size(); ++n) {
      cursor[n] = static_cast<int64_t>(wp.get_linear(static_cast<int64_t>(n)));
      bases[n] = static_cast<int64_t>(cb.get_linear(static_cast<int64_t>(n)));
    }
  }
  EXPECT_GE(flushes, 5);
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuReplayModesFormat,
    ::testing::Values(ModesFmtCase{"gdn_fp8_sr_circular", false, kQwen3Next, DType::f8e4m3,
                                   StateRounding::stochastic, true, false},
                      ModesFmtCase{"gdn_int8_rn_circular", false, kQwen3Next, DType::i8,
                                   StateRounding::nearest, true, false},
                      ModesFmtCase{"kda_fp8_default_circular_prefix", true, kKimi, DType::f8e4m3,
                                   StateRounding::format_default, true, true},
                      ModesFmtCase{"kda_int8_rn_prefix", true, kKimi, DType::i8,
                                   StateRounding::nearest, false, true},
                      // the odd shape: K = 32, V = 48, two value heads per key head
                      ModesFmtCase{"kda_odd_int8_sr_circular_prefix", true, kOdd, DType::i8,
                                   StateRounding::stochastic, true, true},
                      ModesFmtCase{"gdn_odd_bf16_sr_circular", false, kOdd, DType::bf16,
                                   StateRounding::stochastic, true, false}),
    case_name<ModesFmtCase>);

}  // namespace
}  // namespace dstest
