"""SGLang's packed-decode tests, ported to deltastate's SGLang-named ops.

Sources (sgl-project/sglang):
  * test/registered/kernels/ops/attention/test_kda_helion.py @ 253bb88152e6ec6952d81c19428d80dbeff9d163
    - test_public_signatures_match_triton (packed-decode half)  -> test_public_signatures_match_sglang
    - test_packed_decode_contract                              -> test_packed_decode_contract
    - test_packed_decode_lower_bound_contract                  -> test_packed_decode_lower_bound_contract
  * test/registered/attention/unittests/gdn/test_decode_keeps_beta_in_fp32.py
    @ 67a25468c7762686f4eb40e5f90f58a5c182d901
    - TestDecodeKeepsBetaInFp32.test_gdn_packed_decode         -> test_gdn_packed_decode_keeps_beta_in_fp32
  The functions under test are SGLang's python/sglang/kernels/ops/attention/fla/fused_recurrent.py
  @ 047d31af2516212c09b8ce356fae8298ba8526d7 (see docs/PEERS.md).

What changed in the port:
  * The op under test is deltastate's ``fused_recurrent_kda_packed_decode`` /
    ``fused_recurrent_gated_delta_rule_packed_decode`` called exactly as SGLang's test calls the
    SGLang (or its Helion twin) function: same positional order, same keywords.
  * Signature test: SGLang compares the Helion twin with the Triton function; here deltastate's
    function is compared with SGLang's signature (names, order, kinds, defaults), with deltastate's
    own options allowed only as extra keyword-only parameters.
  * test_packed_decode_contract: SGLang's oracle is its Triton kernel; the port uses the torch
    reference of the sibling lower-bound test (rewritten in _peer_common), with the standard
    softplus gate. Tolerances are that test's (atol 1e-4 out; state atol 1e-5/2e-3/5e-4 for
    fp32/bf16/fp16, rtol 1e-4).
  * Device: "cuda" in SGLang; here parametrized over CPU and (when available) CUDA tensors.
  * "Surface" tests at the end are not SGLang tests: they pin SGLang call-surface facts read from
    its source (default ``use_qk_l2norm_in_kernel=False``; strided 1-D index tensors accepted).
"""

import pytest

torch = pytest.importorskip("torch")

from _peer_common import (NO_DEFAULT, P, check_signature, device_param, manual_seed, peer_op,
                          sglang_packed_decode_reference)

_DECODE_STATE_ATOL = {
    torch.float32: 1e-5,
    torch.bfloat16: 2e-3,
    torch.float16: 5e-4,
}

SGLANG_GDN_PACKED = [
    ("mixed_qkv", P, NO_DEFAULT), ("a", P, NO_DEFAULT), ("b", P, NO_DEFAULT),
    ("A_log", P, NO_DEFAULT), ("dt_bias", P, NO_DEFAULT), ("scale", P, NO_DEFAULT),
    ("initial_state", P, NO_DEFAULT), ("out", P, NO_DEFAULT), ("ssm_state_indices", P, NO_DEFAULT),
    ("use_qk_l2norm_in_kernel", P, False),
]
SGLANG_KDA_PACKED = SGLANG_GDN_PACKED + [("lower_bound", P, None)]


def test_public_signatures_match_sglang():
    check_signature(peer_op("fused_recurrent_gated_delta_rule_packed_decode"), SGLANG_GDN_PACKED)
    check_signature(peer_op("fused_recurrent_kda_packed_decode"), SGLANG_KDA_PACKED)


def _kda_inputs(device, state_dtype, seed):
    manual_seed(seed)
    batch, q_heads, v_heads, key_dim, value_dim = 3, 2, 4, 128, 128
    pool_size = 7
    mixed_qkv = torch.randn(batch, 2 * q_heads * key_dim + v_heads * value_dim, device=device,
                            dtype=torch.bfloat16)
    gate = torch.randn(batch, v_heads * key_dim, device=device, dtype=torch.bfloat16)
    beta = torch.randn(batch, v_heads, device=device, dtype=torch.bfloat16)
    a_log = torch.randn(v_heads, device=device, dtype=torch.float32)
    dt_bias = torch.randn(v_heads * key_dim, device=device, dtype=torch.float32)
    state = torch.randn(pool_size, v_heads, value_dim, key_dim, device=device,
                        dtype=state_dtype) * 0.01
    indices = torch.tensor([5, -1, 2], device=device, dtype=torch.int32)
    return mixed_qkv, gate, beta, a_log, dt_bias, state, indices, (batch, v_heads, value_dim,
                                                                   key_dim)


@device_param
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_decode_contract(device, state_dtype):
    op = peer_op("fused_recurrent_kda_packed_decode")
    mixed_qkv, gate, beta, a_log, dt_bias, state, indices, (batch, v_heads, value_dim, key_dim) = \
        _kda_inputs(device, state_dtype, 123)
    reference_state = state.clone()
    ds_state = state.clone()
    reference_out = sglang_packed_decode_reference(
        mixed_qkv, gate, beta, a_log, dt_bias, key_dim ** -0.5, reference_state, indices,
        is_kda=True, use_qk_l2norm_in_kernel=True)
    ds_out = torch.empty_like(reference_out)

    result, result_state = op(mixed_qkv, gate, beta, a_log, dt_bias, key_dim ** -0.5, ds_state,
                              ds_out, indices, True)

    assert result.data_ptr() == ds_out.data_ptr()
    assert result_state.data_ptr() == ds_state.data_ptr()
    torch.testing.assert_close(ds_out, reference_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ds_state, reference_state, atol=_DECODE_STATE_ATOL[state_dtype],
                               rtol=1e-4)
    assert torch.count_nonzero(ds_out[1]).item() == 0
    untouched = torch.tensor([0, 1, 3, 4, 6], device=device)
    assert torch.equal(ds_state[untouched], state[untouched])


@device_param
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_packed_decode_lower_bound_contract(device, state_dtype):
    op = peer_op("fused_recurrent_kda_packed_decode")
    mixed_qkv, gate, beta, a_log, dt_bias, state, indices, (batch, v_heads, value_dim, key_dim) = \
        _kda_inputs(device, state_dtype, 321)
    scale = key_dim ** -0.5
    lower_bound = -5.0
    reference_state = state.clone()
    ds_state = state.clone()
    reference_out = sglang_packed_decode_reference(
        mixed_qkv, gate, beta, a_log, dt_bias, scale, reference_state, indices, is_kda=True,
        use_qk_l2norm_in_kernel=True, lower_bound=lower_bound)
    ds_out = torch.empty_like(reference_out)

    result, result_state = op(mixed_qkv, gate, beta, a_log, dt_bias, scale, ds_state, ds_out,
                              indices, True, lower_bound)

    assert result.data_ptr() == ds_out.data_ptr()
    assert result_state.data_ptr() == ds_state.data_ptr()
    torch.testing.assert_close(ds_out, reference_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ds_state, reference_state, atol=_DECODE_STATE_ATOL[state_dtype],
                               rtol=1e-4)
    assert torch.count_nonzero(ds_out[1]).item() == 0


@device_param
def test_gdn_packed_decode_keeps_beta_in_fp32(device):
    """One token, B=H=HV=K=V=1, unit q=k=v, b=0.5: the stored state equals sigmoid(b) in fp32."""
    packed_decode = peer_op("fused_recurrent_gated_delta_rule_packed_decode")
    dtype = torch.bfloat16
    mixed_qkv = torch.ones((1, 3), device=device, dtype=dtype)
    a = torch.zeros((1, 1), device=device, dtype=dtype)
    b = torch.full((1, 1), 0.5, device=device, dtype=dtype)
    params = torch.zeros((1,), device=device, dtype=dtype)
    # 2-slot pool: state[1] stays zero and isolates the written slot.
    state = torch.zeros((2, 1, 1, 1), device=device, dtype=torch.float32)
    out = torch.empty((1, 1, 1, 1), device=device, dtype=dtype)
    packed_decode(
        mixed_qkv=mixed_qkv,
        a=a,
        b=b,
        A_log=params,
        dt_bias=params,
        scale=1.0,
        initial_state=state,
        out=out,
        ssm_state_indices=torch.zeros((1,), device=device, dtype=torch.int32),
    )
    torch.testing.assert_close(
        state[0].reshape(-1),
        torch.sigmoid(b.float()).reshape(-1),
        atol=1e-6,
        rtol=1e-6,
        msg="packed decode must keep sigmoid(beta) in fp32",
    )


# ---- SGLang surface facts (from the source, not SGLang tests) -----------------------------------
def _gdn_inputs(device, seed=7):
    manual_seed(seed)
    B, H, HV, K, V = 3, 2, 4, 32, 32
    mixed_qkv = torch.randn(B, 2 * H * K + HV * V, device=device)
    a = torch.randn(B, HV, device=device) * 0.5
    b = torch.randn(B, HV, device=device)
    A_log = torch.randn(HV, device=device) * 0.3
    dt_bias = torch.randn(HV, device=device) * 0.1
    state = torch.randn(5, HV, V, K, device=device) * 0.1
    return mixed_qkv, a, b, A_log, dt_bias, state, (B, HV, V, K)


@device_param
def test_surface_default_is_no_qk_l2norm(device):
    """SGLang's default is ``use_qk_l2norm_in_kernel=False``: omitting it equals passing False
    and matches the reference without the norm."""
    op = peer_op("fused_recurrent_gated_delta_rule_packed_decode")
    mixed_qkv, a, b, A_log, dt_bias, state, (B, HV, V, K) = _gdn_inputs(device)
    idx = torch.tensor([3, -1, 0], device=device, dtype=torch.int32)
    ref_state = state.clone()
    ref_out = sglang_packed_decode_reference(mixed_qkv, a, b, A_log, dt_bias, K ** -0.5, ref_state,
                                             idx, is_kda=False, use_qk_l2norm_in_kernel=False)
    s1 = state.clone()
    o1 = torch.empty(B, 1, HV, V, device=device)
    op(mixed_qkv, a, b, A_log, dt_bias, K ** -0.5, s1, o1, idx)
    torch.testing.assert_close(o1, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s1, ref_state, atol=1e-5, rtol=1e-4)


@device_param
def test_surface_strided_indices(device):
    """SGLang indexes ``ssm_state_indices + i * stride(0)``: a strided 1-D index view works and
    equals the contiguous call."""
    op = peer_op("fused_recurrent_gated_delta_rule_packed_decode")
    mixed_qkv, a, b, A_log, dt_bias, state, (B, HV, V, K) = _gdn_inputs(device, 8)
    base = torch.tensor([3, 9, -1, 9, 0, 9], device=device, dtype=torch.int32)
    strided = base[::2]
    assert not strided.is_contiguous()
    s_ref, s_str = state.clone(), state.clone()
    o_ref = torch.empty(B, 1, HV, V, device=device)
    o_str = torch.empty_like(o_ref)
    op(mixed_qkv, a, b, A_log, dt_bias, K ** -0.5, s_ref, o_ref, strided.contiguous(), True)
    op(mixed_qkv, a, b, A_log, dt_bias, K ** -0.5, s_str, o_str, strided, True)
    assert torch.equal(o_ref, o_str)
    assert torch.equal(s_ref, s_str)
