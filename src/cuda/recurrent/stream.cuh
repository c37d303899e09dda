// The streaming decode kernel of the recurrent op: state tiles through shared memory with bulk
// copies, the token prepared once per tile by a producer warp.
// Part of recurrent.cu's translation unit (included there only), in its anonymous namespace.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/delta_math.h"
#include "core/problem.h"
#include "cuda/async_copy.cuh"
#include "cuda/grid.cuh"
#include "cuda/loads.cuh"
#include "cuda/recurrent/head_block.cuh"
#include "cuda/rows.cuh"
#include "cuda/stream_trace.h"
#include "cuda/token.cuh"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

using detail::RecurrentProblem;

namespace {

// Decode (one token per sequence, T = 1 without cu_seqlens) at large batch. A persistent grid;
// CTA b walks tiles b, b + gridDim.x, ... (tile = TILE_ROWS rows of one (sequence, value head))
// through a ring of STAGES shared-memory stages.
//
//  * The producer warp, per tile: resolves the slot, issues one bulk load of the tile (global ->
//    shared, completing on the stage's `full` mbarrier), and meanwhile prepares the token for the
//    consumers into the stage's prep record: q normalized and scaled, k normalized, alpha (per K
//    element for KDA), v of the tile's rows, beta, k.q. It issues the bulk store (shared ->
//    global) of each tile its consumers have finished, in order, and refills a stage once that
//    store has read it. Its input loads run two tiles ahead, unconditional and unconverted (no
//    instruction waits for them before the tile that uses them).
//  * NW consumer warps compute the tile in place: the delta-rule step on their rows from the prep
//    record, the output, the new state back into the stage; then they arrive on `done`.
//
// So the bytes in flight come from the copy engine rather than from resident warps holding tiles
// in registers, and the per-token work (norms, gates, divisions, input loads and their address
// arithmetic) runs once per 16 KB tile in one warp instead of in every warp that touches the head.
// That makes it the faster kernel for 16-bit states at large batch (2 KB per register-kernel
// warp-tile there); for fp32 states the register decode kernel is faster.
//
// Consumer lanes: G = K/16 lanes per row, each holding 16 elements of the row in 16-byte chunks
// (chunk c of lane l starts at element c*G*CE + l*CE), so a quarter warp reads 128 contiguous
// bytes of shared memory and a row's dot products need log2(G) shuffle stages.
template <class StateT, int K>
struct StreamLayout {
  static constexpr int kEsize = static_cast<int>(sizeof(StateT));
  static constexpr int CE = 16 / kEsize;                    // elements per 16-byte chunk
  static constexpr int EPL = 16;                            // elements per lane
  static constexpr int CH = EPL / CE;                       // chunks per lane
  static constexpr int G = K / EPL;                         // lanes per row
  static constexpr int RPP = 32 / G;                        // rows per warp per pass
  static constexpr int R = (kEsize == 4 || G < 8) ? 2 : 4;  // passes (rows per thread)
  static constexpr int NW = kStreamConsumerWarps;
  static constexpr int THREADS = (NW + 1) * 32;
  static constexpr int TILE_ROWS = NW * RPP * R;
  static constexpr int TILE_BYTES = TILE_ROWS * K * kEsize;  // 16 KB (8 KB for bf16, K = 64)
  static constexpr int STAGES = kStreamStageBytes / TILE_BYTES;
  static constexpr int KPL = K / 32;          // producer lanes: K elements per lane
  static constexpr int VPL = TILE_ROWS / 32;  // producer lanes: v rows per lane
  // The prep record of a stage: q[K], k[K], alpha[K] (KDA), v[TILE_ROWS] floats, then scalars.
  static constexpr int PREP_FLOATS = 3 * K + TILE_ROWS;
  static constexpr int PREP_BYTES = PREP_FLOATS * 4 + 32;
  static constexpr int PREP_OFS = STAGES * TILE_BYTES;
  static constexpr int BAR_OFS = PREP_OFS + STAGES * PREP_BYTES;
  static constexpr int SMEM_BYTES = BAR_OFS + STAGES * (8 + 8 + 8);  // full, done, store pointer
  static_assert(G >= 2 && G <= 32 && 2 * R <= G, "K must be 64 or 128");
  static_assert(STAGES >= 2 && STAGES <= 8, "tile size");
  static_assert(PREP_BYTES % 16 == 0 && VPL >= 1, "prep record layout");
  __device__ static int elem(int lane, int c, int e) { return c * (G * CE) + (lane % G) * CE + e; }
};

// The scalars of a prep record (after its float arrays).
struct StagePrep {
  int64_t slot;     // the pool slot, kStagePadded or kStageBad
  int64_t out_off;  // element offset of the token's output row of this head
  float kq, beta, alpha0;
  int vb;  // the tile's row block
};
constexpr int64_t kStagePadded = -1;
constexpr int64_t kStageBad = -2;  // a bad index (bad_slot): handled as padding, NaN out

// One tile's inputs in the producer's lanes (lane l: K elements l*KPL.., rows l*VPL.. of the
// tile), loaded two tiles ahead of their use: where it lives, its slot, the token, the gate
// constants. All as loaded (InT: the inputs' wide type; the index and the gate constants as bits),
// converted by stream_prepare: a conversion where the load stands waits for it (the index's sign
// extension and the token's conversions would stall the producer).
template <class InT, int KPL, int VPL>
struct StreamInputs {
  HeadBlock c;
  uint64_t slot_bits;  // the index as loaded (index_of_bits); unused without indices
  TokenHeadInputs<KPL, InT> tok;
  InT v[VPL];  // rows past V: row V-1's (a load from a clamped row, so no zeroing waits for it)
  GateConsts<KPL, uint32_t> gc;
};
template <class In, int KPL, int VPL, int TILE_ROWS, class InT>
__device__ __forceinline__ void stream_load(const RecurrentProblem& p, int t, int vblocks, int lane,
                                            StreamInputs<InT, KPL, VPL>& x) {
  // Every load unconditional (loads.cuh, kZeroWord): no indices read kZeroWord (stream_slot
  // uses the sequence), GDN's scalar gate input is read by every lane's KPL entries (only the
  // first is used), rows past V read row V-1 (stream_prepare zeroes them).
  x.c = head_block(p, t, vblocks);
  const int n = x.c.n, kofs = lane * KPL;
  x.slot_bits = load_index_bits(p.indices ? p.indices : &kZeroWord, p.index_dtype,
                                p.indices ? n * p.index_stride : 0);
  auto ld = [](const void* ptr, DType dt, int64_t i) { return load_input<In, InT>(ptr, dt, i); };
  const int64_t q_off = head_offset(p.q, n, 0, x.c.h) + kofs;
  const int64_t k_off = head_offset(p.k, n, 0, x.c.h) + kofs;
  const int64_t g_off = head_offset(p.g, n, 0, x.c.hv);
#pragma unroll
  for (int i = 0; i < KPL; ++i) {
    x.tok.q[i] = ld(p.q.ptr, p.q.dtype, q_off + i);
    x.tok.k[i] = ld(p.k.ptr, p.k.dtype, k_off + i);
    x.tok.g[i] = ld(p.g.ptr, p.g.dtype, g_off + (p.gate.kda ? kofs + i : 0));
  }
  x.tok.b = ld(p.beta.ptr, p.beta.dtype, head_offset(p.beta, n, 0, x.c.hv));
  const int64_t v_off = head_offset(p.v, n, 0, x.c.hv);
  const int row0 = x.c.block * TILE_ROWS + lane * VPL;
#pragma unroll
  for (int r = 0; r < VPL; ++r) x.v[r] = ld(p.v.ptr, p.v.dtype, v_off + min(row0 + r, p.V - 1));
  load_gate_consts(p.gate, x.c.hv, p.K, kofs, KPL, x.gc);
}
template <class InT, int KPL, int VPL>
__device__ __forceinline__ int64_t stream_slot(const RecurrentProblem& p,
                                               const StreamInputs<InT, KPL, VPL>& x) {
  return p.indices ? index_of_bits(x.slot_bits, p.index_dtype) : x.c.n;
}

// The producer warp's token preparation into a stage's prep record (token.cuh / delta_math.h
// for the norm, the gate and beta).
template <int K, int KPL, int VPL, int TILE_ROWS, class InT>
__device__ __forceinline__ void stream_prepare(const RecurrentProblem& p,
                                               const StreamInputs<InT, KPL, VPL>& x, int64_t slot,
                                               int lane, float* rec, StagePrep* sc) {
  const TokenHeadInputs<KPL> tok = widen(x.tok);
  const GateConsts<KPL> gc = widen(p.gate, x.gc);
  float qn[KPL], kn[KPL], glog[KPL], al[KPL];
#pragma unroll
  for (int e = 0; e < KPL; ++e) {
    qn[e] = tok.q[e];
    kn[e] = tok.k[e];
  }
  const float kq = prepare_qk<KPL, 32>(qn, kn, p.l2norm, p.scale, lane);
  token_gate(p.gate, gc, tok.g, glog, al);
  static_assert(KPL == 2 || KPL == 4, "K must be 64 or 128");
  using VecK = std::conditional_t<KPL == 4, float4, float2>;
  *reinterpret_cast<VecK*>(rec + lane * KPL) = *reinterpret_cast<const VecK*>(qn);
  *reinterpret_cast<VecK*>(rec + K + lane * KPL) = *reinterpret_cast<const VecK*>(kn);
  if (p.gate.kda)
    *reinterpret_cast<VecK*>(rec + 2 * K + lane * KPL) = *reinterpret_cast<const VecK*>(al);
#pragma unroll
  for (int r = 0; r < VPL; ++r)
    rec[3 * K + lane * VPL + r] =
        x.c.block * TILE_ROWS + lane * VPL + r < p.V ? to_float(x.v[r]) : 0.0f;
  if (lane == 0) {
    sc->slot = slot;  // the pool slot, kStagePadded or kStageBad (load_tile)
    sc->out_off = head_offset(p.out, x.c.n, 0, x.c.hv);
    sc->kq = kq;
    sc->beta = detail::beta_value(tok.b, p.beta_is_logit, p.round_beta, p.beta.dtype);
    sc->alpha0 = al[0];  // GDN's alpha (KDA reads its per-element record)
    sc->vb = x.c.block;
  }
}

// CE consecutive floats of a prep array at element `kidx` (16-byte aligned).
template <int CE>
__device__ __forceinline__ void load_prep(const float* a, int kidx, float (&x)[CE]) {
#pragma unroll
  for (int j = 0; j < CE; j += 4) {
    const float4 v = *reinterpret_cast<const float4*>(a + kidx + j);
    x[j] = v.x;
    x[j + 1] = v.y;
    x[j + 2] = v.z;
    x[j + 3] = v.w;
  }
}

#if DELTASTATE_CUDA_STREAM_TRACE
static_assert(StreamLayout<__nv_bfloat16, 128>::STAGES == kStreamTraceStages,
              "bench/stream_trace reads the stage cycle with the kernel's stage count");
// Trace builds only (CMake DELTASTATE_CUDA_STREAM_TRACE; bench/stream_trace.cpp reads it): the
// SM clock at each point of the pipeline (StreamTracePoint) for the first tiles of the first
// CTAs of the last streaming launch. Lane 0 of the producer and of consumer warp 0 write it.
__device__ long long g_stream_trace[kStreamTraceCtas][kStreamTraceTiles][kStreamTracePoints];
#define DS_STREAM_STAMP(tile, point)                                                           \
  do {                                                                                         \
    if ((tile) < kStreamTraceTiles && static_cast<int>(blockIdx.x) < kStreamTraceCtas)         \
      g_stream_trace[blockIdx.x][tile][static_cast<int>(StreamTracePoint::point)] = clock64(); \
  } while (0)
#else
#define DS_STREAM_STAMP(tile, point) \
  do {                               \
  } while (0)
#endif

template <class StateT, int K, class In>
__global__ void __launch_bounds__(StreamLayout<StateT, K>::THREADS, kStreamCtasPerSm)
    recurrent_stream_kernel(const RecurrentProblem p, int vblocks, int ntiles) {
  using Lay = StreamLayout<StateT, K>;
  constexpr int NW = Lay::NW, STAGES = Lay::STAGES, G = Lay::G, RPP = Lay::RPP, R = Lay::R;
  constexpr int CE = Lay::CE, CH = Lay::CH, KPL = Lay::KPL, VPL = Lay::VPL;
  constexpr int TILE_ROWS = Lay::TILE_ROWS;
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Lay::BAR_OFS);
  uint64_t* done = full + STAGES;
  StateT** stage_ptr = reinterpret_cast<StateT**>(done + STAGES);
  auto tile_smem = [&](int s) { return smem + s * Lay::TILE_BYTES; };
  auto prep_rec = [&](int s) {
    return reinterpret_cast<float*>(smem + Lay::PREP_OFS + s * Lay::PREP_BYTES);
  };
  auto prep_sc = [&](int s) {
    return reinterpret_cast<StagePrep*>(prep_rec(s) + Lay::PREP_FLOATS);
  };

  enter_grid(p.pdl_trigger_early);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n_local = (ntiles - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) /
                      static_cast<int>(gridDim.x);
  auto tile_id = [&](int i) {
    return static_cast<int>(blockIdx.x) + i * static_cast<int>(gridDim.x);
  };
  // Bytes of row block vb (the last one of a head may be partial).
  auto tile_bytes = [&](int vb) {
    return static_cast<uint32_t>(min(TILE_ROWS, p.V - vb * TILE_ROWS)) * K * Lay::kEsize;
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s],
                32);  // the producer warp's lanes (prep record written) + the tile's bytes
      mbar_init(&done[s], NW * 32);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (warp == NW) {  // ---- producer warp ----
    // Tiles in order: tile ld is loaded once the stores its consumers have finished are issued
    // and a stage is free, at most STAGES - 1 ahead of `st` (the next tile to store, in order,
    // once its consumers are done). Lane 0 issues every bulk copy; each stored tile commits one
    // bulk group (empty for padding), so tile j's store is the (st-1-j)-th most recent group, and
    // a stage is refilled once its last store has read it. Loading only STAGES - 1 ahead keeps
    // the stage being refilled one store older than the newest: refilling the stage just stored
    // would wait for that store's read, a fixed cost per tile whatever the tile's bytes. The
    // inputs go two tiles ahead, in two sets of registers (a and b) that the loop alternates, so
    // that neither the tile's bulk load (its slot) nor its preparation (its token) waits for a
    // load issued just before.
    const int64_t head_elems = static_cast<int64_t>(p.V) * K;
    int st = 0;
    auto store_tile = [&] {  // lane 0: the store of tile st (its consumers are done)
      const int s = st % STAGES;
      const StagePrep* sc = prep_sc(s);
      if (sc->slot >= 0) bulk_store(stage_ptr[s], tile_smem(s), tile_bytes(sc->vb));
      bulk_commit();
      DS_STREAM_STAMP(st, store_issued);
    };
    auto store_ready = [&] {  // stores of the tiles whose consumers are done, without waiting
      for (;;) {
        int stored = 0;
        if (lane == 0 && mbar_test(&done[st % STAGES], (st / STAGES) & 1)) {
          store_tile();
          stored = 1;
        }
        if (!__shfl_sync(0xffffffffu, stored, 0)) return;
        ++st;
      }
    };
    auto store_waiting = [&] {  // the store of tile st, waiting for its consumers
      if (lane == 0) {
        mbar_wait(&done[st % STAGES], (st / STAGES) & 1);
        store_tile();
      }
      __syncwarp();
      ++st;
    };
    using InT = typename In::wide_type;
    auto load_tile = [&](int ld, StreamInputs<InT, KPL, VPL>& x) {
      if (lane == 0) DS_STREAM_STAMP(ld, producer_enter);
      if (st < ld) store_ready();
      while (ld >= st + STAGES - 1) store_waiting();  // all stages busy
      const int s = ld % STAGES;
      // The slot, kStagePadded (index < 0) or kStageBad (index past the pool: no bulk load or
      // store, its consumers write NaN, recorded once per row); every lane holds it.
      const int64_t index = stream_slot(p, x);
      const bool bad = bad_slot(p, index);
      const int64_t slot = bad ? kStageBad : index < 0 ? kStagePadded : index;
      if (lane == 0) {
        if (bad) record_bad_slot(p, x.c.n, index, x.c.hv == 0 && x.c.block == 0);
        if (ld >= STAGES) bulk_wait_read_n(st - 1 - (ld - STAGES));
        DS_STREAM_STAMP(ld, stage_free);
        if (slot >= 0) {
          StateT* g = static_cast<StateT*>(p.state.ptr) + slot * p.state.slot_stride +
                      x.c.hv * head_elems + static_cast<int64_t>(x.c.block) * TILE_ROWS * K;
          const uint32_t bytes = tile_bytes(x.c.block);
          stage_ptr[s] = g;
          mbar_expect_tx(&full[s], bytes);
          bulk_load(tile_smem(s), g, bytes, &full[s]);
        }
      }
      __syncwarp();  // the stage's previous prep record has been read (its store has been issued)
      stream_prepare<K, KPL, VPL, TILE_ROWS>(p, x, slot, lane, prep_rec(s), prep_sc(s));
      mbar_arrive(&full[s]);
      if (lane == 0) DS_STREAM_STAMP(ld, prepared);
      // Tile ld + 2's input loads go out after the arrive: an arrive is a release, which would
      // wait for loads still in flight before it.
      if (ld + 2 < n_local)
        stream_load<In, KPL, VPL, TILE_ROWS>(p, tile_id(ld + 2), vblocks, lane, x);
    };
    StreamInputs<InT, KPL, VPL> a, b;
    if (n_local > 0) stream_load<In, KPL, VPL, TILE_ROWS>(p, tile_id(0), vblocks, lane, a);
    if (n_local > 1) stream_load<In, KPL, VPL, TILE_ROWS>(p, tile_id(1), vblocks, lane, b);
    for (int ld = 0; ld < n_local; ld += 2) {
      load_tile(ld, a);
      if (ld + 1 < n_local) load_tile(ld + 1, b);
    }
    while (st < n_local) store_waiting();
    if (lane == 0) bulk_wait_all();
    return;
  }

  // ---- consumer warps ----
  const int lrow0 = warp * RPP * R + lane / G;  // tile-local row of pass 0
  for (int i = 0; i < n_local; ++i) {
    const int s = i % STAGES;
    if (threadIdx.x == 0) DS_STREAM_STAMP(i, consumer_wait);
    mbar_wait(&full[s], (i / STAGES) & 1);
    if (threadIdx.x == 0) DS_STREAM_STAMP(i, consumer_full);
    const float* rec = prep_rec(s);
    const StagePrep sc = *prep_sc(s);
    const int row0 = sc.vb * TILE_ROWS + lrow0;
    if (sc.slot < 0) {  // padding: zero output rows, no state (a bad index: NaN rows)
      mbar_arrive(&done[s]);
      if (lane % G == 0)
        zero_output_rows<R>(p.out, p.V, sc.out_off, row0, RPP,
                            sc.slot == kStageBad ? bad_row_output() : 0.0f);
      continue;
    }
    StateT* tile = reinterpret_cast<StateT*>(tile_smem(s));
    float S[R][Lay::EPL];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int ch = 0; ch < CH; ++ch) {
        const uint4 u =
            *reinterpret_cast<const uint4*>(tile + (lrow0 + r * RPP) * K + Lay::elem(lane, ch, 0));
        const StateT* e = reinterpret_cast<const StateT*>(&u);
#pragma unroll
        for (int j = 0; j < CE; ++j) S[r][ch * CE + j] = to_float(e[j]);
      }
    }
    float v[R];
#pragma unroll
    for (int r = 0; r < R; ++r) v[r] = rec[3 * K + lrow0 + r * RPP];
    // The delta-rule step on the lane's R rows (core/delta_math.h), one 16-byte chunk of K at a
    // time; the dots are partial sums over the lane's chunks.
    const bool kda = p.gate.kda;
    float dots[2 * R];
#pragma unroll
    for (int j = 0; j < 2 * R; ++j) dots[j] = 0.0f;
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) {
      const int kidx = Lay::elem(lane, ch, 0);
      float q[CE], k[CE], alpha[CE];
      load_prep<CE>(rec, kidx, q);
      load_prep<CE>(rec + K, kidx, k);
      if (kda) {
        load_prep<CE>(rec + 2 * K, kidx, alpha);
      } else {
#pragma unroll
        for (int j = 0; j < CE; ++j) alpha[j] = sc.alpha0;
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float sk, sq;
        detail::decay_and_dots(S[r] + ch * CE, alpha, k, q, std::integral_constant<int, CE>{}, sk,
                               sq);
        dots[r] += sk;
        dots[R + r] += sq;
      }
    }
    float u[R], o;
    const int mine = finish_rows<G, R>(dots, v, sc.beta, sc.kq, lane, u, o);
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) {
      float k[CE];
      load_prep<CE>(rec + K, Lay::elem(lane, ch, 0), k);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        detail::rank1_update(S[r] + ch * CE, k, std::integral_constant<int, CE>{}, u[r]);
        uint4 w;
        StateT* e = reinterpret_cast<StateT*>(&w);
#pragma unroll
        for (int j = 0; j < CE; ++j) e[j] = from_float<StateT>(S[r][ch * CE + j]);
        *reinterpret_cast<uint4*>(tile + (lrow0 + r * RPP) * K + Lay::elem(lane, ch, 0)) = w;
      }
    }
    fence_proxy_async();  // the new state is visible to the producer's bulk store
    mbar_arrive(&done[s]);
    if (threadIdx.x == 0) DS_STREAM_STAMP(i, consumer_done);
    // The output after the arrive (a release, which would wait for a store issued before it).
    if (mine >= 0 && row0 + mine * RPP < p.V)
      detail::store_float(p.out.ptr, p.out.dtype, sc.out_off + row0 + mine * RPP, o);
  }
}

}  // namespace
}  // namespace deltastate::cuda_backend
