// StatePool (as SGLang's MambaPool): allocation, exhaustion and double free, zeroing on allocate, fork (prefix
// caching: flushed source only, destination cursor reset, every layer copied, rings not), the
// per-layer and envelope views (strides, addresses, the recurrent_kda stride contract), ring and
// cursor views, and the byte accounting (bytes_per_slot, required_bytes, slots_for_budget).
#include <cstring>

#include "test_util.h"

namespace dstest {
namespace {

using deltastate::ErrorKind;
using deltastate::PoolLayout;
using deltastate::StatePool;
using deltastate::StatePoolConfig;

void expect_error(const std::function<void()>& f, const std::string& message) {
  const auto e = catch_error(f);
  if (!e) return;
  EXPECT_EQ(std::string(e->what()), message);
  EXPECT_EQ(e->kind(), ErrorKind::value);
}

// layers=2, HV=4, V=16, K=8, fp32 states; ReplaySSM rings L=4, H=2, bf16 keys (GDN).
StatePoolConfig small_config(PoolLayout layout, int64_t slots = 3) {
  StatePoolConfig c;
  c.layers = 2;
  c.slots = slots;
  c.HV = 4;
  c.V = 16;
  c.K = 8;
  c.state_dtype = DType::f32;
  c.layout = layout;
  c.envelope_extra_bytes = layout == PoolLayout::envelope ? 100 : 0;
  c.replay_len = 4;
  c.H = 2;
  c.ring_k_dtype = DType::bf16;
  return c;
}

const char* at(const StatePool& p, int64_t offset) { return static_cast<const char*>(p.data()) + offset; }
bool all_bytes_zero(const void* p, int64_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  for (int64_t i = 0; i < n; ++i)
    if (b[i]) return false;
  return true;
}

TEST(StatePool, AllocateFreeExhaustionDoubleFree) {
  StatePool pool(small_config(PoolLayout::per_layer, 4));
  EXPECT_EQ(pool.num_free(), 4);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(pool.allocate(), i) << "the lowest free slot";
    EXPECT_TRUE(pool.is_allocated(i));
  }
  EXPECT_EQ(pool.num_free(), 0);
  expect_error([&] { pool.allocate(); },
               "StatePool exhausted: all 4 slots are in use (free a slot, or size the pool with "
               "StatePool::slots_for_budget)");
  pool.free(2);
  pool.free(0);
  EXPECT_FALSE(pool.is_allocated(2));
  EXPECT_EQ(pool.num_free(), 2);
  EXPECT_EQ(pool.allocate(), 0);
  EXPECT_EQ(pool.allocate(), 2);
  pool.free(1);
  expect_error([&] { pool.free(1); }, "StatePool.free: slot 1 is not allocated (double free?)");
  expect_error([&] { pool.free(4); }, "StatePool.free: slot 4 is out of range for a pool of 4 slots");
  expect_error([&] { pool.free(-1); }, "StatePool.free: slot -1 is out of range for a pool of 4 slots");
  EXPECT_FALSE(pool.is_allocated(-1));
  EXPECT_FALSE(pool.is_allocated(4));
  expect_error([&] { pool.cursor(4); }, "StatePool.cursor: slot 4 is out of range for a pool of 4 slots");
  expect_error([&] { pool.set_cursor(-2, 0); },
               "StatePool.set_cursor: slot -2 is out of range for a pool of 4 slots");
}

// A new pool is all zeros; allocate(clear) zeroes the slot's state in every layer and resets its
// cursor, touching nothing else; allocate(clear=false) keeps the state but still resets the cursor.
TEST(StatePool, ZeroedOnAllocate) {
  for (PoolLayout layout : {PoolLayout::per_layer, PoolLayout::envelope}) {
    SCOPED_TRACE(layout == PoolLayout::envelope ? "envelope" : "per_layer");
    StatePool pool(small_config(layout));
    EXPECT_TRUE(all_bytes_zero(pool.data(), pool.total_bytes()));
    for (int i = 0; i < 3; ++i) pool.allocate();
    fill_sentinel(pool.data(), pool.total_bytes(), DType::f32);
    pool.set_cursor(1, 3);
    pool.free(1);
    Snapshot before;
    before.add(pool.data(), pool.total_bytes());
    EXPECT_EQ(pool.allocate(), 1);
    EXPECT_EQ(pool.cursor(1), 0);
    std::vector<MemRange> cleared{range_of(pool.write_pos(), 1, 1)};
    for (int64_t l = 0; l < 2; ++l) {
      const TensorView v = pool.layer_state(l);
      EXPECT_TRUE(all_zero(slot_values(v, 1))) << "layer " << l;
      cleared.push_back(slot_range(v, 1));
    }
    if (layout == PoolLayout::envelope) {  // the entry's extra bytes are part of the slot
      const auto* e = static_cast<const char*>(pool.envelope_extra(1));
      cleared.push_back({e, e + pool.layer_state(0).stride[0] * 4});
    }
    EXPECT_TRUE(before.unchanged_except(cleared));

    pool.set_cursor(1, 2);
    pool.free(1);
    Rng rng = test_rng();
    fill_slot(pool.layer_state(1), 1, rng);
    const std::vector<double> dirty = slot_values(pool.layer_state(1), 1);
    EXPECT_EQ(pool.allocate(/*clear=*/false), 1);
    EXPECT_EQ(pool.cursor(1), 0);
    EXPECT_EQ(slot_values(pool.layer_state(1), 1), dirty);
  }
}

// fork = SGLang copy_from: needs a flushed source (cursor 0), copies every layer's state (and, in
// an envelope, the rest of the entry), resets the destination's cursor, leaves the rings alone.
TEST(StatePool, ForkRules) {
  for (PoolLayout layout : {PoolLayout::per_layer, PoolLayout::envelope}) {
    SCOPED_TRACE(layout == PoolLayout::envelope ? "envelope" : "per_layer");
    Rng rng = test_rng(layout == PoolLayout::envelope);
    StatePool pool(small_config(layout, 4));
    for (int i = 0; i < 4; ++i) pool.allocate();
    fill_sentinel(pool.data(), pool.total_bytes(), DType::f32);
    for (int64_t l = 0; l < 2; ++l)
      for (int64_t s = 0; s < 4; ++s) fill_slot(pool.layer_state(l), s, rng);
    for (int64_t s = 0; s < 4; ++s) pool.set_cursor(s, 0);
    pool.set_cursor(2, 3);  // the destination's cursor is reset by the fork

    // A source that has not flushed is refused; nothing changes.
    pool.set_cursor(1, 2);
    {
      Snapshot before;
      before.add(pool.data(), pool.total_bytes());
      expect_error([&] { pool.fork(1, 2); },
                   "copy_from requires a fully-flushed ReplaySSM source (write_pos==0), got 2 for src 1");
      EXPECT_TRUE(before.unchanged());
    }
    pool.set_cursor(1, 0);

    Snapshot before;
    before.add(pool.data(), pool.total_bytes());
    pool.fork(1, 2);
    std::vector<MemRange> written{range_of(pool.write_pos(), 2, 1)};
    for (int64_t l = 0; l < 2; ++l) {
      const TensorView v = pool.layer_state(l);
      EXPECT_EQ(slot_values(v, 2), slot_values(v, 1)) << "layer " << l;
      written.push_back(slot_range(v, 2));
    }
    if (layout == PoolLayout::envelope) {
      const auto* src = static_cast<const char*>(pool.envelope_extra(1));
      const auto* dst = static_cast<const char*>(pool.envelope_extra(2));
      const int64_t entry = pool.layer_state(0).stride[0] * 4;
      EXPECT_EQ(std::memcmp(src, dst, static_cast<size_t>(entry)), 0) << "the whole entry";
      written.push_back({dst, dst + entry});
    }
    EXPECT_EQ(pool.cursor(2), 0);
    EXPECT_EQ(pool.cursor(1), 0);
    // Rings (and everything else) untouched.
    EXPECT_TRUE(before.unchanged_except(written));

    expect_error([&] { pool.fork(1, 1); }, "StatePool.fork: src and dst are the same slot 1");
    expect_error([&] { pool.fork(1, 4); }, "StatePool.fork: slot 4 is out of range for a pool of 4 slots");
    pool.free(3);
    expect_error([&] { pool.fork(1, 3); },
                 "StatePool.fork: both slots must be allocated (src 1 is allocated, dst 3 is free)");
    expect_error([&] { pool.fork(3, 0); },
                 "StatePool.fork: both slots must be allocated (src 3 is free, dst 0 is allocated)");
  }
}

// Hand-computed layout of small_config (per_layer, 3 slots): state 2*3*2048 B; d ring
// 2*3*4*4*16*4 = 6144 B at 12288; k ring 2*3*2*4*8*2 = 768 B at 18432; g ring 2*3*4*4*4 = 384 B at
// 19200; cursors 12 B at 19712 (each region 256-byte aligned); total 19968.
TEST(StatePool, PerLayerViewsAndAccounting) {
  const StatePoolConfig cfg = small_config(PoolLayout::per_layer);
  StatePool pool(cfg);
  EXPECT_EQ(StatePool::required_bytes(cfg), 19968);
  EXPECT_EQ(pool.total_bytes(), 19968);
  EXPECT_EQ(StatePool::bytes_per_slot(cfg), 2 * 2048 + 2 * (1024 + 128 + 64) + 4);
  for (int64_t l = 0; l < 2; ++l) {
    const TensorView v = pool.layer_state(l);
    EXPECT_EQ(v.data, at(pool, l * 3 * 2048));
    EXPECT_EQ(shape_str(v), "(3, 4, 16, 8)");
    EXPECT_EQ(stride_str(v), "(512, 128, 8, 1)");
    EXPECT_EQ(v.dtype, DType::f32);
    const TensorView d = pool.d_cache(l), k = pool.k_cache(l), g = pool.g_cache(l);
    EXPECT_EQ(d.data, at(pool, 12288 + l * 3072));
    EXPECT_EQ(shape_str(d), "(3, 4, 4, 16)");
    EXPECT_EQ(d.dtype, DType::f32);
    EXPECT_TRUE(d.is_contiguous());
    EXPECT_EQ(k.data, at(pool, 18432 + l * 384));
    EXPECT_EQ(shape_str(k), "(3, 2, 4, 8)");
    EXPECT_EQ(k.dtype, DType::bf16);
    EXPECT_EQ(g.data, at(pool, 19200 + l * 192));
    EXPECT_EQ(shape_str(g), "(3, 4, 4)");
    EXPECT_EQ(g.dtype, DType::f32);
  }
  const TensorView wp = pool.write_pos();
  EXPECT_EQ(wp.data, at(pool, 19712));
  EXPECT_EQ(shape_str(wp), "(3,)");
  EXPECT_EQ(wp.dtype, DType::i32);
  expect_error([&] { pool.layer_state(2); }, "StatePool: layer 2 is out of range for a pool of 2 layers");
  expect_error([&] { pool.d_cache(-1); }, "StatePool: layer -1 is out of range for a pool of 2 layers");
  expect_error([&] { pool.envelope_extra(0); }, "StatePool.envelope_extra: the pool is not an envelope");

  StatePoolConfig kda = cfg;
  kda.kda = true;
  StatePool kpool(kda);
  EXPECT_EQ(shape_str(kpool.g_cache(1)), "(3, 4, 4, 8)");
  EXPECT_EQ(StatePool::bytes_per_slot(kda), 2 * 2048 + 2 * (1024 + 128 + 4 * 4 * 8 * 4) + 4);

  StatePoolConfig bare = cfg;
  bare.replay_len = 0;
  StatePool bpool(bare);
  expect_error([&] { bpool.d_cache(0); },
               "StatePool has no ReplaySSM rings (configure replay_len >= 1 to create them)");
  expect_error([&] { bpool.k_cache(0); },
               "StatePool has no ReplaySSM rings (configure replay_len >= 1 to create them)");
  expect_error([&] { bpool.g_cache(0); },
               "StatePool has no ReplaySSM rings (configure replay_len >= 1 to create them)");
  EXPECT_EQ(StatePool::bytes_per_slot(bare), 2 * 2048 + 4);
}

// Envelope (extra 100 B -> 256 B): entry = 256 + 2 * 2048 = 4352 B; the layer view of layer l
// starts 256 + l*2048 B into entry 0 and has slot stride 4352 B = 1088 floats.
TEST(StatePool, EnvelopeViewsAndAccounting) {
  const StatePoolConfig cfg = small_config(PoolLayout::envelope);
  StatePool pool(cfg);
  EXPECT_EQ(StatePool::bytes_per_slot(cfg), 4352 + 2 * (1024 + 128 + 64) + 4);
  // state 3*4352 = 13056; d 6144 -> 19200; k 768 -> 19968; g 384 -> 20480; cursors -> 20736.
  EXPECT_EQ(StatePool::required_bytes(cfg), 20736);
  for (int64_t l = 0; l < 2; ++l) {
    const TensorView v = pool.layer_state(l);
    EXPECT_EQ(v.data, at(pool, 256 + l * 2048));
    EXPECT_EQ(stride_str(v), "(1088, 128, 8, 1)");
    EXPECT_GT(v.stride[0], 4 * 16 * 8);
    EXPECT_EQ(pool.d_cache(l).data, at(pool, 13056 + l * 3072));
  }
  EXPECT_EQ(pool.write_pos().data, at(pool, 20480));
  for (int64_t s = 0; s < 3; ++s) EXPECT_EQ(pool.envelope_extra(s), at(pool, s * 4352));
}

// The ranges of all views are disjoint and inside the pool.
TEST(StatePool, ViewsDoNotOverlap) {
  for (PoolLayout layout : {PoolLayout::per_layer, PoolLayout::envelope}) {
    StatePoolConfig cfg = small_config(layout);
    cfg.kda = true;
    StatePool pool(cfg);
    std::vector<MemRange> ranges;
    for (int64_t l = 0; l < cfg.layers; ++l)
      for (int64_t s = 0; s < cfg.slots; ++s) ranges.push_back(slot_range(pool.layer_state(l), s));
    for (int64_t l = 0; l < cfg.layers; ++l)
      for (const TensorView& v : {pool.d_cache(l), pool.k_cache(l), pool.g_cache(l)})
        ranges.push_back(range_of(v, 0, v.numel()));
    ranges.push_back(range_of(pool.write_pos(), 0, cfg.slots));
    if (layout == PoolLayout::envelope)
      for (int64_t s = 0; s < cfg.slots; ++s) {
        const auto* e = static_cast<const char*>(pool.envelope_extra(s));
        ranges.push_back({e, e + cfg.envelope_extra_bytes});
      }
    const char* lo = at(pool, 0);
    const char* hi = at(pool, pool.total_bytes());
    for (size_t i = 0; i < ranges.size(); ++i) {
      EXPECT_GE(ranges[i].begin, lo);
      EXPECT_LE(ranges[i].end, hi);
      for (size_t j = i + 1; j < ranges.size(); ++j)
        EXPECT_TRUE(ranges[i].end <= ranges[j].begin || ranges[j].end <= ranges[i].begin)
            << "ranges " << i << " and " << j << " overlap";
    }
  }
}

// Every envelope layer view meets the recurrent_kda stride contract (slot stride a multiple of 16
// elements, base 32-byte aligned), whatever the dims, and recurrent_kda accepts it.
TEST(StatePool, EnvelopeViewsMeetTheKdaStrideContract) {
  struct Dims {
    int64_t HV, V, K, layers, extra;
    DType dtype;
  };
  const Dims all[] = {{32, 128, 128, 4, 12345, DType::f32},
                      {6, 48, 32, 3, 1000, DType::bf16},
                      {2, 3, 4, 2, 0, DType::f16},
                      {1, 3, 5, 3, 10, DType::bf16},
                      {3, 5, 7, 3, 1, DType::f32}};
  for (const Dims& d : all) {
    SCOPED_TRACE("HV=" + std::to_string(d.HV) + " V=" + std::to_string(d.V) + " K=" +
                 std::to_string(d.K) + " " + dtype_short_name(d.dtype));
    StatePoolConfig cfg;
    cfg.layers = d.layers;
    cfg.slots = 3;
    cfg.HV = d.HV;
    cfg.V = d.V;
    cfg.K = d.K;
    cfg.state_dtype = d.dtype;
    cfg.layout = PoolLayout::envelope;
    cfg.envelope_extra_bytes = d.extra;
    StatePool pool(cfg);
    Rng rng = test_rng(static_cast<uint64_t>(d.K));
    RecurrentSpec spec;
    spec.s = Shape{"d", 1, static_cast<int>(d.HV), static_cast<int>(d.K), static_cast<int>(d.V)};
    spec.kda = true;
    RecurrentBatch rb = make_recurrent_batch(rng, spec);
    Tensor idx = index_tensor({2});
    for (int64_t l = 0; l < d.layers; ++l) {
      const TensorView v = pool.layer_state(l);
      EXPECT_EQ(v.stride[0] % 16, 0) << "layer " << l;
      EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data) % 32, 0u) << "layer " << l;
      EXPECT_EQ(v.stride[0] * v.element_size() % 256, 0) << "layer " << l;
      deltastate::RecurrentArgs args = rb.args(host_view);
      args.state = v;
      args.state_indices = idx.view();
      EXPECT_NO_THROW(deltastate::recurrent_kda(args)) << "layer " << l;
    }
  }
}

TEST(StatePool, SlotsForBudget) {
  StatePoolConfig a = small_config(PoolLayout::per_layer);
  StatePoolConfig b = small_config(PoolLayout::envelope);
  StatePoolConfig c;
  c.HV = 32;
  c.V = 128;
  c.K = 128;
  c.state_dtype = DType::bf16;
  for (StatePoolConfig cfg : {a, b, c}) {
    auto required = [&](int64_t slots) {
      StatePoolConfig x = cfg;
      x.slots = slots;
      return StatePool::required_bytes(x);
    };
    EXPECT_EQ(StatePool::slots_for_budget(cfg, required(1) - 1), 0);
    for (int64_t n : {1, 2, 3, 7, 100}) {
      EXPECT_EQ(StatePool::slots_for_budget(cfg, required(n)), n);
      EXPECT_EQ(StatePool::slots_for_budget(cfg, required(n + 1) - 1), n);
    }
    for (int64_t budget : {int64_t{1} << 20, int64_t{3} << 24, int64_t{1} << 30}) {
      const int64_t n = StatePool::slots_for_budget(cfg, budget);
      if (n > 0) {
        EXPECT_LE(required(n), budget);
      }
      EXPECT_GT(required(n + 1), budget);
    }
  }
  // bf16 Kimi-size states without rings: 1 MiB per slot plus a 4-byte cursor; 5 slots need
  // 5 MiB + 20 B of cursors, rounded up to 256 B.
  StatePoolConfig k = c;
  k.slots = 5;
  EXPECT_EQ(StatePool::bytes_per_slot(k), (1 << 20) + 4);
  EXPECT_EQ(StatePool::required_bytes(k), 5 * (1 << 20) + 256);
  EXPECT_EQ(StatePool::slots_for_budget(k, 5 * (1 << 20) + 256), 5);
  EXPECT_EQ(StatePool::slots_for_budget(k, 5 * (1 << 20) + 255), 4);
}

TEST(StatePool, ConfigErrors) {
  StatePoolConfig ok = small_config(PoolLayout::per_layer);
  auto bad = [&](auto mutate, const std::string& message) {
    StatePoolConfig c = ok;
    mutate(c);
    expect_error([&] { StatePool p(c); }, message);
    expect_error([&] { StatePool::bytes_per_slot(c); }, message);
  };
  bad([](StatePoolConfig& c) { c.layers = 0; },
      "StatePool needs layers, slots, HV, V, K >= 1; got layers=0, slots=3, HV=4, V=16, K=8");
  bad([](StatePoolConfig& c) { c.K = -1; },
      "StatePool needs layers, slots, HV, V, K >= 1; got layers=2, slots=3, HV=4, V=16, K=-1");
  bad([](StatePoolConfig& c) { c.state_dtype = DType::i32; },
      "StatePool state dtype must be float32, bfloat16 or float16; got int32");
  bad([](StatePoolConfig& c) { c.envelope_extra_bytes = 8; },
      "StatePool envelope_extra_bytes applies to the envelope layout only and must be >= 0");
  bad([](StatePoolConfig& c) { c.replay_len = -1; }, "ReplaySSM cache length must be at least 1.");
  bad([](StatePoolConfig& c) { c.H = 3; },
      "StatePool with ReplaySSM rings needs the key-head count H (HV a multiple of H); got H=3, HV=4");
  bad([](StatePoolConfig& c) { c.ring_k_dtype = DType::i64; },
      "StatePool ring_k_dtype must be a float dtype; got int64");
}

TEST(StatePool, ExternalMemory) {
  const StatePoolConfig cfg = small_config(PoolLayout::envelope);
  Tensor mem = Tensor::contiguous(DType::f32, {StatePool::required_bytes(cfg) / 4 + 64});
  expect_error([&] { StatePool p(cfg, static_cast<char*>(mem.alloc_base()) + 4); },
               "StatePool external memory must be non-null and 256-byte aligned");
  expect_error([&] { StatePool p(cfg, nullptr); },
               "StatePool external memory must be non-null and 256-byte aligned");
  StatePool p(cfg, mem.alloc_base());
  EXPECT_EQ(p.data(), mem.alloc_base());
  EXPECT_EQ(p.layer_state(1).data, static_cast<char*>(mem.alloc_base()) + 256 + 2048);
  EXPECT_EQ(p.allocate(), 0);
}

}  // namespace
}  // namespace dstest
