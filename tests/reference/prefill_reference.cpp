#include "reference/prefill_reference.h"

namespace ref {

PrefillResult prefill(const Config& c, const std::vector<Token>& tokens, State S0,
                      int64_t checkpoint_every) {
  PrefillResult r;
  State S = std::move(S0);
  for (size_t t = 0; t < tokens.size(); ++t) {
    r.out.push_back(step(c, tokens[t], S));
    if (checkpoint_every > 0 && (static_cast<int64_t>(t) + 1) % checkpoint_every == 0)
      r.checkpoints.push_back(S);
  }
  r.final_state = std::move(S);
  return r;
}

}  // namespace ref
