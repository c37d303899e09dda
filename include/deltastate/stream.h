// deltastate: the stream handle that ops and the state pool take.
#pragma once

namespace deltastate {

// An opaque stream handle: a cudaStream_t for CUDA tensors (nullptr = the legacy default
// stream); ignored on the CPU.
using Stream = void*;

}  // namespace deltastate
