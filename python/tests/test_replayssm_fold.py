"""Fold-every-commit (the verify's raw ring, `replayssm_fold_commit` and SGLang's
`commit_gdn_replayssm_fold_all_layers` / `commit_kda_replayssm_spec[_all_layers]`) on CPU tensors:
GDN and KDA, every layer in one call over envelope pools (layer and slot strides past the state,
sentinel gaps left bit-untouched), against the intermediate-state verify's per-draft snapshots
bit for bit (the fold runs the recurrent step itself) and against the float64 reference; the track
slot at steps_to_track; padded rows, nothing-accepted rows and the null block; every error text.
(SGLang's own tests of the GDN scheme: peer/test_sglang_replayssm_fold.py; the invariant over
1,000 steps: test_lossless.py.)"""

import numpy as np
import pytest

import deltastate as ds
import reference as ref
from cases import gate_logits, gate_params
from helpers import SENTINEL, Fw, assert_close, to64

H, HV, K, V = 2, 4, 16, 8
LAYERS, SLOTS, L = 2, 6, 4


def _layered_pool(fw, rng, live, dtype="float32"):
    """[LAYERS, SLOTS, HV, V, K] as a view of a sentinel-filled buffer: each slot's entry holds
    every layer's state plus a gap (the slot stride is the entry, the layer stride one state)."""
    inner = HV * V * K
    entry = LAYERS * inner + 16
    flat = fw.full((SLOTS * entry + 8,), SENTINEL, dtype)
    view = fw.as_strided(flat, (LAYERS, SLOTS, HV, V, K), (inner, entry, V * K, K, 1), 8)
    for layer in range(LAYERS):
        for s in live:
            if s >= 0:
                fw.assign(view[layer, s], rng.standard_normal((HV, V, K)) * 0.5, dtype)
    return flat, view


def _rings(fw, kda, layered=True):
    lead = (LAYERS, SLOTS) if layered else (SLOTS,)
    return {"ring_v": fw.full(lead + (HV, L, V), SENTINEL),
            "ring_k": fw.full(lead + (H, L, K), SENTINEL),
            "ring_g": fw.full(lead + ((HV, L, K) if kda else (HV, L)), SENTINEL),
            "ring_beta": fw.full(lead + (HV, L), SENTINEL)}


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_fold_equals_snapshots_every_layer(rng, kda):
    fw = Fw("numpy")
    live = [4, -1, 1, 3]
    N = len(live)
    flat, ck = _layered_pool(fw, rng, live)
    before = to64(ck).copy()
    flat_bits = flat.view(np.uint32).copy()
    rings = _rings(fw, kda)
    lens = [4, 2, 3, 1]
    accepted = [2, 3, 0, 1]  # row 2: nothing accepted
    track_slots = [5, 0, 2, -1]
    track_steps = [0, -1, 1, 0]  # row 0 tracks its first step; row 2 accepted none
    cu = fw.idx(np.concatenate([[0], np.cumsum(lens)]))
    snaps = {}
    for layer in range(LAYERS):
        A_log, dt_bias = gate_params(rng, HV, K, kda)
        Tt = sum(lens)
        x = {"q": rng.standard_normal((1, Tt, H, K)), "k": rng.standard_normal((1, Tt, H, K)),
             "v": rng.standard_normal((1, Tt, HV, V)),
             "a": gate_logits(rng, (1, Tt, HV, K) if kda else (1, Tt, HV)),
             "b": rng.standard_normal((1, Tt, HV))}
        t = {n: fw.from64(v) for n, v in x.items()}
        At, Dt = fw.from64(A_log), fw.from64(dt_bias)
        inter = fw.full((N, max(lens), HV, V, K), 0.0)
        out_a = fw.full((1, Tt, HV, V), float("nan"))
        out_b = fw.full((1, Tt, HV, V), float("nan"))
        plain = fw.from64(to64(ck[layer]))
        ds.verify(t["q"], t["k"], t["v"], t["a"], t["b"], out_a, plain, fw.idx(live),
                  A_log=At, dt_bias=Dt, is_kda=kda, cu_seqlens=cu, update_state=False,
                  intermediate_states=inter)
        ds.verify(t["q"], t["k"], t["v"], t["a"], t["b"], out_b, ck[layer], fw.idx(live),
                  A_log=At, dt_bias=Dt, is_kda=kda, cu_seqlens=cu, update_state=False,
                  **{n: r[layer] for n, r in rings.items()})
        np.testing.assert_array_equal(out_a, out_b, err_msg="the ring changes no output")
        snaps[layer] = to64(inter)
        # the raw ring: v, pre-norm k as given, per-step records at t < L only
        starts = np.concatenate([[0], np.cumsum(lens)])
        for n, s in enumerate(live):
            if s < 0:
                continue
            for j in range(lens[n]):
                np.testing.assert_array_equal(to64(rings["ring_v"][layer, s, :, j]),
                                              to64(t["v"])[0, starts[n] + j])
                np.testing.assert_array_equal(to64(rings["ring_k"][layer, s, :, j]),
                                              to64(t["k"])[0, starts[n] + j])
        # the fp64 reference of the accepted prefix
        for n, s in enumerate(live):
            if s >= 0 and accepted[n]:
                rows = slice(starts[n], starts[n] + lens[n])
                _, states = ref.verify_sequence(before[layer, s], x["q"][0, rows],
                                                x["k"][0, rows], x["v"][0, rows],
                                                x["a"][0, rows], x["b"][0, rows], kda=kda,
                                                A_log=A_log, dt_bias=dt_bias)
                snaps[(layer, n)] = states[accepted[n] - 1]
    ret = ds.replayssm_fold_commit(ck, rings["ring_v"], rings["ring_k"], rings["ring_g"],
                                   rings["ring_beta"], fw.idx(live), fw.idx(accepted, "int64"),
                                   fw.idx(track_slots), fw.idx(track_steps), is_kda=kda)
    assert ret is None
    got = to64(ck)
    changed = set()
    for layer in range(LAYERS):
        for n, s in enumerate(live):
            if s < 0 or accepted[n] == 0:
                continue
            changed.add(s)
            np.testing.assert_array_equal(got[layer, s], snaps[layer][n, accepted[n] - 1])
            assert_close(got[layer, s], snaps[(layer, n)], (1e-5, 1e-4), what="fp64 reference")
            ts, st = track_slots[n], track_steps[n]
            if ts >= 0 and 0 <= st < accepted[n]:
                changed.add(ts)
                np.testing.assert_array_equal(got[layer, ts], snaps[layer][n, st])
    assert changed == {4, 5, 3}
    # every element outside the changed slots' states is bit-unchanged (gaps, other slots)
    inner = HV * V * K
    entry = LAYERS * inner + 16
    mask = np.ones(flat.shape[0], bool)
    for s in changed:
        for layer in range(LAYERS):
            start = 8 + s * entry + layer * inner
            mask[start:start + inner] = False
    np.testing.assert_array_equal(flat.view(np.uint32)[mask], flat_bits[mask])


def test_sglang_names_equal_core(tfw, rng):
    """commit_kda_replayssm_spec (one layer, null_block_id 0) and the all-layers twins equal the
    core op."""
    import torch
    fw = tfw
    ck = torch.randn(LAYERS, SLOTS, HV, V, K)
    rings = {n: torch.randn(*r.shape) * 0.3 for n, r in _rings(fw, True).items()}
    rings["ring_g"] = -rings["ring_g"].abs()
    rings["ring_beta"] = rings["ring_beta"].abs()
    idx = torch.tensor([3, 0, 1], dtype=torch.int32)  # slot 0: SGLang's null block for KDA
    acc = torch.tensor([2, 4, 3], dtype=torch.int32)
    want = ck.clone()
    ds.replayssm_fold_commit(want, *rings.values(), idx, acc, is_kda=True, null_block_id=0)
    got = ck.clone()
    ds.commit_kda_replayssm_spec_all_layers(got, *rings.values(), idx, acc, L, H)
    assert torch.equal(got, want)
    one = ck[1].clone()
    ds.commit_kda_replayssm_spec(one, *(r[1] for r in rings.values()), idx, acc, L, H)
    assert torch.equal(one, want[1])
    assert torch.equal(want[:, 0], ck[:, 0]), "the null block is left alone"
    with pytest.raises(ValueError, match="max_cache_len=8 must be the rings' length"):
        ds.commit_kda_replayssm_spec(one, *(r[1] for r in rings.values()), idx, acc, 8, H)
    with pytest.raises(ValueError, match="num_k_heads=1 must be rawk_cache's key heads"):
        ds.commit_kda_replayssm_spec(one, *(r[1] for r in rings.values()), idx, acc, L, 1)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_sglang_verify_rings_with_the_safe_gate_then_commit(tfw, rng, kda):
    """SGLang's fused_sigmoid_gating_delta_rule_update with lower_bound (its position after
    is_kda) and cache_ring (KDA: a [S, HV, L, K] gate ring), then the commit of the accepted
    prefix (KDA: SGLang's commit_kda_replayssm_spec; GDN: replayssm_fold_commit, which SGLang's
    all-layers commit runs): the outputs and scratch are the core verify's with the safe gate bit
    for bit, and the committed checkpoint is the scratch state of the last accepted draft bit for
    bit."""
    import inspect

    import torch
    names = list(inspect.signature(ds.fused_sigmoid_gating_delta_rule_update).parameters)
    assert names[names.index("is_kda") + 1] == "lower_bound"
    live, T, lb = [4, -1, 1], L, -4.0
    N = len(live)
    ck = torch.from_numpy(rng.standard_normal((SLOTS, HV, V, K)) * 0.5).float()
    A_log, dt_bias = (torch.from_numpy(x).float() for x in gate_params(rng, HV, K, kda))
    q, k = (torch.from_numpy(rng.standard_normal((N, T, H, K))).float() for _ in range(2))
    v = torch.from_numpy(rng.standard_normal((N, T, HV, V))).float()
    a = torch.from_numpy(gate_logits(rng, (N, T, HV * K if kda else HV))).float()
    b = torch.from_numpy(rng.standard_normal((N, T, HV))).float()
    idx = torch.tensor(live, dtype=torch.int32)
    rings = {n: torch.full(r.shape, SENTINEL) for n, r in _rings(tfw, kda, layered=False).items()}
    scratch = torch.full((N, T, HV, V, K), SENTINEL)
    out = ds.fused_sigmoid_gating_delta_rule_update(
        A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, ck, idx, None, True, None, kda, lb,
        disable_state_update=True, intermediate_states_buffer=scratch,
        intermediate_state_indices=torch.arange(N, dtype=torch.int32), cache_steps=T,
        cache_ring=True, replayssm_rawv=rings["ring_v"], replayssm_rawk=rings["ring_k"],
        replayssm_g=rings["ring_g"], replayssm_beta=rings["ring_beta"])
    want = torch.full((N, T, HV, V), float("nan"))
    want_scratch = torch.full_like(scratch, SENTINEL)
    g = a.reshape(N, T, HV, K) if kda else a
    ds.verify(q, k, v, g, b, want, ck, idx, A_log=A_log,
              dt_bias=dt_bias.reshape(HV, K) if kda else dt_bias, is_kda=kda, lower_bound=lb,
              update_state=False, intermediate_states=want_scratch,
              intermediate_state_indices=torch.arange(N, dtype=torch.int32))
    assert torch.equal(out, want) and torch.equal(scratch, want_scratch)
    acc = torch.tensor([3, 2, 1], dtype=torch.int32)  # accepted drafts
    committed = ck.clone()
    if kda:
        ds.commit_kda_replayssm_spec(committed, *rings.values(), idx, acc, L, H)
    else:
        ds.replayssm_fold_commit(committed, *rings.values(), idx, acc, is_kda=False)
    for n, s in enumerate(live):
        if s >= 0:
            assert torch.equal(committed[s], scratch[n, acc[n] - 1]), f"row {n}"
    for s in range(SLOTS):
        if s not in live:
            assert torch.equal(committed[s], ck[s]), f"slot {s} written"
    with pytest.raises(AssertionError, match="cache_ring expects per-layer ring views"):
        wrong = torch.zeros(SLOTS, HV, L) if kda else torch.zeros(SLOTS, HV, L, K)
        ds.fused_sigmoid_gating_delta_rule_update(
            A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, ck, idx, is_kda=kda,
            disable_state_update=True, cache_ring=True, replayssm_rawv=rings["ring_v"],
            replayssm_rawk=rings["ring_k"], replayssm_g=wrong, replayssm_beta=rings["ring_beta"])


def test_errors(tfw):
    import torch
    ck = torch.zeros(LAYERS, SLOTS, HV, V, K)
    r = {n: torch.zeros(*t.shape) for n, t in _rings(tfw, False).items()}
    idx = torch.tensor([1, 2], dtype=torch.int32)
    acc = torch.tensor([1, 1], dtype=torch.int32)

    def call(**kw):
        a = dict(state=ck, rawv=r["ring_v"], rawk=r["ring_k"], g=r["ring_g"],
                 beta=r["ring_beta"], state_indices=idx, accept_lens=acc)
        a.update(kw)
        before = ck.clone()
        with pytest.raises(ValueError) as e:
            ds.replayssm_fold_commit(**a)
        assert torch.equal(ck, before)
        return str(e.value)

    assert "`checkpoint_state` must be [layers, slots, HV, V, K] or [slots, HV, V, K]" in call(
        state=ck[0, 0])
    assert "`null_block_id` must be >= -1 (got -2)" in call(null_block_id=-2)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    assert "`mamba_track_indices`[0]=2 is a live slot of this batch" in call(
        track_indices=i32([2, 4]), steps_to_track=i32([0, 0]))
    assert "`mamba_track_indices`[1]=4 repeats another row's track slot" in call(
        track_indices=i32([4, 4]), steps_to_track=i32([0, 0]))
    assert "`rawk_cache` must have shape (2, 6, 2, 4, 16) (got (2, 6, 2, 5, 16))." in call(
        rawk=torch.zeros(LAYERS, SLOTS, H, L + 1, K))
    assert "`rawv_cache` must have shape (2, 6, 4, 4, 8) (got (2, 5, 4, 4, 8))." in call(
        rawv=torch.zeros(LAYERS, SLOTS - 1, HV, L, V))
    assert "`g_cache` must have shape (2, 6, 4, 4) (got (2, 6, 4, 4, 16))." in call(
        g=torch.zeros(LAYERS, SLOTS, HV, L, K))
    assert "`beta_cache` must be float32 (got torch.bfloat16)." in call(
        beta=r["ring_beta"].bfloat16())
    assert "`rawk_cache` must be contiguous below its slot dimension" in call(
        rawk=torch.zeros(LAYERS, SLOTS, H, K, L).transpose(-1, -2))
    assert "`ssm_state_indices`[1]=6 is out of range for a pool of 6 slots" in call(
        state_indices=torch.tensor([1, 6], dtype=torch.int32))
    assert "`ssm_state_indices`[1]=1 repeats a live slot of this batch" in call(
        state_indices=torch.tensor([1, 1], dtype=torch.int32))
    assert "`accept_lens`[0]=5 exceeds the ring's length L=4" in call(
        accept_lens=torch.tensor([5, 1], dtype=torch.int32))
    assert "`mamba_track_indices` and `mamba_steps_to_track` go together" in call(
        track_indices=idx)
    assert "`mamba_track_indices`[0]=9 is out of range for a pool of 6 slots" in call(
        track_indices=torch.tensor([9, -1]), steps_to_track=torch.tensor([0, 0]))
    # a track slot past the pool is fine when its step is not reached
    ds.replayssm_fold_commit(ck, r["ring_v"], r["ring_k"], r["ring_g"], r["ring_beta"], idx, acc,
                             torch.tensor([9, -1]), torch.tensor([1, 0]))
    # A quantized checkpoint: the commits store the folded state as a float state (no scales, no
    # rounding key), so both refuse it, naming the issue, before anything is written.
    text = (r"`checkpoint_state` is a quantized state \(torch.float8_e4m3fn\): this op does not "
            r"take quantized states yet \(issue #36")
    q8 = torch.zeros(LAYERS, SLOTS, HV, V, K, dtype=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match=text):
        ds.replayssm_fold_commit(q8, r["ring_v"], r["ring_k"], r["ring_g"], r["ring_beta"], idx,
                                 acc)
    dk = torch.zeros(LAYERS, 2, HV, L, V)
    with pytest.raises(NotImplementedError, match=text):
        ds.replayssm_circular_commit(q8, dk, torch.zeros(LAYERS, 2, H, L, K),
                                     torch.zeros(LAYERS, 2, HV, L), idx, idx, idx, idx, idx, acc)
    assert not q8.view(torch.uint8).any(), "a refused commit wrote the checkpoint"
    # the verify's ring
    q = torch.zeros(1, 2, H, K)
    with pytest.raises(ValueError, match="cache_ring needs all four raw rings"):
        ds.verify(q, q, torch.zeros(1, 2, HV, V), torch.zeros(1, 2, HV), torch.zeros(1, 2, HV),
                  torch.zeros(1, 2, HV, V), ck[0], torch.tensor([1]), A_log=torch.zeros(HV),
                  dt_bias=torch.zeros(HV), update_state=False, ring_v=r["ring_v"][0])
    with pytest.raises(ValueError, match="cache_ring expects per-layer ring views: "
                                         "`replayssm_rawv` must be a contiguous tensor"):
        ds.verify(q, q, torch.zeros(1, 2, HV, V), torch.zeros(1, 2, HV), torch.zeros(1, 2, HV),
                  torch.zeros(1, 2, HV, V), ck[0], torch.tensor([1]), A_log=torch.zeros(HV),
                  dt_bias=torch.zeros(HV), update_state=False, ring_v=r["ring_v"],
                  ring_k=r["ring_k"][0], ring_g=r["ring_g"][0], ring_beta=r["ring_beta"][0])
