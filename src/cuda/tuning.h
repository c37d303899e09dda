// Every tuning choice of the CUDA backend in one place: the kernels' CTA shapes, the thresholds
// that pick a kernel or variant per call, and the environment overrides with which tests and
// benchmarks force a variant (scripts/device.sh). The measurements behind them are in
// docs/PERFORMANCE.md.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <utility>

namespace deltastate::cuda_backend {

// ---- CTA shapes ---------------------------------------------------------------------------------
// Whether `ctas` resident CTAs of `bytes` of shared memory each fit an SM (sm_90: 228 KB, of which
// the hardware reserves 1 KB per resident CTA); the kernels' shapes static_assert it.
constexpr bool ctas_fit_smem(int ctas, int bytes) { return ctas * (bytes + 1024) <= 228 * 1024; }
// Direct kernel: CTAs of up to 128 threads, 4 resident per SM: at most 128 registers per thread
// for its rows, the token and the gate constants across the token loop.
constexpr int kDirectCtasPerSm = 4;
// Verify on a pool in its storage format (verify/fmt.cuh): the direct kernel's CTAs, 2 resident
// per SM (at most 255 registers per thread): its per-token stores and tree reloads do not fit in
// 128 without spills.
constexpr int kVerifyFmtCtasPerSm = 2;
// Register decode kernel: 2-warp CTAs, 12 resident per SM (at most 80 registers per thread): 24
// warps per SM keep enough state loads in flight, and a 64-register cap spills.
constexpr int kDecodeCtaWarps = 2, kDecodeCtasPerSm = 12;
// Quantized decode kernel (recurrent/decode_quant.cuh): 4-warp CTAs of 16-row tiles, 4 resident
// per SM (at most 128 registers per thread: a row's K / 4 updated values wait for its amax).
constexpr int kQuantDecodeCtaWarps = 4, kQuantDecodeCtasPerSm = 4;
// Streaming kernel: 4 consumer warps and a producer per CTA, 64 KB of stages, 3 CTAs per SM.
constexpr int kStreamConsumerWarps = 4, kStreamStageBytes = 65536, kStreamCtasPerSm = 3;
// ReplaySSM: 8-warp CTAs, so that the per-head ring work and the token are shared by 8 warps'
// rows; 3 resident per SM (at most 80 registers per thread).
constexpr int kReplayWarps = 8, kReplayCtasPerSm = 3;
// ReplaySSM decode on a checkpoint in its storage format (replay_fmt_kernel): 2 resident per SM
// (at most 128 registers per thread), where it spills 8 / 20 bytes (60 / 152 at 3;
// docs/SPILLS.md).
constexpr int kReplayFmtCtasPerSm = 2;
// ReplaySSM verify: 8-warp CTAs for the same reason (the records and the drafts are prepared once
// per CTA for 8 warps' rows). The vector kernel: 2 resident per SM (at most 128 registers per
// thread), where ptxas fits one row block without spills and two with few; a 3-CTA one-block
// instantiation (80 registers, which spills) is there for the override below. The generic kernel
// (K <= 256, element accesses): 2.
constexpr int kReplayVerifyWarps = 8, kReplayVerifyCtasPerSm = 2, kReplayVerifyGenericCtasPerSm = 2;

// Multi-token kernel (verify, and the recurrent op's multi-token sequences): 4-warp CTAs over one
// head's rows, tokens prepared 8 at a time. Its one-tile shape in registers (`base`): 8 resident
// per SM, at most 64 registers (36 bytes of spill stores at fp32 K = 128): the kernel is bound by
// the latency of each CTA's chain, so 32 warps an SM beat 24 at 80 registers without spills (H100,
// T = 4, Qwen3-Next B = 64 / 256: 147.9 / 564.1 against 166.9 / 641.7 us); the staged one-tile
// shape 6 (80 registers), the generic kernel (K <= 256, element accesses) 4, which spills at 80.
constexpr int kMultiWarps = 4, kMultiBaseCtasPerSm = 8, kMultiCtasPerSm = 6,
              kMultiGenericCtasPerSm = 4, kMultiChunk = 8;
// Its two-tile shapes: 5 resident (at most 96 registers: the second tile's loop spills at 80).
constexpr int kMultiTwoCtasPerSm = 5;
// Fused decode step's cluster kernel: clusters of at most 8 CTAs (the portable cluster size), CTAs
// of at most 4 warps (one or two decode-kernel row tiles each), 6 resident per SM: at most 80
// registers per thread, as the register decode kernel, whose tile a warp runs.
constexpr int kFusedClusterMaxCtas = 8, kFusedClusterMaxWarps = 4, kFusedClusterCtasPerSm = 6;
// The fused step's cluster kernel where the CTA kernel's grid (one CTA per row and key head,
// `cta_kernel_ctas`) fills at most half of the `sms` SMs: there the CTA kernel leaves the state
// read to a few SMs, and the cluster kernel spreads it over the GPU, faster than the unfused
// chain. Above it the CTA kernel is latency-bound and slower than the unfused chain (measured on
// the H200, bench/results/layer-step-h200.json): there the chain plan runs where the caller gives
// a workspace (docs/LAYER_STEP.md).
constexpr bool fused_cluster_pays(int64_t cta_kernel_ctas, int64_t sms) {
  return 2 * cta_kernel_ctas <= sms;
}

// ---- kernel and variant choice ------------------------------------------------------------------
// Direct kernel: one warp per CTA below 8 tiles per SM, which spreads a small batch over more
// SMs; else 4.
constexpr int direct_cta_warps(int64_t tiles, int sms) { return tiles < 8LL * sms ? 1 : 4; }
// Register decode kernel: two tiles per warp where one tile per warp (`warps` of them, `capacity`
// resident on the GPU) makes a partial second wave, which two tiles halve; one elsewhere, where
// two are slower (from 8 waves up too: the two-tile kernel spills, docs/PERFORMANCE.md).
constexpr bool decode_two_tiles(int64_t warps, int64_t capacity) {
  return warps > capacity && warps <= 2 * capacity;
}
// The streaming kernel instead of the register decode kernel: 16-bit states from this many
// (sequence, value head) pairs (GDN; KDA), where the register kernels run out of instruction
// issue. For fp32 states the register kernel is faster at every batch.
constexpr int64_t kStreamMinHeads = 512, kStreamMinHeadsKda = 32;
// Quantized decode kernel: two tiles a warp from this many (sequence, value head) pairs, one
// below (H100, same call, two tiles against one, µs: Qwen3-Next B = 64 (2048 pairs) f8n 45.9-46.1
// against 52.8-53.0, f8 89.3-89.8 against 91.9-92.0, i8 69.8-70.2 against 72.0-72.6; B = 256 f8n
// 165-167 against 201-204; Kimi-Linear f8n B = 64 55.6-56.4 against 68.3-68.5; an earlier call:
// B = 1 10.0 against 7.1; bench/results/decode-quant-hoist-h100.txt).
constexpr int64_t kQuantTwoTileMinHeads = 2048;
// ReplaySSM: two row blocks per CTA, which share the per-head ring work and the token, from 2
// one-block CTAs per SM up; below that, halving the CTAs leaves SMs idle.
constexpr int64_t kReplayTwoBlockWaves = 2;
// ReplaySSM decode with a bf16 checkpoint, K = 128, whole 128-row heads: the tensor-core kernel
// from this many waves of its 128-row CTAs (kReplayCtasPerSm an SM), the rows kernel below (H100,
// µs per step over cursor cycles, tensor-core against rows, same call: Qwen3-Next L = 16 B = 64
// (5.2 waves) 48.49 against 54.09, B = 256 160.06 against 178.27; B = 8 (0.6 waves), the kernel's
// first form (the same appending step, a slower flush): 10.19 against 10.03;
// bench/results/replayssm-decode-tc-h100.txt).
constexpr int64_t kReplayTcWaves = 2;
// The one-warp ReplaySSM kernel (replayssm/decode_warp.cuh: 64 rows a CTA, 27.9 KB of shared
// memory): resident CTAs an SM that its launch bounds promise.
constexpr int kReplayWarpCtasPerSm = 8;
// KDA on the one-warp kernel from this many waves of its CTAs, the tensor-core kernel below: its
// per-column gates (15 float4 loads and 60 exponentials a lane) lengthen a CTA's chain, which
// only a deep grid hides (H100, Kimi-Linear bf16 L = 16, µs per step over cursor cycles, one-warp
// against tensor-core, same call, two rounds: B = 8 (0.5 waves) 11.92 against 10.53-10.55, B =
// 64 (3.9) 53.56-53.65 against 53.14-53.43, B = 128 (7.8) 93.41 against 94.78-95.43, B = 256
// (15.5) 169.89-170.09 against 177.89-178.13; bench/results/replayssm-decode-warp-h100.txt).
// The crossover lies between 3.9 and 7.8 waves.
constexpr int64_t kReplayWarpKdaWaves = 6;
// ReplaySSM verify: two row blocks per CTA (the records and drafts staged once for both, the
// second block's checkpoint rows copied while the first runs) by the same rule, over the
// one-block grid's `ctas`.
constexpr bool replay_verify_two_blocks(int64_t ctas, int sms) {
  return ctas >= kReplayTwoBlockWaves * sms;
}
// Multi-token kernel, vector shapes, as measured faster (bench/results): fp32 states take two
// tiles per warp (the second one staged) where the one-tile grid (`ctas`) has at most one CTA an
// SM, where the second tile's loads overlap the first one's tokens; above it one tile per warp in
// registers at 8 CTAs an SM (from 1024 CTAs, Qwen3-Next B = 8, on an H100: 25.1 against the two
// tiles' 27.4 us at T = 4). 16-bit states take two tiles, both staged, at every batch.
constexpr bool multi_two_tiles(int64_t ctas, int sms) { return ctas <= sms; }
// The conv's vector kernel (8 channels per thread) where its grid of `vec_ctas` CTAs has at
// least two per SM; below that each SM runs one or two CTAs whose threads go through their 8
// channels one after another, slower than the scalar kernel's 8x more threads. Measured on the H200
// (bench/results/layer-step-h200.json, conv + norm of the unfused chain): vector slower at 1.0 and
// 1.5 CTAs per SM (Qwen3-Next B = 16: 11.3 vs 8.0 us; Kimi-Linear B = 16: 9.5 vs 7.6), faster at
// 3.9 and 5.8 (Qwen3-Next B = 64: 17.6 vs 19.2; Kimi-Linear B = 64: 16.0 vs 20.5).
constexpr bool conv_vector_pays(int64_t vec_ctas, int64_t sms) { return vec_ctas >= 2 * sms; }
// Programmatic dependent launch: a launch lets the next grid in early when it fills at most half
// of the GPU's CTA slots (`cta_slots`). An early trigger slows a grid of a whole wave (the next
// grid's CTAs take SM slots while they wait) and speeds up a small one.
constexpr bool pdl_trigger_fits(int64_t ctas, int64_t cta_slots) { return 2 * ctas <= cta_slots; }

// ---- environment overrides (tests and benchmarks; each read once per process) -------------------
// A kernel-variant override from the environment (benchmarks and tests force variants): the
// value of `name` when it is one of `allowed`, else 0 (none). Callers read it once (a static).
inline int env_override(const char* name, std::initializer_list<int> allowed) {
  const char* e = std::getenv(name);
  const int v = e ? std::atoi(e) : 0;
  for (const int a : allowed)
    if (v == a) return v;
  return 0;
}

// The value that environment variable `name` names among `names` ({text, value}), else
// `fallback` (unset, or another text). Callers read it once (a static).
template <class E>
E env_choice(const char* name, std::initializer_list<std::pair<const char*, E>> names, E fallback) {
  if (const char* e = std::getenv(name))
    for (const auto& [text, value] : names)
      if (std::strcmp(e, text) == 0) return value;
  return fallback;
}

// DELTASTATE_CUDA_DECODE=direct|decode|stream: the kernel of a decode-shaped call.
enum class DecodeChoice { automatic, direct, decode, stream };
inline DecodeChoice forced_decode_kernel() {
  static const DecodeChoice forced = env_choice<DecodeChoice>("DELTASTATE_CUDA_DECODE",
                                                              {{"direct", DecodeChoice::direct},
                                                               {"decode", DecodeChoice::decode},
                                                               {"stream", DecodeChoice::stream}},
                                                              DecodeChoice::automatic);
  return forced;
}
// DELTASTATE_CUDA_QUANT_DECODE=mma|mma2: a decode-shaped call on a float8 / int8 pool on the
// tensor-core kernel with one or two tiles a warp.
enum class QuantDecodeChoice { automatic, mma, mma2 };
inline QuantDecodeChoice forced_quant_decode_kernel() {
  static const QuantDecodeChoice forced = env_choice<QuantDecodeChoice>(
      "DELTASTATE_CUDA_QUANT_DECODE",
      {{"mma", QuantDecodeChoice::mma}, {"mma2", QuantDecodeChoice::mma2}},
      QuantDecodeChoice::automatic);
  return forced;
}
// DELTASTATE_CUDA_DECODE_TPW=1|2: tiles per warp of the register decode kernel.
inline int forced_decode_tiles_per_warp() {
  static const int forced = env_override("DELTASTATE_CUDA_DECODE_TPW", {1, 2});
  return forced;
}
// DELTASTATE_CUDA_CONV=scalar|vector: causal_conv1d_update (and the fused step's chain conv) on
// its one-thread-per-channel kernel, or on its vector kernel wherever that one applies
// (conv_update.cu; tests run both).
enum class ConvChoice { automatic, scalar, vector };
inline ConvChoice forced_conv_kernel() {
  static const ConvChoice forced = env_choice<ConvChoice>(
      "DELTASTATE_CUDA_CONV", {{"scalar", ConvChoice::scalar}, {"vector", ConvChoice::vector}},
      ConvChoice::automatic);
  return forced;
}
// DELTASTATE_CUDA_REPLAY_BPC=1|2: row blocks per ReplaySSM CTA (2 only where the shape allows).
inline int forced_replay_blocks_per_cta() {
  static const int forced = env_override("DELTASTATE_CUDA_REPLAY_BPC", {1, 2});
  return forced;
}
// DELTASTATE_CUDA_REPLAY_KERNEL=rows|tc|warp: ReplaySSM decode's kernel for a bf16 checkpoint
// with K = 128 and V a multiple of 128, forced: the rows kernel (replayssm/decode.cuh: a lane's
// rows in registers, the dots on CUDA cores), the tensor-core kernel (replayssm/decode_tc.cuh: a
// warp's 16 rows as mma fragments, 128 rows a CTA) or, with bf16 inputs and L <= 16,
// the one-warp kernel (replayssm/decode_warp.cuh: 64 rows a one-warp CTA, no barrier). Unset:
// the one-warp kernel for GDN at every B (H100, Qwen3-Next L = 16, µs per step over cursor
// cycles, one-warp against tensor-core, same call: B = 1 6.59-6.65 against 7.22, B = 8 9.53-9.57
// against 9.53-9.56, B = 64 41.30-41.47 against 47.71-47.77, B = 256 130.49-130.64 against
// 161.86-162.12; bench/results/replayssm-decode-warp-h100.txt) and for KDA from
// kReplayWarpKdaWaves waves; else the tensor-core kernel where the rows kernel would take two row
// blocks a CTA and its grid fills kReplayTcWaves waves.
enum class ReplayDecodeChoice { automatic, rows, tensor, warp };
inline ReplayDecodeChoice replay_decode_choice() {
  static const ReplayDecodeChoice forced =
      env_choice<ReplayDecodeChoice>("DELTASTATE_CUDA_REPLAY_KERNEL",
                                     {{"rows", ReplayDecodeChoice::rows},
                                      {"tc", ReplayDecodeChoice::tensor},
                                      {"warp", ReplayDecodeChoice::warp}},
                                     ReplayDecodeChoice::automatic);
  return forced;
}
// DELTASTATE_CUDA_REPLAY_VERIFY_BPC=1|2: row blocks per CTA of the vector ReplaySSM verify (2
// only where V is a whole number of pairs of blocks).
inline int forced_replay_verify_blocks_per_cta() {
  static const int forced = env_override("DELTASTATE_CUDA_REPLAY_VERIFY_BPC", {1, 2});
  return forced;
}
// DELTASTATE_CUDA_REPLAY_VERIFY_CTAS=2|3: resident CTAs per SM of the one-block vector ReplaySSM
// verify.
inline int forced_replay_verify_ctas() {
  static const int forced = env_override("DELTASTATE_CUDA_REPLAY_VERIFY_CTAS", {2, 3});
  return forced;
}
// DELTASTATE_CUDA_REPLAY_VERIFY_KERNEL=replay|factor|tc: the ReplaySSM verify kernel, forced:
// the replay of the records onto the rows followed by the recurrent step per draft, that step
// factored on the checkpoint (replayssm/verify.cuh), or the factored step with the checkpoint's
// dots on tensor cores (replayssm/verify_tc.cuh, where its shape applies; else the replay
// kernel). Unset: the tensor-core kernel where its shape applies and replay_verify_tc_pays, else
// the replay kernel. The factored CUDA-core step is no faster than the replay (H200, T = 4, fp32,
// Qwen3-Next, B = 64: 178.8 vs 173.6 µs at L = 8; bench/results/README.md).
enum class ReplayVerifyChoice { automatic, replay, factor, tensor };
inline ReplayVerifyChoice replay_verify_choice() {
  static const ReplayVerifyChoice forced =
      env_choice<ReplayVerifyChoice>("DELTASTATE_CUDA_REPLAY_VERIFY_KERNEL",
                                     {{"replay", ReplayVerifyChoice::replay},
                                      {"factor", ReplayVerifyChoice::factor},
                                      {"tc", ReplayVerifyChoice::tensor}},
                                     ReplayVerifyChoice::automatic);
  return forced;
}
// The tensor-core verify where the ring appends between folds (2T < L: a commit leaves room for
// two more windows of T drafts), since its appending steps are faster and its folds slower (H100,
// T = 4, fp32, Qwen3-Next, same call, tensor-core vs replay kernel, µs per step over whole cursor
// cycles; bench/results/replayssm-verify-tc-h100.json): L = 16 (3 appending steps in 4) B = 8 /
// 64 / 256 27.8 / 174.5 / 630.4 vs 30.1 / 191.7 / 695.4; L = 8 (every step folds) 32.6 / 207.4 /
// 754.5 vs 30.9 / 193.8 / 715.4.
inline bool replay_verify_tc_pays(int64_t T, int64_t L) { return 2 * T < L; }
// Chunked prefill on the split design (chunk_prefill/split.cuh: parallel intra-chunk and output
// kernels around a sequential state pass) instead of the fused tensor-core kernel (one CTA per
// sequence and value head through all its chunks, one resident per SM) where the fused grid of
// `fused_ctas` CTAs leaves more than half of the `sms` SMs idle. The split path's time follows the
// token count (its state pass runs one CTA per SM through every chunk of the batch), the fused
// kernel's the chunks per wave, so the fused one wins from about half a wave up (measured on the
// H200: bench/results/prefill-h200.json).
constexpr bool prefill_split_pays(int64_t fused_ctas, int64_t sms) { return 2 * fused_ctas < sms; }
// DELTASTATE_CUDA_PREFILL=hopper|fallback|fused|split: chunk_prefill on the Hopper GDN kernels
// (chunk_prefill_hopper.cu), its CUDA-core fallback kernel, the fused tensor-core kernel or the
// split kernels, where that one applies (tests run the GPU suite each way; benchmarks compare
// them). Unforced, the Hopper kernels take every problem they apply to.
enum class PrefillChoice { automatic, hopper, fallback, fused, split };
inline PrefillChoice forced_prefill_kernel() {
  static const PrefillChoice forced =
      env_choice<PrefillChoice>("DELTASTATE_CUDA_PREFILL",
                                {{"hopper", PrefillChoice::hopper},
                                 {"fallback", PrefillChoice::fallback},
                                 {"fused", PrefillChoice::fused},
                                 {"split", PrefillChoice::split}},
                                PrefillChoice::automatic);
  return forced;
}
// The Hopper GDN scan (chunk_prefill_hopper.cu) on the V split (two CTAs per value head, 64 state
// rows each) where the whole heads' `ctas` CTAs fill at most half of the `sms` SMs: the split's
// CTAs then all fit in one wave, each with half of the chunk work of a whole head.
// DELTASTATE_CUDA_PREFILL_VSPLIT=on|off forces it (tests run both; benchmarks compare them).
inline bool prefill_vsplit_pays(int64_t ctas, int64_t sms) {
  static const int forced =
      env_choice<int>("DELTASTATE_CUDA_PREFILL_VSPLIT", {{"on", 1}, {"off", 0}}, -1);
  return forced >= 0 ? forced == 1 : 2 * ctas <= sms;
}
// DELTASTATE_CUDA_PREFILL_CP=<chunks>|off: the Hopper GDN prefill's context parallelism
// (chunk_prefill_hopper.cu cp_plan) forced with segments of that many chunks wherever it applies
// (one sequence; tests run the GPU suite with it), or never (0); unset or another value (-1):
// its own rule.
inline int prefill_cp_chunks() {
  static const int forced = [] {
    const char* e = std::getenv("DELTASTATE_CUDA_PREFILL_CP");
    if (!e) return -1;
    if (std::strcmp(e, "off") == 0) return 0;
    const int n = std::atoi(e);
    return n >= 1 ? n : -1;
  }();
  return forced;
}
// The Hopper GDN scan's consumers issue their products freely; DELTASTATE_CUDA_PREFILL_ORDERED=on
// makes them take turns (ordered math), which measured 2% slower (H100, 8x1024: scan 161.7
// against 158.0 µs; docs/PERFORMANCE.md), so it is off unless asked for.
inline bool prefill_ordered_math() {
  static const bool on =
      env_choice<bool>("DELTASTATE_CUDA_PREFILL_ORDERED", {{"on", true}, {"off", false}}, false);
  return on;
}
// The Hopper GDN scan stores whole chunks of an output in the input dtype by TMA stores;
// DELTASTATE_CUDA_PREFILL_TMA_OUT=off keeps the bulk row copies for every chunk (to compare: H100,
// the 1x8192 V-split scan 343 µs with them against 191).
inline bool prefill_tma_out() {
  static const bool on =
      env_choice<bool>("DELTASTATE_CUDA_PREFILL_TMA_OUT", {{"on", true}, {"off", false}}, true);
  return on;
}
// DELTASTATE_CUDA_MULTI=direct: the recurrent op's multi-token sequences on the direct kernel
// instead of the multi-token kernel (tests run both; benchmarks compare them).
inline bool multi_token_disabled() {
  static const bool off = env_choice<bool>("DELTASTATE_CUDA_MULTI", {{"direct", true}}, false);
  return off;
}
// DELTASTATE_CUDA_MULTI_VARIANT=base|stage|two|stage2: the multi-token kernel's vector shape
// (verify/multi_token.cuh, MultiShape): base (one tile, loaded into registers), stage (one tile,
// copied into shared memory while the first chunk is prepared), two (two tiles per warp, the
// second one staged), stage2 (two tiles, both staged); unset: fp32 states two where
// multi_two_tiles says, else base; 16-bit states stage2.
enum class MultiVariant { automatic, base, stage, two, stage2 };
inline MultiVariant forced_multi_variant() {
  static const MultiVariant forced = env_choice<MultiVariant>("DELTASTATE_CUDA_MULTI_VARIANT",
                                                              {{"base", MultiVariant::base},
                                                               {"stage", MultiVariant::stage},
                                                               {"two", MultiVariant::two},
                                                               {"stage2", MultiVariant::stage2}},
                                                              MultiVariant::automatic);
  return forced;
}
// DELTASTATE_CUDA_FUSED=cta|cluster|chain: the fused decode step on its one-CTA-per-key-head
// kernel, on its cluster kernel, or as its chain plan (the conv, packed decode and norm kernels
// through the caller's workspace; an error without one). Unset: the cluster kernel where
// fused_cluster_pays, else the chain where a workspace is given, else the CTA kernel; shapes a
// cluster does not fit never run the cluster kernel. ReplaySSM calls: `chain` runs their chain
// (replayssm_decode's kernels in the middle), anything else their one-launch kernel.
enum class FusedChoice { automatic, cta, cluster, chain };
inline FusedChoice forced_fused_kernel() {
  static const FusedChoice forced = env_choice<FusedChoice>(
      "DELTASTATE_CUDA_FUSED",
      {{"cta", FusedChoice::cta}, {"cluster", FusedChoice::cluster}, {"chain", FusedChoice::chain}},
      FusedChoice::automatic);
  return forced;
}
// DELTASTATE_CUDA_FUSED_TPW=1|2: row tiles per warp of the fused step's cluster kernel (one unless
// forced; fused_decode_step.cu says why).
inline int forced_fused_tiles_per_warp() {
  static const int forced = env_override("DELTASTATE_CUDA_FUSED_TPW", {1, 2});
  return forced;
}
// DELTASTATE_CUDA_PDL_TRIGGER=1|2: let the next PDL grid in early (1) or as the CTAs exit (2).
inline int forced_pdl_trigger() {
  static const int forced = env_override("DELTASTATE_CUDA_PDL_TRIGGER", {1, 2});
  return forced;
}

}  // namespace deltastate::cuda_backend
