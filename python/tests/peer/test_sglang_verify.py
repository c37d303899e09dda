"""SGLang's target-verify tests, ported to ``deltastate.fused_sigmoid_gating_delta_rule_update``,
``deltastate.fused_mamba_state_scatter_with_mask`` and
``deltastate.fused_conv_window_scatter_with_mask``.

Sources (sgl-project/sglang):
  * the kernel test of ``fused_sigmoid_gating_delta_rule_update`` in its GDN target_verify mode
    ("Tests for fused sigmoid gating delta rule MTP kernel (GDN target_verify)", under
    test/registered/kernels, as stored in the public index in December 2026; it imports
    ``sglang.kernels.ops.attention.fla``). Ported: test_fused_gdn_mtp_precision,
    test_qwen35_tp4_fused_gdn_mtp_precision, test_sm90_verify_launch_is_bit_exact (its tree and
    chain cases), test_mtp_single_step_decode, test_verify_scratch_pitch_uses_allocated_steps.
  * the kernel test of mamba_state_scatter_triton.py (it imports
    ``sglang.kernels.ops.mamba.mamba_state_scatter_triton`` and
    ``sglang.srt.mem_cache.layout.page_major``; classes TestMambaStateScatterCorrectness,
    TestScatterDstLayoutContract, TestMambaStateScatterEnvelopeDst, TestCopyMambaStateRows), as
    stored in the public index in December 2026; the index gave its text but not its path in the
    repository. Ported: test_fused_matches_reference and test_fused_scatter_envelope_strided_dst.
Functions: python/sglang/srt/layers/attention/fla/fused_sigmoid_gating_recurrent.py and
python/sglang/kernels/ops/mamba/mamba_state_scatter_triton.py
@ 01a7b8946ccf78fef3cb11bf92b50ef7f0d64d75 (``fused_mamba_state_scatter_with_mask``,
``fused_conv_window_scatter_with_mask``; see docs/PEERS.md).

What changed in the port:
  * SGLang's oracle is its own two-step Triton path (``fused_gdn_gating`` then
    ``fused_recurrent_gated_delta_rule_update``); here it is a float32 torch rewrite of those two
    steps (g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), then the per-token delta
    rule with the in-kernel L2 norm), the same arithmetic the Triton pair does. Tolerances
    (rtol = atol = 1e-2; the state fail-rate bound of test_mtp_single_step_decode) are kept.
  * test_sm90_verify_launch_is_bit_exact compares two Triton launch configurations bit for bit;
    deltastate has one launch policy, so the port keeps its inputs (random trees included) and
    asserts that two runs are bit-equal and that both match the tree reference.
  * The launch-config tests (test_*_launch_config_is_narrow) have no counterpart (no Triton
    launch configs here) and are not ported.
  * The scatter tests keep SGLang's advanced-indexing references, sizes, seeds and
    torch.testing.assert_close. test_fused_matches_reference scatters [L, C, E] entries (3-D dst),
    which deltastate's fused_mamba_state_scatter_with_mask sends to the conv commit as windows of
    one row. test_fused_scatter_envelope_strided_dst builds its envelope-strided views with SGLang's
    page-major pool helpers; the port builds views of the same kind itself (one byte buffer of
    per-slot entries, each holding every layer's conv window and temporal state, so the slot
    stride is the entry), keeping the test's precondition that neither view is contiguous.
  * TestScatterDstLayoutContract tests SGLang's private ``_require_entry_contiguous_dst``, whose
    rejection of a dst with strided entry dims deltastate does not share (it takes any dst
    strides: test_verify.py::test_conv_commit_layouts commits into dim-contiguous windows); its
    envelope views are test_fused_scatter_envelope_strided_dst's. TestCopyMambaStateRows /
    TestCopyMambaStateExtendRows test other functions. None of these is ported.
  * Devices: CPU tensors always, CUDA tensors when present (SGLang: CUDA only). On CPU the batch
    sizes above 16 (above 3 in the 32-case bit-exact test) are skipped to keep the suite short;
    CUDA runs use SGLang's sizes; the scatter tests use SGLang's sizes on both.
  * test_commit_scatter_after_verify is not an SGLang test: it pins the scatter's contract (row =
    request, step >= 0 copied) read from mamba_state_scatter_triton.py.
"""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F

from _peer_common import device_param

import deltastate as ds


def _make_tensors(N, T, H, HV, K, V, device, seed=2025):
    torch.manual_seed(seed)
    A_log = torch.randn(HV, dtype=torch.float32)
    dt_bias = torch.randn(HV, dtype=torch.bfloat16)
    a = torch.randn(1, N * T, HV, dtype=torch.bfloat16)
    b = torch.randn(1, N * T, HV, dtype=torch.bfloat16)
    q = torch.randn(1, N * T, H, K, dtype=torch.bfloat16)
    k = torch.randn(1, N * T, H, K, dtype=torch.bfloat16)
    v = torch.randn(1, N * T, HV, V, dtype=torch.bfloat16)
    indices = torch.arange(N, dtype=torch.int32)
    initial_state = torch.randn(N, HV, K, V, dtype=torch.float)
    cu_seqlens = torch.arange(0, N * T + 1, T, dtype=torch.int32)
    return [t.to(device) for t in (A_log, dt_bias, a, b, q, k, v, initial_state, indices,
                                   cu_seqlens)]


def run_reference(A_log, dt_bias, q, k, v, a, b, state, indices, cu_seqlens, *,
                  disable_state_update=True, parents=None):
    """fused_gdn_gating + fused_recurrent_gated_delta_rule_update, in float32 torch. Returns
    (o in q's dtype, intermediate states [N, T, HV, V, K]); updates `state` unless disabled."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), beta=1.0,
                                               threshold=20.0)
    beta = torch.sigmoid(b.float())
    N = len(cu_seqlens) - 1
    H, HV = q.shape[2], v.shape[2]
    rep = HV // H
    o = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    inter = torch.zeros((N,) + tuple(state.shape[1:]), dtype=torch.float32, device=q.device)
    inter = inter[:, None].repeat(1, int(cu_seqlens[1] - cu_seqlens[0]) if N else 1, 1, 1, 1)
    for n in range(N):
        slot = int(indices[n])
        s0 = state[slot].float().clone()
        S = s0
        t0, t1 = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        for t in range(t1 - t0):
            if parents is not None and t > 0:
                p = int(parents[n, t])
                S = s0 if p < 0 else inter[n, p].clone()
            tok = t0 + t
            kt = k[0, tok].float()
            kt = (kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(rep, 0)
            qt = q[0, tok].float()
            qt = (qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(rep, 0)
            qt = qt * q.shape[-1] ** -0.5
            S = S * torch.exp(g[0, tok])[:, None, None]
            u = beta[0, tok][:, None] * (v[0, tok].float() - torch.einsum("hvk,hk->hv", S, kt))
            S = S + u[:, :, None] * kt[:, None, :]
            o[0, tok] = torch.einsum("hvk,hk->hv", S, qt)
            inter[n, t] = S
        if not disable_state_update:
            state[slot] = S.to(state.dtype)
    return o.to(q.dtype), inter


def run_fused_mtp(A_log, dt_bias, q, k, v, a, b, state, indices, cu_seqlens, **kw):
    return ds.fused_sigmoid_gating_delta_rule_update(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=state,
        initial_state_indices=indices, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True,
        softplus_beta=1.0, softplus_threshold=20.0, is_kda=False, **kw)


def _skip_big_on_cpu(device, N, limit=16):
    if device == "cpu" and N > limit:
        pytest.skip(f"batch above {limit}: CUDA only in the port (CPU run time)")


@device_param
@pytest.mark.parametrize("N", [1, 8, 16])
@pytest.mark.parametrize("T", [1, 4, 8])
def test_fused_gdn_mtp_precision(device, N, T):
    H, HV, K, V = 16, 32, 128, 128
    A_log, dt_bias, a, b, q, k, v, state, indices, cu = _make_tensors(N, T, H, HV, K, V, device)
    out_ref, _ = run_reference(A_log, dt_bias, q, k, v, a, b, state.clone(), indices, cu)
    out_fused = run_fused_mtp(A_log, dt_bias, q, k, v, a, b, state.clone(), indices, cu,
                              disable_state_update=True)
    torch.testing.assert_close(out_ref, out_fused, rtol=1e-2, atol=1e-2)


@device_param
@pytest.mark.parametrize("N", [1, 3, 16])
def test_qwen35_tp4_fused_gdn_mtp_precision(device, N):
    T, H, HV, K, V = 4, 4, 16, 128, 128
    A_log, dt_bias, a, b, q, k, v, state, indices, cu = _make_tensors(N, T, H, HV, K, V, device)
    out_ref, _ = run_reference(A_log, dt_bias, q, k, v, a, b, state.clone(), indices, cu)
    out_fused = run_fused_mtp(A_log, dt_bias, q, k, v, a, b, state.clone(), indices, cu,
                              disable_state_update=True)
    torch.testing.assert_close(out_ref, out_fused, rtol=1e-2, atol=1e-2)


@device_param
@pytest.mark.parametrize("N", [1, 3, 16, 64])
@pytest.mark.parametrize("T", [4, 16])
@pytest.mark.parametrize("H,HV", [(16, 32), (4, 16)])
@pytest.mark.parametrize("tree", [False, True])
def test_sm90_verify_launch_is_bit_exact(device, N, T, H, HV, tree):
    _skip_big_on_cpu(device, N, 3)
    K = V = 128
    A_log, dt_bias, a, b, q, k, v, state, indices, cu = _make_tensors(N, T, H, HV, K, V, device)
    parents = None
    if tree:
        steps = torch.arange(T, device=device)
        parents = (torch.rand(N, T, device=device) * steps).long()
        parents[:, 0] = -1

    def run():
        buffer = torch.zeros(N, T, HV, V, K, dtype=torch.float32, device=device)
        out = run_fused_mtp(A_log, dt_bias, q, k, v, a, b, state.clone(), indices, cu,
                            disable_state_update=True, intermediate_states_buffer=buffer,
                            intermediate_state_indices=indices, cache_steps=T,
                            retrieve_parent_token=parents)
        return out, buffer

    out1, states1 = run()
    out2, states2 = run()
    assert torch.equal(out1, out2)
    assert torch.equal(states1, states2)
    out_ref, inter_ref = run_reference(A_log, dt_bias, q, k, v, a, b, state.clone(), indices, cu,
                                       parents=parents)
    torch.testing.assert_close(out_ref, out1, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(inter_ref, states1, rtol=1e-2, atol=1e-2)


@device_param
@pytest.mark.parametrize("N", [1, 16, 128])
def test_mtp_single_step_decode(device, N):
    _skip_big_on_cpu(device, N)
    T = 1
    H, HV, K, V = 16, 32, 128, 128
    A_log, dt_bias, a, b, q, k, v, state, indices, cu = _make_tensors(N, T, H, HV, K, V, device)
    state_ref, state_fused = state.clone(), state.clone()
    out_ref, _ = run_reference(A_log, dt_bias, q, k, v, a, b, state_ref, indices, cu,
                               disable_state_update=False)
    out_fused = run_fused_mtp(A_log, dt_bias, q, k, v, a, b, state_fused, indices, cu,
                              disable_state_update=False)
    torch.testing.assert_close(out_ref, out_fused, rtol=1e-2, atol=1e-2)
    state_diff = (state_ref.float() - state_fused.float()).abs()
    state_fail_rate = (state_diff > 0.1).float().mean().item() * 100
    assert state_fail_rate < 0.01, f"State mismatch: fail_rate={state_fail_rate:.2f}%"


@device_param
def test_verify_scratch_pitch_uses_allocated_steps(device):
    N, T, ALLOCATED = 2, 4, 8
    H, HV, K, V = 16, 32, 128, 128
    A_log, dt_bias, a, b, q, k, v, state, indices, cu = _make_tensors(N, T, H, HV, K, V, device)
    buffer = torch.full((N + 1, ALLOCATED, HV, V, K), float("nan"), dtype=torch.float32,
                        device=device)
    run_fused_mtp(A_log, dt_bias, q, k, v, a, b, state, indices, cu, disable_state_update=True,
                  intermediate_states_buffer=buffer, intermediate_state_indices=indices,
                  cache_steps=T)
    assert not torch.isnan(buffer[:N, :T]).any()
    assert torch.isnan(buffer[N:]).all()
    assert torch.isnan(buffer[:N, T:]).all()


@device_param
def test_commit_scatter_after_verify(device):
    layers, N, T, HV, K, V = 2, 3, 4, 2, 16, 8
    torch.manual_seed(0)
    dst = torch.randn(layers, 6, HV, V, K, device=device)
    src = torch.randn(layers, N, T, HV, V, K, device=device)
    before = dst.clone()
    ds.fused_mamba_state_scatter_with_mask(dst, src, torch.tensor([4, 1, 0], device=device),
                                           torch.tensor([3, -1, 0], device=device))
    assert torch.equal(dst[:, 4], src[:, 0, 3])
    assert torch.equal(dst[:, 0], src[:, 2, 0])
    assert torch.equal(dst[:, [1, 2, 3, 5]], before[:, [1, 2, 3, 5]])


# ---- mamba_state_scatter_triton.py: the commit scatters -----------------------------------
def _scatter_ref(dst, src, dst_rows, src_rows, steps):
    """SGLang's reference: advanced indexing, dst[:, d] = src[:, s, t]."""
    dst[:, dst_rows] = src[:, src_rows, steps].to(dst.dtype, copy=False)


def _commit_ref(ssm, inter_ssm, conv, inter_conv, dst_rows, steps, track_rows=None,
                track_steps=None):
    """The reference commit: request i's scratch row is i; the accepted steps, then the track
    scatter (its own mask)."""
    rows = torch.arange(steps.shape[0], dtype=torch.int32, device=steps.device)
    for d, t in ((dst_rows, steps), (track_rows, track_steps)):
        if d is None:
            continue
        live = t >= 0
        if not live.any():
            continue
        for dst, src in ((ssm, inter_ssm), (conv, inter_conv)):
            _scatter_ref(dst, src, d[live].to(torch.int64), rows[live].to(torch.int64),
                         t[live].to(torch.int64))


def _commit_fused(ssm, inter_ssm, conv, inter_conv, dst_rows, steps, track_rows=None,
                  track_steps=None):
    """The same through fused_mamba_state_scatter_with_mask (the mask applied in the op)."""
    for d, t in ((dst_rows, steps), (track_rows, track_steps)):
        if d is None:
            continue
        ds.fused_mamba_state_scatter_with_mask(ssm, inter_ssm, d, t)
        ds.fused_mamba_state_scatter_with_mask(conv, inter_conv, d, t)


@device_param
def test_fused_matches_reference(device):
    torch.manual_seed(42)
    L, B, C, D = 8, 32, 49, 5
    ssm_elems, conv_elems = 1024, 512
    ssm0 = torch.randn((L, C, ssm_elems), device=device, dtype=torch.bfloat16)
    conv0 = torch.randn((L, C, conv_elems), device=device, dtype=torch.bfloat16)
    inter_ssm = torch.randn((L, B, D, ssm_elems), device=device, dtype=torch.bfloat16)
    inter_conv = torch.randn((L, B, D, conv_elems), device=device, dtype=torch.bfloat16)
    # distinct cache lines: one write per line
    dst_rows = torch.randperm(C, device=device, dtype=torch.int64)[:B].to(torch.int32)
    steps = torch.randint(0, D, (B,), device=device, dtype=torch.int64)
    steps[torch.rand((B,), device=device) < 0.1] = -1  # about 10% rejected
    track_rows = torch.randperm(C, device=device, dtype=torch.int64)[:B]
    track_steps = torch.randint(0, D, (B,), device=device, dtype=torch.int64)
    track_steps[torch.rand((B,), device=device) < 0.7] = -1
    ssm_ref, conv_ref = ssm0.clone(), conv0.clone()
    ssm_fused, conv_fused = ssm0.clone(), conv0.clone()
    _commit_ref(ssm_ref, inter_ssm, conv_ref, inter_conv, dst_rows, steps, track_rows,
                track_steps)
    _commit_fused(ssm_fused, inter_ssm, conv_fused, inter_conv, dst_rows, steps, track_rows,
                  track_steps)
    torch.testing.assert_close(ssm_fused, ssm_ref)
    torch.testing.assert_close(conv_fused, conv_ref)


def _page_major_views(device, layers=2, slots=16, temporal_shape=(2, 4, 4), conv_shape=(8, 3),
                      conv_dtype=torch.bfloat16, temporal_dtype=torch.float32):
    """Envelope-strided conv and temporal views [layers, slots, *inner] over one byte buffer of
    per-slot entries: entry j holds every layer's conv window, then every layer's temporal state
    (so each view's slot stride is the entry, its layer stride one layer's inner block)."""
    conv_bytes = conv_shape[0] * conv_shape[1] * conv_dtype.itemsize
    t_elems = temporal_shape[0] * temporal_shape[1] * temporal_shape[2]
    t_bytes = t_elems * temporal_dtype.itemsize
    entry = -(-(layers * (conv_bytes + t_bytes)) // 16) * 16
    raw = torch.zeros(slots * entry, dtype=torch.uint8, device=device)
    c_item, t_item = conv_dtype.itemsize, temporal_dtype.itemsize
    conv = raw.view(conv_dtype).as_strided(
        (layers, slots) + tuple(conv_shape),
        (conv_bytes // c_item, entry // c_item, conv_shape[1], 1))
    inner = (temporal_shape[1] * temporal_shape[2], temporal_shape[2], 1)
    temporal = raw.view(temporal_dtype).as_strided(
        (layers, slots) + tuple(temporal_shape), (t_elems, entry // t_item) + inner,
        layers * conv_bytes // t_item)
    return [conv], temporal


@device_param
def test_fused_scatter_envelope_strided_dst(device):
    torch.manual_seed(7)
    conv_views, temporal = _page_major_views(device)
    layers, slots = temporal.shape[0], temporal.shape[1]
    temporal_shape = tuple(temporal.shape[2:])
    dim, km1 = conv_views[0].shape[2], conv_views[0].shape[3]
    # Precondition: the views really are envelope-strided (else the test proves nothing).
    assert not temporal.is_contiguous()
    assert not conv_views[0].is_contiguous()
    B, D = 5, 3
    temporal[:] = torch.randn_like(temporal)
    conv_views[0][:] = torch.randn_like(conv_views[0])
    temporal_before, conv_before = temporal.clone(), conv_views[0].clone()
    # The dense per-step SSM scratch.
    src_ssm = torch.randn((layers, B, D) + temporal_shape, device=device, dtype=temporal.dtype)
    # The conv scratch: SGLang's overlapping view over one [dim, D+K-2] buffer per (layer, row),
    # step t's window = shared[:, t:t+K-1].
    shared = torch.randn((layers, B, dim, D + km1 - 1), device=device, dtype=conv_views[0].dtype)
    src_conv = shared.as_strided((layers, B, D, dim, km1),
                                 (shared.stride(0), shared.stride(1), 1, shared.stride(2), 1))
    dst_rows = torch.randperm(slots, device=device, dtype=torch.int64)[:B].to(torch.int32)
    steps = torch.randint(0, D, (B,), device=device, dtype=torch.int64)
    steps[0] = -1  # a rejected row, skipped
    ds.fused_mamba_state_scatter_with_mask(temporal, src_ssm, dst_rows, steps)
    ds.fused_conv_window_scatter_with_mask(conv_views[0], src_conv, dst_rows, steps)
    # The reference: advanced indexing, whatever the layouts.
    live = steps >= 0
    d = dst_rows[live].long()
    s = torch.arange(B, device=device)[live]
    t = steps[live]
    expect_temporal = temporal_before.clone()
    expect_temporal[:, d] = src_ssm[:, s, t]
    expect_conv = conv_before.clone()
    expect_conv[:, d] = src_conv[:, s, t]
    torch.testing.assert_close(temporal, expect_temporal)
    torch.testing.assert_close(conv_views[0], expect_conv)
