// The fp64 reference of speculative verify, from the semantics of SGLang's target verify
// (fused_sigmoid_gating_delta_rule_update with intermediate states and retrieve_parent_token):
// a chain runs its tokens in order from the initial state; in a tree, token t > 0 starts from
// the state after its parent token (the initial state for a parent < 0). Built on ref::step only.
#pragma once

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

}  // namespace ref
