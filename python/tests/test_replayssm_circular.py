"""The compact circular commit (`replayssm_circular_commit`, SGLang's
`commit_gdn_replayssm_circular`) on CPU tensors: every layer of an envelope pool against a float64
replay of the ring's records (S <- e^g S + (d + d_res)(k + k_res)^T), capacity rows and track rows
at random ring origins, the cursors after it, untouched slots and gaps bit-unchanged; and the
scheme end to end: gdn_replayssm_spec_decode (launch_mode='verify', bf16 d/k rings with the
hi/lo residual ring) + commit_gdn_replayssm_spec + the circular commit at capacity, against the
intermediate-state verify's committed states. (SGLang's own tests of the function:
peer/test_sglang_replayssm_circular.py.)"""

import numpy as np
import pytest

import deltastate as ds
from cases import gate_logits, gate_params
from helpers import SENTINEL, Fw, assert_close, to64

H, HV, K, V = 2, 4, 16, 8
LAYERS, SLOTS, R, L = 2, 6, 5, 8


def _replay64(S0, d, k, g, base, m):
    """float64: S0 [HV, V, K] after the first m records of a ring at origin base."""
    S = np.array(S0, np.float64)
    group = HV // H
    for j in range(m):
        p = (base + j) % L
        for hv in range(HV):
            S[hv] = np.exp(g[hv, p]) * S[hv] + np.outer(d[hv, p], k[hv // group, p])
    return S


@pytest.mark.parametrize("residual", [False, True])
def test_matches_float64_replay(rng, residual):
    fw = Fw("numpy")
    inner = HV * V * K
    entry = LAYERS * inner + 16
    flat = fw.full((SLOTS * entry + 8,), SENTINEL)
    ck = fw.as_strided(flat, (LAYERS, SLOTS, HV, V, K), (inner, entry, V * K, K, 1), 8)
    for layer in range(LAYERS):
        for s in range(SLOTS):
            fw.assign(ck[layer, s], rng.standard_normal((HV, V, K)) * 0.5, "float32")
    d = fw.from64(rng.standard_normal((LAYERS, R, HV, L, V)) * 0.3)
    k = fw.from64(rng.standard_normal((LAYERS, R, H, L, K)) * 0.3)
    g = fw.from64(-rng.uniform(0.01, 0.5, (LAYERS, R, HV, L)))
    dr = fw.from64(rng.standard_normal((LAYERS, R, HV, L, V)) * 1e-3) if residual else None
    kr = fw.from64(rng.standard_normal((LAYERS, R, H, L, K)) * 1e-3) if residual else None
    slots, rows = [4, -1, 1, 2], [3, 0, 0, 4]
    wp_rows = np.zeros(R, np.int64)
    base_rows = rng.integers(0, L, R)
    flush_rows = np.zeros(R, np.int64)
    wp_rows[3], wp_rows[0], wp_rows[4] = 6, 5, 3
    flush_rows[3], flush_rows[0], flush_rows[4] = 1, 0, 1
    accepted = [2, 1, 3, 1]
    track, steps = [5, 0, 3, -1], [0, 0, 1, 0]  # row 1 padded; row 3 no track
    before = to64(ck).copy()
    bits = flat.view(np.uint32).copy()
    t = {n: fw.idx(v) for n, v in (("wp", wp_rows), ("base", base_rows), ("fl", flush_rows))}
    with pytest.raises(ValueError, match=r"`null_block_id` must be >= -1 \(got -2\)"):
        ds.replayssm_circular_commit(ck, d, k, g, fw.idx(slots), fw.idx(rows), t["wp"],
                                     t["base"], t["fl"], fw.idx(accepted), dr, kr, fw.idx(track),
                                     fw.idx(steps), null_block_id=-2)
    for bad_track, text in (([5, 0, 4, -1], r"`mamba_track_indices`\[2\]=4 is a live slot"),
                            ([5, 0, 5, -1], r"`mamba_track_indices`\[2\]=5 repeats another row")):
        with pytest.raises(ValueError, match=text):
            ds.replayssm_circular_commit(ck, d, k, g, fw.idx(slots), fw.idx(rows), t["wp"],
                                         t["base"], t["fl"], fw.idx(accepted), dr, kr,
                                         fw.idx(bad_track), fw.idx(steps))
    assert np.array_equal(flat.view(np.uint32), bits), "a refused call wrote the checkpoint"
    ds.replayssm_circular_commit(ck, d, k, g, fw.idx(slots), fw.idx(rows), t["wp"], t["base"],
                                 t["fl"], fw.idx(accepted), dr, kr, fw.idx(track), fw.idx(steps))
    d64, k64, g64 = to64(d), to64(k), to64(g)
    if residual:
        d64, k64 = d64 + to64(dr), k64 + to64(kr)
    got = to64(ck)
    changed = set()
    for n, (s, r) in enumerate(zip(slots, rows)):
        if s < 0:
            continue
        for layer in range(LAYERS):
            args = (d64[layer, r], k64[layer, r], g64[layer, r], base_rows[r])
            if flush_rows[r]:
                want = _replay64(before[layer, s], *args, wp_rows[r])
                assert_close(got[layer, s], want, (1e-5, 1e-4), what=f"fold seq {n}")
                changed.add(s)
            if track[n] >= 0 and steps[n] >= 0:
                m = wp_rows[r] - accepted[n] + steps[n] + 1
                want = _replay64(before[layer, s], *args, max(m, 0))
                assert_close(got[layer, track[n]], want, (1e-5, 1e-4), what=f"track seq {n}")
                changed.add(track[n])
    np.testing.assert_array_equal(to64(t["wp"]), [5, 0, 0, 0, 0])
    np.testing.assert_array_equal(
        to64(t["base"]), [base_rows[0], base_rows[1], base_rows[2], (base_rows[3] + 6) % L,
                          (base_rows[4] + 3) % L])
    np.testing.assert_array_equal(to64(t["fl"]), [0, 0, 0, 0, 0])
    mask = np.ones(flat.shape[0], bool)
    for s in changed:
        for layer in range(LAYERS):
            start = 8 + s * entry + layer * inner
            mask[start:start + inner] = False
    np.testing.assert_array_equal(flat.view(np.uint32)[mask], bits[mask])


def test_scheme_with_residual_ring(rng, tfw):
    """gdn_replayssm_spec_decode (launch_mode='verify': no row folds in it) with bf16 d/k rings
    and the residual ring, commit_gdn_replayssm_spec, then commit_gdn_replayssm_circular when a
    row reaches capacity: the materialized checkpoint follows the intermediate-state verify's
    committed state over 60 steps, within 2e-3 with the residuals (the compact commit's point:
    the residual restores what the bf16 records lost)."""
    import torch
    L_, Tm, N = 8, 2, 2
    A_log, dt_bias = gate_params(rng, HV, K, False)
    At, Dt = tfw.from64(A_log), tfw.from64(dt_bias)
    ck = torch.from_numpy(rng.standard_normal((1, N + 1, HV, V, K)).astype(np.float32)) * 0.5
    plain = ck[0].clone()
    rings = (torch.zeros(1, N + 1, HV, L_, V, dtype=torch.bfloat16),
             torch.zeros(1, N + 1, H, L_, K, dtype=torch.bfloat16), torch.zeros(1, N + 1, HV, L_))
    res = (torch.zeros(1, N + 1, HV, L_, V, dtype=torch.bfloat16),
           torch.zeros(1, N + 1, H, L_, K, dtype=torch.bfloat16))
    wp, base = torch.zeros(N + 1, dtype=torch.int32), torch.zeros(N + 1, dtype=torch.int32)
    fl = torch.zeros(N + 1, dtype=torch.int8)
    idx = torch.tensor([1, 2], dtype=torch.int32)
    inter = torch.zeros(N, Tm, HV, V, K)
    worst = 0.0
    for step in range(60):
        Tt = N * Tm
        x = {"q": rng.standard_normal((Tt, H, K)), "k": rng.standard_normal((Tt, H, K)),
             "v": rng.standard_normal((Tt, HV, V)), "a": gate_logits(rng, (Tt, HV)) * 0.5,
             "b": rng.standard_normal((Tt, HV))}
        t = {n: tfw.from64(v) for n, v in x.items()}
        qsl = torch.arange(0, Tt + 1, Tm, dtype=torch.int32)
        out = torch.full((Tt, HV, V), float("nan"))
        ds.gdn_replayssm_spec_decode(t["q"], t["k"], t["v"], t["a"], t["b"], At, Dt, ck[0],
                                     *(r[0] for r in rings), res[0][0], res[1][0], None, out,
                                     qsl, idx, idx, wp, base, fl, L_, Tm, launch_mode="verify")
        out_p = torch.full((1, Tt, HV, V), float("nan"))
        ds.verify(t["q"][None], t["k"][None], t["v"][None], t["a"][None], t["b"][None], out_p,
                  plain, idx, A_log=At, dt_bias=Dt, cu_seqlens=qsl, update_state=False,
                  intermediate_states=inter)
        acc = torch.tensor([int(rng.integers(1, Tm + 1)) for _ in range(N)], dtype=torch.int32)
        # SGLang's compact scheme: the cursor commit never folds (the circular commit does)
        fl.zero_()
        ds.commit_gdn_replayssm_spec(wp, base, fl, acc, idx, L_, Tm)
        ds.update_state_after_verify(plain, inter, idx, acc)
        ds.commit_gdn_replayssm_circular(
            checkpoint_state=ck, d_cache=rings[0], k_cache=rings[1], g_cache=rings[2],
            d_residual_cache=res[0], k_residual_cache=res[1], state_batch_indices=idx,
            replay_indices=idx, write_pos=wp, cache_base=base, is_flush=fl, accept_lens=acc)
        for s in (1, 2):
            if wp[s] == 0:  # just materialized
                err = float((ck[0, s] - plain[s]).abs().max())
                worst = max(worst, err)
                assert err < 2e-3, (step, err)
    assert worst > 0
