"""Shared pieces of the ported peer tests (python/tests/peer/).

* ``peer_op(name)``: the deltastate function that takes a peer's name. The peer surfaces are the
  target of issue 19 and do not all exist yet; a missing one fails the calling test with a clear
  message (it is not an import error, so every other test of the file still runs).
* ``DEVICES``: "cpu" always, "cuda" when both torch and this deltastate build can run on a GPU.
* ``cpu_len``: the only size trimming the ports do. On CPU tensors a sequence length above
  ``CPU_MAX_T`` (default 64; ``DELTASTATE_PEER_FULL=1`` lifts it) is cut to it so the whole peer
  suite stays within about a minute on two cores; CUDA runs use the peers' sizes unchanged.
* References, rewritten (not copied) from the peers' own torch references so that the ports keep
  the peers' oracles where the peer's oracle is a torch function, and can replace a Triton oracle
  with the peer's torch reference where it is one:

  - ``fla_naive_recurrent_gated_delta_rule`` / ``fla_naive_recurrent_kda``: FLA
    ``fla/ops/gated_delta_rule/naive.py::naive_recurrent_gated_delta_rule`` and
    ``fla/ops/kda/naive.py::naive_recurrent_kda`` (fla-org/flash-linear-attention @ bc3b101d).
    Same arithmetic order, fp32 math, K-first ``[B, HV, K, V]`` states, the same output dtypes
    (GDN: fp32 output; KDA: output in ``v``'s dtype).
  - ``fla_naive_gdn_gate`` / ``fla_naive_kda_gate`` / ``fla_naive_kda_lowerbound_gate``: FLA
    ``fla/ops/gated_delta_rule/gate.py::naive_gdn_gate`` and ``fla/ops/kda/gate.py``.
  - ``fla_assert_close``: FLA ``fla/utils/_testing.py::assert_close`` (relative RMS error below
    ``ratio``; passes outright when the max abs error is <= ``err_atol``); the FLA_CI_ENV
    warn-instead-of-fail branch is not reproduced (these ports always assert).
  - ``sglang_packed_decode_reference``: the inline torch reference of SGLang's
    ``test/registered/kernels/ops/attention/test_kda_helion.py::
    test_packed_decode_lower_bound_contract`` (sgl-project/sglang @ 253bb881), extended to the
    standard softplus gate (softplus as ``x <= 20 ? log(1+e^x) : x``) and to GDN's scalar gate.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import deltastate as ds

FULL = os.environ.get("DELTASTATE_PEER_FULL", "0") == "1"
CPU_MAX_T = 1 << 30 if FULL else int(os.environ.get("DELTASTATE_PEER_CPU_MAX_T", "64"))


def _cuda_ok() -> bool:
    try:
        return bool(torch.cuda.is_available() and ds.cuda_available())
    except Exception:
        return False


DEVICES = ["cpu"] + (["cuda"] if _cuda_ok() else [])
device_param = pytest.mark.parametrize("device", DEVICES)


def cpu_len(n: int, device: str) -> int:
    """The sequence length a port uses: the peer's ``n`` on CUDA, at most CPU_MAX_T on CPU."""
    return n if device != "cpu" else min(n, CPU_MAX_T)


def peer_op(name: str):
    fn = getattr(ds, name, None)
    if fn is None:
        pytest.fail(f"deltastate has no `{name}` (the peer surface this test ports is missing)",
                    pytrace=False)
    return fn


def manual_seed(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


# ---- FLA's assert_close ----------------------------------------------------------------------
def fla_abs_err(x, y) -> float:
    return (x.detach().float() - y.detach().float()).flatten().abs().max().item()


def fla_err_ratio(x, y) -> float:
    d = (x.detach().float() - y.detach().float()).flatten()
    base = x.detach().float().flatten()
    return d.square().mean().sqrt().item() / (base.square().mean().sqrt().item() + 1e-8)


def fla_assert_close(prefix, ref, tri, ratio, err_atol=1e-6):
    abs_err = fla_abs_err(ref, tri)
    rel = fla_err_ratio(ref, tri)
    msg = f"{prefix:>16} diff: {abs_err:.6f} ratio: {rel:.6f}"
    if abs_err <= err_atol:
        return
    assert not torch.isnan(ref).any(), f"{prefix}: NaN detected in ref"
    assert not torch.isnan(tri).any(), f"{prefix}: NaN detected in tri"
    assert rel < ratio, msg


# ---- FLA's naive references (rewritten) -------------------------------------------------------
def fla_naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=None, initial_state=None,
                                         output_final_state=False):
    """q, k, v: [B, T, H, *] (q/k already repeated to v's heads by the caller, as FLA's test
    does); beta, g: [B, T, H]; state K-first [B, H, K, V]. Output fp32 [B, T, H, V]."""
    qf, kf, vf, bf, gf = (x.transpose(1, 2).contiguous().float() for x in (q, k, v, beta, g))
    Bn, Hn, T, Kd = kf.shape
    Vd = vf.shape[-1]
    o = torch.zeros(Bn, Hn, T, Vd, dtype=torch.float32, device=vf.device)
    if initial_state is not None:
        h = initial_state.float()
    else:
        h = torch.zeros(Bn, Hn, Kd, Vd, dtype=torch.float32, device=vf.device)
    if scale is None:
        scale = 1 / (qf.shape[-1] ** 0.5)
    qf = qf * scale
    for t in range(T):
        h = h * gf[:, :, t].exp()[..., None, None]
        u = vf[:, :, t] - (h * kf[:, :, t][..., None]).sum(-2)
        u = u * bf[:, :, t][..., None]
        h = h + kf[:, :, t].unsqueeze(-1) * u.unsqueeze(-2)
        o[:, :, t] = torch.einsum("bhk,bhkv->bhv", qf[:, :, t], h)
    return o.transpose(1, 2).contiguous(), (h if output_final_state else None)


def fla_naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None,
                            output_final_state=False):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] (log space); beta: [B, T, HV];
    state K-first [B, HV, K, V]. Output in v's dtype, final state fp32."""
    out_dtype = v.dtype
    Bn, T, Hn, Kd = q.shape
    HV, Vd = v.shape[2], v.shape[-1]
    G = HV // Hn
    if scale is None:
        scale = Kd ** -0.5
    qf, kf, vf, gf, bf = (x.float() for x in (q, k, v, g, beta))
    qf = qf.repeat_interleave(G, dim=2) * scale
    kf = kf.repeat_interleave(G, dim=2)
    S = torch.zeros(Bn, HV, Kd, Vd, dtype=torch.float32, device=vf.device)
    if initial_state is not None:
        S = S + initial_state.float()
    o = torch.zeros_like(vf)
    for t in range(T):
        S = S * gf[:, t][..., None].exp()
        u = vf[:, t] - (kf[:, t][..., None] * S).sum(-2)
        S = S + torch.einsum("bhk,bhv->bhkv", bf[:, t][..., None] * kf[:, t], u)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", qf[:, t], S)
    return o.to(out_dtype), (S if output_final_state else None)


def fla_naive_gdn_gate(g, A_log, dt_bias=None):
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float()
    return -A_log.float().exp() * F.softplus(x)


def fla_naive_kda_gate(g, A_log, dt_bias=None):
    Hn = g.shape[-2]
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().view(Hn, -1)
    return -A_log.float().view(Hn, 1).exp() * F.softplus(x)


def fla_naive_kda_lowerbound_gate(g, A_log=None, dt_bias=None, lower_bound=-5.0):
    Hn = g.shape[-2]
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().view(Hn, -1)
    if A_log is not None:
        x = A_log.float().view(Hn, 1).exp() * x
    return lower_bound * torch.sigmoid(x)


# ---- SGLang packed-decode reference (rewritten from the Helion test's inline reference) ---------
def _softplus20(x):
    return torch.where(x <= 20.0, torch.log1p(torch.exp(torch.clamp(x, max=20.0))), x)


def sglang_packed_decode_reference(mixed_qkv, a, b, A_log, dt_bias, scale, state, indices, *,
                                   is_kda, use_qk_l2norm_in_kernel=True, lower_bound=None,
                                   out_dtype=None):
    """One packed decode step in fp32 torch. ``state`` (the pool [S, HV, V, K]) is updated in place
    (stored rounded to its dtype); returns ``out`` [B, 1, HV, V] (zeros for rows with index < 0),
    in ``out_dtype`` (default mixed_qkv's)."""
    B = mixed_qkv.shape[0]
    HV, Vd, Kd = state.shape[1:]
    Hn = (mixed_qkv.shape[1] - HV * Vd) // (2 * Kd)
    q, k, v = mixed_qkv.float().split([Hn * Kd, Hn * Kd, HV * Vd], dim=-1)
    q = q.reshape(B, Hn, Kd)
    k = k.reshape(B, Hn, Kd)
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q.repeat_interleave(HV // Hn, dim=1)
    k = k.repeat_interleave(HV // Hn, dim=1)
    v = v.reshape(B, HV, Vd)
    A = torch.exp(A_log.float()).view(1, HV, 1)
    if is_kda:
        x = a.float().reshape(B, HV, Kd) + dt_bias.float().reshape(1, HV, Kd)
    else:
        x = (a.float().reshape(B, HV) + dt_bias.float().reshape(1, HV)).unsqueeze(-1)
    if lower_bound is not None:
        decay = torch.exp(lower_bound * torch.sigmoid(A * x))
    else:
        decay = torch.exp(-A * _softplus20(x))
    beta = torch.sigmoid(b.float())
    out = torch.zeros(B, 1, HV, Vd, dtype=out_dtype or mixed_qkv.dtype, device=mixed_qkv.device)
    for n, idx in enumerate(indices.tolist()):
        if idx < 0:
            continue
        S = state[idx].float()
        S = S * decay[n][:, None, :]
        r = (v[n] - (S * k[n][:, None, :]).sum(-1)) * beta[n][:, None]
        S = S + r[..., None] * k[n][:, None, :]
        out[n, 0] = (S * (q[n] * scale)[:, None, :]).sum(-1)
        state[idx] = S
    return out


# ---- signature checks ---------------------------------------------------------------------------
P = "POSITIONAL_OR_KEYWORD"
KW = "KEYWORD_ONLY"
class _NoDefault:
    def __repr__(self):
        return "<required>"


NO_DEFAULT = _NoDefault()


def check_signature(fn, expected, *, extra_keyword_only_ok=True):
    """``expected``: the peer's parameters in order as (name, kind, default) with kind P or KW and
    NO_DEFAULT for a required one. The deltastate function must have exactly these first, in this
    order, kinds and defaults; further keyword-only parameters (deltastate's own options) are
    accepted when ``extra_keyword_only_ok``; ``**kwargs`` too."""
    import inspect

    params = list(inspect.signature(fn).parameters.values())
    got = [(p.name, p.kind.name, NO_DEFAULT if p.default is p.empty else p.default)
           for p in params if p.kind.name != "VAR_KEYWORD"]
    head = got[:len(expected)]
    want = [(n, k, d) for n, k, d in expected]
    assert [x[0] for x in head] == [x[0] for x in want], (
        f"parameter names/order differ:\n  peer:       {[x[0] for x in want]}\n"
        f"  deltastate: {[x[0] for x in got]}")
    assert [x[1] for x in head] == [x[1] for x in want], (
        "parameter kinds differ: " + str([(a[0], a[1], b[1]) for a, b in zip(head, want)
                                          if a[1] != b[1]]))
    bad = [(a[0], a[2], b[2]) for a, b in zip(head, want)
           if not (a[2] is b[2] or (a[2] is not NO_DEFAULT and b[2] is not NO_DEFAULT
                                    and type(a[2]) is type(b[2]) and a[2] == b[2]))]
    assert not bad, f"defaults differ (name, deltastate, peer): {bad}"
    extra = got[len(expected):]
    if extra_keyword_only_ok:
        assert all(k == KW for _, k, _ in extra), (
            f"deltastate's additional parameters must be keyword-only: {extra}")
    else:
        assert not extra, f"unexpected additional parameters: {extra}"
