#include "reference/verify_reference.h"

namespace ref {

VerifyResult verify(const Config& c, const std::vector<Token>& tokens, const State& S0,
                    const std::vector<int>& parents) {
  VerifyResult r;
  for (size_t t = 0; t < tokens.size(); ++t) {
    State S;
    if (t == 0) S = S0;
    else if (parents.empty()) S = r.states[t - 1];
    else S = parents[t] < 0 ? S0 : r.states[static_cast<size_t>(parents[t])];
    r.out.push_back(step(c, tokens[t], S));
    r.states.push_back(S);
  }
  return r;
}

}  // namespace ref
