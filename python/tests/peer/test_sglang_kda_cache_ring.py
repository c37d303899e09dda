"""SGLang's KDA cache_ring parity test, ported to ``deltastate.fused_sigmoid_gating_delta_rule_update``
(``is_kda=True`` with ``cache_ring``) and ``deltastate.commit_kda_replayssm_spec``.

Source (sgl-project/sglang): its KDA ReplaySSM fused ring-write parity test (``test_ring_fold_parity``:
"CACHE_RING verify kernel's ring == the state the verify kernel commits"), as stored in the public
index in December 2026 (its path and commit not recorded there). Functions: SGLang's
``fused_sigmoid_gating_delta_rule_update`` with ``lower_bound`` after ``is_kda`` and the KDA gate
ring ``[S, HV, L, K]`` (the version whose assert is ``replayssm_g.dim() == (4 if is_kda else 3)``),
and ``commit_kda_replayssm_spec`` (kda_replayssm_spec_decode.py @ 17f89f3).

The test: run the verify with the ring on (both gates: the safe gate ``lower_bound=-5`` and the
softplus gate), fold the ring back into the checkpoint with the commit (all T drafts accepted),
and check the folded checkpoint against the verify's own state after the last draft
(``intermediate_states_buffer``), relative max error < 1e-3; shapes cover GQA, non-power-of-two
K/V, one step, and a padded (-1) row.

What changed in the port:
  * "cuda" became a device parameter: CPU tensors always run, CUDA when present.
  * On CPU the (64, 7, 32, 32, 128, 128) shape is skipped: its [65, 7, 32, 128, 128] fp32 scratch
    is ~1 GB; CUDA runs it. Seeds (torch.manual_seed(0)), sizes, the tolerance and the assertion
    are SGLang's.
"""

import pytest

torch = pytest.importorskip("torch")

from _peer_common import device_param, peer_op

# (bs, T, HV, H, K, V) -- cover GQA (H<HV), non-pow2 K/V, small T, single head.
SHAPES = [
    (16, 7, 4, 4, 64, 64),  # baseline square heads
    (64, 7, 32, 32, 128, 128),  # K3-like TP8 shape
    (8, 4, 8, 2, 128, 128),  # GQA: 4 v-heads per k-head
    (4, 3, 6, 3, 96, 80),  # non-pow2 K/V, GQA 2:1
    (1, 1, 4, 4, 64, 64),  # single req, single step
]
SHAPE_IDS = ["square", "k3-tp8", "gqa4", "nonpow2", "single"]
GATES = [(-5.0, "safe"), (None, "softplus")]


@device_param
@pytest.mark.parametrize("bs,T,HV,H,K,V", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("lower_bound", [g[0] for g in GATES], ids=[g[1] for g in GATES])
@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
def test_ring_fold_parity(device, bs, T, HV, H, K, V, lower_bound, pad):
    if device == "cpu" and bs * T * HV * K * V > 64 * 1024 * 1024:
        pytest.skip("a ~1 GB fp32 scratch on CPU; CUDA runs this shape")
    verify = peer_op("fused_sigmoid_gating_delta_rule_update")
    commit = peer_op("commit_kda_replayssm_spec")
    DEV = device
    L = max(16, 2 * T)  # ring length; power-of-two backstop satisfied
    scale = K**-0.5
    torch.manual_seed(0)

    q = torch.randn(bs, T, H, K, device=DEV, dtype=torch.float32)
    k = torch.randn(bs, T, H, K, device=DEV, dtype=torch.float32)
    v = torch.randn(bs, T, HV, V, device=DEV, dtype=torch.float32)
    a = torch.randn(bs, T, HV, K, device=DEV, dtype=torch.float32)
    b = torch.randn(bs, T, HV, device=DEV, dtype=torch.float32)
    A_log = torch.randn(HV, device=DEV, dtype=torch.float32)
    dt_bias = torch.randn(HV, K, device=DEV, dtype=torch.float32)
    h0 = torch.randn(bs, HV, V, K, device=DEV, dtype=torch.float32)

    # slots 1..bs; optionally set one row to a -1 padding slot (must be skipped).
    slots = torch.arange(1, bs + 1, device=DEV, dtype=torch.int32)
    if pad and bs > 1:
        slots[-1] = -1
    num_slots = bs + 1

    h0_src = torch.zeros(num_slots, HV, V, K, device=DEV, dtype=torch.float32)
    for j in range(bs):
        if slots[j] >= 0:
            h0_src[slots[j]] = h0[j]
    inter = torch.zeros(num_slots, T, HV, V, K, device=DEV, dtype=torch.float32)

    # ring buffers filled by the fused kernel (CACHE_RING=True).
    rawv = torch.zeros(num_slots, HV, L, V, device=DEV, dtype=torch.float32)
    rawk = torch.zeros(num_slots, H, L, K, device=DEV, dtype=torch.float32)
    gring = torch.zeros(num_slots, HV, L, K, device=DEV, dtype=torch.float32)
    betar = torch.zeros(num_slots, HV, L, device=DEV, dtype=torch.float32)

    verify(
        A_log=A_log,
        a=a,
        dt_bias=dt_bias,
        softplus_beta=1.0,
        softplus_threshold=20.0,
        q=q,
        k=k,
        v=v,
        b=b,
        initial_state_source=h0_src,
        initial_state_indices=slots,
        scale=scale,
        use_qk_l2norm_in_kernel=True,
        is_kda=True,
        lower_bound=lower_bound,
        disable_state_update=True,
        intermediate_states_buffer=inter,
        intermediate_state_indices=slots,
        cache_steps=T,
        # fused ring-write (kwargs below are added by the fusion).
        cache_ring=True,
        replayssm_rawv=rawv,
        replayssm_rawk=rawk,
        replayssm_g=gring,
        replayssm_beta=betar,
    )

    acc = torch.full((bs,), T, device=DEV, dtype=torch.int32)
    ckpt = h0_src.clone()
    commit(
        ckpt,
        rawv,
        rawk,
        gring,
        betar,
        slots,
        acc,
        max_cache_len=L,
        num_k_heads=H,
        use_qk_l2norm_in_kernel=True,
        null_block_id=-1,
    )

    for j in range(bs):
        if slots[j] < 0:
            continue  # padding row: ring not written, nothing to check
        base = inter[slots[j], T - 1]
        fold = ckpt[slots[j]]
        rel = ((fold - base).abs().max() / base.abs().max().clamp_min(1e-6)).item()
        assert rel < 1e-3, f"row={j}: rel={rel:.3e}"
