"""FLA's chunk tests, ported to deltastate's FLA-named chunked prefill.

Sources (fla-org/flash-linear-attention):
  * tests/ops/test_gdn.py @ 0b346347379476548be0678ec597f9e14f148bf7 (the file the brief calls
    test_gated_delta.py; FLA renamed it): test_chunk, test_chunk_with_chunk_size,
    test_chunk_beta_sigmoid_in_kernel, test_chunk_state_v_first, test_chunk_varlen,
    test_chunk_varlen_prefill, test_chunk_gate_in_kernel, test_chunk_gate_in_kernel_gqa,
    test_chunk_gate_in_kernel_varlen.
  * tests/ops/test_kda.py @ bc3b101dcb713ddc5bd8924b66754eb68b5ccf89: test_chunk_invalid_chunk_size,
    test_chunk, test_chunk_state_v_first, test_chunk_use_beta_sigmoid_in_kernel,
    test_chunk_varlen, test_chunk_varlen_prefill, test_chunk_return_intermediate_states.
  Functions: fla/ops/gated_delta_rule/chunk.py and fla/ops/kda/chunk.py @ bc3b101d.

What changed in the port:
  * The op under test is ``deltastate.chunk_gated_delta_rule`` / ``deltastate.chunk_kda``,
    called with FLA's keywords. Oracles are FLA's: ``naive_recurrent_*`` (rewritten in
    _peer_common), or FLA's chunk function itself where FLA's test compares it with itself
    (beta sigmoid in kernel, gate in kernel: the oracle is then deltastate's op with FLA's manual
    preprocessing, exactly as FLA's test does). FLA's ratio thresholds and assert_close are kept.
  * Forward only. deltastate has no backward: FLA's gradient assertions (dq, dk, dv, db, dg, dh0,
    dA_log, ddt_bias) are not ported; every forward assertion (o, ht) is.
  * States. deltastate's chunked prefill takes V-first states only ([N, HV, V, K], the pool's
    layout) on every device and raises NotImplementedError for FLA's default K-first layout (it
    never transposes a state behind the caller's back). The caller here (``fla_chunk``) follows
    that error's advice: it passes FLA's K-first initial state transposed with
    ``state_v_first=True`` and reads the final state back K-first, so FLA's K-first references
    and assertions apply unchanged. test_chunk_state_v_first keeps its case: the K-first call is
    asserted to raise that error, and the V-first result is compared with FLA's naive K-first
    reference at FLA's chunk-vs-naive ratio 0.005 (FLA's 1e-4 compares two runs of its own chunk
    kernel in the two layouts, a run deltastate cannot make).
  * FLA's ``cu_seqlens_cpu`` (a host copy of cu_seqlens, passed by FLA's KDA varlen tests) and
    ``chunk_size`` (FLA: 16/32/64 for GDN, 32/64 for KDA) go to deltastate as FLA's tests pass
    them: deltastate takes the host copy and does not need it, checks chunk_size with FLA's
    ValueError and computes with 64-token chunks (the same recurrence up to rounding), so FLA's
    per-chunk-size cases hold at FLA's thresholds.
  * FLA's skips that concern its own backends (tilelang without GQA, Intel Alchemist, the
    default-config autotune cache) are not reproduced: every case runs.
  * ``device``: FLA's global device; here CPU and (when available) CUDA tensors.
  * Trim: on CPU tensors a sequence length T above 200 is cut to 200 (varlen: each sequence of
    ``cu_seqlens`` cut to at most 200 tokens, same number of sequences): several chunks per
    sequence, the whole file in about 10 s on two cores. DELTASTATE_PEER_FULL=1 restores FLA's
    lengths, DELTASTATE_PEER_CPU_MAX_T=n sets the cut; CUDA uses FLA's lengths.
  * test_gdn.py::test_gate / test_kda.py::test_gate (FLA's fused gate kernels), test_naive_chunk
    (FLA's naive chunk against its naive recurrence) and the FlashQLA / FlashKDA / Ascend backend
    tests are not ported: they test FLA functions deltastate does not take.
"""

import os

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F

import _peer_common
from _peer_common import (DEVICES, fla_assert_close, fla_naive_gdn_gate,
                          fla_naive_kda_gate, fla_naive_kda_lowerbound_gate,
                          fla_naive_recurrent_gated_delta_rule, fla_naive_recurrent_kda,
                          manual_seed, peer_op)

device_param = pytest.mark.parametrize("device", DEVICES)

# The chunk ports' CPU trim: 200 tokens (three full 64-token chunks and a partial one, so the
# chunk-to-chunk recurrence is exercised), unless DELTASTATE_PEER_FULL=1 or
# DELTASTATE_PEER_CPU_MAX_T says otherwise.
CHUNK_CPU_MAX_T = (_peer_common.CPU_MAX_T if _peer_common.FULL
                   or "DELTASTATE_PEER_CPU_MAX_T" in os.environ else 200)


def cpu_len(n: int, device: str) -> int:
    """The sequence length a chunk port uses: the peer's ``n`` on CUDA, at most CHUNK_CPU_MAX_T
    on CPU."""
    return n if device != "cpu" else min(n, CHUNK_CPU_MAX_T)


def fla_chunk(name):
    """The FLA-named chunk op as FLA's tests call it, every argument passed on; K-first states
    passed V-first (the error's advice; module docstring)."""
    fn = peer_op(name)

    def call(*args, **kw):
        if kw.get("state_v_first") or kw.get("transpose_state_layout"):
            return fn(*args, **kw)
        if kw.get("initial_state") is not None:
            kw["initial_state"] = kw["initial_state"].transpose(-1, -2).contiguous()
        kw["state_v_first"] = True
        o, ht = fn(*args, **kw)
        return o, (None if ht is None else ht.transpose(-1, -2))

    return call


def _repeat_heads(x, g):
    """einops ``repeat(x, 'b t h d -> b t (h g) d', g=g)``."""
    return x.repeat_interleave(g, dim=2)


def _trim_cu(cu_seqlens, device):
    """FLA's cu_seqlens with every sequence cut to cpu_len (CPU tensors only)."""
    out = [0]
    for s, e in zip(cu_seqlens, cu_seqlens[1:]):
        out.append(out[-1] + cpu_len(e - s, device))
    return out


# ==== tests/ops/test_gdn.py =====================================================================
@device_param
@pytest.mark.parametrize(
    ('B', 'T', 'H', 'HV', 'D', 'scale', 'gate_logit_normalizer', 'mask_p', 'use_qk_l2norm_in_kernel', 'dtype'),
    [
        pytest.param(
            *test,
            id="B{}-T{}-H{}-HV{}-D{}-scale{}-gate_logit_normalizer{}-mask_p{}-use_qk_l2norm_in_kernel{}-{}".format(*test),
        )
        for test in [
            (4, 1024, 4, 4, 128, 0.1, 1, 1.0, False, torch.float16),
            (2, 75, 4, 4, 64, 1, 0.01, 0, False, torch.float16),
            (2, 500, 3, 3, 60, 1, 1, 0, False, torch.float16),
            (2, 1000, 3, 3, 64, 0.1, 1, 0.5, False, torch.float16),
            (3, 1024, 4, 4, 100, 1, 0.1, 0, False, torch.float16),
            (4, 1024, 4, 4, 128, 0.1, 1, 0, True, torch.float16),
            (2, 1500, 4, 4, 128, 0.1, 10, 0, False, torch.float16),
            (4, 2048, 8, 8, 64, 0.1, 1, 0, False, torch.float16),
            (2, 256, 2, 4, 64, 1, 1, 0, False, torch.float16),
            (2, 512, 2, 8, 64, 1, 0.1, 0, True, torch.float16),
            (2, 1024, 4, 8, 128, 0.1, 1, 0, False, torch.float16),
        ]
    ],
)
def test_gdn_chunk(device, B, T, H, HV, D, scale, gate_logit_normalizer, mask_p,
                   use_qk_l2norm_in_kernel, dtype):
    op = fla_chunk("chunk_gated_delta_rule")
    T = cpu_len(T, device)
    manual_seed(42)
    assert HV % H == 0
    G = HV // H

    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, HV, D, dtype=dtype)
    beta = torch.rand(B, T, HV, dtype=torch.float).sigmoid()
    g = F.logsigmoid(torch.rand(B, T, HV, dtype=torch.float32))
    g = g / gate_logit_normalizer
    g = g * (torch.rand_like(g) > mask_p)
    h0 = torch.zeros(B, HV, D, D, dtype=torch.float32)
    q, k, v, beta, g, h0 = map(lambda x: x.to(device), (q, k, v, beta, g, h0))

    tri, tri_ht = op(
        q=F.normalize(q.clone(), p=2, dim=-1) if not use_qk_l2norm_in_kernel else q.clone(),
        k=F.normalize(k.clone(), p=2, dim=-1) if not use_qk_l2norm_in_kernel else k.clone(),
        v=v.clone(),
        g=g.clone(),
        beta=beta.clone(),
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    ref, ref_ht = fla_naive_recurrent_gated_delta_rule(
        q=F.normalize(_repeat_heads(q.clone(), G), p=2, dim=-1),
        k=F.normalize(_repeat_heads(k.clone(), G), p=2, dim=-1),
        v=v.clone(),
        beta=beta.clone(),
        g=g.clone(),
        scale=scale,
        output_final_state=True,
        initial_state=h0.clone(),
    )
    fla_assert_close('o', ref, tri, 0.005)
    fla_assert_close('ht', ref_ht, tri_ht, 0.005)


@device_param
@pytest.mark.parametrize(
    ('B', 'T', 'H', 'HV', 'D', 'scale', 'gate_logit_normalizer', 'dtype', 'chunk_size'),
    [
        pytest.param(*test, id="B{}-T{}-H{}-HV{}-D{}-scale{}-gate{}-{}-chunk{}".format(*test))
        for chunk_size in [16, 32, 64]
        for test in [
            (1, 64, 2, 4, 32, 0.1, 1.0, torch.float32, chunk_size),
        ]
    ],
)
def test_gdn_chunk_with_chunk_size(device, B, T, H, HV, D, scale, gate_logit_normalizer, dtype,
                                   chunk_size):
    op = fla_chunk("chunk_gated_delta_rule")
    manual_seed(42)
    assert HV % H == 0
    G = HV // H

    q = torch.rand(B, T, H, D, dtype=dtype, device=device)
    k = torch.rand(B, T, H, D, dtype=dtype, device=device)
    v = torch.rand(B, T, HV, D, dtype=dtype, device=device)
    beta = torch.rand(B, T, HV, dtype=torch.float32, device=device).sigmoid()
    g = F.logsigmoid(torch.rand(B, T, HV, dtype=torch.float32, device=device)) / gate_logit_normalizer
    h0 = torch.zeros(B, HV, D, D, dtype=torch.float32, device=device)

    ref_o, ref_ht = fla_naive_recurrent_gated_delta_rule(
        q=F.normalize(_repeat_heads(q, G), p=2, dim=-1),
        k=F.normalize(_repeat_heads(k, G), p=2, dim=-1),
        v=v,
        beta=beta,
        g=g,
        scale=scale,
        initial_state=h0,
        output_final_state=True,
    )
    tri_o, tri_ht = op(
        q=F.normalize(q, p=2, dim=-1),
        k=F.normalize(k, p=2, dim=-1),
        v=v,
        beta=beta,
        g=g,
        scale=scale,
        initial_state=h0,
        output_final_state=True,
        chunk_size=chunk_size,
    )
    fla_assert_close(f'o@{chunk_size}', ref_o, tri_o, 0.005)
    fla_assert_close(f'ht@{chunk_size}', ref_ht, tri_ht, 0.005)


@device_param
@pytest.mark.parametrize(
    ('B', 'T', 'H', 'HV', 'D', 'scale', 'use_qk_l2norm_in_kernel', 'allow_neg_eigval', 'dtype'),
    [
        pytest.param(
            *test,
            id="B{}-T{}-H{}-HV{}-D{}-scale{}-use_qk_l2norm_in_kernel{}-allow_neg_eigval{}-{}".format(*test),
        )
        for test in [
            (2, 500, 4, 4, 64, 1, False, False, torch.float16),
            (3, 1024, 4, 4, 128, 0.1, True, True, torch.float16),
            (2, 1024, 4, 8, 128, 0.1, False, True, torch.float16),
            (4, 2048, 8, 8, 64, 0.1, True, False, torch.float16),
        ]
    ],
)
def test_gdn_chunk_beta_sigmoid_in_kernel(device, B, T, H, HV, D, scale, use_qk_l2norm_in_kernel,
                                          allow_neg_eigval, dtype):
    """`use_beta_sigmoid_in_kernel=True` (raw beta logits) matches manual sigmoid."""
    op = fla_chunk("chunk_gated_delta_rule")
    T = cpu_len(T, device)
    manual_seed(42)
    assert HV % H == 0

    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, HV, D, dtype=dtype)
    beta = torch.randn(B, T, HV, dtype=torch.float)
    g = F.logsigmoid(torch.rand(B, T, HV, dtype=torch.float32))
    h0 = torch.zeros(B, HV, D, D, dtype=torch.float32)
    q, k, v, beta, g, h0 = map(lambda x: x.to(device), (q, k, v, beta, g, h0))

    # in-kernel sigmoid: `beta` is passed as raw logits
    tri, tri_ht = op(
        q=F.normalize(q.clone(), p=2, dim=-1) if not use_qk_l2norm_in_kernel else q.clone(),
        k=F.normalize(k.clone(), p=2, dim=-1) if not use_qk_l2norm_in_kernel else k.clone(),
        v=v.clone(),
        g=g.clone(),
        beta=beta.clone(),
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=allow_neg_eigval,
    )
    # reference: apply sigmoid (and the allow_neg_eigval x2) in PyTorch, then default path
    ref, ref_ht = op(
        q=F.normalize(q.clone(), p=2, dim=-1) if not use_qk_l2norm_in_kernel else q.clone(),
        k=F.normalize(k.clone(), p=2, dim=-1) if not use_qk_l2norm_in_kernel else k.clone(),
        v=v.clone(),
        g=g.clone(),
        beta=beta.clone().sigmoid() * (2 if allow_neg_eigval else 1),
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=False,
    )
    fla_assert_close('o', ref, tri, 0.005)
    fla_assert_close('ht', ref_ht, tri_ht, 0.005)


@device_param
@pytest.mark.parametrize(
    ('B', 'T', 'H', 'D', 'scale', 'gate_logit_normalizer', 'dtype'),
    [
        pytest.param(*test, id="B{}-T{}-H{}-D{}-scale{}-gate_logit_normalizer{}-{}".format(*test))
        for test in [
            (1, 63, 1, 64, 1, 1, torch.float16),
            (2, 500, 3, 60, 1, 1, torch.float16),
            (3, 1024, 4, 128, 0.1, 1, torch.float16),
            (4, 2048, 8, 64, 0.1, 1, torch.float16),
        ]
    ],
)
def test_gdn_chunk_state_v_first(device, B, T, H, D, scale, gate_logit_normalizer, dtype):
    fn = peer_op("chunk_gated_delta_rule")
    T = cpu_len(T, device)
    manual_seed(42)

    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, H, D, dtype=dtype)
    beta = torch.rand(B, T, H, dtype=dtype).sigmoid()
    g = F.logsigmoid(torch.rand(B, T, H, dtype=torch.float32))
    g = g / gate_logit_normalizer
    # Non-zero initial state so transpose load path is actually exercised
    h0_kv = torch.randn(B, H, D, D, dtype=torch.float32)
    h0_vk = h0_kv.transpose(-1, -2).contiguous()
    q, k, v, beta, g, h0_kv, h0_vk = map(lambda x: x.to(device), (q, k, v, beta, g, h0_kv, h0_vk))

    tri, tri_ht = fn(
        q=F.normalize(q.clone(), p=2, dim=-1),
        k=F.normalize(k.clone(), p=2, dim=-1),
        v=v.clone(),
        g=g.clone(),
        beta=beta.clone(),
        scale=scale,
        initial_state=h0_vk.clone(),
        output_final_state=True,
        state_v_first=True,
    )
    # FLA's oracle: its chunk kernel with the K-first state, which deltastate rejects (module
    # docstring); the rejection is asserted, and FLA's naive K-first reference stands in.
    with pytest.raises(NotImplementedError, match="state_v_first"):
        fn(q=F.normalize(q.clone(), p=2, dim=-1), k=F.normalize(k.clone(), p=2, dim=-1),
           v=v.clone(), g=g.clone(), beta=beta.clone(), scale=scale,
           initial_state=h0_kv.clone(), output_final_state=True, state_v_first=False)
    ref, ref_ht = fla_naive_recurrent_gated_delta_rule(
        q=F.normalize(q.clone(), p=2, dim=-1),
        k=F.normalize(k.clone(), p=2, dim=-1),
        v=v.clone(),
        beta=beta.clone(),
        g=g.clone(),
        scale=scale,
        initial_state=h0_kv.clone(),
        output_final_state=True,
    )
    fla_assert_close('o', ref, tri, 0.005)
    fla_assert_close('ht', ref_ht, tri_ht.transpose(-1, -2), 0.005)


def _gdn_varlen_reference(q, k, v, beta, g, h0, cu_seqlens, G):
    ref, ref_ht = [], []
    for i in range(len(cu_seqlens) - 1):
        s, e = cu_seqlens[i], cu_seqlens[i + 1]
        ref_i, ref_ht_i = fla_naive_recurrent_gated_delta_rule(
            q=_repeat_heads(q[:, s:e], G),
            k=_repeat_heads(k[:, s:e], G),
            v=v[:, s:e],
            beta=beta[:, s:e],
            g=g[:, s:e],
            initial_state=h0[i],
            output_final_state=True,
        )
        ref.append(ref_i)
        ref_ht.append(ref_ht_i)
    return torch.cat(ref, 1), torch.cat(ref_ht, 0)


@device_param
@pytest.mark.parametrize(
    ('H', 'HV', 'D', 'mask_p', 'cu_seqlens', 'dtype'),
    [
        pytest.param(*test, id="H{}-HV{}-D{}-mask_p{}-cu_seqlens{}-{}".format(*test))
        for test in [
            (4, 4, 60, 0, [0, 15], torch.float16),
            (4, 4, 64, 0, [0, 256, 500, 1000], torch.float16),
            (4, 4, 64, 0.5, [0, 256, 500, 1000], torch.float16),
            (4, 4, 100, 0, [0, 15, 100, 300, 1200, 2000], torch.float16),
            (2, 4, 64, 0, [0, 256, 500, 1000], torch.float16),
            (2, 8, 64, 0, [0, 256, 500, 1000], torch.float16),
        ]
    ],
)
def test_gdn_chunk_varlen(device, H, HV, D, mask_p, cu_seqlens, dtype):
    op = fla_chunk("chunk_gated_delta_rule")
    cu_seqlens = _trim_cu(cu_seqlens, device)
    manual_seed(42)
    assert HV % H == 0
    G = HV // H
    T = cu_seqlens[-1]
    N = len(cu_seqlens) - 1

    # seq-first required for inputs with variable lengths
    q = torch.randn((1, T, H, D), dtype=dtype)
    k = F.normalize(torch.randn(1, T, H, D, dtype=torch.float32), p=2, dim=-1).to(dtype)
    v = torch.randn((1, T, HV, D), dtype=dtype)
    g = F.logsigmoid(torch.rand(1, T, HV, dtype=dtype))
    g = g * (torch.rand_like(g) > mask_p)
    beta = torch.rand(1, T, HV, dtype=torch.float).sigmoid()
    h0 = torch.randn((N, HV, D, D), dtype=dtype)
    q, k, v, beta, g, h0 = map(lambda x: x.to(device), (q, k, v, beta, g, h0))

    tri, tri_ht = op(
        q=q.clone(),
        k=k.clone(),
        v=v.clone(),
        beta=beta.clone(),
        g=g.clone(),
        initial_state=h0.clone(),
        output_final_state=True,
        cu_seqlens=torch.LongTensor(cu_seqlens).to(device),
    )
    ref, ref_ht = _gdn_varlen_reference(q, k, v, beta, g, h0, cu_seqlens, G)
    fla_assert_close('o', ref, tri, 0.005)
    fla_assert_close('ht', ref_ht, tri_ht, 0.005)


@device_param
@pytest.mark.parametrize(
    ('H', 'D', 'mask_p', 'cu_seqlens', 'dtype'),
    [
        pytest.param(*test, id="H{}-D{}-mask_p{}-cu_seqlens{}-{}".format(*test))
        for test in [
            (4, 60, 0, [0, 8192], torch.float16),
            (4, 60, 0, [0, 15], torch.float16),
            (4, 64, 0, [0, 256, 500, 1000], torch.float16),
            (4, 64, 0.5, [0, 256, 500, 1000], torch.float16),
            (4, 100, 0, [0, 15, 100, 300, 1200, 2000], torch.float16),
        ]
    ],
)
@torch.inference_mode()
def test_gdn_chunk_varlen_prefill(device, H, D, mask_p, cu_seqlens, dtype):
    op = fla_chunk("chunk_gated_delta_rule")
    cu_seqlens = _trim_cu(cu_seqlens, device)
    manual_seed(42)
    T = cu_seqlens[-1]
    N = len(cu_seqlens) - 1

    # seq-first required for inputs with variable lengths
    q = torch.randn((1, T, H, D), dtype=dtype).to(device)
    k = F.normalize(torch.randn(1, T, H, D, dtype=torch.float32), p=2, dim=-1).to(dtype).to(device)
    v = torch.randn((1, T, H, D), dtype=dtype).to(device)
    g = F.logsigmoid(torch.rand(1, T, H, dtype=dtype)).to(device)
    g = g * (torch.rand_like(g) > mask_p)
    beta = torch.rand(1, T, H, dtype=dtype).sigmoid().to(device)
    h0 = torch.randn((N, H, D, D), dtype=dtype).to(device)

    tri, tri_ht = op(
        q=q.clone(),
        k=k.clone(),
        v=v.clone(),
        beta=beta.clone(),
        g=g.clone(),
        initial_state=h0.clone(),
        output_final_state=True,
        cu_seqlens=torch.LongTensor(cu_seqlens).to(device),
    )
    ref, ref_ht = _gdn_varlen_reference(q, k, v, beta, g, h0, cu_seqlens, 1)
    fla_assert_close('o', ref, tri, 0.005)
    fla_assert_close('ht', ref_ht, tri_ht, 0.005)


@device_param
@pytest.mark.parametrize(
    ('B', 'T', 'H', 'D', 'scale', 'has_dt_bias', 'use_qk_l2norm_in_kernel', 'dtype'),
    [
        pytest.param(
            *test,
            id="B{}-T{}-H{}-D{}-scale{}-has_dt_bias{}-use_qk_l2norm{}-{}".format(*test),
        )
        for test in [
            (2, 75, 4, 64, 1, True, True, torch.float16),
            (2, 500, 3, 60, 1, False, False, torch.float16),
            (2, 1000, 3, 64, 0.1, True, False, torch.float16),
            (3, 1024, 4, 100, 1, True, True, torch.float16),
            (4, 1024, 4, 128, 0.1, False, True, torch.float16),
            (4, 2048, 8, 64, 0.1, True, False, torch.float16),
        ]
    ],
)
def test_gdn_chunk_gate_in_kernel(device, B, T, H, D, scale, has_dt_bias, use_qk_l2norm_in_kernel,
                                  dtype):
    """Test use_gate_in_kernel=True path: fused gate activation + chunk cumsum inside kernel."""
    op = fla_chunk("chunk_gated_delta_rule")
    T = cpu_len(T, device)
    manual_seed(42)

    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, H, D, dtype=dtype)
    beta = torch.rand(B, T, H, dtype=torch.float).sigmoid()
    # Raw gate input (before activation)
    g_raw = torch.randn(B, T, H, dtype=torch.float32)
    A_log = torch.randn(H, dtype=torch.float32)
    dt_bias = torch.randn(H, dtype=torch.float32) if has_dt_bias else None
    h0 = torch.zeros(B, H, D, D, dtype=torch.float32)
    q, k, v, beta, g_raw, h0 = map(lambda x: x.to(device), (q, k, v, beta, g_raw, h0))
    A_log = A_log.to(device)
    dt_bias = dt_bias.to(device) if dt_bias is not None else None

    # === use_gate_in_kernel=True ===
    tri, tri_ht = op(
        q=q.clone() if use_qk_l2norm_in_kernel else F.normalize(q.clone(), p=2, dim=-1),
        k=k.clone() if use_qk_l2norm_in_kernel else F.normalize(k.clone(), p=2, dim=-1),
        v=v.clone(),
        g=g_raw.clone(),
        beta=beta.clone(),
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=True,
        A_log=A_log.clone(),
        dt_bias=dt_bias.clone() if dt_bias is not None else None,
    )
    # === Reference path: manually compute gate, then use_gate_in_kernel=False ===
    g_ref = fla_naive_gdn_gate(g_raw, A_log, dt_bias)
    ref, ref_ht = op(
        q=q.clone() if use_qk_l2norm_in_kernel else F.normalize(q.clone(), p=2, dim=-1),
        k=k.clone() if use_qk_l2norm_in_kernel else F.normalize(k.clone(), p=2, dim=-1),
        v=v.clone(),
        g=g_ref,
        beta=beta.clone(),
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    fla_assert_close('o', ref, tri, 0.005)
    fla_assert_close('ht', ref_ht, tri_ht, 0.005)


@device_param
@pytest.mark.parametrize(
    ('B', 'T', 'Hq', 'H', 'D', 'scale', 'has_dt_bias', 'dtype'),
    [
        pytest.param(
            *test,
            id="B{}-T{}-Hq{}-H{}-D{}-scale{}-has_dt_bias{}-{}".format(*test),
        )
        for test in [
            (2, 256, 2, 4, 64, 1, True, torch.float16),
            (2, 512, 1, 4, 64, 0.1, False, torch.float16),
            (2, 512, 2, 8, 64, 1, True, torch.float16),
            (2, 1024, 4, 8, 128, 0.1, True, torch.float16),
        ]
    ],
)
def test_gdn_chunk_gate_in_kernel_gqa(device, B, T, Hq, H, D, scale, has_dt_bias, dtype):
    """Test use_gate_in_kernel=True with grouped value attention (HV > H)."""
    op = fla_chunk("chunk_gated_delta_rule")
    T = cpu_len(T, device)
    manual_seed(42)
    assert H % Hq == 0

    q = torch.rand(B, T, Hq, D, dtype=dtype)
    k = torch.rand(B, T, Hq, D, dtype=dtype)
    v = torch.rand(B, T, H, D, dtype=dtype)
    beta = torch.rand(B, T, H, dtype=torch.float).sigmoid()
    g_raw = torch.randn(B, T, H, dtype=torch.float32)
    A_log = torch.randn(H, dtype=torch.float32)
    dt_bias = torch.randn(H, dtype=torch.float32) if has_dt_bias else None
    h0 = torch.zeros(B, H, D, D, dtype=torch.float32)
    q, k, v, beta, g_raw, h0 = map(lambda x: x.to(device), (q, k, v, beta, g_raw, h0))
    A_log = A_log.to(device)
    dt_bias = dt_bias.to(device) if dt_bias is not None else None

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
    g_ref = fla_naive_gdn_gate(g_raw, A_log, dt_bias)
    ref, ref_ht = op(
        q=q.clone(),
        k=k.clone(),
        v=v.clone(),
        g=g_ref,
        beta=beta.clone(),
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    fla_assert_close('o', ref, tri, 0.005)
    fla_assert_close('ht', ref_ht, tri_ht, 0.005)


@device_param
@pytest.mark.parametrize(
    ('H', 'D', 'has_dt_bias', 'cu_seqlens', 'dtype'),
    [
        pytest.param(*test, id="H{}-D{}-has_dt_bias{}-cu_seqlens{}-{}".format(*test))
        for test in [
            (4, 60, True, [0, 15], torch.float16),
            (4, 64, False, [0, 256, 500, 1000], torch.float16),
            (4, 64, True, [0, 256, 500, 1000], torch.float16),
            (4, 100, True, [0, 15, 100, 300, 1200, 2000], torch.float16),
        ]
    ],
)
def test_gdn_chunk_gate_in_kernel_varlen(device, H, D, has_dt_bias, cu_seqlens, dtype):
    """Test use_gate_in_kernel=True with variable-length sequences."""
    op = fla_chunk("chunk_gated_delta_rule")
    cu_seqlens = _trim_cu(cu_seqlens, device)
    manual_seed(42)
    cu_seqlens = torch.LongTensor(cu_seqlens).to(device)
    T = cu_seqlens[-1].item()
    N = len(cu_seqlens) - 1

    q = torch.randn((1, T, H, D), dtype=dtype)
    k = torch.randn((1, T, H, D), dtype=dtype)
    v = torch.randn((1, T, H, D), dtype=dtype)
    beta = torch.rand(1, T, H, dtype=torch.float).sigmoid()
    g_raw = torch.randn(1, T, H, dtype=torch.float32)
    A_log = torch.randn(H, dtype=torch.float32)
    dt_bias = torch.randn(H, dtype=torch.float32) if has_dt_bias else None
    h0 = torch.randn((N, H, D, D), dtype=torch.float32)
    q, k, v, beta, g_raw, h0 = map(lambda x: x.to(device), (q, k, v, beta, g_raw, h0))
    A_log = A_log.to(device)
    dt_bias = dt_bias.to(device) if dt_bias is not None else None

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
    g_ref = fla_naive_gdn_gate(g_raw, A_log, dt_bias)
    ref, ref_ht = op(
        q=q.clone(),
        k=k.clone(),
        v=v.clone(),
        g=g_ref,
        beta=beta.clone(),
        initial_state=h0.clone(),
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=True,
    )
    fla_assert_close('o', ref, tri, 0.005)
    fla_assert_close('ht', ref_ht, tri_ht, 0.005)


# ==== tests/ops/test_kda.py =====================================================================
@device_param
def test_kda_chunk_invalid_chunk_size(device):
    fn = peer_op("chunk_kda")
    B, T, H, D = 1, 64, 1, 64
    q = torch.randn(B, T, H, D, dtype=torch.float, device=device)
    k = torch.randn(B, T, H, D, dtype=torch.float, device=device)
    v = torch.randn(B, T, H, D, dtype=torch.float, device=device)
    g = torch.randn(B, T, H, D, dtype=torch.float, device=device)
    beta = torch.randn(B, T, H, dtype=torch.float, device=device)

    with pytest.raises(ValueError, match=r"`chunk_size` must be either 32 or 64"):
        fn(q, k, v, g, beta, chunk_size=16)


@device_param
@pytest.mark.parametrize(
    (
        "B",
        "T",
        "H",
        "HV",
        "D",
        "scale",
        "gate_logit_normalizer",
        "mask_p",
        "use_qk_l2norm_in_kernel",
        "use_gate_in_kernel",
        "dtype",
        "safe_gate",
        "disable_recompute",
        "chunk_size",
    ),
    [
        pytest.param(
            *test,
            id=(
                "B{}-T{}-H{}-HV{}-D{}-scale{}-gate_logit_normalizer{}-mask_p{}"
                "-use_qk_l2norm{}-use_gate{}-{}-safe_gate{}-disable_recompute{}-chunk_size{}"
            ).format(*test),
        )
        for test in [
            (1, 63, 1, 1, 64, 1, 1, 0, False, False, torch.float16, True, False, 64),
            (2, 500, 3, 3, 60, 1, 1, 0, False, False, torch.float16, True, True, 64),
            (2, 1000, 3, 3, 64, 0.1, 1, 0.5, False, False, torch.float16, False, True, 64),
            (3, 1024, 4, 4, 100, 1, 0.1, 0, False, False, torch.float16, False, False, 64),
            (4, 1024, 4, 4, 128, 0.1, 1, 0, False, False, torch.float16, True, True, 64),
            (4, 1024, 4, 4, 128, 0.1, 1, 0, True, False, torch.float16, True, False, 64),
            (2, 1500, 4, 4, 128, 0.1, 10, 0, False, True, torch.float16, False, True, 64),
            (4, 2048, 8, 8, 64, 0.1, 1, 0, False, True, torch.float16, True, True, 64),

            (2, 1024, 2, 4, 64, 0.1, 1, 0, False, False, torch.float16, False, False, 64),
            (2, 1024, 2, 8, 64, 0.1, 1, 0, False, True, torch.float16, False, False, 64),
            (2, 1024, 4, 8, 128, 0.1, 1, 0, True, True, torch.float16, False, False, 64),
            (2, 160, 2, 4, 64, 0.1, 1, 0, False, True, torch.float16, True, True, 32),

            (2, 1024, 2, 4, 64, 0.1, 1, 0, True, True, torch.bfloat16, True, False, 64),
            (2, 1024, 2, 4, 64, 0.1, 1, 0, False, True, torch.bfloat16, False, False, 64),
            (2, 160, 2, 4, 64, 0.1, 1, 0, False, True, torch.bfloat16, True, True, 32),
            (2, 1024, 2, 8, 128, 0.1, 1, 0, True, True, torch.bfloat16, False, False, 64),
        ]
    ],
)
def test_kda_chunk(device, B, T, H, HV, D, scale, gate_logit_normalizer, mask_p,
                   use_qk_l2norm_in_kernel, use_gate_in_kernel, dtype, safe_gate,
                   disable_recompute, chunk_size):
    op = fla_chunk("chunk_kda")
    T = cpu_len(T, device)
    manual_seed(42)
    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, HV, D, dtype=dtype)
    g = torch.randn(B, T, HV, D, dtype=torch.float if not use_gate_in_kernel else dtype)
    A_log = dt_bias = None
    if use_gate_in_kernel:
        A_log = torch.randn(HV, dtype=torch.float)
        dt_bias = torch.randn(HV * D, dtype=torch.float)
    else:
        g = F.logsigmoid(g) / gate_logit_normalizer
        g = g * (torch.rand_like(g) > mask_p)
    if safe_gate:
        lower_bound = -5.0
        if not use_gate_in_kernel:
            g = g.clamp(-5, 0)
        naive_kda_gate_fn = fla_naive_kda_lowerbound_gate
    else:
        lower_bound = None
        naive_kda_gate_fn = fla_naive_kda_gate

    beta = torch.randn(B, T, HV, dtype=dtype).sigmoid()
    h0 = torch.randn(B, HV, D, D, dtype=torch.float32)
    if use_gate_in_kernel:
        A_log, dt_bias = map(lambda x: x.to(device), (A_log, dt_bias))
    q, k, v, g, beta, h0 = map(lambda x: x.to(device), (q, k, v, g, beta, h0))

    ref, ref_ht = fla_naive_recurrent_kda(
        q=F.normalize(q.clone(), p=2, dim=-1),
        k=F.normalize(k.clone(), p=2, dim=-1),
        v=v.clone(),
        g=(naive_kda_gate_fn(g, A_log, dt_bias) if use_gate_in_kernel else g.clone()),
        beta=beta.clone(),
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
    )
    tri, tri_ht = op(
        q=F.normalize(q.clone(), p=2, dim=-1) if not use_qk_l2norm_in_kernel else q.clone(),
        k=F.normalize(k.clone(), p=2, dim=-1) if not use_qk_l2norm_in_kernel else k.clone(),
        v=v.clone(),
        g=g.clone(),
        beta=beta.clone(),
        A_log=(A_log.clone() if use_gate_in_kernel else None),
        dt_bias=(dt_bias.clone() if use_gate_in_kernel else None),
        scale=scale,
        initial_state=h0.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        safe_gate=safe_gate,
        lower_bound=lower_bound,
        disable_recompute=disable_recompute,
        chunk_size=chunk_size,
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
            (1, 63, 1, 64, 1, 1, torch.float16),
            (2, 500, 3, 60, 1, 1, torch.float16),
            (3, 1024, 4, 128, 0.1, 1, torch.float16),
            (4, 2048, 8, 64, 0.1, 1, torch.float16),
        ]
    ],
)
def test_kda_chunk_state_v_first(device, B, T, H, D, scale, gate_logit_normalizer, dtype):
    fn = peer_op("chunk_kda")
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

    tri, tri_ht = fn(
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
    # FLA's oracle: its chunk kernel with the K-first state, which deltastate rejects (module
    # docstring); the rejection is asserted, and FLA's naive K-first reference stands in.
    with pytest.raises(NotImplementedError, match="state_v_first"):
        fn(q=F.normalize(q.clone(), p=2, dim=-1), k=F.normalize(k.clone(), p=2, dim=-1),
           v=v.clone(), g=g.clone(), beta=beta.clone(), scale=scale,
           initial_state=h0_kv.clone(), output_final_state=True,
           use_qk_l2norm_in_kernel=False, state_v_first=False)
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
    fla_assert_close("o", ref, tri, 0.005)
    fla_assert_close("ht", ref_ht, tri_ht.transpose(-1, -2), 0.005)


@device_param
@pytest.mark.parametrize(
    ("B", "T", "H", "D", "allow_neg_eigval", "dtype"),
    [
        pytest.param(*test, id="B{}-T{}-H{}-D{}-allow_neg_eigval{}-{}".format(*test))
        for test in [
            (1, 8192, 96, 128, False, torch.bfloat16),
            (1, 8192, 96, 128, True, torch.bfloat16),
            (2, 96, 2, 64, True, torch.float16),
        ]
    ],
)
def test_kda_chunk_use_beta_sigmoid_in_kernel(device, B, T, H, D, allow_neg_eigval, dtype):
    op = fla_chunk("chunk_kda")
    T = cpu_len(T, device)
    manual_seed(42)
    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, H, D, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, D, dtype=torch.float))
    beta_raw = torch.randn(B, T, H, dtype=dtype)
    beta_post = beta_raw.float().sigmoid()
    h0 = torch.randn(B, H, D, D, dtype=torch.float32)
    q, k, v, g, beta_post, beta_raw, h0 = map(lambda x: x.to(device),
                                              (q, k, v, g, beta_post, beta_raw, h0))

    ref, ref_ht = op(
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
        use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=allow_neg_eigval,
    )
    rtol = 1e-4
    fla_assert_close("o", ref, tri, rtol)
    fla_assert_close("ht", ref_ht, tri_ht, rtol)


def _kda_varlen_case(H, D, mask_p, cu_seqlens, dtype, use_gate_in_kernel, safe_gate, device):
    """FLA's data of test_chunk_varlen / test_chunk_varlen_prefill (identical in both)."""
    T = cu_seqlens[-1]
    N = len(cu_seqlens) - 1
    # seq-first required for inputs with variable lengths
    q = torch.randn((1, T, H, D), dtype=dtype)
    k = F.normalize(torch.randn(1, T, H, D, dtype=torch.float32), p=2, dim=-1).to(dtype)
    v = torch.randn((1, T, H, D), dtype=dtype)
    g = torch.randn(1, T, H, D, dtype=torch.float if not use_gate_in_kernel else dtype)
    A_log = dt_bias = None
    if use_gate_in_kernel:
        A_log = torch.log(torch.randn(1, 1, H, 1, dtype=torch.float32, device=device).uniform_(1, 16))
        dt_bias = torch.randn(H * D, dtype=torch.float32, device=device)
    else:
        g = F.logsigmoid(g)
        g = g * (torch.rand_like(g) > mask_p)
    mask = torch.rand_like(g) > mask_p
    g = g * mask + (~mask) * (-1000)
    if safe_gate:
        assert use_gate_in_kernel is False
        g = g.clamp(-5, 0)
    beta = torch.rand(1, T, H, dtype=dtype).sigmoid()
    h0 = torch.randn((N, H, D, D), dtype=torch.float32)
    q, k, v, g, beta, h0 = map(lambda x: x.to(device), (q, k, v, g, beta, h0))
    return q, k, v, g, beta, h0, A_log, dt_bias


def _kda_varlen_reference(q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens, use_gate_in_kernel):
    ref, ref_ht = [], []
    for i in range(len(cu_seqlens) - 1):
        s, e = cu_seqlens[i], cu_seqlens[i + 1]
        ref_i, ref_ht_i = fla_naive_recurrent_kda(
            q=F.normalize(q[:, s:e], p=2, dim=-1),
            k=k[:, s:e],  # k is already normalized
            v=v[:, s:e],
            beta=beta[:, s:e],
            g=(fla_naive_kda_gate(g[:, s:e].to(torch.float), A_log.to(torch.float),
                                  dt_bias.to(torch.float)) if use_gate_in_kernel else g[:, s:e]),
            initial_state=h0[i],
            output_final_state=True,
        )
        ref.append(ref_i)
        ref_ht.append(ref_ht_i)
    return torch.cat(ref, 1), torch.cat(ref_ht, 0)


def _kda_varlen_check(device, H, D, mask_p, cu_seqlens, dtype, use_gate_in_kernel, safe_gate,
                      disable_recompute, **chunk_kw):
    """The body FLA's test_chunk_varlen and test_chunk_varlen_prefill share: chunk_kda on one
    varlen batch against the token-by-token reference, o and the final states at 0.005."""
    op = fla_chunk("chunk_kda")
    cu_seqlens = _trim_cu(cu_seqlens, device)
    manual_seed(42)
    q, k, v, g, beta, h0, A_log, dt_bias = _kda_varlen_case(
        H, D, mask_p, cu_seqlens, dtype, use_gate_in_kernel, safe_gate, device)
    cu = torch.LongTensor(cu_seqlens).to(device)
    tri, tri_ht = op(
        q=F.normalize(q.clone(), p=2, dim=-1),
        k=k.clone(),  # k is already normalized
        v=v.clone(),
        g=g.clone(),
        beta=beta.clone(),
        A_log=(A_log.clone() if use_gate_in_kernel else None),
        dt_bias=(dt_bias.clone() if use_gate_in_kernel else None),
        initial_state=h0.clone(),
        output_final_state=True,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu.cpu(),
        use_gate_in_kernel=use_gate_in_kernel,
        safe_gate=safe_gate,
        disable_recompute=disable_recompute,
        **chunk_kw,
    )
    ref, ref_ht = _kda_varlen_reference(q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens,
                                        use_gate_in_kernel)
    fla_assert_close("o", ref, tri, 0.005)
    fla_assert_close("ht", ref_ht, tri_ht, 0.005)


@device_param
@pytest.mark.parametrize(
    ("H", "D", "mask_p", "cu_seqlens", "dtype", "use_gate_in_kernel", "safe_gate",
     "disable_recompute", "chunk_size"),
    [
        pytest.param(
            *test,
            id=(
                "H{}-D{}-mask_p{}-cu_seqlens{}-{}-gate{}"
                "-safe_gate{}-disable_recompute{}-chunk_size{}"
            ).format(*test),
        )
        for test in [
            (4, 60, 0.1, [0, 15], torch.float16, True, False, False, 64),
            (4, 64, 0.9, [0, 256, 500, 1000], torch.float16, True, False, False, 64),
            (4, 128, 0.5, [0, 256, 500, 1000], torch.float16, False, False, False, 64),
            (4, 100, 0, [0, 15, 100, 300, 1200, 2000], torch.float16, True, False, False, 64),
            (4, 256, 0, [0, 100, 300, 1200, 3000, 4096], torch.float16, False, True, True, 64),
            (4, 60, 0.1, [0, 31, 96, 160], torch.float16, True, False, True, 32),
        ]
    ],
)
def test_kda_chunk_varlen(device, H, D, mask_p, cu_seqlens, dtype, use_gate_in_kernel, safe_gate,
                          disable_recompute, chunk_size):
    _kda_varlen_check(device, H, D, mask_p, cu_seqlens, dtype, use_gate_in_kernel, safe_gate,
                      disable_recompute, chunk_size=chunk_size)


@device_param
@pytest.mark.parametrize(
    ("H", "D", "mask_p", "cu_seqlens", "dtype", "use_gate_in_kernel", "safe_gate", "disable_recompute"),
    [
        pytest.param(*test, id="H{}-D{}-mask_p{}-cu_seqlens{}-{}-gate{}-safe_gate{}-disable_recompute{}".format(*test))
        for test in [
            (4, 60, 0.1, [0, 8192], torch.float16, True, False, False),
            (4, 64, 0.9, [0, 256, 500, 1000], torch.float16, True, False, False),
            (4, 128, 0.5, [0, 256, 500, 1000], torch.float16, False, False, False),
            (4, 100, 0, [0, 15, 100, 300, 1200, 2000], torch.float16, True, False, False),
            (4, 256, 0, [0, 100, 300, 1200, 3000, 4096], torch.float16, False, True, True),
        ]
    ],
)
@torch.inference_mode()
def test_kda_chunk_varlen_prefill(device, H, D, mask_p, cu_seqlens, dtype, use_gate_in_kernel,
                                  safe_gate, disable_recompute):
    _kda_varlen_check(device, H, D, mask_p, cu_seqlens, dtype, use_gate_in_kernel, safe_gate,
                      disable_recompute)


@device_param
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_kda_chunk_return_intermediate_states(device, dtype):
    """FLA returns the per-chunk states h with return_intermediate_states=True; deltastate does
    not (its checkpoints, checkpoint_every_n_tokens, are the way to per-chunk states). The case is
    kept: the call is asserted to be rejected with an error naming the checkpoints."""
    fn = peer_op("chunk_kda")
    manual_seed(42)
    B, T, H, D = 2, cpu_len(1024, device), 4, 128
    q = torch.randn(B, T, H, D, dtype=dtype, device=device)
    k = torch.randn(B, T, H, D, dtype=dtype, device=device)
    v = torch.randn(B, T, H, D, dtype=dtype, device=device)
    g = torch.randn(B, T, H, D, dtype=dtype, device=device)
    beta = torch.rand(B, T, H, dtype=dtype, device=device)
    with torch.inference_mode():
        with pytest.raises(NotImplementedError, match="checkpoint_every_n_tokens"):
            fn(q=q, k=k, v=v, g=g, beta=beta, initial_state=None, output_final_state=True,
               return_intermediate_states=True, disable_recompute=False, state_v_first=True)
