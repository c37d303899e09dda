"""deltastate's SGLang kernel objects, driven the way SGLang's GDN / KDA attention backends drive
their kernel (python/sglang/srt/layers/attention/linear/gdn_backend.py, kda_backend.py,
kernels/gdn_triton.py, kernels/kda_triton.py, kernels/kernel_backend.py as read at
sgl-project/sglang 0a48af3a / 007d1d93 / 03a4a692): a pool ``[slots, HV, V, K]`` with slot 0
reserved, a prefill (``extend``, varlen with ``query_start_loc``) for requests in scattered
slots, then decode steps of a CUDA-graph-padded batch (index -1) alternating ``decode`` (split
q/k/v views of ``mixed_qkv``) and ``packed_decode``, then speculative rounds as SGLang's EAGLE /
MTP runs them (gdn_backend.py's target-verify branch, hybrid_linear_attn_backend.py's
``update_mamba_state_after_mtp_verify`` as read at sgl-project/sglang 0a48af3a): ``target_verify``
of DRAFT tokens per request into the per-layer scratch ``intermediate_ssm`` (a chain, then an
EAGLE tree through ``retrieve_parent_token``), the pool left unchanged, then the commit of each
request's last accepted step with ``fused_mamba_state_scatter_with_mask`` over the
``[layers, ...]`` pool and scratch, then a decode step from the committed states. Checked every
step against an independent fp64 recurrence written here; the reserved slot, the free slots, the
unused scratch rows and the padded rows' outputs are checked (1e30 sentinels bit-untouched,
zeros). A second test runs SGLang's target-verify branch with deltastate's causal_conv1d_update
in place of SGLang's conv (its reshapes, per-draft windows and EAGLE tree tables), and commits
states and conv windows with SGLang's scatter."""

import inspect

import pytest

torch = pytest.importorskip("torch")

import deltastate  # noqa: E402
from deltastate.integrations.sglang import DeltastateGDNKernel, DeltastateKDAKernel  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and deltastate.cuda_available()
                     else [])
SENTINEL = 1e30
H, HV, K, V = 2, 4, 32, 16  # GVA 2, K != V
SLOTS = 8
LENS = (7, 1, 19)  # prefill lengths
REQ_SLOTS = (3, 5, 2)  # slot 0 is SGLang's reserved dummy slot; 1, 4, 6, 7 stay free
STEPS = 6
DRAFT = 4  # draft tokens per request in a verify (SGLang's speculative_num_draft_tokens)
SPEC = 6  # scratch rows (SGLang's intermediate_ssm has one per running request)
TREE = (-1, 0, 0, 1)  # retrieve_parent_token of one request: token t's parent (-1: the root)


# ---- the independent reference (fp64, one token at a time) -------------------------------------
def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _softplus(x):
    return torch.where(x > 20, x, torch.log1p(torch.exp(x)))


def _step(S, q, k, v, g, beta):
    """One token for one sequence: S [HV, V, K]; q, k [H, K]; v [HV, V]; g [HV] or [HV, K]
    (log decay); beta [HV]. Returns o [HV, V]."""
    rep = HV // H
    q = _l2(q).repeat_interleave(rep, 0) * K ** -0.5
    k = _l2(k).repeat_interleave(rep, 0)
    decay = torch.exp(g)
    S *= decay[:, None, None] if decay.dim() == 1 else decay[:, None, :]
    kv = torch.einsum("hvk,hk->hv", S, k)
    S += beta[:, None, None] * torch.einsum("hv,hk->hvk", v - kv, k)
    return torch.einsum("hvk,hk->hv", S, q)


def _gate(kda, a, A_log, dt_bias, lower_bound=None):
    """SGLang's gate from the raw input: GDN a [.., HV]; KDA a [.., HV*K] -> [.., HV, K]."""
    A = A_log.double().reshape(-1)
    if kda:
        x = a.double().reshape(*a.shape[:-1], HV, K) + dt_bias.double().reshape(HV, K)
        if lower_bound is not None:
            return lower_bound * torch.sigmoid(torch.exp(A)[:, None] * x)
        return -torch.exp(A)[:, None] * _softplus(x)
    return -torch.exp(A) * _softplus(a.double() + dt_bias.double())


# ---- the harness --------------------------------------------------------------------------------
class Layer:
    """One linear-attention layer's parameters and pool, as SGLang's backend holds them."""

    def __init__(self, kda, device, dtype, gen):
        def r(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(device)

        self.kda = kda
        self.A_log = (torch.rand(1, 1, HV, 1, generator=gen) * 2).log().to(device) if kda else \
            (torch.rand(HV, generator=gen) * 2).log().to(device)
        self.dt_bias = r(HV * K if kda else HV, scale=0.5)
        # SGLang's mamba pool holds every layer: temporal [layers, slots, HV, V, K] and the
        # verify scratch intermediate_ssm [layers, spec, draft, HV, V, K]; a layer sees [0].
        self.temporal = torch.full((1, SLOTS, HV, V, K), SENTINEL, device=device)
        self.scratch = torch.full((1, SPEC, DRAFT, HV, V, K), SENTINEL, device=device)
        self.pool = self.temporal[0]
        for s in REQ_SLOTS:  # SGLang's mamba pool zeroes a slot when it allocates it
            self.pool[s].zero_()
        self.ref = {s: torch.zeros(HV, V, K, dtype=torch.float64) for s in REQ_SLOTS}
        self.r, self.dtype = r, dtype


def _qkv(layer, T):
    r = layer.r
    mixed = r(T, 2 * H * K + HV * V).to(layer.dtype)
    a = r(T, HV * K if layer.kda else HV)
    b = r(T, HV)
    return mixed, a, b


def _split(mixed, T):
    q = mixed[:, :H * K].view(1, T, H, K)
    k = mixed[:, H * K:2 * H * K].view(1, T, H, K)
    v = mixed[:, 2 * H * K:].view(1, T, HV, V)
    return q, k, v


def _reference_tokens(layer, slot, mixed, a, b, lower_bound=None):
    T = mixed.shape[0]
    q, k, v = (x[0].double().cpu() for x in _split(mixed, T))
    g = _gate(layer.kda, a.cpu(), layer.A_log.cpu(), layer.dt_bias.cpu(), lower_bound)
    beta = torch.sigmoid(b.double().cpu())
    return torch.stack([_step(layer.ref[slot], q[t], k[t], v[t], g[t], beta[t])
                        for t in range(T)])


def _reference_verify(layer, slot, mixed, a, b, parents):
    """A verify of one request: token t from the state after its parent (the committed state for
    -1); the committed state is not changed. Returns (o [T, HV, V], states [T, HV, V, K])."""
    T = mixed.shape[0]
    q, k, v = (x[0].double().cpu() for x in _split(mixed, T))
    g = _gate(layer.kda, a.cpu(), layer.A_log.cpu(), layer.dt_bias.cpu())
    beta = torch.sigmoid(b.double().cpu())
    outs, states = [], []
    for t in range(T):
        S = (layer.ref[slot] if parents[t] < 0 else states[parents[t]]).clone()
        outs.append(_step(S, q[t], k[t], v[t], g[t], beta[t]))
        states.append(S)
    return torch.stack(outs), torch.stack(states)


def _verify_and_commit(layer, kernel, rows, accepted, tree, atol):
    """One speculative round of a batch (`rows`: slots, -1 padded) as SGLang runs it: the verify
    forward, then the scatter of each request's last accepted step (`accepted`, -1: none)."""
    device = layer.pool.device
    B = len(rows)
    mixed, a, b = _qkv(layer, B * DRAFT)
    q, k, v = _split(mixed, B * DRAFT)
    idx = torch.tensor(rows, dtype=torch.int32, device=device)
    parents = TREE if tree else tuple(range(-1, DRAFT - 1))
    retrieve = (torch.tensor([parents] * B, dtype=torch.int64, device=device) if tree
                else None)  # SGLang passes None for a chain (topk 1)
    before = layer.temporal.clone()
    out = kernel.target_verify(
        A_log=layer.A_log, dt_bias=layer.dt_bias, q=q, k=k, v=v, a=a, b=b,
        ssm_states=layer.pool, cache_indices=idx,
        query_start_loc=torch.arange(0, B * DRAFT + 1, DRAFT, dtype=torch.int32, device=device),
        intermediate_states_buffer=layer.scratch[0],
        intermediate_state_indices=torch.arange(B, dtype=torch.int32, device=device),
        cache_steps=DRAFT, retrieve_parent_token=retrieve)
    assert out.shape == (1, B * DRAFT, HV, V)
    assert torch.equal(layer.temporal, before), "target_verify wrote the pool"
    scratch = layer.scratch[0].cpu()
    states = {}
    for i, s in enumerate(rows):
        got = out[0, i * DRAFT:(i + 1) * DRAFT].double().cpu()
        if s < 0:
            assert torch.equal(got, torch.zeros_like(got)), "padded request's output not zero"
            assert torch.equal(scratch[i], torch.full_like(scratch[i], SENTINEL))
            continue
        sl = slice(i * DRAFT, (i + 1) * DRAFT)
        want, states[s] = _reference_verify(layer, s, mixed[sl], a[sl], b[sl], parents)
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)
        torch.testing.assert_close(scratch[i].double(), states[s], atol=atol, rtol=atol)
    for i in range(B, SPEC):  # scratch rows no request uses
        assert torch.equal(scratch[i], torch.full_like(scratch[i], SENTINEL)), f"row {i} written"

    # -- the commit: update_mamba_state_after_mtp_verify's scatter over every layer --
    deltastate.fused_mamba_state_scatter_with_mask(
        layer.temporal, layer.scratch, idx,
        torch.tensor(accepted, dtype=torch.int64, device=device))
    for s, step in zip(rows, accepted):
        if s >= 0 and step >= 0:
            layer.ref[s] = states[s][step].clone()
    _assert_pool(layer, atol)


def _assert_pool(layer, atol):
    pool = layer.pool.cpu()
    for s in range(SLOTS):
        if s in layer.ref:
            torch.testing.assert_close(pool[s].double(), layer.ref[s], atol=atol, rtol=atol)
        else:  # slot 0 (reserved) and the free slots: bit-untouched
            assert torch.equal(pool[s], torch.full_like(pool[s], SENTINEL)), f"slot {s} written"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_harness_prefill_decode_verify_commit(device, kda):
    gen = torch.Generator().manual_seed(7 + kda)
    dtype = torch.float32
    layer = Layer(kda, device, dtype, gen)
    kernel = DeltastateKDAKernel() if kda else DeltastateGDNKernel()
    atol = 2e-4

    # -- extend: one varlen batch, SGLang's tensors and keywords --
    T = sum(LENS)
    mixed, a, b = _qkv(layer, T)
    q, k, v = _split(mixed, T)
    qsl = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32,
                       device=device)
    cache_indices = torch.tensor(REQ_SLOTS, dtype=torch.int32, device=device)
    if kda:  # the KDA backend hands the raw gate and sigmoid(b) with the layer's gate params
        out = kernel.extend(q=q, k=k, v=v, g=a, beta=torch.sigmoid(b), ssm_states=layer.pool,
                            cache_indices=cache_indices, query_start_loc=qsl,
                            A_log=layer.A_log, dt_bias=layer.dt_bias, lower_bound=None)
    else:  # the GDN backend gates first (fused_gdn_gating): g, beta [1, T, HV]
        g = _gate(False, a, layer.A_log, layer.dt_bias).float().unsqueeze(0)
        out, last, h = kernel.extend(q=q, k=k, v=v, g=g, beta=torch.sigmoid(b).unsqueeze(0),
                                     ssm_states=layer.pool, cache_indices=cache_indices,
                                     query_start_loc=qsl)
        assert last is None and h is None
    assert out.shape == (1, T, HV, V)
    ref = []
    for n, s in enumerate(REQ_SLOTS):
        sl = slice(int(qsl[n]), int(qsl[n + 1]))
        ref.append(_reference_tokens(layer, s, mixed[sl], a[sl], b[sl]))
    torch.testing.assert_close(out[0].double().cpu(), torch.cat(ref), atol=atol, rtol=atol)
    _assert_pool(layer, atol)

    # -- decode: a batch of 4 padded for a CUDA graph (row 3: -1), both decode paths --
    rows = [REQ_SLOTS[2], REQ_SLOTS[0], -1, REQ_SLOTS[1]]
    B = len(rows)
    idx = torch.tensor(rows, dtype=torch.int32, device=device)
    for step in range(STEPS):
        mixed, a, b = _qkv(layer, B)
        if step % 2 == 0:
            out = kernel.packed_decode(mixed_qkv=mixed, a=a, b=b, A_log=layer.A_log,
                                       dt_bias=layer.dt_bias, scale=K ** -0.5,
                                       ssm_states=layer.pool, cache_indices=idx,
                                       num_v_heads=HV, head_v_dim=V)
        else:
            q, k, v = _split(mixed, B)
            out = kernel.decode(q=q, k=k, v=v, a=a, b=b, A_log=layer.A_log,
                                dt_bias=layer.dt_bias, ssm_states=layer.pool,
                                cache_indices=idx,
                                query_start_loc=torch.arange(B + 1, dtype=torch.int32,
                                                             device=device))
        assert out.shape == (1, B, HV, V)
        for i, s in enumerate(rows):
            got = out[0, i].double().cpu()
            if s < 0:
                assert torch.equal(got, torch.zeros_like(got)), "padded row's output not zero"
                continue
            want = _reference_tokens(layer, s, mixed[i:i + 1], a[i:i + 1], b[i:i + 1])[0]
            torch.testing.assert_close(got, want, atol=atol, rtol=atol)
        _assert_pool(layer, atol)

    # -- speculative rounds on the same padded batch: a chain, then a tree --
    # accepted: the last accepted draft step per request (SGLang's accept_length - 1); in the
    # tree, step 3's path is 0 -> 1 -> 3.
    _verify_and_commit(layer, kernel, rows, accepted=[2, 0, -1, DRAFT - 1], tree=False,
                       atol=atol)
    _verify_and_commit(layer, kernel, rows, accepted=[3, 2, -1, 0], tree=True, atol=atol)

    # -- a decode step from the committed states --
    mixed, a, b = _qkv(layer, B)
    q, k, v = _split(mixed, B)
    out = kernel.decode(q=q, k=k, v=v, a=a, b=b, A_log=layer.A_log, dt_bias=layer.dt_bias,
                        ssm_states=layer.pool, cache_indices=idx,
                        query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=device))
    for i, s in enumerate(rows):
        if s >= 0:
            want = _reference_tokens(layer, s, mixed[i:i + 1], a[i:i + 1], b[i:i + 1])[0]
            torch.testing.assert_close(out[0, i].double().cpu(), want, atol=atol, rtol=atol)
    _assert_pool(layer, atol)


def _conv_path_ref(window, xs, w, bias):
    """float64: the conv output of the last input in `xs` [n, dim] after `window` [dim, W-1]
    (SiLU), and the window after it."""
    seq = torch.cat([window.double(), xs.double().T], 1)
    y = (seq[:, -w.shape[1]:] * w.double()).sum(1) + bias.double()
    return y / (1 + torch.exp(-y)), seq[:, -(w.shape[1] - 1):]


@pytest.mark.parametrize("device", DEVICES)
def test_target_verify_with_the_conv_as_sglang_calls_it(device):
    """SGLang's GDN target-verify branch with deltastate's causal_conv1d_update in place of its
    own (gdn_backend.py's forward: mixed_qkv.view(B, draft, -1).transpose(1, 2) into the conv
    with the mamba pool's conv_states and intermediate_conv_window, the EAGLE tree's
    retrieve_next_token / retrieve_next_sibling / retrieve_parent_token, the output
    .transpose(1, 2).view(seq_len, -1) split into q, k, v), then target_verify with the parents
    the conv wrote, then update_mamba_state_after_mtp_verify's two scatters (states and conv
    windows). Against float64 along each token's path: conv outputs, attention outputs, and the
    committed states and windows; free slots and unused scratch rows untouched."""
    gen = torch.Generator().manual_seed(23)
    layer = Layer(False, device, torch.float32, gen)
    W = 4
    dim = 2 * H * K + HV * V
    conv_w = layer.r(dim, W, scale=0.5)
    conv_b = layer.r(dim, scale=0.1)
    conv_states = torch.full((1, SLOTS, dim, W - 1), SENTINEL, device=device)  # conv[0]
    conv_scratch = torch.full((1, SPEC, DRAFT, dim, W - 1), SENTINEL, device=device)
    for s in REQ_SLOTS:
        conv_states[0, s] = layer.r(dim, W - 1)
        layer.pool[s] = layer.r(HV, V, K, scale=0.1)
        layer.ref[s] = layer.pool[s].double().cpu()
    ref_win = {s: conv_states[0, s].double().cpu() for s in REQ_SLOTS}
    rows = [REQ_SLOTS[2], -1, REQ_SLOTS[0], REQ_SLOTS[1]]
    B = len(rows)
    idx = torch.tensor(rows, dtype=torch.int32, device=device)
    # one tree for every request: 0 -> {1, 2}, 1 -> 3 (next token / next sibling, SGLang's)
    nxt = torch.tensor([[1, 3, -1, -1]] * B, dtype=torch.int64, device=device)
    sib = torch.tensor([[-1, 2, -1, -1]] * B, dtype=torch.int64, device=device)
    parent_of = (0, 0, 0, 1)  # what SGLang's conv derives (token 0's entry stays 0)
    retrieve_parent_token = torch.full((B, DRAFT), -5, dtype=torch.int64, device=device)
    inter_idx = torch.arange(B, dtype=torch.int32, device=device)

    raw, a, b = _qkv(layer, B * DRAFT)  # the projected rows, before the conv
    seq_len = B * DRAFT
    mixed_qkv_reshaped = raw.view(B, DRAFT, -1).transpose(1, 2)
    mixed_qkv_processed = deltastate.causal_conv1d_update(
        mixed_qkv_reshaped, conv_states[0], conv_w, conv_b, "silu",
        conv_state_indices=idx, intermediate_conv_window=conv_scratch[0],
        intermediate_state_indices=inter_idx, retrieve_next_token=nxt,
        retrieve_next_sibling=sib, retrieve_parent_token=retrieve_parent_token)
    mixed_qkv = mixed_qkv_processed.transpose(1, 2).view(seq_len, -1)
    q, k, v = _split(mixed_qkv, seq_len)
    before = layer.temporal.clone()
    out = DeltastateGDNKernel().target_verify(
        A_log=layer.A_log, dt_bias=layer.dt_bias, q=q, k=k, v=v, a=a, b=b,
        ssm_states=layer.pool, cache_indices=idx,
        query_start_loc=torch.arange(0, seq_len + 1, DRAFT, dtype=torch.int32, device=device),
        intermediate_states_buffer=layer.scratch[0], intermediate_state_indices=inter_idx,
        cache_steps=DRAFT, retrieve_parent_token=retrieve_parent_token)
    assert torch.equal(layer.temporal, before), "target_verify wrote the pool"

    parents = (-1, 0, 0, 1)  # the harness reference's form of the same tree
    states, wins = {}, {}
    for i, s in enumerate(rows):
        sl = slice(i * DRAFT, (i + 1) * DRAFT)
        if s < 0:
            assert torch.equal(out[0, sl], torch.zeros_like(out[0, sl]))
            assert torch.equal(retrieve_parent_token[i], torch.full_like(retrieve_parent_token[i],
                                                                         -5))
            continue
        assert retrieve_parent_token[i].tolist() == list(parent_of)
        x = raw[sl].cpu()
        wins[s] = []
        for t in range(DRAFT):
            path = [t]
            while path[-1] > 0:
                path.append(parent_of[path[-1]])
            y, win = _conv_path_ref(ref_win[s], x[path[::-1]], conv_w.cpu(), conv_b.cpu())
            torch.testing.assert_close(mixed_qkv[i * DRAFT + t].double().cpu(), y, atol=1e-5,
                                       rtol=1e-5)
            torch.testing.assert_close(conv_scratch[0, i, t].double().cpu(), win, atol=0, rtol=0)
            wins[s].append(win)
        want, states[s] = _reference_verify(layer, s, mixed_qkv[sl], a[sl], b[sl], parents)
        torch.testing.assert_close(out[0, sl].double().cpu(), want, atol=2e-4, rtol=2e-4)

    # update_mamba_state_after_mtp_verify: the last accepted step of each request
    accepted_steps = torch.tensor([3, -1, 2, 0], dtype=torch.int64, device=device)
    deltastate.fused_mamba_state_scatter_with_mask(layer.temporal, layer.scratch, idx,
                                                   accepted_steps)
    deltastate.fused_mamba_state_scatter_with_mask(conv_states, conv_scratch, idx, accepted_steps)
    for s, step in zip(rows, accepted_steps.tolist()):
        if s >= 0:
            layer.ref[s] = states[s][step].clone()
            ref_win[s] = wins[s][step]
    _assert_pool(layer, 2e-4)
    got = conv_states[0].cpu()
    for sl in range(SLOTS):
        if sl in ref_win:
            torch.testing.assert_close(got[sl].double(), ref_win[sl], atol=0, rtol=0)
        else:
            assert torch.equal(got[sl], torch.full_like(got[sl], SENTINEL)), f"slot {sl}"
    for r in range(B, SPEC):
        assert torch.equal(conv_scratch[0, r].cpu(), torch.full_like(conv_scratch[0, r].cpu(),
                                                                     SENTINEL))


@pytest.mark.parametrize("device", DEVICES)
def test_gdn_extend_without_inplace_update_keeps_the_pool(device):
    gen = torch.Generator().manual_seed(3)
    layer = Layer(False, device, torch.float32, gen)
    layer.pool[REQ_SLOTS[0]].normal_(generator=None)
    before = layer.pool.clone()
    T = 9
    mixed, a, b = _qkv(layer, T)
    q, k, v = _split(mixed, T)
    g = _gate(False, a, layer.A_log, layer.dt_bias).float().unsqueeze(0)
    args = dict(q=q, k=k, v=v, g=g, beta=torch.sigmoid(b).unsqueeze(0), ssm_states=layer.pool,
                cache_indices=torch.tensor(REQ_SLOTS[:1], dtype=torch.int32, device=device),
                query_start_loc=torch.tensor([0, T], dtype=torch.int32, device=device))
    kernel = DeltastateGDNKernel()
    o_scored, _, _ = kernel.extend(inplace_update=False, **args)
    assert torch.equal(layer.pool, before)
    o, _, _ = kernel.extend(**args)
    torch.testing.assert_close(o_scored, o, atol=0, rtol=0)
    assert not torch.equal(layer.pool, before)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_target_verify_flat_scratch_and_lower_bound(kda):
    """A flat scratch [spec * cache_steps, HV, V, K] is cut into rows of cache_steps (SGLang's
    kernel's pitch); KDA's lower_bound keyword (passed by SGLang's KDA backends) selects the safe
    gate, as in decode."""
    gen = torch.Generator().manual_seed(11)
    layer = Layer(kda, "cpu", torch.float32, gen)
    for s in REQ_SLOTS:
        layer.pool[s].normal_(generator=gen)
        layer.ref[s] = layer.pool[s].double().clone()
    B = len(REQ_SLOTS)
    mixed, a, b = _qkv(layer, B * DRAFT)
    q, k, v = _split(mixed, B * DRAFT)
    lower_bound = -5.0 if kda else None
    flat = torch.full((SPEC * DRAFT, HV, V, K), SENTINEL)
    out = (DeltastateKDAKernel() if kda else DeltastateGDNKernel()).target_verify(
        layer.A_log, layer.dt_bias, q, k, v, a, b, ssm_states=layer.pool,
        cache_indices=torch.tensor(REQ_SLOTS, dtype=torch.int32),
        query_start_loc=torch.arange(0, B * DRAFT + 1, DRAFT, dtype=torch.int32),
        intermediate_states_buffer=flat,
        intermediate_state_indices=torch.tensor([2, 0, 5], dtype=torch.int32),
        cache_steps=DRAFT, retrieve_parent_token=None, lower_bound=lower_bound)
    for i, (s, row) in enumerate(zip(REQ_SLOTS, (2, 0, 5))):
        sl = slice(i * DRAFT, (i + 1) * DRAFT)
        T = DRAFT
        qd, kd, vd = (x[0].double() for x in _split(mixed[sl], T))
        g = _gate(kda, a[sl], layer.A_log, layer.dt_bias, lower_bound)
        beta = torch.sigmoid(b[sl].double())
        S = layer.ref[s].clone()
        for t in range(T):
            want = _step(S, qd[t], kd[t], vd[t], g[t], beta[t])
            torch.testing.assert_close(out[0, i * DRAFT + t].double(), want, atol=2e-4,
                                       rtol=2e-4)
            torch.testing.assert_close(flat[row * DRAFT + t].double(), S, atol=2e-4, rtol=2e-4)
    for row in (1, 3, 4):
        assert torch.equal(flat[row * DRAFT:(row + 1) * DRAFT],
                           torch.full((DRAFT, HV, V, K), SENTINEL)), f"scratch row {row} written"
    _assert_pool(layer, 0)


def _rings(L, kda):
    """SGLang's per-layer raw rings (cache_ring), filled with the sentinel."""
    return dict(replayssm_rawv=torch.full((SLOTS, HV, L, V), SENTINEL),
                replayssm_rawk=torch.full((SLOTS, H, L, K), SENTINEL),
                replayssm_g=torch.full((SLOTS, HV, L, K) if kda else (SLOTS, HV, L), SENTINEL),
                replayssm_beta=torch.full((SLOTS, HV, L), SENTINEL))


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_target_verify_cache_ring_records_the_raw_drafts(kda):
    """target_verify with SGLang's cache_ring keywords (its KDA kernel's target_verify passes
    them) records each request's drafts t < L at its slot of the rings: raw v, raw (pre-norm) k,
    the gate and sigmoid(b), as fp32 here (the last draft, past the ring, is dropped); padded
    rows' and other slots' entries stay untouched; the outputs are the call's without the rings.
    Without cache_ring the rings are not written."""
    gen = torch.Generator().manual_seed(17)
    layer = Layer(kda, "cpu", torch.float32, gen)
    for s in REQ_SLOTS:
        layer.pool[s].normal_(generator=gen)
    rows = (REQ_SLOTS[0], -1, REQ_SLOTS[2])
    B, L = len(rows), DRAFT - 1  # the last draft falls past the ring
    mixed, a, b = _qkv(layer, B * DRAFT)
    q, k, v = _split(mixed, B * DRAFT)
    kernel = DeltastateKDAKernel() if kda else DeltastateGDNKernel()

    def run(**extra):
        scratch = torch.full((SPEC, DRAFT, HV, V, K), SENTINEL)
        out = kernel.target_verify(
            layer.A_log, layer.dt_bias, q, k, v, a, b, ssm_states=layer.pool,
            cache_indices=torch.tensor(rows, dtype=torch.int32),
            query_start_loc=torch.arange(0, B * DRAFT + 1, DRAFT, dtype=torch.int32),
            intermediate_states_buffer=scratch,
            intermediate_state_indices=torch.arange(B, dtype=torch.int32),
            cache_steps=DRAFT, retrieve_parent_token=None, **extra)
        return out, scratch

    rings = _rings(L, kda)
    want_out, want_scratch = run()
    untouched = _rings(L, kda)
    out, scratch = run(cache_ring=False, **untouched)
    for name, t in untouched.items():
        assert torch.equal(t, torch.full_like(t, SENTINEL)), f"{name} written without cache_ring"
    out, scratch = run(cache_ring=True, **rings)
    assert torch.equal(out, want_out) and torch.equal(scratch, want_scratch)
    gate = _gate(kda, a, layer.A_log, layer.dt_bias)
    beta = torch.sigmoid(b.double())
    qk = _split(mixed, B * DRAFT)
    for i, s in enumerate(rows):
        for t in range(L if s >= 0 else 0):
            tok = i * DRAFT + t
            assert torch.equal(rings["replayssm_rawv"][s, :, t], qk[2][0, tok])
            assert torch.equal(rings["replayssm_rawk"][s, :, t], qk[1][0, tok])
            torch.testing.assert_close(rings["replayssm_g"][s, :, t].double(), gate[tok],
                                       atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(rings["replayssm_beta"][s, :, t].double(), beta[tok],
                                       atol=1e-6, rtol=1e-6)
    written = {s for s in rows if s >= 0}
    for name, t in rings.items():
        for s in set(range(SLOTS)) - written:
            assert torch.equal(t[s], torch.full_like(t[s], SENTINEL)), f"{name} slot {s} written"


def test_kda_replayssm_packed_decode_takes_the_backends_gate_shapes():
    """SGLang's KDA kernel reshapes its backend's gate inputs (a [B, 1, HV*K], b [B, 1, HV]) before
    ReplaySSM decode, as it does for packed decode; the result is the 2-D inputs' bit for bit."""
    gen = torch.Generator().manual_seed(19)
    layer = Layer(True, "cpu", torch.float32, gen)
    for s in REQ_SLOTS:
        layer.pool[s].normal_(generator=gen)
    B, L = len(REQ_SLOTS), 4
    mixed, a, b = _qkv(layer, B)
    idx = torch.tensor(REQ_SLOTS, dtype=torch.int32)

    def run(a_in, b_in):
        pool = layer.pool.clone()
        rings = dict(replayssm_d=torch.zeros(SLOTS, HV, L, V),
                     replayssm_k=torch.zeros(SLOTS, H, L, K),
                     replayssm_g=torch.zeros(SLOTS, HV, L, K),
                     replayssm_write_pos=torch.zeros(B, dtype=torch.int32))
        out = DeltastateKDAKernel().packed_decode(
            mixed, a_in, b_in, A_log=layer.A_log, dt_bias=layer.dt_bias, scale=K ** -0.5,
            ssm_states=pool, cache_indices=idx, num_v_heads=HV, head_v_dim=V, **rings)
        return out, pool, rings

    flat = run(a, b)
    shaped = run(a.reshape(B, 1, HV * K), b.reshape(B, 1, HV))
    assert torch.equal(flat[0], shaped[0]) and torch.equal(flat[1], shaped[1])
    for name in flat[2]:
        assert torch.equal(flat[2][name], shaped[2][name]), name
    assert flat[0].shape == (1, B, HV, V)


def test_kda_extend_beta_is_raw():
    """SGLang's KDA extend takes beta_is_raw (beta as its logit, sigmoid in the kernel): the same
    as the probability given."""
    gen = torch.Generator().manual_seed(23)
    layer = Layer(True, "cpu", torch.float32, gen)
    T = 11
    mixed, a, b = _qkv(layer, T)
    q, k, v = _split(mixed, T)
    idx = torch.tensor(REQ_SLOTS[:1], dtype=torch.int32)
    loc = torch.tensor([0, T], dtype=torch.int32)
    outs = []
    for beta, raw in ((torch.sigmoid(b), False), (b, True)):
        pool = layer.pool.clone()
        outs.append((DeltastateKDAKernel().extend(
            q, k, v, a.reshape(1, T, HV, K), beta.unsqueeze(0), ssm_states=pool,
            cache_indices=idx, query_start_loc=loc, A_log=layer.A_log.reshape(-1),
            dt_bias=layer.dt_bias, beta_is_raw=raw), pool))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-6, rtol=1e-6)


def test_intermediate_states_of_extend_are_not_implemented():
    with pytest.raises(NotImplementedError, match=r"return_intermediate_states \(SGLang's "
                       r"per-chunk states h for prefix-cache tracking\) is not implemented"):
        DeltastateKDAKernel().extend(None, None, None, None, None, ssm_states=None,
                                     cache_indices=None, query_start_loc=None,
                                     return_intermediate_states=True)


# SGLang's surface (kernels/kernel_backend.py @ 03a4a692; TritonGDNKernel.packed_decode and
# .target_verify @ 0a48af3a, TritonKDAKernel.target_verify @ 007d1d93): parameter name, kind (P
# positional-or-keyword, K keyword-only, V **kwargs). Later TritonKDAKernels (the kda_triton.py
# with `supports_fused_chain_verify`) add optional keywords before **kwargs to target_verify
# (lower_bound, cache_ring, replayssm_rawv .. replayssm_beta) and extend (beta_is_raw).
SURFACE = {
    "decode": "q:P k:P v:P a:P b:P A_log:K dt_bias:K ssm_states:K cache_indices:K "
              "query_start_loc:K kwargs:V",
    "extend": "q:P k:P v:P g:P beta:P ssm_states:K cache_indices:K query_start_loc:K",
    "target_verify": "A_log:P dt_bias:P q:P k:P v:P a:P b:P ssm_states:K cache_indices:K "
                     "query_start_loc:K intermediate_states_buffer:K "
                     "intermediate_state_indices:K cache_steps:K retrieve_parent_token:K",
    "packed_decode": "mixed_qkv:P a:P b:P A_log:K dt_bias:K scale:K ssm_states:K "
                     "cache_indices:K num_v_heads:K head_v_dim:K kwargs:V",
}
_KIND = {inspect.Parameter.POSITIONAL_OR_KEYWORD: "P", inspect.Parameter.KEYWORD_ONLY: "K",
         inspect.Parameter.VAR_KEYWORD: "V"}


@pytest.mark.parametrize("cls", [DeltastateGDNKernel, DeltastateKDAKernel])
@pytest.mark.parametrize("method", sorted(SURFACE))
def test_surface_is_sglangs(cls, method):
    params = list(inspect.signature(getattr(cls, method)).parameters.values())[1:]  # no self
    got = [f"{p.name}:{_KIND[p.kind]}" for p in params]
    want = SURFACE[method].split()
    if method in ("extend", "target_verify"):  # optional keywords added before **kwargs
        assert got[:len(want)] == want and got[-1] == "kwargs:V"
        assert all(p.default is not inspect.Parameter.empty for p in params[len(want):-1])
    else:
        assert got == want
    assert cls.supports_packed_decode is True and cls.uses_state_checkpoints is False
