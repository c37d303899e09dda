"""The drop-in rules of issue 19 that the ported peer tests (python/tests/peer/) do not pin: one
beta rule (ReplaySSM equals plain decode over 256 steps with equal options), the exact default k
ring, `scale=None` everywhere, strided index tensors in every op, FLA's `g`/`gk`/`gv`/`beta`
forms, FlashInfer's allocation and prefill options, the Helion twin's texts, dtypes printed as the
caller's framework does, and the mode/tuning keywords of ReplaySSM. CPU tensors always; CUDA
tensors too when a GPU and a CUDA build are present."""

import re

import numpy as np
import pytest

import deltastate as ds
from helpers import torch

pytestmark = pytest.mark.skipif(torch is None, reason="needs torch")

DEVICES = ["cpu"] + (["cuda"] if torch is not None and torch.cuda.is_available()
                     and ds.cuda_available() else [])
device_param = pytest.mark.parametrize("device", DEVICES)


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- 8, 9: one beta rule; the default k ring is exact ------------------------------------------
@device_param
@pytest.mark.parametrize("round_beta", [False, True], ids=["fp32-beta", "rounded-beta"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_replayssm_equals_plain_decode_over_256_steps(device, kda, round_beta):
    """With the same beta option, ReplaySSM over a default StatePool (fp32 checkpoint, fp32 d ring,
    the default k ring) equals packed decode to 1e-6 relative over 256 steps: every output and
    every checkpoint at a flush (natural and forced). fp32 activations, b in bf16 (where rounding
    beta to b's dtype changes beta)."""
    B, H, HV, K, V, L = 3, 2, 4, 32, 32, 8
    g = gen(1)
    pool = ds.StatePool(layers=1, slots=B, HV=HV, V=V, K=K, replay_len=L, H=H, kda=kda,
                        device=device)
    assert pool.k_cache(0).dtype == torch.float32  # the exact default
    rows = [pool.allocate() for _ in range(B)]
    idx = torch.tensor(rows, dtype=torch.int32, device=device)
    state = pool.layer_state(0)
    plain = torch.zeros(B, HV, V, K, device=device)
    A_log = (torch.randn(HV, generator=g) * 0.3).to(device)
    dt = (torch.randn(HV * K if kda else HV, generator=g) * 0.1).to(device)
    wp = torch.zeros(B, dtype=torch.int32, device=device)
    packed = (ds.fused_recurrent_kda_packed_decode if kda
              else ds.fused_recurrent_gated_delta_rule_packed_decode)
    flushes = 0
    for step in range(256):
        x = torch.randn(B, 2 * H * K + HV * V, generator=g).to(device)
        a = torch.randn(B, HV * K if kda else HV, generator=g).to(device)
        b = torch.randn(B, HV, generator=g).to(torch.bfloat16).to(device)
        ff = (torch.rand(B, generator=g) < 0.05).to(torch.int32).to(device)
        want = torch.empty(B, 1, HV, V, device=device)
        got = torch.empty_like(want)
        packed(x, a, b, A_log, dt, None, plain, want, idx, True, round_beta=round_beta)
        ds.fused_recurrent_linear_replayssm_decode(
            x, a.reshape(B, HV, K) if kda else a, b, A_log, dt.reshape(HV, K) if kda else dt,
            None, state, pool.d_cache(0), pool.k_cache(0), pool.g_cache(0), got, idx, wp, ff,
            None, True, kda, round_beta=round_beta)
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel <= 1e-6, f"out, step {step}: {rel:.3g} relative"
        flushed = ((wp == L - 1) | (ff != 0)).tolist()
        for n, s in enumerate(rows):
            if flushed[n]:
                flushes += 1
                rel = ((state[s] - plain[n]).abs().max() / plain[n].abs().max()).item()
                assert rel <= 1e-6, f"checkpoint, step {step}: {rel:.3g} relative"
        wp = torch.where(torch.tensor(flushed, device=device), torch.zeros_like(wp), wp + 1)
    assert flushes >= B * (256 // L)


@device_param
def test_every_op_takes_round_beta(device):
    """`round_beta` is the same keyword, with the same default (False: fp32 beta), on every op."""
    import inspect

    for name in ("fused_recurrent_gated_delta_rule_packed_decode",
                 "fused_recurrent_kda_packed_decode", "recurrent_kda", "recurrent_gated_delta_rule",
                 "fused_recurrent_gated_delta_rule", "fused_recurrent_kda",
                 "fused_recurrent_linear_replayssm_decode",
                 "helion_fused_recurrent_kda_replayssm_decode"):
        p = inspect.signature(getattr(ds, name)).parameters["round_beta"]
        assert p.default is False and p.kind is p.KEYWORD_ONLY, name
    # And it changes beta: a bf16 b whose sigmoid bf16 does not hold exactly.
    q = torch.zeros(1, 1, 1, 16, device=device)
    k = torch.zeros(1, 1, 1, 16, device=device)
    k[..., 0] = 1.0
    v = torch.zeros(1, 1, 1, 16, device=device)
    v[..., 0] = 1.0
    g = torch.zeros(1, 1, 1, device=device)
    b = torch.full((1, 1, 1), 0.5, dtype=torch.bfloat16, device=device)
    finals = []
    for rb in (False, True):
        _, fin = ds.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=b, output_final_state=True,
                                                     use_beta_sigmoid_in_kernel=True,
                                                     state_v_first=True, round_beta=rb)
        finals.append(fin[0, 0, 0, 0].item())
    s = torch.sigmoid(torch.tensor(0.5)).item()
    assert abs(finals[0] - s) < 1e-7
    assert finals[1] == torch.sigmoid(b.float()).to(torch.bfloat16).float().item() != finals[0]


# ---- 6: scale=None is K^-0.5 in every op --------------------------------------------------------
def _packed_inputs(device, kda, seed=3, B=3, H=2, HV=4, K=16, V=8):
    g = gen(seed)
    x = torch.randn(B, 2 * H * K + HV * V, generator=g).to(device)
    a = torch.randn(B, HV * K if kda else HV, generator=g).to(device)
    b = torch.randn(B, HV, generator=g).to(device)
    A_log = (torch.randn(HV, generator=g) * 0.3).to(device)
    dt = (torch.randn(HV * K if kda else HV, generator=g) * 0.1).to(device)
    st = (torch.randn(5, HV, V, K, generator=g) * 0.1).to(device)
    return x, a, b, A_log, dt, st, (B, H, HV, K, V)


@device_param
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_scale_none_is_k_to_the_minus_half(device, kda):
    x, a, b, A_log, dt, st, (B, H, HV, K, V) = _packed_inputs(device, kda)
    op = (ds.fused_recurrent_kda_packed_decode if kda
          else ds.fused_recurrent_gated_delta_rule_packed_decode)
    idx = torch.tensor([4, -1, 0], dtype=torch.int32, device=device)
    outs, states = [], []
    for scale in (None, K ** -0.5):
        s, o = st.clone(), torch.empty(B, 1, HV, V, device=device)
        op(x, a, b, A_log, dt, scale, s, o, idx, True)
        outs.append(o)
        states.append(s)
    assert torch.equal(outs[0], outs[1]) and torch.equal(states[0], states[1])
    # ReplaySSM too.
    L = 2
    outs = []
    for scale in (None, K ** -0.5):
        o = torch.empty(B, 1, HV, V, device=device)
        ds.fused_recurrent_linear_replayssm_decode(
            x, a.reshape(B, HV, K) if kda else a, b, A_log, dt, scale, st.clone(),
            torch.zeros(5, HV, L, V, device=device), torch.zeros(5, H, L, K, device=device),
            torch.zeros((5, HV, L, K) if kda else (5, HV, L), device=device), o, idx,
            torch.zeros(B, dtype=torch.int32, device=device), None, None, True, kda)
        outs.append(o)
    assert torch.equal(outs[0], outs[1])


# ---- 7: strided 1-D index tensors in every op ---------------------------------------------------
@device_param
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_strided_indices_every_op(device, kda):
    """A strided view of a wider index table (as SGLang passes) equals its contiguous copy, in
    packed decode, the recurrent ops (FlashInfer's and FLA's names take none: FlashInfer's) and
    ReplaySSM; the padded row included."""
    x, a, b, A_log, dt, st, (B, H, HV, K, V) = _packed_inputs(device, kda, seed=8)
    table = torch.tensor([3, 9, -1, 9, 0, 9], dtype=torch.int32, device=device)
    strided = table[::2]
    assert not strided.is_contiguous()
    packed = (ds.fused_recurrent_kda_packed_decode if kda
              else ds.fused_recurrent_gated_delta_rule_packed_decode)
    res = []
    for idx in (strided.contiguous(), strided):
        s, o = st.clone(), torch.empty(B, 1, HV, V, device=device)
        packed(x, a, b, A_log, dt, None, s, o, idx, True)
        res.append((o, s))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])

    g = gen(9)
    q = torch.randn(B, 2, H, K, generator=g).to(device)
    k = torch.randn(B, 2, H, K, generator=g).to(device)
    v = torch.randn(B, 2, HV, V, generator=g).to(device)
    gg = -torch.rand((B, 2, HV, K) if kda else (B, 2, HV), generator=g).to(device)
    beta = torch.rand(B, 2, HV, generator=g).to(device)
    rec = ds.recurrent_kda if kda else ds.recurrent_gated_delta_rule
    res = []
    for idx in (strided.contiguous(), strided.to(torch.int64)[::1], strided):
        s = st.clone()
        o, _ = rec(q, k, v, gg, beta, initial_state=s, ssm_state_indices=idx)
        res.append((o, s))
    for o, s in res[1:]:
        assert torch.equal(o, res[0][0]) and torch.equal(s, res[0][1])

    L = 4
    res = []
    for idx in (strided.contiguous(), strided):
        s, o = st.clone(), torch.empty(B, 1, HV, V, device=device)
        rings = (torch.zeros(5, HV, L, V, device=device), torch.zeros(5, H, L, K, device=device),
                 torch.zeros((5, HV, L, K) if kda else (5, HV, L), device=device))
        wp = torch.tensor([1, 0, 3], dtype=torch.int32, device=device)
        ds.fused_recurrent_linear_replayssm_decode(
            x, a.reshape(B, HV, K) if kda else a, b, A_log, dt, None, s, *rings, o, idx, wp,
            None, None, True, kda, advance_write_pos=True)
        res.append((o, s, *rings, wp))
    for u, w in zip(res[0], res[1]):
        assert torch.equal(u, w)


# ---- 2: ReplaySSM's SGLang keywords -------------------------------------------------------------
def _tiny_replay(device, kda=False):
    x, a, b, A_log, dt, st, (B, H, HV, K, V) = _packed_inputs(device, kda, seed=5)
    L = 4
    return dict(
        mixed_qkv=x, a=a.reshape(B, HV, K) if kda else a, b=b, A_log=A_log,
        dt_bias=dt.reshape(HV, K) if kda else dt, scale=None, initial_state=st,
        d_cache=torch.zeros(5, HV, L, V, device=device),
        k_cache=torch.zeros(5, H, L, K, device=device),
        g_cache=torch.zeros((5, HV, L, K) if kda else (5, HV, L), device=device),
        out=torch.empty(B, 1, HV, V, device=device),
        ssm_state_indices=torch.tensor([4, -1, 0], dtype=torch.int32, device=device),
        write_pos=torch.zeros(B, dtype=torch.int32, device=device))


@pytest.mark.parametrize("mode,error", [
    (dict(circular_replay=True),
     "`cache_base` must be a contiguous 1D int32 tensor for circular replay."),
    (dict(predecayed_k_cache=True), "Pre-decayed K requires KDA circular replay with prefix gates."),
    (dict(prefix_gate_cache=True), None),  # GDN: SGLang's kernel ignores prefix gates
    (dict(cache_base="zeros"), None),  # without circular_replay SGLang ignores cache_base
], ids=["circular_replay", "predecayed_k_cache", "prefix_gate_cache", "cache_base"])
def test_replayssm_mode_keywords_follow_sglang(mode, error):
    """SGLang's ring-mode keywords: a mode missing what it needs raises SGLang's ValueError with
    nothing written; a keyword SGLang ignores in that call changes nothing (the ring modes
    themselves: test_replayssm_modes.py)."""
    args, twin = _tiny_replay("cpu"), _tiny_replay("cpu")
    if mode.get("cache_base") == "zeros":
        mode = dict(cache_base=torch.full((3,), 2, dtype=torch.int32))
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    if error is not None:
        with pytest.raises(ValueError) as e:
            ds.fused_recurrent_linear_replayssm_decode(**args, **mode)
        assert str(e.value) == error
        for k, v in before.items():  # nothing written
            assert torch.equal(args[k].nan_to_num(7.0), v.nan_to_num(7.0)), k
        return
    ds.fused_recurrent_linear_replayssm_decode(**args, **mode)
    ds.fused_recurrent_linear_replayssm_decode(**twin, cache_base=None, circular_replay=False,
                                               prefix_gate_cache=False, predecayed_k_cache=False)
    for k in ("out", "initial_state", "d_cache", "k_cache", "g_cache", "write_pos"):
        assert torch.equal(args[k].nan_to_num(7.0), twin[k].nan_to_num(7.0)), k


def test_replayssm_tuning_keywords_ignored_positionally():
    """SGLang's tuning knobs by position (block_v, num_warps, num_stages, nk) change nothing."""
    a1, a2 = _tiny_replay("cpu"), _tiny_replay("cpu")
    head = list(a1.values())
    ds.fused_recurrent_linear_replayssm_decode(*head, None, None, True, False)
    ds.fused_recurrent_linear_replayssm_decode(*list(a2.values()), None, None, True, False, 32, 8,
                                               1, 4)
    assert torch.equal(a1["out"], a2["out"]) and torch.equal(a1["d_cache"], a2["d_cache"])


# ---- 5: the Helion twin's texts; dtypes as the framework prints them ---------------------------
def _helion_case(change):
    args = _tiny_replay("cpu", kda=True)
    change(args)
    return args


HELION_TEXTS = [
    (lambda a: a.update(a=a["a"][:, :, ::2]), "KDA `a` must be a contiguous 2D or 3D tensor."),
    (lambda a: a.update(dt_bias=a["dt_bias"].reshape(1, 4, 16)),
     "KDA `dt_bias` must be a contiguous 1D or 2D tensor."),
    (lambda a: a.update(write_pos=a["write_pos"].long()), "`write_pos` must be a 1D int32 tensor."),
    (lambda a: a.update(write_pos=a["write_pos"][:2]), "`write_pos` must have shape (3,)."),
    (lambda a: a.update(force_flush=torch.zeros(2, dtype=torch.int32)),
     "`force_flush` must be a length-B int32 tensor or None."),
    (lambda a: a.update(d_cache=torch.zeros(5, 4, 4, 9)), "`d_cache` must have shape [slots, HV, L, V]."),
    (lambda a: a.update(k_cache=torch.zeros(5, 2, 3, 16)), "`k_cache` must have shape [slots, H, L, K]."),
    (lambda a: a.update(g_cache=torch.zeros(5, 4, 4)), "`g_cache` must have shape [slots, HV, L, K]."),
    (lambda a: a.update(g_cache=torch.zeros(5, 4, 4, 16, dtype=torch.float16)),
     "`g_cache` must have dtype torch.float32."),
    (lambda a: a.update(mixed_qkv=a["mixed_qkv"][None]),
     "`mixed_qkv` must be a 2D tensor (got ndim=3)."),  # the packed-decode texts
    (lambda a: a.update(A_log=torch.zeros(3)), "`A_log` must have 4 elements (got 3)."),
]


@pytest.mark.parametrize("change,text", HELION_TEXTS,
                         ids=[re.sub(r"\W+", "-", t)[:40] for _, t in HELION_TEXTS])
def test_helion_twin_texts(change, text):
    args = _helion_case(change)
    with pytest.raises(ValueError) as e:
        ds.helion_fused_recurrent_kda_replayssm_decode(**args)
    assert str(e.value) == text


def test_helion_twin_accepts_flat_gate_forms():
    """The Helion twin takes a [B, HV*K] and dt_bias [HV*K] as well as the 3-D / 2-D forms."""
    a3 = _tiny_replay("cpu", kda=True)
    a2 = _tiny_replay("cpu", kda=True)
    a2["a"] = a2["a"].reshape(3, -1)
    a2["dt_bias"] = a2["dt_bias"].reshape(-1)
    r3 = ds.helion_fused_recurrent_kda_replayssm_decode(**a3)
    r2 = ds.helion_fused_recurrent_kda_replayssm_decode(**a2)
    assert r3[0] is a3["out"] and r3[1] is a3["initial_state"]
    assert torch.equal(r2[0], r3[0])


def test_dtypes_printed_as_the_framework_does():
    """A caller's dtype appears as its framework prints it; never as a DLPack code."""
    args = _tiny_replay("cpu")
    args["g_cache"] = args["g_cache"].half()
    with pytest.raises(ValueError, match=r"^`g_cache` must be float32 \(got torch\.float16\)\.$"):
        ds.fused_recurrent_linear_replayssm_decode(**args)
    x, a, b, A_log, dt, st, (B, H, HV, K, V) = _packed_inputs("cpu", False)
    out = torch.empty(B, 1, HV, V)
    idx = torch.tensor([1, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError) as e:
        ds.fused_recurrent_gated_delta_rule_packed_decode(x, a.double(), b, A_log, dt, None, st,
                                                          out, idx)
    assert str(e.value) == ("`a` has dtype torch.float64, which deltastate does not take; `a` "
                            "takes torch.float32, torch.bfloat16 or torch.float16")
    with pytest.raises(ValueError) as e:
        ds.fused_recurrent_gated_delta_rule_packed_decode(x, a, b, A_log, dt, None, st, out,
                                                          idx.float())
    assert str(e.value) == ("`ssm_state_indices` must have dtype torch.int32 or torch.int64; got "
                            "torch.float32")
    n = {k: v.numpy() for k, v in dict(x=x, a=a, b=b, A_log=A_log, dt=dt, st=st).items()}
    with pytest.raises(ValueError) as e:
        ds.fused_recurrent_gated_delta_rule_packed_decode(
            n["x"], n["a"].astype(np.int16), n["b"], n["A_log"], n["dt"], None, n["st"],
            out.numpy(), idx.numpy())
    assert str(e.value) == ("`a` has dtype int16, which deltastate does not take; `a` takes "
                            "float32, bfloat16 or float16")
    assert "DLPack" not in str(e.value) and "\x1f" not in str(e.value)


def test_torch_op_errors_print_torch_dtypes():
    """The torch custom ops (what torch.compile calls) spell dtypes the same way."""
    x, a, b, A_log, dt, st, (B, H, HV, K, V) = _packed_inputs("cpu", False)
    with pytest.raises(ValueError, match=r"got torch\.float32$"):
        torch.ops.deltastate.gdn_packed_decode(x, a, b, A_log, dt, None, st,
                                               torch.empty(B, 1, HV, V),
                                               torch.tensor([0, 1, 2.0]))


# ---- 3: FLA's g / gk / gv / beta forms, keywords, gate parameters --------------------------------
def _fla_inputs(seed=11, B=2, T=5, H=2, HV=4, K=16, V=8):
    g = gen(seed)
    q = torch.randn(B, T, H, K, generator=g)
    k = torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, HV, V, generator=g)
    beta = torch.rand(B, T, HV, generator=g)
    gl = -torch.rand(B, T, HV, generator=g)
    gk = -torch.rand(B, T, HV, K, generator=g) * 0.5
    h0 = torch.randn(B, HV, K, V, generator=g) * 0.1  # K-first, FLA's default
    return q, k, v, beta, gl, gk, h0


def test_fla_gdn_g_none_and_beta_none():
    """g=None: no decay (g = 0); beta=None: ones."""
    q, k, v, beta, gl, gk, h0 = _fla_inputs()
    op = ds.fused_recurrent_gated_delta_rule
    o1, h1 = op(q, k, v, g=None, beta=beta, initial_state=h0, output_final_state=True,
                use_qk_l2norm_in_kernel=True)
    o2, h2 = op(q, k, v, g=torch.zeros_like(gl), beta=beta, initial_state=h0,
                output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    o1, h1 = op(q, k, v, g=gl, initial_state=h0, output_final_state=True,
                use_qk_l2norm_in_kernel=True)
    o2, h2 = op(q, k, v, g=gl, beta=torch.ones_like(beta), initial_state=h0,
                output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)


def test_fla_gdn_gk_is_the_kda_gate():
    """gk alone is KDA's per-K gate; g with gk is the per-K decay g + gk (FLA applies both)."""
    q, k, v, beta, gl, gk, h0 = _fla_inputs()
    gdn, kda = ds.fused_recurrent_gated_delta_rule, ds.fused_recurrent_kda
    o1, h1 = gdn(q, k, v, gk=gk, beta=beta, initial_state=h0, output_final_state=True)
    o2, h2 = kda(q, k, v, gk, beta, initial_state=h0, output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    o1, h1 = gdn(q, k, v, g=gl, gk=gk, beta=beta, initial_state=h0, output_final_state=True)
    o2, h2 = kda(q, k, v, gl[..., None] + gk, beta, initial_state=h0, output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    with pytest.raises(NotImplementedError, match="`gk` with use_gate_in_kernel=True"):
        gdn(q, k, v, g=gl, gk=gk, beta=beta, use_gate_in_kernel=True, A_log=torch.zeros(4))


def test_fla_unsupported_forms_are_clear_errors():
    q, k, v, beta, gl, gk, h0 = _fla_inputs()
    gdn, kda = ds.fused_recurrent_gated_delta_rule, ds.fused_recurrent_kda
    with pytest.raises(NotImplementedError, match="`gv`"):
        gdn(q, k, v, g=gl, gv=torch.zeros_like(v), beta=beta)
    with pytest.raises(NotImplementedError, match=r"per-value-channel `beta` \[B, T, HV, V\]"):
        gdn(q, k, v, g=gl, beta=torch.rand_like(v))
    with pytest.raises(NotImplementedError, match="without `A_log` is supported with `lower_bound`"):
        kda(q, k, v, gk, beta, use_gate_in_kernel=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'ssm_state_indices'"):
        kda(q, k, v, gk, beta, ssm_state_indices=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^`allow_neg_eigval=True` requires"):
        gdn(q, k, v, g=gl, beta=beta, allow_neg_eigval=True)
    with pytest.raises(ValueError, match=r"^`A_log` must be provided when"):
        gdn(q, k, v, g=gl, beta=beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match=r"^`g` \(raw pre-activation\) must be provided"):
        gdn(q, k, v, beta=beta, use_gate_in_kernel=True, A_log=torch.zeros(4))


def test_fla_ignores_gate_parameters_without_the_gate_and_keeps_the_state():
    """FLA drops A_log/dt_bias/lower_bound without use_gate_in_kernel; initial_state is only
    read; the final state is a new float32 state in the caller's layout."""
    q, k, v, beta, gl, gk, h0 = _fla_inputs()
    h0b = h0.to(torch.bfloat16)
    before = h0b.clone()
    o1, h1 = ds.fused_recurrent_kda(q, k, v, gk, beta, A_log=torch.zeros(4), dt_bias=torch.ones(64),
                                    lower_bound=-5.0, initial_state=h0b, output_final_state=True)
    o2, h2 = ds.fused_recurrent_kda(q, k, v, gk, beta, initial_state=h0b, output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    assert torch.equal(h0b, before)
    assert h1.dtype == torch.float32 and tuple(h1.shape) == tuple(h0.shape)
    assert o1.dtype == v.dtype and tuple(o1.shape) == tuple(v.shape)
    # The V-first layout gives the transposed final state from the transposed start.
    o3, h3 = ds.fused_recurrent_kda(q, k, v, gk, beta, initial_state=h0b.transpose(-1, -2)
                                    .contiguous(), output_final_state=True, state_v_first=True)
    torch.testing.assert_close(o3, o2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h3.transpose(-1, -2), h2, atol=1e-6, rtol=1e-6)


def test_fla_k_first_state_of_another_shape_is_rejected_clearly():
    """With K != V the wrong layout is a clear shape error (with K == V both shapes match: the
    caller's flag decides, never a guess)."""
    q, k, v, beta, gl, gk, h0 = _fla_inputs()
    with pytest.raises(ValueError, match=r"`initial_state` must have shape \[slots, HV, K, V\]"):
        ds.fused_recurrent_gated_delta_rule(q, k, v, g=gl, beta=beta,
                                            initial_state=h0.transpose(-1, -2).contiguous())


# ---- 4: FlashInfer's allocation and prefill options ---------------------------------------------
def _fi_inputs(B=3, H=2, D=16, seed=3):
    g = gen(seed)
    q = torch.rand(B, 1, H, D, generator=g)
    k = torch.rand(B, 1, H, D, generator=g)
    v = torch.rand(B, 1, H, D, generator=g)
    gg = torch.nn.functional.logsigmoid(torch.randn(B, 1, H, D, generator=g))
    beta = torch.rand(B, 1, H, generator=g)
    return q, k, v, gg, beta


def test_flashinfer_none_state_without_cu_seqlens_allocates_b_rows():
    q, k, v, g, beta = _fi_inputs()
    o, st = ds.recurrent_kda(q, k, v, g, beta, initial_state=None, output_final_state=True,
                             ssm_state_indices=torch.tensor([7, 0, 2], dtype=torch.int32))
    assert tuple(st.shape) == (3, 2, 16, 16) and st.dtype == torch.bfloat16
    o2, st2 = ds.recurrent_kda(q, k, v, g, beta, initial_state=torch.zeros(3, 2, 16, 16),
                               output_final_state=True)
    torch.testing.assert_close(o, o2)
    torch.testing.assert_close(st.float(), st2, atol=1e-2, rtol=1e-2)
    # numpy: float32 (numpy has no bfloat16), 32-byte aligned (recurrent_kda's stride contract).
    on, stn = ds.recurrent_kda(*(t.numpy() for t in (q, k, v, g, beta)), output_final_state=True)
    assert isinstance(stn, np.ndarray) and stn.dtype == np.float32 and stn.ctypes.data % 32 == 0


def test_flashinfer_source_outside_spec_decode():
    """FlashInfer's initial_state_source runs with num_spec_tokens (the verify op's source pool);
    alone it is FlashInfer's ValueError, in standard decode a NotImplementedError; the state is
    left untouched either way."""
    q, k, v, g, beta = _fi_inputs()
    h0 = torch.zeros(3, 2, 16, 16)
    src, rows = torch.zeros(3, 2, 16, 16), torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="^initial_state_source and initial_state_indices must "
                       "be provided together$"):
        ds.recurrent_kda(q, k, v, g, beta, initial_state=h0, initial_state_source=src)
    with pytest.raises(NotImplementedError, match=r"^recurrent_kda: `initial_state_source` "
                       r"outside speculative decode \(num_spec_tokens=None\)"):
        ds.recurrent_kda(q, k, v, g, beta, initial_state=h0, initial_state_source=src,
                         initial_state_indices=rows)
    assert (h0 == 0).all()


@pytest.mark.parametrize("arg,value", [
    ("seq_order", torch.zeros(1) if torch is not None else None),
    ("prefill_workspace", object()), ("state_checkpoints", torch.zeros(1) if torch else None),
    ("checkpoint_cu_starts", torch.zeros(1) if torch is not None else None),
    ("checkpoint_every_n_tokens", 4)])
def test_flashinfer_unimplemented_options(arg, value):
    q, k, v, g, beta = _fi_inputs()
    h0 = torch.zeros(3, 2, 16, 16)
    with pytest.raises(NotImplementedError, match=rf"^recurrent_kda: `{arg}`="):
        ds.recurrent_kda(q, k, v, g, beta, initial_state=h0, **{arg: value})
    assert (h0 == 0).all()
    for backend in ("auto", "cute-dsl", "cake"):  # FlashInfer's names: accepted, one backend
        ds.recurrent_kda(q, k, v, g, beta, initial_state=torch.zeros(3, 2, 16, 16),
                         backend=backend)
