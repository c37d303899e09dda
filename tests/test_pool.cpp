// StatePool (the slot pool of SGLang's MambaPool, envelope pools included): allocation, exhaustion
// and double free, zeroing on allocate, fork (prefix caching: flushed source only, destination
// cursor reset, every layer copied, rings not), the per-layer and envelope views (strides,
// addresses, the recurrent_kda stride contract), ring and cursor views, and the byte accounting
// (bytes_per_slot, required_bytes, slots_for_budget); the null-slot layout (SGLang's: slot 0 never
// allocated, padded rows aimed at it touch no request).
#include <cmath>
#include <cstring>
#include <tuple>

#include "quant_formats.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::ErrorKind;
using deltastate::PoolLayout;
using deltastate::StatePool;
using deltastate::StatePoolConfig;

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

const char* at(const StatePool& p, int64_t offset) {
  return static_cast<const char*>(p.data()) + offset;
}
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
               "StatePool exhausted: all 4 slots are in use (free a slot, or size the pool for a "
               "memory budget with slots_for_budget)");
  pool.free(2);
  pool.free(0);
  EXPECT_FALSE(pool.is_allocated(2));
  EXPECT_EQ(pool.num_free(), 2);
  EXPECT_EQ(pool.allocate(), 0);
  EXPECT_EQ(pool.allocate(), 2);
  pool.free(1);
  expect_error([&] { pool.free(1); }, "StatePool.free: slot 1 is not allocated (double free?)");
  expect_error([&] { pool.free(4); },
               "StatePool.free: slot 4 is out of range for a pool of 4 slots");
  expect_error([&] { pool.free(-1); },
               "StatePool.free: slot -1 is out of range for a pool of 4 slots");
  EXPECT_FALSE(pool.is_allocated(-1));
  EXPECT_FALSE(pool.is_allocated(4));
  expect_error([&] { pool.cursor(4); },
               "StatePool.cursor: slot 4 is out of range for a pool of 4 slots");
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

    // A pending source whose records cannot be read is refused; nothing changes. (A valid one
    // is materialized: python/tests/test_pool_fork_replay.py.)
    {
      Snapshot before;
      before.add(pool.data(), pool.total_bytes());
      pool.set_cursor(1, 7);
      expect_error([&] { pool.fork(1, 2); },
                   "StatePool.fork: the cursor of src 1 is 7, outside the ring [0, L-1=3]");
      pool.set_cursor(1, 2);
      StatePool::ForkRing ring;
      ring.cache_base = 4;
      expect_error([&] { pool.fork(1, 2, nullptr, ring); },
                   "StatePool.fork: cache_base=4 is outside the ring [0, L-1=3]");
      ring.cache_base = 1;
      ring.prefix_gate_cache = ring.predecayed_k_cache = true;  // the pool is GDN
      expect_error([&] { pool.fork(1, 2, nullptr, ring); },
                   "Pre-decayed K requires KDA circular replay with prefix gates.");
      pool.set_cursor(1, 0);
      EXPECT_TRUE(before.unchanged());
    }
    {  // Without rings a nonzero cursor cannot be materialized: SGLang's copy_from text.
      StatePoolConfig c = small_config(layout, 4);
      c.replay_len = 0;
      StatePool bare(c);
      bare.allocate();
      bare.allocate();
      bare.set_cursor(0, 2);
      expect_error(
          [&] { bare.fork(0, 1); },
          "copy_from requires a fully-flushed ReplaySSM source (write_pos==0), got 2 for src 0");
    }

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
    expect_error([&] { pool.fork(1, 4); },
                 "StatePool.fork: slot 4 is out of range for a pool of 4 slots");
    pool.free(3);
    expect_error(
        [&] { pool.fork(1, 3); },
        "StatePool.fork: both slots must be allocated (src 1 is allocated, dst 3 is free)");
    expect_error(
        [&] { pool.fork(3, 0); },
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
  expect_error([&] { pool.layer_state(2); },
               "StatePool: layer 2 is out of range for a pool of 2 layers");
  expect_error([&] { pool.d_cache(-1); },
               "StatePool: layer -1 is out of range for a pool of 2 layers");
  expect_error([&] { pool.envelope_extra(0); },
               "StatePool.envelope_extra: the pool is not an envelope");

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
    SCOPED_TRACE("HV=" + std::to_string(d.HV) + " V=" + std::to_string(d.V) +
                 " K=" + std::to_string(d.K) + " " + dtype_short_name(d.dtype));
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
      "StatePool state dtype must be float32, bfloat16, float16, float8_e4m3fn or int8; got int32");
  bad([](StatePoolConfig& c) { c.envelope_extra_bytes = 8; },
      "StatePool envelope_extra_bytes applies to the envelope layout only and must be >= 0");
  bad([](StatePoolConfig& c) { c.replay_len = -1; }, "ReplaySSM cache length must be at least 1.");
  bad([](StatePoolConfig& c) { c.H = 3; },
      "StatePool with ReplaySSM rings needs the key-head count H (HV a multiple of H); got H=3, "
      "HV=4");
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

// ---- the null slot (SGLang's layout) ------------------------------------------------------------
// small_config with slot 0 reserved: `slots` allocatable slots over slots + 1 rows.
StatePoolConfig null_config(PoolLayout layout, int64_t slots = 3) {
  StatePoolConfig c = small_config(layout, slots);
  c.null_slot = true;
  return c;
}

// Byte ranges of slot `slot` in a pool: its state in every layer (the whole entry of an envelope),
// and with `all` also its rings and its cursor.
std::vector<MemRange> slot_ranges(const StatePool& p, int64_t slot, bool all = true) {
  const StatePoolConfig& c = p.config();
  std::vector<MemRange> r;
  if (all) r.push_back(range_of(p.write_pos(), slot, 1));
  for (int64_t l = 0; l < c.layers; ++l) {
    const TensorView v = p.layer_state(l);
    if (c.layout == PoolLayout::per_layer) r.push_back(slot_range(v, slot));
    else if (l == 0) {
      const auto* e = static_cast<const char*>(p.envelope_extra(slot));
      r.push_back({e, e + v.stride[0] * v.element_size()});
    }
    if (all && c.replay_len > 0)
      for (const TensorView& ring : {p.d_cache(l), p.k_cache(l), p.g_cache(l)})
        r.push_back(range_of(ring, slot * ring.stride[0], ring.stride[0]));
  }
  return r;
}

// StatePoolConfig::sglang is SGLang's MambaPool: `size` allocatable slots, slot 0 a null slot in
// memory that allocate() never returns (whatever the order of frees), free() refuses.
TEST(StatePool, NullSlotIsNeverAllocated) {
  const StatePoolConfig cfg = StatePoolConfig::sglang(2, 4, 4, 16, 8);
  EXPECT_TRUE(cfg.null_slot);
  EXPECT_EQ(cfg.slots, 4);
  EXPECT_EQ(cfg.physical_slots(), 5);
  EXPECT_EQ(cfg.layout, PoolLayout::per_layer);
  EXPECT_EQ(cfg.state_dtype, DType::f32);
  EXPECT_EQ(small_config(PoolLayout::per_layer, 4).physical_slots(), 4);
  StatePool pool(cfg);
  EXPECT_EQ(pool.num_free(), 4);
  EXPECT_FALSE(pool.is_allocated(0));
  for (int64_t i = 1; i <= 4; ++i) EXPECT_EQ(pool.allocate(), i) << "1..size, lowest first";
  EXPECT_EQ(pool.num_free(), 0);
  EXPECT_FALSE(pool.is_allocated(0));
  expect_error([&] { pool.allocate(); },
               "StatePool exhausted: all 4 slots are in use (free a slot, or size the pool for a "
               "memory budget with slots_for_budget)");
  expect_error([&] { pool.free(0); },
               "StatePool.free: slot 0 is the null slot of this pool (never allocated)");
  expect_error([&] { pool.free(5); },
               "StatePool.free: slot 5 is out of range for a pool of 4 slots (1..4; slot 0 is the "
               "null slot)");
  expect_error([&] { pool.free(-1); },
               "StatePool.free: slot -1 is out of range for a pool of 4 slots (1..4; slot 0 is the "
               "null slot)");
  EXPECT_FALSE(pool.is_allocated(5));
  // Random churn: allocate never hands out slot 0.
  Rng rng = test_rng();
  std::vector<int64_t> live{1, 2, 3, 4};
  for (int round = 0; round < 200; ++round) {
    if (!live.empty() && (pool.num_free() == 0 || rng.chance(0.5))) {
      const size_t i = static_cast<size_t>(rng.integer(0, static_cast<int64_t>(live.size()) - 1));
      pool.free(live[i]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      const int64_t s = pool.allocate();
      EXPECT_GE(s, 1);
      EXPECT_LE(s, 4);
      live.push_back(s);
    }
    EXPECT_EQ(pool.num_free(), 4 - static_cast<int64_t>(live.size()));
    EXPECT_FALSE(pool.is_allocated(0));
  }
  EXPECT_EQ(pool.cursor(0), 0) << "the null slot's cursor exists and stays readable";
}

// The null slot's row is real memory: views have slots + 1 rows, laid out exactly as a pool of
// slots + 1 slots; the memory starts zeroed; the accounting counts the extra row.
TEST(StatePool, NullSlotLayoutAndAccounting) {
  for (PoolLayout layout : {PoolLayout::per_layer, PoolLayout::envelope}) {
    SCOPED_TRACE(layout == PoolLayout::envelope ? "envelope" : "per_layer");
    for (bool kda : {false, true}) {
      StatePoolConfig cfg = null_config(layout, 3), rows = small_config(layout, 4);
      cfg.kda = rows.kda = kda;
      StatePool pool(cfg), same(rows);
      EXPECT_EQ(pool.total_bytes(), same.total_bytes());
      EXPECT_EQ(StatePool::required_bytes(cfg), StatePool::required_bytes(rows));
      EXPECT_GT(StatePool::required_bytes(cfg), StatePool::required_bytes(small_config(layout, 3)));
      EXPECT_EQ(StatePool::bytes_per_slot(cfg), StatePool::bytes_per_slot(rows));
      EXPECT_TRUE(all_bytes_zero(pool.data(), pool.total_bytes()));
      auto same_view = [&](const TensorView& a, const TensorView& b) {
        EXPECT_EQ(static_cast<const char*>(a.data) - static_cast<const char*>(pool.data()),
                  static_cast<const char*>(b.data) - static_cast<const char*>(same.data()));
        EXPECT_EQ(shape_str(a), shape_str(b));
        EXPECT_EQ(stride_str(a), stride_str(b));
        EXPECT_EQ(a.shape[0], 4) << "slots + 1 rows";
      };
      for (int64_t l = 0; l < cfg.layers; ++l) {
        same_view(pool.layer_state(l), same.layer_state(l));
        same_view(pool.d_cache(l), same.d_cache(l));
        same_view(pool.k_cache(l), same.k_cache(l));
        same_view(pool.g_cache(l), same.g_cache(l));
      }
      same_view(pool.write_pos(), same.write_pos());
      if (layout == PoolLayout::envelope) {
        EXPECT_EQ(static_cast<const char*>(pool.envelope_extra(0)), pool.data());
      }
    }
    // slots_for_budget gives the allocatable slots, the null row paid for out of the budget.
    const StatePoolConfig cfg = null_config(layout);
    auto required = [&](int64_t slots, bool null_slot) {
      StatePoolConfig x = cfg;
      x.slots = slots;
      x.null_slot = null_slot;
      return StatePool::required_bytes(x);
    };
    EXPECT_EQ(StatePool::slots_for_budget(cfg, required(1, false)), 0);
    EXPECT_EQ(StatePool::slots_for_budget(cfg, required(1, true) - 1), 0);
    for (int64_t n : {1, 2, 3, 7, 100}) {
      EXPECT_EQ(required(n, true), required(n + 1, false));
      EXPECT_EQ(StatePool::slots_for_budget(cfg, required(n, true)), n);
      EXPECT_EQ(StatePool::slots_for_budget(cfg, required(n + 1, true) - 1), n);
    }
  }
}

// fork and allocate's clear with a null slot: the null slot is neither a source nor a destination,
// and clearing or forking a live slot leaves slot 0's memory alone.
TEST(StatePool, NullSlotForkAndClear) {
  for (PoolLayout layout : {PoolLayout::per_layer, PoolLayout::envelope}) {
    SCOPED_TRACE(layout == PoolLayout::envelope ? "envelope" : "per_layer");
    Rng rng = test_rng(layout == PoolLayout::envelope);
    StatePool pool(null_config(layout, 3));
    for (int64_t i = 1; i <= 3; ++i) EXPECT_EQ(pool.allocate(), i);
    fill_sentinel(pool.data(), pool.total_bytes(), DType::f32);
    for (int64_t l = 0; l < 2; ++l)
      for (int64_t s = 0; s <= 3; ++s) fill_slot(pool.layer_state(l), s, rng);
    for (int64_t s = 0; s <= 3; ++s) pool.set_cursor(s, 0);
    expect_error([&] { pool.fork(0, 1); },
                 "StatePool.fork: both slots must be allocated (src 0 is the null slot, dst 1 is "
                 "allocated)");
    expect_error([&] { pool.fork(1, 0); },
                 "StatePool.fork: both slots must be allocated (src 1 is allocated, dst 0 is the "
                 "null slot)");
    expect_error(
        [&] { pool.fork(1, 4); },
        "StatePool.fork: slot 4 is out of range for a pool of 3 slots (1..3; slot 0 is the "
        "null slot)");
    Snapshot before;
    before.add(pool.data(), pool.total_bytes());
    pool.fork(1, 3);
    for (int64_t l = 0; l < 2; ++l)
      EXPECT_EQ(slot_values(pool.layer_state(l), 3), slot_values(pool.layer_state(l), 1));
    std::vector<MemRange> written = slot_ranges(pool, 3, /*all=*/false);
    written.push_back(range_of(pool.write_pos(), 3, 1));
    EXPECT_TRUE(before.unchanged_except(written)) << "fork wrote only dst's state and cursor";

    pool.free(2);
    Snapshot before_clear;
    before_clear.add(pool.data(), pool.total_bytes());
    EXPECT_EQ(pool.allocate(), 2);
    EXPECT_TRUE(before_clear.unchanged_except(slot_ranges(pool, 2)));
    EXPECT_FALSE(all_zero(slot_values(pool.layer_state(0), 0))) << "slot 0 is not cleared";
  }
}

// The point of the null slot: a caller that aims a padded batch row at index 0 (SGLang's
// clamp(min=0), FlashInfer's "0 is null") writes only slot 0. Two identical SGLang pools run the
// same packed decode, recurrent and ReplaySSM calls, one with a row aimed at slot 0, the other
// with that row padded (-1); every live slot (state, rings, cursor) and every live row's output is
// bit-identical, and only slot 0 differs. In a pool whose slot 0 is a live request, the same row
// overwrites that request.
TEST(StatePool, NullSlotPaddedRowNeverTouchesLiveSlots) {
  for (bool kda : {false, true}) {
    SCOPED_TRACE(kda ? "kda" : "gdn");
    Rng rng = test_rng(kda);
    const Shape& s = kOdd;
    StatePoolConfig cfg = StatePoolConfig::sglang(2, 4, s.HV, s.V, s.K);
    cfg.replay_len = 4;
    cfg.H = s.H;
    cfg.ring_k_dtype = DType::f32;
    cfg.kda = kda;
    StatePool a(cfg), b(cfg);
    std::vector<int64_t> live;
    for (int i = 0; i < 4; ++i) {
      live.push_back(a.allocate());
      EXPECT_EQ(b.allocate(), live.back());
    }
    EXPECT_EQ(live, (std::vector<int64_t>{1, 2, 3, 4}));
    for (int64_t l = 0; l < 2; ++l)
      for (int64_t sl : live) fill_slot(a.layer_state(l), sl, rng);
    for (int64_t sl : live) a.set_cursor(sl, static_cast<int32_t>(sl % 4));
    std::memcpy(b.data(), a.data(), static_cast<size_t>(a.total_bytes()));

    const std::vector<int64_t> aimed{live[2], 0, live[1], -1, live[3]};
    const std::vector<int64_t> padded{live[2], -1, live[1], -1, live[3]};
    const std::vector<int64_t> live_rows{0, 2, 4};
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.K));
    const std::optional<double> lb = kda ? kLb : kNoLb;

    // Packed decode on layer 0.
    DecodeBatch pa = make_decode_batch(rng, s, kda, aimed, DType::f32);
    DecodeBatch pb = pa;
    pb.idx = index_tensor(padded);
    pb.out = pa.out.empty_like();
    for (auto [pool, batch] : {std::pair{&a, &pa}, std::pair{&b, &pb}}) {
      const auto args = batch->packed_args(host_view, pool->layer_state(0), scale, lb);
      if (kda) deltastate::kda_packed_decode(args);
      else deltastate::gdn_packed_decode(args);
    }
    for (int64_t r : live_rows) EXPECT_EQ(pa.out_row(r), pb.out_row(r)) << "packed row " << r;

    // Recurrent (pooled, two tokens per sequence) on layer 0 again.
    RecurrentBatch ra = make_recurrent_batch(rng, recurrent_spec(s, kda, DType::f32, 5, 2));
    RecurrentBatch rb = ra;
    rb.out = ra.out.empty_like();
    const Tensor ia = index_tensor(aimed), ib = index_tensor(padded);
    for (auto [pool, batch, idx] : {std::tuple{&a, &ra, &ia}, std::tuple{&b, &rb, &ib}}) {
      deltastate::RecurrentArgs args = batch->args(host_view);
      args.state = pool->layer_state(0);
      args.state_indices = idx->view();
      if (kda) deltastate::recurrent_kda(args);
      else deltastate::recurrent_gdn(args);
    }
    for (int64_t n : live_rows)
      for (int64_t t = 0; t < 2; ++t)
        EXPECT_EQ(ra.out_token(n, t), rb.out_token(n, t)) << "recurrent row " << n;

    // ReplaySSM on layer 1, the rows' cursors gathered from the pool and advanced by the op.
    DecodeBatch xa = make_decode_batch(rng, s, kda, aimed, DType::f32);
    DecodeBatch xb = xa;
    xb.idx = index_tensor(padded);
    xb.out = xa.out.empty_like();
    std::vector<int64_t> cursors;
    for (int64_t sl : aimed) cursors.push_back(sl >= 0 ? a.cursor(sl) : 0);
    const Tensor wa = index_tensor(cursors), wb = index_tensor(cursors);
    for (auto [pool, batch, wp] : {std::tuple{&a, &xa, &wa}, std::tuple{&b, &xb, &wb}}) {
      deltastate::ReplayDecodeArgs args =
          replay_args(host_view, *batch, pool->layer_state(1), pool->d_cache(1), pool->k_cache(1),
                      pool->g_cache(1), *wp, nullptr, scale, lb);
      args.advance_write_pos = true;
      deltastate::replayssm_decode(args);
    }
    for (int64_t r : live_rows) {
      EXPECT_EQ(xa.out_row(r), xb.out_row(r)) << "ReplaySSM row " << r;
      EXPECT_EQ(index_values(wa)[r], index_values(wb)[r]) << "cursor of row " << r;
    }

    // Only slot 0 differs between the pools; every live slot is bit-identical.
    EXPECT_TRUE(Snapshot::equal_except(a.data(), b.data(), a.total_bytes(), slot_ranges(a, 0)));
    const auto* base_a = static_cast<const char*>(a.data());
    const auto* base_b = static_cast<const char*>(b.data());
    for (int64_t sl : live)
      for (const MemRange& r : slot_ranges(a, sl))
        EXPECT_EQ(
            std::memcmp(r.begin, base_b + (r.begin - base_a), static_cast<size_t>(r.end - r.begin)),
            0)
            << "live slot " << sl;
    EXPECT_FALSE(all_zero(slot_values(a.layer_state(0), 0))) << "the aimed row wrote slot 0";
    EXPECT_TRUE(all_zero(slot_values(b.layer_state(0), 0)));

    // Without the null slot, slot 0 is a live request and the same row overwrites it.
    StatePoolConfig plain = cfg;
    plain.null_slot = false;
    StatePool c(plain);
    EXPECT_EQ(c.allocate(), 0);
    fill_slot(c.layer_state(0), 0, rng);
    const std::vector<double> request = slot_values(c.layer_state(0), 0);
    DecodeBatch pc = make_decode_batch(rng, s, kda, {0}, DType::f32);
    const auto args = pc.packed_args(host_view, c.layer_state(0), scale, lb);
    if (kda) deltastate::kda_packed_decode(args);
    else deltastate::gdn_packed_decode(args);
    EXPECT_NE(slot_values(c.layer_state(0), 0), request);
  }
}

}  // namespace
}  // namespace dstest

// ---- quantized states (float8_e4m3fn, int8) -----------------------------------------------------
namespace dstest {
namespace {

using deltastate::tuple_str;

StatePoolConfig quantized_config(DType dtype, PoolLayout layout) {
  StatePoolConfig c;
  c.layers = 3;
  c.slots = 4;
  c.HV = 2;
  c.V = 12;
  c.K = 20;  // HV*V*K = 480 bytes: the scales start at 480 rounded up to 32 = 480
  c.state_dtype = dtype;
  c.layout = layout;
  c.envelope_extra_bytes = layout == PoolLayout::envelope ? 40 : 0;
  c.conv_dim = 24;
  c.conv_dtype = DType::bf16;
  return c;
}

TEST(StatePoolQuantized, ViewsForkClearAndAccounting) {
  for (DType dtype : {DType::f8e4m3, DType::i8}) {
    for (PoolLayout layout : {PoolLayout::per_layer, PoolLayout::envelope}) {
      SCOPED_TRACE(std::string(deltastate::dtype_name(dtype)) +
                   (layout == PoolLayout::envelope ? " envelope" : " per_layer"));
      const StatePoolConfig c = quantized_config(dtype, layout);
      StatePool pool(c);
      const int64_t codes = c.HV * c.V * c.K, scale_bytes = c.HV * c.V * 4;
      // a (layer, slot) block: codes, scales at the next 32-byte boundary, rounded to 32 bytes
      const int64_t block = 480 + 96;
      for (int64_t l = 0; l < c.layers; ++l) {
        const TensorView st = pool.layer_state(l), sc = pool.layer_scales(l);
        EXPECT_EQ(st.dtype, dtype);
        EXPECT_EQ(tuple_str(st.shape, 4), tuple_str({4, 2, 12, 20}));
        EXPECT_EQ(tuple_str(st.stride + 1, 3), tuple_str({240, 20, 1}));
        EXPECT_EQ(sc.dtype, DType::f32);
        EXPECT_EQ(tuple_str(sc.shape, 3), tuple_str({4, 2, 12}));
        EXPECT_EQ(sc.stride[0] * 4, st.stride[0]);  // the state's slot stride, in bytes
        EXPECT_EQ(tuple_str(sc.stride + 1, 2), tuple_str({12, 1}));
        EXPECT_EQ(static_cast<const char*>(sc.data) - static_cast<const char*>(st.data), 480);
        if (layout == PoolLayout::per_layer) EXPECT_EQ(st.stride[0], block);
        EXPECT_EQ(reinterpret_cast<uintptr_t>(st.data) % 32, 0u);
      }
      const TensorView all = pool.scales();
      EXPECT_EQ(tuple_str(all.shape, 4), tuple_str({3, 4, 2, 12}));
      EXPECT_EQ(static_cast<const char*>(all.data) + all.stride[0] * 4 * 2,  // layer 2's scales
                static_cast<const char*>(pool.layer_scales(2).data));
      // accounting counts the codes and the scales of every layer
      const int64_t conv = c.conv_dim * (c.conv_width - 1) * 2;
      if (layout == PoolLayout::per_layer)
        EXPECT_EQ(StatePool::bytes_per_slot(c), c.layers * (block + conv) + 4);
      EXPECT_GE(StatePool::bytes_per_slot(c), c.layers * (codes + scale_bytes));
      EXPECT_LT(StatePool::bytes_per_slot(c),
                c.layers * (codes * 4) / 2);  // well under half of fp32 (+ conv windows)

      // fork copies a slot's codes and scales in every layer; allocate clears them
      const int64_t a = pool.allocate(), b = pool.allocate();
      for (int64_t l = 0; l < c.layers; ++l) {
        const TensorView st = pool.layer_state(l), sc = pool.layer_scales(l);
        char* sa = static_cast<char*>(st.data) + a * st.stride[0];
        for (int64_t i = 0; i < codes; ++i) sa[i] = static_cast<char>(i * 7 + l);
        float* fa = static_cast<float*>(sc.data) + a * sc.stride[0];
        for (int64_t i = 0; i < c.HV * c.V; ++i) fa[i] = 0.5f + i + l;
      }
      pool.fork(a, b);
      for (int64_t l = 0; l < c.layers; ++l) {
        const TensorView st = pool.layer_state(l), sc = pool.layer_scales(l);
        EXPECT_EQ(std::memcmp(static_cast<char*>(st.data) + a * st.stride[0],
                              static_cast<char*>(st.data) + b * st.stride[0], codes),
                  0);
        EXPECT_EQ(std::memcmp(static_cast<float*>(sc.data) + a * sc.stride[0],
                              static_cast<float*>(sc.data) + b * sc.stride[0], scale_bytes),
                  0);
      }
      pool.free(b);
      const int64_t b2 = pool.allocate();
      EXPECT_EQ(b2, b);
      for (int64_t l = 0; l < c.layers; ++l) {
        const TensorView st = pool.layer_state(l), sc = pool.layer_scales(l);
        const char* sb = static_cast<char*>(st.data) + b * st.stride[0];
        EXPECT_TRUE(std::all_of(sb, sb + codes, [](char x) { return x == 0; }));
        const float* fb = static_cast<float*>(sc.data) + b * sc.stride[0];
        EXPECT_TRUE(std::all_of(fb, fb + c.HV * c.V, [](float x) { return x == 0.0f; }));
      }
      // float8 rounds stochastically by default: one step counter per layer; int8: none
      if (dtype == DType::f8e4m3) {
        const TensorView s0 = pool.rounding_step(0), s2 = pool.rounding_step(2);
        EXPECT_EQ(s0.dtype, DType::i64);
        EXPECT_EQ(static_cast<int64_t*>(s2.data) - static_cast<int64_t*>(s0.data), 2);
        EXPECT_EQ(*static_cast<int64_t*>(s2.data), 0);
      } else {
        expect_error([&] { pool.rounding_step(0); },
                     "StatePool.rounding_step: the pool rounds its states to nearest (no step "
                     "counter; configure state_rounding stochastic)");
      }
    }
  }
}

TEST(StatePoolQuantized, Errors) {
  StatePoolConfig f = quantized_config(DType::f32, PoolLayout::per_layer);
  StatePool fp32(f);
  expect_error([&] { fp32.layer_scales(0); },
               "StatePool.layer_scales: the pool's state is float32, which has no scales");
  StatePoolConfig r = quantized_config(DType::i8, PoolLayout::per_layer);
  r.spec_rows = 2;
  r.spec_steps = 3;
  expect_error([&] { StatePool p(r); },
               "StatePool with int8 states: the speculative-verify scratch (spec_rows) is not "
               "built for quantized states yet (issue #36)");
  // ReplaySSM rings stay float: the d ring float32
  r.spec_rows = r.spec_steps = 0;
  r.replay_len = 4;
  r.H = 2;
  StatePool rp(r);
  EXPECT_EQ(rp.d_cache(1).dtype, DType::f32);
  EXPECT_EQ(
      static_cast<const char*>(rp.d_cache(1).data) - static_cast<const char*>(rp.d_cache(0).data),
      4 * 2 * 4 * 12 * 4);  // physical slots * HV * L * V * 4 bytes
  StatePoolConfig q = quantized_config(DType::f8e4m3, PoolLayout::envelope);
  q.state_rounding = deltastate::StateRounding::stochastic;
  StatePool sp(q);
  expect_error([&] { sp.rounding_step(3); },
               "StatePool: layer 3 is out of range for a pool of 3 layers");
}

// ---- fork with pending ReplaySSM records on a quantized / stochastically rounded pool -----------
struct FmtForkCase {
  const char* name;
  bool kda;
  DType dtype;
  deltastate::StateRounding rounding;
  PoolLayout layout;
};
inline void PrintTo(const FmtForkCase& c, std::ostream* os) { *os << c.name; }

// Two layers, 5 slots, rings of L = 4 (float32 keys), no conv windows.
StatePoolConfig fmt_fork_config(const FmtForkCase& c) {
  StatePoolConfig cfg;
  cfg.layers = 2;
  cfg.slots = 5;
  cfg.H = 2;
  cfg.HV = 4;
  cfg.V = 8;
  cfg.K = 16;
  cfg.state_dtype = c.dtype;
  cfg.state_rounding = c.rounding;
  cfg.rounding_seed = kSeed;
  cfg.layout = c.layout;
  cfg.envelope_extra_bytes = c.layout == PoolLayout::envelope ? 40 : 0;
  cfg.replay_len = 4;
  cfg.kda = c.kda;
  return cfg;
}

bool quantized_dtype(DType t) { return t == DType::f8e4m3 || t == DType::i8; }

// Slot `slot` of `layer` dequantized, [HV*V*K] in fp64 (codes times their row's scale, or the
// 16-bit values).
std::vector<double> dequantized_slot(const StatePool& pool, int64_t layer, int64_t slot) {
  const StatePoolConfig& c = pool.config();
  const TensorView st = pool.layer_state(layer);
  if (!quantized_dtype(c.state_dtype)) return slot_values(st, slot);
  const TensorView sc = pool.layer_scales(layer);
  const auto* codes = static_cast<const uint8_t*>(st.data) + slot * st.stride[0];
  const auto* scales = static_cast<const float*>(sc.data) + slot * sc.stride[0];
  std::vector<double> v(static_cast<size_t>(c.HV * c.V * c.K));
  for (size_t e = 0; e < v.size(); ++e)
    v[e] = code_value(codes[e], c.state_dtype) * scales[e / static_cast<size_t>(c.K)];
  return v;
}

// The state after `src`'s m ring records from `base` in fp64 (basic or circular ring, no prefix
// gates): S = exp(Gtot) * S0 + sum_j d_j exp(Gtot - G_j) k_j^T, per column for KDA, from S0 the
// dequantized checkpoint.
std::vector<double> rebuilt_fp64(const StatePool& pool, int64_t layer, int64_t src, int m,
                                 int base) {
  const StatePoolConfig& c = pool.config();
  const int64_t HV = c.HV, V = c.V, K = c.K, H = c.H, L = c.replay_len;
  const int64_t gw = c.kda ? K : 1;
  const TensorView d = pool.d_cache(layer), k = pool.k_cache(layer), g = pool.g_cache(layer);
  std::vector<double> S = dequantized_slot(pool, layer, src);
  auto val = [](const TensorView& t, int64_t slot, int64_t e) {
    return load_value(t.data, t.dtype, slot * t.stride[0] + e);
  };
  for (int64_t hv = 0; hv < HV; ++hv) {
    const int64_t h = hv / (HV / H);
    for (int64_t i = 0; i < K; ++i) {
      const int64_t gi = c.kda ? i : 0;
      double gtot = 0.0;
      for (int j = 0; j < m; ++j) gtot += val(g, src, (hv * L + (base + j) % L) * gw + gi);
      for (int64_t v = 0; v < V; ++v) {
        double s = std::exp(gtot) * S[static_cast<size_t>((hv * V + v) * K + i)];
        double G = 0.0;
        for (int j = 0; j < m; ++j) {
          const int64_t pos = (base + j) % L;
          G += val(g, src, (hv * L + pos) * gw + gi);
          s += val(d, src, (hv * L + pos) * V + v) * std::exp(gtot - G) *
               val(k, src, (h * L + pos) * K + i);
        }
        S[static_cast<size_t>((hv * V + v) * K + i)] = s;
      }
    }
  }
  return S;
}

// What fork may write: dst's checkpoint (codes and scales) in every layer and dst's cursor.
std::vector<MemRange> fork_written(const StatePool& pool, int64_t dst) {
  std::vector<MemRange> w{range_of(pool.write_pos(), dst, 1)};
  const StatePoolConfig& c = pool.config();
  for (int64_t l = 0; l < c.layers; ++l) {
    w.push_back(slot_range(pool.layer_state(l), dst));
    if (quantized_dtype(c.state_dtype))
      w.push_back(range_of(pool.layer_scales(l), dst * pool.layer_scales(l).stride[0], c.HV * c.V));
  }
  return w;
}

class StatePoolFmtFork : public ::testing::TestWithParam<FmtForkCase> {};

// A source with m = 3 pending records (basic ring, then circular at base 2): dst's checkpoint in
// every layer is the fp64 rebuild of src's dequantized checkpoint and records, within one
// quantum of its new row scale (quantized; the scale fresh, never the 1e30 sentinel) or one unit
// in the last place (bf16); everything else, the step counters included, bit-untouched; dst's
// cursor 0, src's still m.
TEST_P(StatePoolFmtFork, MaterializesWithinAQuantum) {
  const FmtForkCase& fc = GetParam();
  Rng rng = test_rng();
  for (int base : {0, 2}) {
    SCOPED_TRACE("cache_base " + std::to_string(base));
    StatePool pool(fmt_fork_config(fc));
    const StatePoolConfig& c = pool.config();
    for (int i = 0; i < 4; ++i) pool.allocate();
    fill_formatted_pool(pool, {0, 1}, {0, 1, 2, 3}, rng);
    for (int64_t s = 0; s < 5; ++s) pool.set_cursor(s, 0);
    const int64_t src = 1, dst = 2;
    const int m = 3;
    pool.set_cursor(src, m);
    pool.set_cursor(dst, 2);
    std::vector<std::vector<double>> want;
    for (int64_t l = 0; l < c.layers; ++l) want.push_back(rebuilt_fp64(pool, l, src, m, base));
    Snapshot before;
    before.add(pool.data(), pool.total_bytes());
    StatePool::ForkRing ring;
    ring.cache_base = base;
    pool.fork(src, dst, nullptr, ring);
    EXPECT_EQ(pool.cursor(dst), 0);
    EXPECT_EQ(pool.cursor(src), m);
    EXPECT_TRUE(before.unchanged_except(fork_written(pool, dst)));
    for (int64_t l = 0; l < c.layers; ++l) {
      SCOPED_TRACE("layer " + std::to_string(l));
      const std::vector<double> got = dequantized_slot(pool, l, dst);
      const std::vector<double>& w = want[static_cast<size_t>(l)];
      for (int64_t r = 0; r < c.HV * c.V; ++r) {
        double amax = 0.0;
        for (int64_t i = 0; i < c.K; ++i)
          amax = std::max(amax, std::fabs(w[static_cast<size_t>(r * c.K + i)]));
        double scale = 0.0;
        if (quantized_dtype(c.state_dtype)) {
          const TensorView sc = pool.layer_scales(l);
          scale = static_cast<const float*>(sc.data)[dst * sc.stride[0] + r];
          const double cap = c.state_dtype == DType::i8 ? 127.0 : 448.0;
          ASSERT_NEAR(scale, amax / cap, 1e-5 * amax / cap) << "the fresh scale of row " << r;
        }
        for (int64_t i = 0; i < c.K; ++i) {
          const double x = w[static_cast<size_t>(r * c.K + i)];
          double quantum = std::ldexp(std::fabs(x), -7);  // bf16: one ulp
          if (c.state_dtype == DType::i8) quantum = scale;
          if (c.state_dtype == DType::f8e4m3)
            quantum = std::max(std::ldexp(std::fabs(x), -3), std::ldexp(scale, -9));
          ASSERT_LE(std::fabs(got[static_cast<size_t>(r * c.K + i)] - x),
                    quantum * 1.0001 + 1e-5 * amax)
              << "row " << r << " k " << i;
        }
      }
    }
  }
}

// Circular rings: a fork at m = L-1 stores, byte for byte, the history checkpoint src's next
// (natural) step stores (the same rebuild, src's key at the same step), so the fork equals
// src's flush copied to dst; fork leaves the step counter, the decode advances it.
TEST_P(StatePoolFmtFork, EqualsTheFlushCopied) {
  const FmtForkCase& fc = GetParam();
  Rng rng = test_rng();
  StatePool pool(fmt_fork_config(fc));
  const StatePoolConfig& c = pool.config();
  for (int i = 0; i < 4; ++i) pool.allocate();
  fill_formatted_pool(pool, {0, 1}, {0, 1, 2, 3}, rng);
  for (int64_t s = 0; s < 5; ++s) pool.set_cursor(s, 0);
  const int64_t src = 3, dst = 0;
  const int m = static_cast<int>(c.replay_len) - 1, base = 1;
  pool.set_cursor(src, m);
  StatePool::ForkRing ring;
  ring.cache_base = base;
  pool.fork(src, dst, nullptr, ring);
  const Shape s{"fork", static_cast<int>(c.H), static_cast<int>(c.HV), static_cast<int>(c.K),
                static_cast<int>(c.V)};
  for (int64_t l = 0; l < c.layers; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    if (c.stochastic_rounding()) {
      EXPECT_EQ(*static_cast<const int64_t*>(pool.rounding_step(l).data), kStep0) << "fork";
    }
    DecodeBatch batch = make_decode_batch(rng, s, c.kda, {src}, DType::f32);
    Tensor wp = index_tensor({m}), cb = index_tensor({base});
    deltastate::ReplayDecodeArgs a =
        replay_args(host_view, batch, pool.layer_state(l), pool.d_cache(l), pool.k_cache(l),
                    pool.g_cache(l), wp, nullptr, 0.25, c.kda ? kLb : kNoLb);
    a.state_format = format_of(pool, l, fc.rounding);
    a.cache_base = cb.view();
    a.circular_replay = true;
    deltastate::replayssm_decode(a);  // natural at L-1: the history checkpoint, then an append
    const TensorView st = pool.layer_state(l);
    const int64_t bytes = c.HV * c.V * c.K * deltastate::dtype_size(c.state_dtype);
    EXPECT_EQ(std::memcmp(static_cast<const char*>(st.data) +
                              src * st.stride[0] * deltastate::dtype_size(st.dtype),
                          static_cast<const char*>(st.data) +
                              dst * st.stride[0] * deltastate::dtype_size(st.dtype),
                          static_cast<size_t>(bytes)),
              0)
        << "the checkpoints";
    if (quantized_dtype(c.state_dtype)) {
      const TensorView sc = pool.layer_scales(l);
      const float* f = static_cast<const float*>(sc.data);
      EXPECT_EQ(std::memcmp(f + src * sc.stride[0], f + dst * sc.stride[0],
                            static_cast<size_t>(c.HV * c.V * 4)),
                0)
          << "the scales";
    }
    if (c.stochastic_rounding()) {
      EXPECT_EQ(*static_cast<const int64_t*>(pool.rounding_step(l).data), kStep0 + 1) << "decode";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fmt, StatePoolFmtFork,
    ::testing::Values(FmtForkCase{"gdn_fp8_sr", false, DType::f8e4m3,
                                  deltastate::StateRounding::format_default, PoolLayout::per_layer},
                      FmtForkCase{"kda_int8_rn_envelope", true, DType::i8,
                                  deltastate::StateRounding::nearest, PoolLayout::envelope},
                      FmtForkCase{"gdn_bf16_sr_envelope", false, DType::bf16,
                                  deltastate::StateRounding::stochastic, PoolLayout::envelope},
                      FmtForkCase{"kda_int8_sr", true, DType::i8,
                                  deltastate::StateRounding::stochastic, PoolLayout::per_layer},
                      FmtForkCase{"kda_fp8_rn", true, DType::f8e4m3,
                                  deltastate::StateRounding::nearest, PoolLayout::per_layer}),
    case_name<FmtForkCase>);

}  // namespace
}  // namespace dstest
