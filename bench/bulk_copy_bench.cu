// How fast in-place copies move bytes in the access patterns of our decode kernels, with no compute,
// over a 2 GiB buffer (cold: many times the 60 MB L2), beside cudaMemcpy (the benchmarks' copy
// yardstick) and a grid-stride 16-byte copy kernel (100% in the tables):
//   ilp-copy  the grid-stride copy with U 16-byte loads per thread before its U stores;
//   warptile  one tile of U * 512 bytes per warp, no loop: the register decode kernel's shape
//             (fp32 K = 128: U = 8);
//   bulk      TMA bulk copies (the streaming kernel's path), below; skipped with --ilp-only.
// (Which tile size per warp, or which bulk-copy configuration, reaches copy bandwidth:
// docs/PERFORMANCE.md, "What bounds each kernel today".)
//
//   bulk_copy_bench [--gib 2] [--reps 20] [--quick] [--ilp-only]   (scripts/device.sh bench-bulk)
//
// Bulk modes, each over the whole buffer per launch; one thread per CTA issues every copy:
//   copy   in place, as decode: load a tile into a stage, store it back to where it came from; a
//          stage is refilled once its store has read it, one store older than the newest (the
//          streaming kernel's rule), so S - 1 stages load while one stores;
//   load   loads only, S in flight;
//   store  stores only from stages never written, S bulk groups in flight.
// Tiles go in order (tile t of a CTA at blockIdx + t * gridDim) over either the buffer as it lies
// or 1 MiB "slots" in a random order (a decode batch's random pool slots, bf16 Qwen3-Next).
// Bandwidth counts the bytes each mode moves (copy: read + write).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/async_copy.cuh"
#include "cuda_timing.h"

using namespace deltastate::cuda_backend;
using bench::check;
using bench::median_us;

namespace {

enum Mode : int { kCopy = 0, kLoad = 1, kStore = 2 };
constexpr int kMaxStages = 8;
constexpr int64_t kSlotBytes = 1 << 20;

struct Layout {
  unsigned char* base;
  const int32_t* slot_perm;  // null: tiles in address order
  int64_t tiles;
  int tile_bytes;
  int tiles_per_slot;
  __device__ unsigned char* tile(int64_t t) const {
    if (!slot_perm) return base + t * tile_bytes;
    const int64_t slot = slot_perm[t / tiles_per_slot];
    return base + slot * kSlotBytes + (t % tiles_per_slot) * static_cast<int64_t>(tile_bytes);
  }
};

__global__ void bulk_kernel(Layout L, int mode, int stages) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + static_cast<size_t>(stages) * L.tile_bytes);
  if (threadIdx.x != 0) return;
  for (int s = 0; s < stages; ++s) mbar_init(&full[s], 1);
  mbar_init_fence();
  const int64_t n = (L.tiles - blockIdx.x + gridDim.x - 1) / gridDim.x;  // this CTA's tiles
  auto tile_id = [&](int64_t i) { return blockIdx.x + i * gridDim.x; };
  auto stage = [&](int64_t i) { return smem + (i % stages) * static_cast<int64_t>(L.tile_bytes); };
  auto load = [&](int64_t i) {
    uint64_t* bar = &full[i % stages];
    mbar_expect_tx(bar, L.tile_bytes);
    bulk_load(stage(i), L.tile(tile_id(i)), L.tile_bytes, bar);
    mbar_arrive(bar);
  };
  auto wait_full = [&](int64_t i) { mbar_wait(&full[i % stages], static_cast<uint32_t>((i / stages) & 1)); };
  if (mode == kStore) {
    for (int64_t i = 0; i < n; ++i) {
      if (i >= stages) bulk_wait_read_n(stages - 1);
      bulk_store(L.tile(tile_id(i)), stage(i), L.tile_bytes);
      bulk_commit();
    }
  } else if (mode == kLoad) {
    for (int64_t i = 0; i < stages && i < n; ++i) load(i);
    for (int64_t i = 0; i < n; ++i) {
      wait_full(i);
      if (i + stages < n) load(i + stages);
    }
  } else {
    for (int64_t i = 0; i + 1 < stages && i < n; ++i) load(i);
    for (int64_t i = 0; i < n; ++i) {
      wait_full(i);
      bulk_store(L.tile(tile_id(i)), stage(i), L.tile_bytes);
      bulk_commit();
      const int64_t next = i + stages - 1;  // goes into the stage of tile i - 1
      if (next < n) {
        if (i >= 1) bulk_wait_read<1>();  // tile i - 1's store has read that stage
        load(next);
      }
    }
  }
  bulk_wait_all();
}

// The yardstick: 16-byte loads and stores, grid-stride, in place (as decode) or to another buffer.
// U > 1: each thread issues U loads (a block's U consecutive 16-byte rows) before its U stores,
// the way a register decode kernel holds its rows (n a multiple of U * blockDim).
template <int U>
__global__ void copy_kernel(const uint4* src, uint4* dst, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * U;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) * U + threadIdx.x; i < n; i += step) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = src[i + u * blockDim.x];
#pragma unroll
    for (int u = 0; u < U; ++u) dst[i + u * blockDim.x] = r[u];
  }
}

// A decode kernel's access pattern without its compute: one warp per tile of U * 512 contiguous
// bytes (lane l: 16-byte words l, l + 32, ...), all U loads before its U stores, in place, one
// tile per warp and no loop (a grid as large as the buffer; W warps per CTA). The register decode
// kernel's fp32 K = 128 tile is U = 8 (8 rows of 512 bytes, one 16-byte word per lane per row).
// Streaming cache hints (__ldcs / __stcs) as the decode kernels' state accesses; they also keep
// the compiler from dropping a store of the value just loaded from the same address.
template <int U>
__global__ void warp_tile_copy_kernel(uint4* buf, int64_t tiles) {
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (w >= tiles) return;
  uint4* t = buf + w * 32 * U + (threadIdx.x & 31);
  uint4 r[U];
#pragma unroll
  for (int u = 0; u < U; ++u) r[u] = __ldcs(t + u * 32);
#pragma unroll
  for (int u = 0; u < U; ++u) __stcs(t + u * 32, r[u]);
}

// f(std::integral_constant<int, U>{}) for each U: the copy kernels' loads per thread or per lane.
template <int... Us, class F>
void for_each_u(F&& f) {
  (f(std::integral_constant<int, Us>{}), ...);
}

}  // namespace

int main(int argc, char** argv) {
  double gib = 2.0;
  int reps = 20;
  bool quick = false, ilp_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--gib" && i + 1 < argc) gib = std::atof(argv[++i]);
    else if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (a == "--quick") quick = true;
    else if (a == "--ilp-only") ilp_only = true;
    else {
      std::fprintf(stderr, "usage: bulk_copy_bench [--gib 2] [--reps 20] [--quick] [--ilp-only]\n");
      return 2;
    }
  }
  int dev = 0, sms = 0, smem_optin = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "attribute");
  check(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "attribute");
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");

  const int64_t slots = static_cast<int64_t>(gib * (1 << 30)) / kSlotBytes;
  const int64_t bytes = slots * kSlotBytes;
  unsigned char *buf = nullptr, *other = nullptr;
  check(cudaMalloc(&buf, bytes), "cudaMalloc");
  check(cudaMalloc(&other, bytes), "cudaMalloc");
  check(cudaMemset(buf, 1, bytes), "cudaMemset");
  check(cudaMemset(other, 2, bytes), "cudaMemset");
  std::vector<int32_t> perm(static_cast<size_t>(slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
  int32_t* d_perm = nullptr;
  check(cudaMalloc(&d_perm, perm.size() * 4), "cudaMalloc");
  check(cudaMemcpy(d_perm, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaFuncSetAttribute(bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin),
        "cudaFuncSetAttribute");

  const int64_t vecs = bytes / 16;
  const int copy_grid = sms * 16;
  uint4* const b16 = reinterpret_cast<uint4*>(buf);
  uint4* const o16 = reinterpret_cast<uint4*>(other);
  const double t_inplace = median_us([&](int) { copy_kernel<1><<<copy_grid, 256>>>(b16, b16, vecs); }, reps);
  const double t_twobuf = median_us([&](int) { copy_kernel<1><<<copy_grid, 256>>>(b16, o16, vecs); }, reps);
  const double t_memcpy = median_us([&](int) { check(cudaMemcpyAsync(other, buf, bytes, cudaMemcpyDeviceToDevice), "memcpy"); },
                                    reps);
  const double copy_gbps = 2.0 * bytes / (t_inplace * 1e3);
  std::printf("# %s, %d SMs, buffer %.2f GiB, median of %d launches\n", prop.name, sms,
              bytes / double(1 << 30), reps);
  std::printf("# copy kernel (16-byte accesses), in place: %.1f us, %.0f GB/s (read + write) = 100%%\n",
              t_inplace, copy_gbps);
  std::printf("# copy kernel to another buffer: %.0f GB/s; cudaMemcpy device to device: %.0f GB/s\n",
              2.0 * bytes / (t_twobuf * 1e3), 2.0 * bytes / (t_memcpy * 1e3));
  // 16-byte copies with U loads per thread in flight before its stores, in place and to another
  // buffer, over grids of 1-16 CTAs per SM (256 threads): which access pattern reaches cudaMemcpy.
  std::printf("%-8s %3s %8s %10s %8s %7s\n", "ilp-copy", "U", "ctas/SM", "us", "GB/s", "%copy");
  auto ilp = [&](auto u_tag, int per_sm, bool in_place) {
    constexpr int U = decltype(u_tag)::value;
    uint4* dst = in_place ? b16 : o16;
    const double us = median_us([&](int) { copy_kernel<U><<<sms * per_sm, 256>>>(b16, dst, vecs); }, reps);
    const double gbps = 2.0 * bytes / (us * 1e3);
    std::printf("%-8s %3d %8d %10.1f %8.0f %6.1f%%\n", in_place ? "inplace" : "twobuf", U, per_sm, us,
                gbps, 100.0 * gbps / copy_gbps);
  };
  for (bool in_place : {true, false})
    for (int per_sm : {2, 4, 8, 16})
      for_each_u<1, 2, 4, 8>([&](auto u) { ilp(u, per_sm, in_place); });
  // One tile per warp, no loop (the register decode kernel's shape): tile U * 512 bytes, W warps
  // per CTA, in place; resident warps per SM as many as fit, or capped at 24 (the decode kernel's
  // 12 two-warp CTAs at 80 registers) by padding each CTA's shared memory.
  std::printf("%-8s %3s %8s %8s %10s %8s %7s\n", "warptile", "U", "warps", "warps/SM", "us", "GB/s", "%copy");
  auto warp_tiles = [&](auto u_tag, int warps, bool cap24) {
    constexpr int U = decltype(u_tag)::value;
    const int64_t tiles = vecs / (32 * U);
    const int64_t ctas = (tiles + warps - 1) / warps;
    const size_t smem = cap24 ? (static_cast<size_t>(smem_optin) + 1024) / (24 / warps) - 1024 : 0;
    check(cudaFuncSetAttribute(warp_tile_copy_kernel<U>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               smem_optin), "cudaFuncSetAttribute");
    int resident = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, warp_tile_copy_kernel<U>, 32 * warps, smem),
          "occupancy");
    const double us = median_us([&](int) {
      warp_tile_copy_kernel<U><<<static_cast<unsigned>(ctas), 32 * warps, smem>>>(b16, tiles);
    }, reps);
    const double gbps = 2.0 * bytes / (us * 1e3);
    std::printf("%-8s %3d %8d %8d %10.1f %8.0f %6.1f%%\n", "inplace", U, warps, resident * warps, us, gbps,
                100.0 * gbps / copy_gbps);
  };
  for (bool cap24 : {false, true})
    for (int warps : {2, 8})
      for_each_u<1, 2, 4, 8, 16>([&](auto u) { warp_tiles(u, warps, cap24); });

  // TMA bulk copies: every mode, slot order, tile size, stage count and CTAs per SM that fit.
  auto bulk_sweep = [&] {
    std::printf("%-6s %-7s %8s %7s %8s %10s %8s %7s\n", "mode", "order", "tile_KB", "stages",
                "ctas/SM", "us", "GB/s", "%copy");
    const char* mode_name[] = {"copy", "load", "store"};
    std::vector<int> tile_kb = quick ? std::vector<int>{16} : std::vector<int>{4, 8, 16, 32};
    std::vector<int> stage_counts = quick ? std::vector<int>{4} : std::vector<int>{2, 4, 8};
    std::vector<int> cta_counts = quick ? std::vector<int>{3} : std::vector<int>{1, 2, 3, 4, 8};
    for (int mode : {kCopy, kLoad, kStore})
      for (int random : {0, 1})
        for (int kb : tile_kb)
          for (int st : stage_counts)
            for (int per_sm : cta_counts) {
              const int tb = kb * 1024;
              const size_t smem = static_cast<size_t>(st) * tb + kMaxStages * 8;
              if (smem > static_cast<size_t>(smem_optin)) continue;
              int resident = 0;
              check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, bulk_kernel, 32, smem),
                    "occupancy");
              if (resident < per_sm) continue;  // would not all be resident
              const Layout L{buf, random ? d_perm : nullptr, bytes / tb, tb, static_cast<int>(kSlotBytes / tb)};
              const int grid = per_sm * sms;
              const double us = median_us([&](int) { bulk_kernel<<<grid, 32, smem>>>(L, mode, st); }, reps);
              const double moved = mode == kCopy ? 2.0 * bytes : static_cast<double>(bytes);
              const double gbps = moved / (us * 1e3);
              std::printf("%-6s %-7s %8d %7d %8d %10.1f %8.0f %6.1f%%\n", mode_name[mode],
                          random ? "random" : "linear", kb, st, per_sm, us, gbps, 100.0 * gbps / copy_gbps);
            }
  };
  if (!ilp_only) bulk_sweep();
  check(cudaFree(buf), "cudaFree");
  check(cudaFree(other), "cudaFree");
  check(cudaFree(d_perm), "cudaFree");
  return 0;
}
