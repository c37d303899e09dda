"""FlashInfer's MTP (multi-token verify) tests, ported to ``deltastate.gated_delta_rule_mtp``.

Source (flashinfer-ai/flashinfer): tests/gdn/test_decode_delta_rule.py (its
``_test_verify_kernel_mtp`` with test_verify_kernel_mtp and
test_mtp_fp32_state_with_cache_and_state_update, as stored in the public index in December 2026,
e.g. at 01a03f3c84bb6c128286915215b521da8408d5dc). Function: flashinfer/gdn_decode.py::
gated_delta_rule_mtp @ 0012242372e76773b328c4bbfb0045409898888d (see docs/PEERS.md).

What changed in the port:
  * The op is ``deltastate.gated_delta_rule_mtp`` called exactly as FlashInfer's test calls it
    (keywords, FlashInfer's names), its return values used as FlashInfer's test uses them.
  * FlashInfer's oracle is ``tests/gdn/reference_delta_rule.py::verify_delta_rule`` (a torch
    float32 recurrence on K-major [B, HV, K, V] states). The port's ``verify_delta_rule`` is a
    rewrite of the same recurrence on the V-major layout the op takes (FlashInfer's test transposes
    between the two): g = -exp(A_log) * softplus(a + dt_bias) (beta 1, threshold 20),
    beta = sigmoid(b), q and k L2-normalized after the GQA expansion, q scaled; per token
    S <- exp(g) S, S <- S + k (beta (v - S k))^T, o = S q; the state after every token kept.
  * Inputs, sizes, seeds, tolerances (bf16 inputs: atol = rtol = 1e-2 on outputs and states) and
    assertions are kept. FlashInfer skips without an SM90+ GPU; here CPU tensors always run and
    CUDA tensors when present. On CPU the batch sizes above 4 are skipped (a [B, T, 32, 128, 128]
    fp32 buffer per case); CUDA runs use FlashInfer's sizes.
"""

import math
import os

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F

from _peer_common import device_param

import deltastate as ds


def verify_delta_rule(q, k, v, state, A_log, a, dt_bias, b, scale_factor):
    """Returns (o [B,T,HV,V] float32, final state [B,HV,V,K], states [B,T,HV,V,K])."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    rep = HV // H
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), beta=1.0,
                                               threshold=20.0)
    beta = torch.sigmoid(b.float())
    S = state.float().clone()
    o = torch.zeros(B, T, HV, v.shape[3], dtype=torch.float32, device=q.device)
    states = torch.zeros((B, T) + tuple(state.shape[1:]), dtype=torch.float32, device=q.device)
    for t in range(T):
        qt = q[:, t].float().repeat_interleave(rep, 1)
        kt = k[:, t].float().repeat_interleave(rep, 1)
        qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6) * scale_factor
        kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
        S = S * torch.exp(g[:, t])[..., None, None]
        u = beta[:, t][..., None] * (v[:, t].float() - torch.einsum("bhvk,bhk->bhv", S, kt))
        S = S + u[..., :, None] * kt[..., None, :]
        o[:, t] = torch.einsum("bhvk,bhk->bhv", S, qt)
        states[:, t] = S
    return o, S, states


def _test_verify_kernel_mtp(device, dtype, batch_size, num_q_heads, num_k_heads, num_v_heads,
                            head_size, seq_len, scale, alpha, beta, cache_intermediate_states=True,
                            disable_state_update=True, seed=0):
    if device == "cpu" and batch_size > 4:
        pytest.skip("batch above 4: CUDA only in the port (CPU memory and time)")
    torch.manual_seed(seed)
    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    B, T, H, HV, K, V = batch_size, seq_len, num_q_heads, num_v_heads, head_size, head_size
    q = torch.randn(B, T, H, K, dtype=torch_dtype, device=device) * 0.1
    k = torch.randn(B, T, num_k_heads, K, dtype=torch_dtype, device=device) * 0.1
    v = torch.randn(B, T, HV, V, dtype=torch_dtype, device=device) * 0.1
    A_log = (torch.randn(HV, dtype=torch.float32, device=device) * 0.1 if alpha
             else torch.zeros(HV, dtype=torch.float32, device=device))
    dt_bias = (torch.randn(HV, dtype=torch.float32, device=device) * 0.1 if alpha
               else torch.zeros(HV, dtype=torch.float32, device=device))
    a = (torch.randn(B, T, HV, dtype=torch_dtype, device=device) * 0.1 if alpha
         else torch.zeros(B, T, HV, dtype=torch_dtype, device=device))
    b_tensor = (torch.randn(B, T, HV, dtype=torch_dtype, device=device) * 0.1 if beta
                else torch.zeros(B, T, HV, dtype=torch_dtype, device=device))
    pool_size = B
    initial_state = torch.randn(pool_size, HV, V, K, dtype=torch.float32, device=device) * 0.01
    initial_state_indices = torch.arange(B, dtype=torch.int32, device=device)
    intermediate_states_buffer = (
        torch.zeros(pool_size, T, HV, V, K, dtype=torch.float32, device=device)
        if cache_intermediate_states else None)
    scale_val = 1.0 / math.sqrt(K) if scale == "auto" else scale
    initial_state_kernel = initial_state.clone()
    output_kernel, final_state_kernel = ds.gated_delta_rule_mtp(
        q=q, k=k, v=v, initial_state=initial_state_kernel,
        initial_state_indices=initial_state_indices, A_log=A_log, a=a, dt_bias=dt_bias,
        b=b_tensor, scale=scale_val, output=None,
        intermediate_states_buffer=intermediate_states_buffer,
        disable_state_update=disable_state_update, use_qk_l2norm=True)
    output_ref, final_state_ref, intermediate_states_ref = verify_delta_rule(
        q, k, v, initial_state.clone(), A_log, a, dt_bias, b_tensor, scale_val)
    if dtype == "bfloat16":
        atol_o = rtol_o = atol_s = rtol_s = 1e-2
    else:
        atol_o = rtol_o = atol_s = rtol_s = 1e-3
    torch.testing.assert_close(output_kernel.float(), output_ref.float(), atol=atol_o,
                               rtol=rtol_o,
                               msg=f"Output mismatch for MTP kernel (B={B}, T={T}, dtype={dtype})")
    if cache_intermediate_states:
        torch.testing.assert_close(intermediate_states_buffer.float(),
                                   intermediate_states_ref.float(), atol=atol_s, rtol=rtol_s)
    if not disable_state_update:
        torch.testing.assert_close(final_state_kernel.float(), final_state_ref.float(),
                                   atol=atol_s, rtol=rtol_s)
    else:
        assert torch.equal(final_state_kernel, initial_state), "disable_state_update"


@device_param
@pytest.mark.parametrize("cache_intermediate_states", [True, False])
@pytest.mark.parametrize("seq_len", [2, 4, 8])
@pytest.mark.parametrize("batch_size", [1, 2, 4, 8, 16])
def test_verify_kernel_mtp(device, batch_size, seq_len, cache_intermediate_states,
                           seed=int(os.environ.get("SEED", "0"))):
    _test_verify_kernel_mtp(device, "bfloat16", batch_size, 16, 16, 32, 128, seq_len, 1.0, True,
                            True, cache_intermediate_states, True, seed)


@device_param
@pytest.mark.parametrize("seq_len", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("batch_size", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
def test_mtp_fp32_state_with_cache_and_state_update(device, batch_size, seq_len,
                                                    seed=int(os.environ.get("SEED", "0"))):
    _test_verify_kernel_mtp(device, "bfloat16", batch_size, 16, 16, 32, 128, seq_len,
                            1.0 / math.sqrt(128), True, True, True, False, seed)
