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

VerifyResult verify_from_pool(const Config& c, const std::vector<Token>& tokens,
                              const std::vector<State>& pool, int64_t row,
                              const std::vector<int>& parents,
                              const std::function<double(double)>& round_stored) {
  VerifyResult r;
  if (row < 0) {
    for (size_t t = 0; t < tokens.size(); ++t)
      r.out.emplace_back(static_cast<size_t>(c.HV) * static_cast<size_t>(c.V), 0.0);
    return r;
  }
  const State& S0 = pool.at(static_cast<size_t>(row));
  for (size_t t = 0; t < tokens.size(); ++t) {
    const int parent = parents.empty() ? static_cast<int>(t) - 1 : parents[t];
    State S;
    if (t == 0 || parent < 0) {
      S = S0;
    } else {
      S = r.states[static_cast<size_t>(parent)];
      if (round_stored && parent != static_cast<int>(t) - 1)
        for (double& x : S) x = round_stored(x);
    }
    r.out.push_back(step(c, tokens[t], S));
    r.states.push_back(S);
  }
  return r;
}

}  // namespace ref
