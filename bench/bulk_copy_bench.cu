// How fast the TMA bulk-copy path moves bytes on its own, beside a plain copy kernel over the same
// buffer: the streaming decode kernel moves exactly a copy's bytes through bulk copies and reaches
// ~84% of copy bandwidth with DRAM idle 30% of the time (docs/PERFORMANCE.md, tenth session), so
// this asks which tile size, stages per CTA and CTAs per SM (if any) let bulk copies reach the copy
// kernel's bandwidth. No compute: one thread per CTA issues every copy.
//
//   bulk_copy_bench [--gib 2] [--reps 20] [--quick]      (scripts/device.sh bench-bulk)
//
// Modes, each over the whole buffer per launch (cold: the buffer is many times the 60 MB L2):
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
#include <vector>

#include "cuda/bulk_copy.cuh"
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
__global__ void copy_kernel(const uint4* src, uint4* dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

}  // namespace

int main(int argc, char** argv) {
  double gib = 2.0;
  int reps = 20;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--gib" && i + 1 < argc) gib = std::atof(argv[++i]);
    else if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (a == "--quick") quick = true;
    else {
      std::fprintf(stderr, "usage: bulk_copy_bench [--gib 2] [--reps 20] [--quick]\n");
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
  const double t_inplace = median_us([&](int) {
    copy_kernel<<<copy_grid, 256>>>(reinterpret_cast<uint4*>(buf), reinterpret_cast<uint4*>(buf), vecs);
  }, reps);
  const double t_twobuf = median_us([&](int) {
    copy_kernel<<<copy_grid, 256>>>(reinterpret_cast<uint4*>(buf), reinterpret_cast<uint4*>(other), vecs);
  }, reps);
  const double t_memcpy = median_us([&](int) { check(cudaMemcpyAsync(other, buf, bytes, cudaMemcpyDeviceToDevice), "memcpy"); },
                                    reps);
  const double copy_gbps = 2.0 * bytes / (t_inplace * 1e3);
  std::printf("# %s, %d SMs, buffer %.2f GiB, median of %d launches\n", prop.name, sms,
              bytes / double(1 << 30), reps);
  std::printf("# copy kernel (16-byte accesses), in place: %.1f us, %.0f GB/s (read + write) = 100%%\n",
              t_inplace, copy_gbps);
  std::printf("# copy kernel to another buffer: %.0f GB/s; cudaMemcpy device to device: %.0f GB/s\n",
              2.0 * bytes / (t_twobuf * 1e3), 2.0 * bytes / (t_memcpy * 1e3));
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
  check(cudaFree(buf), "cudaFree");
  check(cudaFree(other), "cudaFree");
  check(cudaFree(d_perm), "cudaFree");
  return 0;
}
