// deltastate: the state pool of a serving engine's linear-attention layers.
//
// One pool holds, for `slots` requests and `layers` layers, the recurrent state [HV, V, K] of each
// (layer, slot), optionally the conv windows of the short causal conv before the delta rule
// (conv_dim > 0, below), optionally the ReplaySSM rings, and one ReplaySSM cursor per slot (shared
// by all layers, advanced once per forward). Memory is zero-initialized. Two layouts:
//   per_layer : state [layers, slots, HV, V, K]; a layer view has slot stride HV*V*K.
//   envelope  : one entry per slot holds every layer's conv windows and state (after
//               `envelope_extra_bytes` of other per-slot data), so a layer view has a slot stride
//               of the whole entry, much larger than HV*V*K (SGLang's unified, page-major
//               "envelope" pools).
// Both layouts give views that every op accepts, with 64-bit offsets. Slots are 0..slots-1; a new
// request takes a slot with allocate() and returns it with free().
//
// Quantized states (state_dtype float8_e4m3fn or int8; docs/STATE_FORMATS.md): each (layer,
// slot) block holds the [HV, V, K] 1-byte codes, then (at a 32-byte boundary) their fp32 scales
// [HV, V], one per V row; the block is the unit that allocate() clears and fork() copies, and
// layer_state(l) / layer_scales(l) view it with the block's slot stride (per_layer: the block;
// envelope: the entry). A zeroed block (codes 0, scales 0) is the zero state. The ReplaySSM rings
// stay float (the d ring float32); the speculative scratch is not built for them yet.
// Stochastic rounding (rounds_stochastically(state_dtype, state_rounding)): the pool also holds
// one int64 step counter per layer (rounding_step(l)); an op given it reads it as the step of
// the generator's key (rounding_seed, slot, layer, step) and adds 1 on the device, so replaying a
// captured CUDA graph advances it without the host.
//
// Null slot (`null_slot = true`, the layout of SGLang's MambaPool, built by
// StatePoolConfig::sglang): slot 0 is a dummy row that exists in memory but is never allocated,
// so a caller may aim padded batch rows at it (SGLang's `clamp(min=0)`, FlashInfer's "index 0 is
// null") without touching a live request. `slots` stays the capacity (SGLang's `size`): every view
// then has physical_slots() = slots + 1 rows, allocate() returns 1..slots, and the byte accounting
// (required_bytes, slots_for_budget) counts the extra row. Slot 0 starts zeroed; whatever a padded
// row writes there later is garbage by definition (allocate never hands it out).
#pragma once

#include <cstdint>
#include <vector>

#include "deltastate/stream.h"
#include "deltastate/tensor.h"

namespace deltastate {

enum class PoolLayout { per_layer, envelope };
// The conv window's layout, both viewed as [slots, dim, conv_width - 1]:
//   window_contiguous: the window of a channel is contiguous (SGLang's [layers, slots, conv_dim,
//                      width-1]: strides (dim*(W-1), W-1, 1) per layer)
//   dim_contiguous:    stride 1 along dim (vLLM's causal_conv1d layout, memory [slots, W-1, dim]:
//                      strides (dim*(W-1), 1, dim))
enum class ConvLayout { window_contiguous, dim_contiguous };

struct StatePoolConfig {
  int64_t layers = 1;
  int64_t slots = 1;
  int64_t HV = 0, V = 0, K = 0;
  DType state_dtype = DType::f32;  // f32, bf16, f16; f8e4m3 or i8 with fp32 scales (above)
  StateRounding state_rounding = StateRounding::format_default;
  uint64_t rounding_seed = 0;  // the seed of the stochastic-rounding key
  PoolLayout layout = PoolLayout::per_layer;
  int64_t envelope_extra_bytes = 0;  // envelope only: other per-slot bytes at the entry's start
  // ReplaySSM rings; replay_len = 0 means none. The k ring has H key heads. The d ring has the
  // state dtype; the k ring `ring_k_dtype`: the op stores each normalized key rounded to it
  // (ReplayDecodeArgs), so float32, the default, is exact whatever the activations; the
  // activation dtype (bf16 with bf16 activations, SGLang's choice) halves the ring's bytes at
  // about 1e-3 relative output error for fp32 activations.
  int64_t replay_len = 0;
  int64_t H = 0;
  DType ring_k_dtype = DType::f32;
  bool kda = false;  // g ring [.., L, K] (KDA) or [.., L] (GDN)
  Device device{};
  // Reserve slot 0 as a never-allocated null slot (see the top of this file); `slots` is then
  // the number of allocatable slots and the views have slots + 1 rows.
  bool null_slot = false;
  // Conv windows, conv_dim = 0: none. Per (layer, slot) conv_dim channels of conv_width - 1
  // entries of conv_dtype (GDN's packed row: conv_dim = 2*H*K + HV*V). conv_split_qkv keeps
  // three windows, q [H*K], k [H*K] and v [HV*V] channels (Kimi-Linear's separate convs; needs H
  // and conv_dim = 2*H*K + HV*V), each its own tensor; otherwise one packed window. allocate()
  // zeroes a slot's windows with its state; fork() copies them.
  int64_t conv_dim = 0;
  int64_t conv_width = 4;
  DType conv_dtype = DType::f32;
  ConvLayout conv_layout = ConvLayout::window_contiguous;
  bool conv_split_qkv = false;

  // Speculative-verify scratch (SGLang's SpeculativeState), spec_rows = spec_steps = 0: none.
  // spec_rows scratch rows (one per batch row of a verify) of spec_steps draft positions: per
  // layer the state after each draft [spec_rows, spec_steps, HV, V, K] (state dtype, the verify
  // op's intermediate_states) and, with conv windows, the window after each draft [spec_rows,
  // spec_steps, dim, W-1] per conv part (conv dtype and layout; causal_conv1d_update's
  // intermediate_conv_window). Not per slot: one block, not cleared or forked with slots.
  int64_t spec_rows = 0, spec_steps = 0;

  bool stochastic_rounding() const { return rounds_stochastically(state_dtype, state_rounding); }
  // Rows of every view: slots, plus one with null_slot.
  int64_t physical_slots() const { return slots + (null_slot ? 1 : 0); }

  // SGLang's MambaPool layout: `size` requests, state [layers, size + 1, HV, V, K] (per_layer,
  // fp32 unless changed), slot 0 reserved as the null slot, allocate() returning 1..size. Set
  // the other fields (state_dtype, replay_len, H, ring_k_dtype, kda, device) on the result.
  static StatePoolConfig sglang(int64_t layers, int64_t size, int64_t HV, int64_t V, int64_t K,
                                DType state_dtype = DType::f32) {
    StatePoolConfig c;
    c.layers = layers;
    c.slots = size;
    c.HV = HV;
    c.V = V;
    c.K = K;
    c.state_dtype = state_dtype;
    c.null_slot = true;
    return c;
  }
};

class StatePool {
 public:
  // Owns zeroed memory on config.device.
  explicit StatePool(const StatePoolConfig& config);
  // Over caller memory of at least required_bytes(config) bytes, 256-byte aligned, on
  // config.device; the caller zeroes it. Used by bindings whose framework owns the storage.
  StatePool(const StatePoolConfig& config, void* external_memory);
  ~StatePool();
  StatePool(const StatePool&) = delete;
  StatePool& operator=(const StatePool&) = delete;

  const StatePoolConfig& config() const { return cfg_; }

  // --- slots -------------------------------------------------------------------------------
  // Takes a free slot (the lowest one; never the null slot 0 of a null_slot pool), zeroes its
  // state in every layer (when `clear`) and resets its cursor. Throws when every slot is in use.
  int64_t allocate(bool clear = true, Stream stream = nullptr);
  // Returns a slot. Throws for a slot out of range, the null slot, or a slot not allocated
  // (double free).
  void free(int64_t slot);
  bool is_allocated(int64_t slot) const;  // false for the null slot
  int64_t num_free() const;               // allocatable slots not in use (null slot excluded)

  // How fork reads a source's pending ReplaySSM records: the ring mode its decode ran with
  // (ReplayDecodeArgs: cache_base the source row's circular base, 0 for the basic ring; prefix
  // gates and pre-decayed keys as that call's flags).
  struct ForkRing {
    int32_t cache_base = 0;
    bool prefix_gate_cache = false;
    bool predecayed_k_cache = false;
  };
  // Prefix caching: copy every layer's state (and conv windows) of `src` into `dst` (both
  // allocated) and reset dst's cursor to 0 (in circular mode dst's cache_base is the caller's:
  // 0). A source with pending ReplaySSM records (cursor m > 0: its checkpoint lags its tokens by
  // m) is materialized: dst's checkpoint in every layer becomes the state after those records,
  // e^Gtot * S0 + sum_j d_j (W_j * k_j)^T, computed with the operations a ReplaySSM fold uses, so
  // on the CPU a fold of the next token on src and on dst gives the same bits (fp32). Src and
  // the rings are not written. A quantized or stochastically rounded pool rebuilds in fp32
  // from dst's dequantized copy and stores each row through its format (a fresh row scale;
  // src's key at the layer's step, the counter not advanced): the bytes src's history checkpoint
  // at that step would hold, so the fork equals src's flush copied to dst. CUDA pools run a
  // kernel. A pool without rings refuses a nonzero source cursor. For CUDA pools the cursor check
  // reads one int from the device (a synchronization): not for the decode loop.
  void fork(int64_t src, int64_t dst, Stream stream, const ForkRing& ring);
  void fork(int64_t src, int64_t dst, Stream stream = nullptr) { fork(src, dst, stream, {}); }

  // --- views (`slots` rows here means config().physical_slots(): slots + 1 with null_slot) ---
  TensorView layer_state(int64_t layer) const;  // [slots, HV, V, K]
  // Quantized pools: the fp32 scales of layer_state(layer), [slots, HV, V] (slot stride: the
  // state's slot stride in bytes / 4); scales(): every layer's, [layers, slots, HV, V].
  TensorView layer_scales(int64_t layer) const;
  TensorView scales() const;
  // Stochastic rounding: the layer's int64 step counter, [1] (zero in a new pool); every
  // layer's, [layers] (the commit after a verify, which stores every layer).
  TensorView rounding_step(int64_t layer) const;
  TensorView rounding_steps() const;
  TensorView d_cache(int64_t layer) const;   // [slots, HV, L, V] (state dtype; quantized: f32)
  TensorView k_cache(int64_t layer) const;   // [slots, H, L, K]       (ring_k_dtype)
  TensorView g_cache(int64_t layer) const;   // [slots, HV, L(, K)]    (float32)
  TensorView write_pos() const;              // [slots] int32 cursors
  void* envelope_extra(int64_t slot) const;  // envelope: the entry's first extra bytes
  // Conv windows [slots, dim, conv_width - 1] of one layer (strides per conv_layout; envelope: the
  // entry's slot stride). part -1: the packed window (dim = conv_dim; not with conv_split_qkv);
  // 0, 1, 2: the q, k, v windows (dims H*K, H*K, HV*V; of a packed window, its channel slices).
  TensorView conv_state(int64_t layer, int part = -1) const;
  // Every layer at once, for the ops that take them in one launch (the commits after a verify):
  // [layers, slots, HV, V, K] and [layers, slots, dim, conv_width - 1].
  TensorView states() const;
  TensorView conv_states(int part = -1) const;
  // The speculative-verify scratch (spec_rows > 0): one layer's [spec_rows, spec_steps, HV, V, K]
  // and [spec_rows, spec_steps, dim, conv_width - 1] (part as conv_state), or every layer's with a
  // leading [layers] dimension.
  TensorView intermediate_states(int64_t layer) const;
  TensorView intermediate_states() const;
  TensorView intermediate_conv_window(int64_t layer, int part = -1) const;
  TensorView intermediate_conv_windows(int part = -1) const;

  // Host-side cursor access (CUDA pools: a copy on `stream`, then a wait for that stream; pass
  // the stream the decode ops run on so the read is ordered after them).
  int32_t cursor(int64_t slot, Stream stream = nullptr) const;
  void set_cursor(int64_t slot, int32_t value, Stream stream = nullptr);

  // --- accounting --------------------------------------------------------------------------
  // state + conv windows + rings + cursor (the speculative scratch is not per slot)
  static int64_t bytes_per_slot(const StatePoolConfig& config);
  // The speculative-verify scratch: states and conv windows of every layer, alignment included.
  static int64_t spec_bytes(const StatePoolConfig& config);
  // Everything, with alignment (and the null slot's row when config.null_slot).
  static int64_t required_bytes(const StatePoolConfig& config);
  // How many slots fit in `budget_bytes` (the whole pool, alignment included; with
  // config.null_slot the allocatable slots, the null slot's row counted in the budget).
  static int64_t slots_for_budget(StatePoolConfig config, int64_t budget_bytes);
  int64_t total_bytes() const { return required_bytes(cfg_); }
  void* data() const { return base_; }

 private:
  struct Layout {
    int64_t state_offset, state_bytes;
    int64_t entry_bytes;  // envelope entry pitch (bytes)
    int64_t extra_pad;    // envelope: bytes before the first layer's state in an entry
    // A slot's state in every layer as rows of entry_bytes, slot_row_pitch apart: the layers
    // (per_layer) or the one entry (envelope). Clearing and forking a slot copy these rows.
    int64_t slot_rows, slot_row_pitch;
    int64_t d_offset, k_offset, g_offset, cursor_offset, step_offset, total;
    // The speculative scratch: states [layers, rows, steps, HV, V, K] from spec_state_offset,
    // conv part j's windows [layers, rows, steps, dim_j, W-1] from spec_conv_offset[j].
    int64_t spec_state_offset, spec_conv_offset[3], spec_end;
    // Conv windows: `conv_parts` windows (1 packed, 3 split) of conv_part_dim[j] channels; the
    // block of one (layer, slot, part) is conv_block[j] bytes. per_layer: part j's blocks
    // [layers, slots] from conv_offset[j]; envelope: inside the entry, a layer's blocks one after
    // the other (each rounded up to 32 bytes), layers conv_layer_pitch bytes apart from
    // extra_pad on, then the layers' states from extra_pad + conv_pad.
    int conv_parts;
    int64_t conv_part_dim[3], conv_block[3], conv_offset[3];
    int64_t conv_layer_pitch, conv_pad;
  };
  // Byte offset inside an envelope entry of (layer, part)'s conv block.
  int64_t conv_entry_offset(int64_t layer, int part) const;
  // The window view of `part` (-1 packed, 0/1/2 q/k/v) of the stored part block `p` at byte
  // `offset` with leading dims `lead` of element strides `lead_strides` (the channel slice of a
  // packed window for part >= 0).
  TensorView conv_view(int64_t offset, int p, int part, std::vector<int64_t> lead,
                       std::vector<int64_t> lead_strides) const;
  int stored_conv_part(int part, const char* what) const;  // checks `part`; the stored part
  // A slot's memory as runs of `rows` rows of `bytes`, `pitch` apart, the first at
  // offset + slot*slot_step: what clearing and forking a slot touch.
  struct SlotRun {
    int64_t offset, slot_step, rows, pitch, bytes;
  };
  std::vector<SlotRun> slot_runs() const;
  static Layout layout_of(const StatePoolConfig& c);
  static void check_config(const StatePoolConfig& c);
  void check_slot(int64_t slot, const char* what) const;
  void clear_slot(int64_t slot, Stream stream);
  char* at(int64_t offset) const { return static_cast<char*>(base_) + offset; }

  StatePoolConfig cfg_;
  Layout lay_{};
  void* base_ = nullptr;
  bool owns_ = false;
  std::vector<char> allocated_;
};

}  // namespace deltastate
