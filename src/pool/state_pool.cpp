#include "deltastate/state_pool.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "api/backend.h"
#include "core/error_text.h"
#include "core/problem.h"
#include "cpu/kernels.h"
#include "deltastate/error.h"

namespace deltastate {

using detail::fail;
using detail::format;

namespace {
constexpr int64_t kAlign = 256;
int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }
long long ll(int64_t v) { return static_cast<long long>(v); }
bool on_cuda(const StatePoolConfig& c) { return c.device.type == DeviceType::cuda; }
// Envelope: bytes between consecutive layers' states inside an entry. Rounded up to 32 bytes so
// that every layer view keeps the 32-byte base alignment of the recurrent_kda stride contract
// (and 16-byte vector loads), whatever HV*V*K*itemsize is.
int64_t envelope_layer_pitch(const StatePoolConfig& c);
// The d ring's dtype: the state's, float32 for a quantized state (the rings stay float).
DType ring_d_dtype(const StatePoolConfig& c) {
  return is_quantized(c.state_dtype) ? DType::f32 : c.state_dtype;
}
// Byte offset of a quantized block's scales: the codes rounded up to 32 bytes.
int64_t scales_offset(const StatePoolConfig& c) { return round_up(c.HV * c.V * c.K, 32); }
// One (layer, slot)'s state: HV*V*K elements, or for a quantized state its codes then its fp32
// scales (state_pool.h).
int64_t state_block_bytes(const StatePoolConfig& c) {
  if (is_quantized(c.state_dtype)) return scales_offset(c) + round_up(c.HV * c.V * 4, 32);
  return c.HV * c.V * c.K * dtype_size(c.state_dtype);
}
int64_t envelope_layer_pitch(const StatePoolConfig& c) {
  return round_up(state_block_bytes(c), 32);
}
}  // namespace

void StatePool::check_config(const StatePoolConfig& c) {
  if (c.layers < 1 || c.slots < 1 || c.HV < 1 || c.V < 1 || c.K < 1)
    fail(format(
        "StatePool needs layers, slots, HV, V, K >= 1; got layers=%lld, slots=%lld, HV=%lld, "
        "V=%lld, K=%lld",
        ll(c.layers), ll(c.slots), ll(c.HV), ll(c.V), ll(c.K)));
  if (!is_floating(c.state_dtype) && !is_quantized(c.state_dtype))
    fail(format(
        "StatePool state dtype must be float32, bfloat16, float16, float8_e4m3fn or int8; got %s",
        dtype_name(c.state_dtype)));
  if (is_quantized(c.state_dtype) && c.spec_rows > 0)
    fail(format(
        "StatePool with %s states: the speculative-verify scratch (spec_rows) is not built for "
        "quantized states yet (issue #36)",
        dtype_name(c.state_dtype)));
  if (c.envelope_extra_bytes < 0 || (c.envelope_extra_bytes && c.layout != PoolLayout::envelope))
    fail("StatePool envelope_extra_bytes applies to the envelope layout only and must be >= 0");
  if (c.conv_dim < 0) fail(format("StatePool conv_dim must be >= 0; got %lld", ll(c.conv_dim)));
  if (c.conv_dim > 0) {
    if (c.conv_width < 2 || c.conv_width > 4)
      fail(format("StatePool conv_width must be 2..4 (causal_conv1d's widths); got %lld",
                  ll(c.conv_width)));
    if (!is_floating(c.conv_dtype))
      fail(format("StatePool conv_dtype must be float32, bfloat16 or float16; got %s",
                  dtype_name(c.conv_dtype)));
    if (c.conv_split_qkv && (c.H < 1 || c.conv_dim != 2 * c.H * c.K + c.HV * c.V))
      fail(
          format("StatePool conv_split_qkv needs H >= 1 and conv_dim = 2*H*K + HV*V; got H=%lld, "
                 "conv_dim=%lld (2*H*K + HV*V = %lld)",
                 ll(c.H), ll(c.conv_dim), ll(2 * c.H * c.K + c.HV * c.V)));
  } else if (c.conv_split_qkv) {
    fail("StatePool conv_split_qkv needs conv_dim > 0");
  }
  if (c.spec_rows < 0 || c.spec_steps < 0 || (c.spec_rows == 0) != (c.spec_steps == 0))
    fail(
        format("StatePool spec_rows and spec_steps go together (both >= 1 for a speculative-verify "
               "scratch, both 0 for none); got spec_rows=%lld, spec_steps=%lld",
               ll(c.spec_rows), ll(c.spec_steps)));
  if (c.replay_len < 0) fail("ReplaySSM cache length must be at least 1.");
  if (c.replay_len > 0) {
    if (c.H < 1 || c.HV % c.H != 0)
      fail(
          format("StatePool with ReplaySSM rings needs the key-head count H (HV a multiple of H); "
                 "got H=%lld, HV=%lld",
                 ll(c.H), ll(c.HV)));
    if (!is_floating(c.ring_k_dtype))
      fail(format("StatePool ring_k_dtype must be a float dtype; got %s",
                  dtype_name(c.ring_k_dtype)));
  }
}

StatePool::Layout StatePool::layout_of(const StatePoolConfig& c) {
  Layout l{};
  const int64_t isz = dtype_size(c.state_dtype);
  const int64_t head_bytes = c.HV * c.V * c.K * isz;  // one (layer, slot) state's elements
  const int64_t block = state_block_bytes(c);         // with a quantized state's scales
  const int64_t n = c.physical_slots();               // rows of every view (null slot included)
  l.state_offset = 0;
  // Conv windows: one packed part or three (q, k, v).
  const int64_t csz = dtype_size(c.conv_dtype), W1 = c.conv_width - 1;
  l.conv_parts = c.conv_dim == 0 ? 0 : c.conv_split_qkv ? 3 : 1;
  l.conv_layer_pitch = 0;
  for (int j = 0; j < 3; ++j) {
    l.conv_part_dim[j] = l.conv_parts == 3               ? (j < 2 ? c.H * c.K : c.HV * c.V)
                         : (j == 0 && l.conv_parts == 1) ? c.conv_dim
                                                         : 0;
    l.conv_block[j] = l.conv_part_dim[j] * W1 * csz;
    l.conv_offset[j] = 0;
    l.conv_layer_pitch += round_up(l.conv_block[j], 32);
  }
  l.conv_pad =
      c.layout == PoolLayout::envelope ? round_up(c.layers * l.conv_layer_pitch, kAlign) : 0;
  // A slot's state in every layer is `slot_rows` rows of entry_bytes, slot_row_pitch apart: its
  // one entry (envelope) or one row per layer (per_layer).
  if (c.layout == PoolLayout::envelope) {
    l.extra_pad = round_up(c.envelope_extra_bytes, kAlign);
    l.entry_bytes = round_up(l.extra_pad + l.conv_pad + c.layers * envelope_layer_pitch(c), kAlign);
    l.state_bytes = n * l.entry_bytes;
    l.slot_rows = 1;
    l.slot_row_pitch = l.entry_bytes;
  } else {
    l.extra_pad = 0;
    l.entry_bytes = block;
    l.state_bytes = c.layers * n * block;
    l.slot_rows = c.layers;
    l.slot_row_pitch = n * l.entry_bytes;
  }
  int64_t off = round_up(l.state_bytes, kAlign);
  if (c.layout == PoolLayout::per_layer) {
    for (int j = 0; j < l.conv_parts; ++j) {
      l.conv_offset[j] = off;
      off = round_up(off + c.layers * n * l.conv_block[j], kAlign);
    }
  }
  const int64_t L = c.replay_len;
  l.d_offset = off;
  off = round_up(off + c.layers * n * c.HV * L * c.V * dtype_size(ring_d_dtype(c)), kAlign);
  l.k_offset = off;
  off = round_up(off + c.layers * n * c.H * L * c.K * dtype_size(c.ring_k_dtype), kAlign);
  l.g_offset = off;
  off = round_up(off + c.layers * n * c.HV * L * (c.kda ? c.K : 1) * 4, kAlign);
  const int64_t drafts = c.layers * c.spec_rows * c.spec_steps;
  l.spec_state_offset = off;
  off = round_up(off + drafts * head_bytes, kAlign);
  for (int j = 0; j < 3; ++j) {
    l.spec_conv_offset[j] = off;
    off = round_up(off + drafts * l.conv_block[j], kAlign);
  }
  l.spec_end = off;
  l.cursor_offset = off;
  off = round_up(off + n * 4, kAlign);
  l.step_offset = off;
  if (c.stochastic_rounding()) off = round_up(off + c.layers * 8, kAlign);
  l.total = off;
  return l;
}

StatePool::StatePool(const StatePoolConfig& config) : cfg_(config) {
  check_config(cfg_);
  lay_ = layout_of(cfg_);
  if (on_cuda(cfg_)) {
    base_ = cuda_backend::device_alloc(static_cast<size_t>(lay_.total), cfg_.device.index);
  } else {
    base_ = std::aligned_alloc(kAlign, static_cast<size_t>(lay_.total));
    if (!base_)
      throw Error(ErrorKind::runtime,
                  format("StatePool: cannot allocate %lld bytes", ll(lay_.total)));
    std::memset(base_, 0, static_cast<size_t>(lay_.total));
  }
  owns_ = true;
  allocated_.assign(static_cast<size_t>(cfg_.physical_slots()), 0);
}

StatePool::StatePool(const StatePoolConfig& config, void* external_memory) : cfg_(config) {
  check_config(cfg_);
  lay_ = layout_of(cfg_);
  if (!external_memory || reinterpret_cast<uintptr_t>(external_memory) % kAlign != 0)
    fail(format("StatePool external memory must be non-null and %lld-byte aligned", ll(kAlign)));
  base_ = external_memory;
  allocated_.assign(static_cast<size_t>(cfg_.physical_slots()), 0);
}

StatePool::~StatePool() {
  if (!owns_) return;
  if (on_cuda(cfg_)) cuda_backend::device_free(base_, cfg_.device.index);
  else std::free(base_);
}

void StatePool::check_slot(int64_t slot, const char* what) const {
  if (slot < 0 || slot >= cfg_.physical_slots()) {
    if (cfg_.null_slot)
      fail(
          format("StatePool.%s: slot %lld is out of range for a pool of %lld slots (1..%lld; slot "
                 "0 is the null slot)",
                 what, ll(slot), ll(cfg_.slots), ll(cfg_.slots)));
    fail(format("StatePool.%s: slot %lld is out of range for a pool of %lld slots", what, ll(slot),
                ll(cfg_.slots)));
  }
}

namespace {
// The first allocatable slot: 1 when slot 0 is the null slot.
int64_t first_slot(const StatePoolConfig& c) { return c.null_slot ? 1 : 0; }
}  // namespace

int64_t StatePool::allocate(bool clear, Stream stream) {
  auto it = std::find(allocated_.begin() + first_slot(cfg_), allocated_.end(), 0);
  if (it == allocated_.end())
    fail(
        format("StatePool exhausted: all %lld slots are in use (free a slot, or size the pool "
               "for a memory budget with slots_for_budget)",
               ll(cfg_.slots)));
  const int64_t slot = it - allocated_.begin();
  if (clear) clear_slot(slot, stream);
  set_cursor(slot, 0, stream);
  *it = 1;
  return slot;
}

void StatePool::free(int64_t slot) {
  check_slot(slot, "free");
  if (cfg_.null_slot && slot == 0)
    fail("StatePool.free: slot 0 is the null slot of this pool (never allocated)");
  if (!allocated_[static_cast<size_t>(slot)])
    fail(format("StatePool.free: slot %lld is not allocated (double free?)", ll(slot)));
  allocated_[static_cast<size_t>(slot)] = 0;
}

bool StatePool::is_allocated(int64_t slot) const {
  return slot >= first_slot(cfg_) && slot < cfg_.physical_slots() &&
         allocated_[static_cast<size_t>(slot)];
}

int64_t StatePool::num_free() const {
  return std::count(allocated_.begin() + first_slot(cfg_), allocated_.end(), 0);
}

std::vector<StatePool::SlotRun> StatePool::slot_runs() const {
  std::vector<SlotRun> runs;
  // The state in every layer: the layers' rows (per_layer) or the one entry (envelope, which
  // holds the conv windows too).
  runs.push_back(
      {lay_.state_offset, lay_.entry_bytes, lay_.slot_rows, lay_.slot_row_pitch, lay_.entry_bytes});
  if (cfg_.layout == PoolLayout::per_layer) {
    const int64_t n = cfg_.physical_slots();
    for (int j = 0; j < lay_.conv_parts; ++j)
      runs.push_back({lay_.conv_offset[j], lay_.conv_block[j], cfg_.layers, n * lay_.conv_block[j],
                      lay_.conv_block[j]});
  }
  return runs;
}

void StatePool::clear_slot(int64_t slot, Stream stream) {
  for (const SlotRun& r : slot_runs()) {
    char* first = at(r.offset + slot * r.slot_step);
    if (on_cuda(cfg_)) {
      cuda_backend::memset_2d_async(first, static_cast<size_t>(r.pitch), 0,
                                    static_cast<size_t>(r.bytes), static_cast<size_t>(r.rows),
                                    cfg_.device.index, stream);
    } else {
      for (int64_t i = 0; i < r.rows; ++i)
        std::memset(first + i * r.pitch, 0, static_cast<size_t>(r.bytes));
    }
  }
}

void StatePool::fork(int64_t src, int64_t dst, Stream stream, const ForkRing& ring) {
  check_slot(src, "fork");
  check_slot(dst, "fork");
  auto state = [this](int64_t s) {
    return is_allocated(s) ? "allocated" : cfg_.null_slot && s == 0 ? "the null slot" : "free";
  };
  if (!is_allocated(src) || !is_allocated(dst))
    fail(format("StatePool.fork: both slots must be allocated (src %lld is %s, dst %lld is %s)",
                ll(src), state(src), ll(dst), state(dst)));
  if (src == dst) fail(format("StatePool.fork: src and dst are the same slot %lld", ll(src)));
  const int32_t wp = cursor(src, stream);
  const int64_t L = cfg_.replay_len;
  if (wp != 0 && L == 0)
    fail(
        format("copy_from requires a fully-flushed ReplaySSM source (write_pos==0), got %d for "
               "src %lld",
               wp, ll(src)));
  if (wp != 0) {  // every check before the first write
    if (wp < 0 || wp >= L)
      fail(format("StatePool.fork: the cursor of src %lld is %d, outside the ring [0, L-1=%lld]",
                  ll(src), wp, ll(L - 1)));
    if (ring.cache_base < 0 || ring.cache_base >= L)
      fail(format("StatePool.fork: cache_base=%d is outside the ring [0, L-1=%lld]",
                  ring.cache_base, ll(L - 1)));
    if (ring.predecayed_k_cache && (!cfg_.kda || !ring.prefix_gate_cache))
      fail("Pre-decayed K requires KDA circular replay with prefix gates.");
  }
  // layer l's rebuild problem (the pending records of src into dst)
  auto rebuild = [&](int64_t layer) {
    const TensorView st = layer_state(layer), d = d_cache(layer), k = k_cache(layer);
    detail::ReplayProblem p;
    p.H = static_cast<int32_t>(cfg_.H);
    p.HV = static_cast<int32_t>(cfg_.HV);
    p.K = static_cast<int32_t>(cfg_.K);
    p.V = static_cast<int32_t>(cfg_.V);
    p.L = static_cast<int32_t>(L);
    p.gate.kda = cfg_.kda;
    p.state = {st.data, st.dtype, st.stride[0], st.shape[0]};
    // The pool's format: dst's rows stored with fresh scales and src's key at the layer's step
    // (the materializations' rule), the counter read where it lies (on the device for CUDA pools).
    if (is_quantized(cfg_.state_dtype)) {
      const TensorView sc = layer_scales(layer);
      p.state.scales = static_cast<float*>(sc.data);
      p.state.scale_slot_stride = sc.stride[0];
    }
    if (cfg_.stochastic_rounding()) {
      p.state.stochastic = true;
      p.state.step = static_cast<int64_t*>(rounding_step(layer).data);
      p.state.seed = cfg_.rounding_seed;
      p.state.layer = static_cast<uint64_t>(layer);
    }
    p.d_cache = d.data;
    p.d_dtype = d.dtype;
    p.k_cache = k.data;
    p.k_dtype = k.dtype;
    p.g_cache = static_cast<float*>(g_cache(layer).data);
    p.modes.circular = ring.cache_base != 0;
    p.modes.prefix_gates = ring.prefix_gate_cache && cfg_.kda;
    p.modes.predecayed_k = ring.predecayed_k_cache;
    p.device = cfg_.device;
    return p;
  };
  // the CUDA kernel's limits before anything is written (its shared memory grows with wp)
  if (wp != 0 && on_cuda(cfg_)) cuda_backend::check_replay_materialize(rebuild(0), wp);
  for (const SlotRun& r : slot_runs()) {
    const char* from = at(r.offset + src * r.slot_step);
    char* to = at(r.offset + dst * r.slot_step);
    if (on_cuda(cfg_)) {
      cuda_backend::copy_2d_async(to, static_cast<size_t>(r.pitch), from,
                                  static_cast<size_t>(r.pitch), static_cast<size_t>(r.bytes),
                                  static_cast<size_t>(r.rows), cfg_.device.index, stream);
    } else {
      for (int64_t i = 0; i < r.rows; ++i)
        std::memcpy(to + i * r.pitch, from + i * r.pitch, static_cast<size_t>(r.bytes));
    }
  }
  if (wp != 0) {
    for (int64_t layer = 0; layer < cfg_.layers; ++layer) {
      const detail::ReplayProblem p = rebuild(layer);
      if (on_cuda(cfg_))
        cuda_backend::run_replay_materialize(p, src, dst, wp, ring.cache_base, stream);
      else cpu::run_replay_materialize(p, src, dst, wp, ring.cache_base);
    }
  }
  set_cursor(dst, 0, stream);
}

namespace {
void check_layer(const StatePoolConfig& c, int64_t layer) {
  if (layer < 0 || layer >= c.layers)
    fail(format("StatePool: layer %lld is out of range for a pool of %lld layers", ll(layer),
                ll(c.layers)));
}
// A view of up to kMaxDims dims from shape and strides built at run time.
TensorView view_of(void* data, DType dtype, const std::vector<int64_t>& shape,
                   const std::vector<int64_t>& strides, Device device) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = static_cast<int>(shape.size());
  for (int d = 0; d < v.ndim; ++d) v.shape[d] = shape[d], v.stride[d] = strides[d];
  return v;
}
}  // namespace

TensorView StatePool::layer_state(int64_t layer) const {
  check_layer(cfg_, layer);
  const int64_t isz = dtype_size(cfg_.state_dtype);
  // A slot's rows are entry_bytes apart in both layouts (the envelope entry, or the per-layer
  // block of one (layer, slot)).
  const int64_t slot_stride = lay_.entry_bytes / isz;
  const int64_t offset =
      cfg_.layout == PoolLayout::envelope
          ? lay_.state_offset + lay_.extra_pad + lay_.conv_pad + layer * envelope_layer_pitch(cfg_)
          : lay_.state_offset + layer * cfg_.physical_slots() * lay_.entry_bytes;
  return TensorView::strided(at(offset), cfg_.state_dtype,
                             {cfg_.physical_slots(), cfg_.HV, cfg_.V, cfg_.K},
                             {slot_stride, cfg_.V * cfg_.K, cfg_.K, 1}, cfg_.device);
}

TensorView StatePool::layer_scales(int64_t layer) const {
  if (!is_quantized(cfg_.state_dtype))
    fail(format("StatePool.layer_scales: the pool's state is %s, which has no scales",
                dtype_name(cfg_.state_dtype)));
  const TensorView st = layer_state(layer);
  return TensorView::strided(static_cast<char*>(st.data) + scales_offset(cfg_), DType::f32,
                             {cfg_.physical_slots(), cfg_.HV, cfg_.V},
                             {st.stride[0] / 4, cfg_.V, 1}, cfg_.device);
}

TensorView StatePool::scales() const {
  const TensorView first = layer_scales(0);
  const TensorView all = states();
  return view_of(first.data, DType::f32, {cfg_.layers, cfg_.physical_slots(), cfg_.HV, cfg_.V},
                 {all.stride[0] / 4, first.stride[0], cfg_.V, 1}, cfg_.device);
}

TensorView StatePool::rounding_step(int64_t layer) const {
  if (!cfg_.stochastic_rounding())
    fail(
        "StatePool.rounding_step: the pool rounds its states to nearest (no step counter; "
        "configure state_rounding stochastic)");
  check_layer(cfg_, layer);
  return TensorView::contiguous(at(lay_.step_offset + layer * 8), DType::i64, {1}, cfg_.device);
}

TensorView StatePool::rounding_steps() const {
  TensorView v = rounding_step(0);
  v.shape[0] = cfg_.layers;
  return v;
}

int64_t StatePool::conv_entry_offset(int64_t layer, int part) const {
  int64_t off = lay_.extra_pad + layer * lay_.conv_layer_pitch;
  for (int j = 0; j < part; ++j) off += round_up(lay_.conv_block[j], 32);
  return off;
}

int StatePool::stored_conv_part(int part, const char* what) const {
  if (lay_.conv_parts == 0)
    fail("StatePool has no conv windows (configure conv_dim > 0 to create them)");
  if (part < -1 || part > 2)
    fail(format("StatePool.%s: part must be -1 (packed), 0 (q), 1 (k) or 2 (v); got %d", what,
                part));
  if (part == -1 && lay_.conv_parts == 3)
    fail(
        format("StatePool.%s: the pool keeps separate q, k, v windows (conv_split_qkv); pass "
               "part 0, 1 or 2",
               what));
  if (part >= 0 && lay_.conv_parts == 1 && 2 * cfg_.H * cfg_.K + cfg_.HV * cfg_.V != cfg_.conv_dim)
    fail(
        format("StatePool.%s: the q, k, v parts of a packed window need H with conv_dim "
               "= 2*H*K + HV*V; got H=%lld, conv_dim=%lld",
               what, ll(cfg_.H), ll(cfg_.conv_dim)));
  return lay_.conv_parts == 3 ? part : 0;
}

TensorView StatePool::conv_view(int64_t offset, int p, int part, std::vector<int64_t> lead,
                                std::vector<int64_t> lead_strides) const {
  const int64_t csz = dtype_size(cfg_.conv_dtype), W1 = cfg_.conv_width - 1;
  const int64_t dim = lay_.conv_part_dim[p];
  // channels of the view: the stored window's, or a packed window's q / k / v slice
  int64_t first = 0, channels = dim;
  if (lay_.conv_parts == 1 && part >= 0) {
    const int64_t hk = cfg_.H * cfg_.K;
    first = part == 0 ? 0 : part == 1 ? hk : 2 * hk;
    channels = part == 2 ? cfg_.HV * cfg_.V : hk;
  }
  const bool dim_major = cfg_.conv_layout == ConvLayout::dim_contiguous;
  const int64_t dim_stride = dim_major ? 1 : W1, tok_stride = dim_major ? dim : 1;
  lead.push_back(channels);
  lead.push_back(W1);
  lead_strides.push_back(dim_stride);
  lead_strides.push_back(tok_stride);
  return view_of(at(offset + first * dim_stride * csz), cfg_.conv_dtype, lead, lead_strides,
                 cfg_.device);
}

TensorView StatePool::states() const {
  const int64_t isz = dtype_size(cfg_.state_dtype);
  const TensorView first = layer_state(0);
  const int64_t layer_stride = cfg_.layout == PoolLayout::envelope
                                   ? envelope_layer_pitch(cfg_) / isz
                                   : cfg_.physical_slots() * lay_.entry_bytes / isz;
  return view_of(first.data, cfg_.state_dtype,
                 {cfg_.layers, cfg_.physical_slots(), cfg_.HV, cfg_.V, cfg_.K},
                 {layer_stride, first.stride[0], cfg_.V * cfg_.K, cfg_.K, 1}, cfg_.device);
}

TensorView StatePool::conv_states(int part) const {
  const int p = stored_conv_part(part, "conv_states");
  const int64_t csz = dtype_size(cfg_.conv_dtype), n = cfg_.physical_slots();
  const int64_t W1 = cfg_.conv_width - 1;
  if (cfg_.layout == PoolLayout::envelope)
    return conv_view(lay_.state_offset + conv_entry_offset(0, p), p, part, {cfg_.layers, n},
                     {lay_.conv_layer_pitch / csz, lay_.entry_bytes / csz});
  const int64_t block = lay_.conv_part_dim[p] * W1;
  return conv_view(lay_.conv_offset[p], p, part, {cfg_.layers, n}, {n * block, block});
}

namespace {
void require_spec(const StatePoolConfig& c) {
  if (c.spec_rows <= 0)
    fail(
        "StatePool has no speculative-verify scratch (configure spec_rows and spec_steps >= 1 "
        "to create it)");
}
}  // namespace

TensorView StatePool::intermediate_states() const {
  require_spec(cfg_);
  const int64_t head = cfg_.HV * cfg_.V * cfg_.K, R = cfg_.spec_rows, S = cfg_.spec_steps;
  return view_of(at(lay_.spec_state_offset), cfg_.state_dtype,
                 {cfg_.layers, R, S, cfg_.HV, cfg_.V, cfg_.K},
                 {R * S * head, S * head, head, cfg_.V * cfg_.K, cfg_.K, 1}, cfg_.device);
}

TensorView StatePool::intermediate_states(int64_t layer) const {
  require_spec(cfg_);
  check_layer(cfg_, layer);
  TensorView all = intermediate_states();
  TensorView v =
      view_of(static_cast<char*>(all.data) + layer * all.stride[0] * dtype_size(cfg_.state_dtype),
              cfg_.state_dtype, {all.shape[1], all.shape[2], cfg_.HV, cfg_.V, cfg_.K},
              {all.stride[1], all.stride[2], all.stride[3], all.stride[4], 1}, cfg_.device);
  return v;
}

TensorView StatePool::intermediate_conv_windows(int part) const {
  require_spec(cfg_);
  const int p = stored_conv_part(part, "intermediate_conv_windows");
  const int64_t block = lay_.conv_part_dim[p] * (cfg_.conv_width - 1);
  const int64_t R = cfg_.spec_rows, S = cfg_.spec_steps;
  return conv_view(lay_.spec_conv_offset[p], p, part, {cfg_.layers, R, S},
                   {R * S * block, S * block, block});
}

TensorView StatePool::intermediate_conv_window(int64_t layer, int part) const {
  require_spec(cfg_);
  check_layer(cfg_, layer);
  const int p = stored_conv_part(part, "intermediate_conv_window");
  const int64_t block = lay_.conv_part_dim[p] * (cfg_.conv_width - 1);
  const int64_t R = cfg_.spec_rows, S = cfg_.spec_steps;
  return conv_view(lay_.spec_conv_offset[p] + layer * R * S * block * dtype_size(cfg_.conv_dtype),
                   p, part, {R, S}, {S * block, block});
}

TensorView StatePool::conv_state(int64_t layer, int part) const {
  if (lay_.conv_parts == 0)
    fail("StatePool has no conv windows (configure conv_dim > 0 to create them)");
  check_layer(cfg_, layer);
  const int p = stored_conv_part(part, "conv_state");
  const int64_t csz = dtype_size(cfg_.conv_dtype), n = cfg_.physical_slots();
  if (cfg_.layout == PoolLayout::envelope)
    return conv_view(lay_.state_offset + conv_entry_offset(layer, p), p, part, {n},
                     {lay_.entry_bytes / csz});
  const int64_t block = lay_.conv_part_dim[p] * (cfg_.conv_width - 1);
  return conv_view(lay_.conv_offset[p] + layer * n * lay_.conv_block[p], p, part, {n}, {block});
}

namespace {
void require_rings(const StatePoolConfig& c, int64_t layer) {
  if (c.replay_len <= 0)
    fail("StatePool has no ReplaySSM rings (configure replay_len >= 1 to create them)");
  check_layer(c, layer);
}
}  // namespace

TensorView StatePool::d_cache(int64_t layer) const {
  require_rings(cfg_, layer);
  const int64_t n = cfg_.physical_slots();
  const int64_t per_layer = n * cfg_.HV * cfg_.replay_len * cfg_.V;
  const DType dt = ring_d_dtype(cfg_);
  return TensorView::contiguous(at(lay_.d_offset + layer * per_layer * dtype_size(dt)), dt,
                                {n, cfg_.HV, cfg_.replay_len, cfg_.V}, cfg_.device);
}

TensorView StatePool::k_cache(int64_t layer) const {
  require_rings(cfg_, layer);
  const int64_t n = cfg_.physical_slots();
  const int64_t per_layer = n * cfg_.H * cfg_.replay_len * cfg_.K;
  return TensorView::contiguous(
      at(lay_.k_offset + layer * per_layer * dtype_size(cfg_.ring_k_dtype)), cfg_.ring_k_dtype,
      {n, cfg_.H, cfg_.replay_len, cfg_.K}, cfg_.device);
}

TensorView StatePool::g_cache(int64_t layer) const {
  require_rings(cfg_, layer);
  const int64_t n = cfg_.physical_slots();
  const int64_t width = cfg_.kda ? cfg_.K : 1;
  const int64_t per_layer = n * cfg_.HV * cfg_.replay_len * width;
  void* p = at(lay_.g_offset + layer * per_layer * 4);
  if (cfg_.kda)
    return TensorView::contiguous(p, DType::f32, {n, cfg_.HV, cfg_.replay_len, cfg_.K},
                                  cfg_.device);
  return TensorView::contiguous(p, DType::f32, {n, cfg_.HV, cfg_.replay_len}, cfg_.device);
}

TensorView StatePool::write_pos() const {
  return TensorView::contiguous(at(lay_.cursor_offset), DType::i32, {cfg_.physical_slots()},
                                cfg_.device);
}

void* StatePool::envelope_extra(int64_t slot) const {
  if (cfg_.layout != PoolLayout::envelope)
    fail("StatePool.envelope_extra: the pool is not an envelope");
  check_slot(slot, "envelope_extra");
  return at(lay_.state_offset + slot * lay_.entry_bytes);
}

int32_t StatePool::cursor(int64_t slot, Stream stream) const {
  check_slot(slot, "cursor");
  const void* p = at(lay_.cursor_offset + slot * 4);
  int32_t v = 0;
  if (on_cuda(cfg_)) cuda_backend::copy_to_host(&v, p, 4, cfg_.device.index, stream);
  else std::memcpy(&v, p, 4);
  return v;
}

void StatePool::set_cursor(int64_t slot, int32_t value, Stream stream) {
  check_slot(slot, "set_cursor");
  void* p = at(lay_.cursor_offset + slot * 4);
  if (on_cuda(cfg_)) cuda_backend::copy_to_device(p, &value, 4, cfg_.device.index, stream);
  else std::memcpy(p, &value, 4);
}

int64_t StatePool::bytes_per_slot(const StatePoolConfig& c) {
  check_config(c);
  const int64_t L = c.replay_len;
  const int64_t conv = c.conv_dim * (c.conv_width - 1) * dtype_size(c.conv_dtype);
  const int64_t state = c.layout == PoolLayout::envelope
                            ? layout_of(c).entry_bytes
                            : c.layers * (state_block_bytes(c) + (c.conv_dim > 0 ? conv : 0));
  const int64_t rings =
      c.layers * (c.HV * L * c.V * dtype_size(ring_d_dtype(c)) +
                  c.H * L * c.K * dtype_size(c.ring_k_dtype) + c.HV * L * (c.kda ? c.K : 1) * 4);
  return state + rings + 4;
}

int64_t StatePool::spec_bytes(const StatePoolConfig& c) {
  check_config(c);
  const Layout l = layout_of(c);
  return l.spec_end - l.spec_state_offset;
}

int64_t StatePool::required_bytes(const StatePoolConfig& c) {
  check_config(c);
  return layout_of(c).total;
}

int64_t StatePool::slots_for_budget(StatePoolConfig c, int64_t budget_bytes) {
  c.slots = 1;
  check_config(c);
  if (layout_of(c).total > budget_bytes) return 0;
  int64_t lo = 1, hi = budget_bytes / bytes_per_slot(c) + 1;  // lo fits; hi may not
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    c.slots = mid;
    if (layout_of(c).total <= budget_bytes) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace deltastate
