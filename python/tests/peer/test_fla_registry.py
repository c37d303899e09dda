"""FLA's own op tests, run through FLA's backend registry with deltastate registered.

The functions under test are FLA's (fla-core 0.6.0): ``fla.ops.gated_delta_rule.
chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` and ``fla.ops.kda.chunk_kda`` /
``fused_recurrent_kda``, called as FLA's tests call them; FLA's registry dispatches them to
deltastate (:mod:`deltastate.integrations.fla`), and each test asserts that deltastate ran.

Sources (fla-org/flash-linear-attention @ bc3b101dcb713ddc5bd8924b66754eb68b5ccf89):
  * tests/ops/test_gdn.py: test_fused_recurrent, test_chunk, test_chunk_state_v_first,
    test_chunk_varlen.
  * tests/ops/test_kda.py: test_fused_recurrent, test_chunk, test_chunk_varlen.

What changed in the port:
  * Forward only: FLA's tests also run backward; deltastate is forward-only (its verifier hands
    autograd calls back to FLA, which test_autograd_goes_to_fla checks), so the calls run under
    ``torch.no_grad()`` and only FLA's ``o`` / ``ht`` assertions (its ratios) are kept.
  * Oracles: FLA's naive references from the installed fla package (pure torch), as FLA's tests.
    test_chunk_state_v_first's oracle is FLA's K-first call, also through the registry.
  * Trim: on CPU tensors T is cut to 64 (varlen: each sequence to at most 64 tokens), see
    _peer_common.cpu_len; DELTASTATE_PEER_FULL=1 restores FLA's lengths.
  * Device: CPU, and CUDA when available. On CUDA FLA's default K-first state is handed back to
    FLA's Triton by the verifier, so there the test passes the state V-first
    (``state_v_first=True``, the test transposes) to run deltastate; FLA's oracle is unchanged.
  * A subset of FLA's parameter rows (named in each parametrization), to keep CI short; the KDA
    rows with ``use_gate_in_kernel`` take FLA's shapes of A_log / dt_bias.
"""

import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("fla") is None or importlib.util.find_spec("einops") is None:
    pytest.skip("fla-core / einops not installed: FLA registry tests SKIPPED "
                "(pip install fla-core==0.6.0 einops)", allow_module_level=True)
try:
    import fla.backends  # noqa: F401 - fla-core 0.6's registry (it needs triton importable)
except ImportError as e:
    pytest.skip(f"fla-core 0.6 not importable ({e}): FLA registry tests SKIPPED",
                allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

import deltastate.integrations.fla as dsfla  # noqa: E402
from _peer_common import DEVICES, cpu_len, fla_assert_close  # noqa: E402

dsfla.register()

from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: E402,E501
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule  # noqa: E402
from fla.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: E402
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate  # noqa: E402
from fla.ops.kda.naive import naive_recurrent_kda  # noqa: E402

device_param = pytest.mark.parametrize("device", DEVICES)


@pytest.fixture
def ran(ds_op_calls):
    return ds_op_calls


def _repeat(x, g):
    return x.repeat_interleave(g, dim=2)


def _call(fn, device, **kw):
    """FLA's call; on CUDA with the state passed V-first (see the module docstring)."""
    with torch.no_grad():
        if device != "cuda" or kw.get("state_v_first"):
            return fn(**kw)
        if kw.get("initial_state") is not None:
            kw["initial_state"] = kw["initial_state"].transpose(-1, -2).contiguous()
        kw["state_v_first"] = True  # the caller's K-first (False or absent), passed V-first
        o, ht = fn(**kw)
        return o, (None if ht is None else ht.transpose(-1, -2))


def _cut_cu(cu, device):
    """Each sequence of cu_seqlens cut to at most cpu_len tokens (CPU), same count."""
    lens = [min(b - a, cpu_len(b - a, device)) for a, b in zip(cu[:-1], cu[1:])]
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


# ---- test_gdn.py::test_fused_recurrent (rows 1, 3, 5 of FLA's table) ---------------------------
@device_param
@pytest.mark.parametrize(("B", "T", "H", "HV", "D", "scale", "gate_logit_normalizer", "dtype"), [
    (1, 63, 1, 1, 64, 1, 1, torch.float),
    (2, 1000, 2, 8, 128, 1, 0.1, torch.float),
    (4, 2048, 4, 4, 64, 0.1, 1, torch.float),
])
def test_gdn_fused_recurrent(ran, device, B, T, H, HV, D, scale, gate_logit_normalizer, dtype):
    T = cpu_len(T, device)
    torch.manual_seed(42)
    q = torch.randn(B, T, H, D, dtype=torch.float32)
    k = torch.randn(B, T, H, D, dtype=torch.float32)
    v = torch.randn(B, T, HV, D, dtype=dtype)
    beta = torch.rand(B, T, HV, dtype=dtype).sigmoid()
    g = F.logsigmoid(torch.rand(B, T, HV, dtype=torch.float32)) / gate_logit_normalizer
    h0 = torch.randn(B, HV, D, D, dtype=torch.float32)
    q, k, v, beta, g, h0 = (x.to(device) for x in (q, k, v, beta, g, h0))
    ref, ref_ht = naive_recurrent_gated_delta_rule(
        q=F.normalize(_repeat(q, HV // H), p=2, dim=-1).to(dtype),
        k=F.normalize(_repeat(k, HV // H), p=2, dim=-1).to(dtype),
        v=v, beta=beta, g=g, scale=scale, initial_state=h0, output_final_state=True)
    tri, tri_ht = _call(fused_recurrent_gated_delta_rule, device, q=q, k=k, v=v, beta=beta, g=g,
                        scale=scale, initial_state=h0.clone(), use_qk_l2norm_in_kernel=True,
                        output_final_state=True)
    fla_assert_close("o", ref, tri, 0.002)
    fla_assert_close("ht", ref_ht, tri_ht, 0.002)
    assert ran == {"fused_recurrent_gated_delta_rule": 1}


# ---- test_gdn.py::test_chunk (rows 2, 3, 6, 9, 10 of FLA's table) ------------------------------
@device_param
@pytest.mark.parametrize(
    ("B", "T", "H", "HV", "D", "scale", "gate_logit_normalizer", "mask_p",
     "use_qk_l2norm_in_kernel", "dtype"), [
        (2, 75, 4, 4, 64, 1, 0.01, 0, False, torch.float16),
        (2, 500, 3, 3, 60, 1, 1, 0, False, torch.float16),
        (4, 1024, 4, 4, 128, 0.1, 1, 0, True, torch.float16),
        (2, 256, 2, 4, 64, 1, 1, 0, False, torch.float16),
        (2, 512, 2, 8, 64, 1, 0.1, 0, True, torch.float16),
    ])
def test_gdn_chunk(ran, device, B, T, H, HV, D, scale, gate_logit_normalizer, mask_p,
                   use_qk_l2norm_in_kernel, dtype):
    T = cpu_len(T, device)
    torch.manual_seed(42)
    G = HV // H
    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, HV, D, dtype=dtype)
    beta = torch.rand(B, T, HV, dtype=torch.float).sigmoid()
    g = F.logsigmoid(torch.rand(B, T, HV, dtype=torch.float32)) / gate_logit_normalizer
    g = g * (torch.rand_like(g) > mask_p)
    h0 = torch.zeros(B, HV, D, D, dtype=torch.float32)
    q, k, v, beta, g, h0 = (x.to(device) for x in (q, k, v, beta, g, h0))
    tri, tri_ht = _call(
        chunk_gated_delta_rule, device,
        q=F.normalize(q, p=2, dim=-1) if not use_qk_l2norm_in_kernel else q,
        k=F.normalize(k, p=2, dim=-1) if not use_qk_l2norm_in_kernel else k,
        v=v, g=g, beta=beta, scale=scale, initial_state=h0.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    ref, ref_ht = naive_recurrent_gated_delta_rule(
        q=F.normalize(_repeat(q, G), p=2, dim=-1), k=F.normalize(_repeat(k, G), p=2, dim=-1),
        v=v, beta=beta, g=g, scale=scale, output_final_state=True, initial_state=h0)
    fla_assert_close("o", ref, tri, 0.005)
    fla_assert_close("ht", ref_ht, tri_ht, 0.005)
    assert ran == {"chunk_gated_delta_rule": 1}


# ---- test_gdn.py::test_chunk_state_v_first (rows 1, 2, 4 of FLA's table) -----------------------
@device_param
@pytest.mark.parametrize(("B", "T", "H", "D", "scale", "gate_logit_normalizer", "dtype"), [
    (1, 63, 1, 64, 1, 1, torch.float),
    (2, 500, 4, 60, 1, 1, torch.float),
    (3, 1024, 2, 128, 0.1, 1, torch.float),
])
def test_gdn_chunk_state_v_first(ran, device, B, T, H, D, scale, gate_logit_normalizer, dtype):
    T = cpu_len(T, device)
    torch.manual_seed(42)
    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, H, D, dtype=dtype)
    beta = torch.rand(B, T, H, dtype=dtype).sigmoid()
    g = F.logsigmoid(torch.rand(B, T, H, dtype=torch.float32)) / gate_logit_normalizer
    h0_kv = torch.randn(B, H, D, D, dtype=torch.float32)
    h0_vk = h0_kv.transpose(-1, -2).contiguous()
    q, k, v, beta, g, h0_kv, h0_vk = (x.to(device) for x in (q, k, v, beta, g, h0_kv, h0_vk))
    common = dict(q=F.normalize(q, p=2, dim=-1), k=F.normalize(k, p=2, dim=-1), v=v, g=g,
                  beta=beta, scale=scale, output_final_state=True)
    tri, tri_ht = _call(chunk_gated_delta_rule, device, initial_state=h0_vk.clone(),
                        state_v_first=True, **common)
    ref, ref_ht = _call(chunk_gated_delta_rule, device, initial_state=h0_kv.clone(),
                        state_v_first=False, **common)
    fla_assert_close("o", ref, tri, 1e-4)
    fla_assert_close("ht", ref_ht, tri_ht.transpose(-1, -2), 1e-4)
    assert ran == {"chunk_gated_delta_rule": 2}


# ---- test_gdn.py::test_chunk_varlen (rows 1, 2, 4, 6 of FLA's table) ---------------------------
@device_param
@pytest.mark.parametrize(("H", "HV", "D", "mask_p", "cu_seqlens", "dtype"), [
    (4, 4, 60, 0, [0, 15], torch.float16),
    (4, 4, 64, 0, [0, 256, 500, 1000], torch.float16),
    (4, 4, 100, 0, [0, 15, 100, 300, 1200, 2000], torch.float16),
    (2, 8, 64, 0, [0, 256, 500, 1000], torch.float16),
])
def test_gdn_chunk_varlen(ran, device, H, HV, D, mask_p, cu_seqlens, dtype):
    torch.manual_seed(42)
    G = HV // H
    cu = _cut_cu(cu_seqlens, device)
    T, N = cu[-1], len(cu) - 1
    q = torch.randn((1, T, H, D), dtype=dtype)
    k = F.normalize(torch.randn(1, T, H, D, dtype=torch.float32), p=2, dim=-1).to(dtype)
    v = torch.randn((1, T, HV, D), dtype=dtype)
    g = F.logsigmoid(torch.rand(1, T, HV, dtype=dtype))
    g = g * (torch.rand_like(g) > mask_p)
    beta = torch.rand(1, T, HV, dtype=torch.float).sigmoid()
    h0 = torch.randn((N, HV, D, D), dtype=dtype)
    q, k, v, beta, g, h0 = (x.to(device) for x in (q, k, v, beta, g, h0))
    cu_t = torch.LongTensor(cu).to(device)
    tri, tri_ht = _call(chunk_gated_delta_rule, device, q=q, k=k, v=v, beta=beta, g=g,
                        initial_state=h0.clone(), output_final_state=True, cu_seqlens=cu_t)
    ref, ref_ht = [], []
    for i in range(N):
        s = slice(cu[i], cu[i + 1])
        r, rh = naive_recurrent_gated_delta_rule(
            q=_repeat(q[:, s], G), k=_repeat(k[:, s], G), v=v[:, s], beta=beta[:, s], g=g[:, s],
            initial_state=h0[i], output_final_state=True)
        ref.append(r)
        ref_ht.append(rh)
    fla_assert_close("o", torch.cat(ref, 1), tri, 0.005)
    fla_assert_close("ht", torch.cat(ref_ht, 0), tri_ht, 0.005)
    assert ran == {"chunk_gated_delta_rule": 1}


# ---- test_kda.py::test_fused_recurrent (rows of FLA's table: 1, 3, 5) --------------------------
@device_param
@pytest.mark.parametrize(("B", "T", "H", "HV", "D", "scale", "gate_logit_normalizer", "dtype"), [
    (1, 64, 1, 1, 64, 1, 1, torch.float),
    (2, 100, 2, 4, 60, 0.1, 1, torch.float),
    (4, 2048, 4, 4, 64, 0.1, 1, torch.float),
])
def test_kda_fused_recurrent(ran, device, B, T, H, HV, D, scale, gate_logit_normalizer, dtype):
    T = cpu_len(T, device)
    torch.manual_seed(42)
    q = torch.rand(B, T, H, D, dtype=dtype)
    k = torch.rand(B, T, H, D, dtype=dtype)
    v = torch.rand(B, T, HV, D, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, D, dtype=torch.float)) / gate_logit_normalizer
    beta = torch.randn(B, T, HV, dtype=dtype).sigmoid()
    h0 = torch.randn(B, HV, D, D, dtype=torch.float32)
    q, k, v, g, beta, h0 = (x.to(device) for x in (q, k, v, g, beta, h0))
    ref, ref_ht = naive_recurrent_kda(
        q=F.normalize(_repeat(q, HV // H), p=2, dim=-1), k=F.normalize(_repeat(k, HV // H), p=2,
                                                                      dim=-1),
        v=v, g=g, beta=beta, scale=scale, initial_state=h0, output_final_state=True)
    tri, tri_ht = _call(fused_recurrent_kda, device, q=F.normalize(q, p=2, dim=-1),
                        k=F.normalize(k, p=2, dim=-1), v=v, g=g, beta=beta, scale=scale,
                        initial_state=h0.clone(), output_final_state=True)
    fla_assert_close("o", ref, tri, 0.005)
    fla_assert_close("ht", ref_ht, tri_ht, 0.005)
    assert ran == {"fused_recurrent_kda": 1}


# ---- test_kda.py::test_chunk (rows 1, 2, 6, 7, 9, 12, 13 of FLA's table) ----------------------
@device_param
@pytest.mark.parametrize(
    ("B", "T", "H", "HV", "D", "scale", "gate_logit_normalizer", "mask_p",
     "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "dtype", "safe_gate"), [
        (1, 63, 1, 1, 64, 1, 1, 0, False, False, torch.float16, True),
        (2, 500, 3, 3, 60, 1, 1, 0, False, False, torch.float16, True),
        (4, 1024, 4, 4, 128, 0.1, 1, 0, True, False, torch.float16, True),
        (2, 1500, 4, 4, 128, 0.1, 10, 0, False, True, torch.float16, False),
        (2, 1024, 2, 4, 64, 0.1, 1, 0, False, False, torch.float16, False),
        (2, 160, 2, 4, 64, 0.1, 1, 0, False, True, torch.float16, True),
        (2, 1024, 2, 4, 64, 0.1, 1, 0, True, True, torch.bfloat16, True),
    ])
def test_kda_chunk(ran, device, B, T, H, HV, D, scale, gate_logit_normalizer, mask_p,
                   use_qk_l2norm_in_kernel, use_gate_in_kernel, dtype, safe_gate):
    T = cpu_len(T, device)
    torch.manual_seed(42)
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
        gate_fn = naive_kda_lowerbound_gate
    else:
        lower_bound = None
        gate_fn = naive_kda_gate
    beta = torch.randn(B, T, HV, dtype=dtype).sigmoid()
    h0 = torch.randn(B, HV, D, D, dtype=torch.float32)
    if use_gate_in_kernel:
        A_log, dt_bias = A_log.to(device), dt_bias.to(device)
    q, k, v, g, beta, h0 = (x.to(device) for x in (q, k, v, g, beta, h0))
    G = HV // H
    ref_g = gate_fn(g, A_log, dt_bias) if use_gate_in_kernel else g
    ref, ref_ht = naive_recurrent_kda(
        q=F.normalize(_repeat(q, G), p=2, dim=-1), k=F.normalize(_repeat(k, G), p=2, dim=-1),
        v=v, g=ref_g, beta=beta, scale=scale, initial_state=h0, output_final_state=True)
    tri, tri_ht = _call(
        chunk_kda, device,
        q=F.normalize(q, p=2, dim=-1) if not use_qk_l2norm_in_kernel else q,
        k=F.normalize(k, p=2, dim=-1) if not use_qk_l2norm_in_kernel else k,
        v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
        initial_state=h0.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        safe_gate=safe_gate, lower_bound=lower_bound)
    fla_assert_close("o", ref, tri, 0.005)
    fla_assert_close("ht", ref_ht, tri_ht, 0.005)
    assert ran == {"chunk_kda": 1}


# ---- test_kda.py::test_chunk_varlen (rows 1, 3, 4 of FLA's table) ------------------------------
@device_param
@pytest.mark.parametrize(("H", "D", "mask_p", "cu_seqlens", "dtype", "use_gate_in_kernel"), [
    (4, 60, 0.1, [0, 15], torch.float16, True),
    (4, 128, 0.5, [0, 256, 500, 1000], torch.float16, False),
    (4, 100, 0, [0, 15, 100, 300, 1200, 2000], torch.float16, True),
])
def test_kda_chunk_varlen(ran, device, H, D, mask_p, cu_seqlens, dtype, use_gate_in_kernel):
    torch.manual_seed(42)
    cu = _cut_cu(cu_seqlens, device)
    T, N = cu[-1], len(cu) - 1
    q = torch.randn((1, T, H, D), dtype=dtype)
    k = F.normalize(torch.randn(1, T, H, D, dtype=torch.float32), p=2, dim=-1).to(dtype)
    v = torch.randn((1, T, H, D), dtype=dtype)
    g = torch.randn(1, T, H, D, dtype=torch.float if not use_gate_in_kernel else dtype)
    A_log = dt_bias = None
    if use_gate_in_kernel:
        A_log = torch.log(torch.randn(1, 1, H, 1, dtype=torch.float32).uniform_(1, 16))
        dt_bias = torch.randn(H * D, dtype=torch.float32)
    else:
        g = F.logsigmoid(g)
        g = g * (torch.rand_like(g) > mask_p)
    mask = torch.rand_like(g) > mask_p
    g = g * mask + (~mask) * (-1000)
    beta = torch.rand(1, T, H, dtype=dtype).sigmoid()
    h0 = torch.randn((N, H, D, D), dtype=torch.float32)
    q, k, v, g, beta, h0 = (x.to(device) for x in (q, k, v, g, beta, h0))
    if use_gate_in_kernel:
        A_log, dt_bias = A_log.to(device), dt_bias.to(device)
    cu_t = torch.LongTensor(cu).to(device)
    tri, tri_ht = _call(chunk_kda, device, q=F.normalize(q, p=2, dim=-1), k=k, v=v, g=g,
                        beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0.clone(),
                        output_final_state=True, cu_seqlens=cu_t, cu_seqlens_cpu=cu_t.cpu(),
                        use_gate_in_kernel=use_gate_in_kernel, chunk_size=64)
    ref, ref_ht = [], []
    for i in range(N):
        s = slice(cu[i], cu[i + 1])
        gi = (naive_kda_gate(g[:, s].to(torch.float), A_log.to(torch.float),
                             dt_bias.to(torch.float)) if use_gate_in_kernel else g[:, s])
        r, rh = naive_recurrent_kda(q=F.normalize(q[:, s], p=2, dim=-1), k=k[:, s], v=v[:, s],
                                    beta=beta[:, s], g=gi, initial_state=h0[i],
                                    output_final_state=True)
        ref.append(r)
        ref_ht.append(rh)
    fla_assert_close("o", torch.cat(ref, 1), tri, 0.005)
    fla_assert_close("ht", torch.cat(ref_ht, 0), tri_ht, 0.005)
    assert ran == {"chunk_kda": 1}


# ---- the registry itself (not FLA tests) -------------------------------------------------------
def _small(device="cpu", requires_grad=False):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 16, device=device) for _ in range(3))
    g = F.logsigmoid(torch.rand(1, 5, 2, device=device))
    beta = torch.rand(1, 5, 2, device=device)
    if requires_grad:
        q.requires_grad_()
    return q, k, v, g, beta


def test_autograd_goes_to_fla():
    q, k, v, g, beta = _small(requires_grad=True)
    assert dsfla.unsupported("chunk_gated_delta_rule", q, k, v, g, beta) == (
        "deltastate implements the forward pass only (an input requires grad)")
    with torch.no_grad():
        assert dsfla.unsupported("chunk_gated_delta_rule", q, k, v, g, beta) is None


def test_verifier_reasons():
    q, k, v, g, beta = _small()
    gv = torch.zeros(1, 5, 2, 16)
    assert dsfla.unsupported("fused_recurrent_gated_delta_rule", q, k, v, g, gv=gv,
                             beta=beta) == (
        "gv (a per-value-channel decay) is not supported by deltastate")
    assert dsfla.unsupported("chunk_gated_delta_rule", q, k, v, g, beta.unsqueeze(-1).expand(
        1, 5, 2, 16)) == "a per-value-channel beta [B, T, HV, V] is not supported by deltastate"
    assert dsfla.unsupported("chunk_kda", q, k, v, g.unsqueeze(-1).expand(1, 5, 2, 16), beta,
                             return_intermediate_states=True) == (
        "return_intermediate_states is not implemented in deltastate")
    assert dsfla.unsupported("chunk_gated_delta_rule", q, k, v, g, beta, cp_context=object()) == (
        "context parallelism (cp_context) is not implemented in deltastate")
    assert dsfla.unsupported("fused_recurrent_kda_fwd", q, k, v, g, beta, inplace_final_state=True,
                             initial_state=torch.zeros(1, 2, 16, 16)).startswith(
        "the pooled in-place form (inplace_final_state=True)")
    with pytest.raises(ValueError, match="no FLA entry point named 'chunk_x'"):
        dsfla.unsupported("chunk_x", q)


@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA device")
def test_k_first_on_cuda_goes_to_fla():
    q, k, v, g, beta = _small("cuda")
    h0 = torch.zeros(1, 2, 16, 16, device="cuda")
    assert dsfla.unsupported("chunk_gated_delta_rule", q, k, v, g, beta, initial_state=h0).startswith(
        "a K-first state [N, HV, K, V] (FLA's default) on CUDA tensors")
    assert dsfla.unsupported("chunk_gated_delta_rule", q, k, v, g, beta, initial_state=h0,
                             state_v_first=True) is None


def test_kill_switch(ran, monkeypatch):
    """FLA_DELTASTATE=0 hands every call back to FLA's own kernel (Triton: fails on a CPU)."""
    q, k, v, g, beta = _small()
    monkeypatch.setenv("FLA_DELTASTATE", "0")
    with torch.no_grad(), pytest.raises(Exception):
        chunk_gated_delta_rule(q, k, v, g, beta)
    assert ran == {}
    monkeypatch.setenv("FLA_DELTASTATE", "1")
    with torch.no_grad():
        chunk_gated_delta_rule(q, k, v, g, beta)
    assert ran == {"chunk_gated_delta_rule": 1}


def test_register_is_idempotent_and_rebinds():
    import fla.ops.gated_delta_rule as gdr

    dsfla.register()
    assert dsfla.is_registered()
    assert gdr.fused_recurrent_gated_delta_rule is fused_recurrent_gated_delta_rule
    assert gdr.fused_recurrent_gdn is fused_recurrent_gated_delta_rule
    assert os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") != "1"


def test_strided_head_vectors_run_as_fla_runs_them(ran):
    """FLA makes every input contiguous before its kernels (its input_guard), so q, k, v, g, beta
    whose head vectors are strided (a view transformers' torch path passes, last-dim stride 8)
    are valid calls: deltastate takes them, with the same outputs as the contiguous call."""
    q, k, v, g, beta = _small()
    strided = [x.transpose(-1, -2).contiguous().transpose(-1, -2) if x.dim() == 4 else x
               for x in (q, k, v)]
    assert strided[0].stride(-1) != 1
    with torch.no_grad():
        o_ref, s_ref = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
        o, s = chunk_gated_delta_rule(*strided, g, beta, output_final_state=True)
    assert ran == {"chunk_gated_delta_rule": 2}
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
