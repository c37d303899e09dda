"""FLA's fused-recurrent tests, ported to deltastate's FLA-named ops.

Sources (fla-org/flash-linear-attention):
  * tests/ops/test_gdn.py @ 0b346347379476548be0678ec597f9e14f148bf7 (the file the brief calls
    test_gated_delta.py; FLA renamed it): test_fused_recurrent, test_fused_recurrent_state_v_first,
    test_fused_recurrent_gate_in_kernel, test_fused_recurrent_beta_sigmoid_in_kernel,
    test_fused_recurrent_gate_in_kernel_varlen.
  * tests/ops/test_kda.py @ bc3b101dcb713ddc5bd8924b66754eb68b5ccf89: test_fused_recurrent,
    test_fused_recurrent_use_beta_sigmoid_in_kernel, test_fused_recurrent_state_v_first,
    test_fused_recurrent_gate_in_kernel.
  Functions: fla/ops/gated_delta_rule/fused_recurrent.py and fla/ops/kda/fused_recurrent.py
  @ bc3b101d (see docs/PEERS.md).

What changed in the port:
  * The op under test is ``deltastate.fused_recurrent_gated_delta_rule`` /
    ``deltastate.fused_recurrent_kda``, called with FLA's keywords (FLA's test calls them with
    keywords only), including ``transpose_state_layout`` (FLA's deprecated alias).
  * Oracles. Where FLA's oracle is ``naive_recurrent_*`` it is kept (rewritten in _peer_common).
    Where FLA's oracle is its own Triton ``fused_recurrent_*`` called differently (manual gate,
    manual sigmoid, the other state layout), the port uses FLA's naive torch reference with the
    same manual preprocessing instead: the gate from ``naive_gdn_gate`` / ``naive_kda_gate`` /
    ``naive_kda_lowerbound_gate``, beta from ``sigmoid`` (x2 for ``allow_neg_eigval``), and the
    K-first state from the naive reference for the V-first comparison. FLA's ratio thresholds
    and its assert_close are kept.
  * ``device``: FLA's global device; here CPU and (when available) CUDA tensors. On CUDA the
    K-first state (FLA's default, which deltastate runs on the CPU only) is passed V-first with
    ``state_v_first=True`` by the test (``fla_on_device``), as the error on CUDA asks.
  * Trim: on CPU tensors a sequence length T above 64 is cut to 64 (varlen: each sequence of
    ``cu_seqlens`` cut to at most 64 tokens, same number of sequences), see
    _peer_common.cpu_len; DELTASTATE_PEER_FULL=1 restores FLA's lengths; CUDA uses them.
  * The KDA test poisons the memory after ``g`` (1e30) when D is not a power of two; kept.
  * test_kda.py::test_fused_recurrent_vllm_decode is not ported: it calls FLA's internal
    ``fused_recurrent_kda_fwd`` (ssm_state_indices, inplace_final_state), a name deltastate does
    not take; FlashInfer's copy of it is ported in test_flashinfer_recurrent_kda.py.
"""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F

from _peer_common import (DEVICES, P, NO_DEFAULT, check_signature, cpu_len, fla_assert_close,
                          fla_naive_gdn_gate, fla_naive_kda_gate, fla_naive_kda_lowerbound_gate,
                          fla_naive_recurrent_gated_delta_rule, fla_naive_recurrent_kda,
                          manual_seed, peer_op)

device_param = pytest.mark.parametrize("device", DEVICES)

def _pow2(n):
    return 1 << (n - 1).bit_length()

def _repeat_heads(x, g):
    """einops ``repeat(x, 'b t h d -> b t (h g) d', g=g)``."""
    return x.repeat_interleave(g, dim=2)


def fla_on_device(name, device):
    """The FLA-named op as a caller on ``device`` uses it. deltastate runs FLA's default K-first
    state ([N, HV, K, V]) on the CPU only and rejects it on CUDA (it never transposes a state
    behind the caller's back), so on CUDA this caller follows that error's advice: it passes the
    state V-first with ``state_v_first=True`` and reads the final state back K-first. FLA's
    references, tolerances and assertions are unchanged."""
    fn = peer_op(name)
    if device != "cuda":
        return fn

    def call(*args, **kw):
        if kw.get("state_v_first") or kw.get("transpose_state_layout"):
            return fn(*args, **kw)
        if kw.get("initial_state") is not None:
            kw["initial_state"] = kw["initial_state"].transpose(-1, -2).contiguous()
        kw["state_v_first"] = True
        o, ht = fn(*args, **kw)
        return o, (None if ht is None else ht.transpose(-1, -2))

    return call

# ---- signatures (not FLA tests: FLA's exact signatures, from the source) --------------------------
FLA_GDN = [
    ("q", P, NO_DEFAULT), ("k", P, NO_DEFAULT), ("v", P, NO_DEFAULT), ("g", P, None),
    ("gk", P, None), ("gv", P, None), ("beta", P, None), ("scale", P, None),
    ("initial_state", P, None), ("output_final_state", P, False),
    ("use_qk_l2norm_in_kernel", P, False), ("use_gate_in_kernel", P, False), ("A_log", P, None),
    ("dt_bias", P, None), ("use_beta_sigmoid_in_kernel", P, False), ("allow_neg_eigval", P, False),
    ("state_v_first", P, False), ("cu_seqlens", P, None),
]
FLA_KDA = [
    ("q", P, NO_DEFAULT), ("k", P, NO_DEFAULT), ("v", P, NO_DEFAULT), ("g", P, NO_DEFAULT),
    ("beta", P, NO_DEFAULT), ("A_log", P, None), ("dt_bias", P, None), ("scale", P, None),
    ("initial_state", P, None), ("output_final_state", P, False),
    ("use_qk_l2norm_in_kernel", P, False), ("use_gate_in_kernel", P, False),
    ("use_beta_sigmoid_in_kernel", P, False), ("allow_neg_eigval", P, False),
    ("lower_bound", P, None), ("state_v_first", P, False), ("cu_seqlens", P, None),
]

def test_signatures_match_fla():
    check_signature(peer_op("fused_recurrent_gated_delta_rule"), FLA_GDN)
    check_signature(peer_op("fused_recurrent_kda"), FLA_KDA)

# ==== tests/ops/test_gdn.py =====================================================================
@device_param
@pytest.mark.parametrize(
    ('B', 'T', 'H', 'HV', 'D', 'scale', 'gate_logit_normalizer', 'dtype'),
    [
        pytest.param(*test, id="B{}-T{}-H{}-HV{}-D{}-scale{}-gate_logit_normalizer{}-{}".format(*test))
        for test in [
            (1, 63, 1, 1, 64, 1, 1, torch.float),
            (2, 500, 4, 4, 60, 1, 1, torch.float),
            (2, 1000, 2, 8, 128, 1, 0.1, torch.float),
            (3, 1024, 2, 2, 128, 0.1, 1, torch.float),
            (4, 1024, 3, 3, 128, 1, 10, torch.float),
            (4, 2048, 4, 4, 64, 0.1, 1, torch.float),
            (2, 1024, 4, 4, 128, 1, 0.1, torch.float16),
            (2, 1024, 4, 8, 128, 1, 10, torch.float16),
        ]
    ],
)
def test_gdn_fused_recurrent(device, B, T, H, HV, D, scale, gate_logit_normalizer, dtype):
    op = fla_on_device("fused_recurrent_gated_delta_rule", device)
    T = cpu_len(T, device)
    manual_seed(42)
    q = torch.randn(B, T, H, D, dtype=torch.float32)
    k = torch.randn(B, T, H, D, dtype=torch.float32)
    v = torch.randn(B, T, HV, D, dtype=dtype)
    beta = torch.rand(B, T, HV, dtype=dtype).sigmoid()
    g = F.logsigmoid(torch.rand(B, T, HV, dtype=torch.float32))
    g = g / gate_logit_normalizer
    h0 = torch.randn(B, HV, D, D, dtype=torch.float32)
    q, k, v, beta, g, h0 = map(lambda x: x.to(device).requires_grad_(), (q, k, v, beta, g, h0))
    ref, ref_ht = fla_naive_recurrent_gated_delta_rule(
        q=F.normalize(_repeat_heads(q.clone(), HV // H), p=2, dim=-1).to(dtype),
        k=F.normalize(_repeat_heads(k.clone(), HV // H), p=2, dim=-1).to(dtype),
        v=v.clone(),
        beta=beta.clone(),
        g=g.clone(),
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
    )
    tri, tri_ht = op(
        q=q.clone(),
        k=k.clone(),
        v=v.clone(),
        beta=beta.clone(),
        g=g.clone(),
        scale=scale,
        initial_state=h0.clone(),
        use_qk_l2norm_in_kernel=True,
        output_final_state=True,
    )
    fla_assert_close('o', ref, tri, 0.002)
    fla_assert_close('ht', ref_ht, tri_ht, 0.002)

@device_param
@pytest.mark.parametrize(
    ('B', 'T', 'H', 'HV', 'D', 'scale', 'gate_logit_normalizer', 'dtype'),
    [
        pytest.param(*test, id="B{}-T{}-H{}-HV{}-D{}-scale{}-gate_logit_normalizer{}-{}".format(*test))
        for test in [
            (1, 63, 1, 1, 64, 1, 1, torch.float),
            (2, 500, 4, 4, 60, 1, 1, torch.float),
            (2, 1000, 2, 8, 128, 1, 0.1, torch.float),
            (3, 1024, 2, 2, 128, 0.1, 1, torch.float),
            (4, 2048, 4, 4, 64, 0.1, 1, torch.float),
        ]
    ],
)
def test_gdn_fused_recurrent_state_v_first(device, B, T, H, HV, D, scale, gate_logit_normalizer,
                                           dtype):
    op = fla_on_device("fused_recurrent_gated_delta_rule", device)
    T = cpu_len(T, device)
    manual_seed(42)
    q = torch.randn(B, T, H, D, dtype=torch.float32)
    k = torch.randn(B, T, H, D, dtype=torch.float32)
    v = torch.randn(B, T, HV, D, dtype=dtype)
    beta = torch.rand(B, T, HV, dtype=dtype).sigmoid()
    g = F.logsigmoid(torch.rand(B, T, HV, dtype=torch.float32))
    g = g / gate_logit_normalizer
    h0_kv = torch.randn(B, HV, D, D, dtype=torch.float32)
    h0_vk = h0_kv.transpose(-1, -2).contiguous()
    q, k, v, beta, g, h0_kv, h0_vk = map(lambda x: x.to(device), (q, k, v, beta, g, h0_kv, h0_vk))

    # FLA's oracle: its Triton kernel, K-first. Here: FLA's naive reference (K-first).
    ref, ref_ht = fla_naive_recurrent_gated_delta_rule(
        q=F.normalize(_repeat_heads(q.clone(), HV // H), p=2, dim=-1),
        k=F.normalize(_repeat_heads(k.clone(), HV // H), p=2, dim=-1),
        v=v.clone(),
        beta=beta.clone(),
        g=g.clone(),
        scale=scale,
        initial_state=h0_kv.clone(),
        output_final_state=True,
    )
    tri, tri_ht = op(
        q=q.clone(),
        k=k.clone(),
        v=v.clone(),
        beta=beta.clone(),
        g=g.clone(),
        scale=scale,
        initial_state=h0_vk.clone(),
        use_qk_l2norm_in_kernel=True,
        output_final_state=True,
        state_v_first=True,
    )
    fla_assert_close('o', ref, tri, 1e-4)
    fla_assert_close('ht', ref_ht, tri_ht.transpose(-1, -2), 1e-4)

    # the legacy `transpose_state_layout` kwarg maps to `state_v_first` with a warning,
    # and passing both names at once is rejected
    with pytest.warns(DeprecationWarning):
        op(q=q, k=k, v=v, g=g, beta=beta, transpose_state_layout=True)
    with pytest.raises(ValueError):
        op(q=q, k=k, v=v, g=g, beta=beta, state_v_first=True, transpose_state_layout=True)

@device_param
@pytest.mark.parametrize(
    ('B', 'T', 'H', 'HV', 'D', 'scale', 'has_dt_bias', 'dtype'),
    [
        pytest.param(*test, id="B{}-T{}-H{}-HV{}-D{}-scale{}-has_dt_bias{}-{}".format(*test))
        for test in [
            (1, 64, 1, 1, 64, 1, False, torch.float),
            (2, 256, 2, 2, 64, 1, True, torch.float),
            (2, 512, 2, 4, 64, 0.1, True, torch.float16),
            (3, 1000, 2, 8, 128, 1, False, torch.float16),
            (4, 1024, 4, 4, 128, 0.1, True, torch.float16),
        ]
    ],
)
def test_gdn_fused_recurrent_gate_in_kernel(device, B, T, H, HV, D, scale, has_dt_bias, dtype):
    """fused_recurrent_gated_delta_rule with use_gate_in_kernel=True matches manual gate."""
    op = fla_on_device("fused_recurrent_gated_delta_rule", device)
    T = cpu_len(T, device)
    manual_seed(42)
    q = torch.randn(B, T, H, D, dtype=dtype, device=device)
    k = torch.randn(B, T, H, D, dtype=dtype, device=device)
    v = torch.randn(B, T, HV, D, dtype=dtype, device=device)
    beta = torch.rand(B, T, HV, dtype=dtype, device=device).sigmoid()
    g_raw = torch.randn(B, T, HV, dtype=torch.float32, device=device)
    A_log = torch.log(torch.empty(HV, dtype=torch.float32, device=device).uniform_(1, 16))
    dt_bias = torch.randn(HV, dtype=torch.float32, device=device) if has_dt_bias else None
    h0 = torch.randn(B, HV, D, D, dtype=torch.float32, device=device)

    g_ref = fla_naive_gdn_gate(g_raw, A_log, dt_bias)
    # FLA's oracle: its Triton kernel with g_ref. Here: FLA's naive reference with g_ref.
    ref, ref_ht = fla_naive_recurrent_gated_delta_rule(
        q=F.normalize(_repeat_heads(q.clone().float(), HV // H), p=2, dim=-1),
        k=F.normalize(_repeat_heads(k.clone().float(), HV // H), p=2, dim=-1),
        v=v.clone(),
        beta=beta.clone(),
        g=g_ref,
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
    )
    tri, tri_ht = op(
        q=q.clone(),
        k=k.clone(),
        v=v.clone(),
        g=g_raw.clone(),
        beta=beta.clone(),
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=A_log.clone(),
        dt_bias=dt_bias.clone() if dt_bias is not None else None,
    )
    fla_assert_close('o', ref, tri, 0.002)
    fla_assert_close('ht', ref_ht, tri_ht, 0.002)

@device_param
@pytest.mark.parametrize(
    ('B', 'T', 'H', 'HV', 'D', 'scale', 'allow_neg_eigval', 'dtype'),
    [
        pytest.param(*test, id="B{}-T{}-H{}-HV{}-D{}-scale{}-allow_neg_eigval{}-{}".format(*test))
        for test in [
            (1, 64, 1, 1, 64, 1, False, torch.float),
            (2, 512, 2, 4, 64, 0.1, True, torch.float16),
            (3, 1000, 2, 8, 128, 1, True, torch.float16),
            (4, 1024, 4, 4, 128, 0.1, False, torch.float16),
        ]
    ],
)
def test_gdn_fused_recurrent_beta_sigmoid_in_kernel(device, B, T, H, HV, D, scale,
                                                    allow_neg_eigval, dtype):
    """fused_recurrent_gated_delta_rule with use_beta_sigmoid_in_kernel=True matches manual sigmoid."""
    op = fla_on_device("fused_recurrent_gated_delta_rule", device)
    T = cpu_len(T, device)
    manual_seed(42)
    q = torch.randn(B, T, H, D, dtype=dtype, device=device)
    k = torch.randn(B, T, H, D, dtype=dtype, device=device)
    v = torch.randn(B, T, HV, D, dtype=dtype, device=device)
    beta = torch.randn(B, T, HV, dtype=dtype, device=device)
    g = F.logsigmoid(torch.rand(B, T, HV, dtype=torch.float32, device=device))
    h0 = torch.randn(B, HV, D, D, dtype=torch.float32, device=device)

    # reference: apply sigmoid (and the allow_neg_eigval x2) in PyTorch, then the naive path
    ref, ref_ht = fla_naive_recurrent_gated_delta_rule(
        q=F.normalize(_repeat_heads(q.clone().float(), HV // H), p=2, dim=-1),
        k=F.normalize(_repeat_heads(k.clone().float(), HV // H), p=2, dim=-1),
        v=v.clone(),
        beta=beta.clone().sigmoid() * (2 if allow_neg_eigval else 1),
        g=g.clone(),
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
    )
    # in-kernel sigmoid: `beta` is passed as raw logits
    tri, tri_ht = op(
        q=q.clone(),
        k=k.clone(),
        v=v.clone(),
        g=g.clone(),
        beta=beta.clone(),
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=allow_neg_eigval,
    )
    fla_assert_close('o', ref, tri, 0.005)
    fla_assert_close('ht', ref_ht, tri_ht, 0.005)

@device_param
@pytest.mark.parametrize(
    ('H', 'HV', 'D', 'has_dt_bias', 'cu_seqlens', 'dtype'),
    [
        pytest.param(*test, id="H{}-HV{}-D{}-has_dt_bias{}-cu_seqlens{}-{}".format(*test))
        for test in [
            (2, 2, 64, True, [0, 15, 100, 300], torch.float16),
            (2, 4, 64, False, [0, 256, 500, 1000], torch.float16),
            (4, 4, 128, True, [0, 15, 100, 300, 1200, 2000], torch.float16),
        ]
    ],
)
def test_gdn_fused_recurrent_gate_in_kernel_varlen(device, H, HV, D, has_dt_bias, cu_seqlens,
                                                   dtype):
    """Varlen fused_recurrent_gated_delta_rule with use_gate_in_kernel=True."""
    op = fla_on_device("fused_recurrent_gated_delta_rule", device)
    lens = [cpu_len(e - s, device) for s, e in zip(cu_seqlens, cu_seqlens[1:])]
    cu_seqlens = [0]
    for n in lens:
        cu_seqlens.append(cu_seqlens[-1] + n)
    manual_seed(42)
    cu_seqlens = torch.LongTensor(cu_seqlens).to(device)
    T = cu_seqlens[-1].item()
    N = len(cu_seqlens) - 1

    q = torch.randn(1, T, H, D, dtype=dtype, device=device)
    k = torch.randn(1, T, H, D, dtype=dtype, device=device)
    v = torch.randn(1, T, HV, D, dtype=dtype, device=device)
    beta = torch.rand(1, T, HV, dtype=dtype, device=device).sigmoid()
    g_raw = torch.randn(1, T, HV, dtype=torch.float32, device=device)
    A_log = torch.log(torch.empty(HV, dtype=torch.float32, device=device).uniform_(1, 16))
    dt_bias = torch.randn(HV, dtype=torch.float32, device=device) if has_dt_bias else None
    h0 = torch.randn(N, HV, D, D, dtype=torch.float32, device=device)

    g_ref = fla_naive_gdn_gate(g_raw, A_log, dt_bias)
    # FLA's oracle: its Triton varlen kernel with g_ref. Here: the naive reference per sequence.
    ref_o, ref_h = [], []
    for n in range(N):
        s, e = cu_seqlens[n].item(), cu_seqlens[n + 1].item()
        o_n, h_n = fla_naive_recurrent_gated_delta_rule(
            q=F.normalize(_repeat_heads(q[:, s:e].float(), HV // H), p=2, dim=-1),
            k=F.normalize(_repeat_heads(k[:, s:e].float(), HV // H), p=2, dim=-1),
            v=v[:, s:e],
            beta=beta[:, s:e],
            g=g_ref[:, s:e],
            initial_state=h0[n:n + 1].clone(),
            output_final_state=True,
        )
        ref_o.append(o_n)
        ref_h.append(h_n)
    ref, ref_ht = torch.cat(ref_o, dim=1), torch.cat(ref_h, dim=0)
    tri, tri_ht = op(
        q=q.clone(),
        k=k.clone(),
        v=v.clone(),
        g=g_raw.clone(),
        beta=beta.clone(),
        initial_state=h0.clone(),
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=A_log.clone(),
        dt_bias=dt_bias.clone() if dt_bias is not None else None,
    )
    fla_assert_close('o', ref, tri, 0.002)
    fla_assert_close('ht', ref_ht, tri_ht, 0.002)

# ==== tests/ops/test_kda.py =====================================================================
@device_param
@pytest.mark.parametrize(
    ("B", "T", "H", "HV", "D", "scale", "gate_logit_normalizer", "use_qk_l2norm_in_kernel", "dtype"),
    [
        pytest.param(
            *test,
            id="B{}-T{}-H{}-HV{}-D{}-scale{}-gate_logit_normalizer{}-use_qk_l2norm{}-{}".format(*test),
        )
        for test in [
            (1, 64, 1, 1, 64, 1, 1, False, torch.float),
            (2, 512, 3, 3, 60, 1, 1, False, torch.float),
            (3, 1000, 4, 4, 100, 0.1, 1, True, torch.float),
            (4, 1024, 4, 4, 128, 0.1, 1, False, torch.float),
            (2, 512, 2, 4, 60, 1, 1, False, torch.float),
            (2, 1024, 2, 8, 128, 0.1, 1, True, torch.float),
        ]
    ],
)
def test_kda_fused_recurrent(device, B, T, H, HV, D, scale, gate_logit_normalizer,
                             use_qk_l2norm_in_kernel, dtype):
    op = fla_on_device("fused_recurrent_kda", device)
    T = cpu_len(T, device)
    manual_seed(42)
    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, HV, D, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, D, dtype=torch.float)) / gate_logit_normalizer
    beta = torch.randn(B, T, HV, dtype=dtype).sigmoid()
    h0 = torch.randn(B, HV, D, D, dtype=torch.float32)
    q, k, v, g, beta, h0 = map(lambda x: x.to(device).requires_grad_(True), (q, k, v, g, beta, h0))

    g_tri = g.clone()
    if _pow2(D) != D:
        # the kernel loads g in next_power_of_2(D) blocks;
        # poison the memory right after g so any read past D shows up as NaN instead of a silent no-op
        buf = torch.full((g.numel() + _pow2(D),), 1e30, dtype=torch.float, device=device)
        g_tri = buf[:g.numel()].view_as(g).copy_(g)

    ref, ref_ht = fla_naive_recurrent_kda(
        q=F.normalize(q.clone(), p=2, dim=-1),
        k=F.normalize(k.clone(), p=2, dim=-1),
        v=v.clone(),
        g=g.clone(),
        beta=beta.clone(),
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
    )

    tri, tri_ht = op(
        q=F.normalize(q.clone(), p=2, dim=-1) if not use_qk_l2norm_in_kernel else q.clone(),
        k=F.normalize(k.clone(), p=2, dim=-1) if not use_qk_l2norm_in_kernel else k.clone(),
        v=v.clone(),
        g=g_tri,
        beta=beta.clone(),
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    fla_assert_close("o", ref, tri, 0.005)
    fla_assert_close("ht", ref_ht, tri_ht, 0.005)

@device_param
@pytest.mark.parametrize(
    ("B", "T", "H", "D", "allow_neg_eigval", "dtype"),
    [
        pytest.param(*test, id="B{}-T{}-H{}-D{}-allow_neg_eigval{}-{}".format(*test))
        for test in [
            (2, 256, 4, 64, False, torch.float),
            (2, 256, 4, 64, True, torch.float),
            (1, 512, 3, 60, True, torch.float),
        ]
    ],
)
def test_kda_fused_recurrent_use_beta_sigmoid_in_kernel(device, B, T, H, D, allow_neg_eigval,
                                                        dtype):
    op = fla_on_device("fused_recurrent_kda", device)
    T = cpu_len(T, device)
    manual_seed(42)
    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, H, D, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, D, dtype=torch.float))
    beta_post = torch.randn(B, T, H, dtype=dtype).sigmoid()
    beta_raw = torch.logit(beta_post.float().clamp_(1e-4, 1 - 1e-4)).to(dtype)
    h0 = torch.randn(B, H, D, D, dtype=torch.float32)
    q, k, v, g, beta_post, beta_raw, h0 = map(
        lambda x: x.to(device),
        (q, k, v, g, beta_post, beta_raw, h0),
    )

    # FLA's oracle: its Triton kernel with post-sigmoid beta. Here: FLA's naive reference.
    ref, ref_ht = fla_naive_recurrent_kda(
        q=F.normalize(q.clone(), p=2, dim=-1),
        k=F.normalize(k.clone(), p=2, dim=-1),
        v=v.clone(),
        g=g.clone(),
        beta=beta_post.clone() * (2 if allow_neg_eigval else 1),
        scale=None,
        initial_state=h0.clone(),
        output_final_state=True,
    )
    tri, tri_ht = op(
        q=F.normalize(q.clone(), p=2, dim=-1),
        k=F.normalize(k.clone(), p=2, dim=-1),
        v=v.clone(),
        g=g.clone(),
        beta=beta_raw.clone(),
        scale=None,
        initial_state=h0.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
        use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=allow_neg_eigval,
    )
    fla_assert_close("o", ref, tri, 0.005)
    fla_assert_close("ht", ref_ht, tri_ht, 0.005)

@device_param
@pytest.mark.parametrize(
    ("B", "T", "H", "D", "scale", "gate_logit_normalizer", "dtype"),
    [
        pytest.param(
            *test,
            id="B{}-T{}-H{}-D{}-scale{}-gate_logit_normalizer{}-{}".format(*test),
        )
        for test in [
            (1, 64, 1, 64, 1, 1, torch.float),
            (2, 512, 3, 60, 1, 1, torch.float),
            (3, 1000, 4, 100, 0.1, 1, torch.float),
            (4, 1024, 4, 128, 0.1, 1, torch.float),
        ]
    ],
)
def test_kda_fused_recurrent_state_v_first(device, B, T, H, D, scale, gate_logit_normalizer,
                                           dtype):
    op = fla_on_device("fused_recurrent_kda", device)
    T = cpu_len(T, device)
    manual_seed(42)
    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, H, D, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, D, dtype=torch.float)) / gate_logit_normalizer
    beta = torch.randn(B, T, H, dtype=dtype).sigmoid()
    h0_kv = torch.randn(B, H, D, D, dtype=torch.float32)
    h0_vk = h0_kv.transpose(-1, -2).contiguous()
    q, k, v, g, beta, h0_kv, h0_vk = map(lambda x: x.to(device), (q, k, v, g, beta, h0_kv, h0_vk))

    # FLA's oracle: its Triton kernel, K-first. Here: FLA's naive reference (K-first).
    ref, ref_ht = fla_naive_recurrent_kda(
        q=F.normalize(q.clone(), p=2, dim=-1),
        k=F.normalize(k.clone(), p=2, dim=-1),
        v=v.clone(),
        g=g.clone(),
        beta=beta.clone(),
        scale=scale,
        initial_state=h0_kv.clone(),
        output_final_state=True,
    )
    tri, tri_ht = op(
        q=F.normalize(q.clone(), p=2, dim=-1),
        k=F.normalize(k.clone(), p=2, dim=-1),
        v=v.clone(),
        g=g.clone(),
        beta=beta.clone(),
        scale=scale,
        initial_state=h0_vk.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
        state_v_first=True,
    )
    fla_assert_close("o", ref, tri, 1e-4)
    fla_assert_close("ht", ref_ht, tri_ht.transpose(-1, -2), 1e-4)

    # the legacy `transpose_state_layout` kwarg maps to `state_v_first` with a warning,
    # and passing both names at once is rejected
    with pytest.warns(DeprecationWarning):
        op(q=q, k=k, v=v, g=g, beta=beta, transpose_state_layout=True)
    with pytest.raises(ValueError):
        op(q=q, k=k, v=v, g=g, beta=beta, state_v_first=True, transpose_state_layout=True)

@device_param
@pytest.mark.parametrize(
    ("B", "T", "H", "HV", "D", "scale", "has_a_log", "has_dt_bias", "safe_gate", "dtype"),
    [
        pytest.param(
            *test,
            id="B{}-T{}-H{}-HV{}-D{}-scale{}-has_a_log{}-has_dt_bias{}-safe_gate{}-{}".format(*test),
        )
        for test in [
            (1, 64, 1, 1, 64, 1, True, False, False, torch.float),
            (2, 256, 2, 2, 64, 1, True, True, False, torch.float),
            (2, 512, 2, 4, 64, 0.1, True, True, True, torch.float16),
            (3, 1000, 2, 8, 128, 1, True, False, False, torch.float16),
            (4, 1024, 4, 4, 128, 0.1, True, True, True, torch.float16),
            (1, 64, 1, 1, 64, 1, False, False, True, torch.float),
            (2, 256, 2, 4, 64, 1, False, True, True, torch.float),
        ]
    ],
)
def test_kda_fused_recurrent_gate_in_kernel(device, B, T, H, HV, D, scale, has_a_log, has_dt_bias,
                                            safe_gate, dtype):
    """fused_recurrent_kda with use_gate_in_kernel=True matches manual gate path."""
    op = fla_on_device("fused_recurrent_kda", device)
    T = cpu_len(T, device)
    manual_seed(42)
    q = torch.rand(B, T, H, D, dtype=dtype, device=device)
    k = torch.rand(B, T, H, D, dtype=dtype, device=device)
    v = torch.rand(B, T, HV, D, dtype=dtype, device=device)
    beta = torch.rand(B, T, HV, dtype=dtype, device=device).sigmoid()
    g_raw = torch.randn(B, T, HV, D, dtype=torch.float32, device=device)
    A_log = (torch.log(torch.empty(HV, dtype=torch.float32, device=device).uniform_(1, 16))
             if has_a_log else None)
    dt_bias = torch.randn(HV * D, dtype=torch.float32, device=device) if has_dt_bias else None
    h0 = torch.randn(B, HV, D, D, dtype=torch.float32, device=device)

    lower_bound = -5.0 if safe_gate else None
    naive_gate_fn = fla_naive_kda_lowerbound_gate if safe_gate else fla_naive_kda_gate
    g_ref = naive_gate_fn(g_raw, A_log, dt_bias)

    # FLA's oracle: its Triton kernel with g_ref and the in-kernel norm. Here: FLA's naive
    # reference with g_ref and normalized q/k.
    ref, ref_ht = fla_naive_recurrent_kda(
        q=F.normalize(q.clone().float(), p=2, dim=-1),
        k=F.normalize(k.clone().float(), p=2, dim=-1),
        v=v.clone(),
        g=g_ref,
        beta=beta.clone(),
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
    )
    tri, tri_ht = op(
        q=q.clone(),
        k=k.clone(),
        v=v.clone(),
        g=g_raw.clone(),
        beta=beta.clone(),
        A_log=A_log.clone() if A_log is not None else None,
        dt_bias=dt_bias.clone() if dt_bias is not None else None,
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        lower_bound=lower_bound,
    )
    fla_assert_close("o", ref, tri, 0.002)
    fla_assert_close("ht", ref_ht, tri_ht, 0.002)
