// The streaming decode kernel's per-tile timeline, in trace builds only (CMake option
// DELTASTATE_CUDA_STREAM_TRACE; bench/stream_trace.cpp reads and summarizes it). The kernel
// records the SM clock (clock64) at each point below for the first kStreamTraceTiles tiles of the
// first kStreamTraceCtas CTAs of each launch; all of a CTA's stamps come from one SM's clock.
#pragma once

#include <vector>

namespace deltastate::cuda_backend {

enum class StreamTracePoint : int {
  producer_enter,  // the producer starts on tile i (before waiting for a free stage)
  stage_free,    // its stage is free (the last store from it has been read): the bulk load goes out
  prepared,      // the token is prepared and the producer has arrived on the stage's `full`
  store_issued,  // the producer has issued tile i's bulk store
  consumer_wait,  // consumer warp 0 starts waiting for tile i
  consumer_full,  // ... sees it full (bytes landed and prepared)
  consumer_done,  // ... has computed it and arrived on `done`
  count
};
constexpr int kStreamTraceCtas = 512;
constexpr int kStreamTraceTiles = 64;
constexpr int kStreamTracePoints = static_cast<int>(StreamTracePoint::count);
// Stages per CTA of the traced shape (16-bit states, K = 128; recurrent.cu checks it against the
// kernel's layout): tile i + kStreamTraceStages refills tile i's stage.
constexpr int kStreamTraceStages = 4;

#if DELTASTATE_CUDA_STREAM_TRACE
void stream_trace_reset();
// [kStreamTraceCtas][kStreamTraceTiles][kStreamTracePoints]; 0 where a point was not reached.
std::vector<long long> stream_trace_read();
#endif

}  // namespace deltastate::cuda_backend
