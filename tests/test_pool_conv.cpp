// StatePool's conv windows: the views of both layouts (SGLang's window-contiguous, vLLM's
// dim-contiguous), packed and split q/k/v windows, the envelope entry holding conv windows and
// states of every layer without overlap, allocate zeroing and fork copying the windows, the byte
// accounting, and the error texts. The speculative-verify scratch (intermediate states and conv
// windows) beside them, and the every-layer views the commits take.
#include <cstring>
#include <set>

#include "test_util.h"

namespace dstest {
namespace {

using deltastate::ConvLayout;
using deltastate::ErrorKind;
using deltastate::PoolLayout;
using deltastate::StatePool;
using deltastate::StatePoolConfig;

// H=2, HV=4, V=16, K=8: conv_dim = 2*2*8 + 4*16 = 96; width 4 (3 entries); bf16 windows.
StatePoolConfig conv_config(PoolLayout layout, ConvLayout cl, bool split) {
  StatePoolConfig c;
  c.layers = 3;
  c.slots = 4;
  c.H = 2;
  c.HV = 4;
  c.V = 16;
  c.K = 8;
  c.layout = layout;
  c.envelope_extra_bytes = layout == PoolLayout::envelope ? 40 : 0;
  c.conv_dim = 96;
  c.conv_dtype = DType::bf16;
  c.conv_layout = cl;
  c.conv_split_qkv = split;
  return c;
}

// Every byte of every element of a view, as addresses.
std::set<const char*> bytes_of(const TensorView& v) {
  std::set<const char*> out;
  const int64_t isz = v.element_size();
  std::vector<int64_t> i(static_cast<size_t>(v.ndim), 0);
  for (;;) {
    int64_t off = 0;
    for (int d = 0; d < v.ndim; ++d) off += i[d] * v.stride[d];
    for (int64_t b = 0; b < isz; ++b) out.insert(static_cast<const char*>(v.data) + off * isz + b);
    int d = v.ndim - 1;
    while (d >= 0 && ++i[d] == v.shape[d]) i[d--] = 0;
    if (d < 0) break;
  }
  return out;
}

struct PoolConvCase {
  const char* name;
  PoolLayout layout;
  ConvLayout conv;
  bool split;
};
inline void PrintTo(const PoolConvCase& c, std::ostream* os) { *os << c.name; }
class PoolConv : public ::testing::TestWithParam<PoolConvCase> {};

TEST_P(PoolConv, ViewsDisjointClearedForked) {
  const PoolConvCase& pc = GetParam();
  const StatePoolConfig cfg = conv_config(pc.layout, pc.conv, pc.split);
  StatePool pool(cfg);
  const int64_t n = cfg.physical_slots();
  // shapes and strides of the views
  const int64_t dims[3] = {16, 16, 64};
  std::set<const char*> seen;
  auto add_disjoint = [&](const TensorView& v, const std::string& what) {
    for (const char* p : bytes_of(v)) {
      ASSERT_TRUE(seen.insert(p).second) << what << " overlaps another view";
      ASSERT_GE(p, static_cast<const char*>(pool.data()));
      ASSERT_LT(p, static_cast<const char*>(pool.data()) + pool.total_bytes());
    }
  };
  for (int64_t l = 0; l < cfg.layers; ++l) {
    add_disjoint(pool.layer_state(l), "state of layer " + std::to_string(l));
    for (int part = 0; part < 3; ++part) {
      const TensorView v = pool.conv_state(l, part);
      EXPECT_EQ(v.ndim, 3);
      EXPECT_EQ(v.shape[0], n);
      EXPECT_EQ(v.shape[1], dims[part]);
      EXPECT_EQ(v.shape[2], 3);
      EXPECT_EQ(v.dtype, DType::bf16);
      const int64_t stored_dim = pc.split ? dims[part] : 96;
      if (pc.conv == ConvLayout::dim_contiguous) {
        EXPECT_EQ(v.stride[1], 1);
        EXPECT_EQ(v.stride[2], stored_dim);
      } else {
        EXPECT_EQ(v.stride[1], 3);
        EXPECT_EQ(v.stride[2], 1);
      }
      if (pc.layout == PoolLayout::envelope)
        EXPECT_EQ(v.stride[0], pool.layer_state(0).stride[0] * 4 / 2) << "the entry's pitch";
      else EXPECT_EQ(v.stride[0], stored_dim * 3);
      add_disjoint(v, "conv part " + std::to_string(part) + " of layer " + std::to_string(l));
    }
    if (!pc.split) {
      const TensorView packed = pool.conv_state(l);
      EXPECT_EQ(packed.shape[1], 96);
      EXPECT_EQ(static_cast<const char*>(pool.conv_state(l, 1).data) -
                    static_cast<const char*>(packed.data),
                16 * packed.stride[1] * 2)
          << "k follows q in the packed window";
    }
  }
  if (pc.layout == PoolLayout::envelope) {  // every view of slot 1 lies inside entry 1
    const char* entry = static_cast<const char*>(pool.envelope_extra(1));
    const int64_t pitch = pool.layer_state(0).stride[0] * 4;
    for (int64_t l = 0; l < cfg.layers; ++l)
      for (int part = 0; part < 3; ++part) {
        const TensorView v = pool.conv_state(l, part);
        const char* p = static_cast<const char*>(v.data) + v.stride[0] * 2;
        EXPECT_GE(p, entry + 40);
        EXPECT_LT(p, entry + pitch);
      }
  }

  // allocate zeroes a slot's windows; fork copies them (every layer, every part)
  fill_sentinel(pool.data(), pool.total_bytes(), DType::f32);
  const int64_t a = pool.allocate(), b = pool.allocate();
  Rng rng = test_rng();
  // f(view, element offset within a slot) for every window element of every layer and part
  auto each_element = [&](auto f) {
    for (int64_t l = 0; l < cfg.layers; ++l)
      for (int part = 0; part < 3; ++part) {
        const TensorView v = pool.conv_state(l, part);
        for (int64_t c = 0; c < v.shape[1]; ++c)
          for (int64_t i = 0; i < 3; ++i) f(v, c * v.stride[1] + i * v.stride[2]);
      }
  };
  each_element([&](const TensorView& v, int64_t off) {
    EXPECT_EQ(load_value(v.data, v.dtype, a * v.stride[0] + off), 0.0) << "cleared";
    store_value(v.data, v.dtype, a * v.stride[0] + off, rng.uniform(-1, 1));
  });
  pool.fork(a, b);
  each_element([&](const TensorView& v, int64_t off) {
    EXPECT_EQ(load_value(v.data, v.dtype, b * v.stride[0] + off),
              load_value(v.data, v.dtype, a * v.stride[0] + off))
        << "forked";
  });
}

// Both window layouts, packed and split windows, both pool layouts.
const auto kPoolConvCases = ::testing::Values(
    PoolConvCase{"per_layer_sglang", PoolLayout::per_layer, ConvLayout::window_contiguous, false},
    PoolConvCase{"per_layer_vllm", PoolLayout::per_layer, ConvLayout::dim_contiguous, false},
    PoolConvCase{"per_layer_split", PoolLayout::per_layer, ConvLayout::window_contiguous, true},
    PoolConvCase{"per_layer_vllm_split", PoolLayout::per_layer, ConvLayout::dim_contiguous, true},
    PoolConvCase{"envelope_sglang", PoolLayout::envelope, ConvLayout::window_contiguous, false},
    PoolConvCase{"envelope_vllm_split", PoolLayout::envelope, ConvLayout::dim_contiguous, true});

INSTANTIATE_TEST_SUITE_P(Layouts, PoolConv, kPoolConvCases, case_name<PoolConvCase>);

TEST(PoolConvAccounting, CountsTheWindows) {
  for (PoolLayout layout : {PoolLayout::per_layer, PoolLayout::envelope}) {
    StatePoolConfig with = conv_config(layout, ConvLayout::window_contiguous, false);
    StatePoolConfig without = with;
    without.conv_dim = 0;
    const int64_t conv_bytes = 3 * 96 * 3 * 2;  // layers * conv_dim * (W-1) * bf16
    if (layout == PoolLayout::per_layer)
      EXPECT_EQ(StatePool::bytes_per_slot(with) - StatePool::bytes_per_slot(without), conv_bytes);
    else
      EXPECT_GE(StatePool::bytes_per_slot(with) - StatePool::bytes_per_slot(without), conv_bytes);
    EXPECT_GE(StatePool::required_bytes(with) - StatePool::required_bytes(without),
              conv_bytes * with.physical_slots());
    const int64_t budget = StatePool::required_bytes(without);
    EXPECT_LT(StatePool::slots_for_budget(with, budget), with.slots);
  }
}

TEST(PoolConvContract, ErrorTexts) {
  auto expect_error = [](StatePoolConfig c, const std::string& message) {
    const auto e = catch_error([&] { StatePool p(c); });
    if (!e) return;
    EXPECT_EQ(std::string(e->what()), message);
    EXPECT_EQ(e->kind(), ErrorKind::value);
  };
  StatePoolConfig c = conv_config(PoolLayout::per_layer, ConvLayout::window_contiguous, false);
  c.conv_dim = -1;
  expect_error(c, "StatePool conv_dim must be >= 0; got -1");
  c = conv_config(PoolLayout::per_layer, ConvLayout::window_contiguous, false);
  c.conv_width = 5;
  expect_error(c, "StatePool conv_width must be 2..4 (causal_conv1d's widths); got 5");
  c = conv_config(PoolLayout::per_layer, ConvLayout::window_contiguous, false);
  c.conv_dtype = DType::i32;
  expect_error(c, "StatePool conv_dtype must be float32, bfloat16 or float16; got int32");
  c = conv_config(PoolLayout::per_layer, ConvLayout::window_contiguous, true);
  c.conv_dim = 95;
  expect_error(c,
               "StatePool conv_split_qkv needs H >= 1 and conv_dim = 2*H*K + HV*V; got H=2, "
               "conv_dim=95 (2*H*K + HV*V = 96)");
  c.conv_dim = 0;
  expect_error(c, "StatePool conv_split_qkv needs conv_dim > 0");

  StatePool none(conv_config(PoolLayout::per_layer, ConvLayout::window_contiguous, false));
  StatePool split(conv_config(PoolLayout::per_layer, ConvLayout::window_contiguous, true));
  StatePoolConfig nc = conv_config(PoolLayout::per_layer, ConvLayout::window_contiguous, false);
  nc.conv_dim = 0;
  StatePool noconv(nc);
  auto view_error = [](const std::function<void()>& f, const std::string& message) {
    const auto e = catch_error(f);
    if (e) {
      EXPECT_EQ(std::string(e->what()), message);
    }
  };
  view_error([&] { noconv.conv_state(0); },
             "StatePool has no conv windows (configure conv_dim > 0 to create them)");
  view_error([&] { none.conv_state(3); },
             "StatePool: layer 3 is out of range for a pool of 3 layers");
  view_error([&] { none.conv_state(0, 3); },
             "StatePool.conv_state: part must be -1 (packed), 0 (q), 1 (k) or 2 (v); got 3");
  view_error([&] { split.conv_state(0); },
             "StatePool.conv_state: the pool keeps separate q, k, v windows (conv_split_qkv); pass "
             "part 0, 1 or 2");
  StatePoolConfig odd = conv_config(PoolLayout::per_layer, ConvLayout::window_contiguous, false);
  odd.conv_dim = 50;
  StatePool oddp(odd);
  view_error([&] { oddp.conv_state(0, 0); },
             "StatePool.conv_state: the q, k, v parts of a packed window need H with conv_dim = "
             "2*H*K + HV*V; got H=2, conv_dim=50");
}

// ---- the speculative-verify scratch and the every-layer views ---------------------------------
// A view of `v` with its leading dimension fixed at i.
void expect_same_view(const TensorView& a, const TensorView& b, const std::string& what) {
  EXPECT_EQ(a.data, b.data) << what;
  EXPECT_EQ(a.dtype, b.dtype) << what;
  ASSERT_EQ(a.ndim, b.ndim) << what;
  for (int d = 0; d < a.ndim; ++d) {
    EXPECT_EQ(a.shape[d], b.shape[d]) << what << ", dim " << d;
    EXPECT_EQ(a.stride[d], b.stride[d]) << what << ", dim " << d;
  }
}

class PoolSpec : public ::testing::TestWithParam<PoolConvCase> {};

TEST_P(PoolSpec, ScratchViewsDisjointUntouchedBySlots) {
  const PoolConvCase& pc = GetParam();
  StatePoolConfig cfg = conv_config(pc.layout, pc.conv, pc.split);
  cfg.spec_rows = 3;
  cfg.spec_steps = 5;
  StatePool pool(cfg);
  const int64_t dims[3] = {16, 16, 64};
  const std::vector<int> parts = pc.split ? std::vector<int>{0, 1, 2} : std::vector<int>{-1};
  // the every-layer views are the layer views stacked
  for (int64_t l = 0; l < cfg.layers; ++l) {
    expect_same_view(sub_view(pool.states(), l), pool.layer_state(l), "states() layer");
    expect_same_view(sub_view(pool.intermediate_states(), l), pool.intermediate_states(l),
                     "intermediate_states() layer");
    for (int part : {-1, 0, 1, 2}) {
      if (pc.split && part < 0) continue;
      expect_same_view(sub_view(pool.conv_states(part), l), pool.conv_state(l, part),
                       "conv_states(" + std::to_string(part) + ") layer");
      expect_same_view(sub_view(pool.intermediate_conv_windows(part), l),
                       pool.intermediate_conv_window(l, part),
                       "intermediate_conv_windows(" + std::to_string(part) + ") layer");
    }
  }
  // shapes, dtypes, strides: the scratch windows in the pool's conv layout
  const TensorView is = pool.intermediate_states(1);
  EXPECT_EQ(is.ndim, 5);
  EXPECT_EQ(is.shape[0], 3);
  EXPECT_EQ(is.shape[1], 5);
  EXPECT_EQ(is.stride[1], 4 * 16 * 8);
  EXPECT_EQ(is.stride[0], 5 * 4 * 16 * 8);
  for (int part = 0; part < 3; ++part) {
    const TensorView w = pool.intermediate_conv_window(2, part);
    EXPECT_EQ(w.ndim, 4);
    EXPECT_EQ(w.shape[0], 3);
    EXPECT_EQ(w.shape[1], 5);
    EXPECT_EQ(w.shape[2], dims[part]);
    EXPECT_EQ(w.shape[3], 3);
    EXPECT_EQ(w.dtype, DType::bf16);
    const int64_t stored_dim = pc.split ? dims[part] : 96;
    EXPECT_EQ(w.stride[1], stored_dim * 3);
    EXPECT_EQ(w.stride[2], pc.conv == ConvLayout::dim_contiguous ? 1 : 3);
    EXPECT_EQ(w.stride[3], pc.conv == ConvLayout::dim_contiguous ? stored_dim : 1);
  }
  // every view disjoint from every other, all inside the pool
  std::set<const char*> seen;
  auto add_disjoint = [&](const TensorView& v, const std::string& what) {
    for (const char* p : bytes_of(v)) {
      ASSERT_TRUE(seen.insert(p).second) << what << " overlaps another view";
      ASSERT_GE(p, static_cast<const char*>(pool.data()));
      ASSERT_LT(p, static_cast<const char*>(pool.data()) + pool.total_bytes());
    }
  };
  add_disjoint(pool.states(), "states");
  for (int part : parts) add_disjoint(pool.conv_states(part), "conv_states");
  add_disjoint(pool.intermediate_states(), "intermediate_states");
  for (int part : parts) add_disjoint(pool.intermediate_conv_windows(part), "intermediate windows");
  add_disjoint(pool.write_pos(), "write_pos");
  // allocate (clear) and fork leave the scratch alone
  Rng rng = test_rng();
  auto fill = [&](const TensorView& v) {
    for (const char* p : bytes_of(v)) *const_cast<char*>(p) = static_cast<char>(rng.integer(1, 99));
  };
  fill(pool.intermediate_states());
  for (int part : parts) fill(pool.intermediate_conv_windows(part));
  Snapshot before;
  const TensorView first = pool.intermediate_states();
  const int64_t spec = StatePool::spec_bytes(cfg);
  before.add(first.data, spec);
  const int64_t a = pool.allocate(), b = pool.allocate();
  pool.fork(a, b);
  EXPECT_TRUE(before.unchanged()) << "the scratch after allocate and fork";
}

INSTANTIATE_TEST_SUITE_P(Layouts, PoolSpec, kPoolConvCases, case_name<PoolConvCase>);

TEST(PoolSpecAccounting, CountsTheScratchOnce) {
  for (PoolLayout layout : {PoolLayout::per_layer, PoolLayout::envelope}) {
    StatePoolConfig without = conv_config(layout, ConvLayout::window_contiguous, false);
    StatePoolConfig with = without;
    with.spec_rows = 3;
    with.spec_steps = 5;
    const int64_t states = 3 * 3 * 5 * 4 * 16 * 8 * 4;  // layers*rows*steps*HV*V*K*fp32
    const int64_t windows = 3 * 3 * 5 * 96 * 3 * 2;     // layers*rows*steps*conv_dim*(W-1)*bf16
    EXPECT_EQ(StatePool::spec_bytes(without), 0);
    EXPECT_GE(StatePool::spec_bytes(with), states + windows);
    EXPECT_LT(StatePool::spec_bytes(with), states + windows + 4 * 256);  // alignment only
    EXPECT_EQ(StatePool::required_bytes(with) - StatePool::required_bytes(without),
              StatePool::spec_bytes(with));
    EXPECT_EQ(StatePool::bytes_per_slot(with), StatePool::bytes_per_slot(without))
        << "the scratch is not per slot";
    // a budget that holds the pool without the scratch holds fewer slots with it
    StatePoolConfig big = without;
    big.slots = 40;
    StatePoolConfig big_spec = big;
    big_spec.spec_rows = 3;
    big_spec.spec_steps = 5;
    const int64_t budget = StatePool::required_bytes(big);
    EXPECT_EQ(StatePool::slots_for_budget(big, budget), 40);
    const int64_t fit = StatePool::slots_for_budget(big_spec, budget);
    EXPECT_LT(fit, 40);
    big_spec.slots = fit;
    EXPECT_LE(StatePool::required_bytes(big_spec), budget);
    big_spec.slots = fit + 1;
    EXPECT_GT(StatePool::required_bytes(big_spec), budget);
  }
}

TEST(PoolSpecContract, ErrorTexts) {
  StatePoolConfig c = conv_config(PoolLayout::per_layer, ConvLayout::window_contiguous, false);
  c.spec_rows = 2;
  const auto e = catch_error([&] { StatePool p(c); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(std::string(e->what()),
            "StatePool spec_rows and spec_steps go together (both >= 1 for a speculative-verify "
            "scratch, both 0 for none); got spec_rows=2, spec_steps=0");
  c.spec_steps = -1;
  EXPECT_TRUE(catch_error([&] { StatePool p(c); }).has_value());
  StatePool plain(conv_config(PoolLayout::per_layer, ConvLayout::window_contiguous, false));
  auto view_error = [](const std::function<void()>& f, const std::string& message) {
    const auto err = catch_error(f);
    ASSERT_TRUE(err.has_value()) << "no error; expected: " << message;
    EXPECT_EQ(std::string(err->what()), message);
  };
  const std::string none =
      "StatePool has no speculative-verify scratch (configure spec_rows and spec_steps >= 1 to "
      "create it)";
  view_error([&] { plain.intermediate_states(); }, none);
  view_error([&] { plain.intermediate_states(0); }, none);
  view_error([&] { plain.intermediate_conv_window(0); }, none);
  c.spec_steps = 4;
  c.conv_dim = 0;
  StatePool noconv(c);
  view_error([&] { noconv.intermediate_conv_windows(); },
             "StatePool has no conv windows (configure conv_dim > 0 to create them)");
  view_error([&] { noconv.conv_states(); },
             "StatePool has no conv windows (configure conv_dim > 0 to create them)");
  view_error([&] { noconv.intermediate_states(3); },
             "StatePool: layer 3 is out of range for a pool of 3 layers");
  StatePoolConfig sc = conv_config(PoolLayout::per_layer, ConvLayout::window_contiguous, true);
  sc.spec_rows = sc.spec_steps = 2;
  StatePool split(sc);
  view_error([&] { split.intermediate_conv_window(0); },
             "StatePool.intermediate_conv_window: the pool keeps separate q, k, v windows "
             "(conv_split_qkv); pass part 0, 1 or 2");
}

}  // namespace
}  // namespace dstest
