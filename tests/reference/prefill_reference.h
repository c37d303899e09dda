// The fp64 reference of chunked prefill: the plain token-by-token recurrence (reference.h's
// `step`) over one sequence, recording the state every `checkpoint_every` tokens. It knows
// nothing of chunks; tests compare the chunked kernels' outputs, final states and checkpoints
// with it.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/reference.h"

namespace ref {

struct PrefillResult {
  std::vector<std::vector<double>> out;  // [len][HV*V]
  State final_state;                     // [HV, V, K]
  std::vector<State> checkpoints;        // j: the state after (j+1)*checkpoint_every tokens
};

// Runs `tokens` from S0; checkpoint_every = 0 records no checkpoints.
PrefillResult prefill(const Config& c, const std::vector<Token>& tokens, State S0,
                      int64_t checkpoint_every);

}  // namespace ref
