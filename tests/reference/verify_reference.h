// The fp64 reference of speculative verify, from the semantics of SGLang's target verify
// (fused_sigmoid_gating_delta_rule_update with intermediate states and retrieve_parent_token):
// a chain runs its tokens in order from the initial state; in a tree, token t > 0 starts from
// the state after its parent token (the initial state for a parent < 0). Built on ref::step only.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "reference/reference.h"

namespace ref {

struct VerifyResult {
  std::vector<std::vector<double>> out;  // [T][HV*V]
  std::vector<State> states;             // [T]: the state after each token
};

// `parents` empty: a chain (token t starts from the state after token t-1).
VerifyResult verify(const Config& c, const std::vector<Token>& tokens, const State& S0,
                    const std::vector<int>& parents = {});

// A sequence whose initial state is row `row` of a start pool (the pool's start slot, or the
// read-only source pool of FlashInfer's initial_state_source): `verify` from pool[row]; a row < 0
// is a padded sequence: every output zero, no state after any token (nothing stored).
// `round_stored` (optional) is the storage rounding of the scratch buffer a tree reads a parent's
// state back from (parent < t - 1: the state as stored; the previous token's state and the
// initial state are used as they are).
VerifyResult verify_from_pool(const Config& c, const std::vector<Token>& tokens,
                              const std::vector<State>& pool, int64_t row,
                              const std::vector<int>& parents = {},
                              const std::function<double(double)>& round_stored = {});

}  // namespace ref
