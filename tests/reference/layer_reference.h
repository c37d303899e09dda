// An independent fp64 reference of the pieces around the delta rule in a decode layer step,
// written from causal-conv1d's causal_conv1d_update_ref (torch.cat of window and x, a depthwise
// F.conv1d, the window's copy from the tail) and HF transformers' Qwen3NextRMSNormGated. Plain
// loops over doubles; shares nothing with the library.
#pragma once

#include <functional>
#include <vector>

namespace ref {

// One batch row of causal_conv1d_update_ref: window [dim][state_len] (updated in place), x
// [dim][T], weight [dim][width], bias [dim] (empty: none); returns out [dim][T]. With
// `cache_seqlen` >= 0 the window is a circular buffer written from cache_seqlen % state_len.
std::vector<double> conv_update(std::vector<double>& window, const std::vector<double>& x,
                                const std::vector<double>& weight, const std::vector<double>& bias,
                                int dim, int state_len, int T, int width, bool silu,
                                int cache_seqlen = -1);

// One batch row of SGLang's speculative causal_conv1d_update (intermediate windows,
// num_accept_tokens, an EAGLE tree), written from its semantics: token t's inputs are the window
// (entries accept-1 .. accept+width-3 with `accept` >= 1, else the last width-1) followed by x at
// t's ancestors, root first (`parent` empty: the chain 0..t); its window is their last width-1
// values, stored in `windows` [T][dim][width-1]. The window [dim][state_len] is updated in place:
// with accept, entries 0..width-3 take entries accept.., then x; else the last state_len values
// of [window, x]. Returns out [dim][T].
std::vector<double> conv_verify(std::vector<double>& window, const std::vector<double>& x,
                                const std::vector<double>& weight, const std::vector<double>& bias,
                                int dim, int state_len, int T, int width, bool silu, int accept,
                                const std::vector<int>& parent, std::vector<double>& windows);

// Qwen3NextRMSNormGated over one head: x [n] (as stored), z [n], weight [n]; `round_act` rounds
// to the activation dtype (hidden_states.to(input_dtype)), `round_product` the product
// weight * normalized when the weight has that dtype (identity otherwise).
std::vector<double> gated_rms_norm(const std::vector<double>& x, const std::vector<double>& z,
                                   const std::vector<double>& weight, double eps,
                                   const std::function<double(double)>& round_act,
                                   const std::function<double(double)>& round_product);

}  // namespace ref
