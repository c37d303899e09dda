"""ReplaySSM speculative verify through the Python surface: the core `replayssm_verify` /
`replayssm_commit` and SGLang's `gdn_replayssm_spec_decode` / `commit_gdn_replayssm_spec`, over
random accept/reject steps with forced folds, against the numpy float64 reference
(reference.verify_sequence from the committed state) and bit for bit against the
intermediate-state verify (`verify` + `update_state_after_verify`) with fp32 checkpoints and
rings; bf16 checkpoints; padded sequences, envelope pools with sentinel slots left
bit-untouched, NaN-poisoned outputs, the cursors against the commit's rule; the SGLang surface's
differences and errors."""

import inspect

import numpy as np
import pytest

import deltastate as ds
import reference as ref
from cases import gate_logits, gate_params
from helpers import SENTINEL, PoolBuf, assert_close, poison, to64

H, HV, K, V = 2, 4, 32, 16
TOL_OUT = {"float32": (1e-4, 1e-3), "bfloat16": (3e-3, 1e-2)}
TOL_FOLD = {"float32": (1e-4, 1e-3), "bfloat16": (4e-3, 1e-2)}


def _window(rng, fw, lens, kda, A_log, dt_bias):
    """One verify window, varlen: q, k [1, T, H, K], v [1, T, HV, V], a, b; fp32."""
    T = int(sum(lens))
    d = {"q": rng.standard_normal((1, T, H, K)), "k": rng.standard_normal((1, T, H, K)),
         "v": rng.standard_normal((1, T, HV, V)),
         "a": gate_logits(rng, (1, T, HV, K) if kda else (1, T, HV)),
         "b": rng.standard_normal((1, T, HV))}
    t = {n: fw.from64(x) for n, x in d.items()}
    t["cu"] = fw.idx(np.concatenate([[0], np.cumsum(lens)]))
    t["A_log"], t["dt_bias"] = fw.from64(A_log), fw.from64(dt_bias)
    return t, {n: to64(x) for n, x in t.items()}


class Cursors:
    """The slot-keyed cursors and what the test expects of them."""

    def __init__(self, fw, slots, L, T, rng, live):
        self.L, self.T = L, T
        self.wp = np.zeros(slots, np.int64)
        self.base = np.zeros(slots, np.int64)
        self.flush = np.zeros(slots, np.int64)
        for s in live:
            self.base[s] = rng.integers(0, L)
        self.t = {n: fw.idx(getattr(self, n)) for n in ("wp", "base", "flush")}
        self.fw = fw

    def push(self):
        for n in ("wp", "base", "flush"):
            self.fw.assign(self.t[n], getattr(self, n), "int32")

    def commit(self, s, a):
        if self.flush[s]:
            if a > 0:
                self.base[s] = (self.base[s] + self.wp[s]) % self.L
            self.wp[s] = a
        else:
            self.wp[s] += a
        self.flush[s] = int(self.wp[s] + 2 * self.T > self.L)

    def check(self):
        for n in ("wp", "base", "flush"):
            np.testing.assert_array_equal(to64(self.t[n]), getattr(self, n), err_msg=n)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_random_steps_match_reference_and_intermediate_verify(rng, fw, kda, state_dtype):
    if not fw.supports(state_dtype):
        pytest.skip("numpy has no bfloat16")
    N, slots, L, T, steps = 3, 6, 16, 4, 40
    live = [4, -1, 1]
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    ck = PoolBuf(fw, slots, HV, V, K, state_dtype, rng, [s for s in live if s >= 0])
    plain = PoolBuf(fw, slots, HV, V, K, state_dtype, rng, [])
    plain.flat[...] = ck.flat
    truth = {s: ck.state64()[s] for s in live if s >= 0}  # fp64 committed states
    d_cache = fw.full((slots, HV, L, V), SENTINEL)
    k_cache = fw.full((slots, H, L, K), SENTINEL)
    g_cache = fw.full((slots, HV, L, K) if kda else (slots, HV, L), SENTINEL)
    cur = Cursors(fw, slots, L, T, rng, [s for s in live if s >= 0])
    idx = fw.idx(live)
    inter = fw.full((N, T, HV, V, K), 0.0, state_dtype)
    folds = 0
    for step in range(steps):
        lens = rng.integers(1, T + 1, N)
        t, r = _window(rng, fw, lens, kda, A_log, dt_bias)
        for s in truth:
            if rng.random() < 0.1:
                cur.flush[s] = 1  # a forced fold
        cur.push()
        ring_before = [to64(x).copy() for x in (d_cache, k_cache, g_cache)]
        ck_before = ck.bits()
        out = poison(fw, (1, int(lens.sum()), HV, V), "float32")
        ret = ds.replayssm_verify(t["q"], t["k"], t["v"], t["a"], t["b"], out, ck.view, idx,
                                  d_cache, k_cache, g_cache, cur.t["wp"], cur.t["base"],
                                  cur.t["flush"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                                  is_kda=kda, cu_seqlens=t["cu"])
        assert ret is out
        got = to64(out)[0]
        starts = np.concatenate([[0], np.cumsum(lens)])
        folded = [live[n] for n in range(N)
                  if live[n] >= 0 and cur.flush[live[n]] and cur.wp[live[n]] > 0]
        ck.assert_untouched_outside(ck_before, folded, "replayssm_verify")
        # The ring: only the drafts' positions changed.
        for arr, before in zip((d_cache, k_cache, g_cache), ring_before):
            now = to64(arr)
            mask = np.zeros(now.shape, bool)
            for n in range(N):
                s = live[n]
                if s >= 0:
                    for j in range(lens[n]):
                        mask[s, :, (cur.base[s] + cur.wp[s] + j) % L] = True
            np.testing.assert_array_equal(now[~mask], before[~mask])
        # The intermediate-state verify from the committed pool, and the fp64 reference.
        out_p = poison(fw, (1, int(lens.sum()), HV, V), "float32")
        ds.verify(t["q"], t["k"], t["v"], t["a"], t["b"], out_p, plain.view, idx,
                  A_log=t["A_log"], dt_bias=t["dt_bias"], is_kda=kda, cu_seqlens=t["cu"],
                  update_state=False, intermediate_states=inter)
        want_states = {}
        for n in range(N):
            rows = slice(starts[n], starts[n + 1])
            s = live[n]
            if s < 0:
                assert np.all(got[rows] == 0), "padded sequence"
                continue
            if s in folded:
                folds += 1
                assert_close(ck.state64()[s], truth[s], TOL_FOLD[state_dtype], state_dtype,
                             what=f"folded checkpoint step {step}")
                if state_dtype == "float32":
                    np.testing.assert_array_equal(ck.state64()[s], plain.state64()[s])
            if state_dtype == "float32":
                np.testing.assert_array_equal(got[rows], to64(out_p)[0, rows])
            wo, ws = ref.verify_sequence(truth[s], r["q"][0, rows], r["k"][0, rows],
                                         r["v"][0, rows], r["a"][0, rows], r["b"][0, rows],
                                         kda=kda, A_log=r["A_log"], dt_bias=r["dt_bias"])
            want_states[n] = ws
            assert_close(got[rows], wo, TOL_OUT[state_dtype], "float32",
                         what=f"step {step} seq {n}")
        accepted = [int(rng.integers(0 if rng.random() < 0.05 else 1, lens[n] + 1))
                    for n in range(N)]
        acc = fw.idx(accepted, "int64")
        assert ds.replayssm_commit(cur.t["wp"], cur.t["base"], cur.t["flush"], acc, idx, L,
                                   T) is cur.t["wp"]
        ds.update_state_after_verify(plain.view, inter, idx, acc)
        for n in range(N):
            s = live[n]
            if s >= 0:
                cur.commit(s, accepted[n])
                if accepted[n] > 0:
                    truth[s] = want_states[n][accepted[n] - 1]
        cur.check()
    assert folds > 0


def _sglang_setup(tfw, rng, slots=5, L=8, T=3, rows=None, ring_dtype="float32", raw=True):
    """SGLang's spec-decode inputs: three sequences (lens 3, 2, 3), checkpoint slots [slots],
    request-keyed rings and cursors [rows] (default: as many as slots), sentinel-filled rings."""
    torch = pytest.importorskip("torch")
    rows = slots if rows is None else rows
    A_log, dt_bias = gate_params(rng, HV, K, False)
    lens = [3, 2, 3]
    Tt = sum(lens)
    x = {"q": rng.standard_normal((Tt, H, K)), "k": rng.standard_normal((Tt, H, K)),
         "v": rng.standard_normal((Tt, HV, V)), "a": gate_logits(rng, (Tt, HV)),
         "b": rng.standard_normal((Tt, HV))}
    t = {n: tfw.from64(v) for n, v in x.items()}
    t["A_log"], t["dt_bias"] = tfw.from64(A_log), tfw.from64(dt_bias)
    t["qsl"] = tfw.idx([0, 3, 5, 8])
    ck = torch.from_numpy(rng.standard_normal((slots, HV, V, K)).astype(np.float32))
    dt = getattr(torch, ring_dtype)
    rings = (torch.full((rows, HV, L, V), SENTINEL).to(dt),
             torch.full((rows, H, L, K), SENTINEL).to(dt), torch.full((rows, HV, L), SENTINEL))
    raws = (torch.full((rows, HV, L, V), SENTINEL), torch.full((rows, H, L, K), SENTINEL),
            torch.full((rows, HV, L), SENTINEL)) if raw else (None, None, None)
    wp = torch.zeros(rows, dtype=torch.int32)
    base = torch.zeros(rows, dtype=torch.int32)
    fl = torch.zeros(rows, dtype=torch.int8)
    for r, (w, b, f) in zip((1, 2, 4), ((2, 5, 0), (1, 7, 1), (3, 1, 0))):
        if r < rows:
            wp[r], base[r], fl[r] = w, b, f
    # committed records in the rings (random values; the verify only reads them)
    for ring in rings + tuple(r for r in raws if r is not None):
        ring.copy_(torch.from_numpy(rng.standard_normal(tuple(ring.shape))).to(ring.dtype) * 0.3)
    rings[2].copy_(-rings[2].abs())  # log decays
    return t, ck, rings, raws, (wp, base, fl), lens


def _spec(t, ck, rings, raws, out, idx, ridx, cursors, L=8, Tmax=3, **kw):
    return ds.gdn_replayssm_spec_decode(t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"],
                                        t["dt_bias"], ck, *rings, *raws, out, t["qsl"], idx,
                                        ridx, *cursors, L, Tmax, **kw)


def _clone(*xs):
    return tuple(None if x is None else x.clone() for x in xs)


def test_sglang_surface_equals_core(tfw, rng):
    """gdn_replayssm_spec_decode and commit_gdn_replayssm_spec (SGLang's argument order,
    null_block_id=0: slot 0 is the null block; checkpoint slots apart from the request-keyed
    rings and cursors; int8 is_flush; the exact-raw ring) equal the core ops."""
    import torch
    t, ck, rings, raws, (wp, base, fl), lens = _sglang_setup(tfw, rng, slots=6, rows=5)
    idx = torch.tensor([3, 0, 5], dtype=torch.int32)   # checkpoint slots (row 1: the null block)
    ridx = torch.tensor([2, 0, 4], dtype=torch.int64)  # ring and cursor rows
    ck2, rings2, raws2 = ck.clone(), _clone(*rings), _clone(*raws)
    ck0 = ck.clone()
    out = torch.full((8, HV, V), float("nan"))
    ret = _spec(t, ck, rings, raws, out, idx, ridx, (wp, base, fl))
    assert ret is out
    out2 = torch.full((1, 8, HV, V), float("nan"))
    ds.replayssm_verify(t["q"][None], t["k"][None], t["v"][None], t["a"][None], t["b"][None],
                        out2, ck2, idx, *rings2, wp, base, fl, A_log=t["A_log"],
                        dt_bias=t["dt_bias"], cu_seqlens=t["qsl"], null_block_id=0,
                        replay_indices=ridx, rawv_cache=raws2[0], rawk_cache=raws2[1],
                        beta_cache=raws2[2])
    assert torch.equal(out, out2[0])
    assert torch.all(out[3:5] == 0), "the null block's rows are zero"
    assert torch.equal(ck, ck2)
    for a, b in zip(rings + raws, rings2 + raws2):
        assert torch.equal(a, b)
    # Slot 3 (ring row 2, folding with one record) holds the fold; slot 5 (row 4, appending)
    # and every other slot are bit-untouched.
    assert not torch.equal(ck[3], ck0[3])
    for s in (0, 1, 2, 4, 5):
        assert torch.equal(ck[s], ck0[s])
    wp2, base2, fl2 = wp.clone(), base.clone(), fl.clone()
    acc = torch.tensor([2, 1, 3], dtype=torch.int32)
    assert ds.commit_gdn_replayssm_spec(wp, base, fl, acc, ridx, 8, 3) is None
    ds.replayssm_commit(wp2, base2, fl2, acc, ridx, 8, 3, null_block_id=0)
    assert torch.equal(wp, wp2) and torch.equal(base, base2) and torch.equal(fl, fl2)
    assert fl.dtype == torch.int8
    # row 2 was folding: its cursor restarts at the accepted count, its origin moves by wp.
    assert wp[2] == 2 and base[2] == (7 + 1) % 8 and fl[2] == 0
    assert wp[4] == 3 + 3 and fl[4] == 1  # 6 + 2 * 3 > 8: the next step folds
    assert wp[0] == 0, "the null block's cursor is left alone"


def test_sglang_exact_fold_is_the_recurrent_state(tfw, rng):
    """A folding row's checkpoint after the exact-raw fold is the recurrent op's state after its
    committed raw tokens, bit for bit, although the d/k rings are bfloat16; its outputs are the
    recurrent op's outputs from there."""
    import torch
    L = 8
    t, ck, rings, raws, (wp, base, fl), lens = _sglang_setup(tfw, rng, L=L,
                                                             ring_dtype="bfloat16")
    idx = torch.tensor([1, 2, 4], dtype=torch.int32)
    # The committed raw tokens of slot 2 (is_flush=1, wp=1, base=7): made consistent with g and
    # beta rings as the recurrent op computes them, by running the recurrent op on them.
    s, m, b0 = 2, int(wp[2]), int(base[2])
    a_c = torch.from_numpy(gate_logits(rng, (1, m, HV))).float()
    b_c = torch.randn(1, m, HV)
    k_c, v_c = torch.randn(1, m, H, K), torch.randn(1, m, HV, V)
    q_c = torch.randn(1, m, H, K)
    # their g and beta as the verify op writes them: run a verify with those tokens as drafts
    # into a scratch fp32 ring with the exact-raw ring attached
    sc = (torch.zeros(1, HV, L, V), torch.zeros(1, H, L, K), torch.zeros(1, HV, L))
    sr = (torch.zeros(1, HV, L, V), torch.zeros(1, H, L, K), torch.zeros(1, HV, L))
    z = torch.zeros(1, dtype=torch.int32)
    ck0 = ck[s:s + 1].clone()
    ds.replayssm_verify(q_c, k_c, v_c, a_c, b_c, torch.empty(1, m, HV, V), ck0,
                        torch.zeros(1, dtype=torch.int32), *sc, z, z.clone(), z.clone(),
                        A_log=t["A_log"], dt_bias=t["dt_bias"], rawv_cache=sr[0],
                        rawk_cache=sr[1], beta_cache=sr[2])
    for j in range(m):
        p = (b0 + j) % L
        raws[0][s, :, p], raws[1][s, :, p], raws[2][s, :, p] = sr[0][0, :, j], sr[1][0, :, j], \
            sr[2][0, :, j]
        rings[2][s, :, p] = sc[2][0, :, j]
    # the recurrent op over the committed tokens then the drafts, from the old checkpoint
    want_state = ck[s:s + 1].clone()
    n0, n1 = 3, 5  # sequence 1's drafts: tokens 3..4
    qq = torch.cat([q_c, t["q"][None, n0:n1]], 1)
    kk = torch.cat([k_c, t["k"][None, n0:n1]], 1)
    vv = torch.cat([v_c, t["v"][None, n0:n1]], 1)
    aa = torch.cat([a_c, t["a"][None, n0:n1]], 1)
    bb = torch.cat([b_c, t["b"][None, n0:n1]], 1)
    o_rec = torch.empty(1, m + n1 - n0, HV, V)
    mid = ck[s:s + 1].clone()
    ds.verify(qq[:, :m], kk[:, :m], vv[:, :m], aa[:, :m], bb[:, :m], torch.empty(1, m, HV, V),
              mid, torch.zeros(1, dtype=torch.int32), A_log=t["A_log"], dt_bias=t["dt_bias"],
              update_state=True)
    ds.verify(qq, kk, vv, aa, bb, o_rec, want_state, torch.zeros(1, dtype=torch.int32),
              A_log=t["A_log"], dt_bias=t["dt_bias"], update_state=False)
    out = torch.full((8, HV, V), float("nan"))
    _spec(t, ck, rings, raws, out, idx, idx, (wp, base, fl), L=L)
    assert torch.equal(ck[s], mid[0]), "the exact fold is the recurrent op's state"
    assert torch.equal(out[n0:n1], o_rec[0, m:]), "outputs from the folded checkpoint"


def test_sglang_launch_modes_split_both(tfw, rng):
    """launch_mode='verify' then 'flush' writes exactly what 'both' writes; 'verify' leaves the
    folding rows' outputs alone, 'flush' the others' (and the padded rows')."""
    import torch
    t, ck, rings, raws, cursors, lens = _sglang_setup(tfw, rng)
    idx = torch.tensor([1, 0, 2], dtype=torch.int32)  # seq 1 padded; slot 2 folds
    state = (ck,) + rings + raws
    split = _clone(*state)
    out = torch.full((8, HV, V), float("nan"))
    _spec(t, ck, rings, raws, out, idx, idx, cursors)
    out_v = torch.full((8, HV, V), float("nan"))
    _spec(t, split[0], split[1:4], split[4:], out_v, idx, idx, cursors, launch_mode="verify")
    assert torch.isnan(out_v[5:8]).all(), "verify: the folding row's outputs are not written"
    assert torch.equal(out_v[:5], out[:5])
    out_f = torch.full((8, HV, V), float("nan"))
    _spec(t, split[0], split[1:4], split[4:], out_f, idx, idx, cursors, launch_mode="flush")
    assert torch.isnan(out_f[:5]).all(), "flush: only the folding rows' outputs"
    assert torch.equal(out_f[5:8], out[5:8])
    for a, b in zip(state, split):
        assert torch.equal(a, b)


def test_sglang_records_past_the_ring_are_dropped(tfw, rng):
    """write_pos + drafts > L: the drafts' outputs are still computed (the recurrent op's), the
    records that fit are written and those past the ring dropped (the committed records they
    would wrap onto stay bit-unchanged)."""
    import torch
    L = 8
    t, ck, rings, raws, (wp, base, fl), lens = _sglang_setup(tfw, rng, L=L)
    idx = torch.tensor([1, 2, 4], dtype=torch.int32)
    fl.zero_()
    wp[4] = 6  # sequence 2: 3 drafts at logical 6, 7, 8 -> the last is past the ring
    before = _clone(*rings, *raws)
    out = torch.full((8, HV, V), float("nan"))
    _spec(t, ck, rings, raws, out, idx, idx, (wp, base, fl), L=L)
    assert not torch.isnan(out).any()
    b4 = int(base[4])
    written = {(b4 + 6) % L, (b4 + 7) % L}
    for now, old in zip(rings + raws, before):
        for p in range(L):
            same = torch.equal(now[4, :, p], old[4, :, p])
            assert same != (p in written), f"ring position {p}"
    # the outputs against the same call with a ring large enough for every record
    big = _sglang_setup(tfw, np.random.default_rng(0), L=16)[2:4]
    rings16 = tuple(torch.zeros_like(x) for x in big[0])
    raws16 = tuple(torch.zeros_like(x) for x in big[1])
    for r16, r8 in zip(rings16 + raws16, rings + raws):
        r16[:, :, :L] = r8
        r16[:, :, L:] = r8
    out16 = torch.full((8, HV, V), float("nan"))
    _spec(t, ck.clone(), rings16, raws16, out16, idx, idx, (wp, base, fl), L=16, Tmax=3)
    assert torch.equal(out[5:8], out16[5:8])


def test_sglang_residual_ring(tfw, rng):
    """rawv and rawk without beta_cache: the hi/lo residual ring. Each record's residual is
    d - bf16(d) and k^ - bf16(k^), from the fp32 values the fp32-ring call records (bit for bit),
    rounded to the residual ring's dtype; launch_mode='verify' runs without the exact-raw ring."""
    import torch
    t, ck, rings, raws, (wp, base, fl), lens = _sglang_setup(tfw, rng, ring_dtype="bfloat16")
    fl.zero_()
    idx = torch.tensor([1, 2, 4], dtype=torch.int32)
    res = (torch.full_like(raws[0], SENTINEL).bfloat16(),
           torch.full_like(raws[1], SENTINEL).bfloat16())
    out = torch.full((8, HV, V), float("nan"))
    _spec(t, ck, rings, res + (None,), out, idx, idx, (wp, base, fl), launch_mode="verify")
    r32 = tuple(x.float().clone() for x in rings)
    out32 = torch.full((8, HV, V), float("nan"))
    _spec(t, ck, r32, (None, None, None), out32, idx, idx, (wp, base, fl), launch_mode="verify")
    starts = [0, 3, 5, 8]
    for n, s in enumerate(idx.tolist()):
        for j in range(starts[n + 1] - starts[n]):
            p = (int(base[s]) + int(wp[s]) + j) % 8
            d32, k32 = r32[0][s, :, p], r32[1][s, :, p]
            assert torch.equal(rings[0][s, :, p], d32.bfloat16())
            assert torch.equal(res[0][s, :, p], (d32 - d32.bfloat16().float()).bfloat16())
            assert torch.equal(res[1][s, :, p], (k32 - k32.bfloat16().float()).bfloat16())
    with pytest.raises(ValueError, match="raw replay buffers are required for exact-fold launch"):
        _spec(t, ck, rings, res + (None,), out, idx, idx, (wp, base, fl))


def test_sglang_commit_cache_buf_len_and_fold_every_commit(tfw, rng):
    import torch
    wp = torch.tensor([0, 3, 6, 2], dtype=torch.int32)
    base = torch.tensor([0, 14, 13, 5], dtype=torch.int32)
    fl = torch.tensor([0, 1, 1, 0], dtype=torch.int8)
    rows = torch.tensor([1, 2, 3], dtype=torch.int32)
    acc = torch.tensor([2, 0, 1], dtype=torch.int32)
    # max_cache_len 8 sets the margin; the rings are 16 long: the origin wraps at 16.
    ds.commit_gdn_replayssm_spec(wp, base, fl, acc, rows, 8, 2, cache_buf_len=16)
    assert wp.tolist() == [0, 2, 0, 3] and base.tolist() == [0, (14 + 3) % 16, 13, 5]
    assert fl.tolist() == [0, 0, 0, 0]  # 2 + 4 > 8? no; 0 + 4; 3 + 4
    wp = torch.tensor([0, 3, 0, 2], dtype=torch.int32)
    fl = torch.tensor([0, 1, 1, 0], dtype=torch.int8)
    ds.commit_gdn_replayssm_spec(wp, base, fl, acc, rows, 8, 2, True)
    assert wp.tolist() == [0, 2, 0, 3] and fl.tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="cache_buf_len must be a power of two >= max_cache_len"):
        ds.commit_gdn_replayssm_spec(wp, base, fl, acc, rows, 8, 2, cache_buf_len=12)


def test_sglang_surface_errors(tfw, rng):
    import torch
    t, ck, rings, raws, (wp, base, fl), lens = _sglang_setup(tfw, rng)
    idx = torch.tensor([2, 1, 4], dtype=torch.int32)
    out = torch.empty(8, HV, V)
    cur = (wp, base, fl)
    with pytest.raises(ValueError, match="`launch_mode` must be one of 'both', 'verify', 'flush'"):
        _spec(t, ck, rings, raws, out, idx, idx, cur, launch_mode="fold")
    with pytest.raises(AssertionError, match="circular cache requires power-of-two"):
        _spec(t, ck, rings, raws, out, idx, idx, cur, L=6)
    with pytest.raises(ValueError, match="needs max_cache_len >= 2 \\* max_spec_len"):
        _spec(t, ck, rings, raws, out, idx, idx, cur, Tmax=5)
    with pytest.raises(ValueError, match="raw replay buffers are required for exact-fold launch"):
        _spec(t, ck, rings, (None, None, None), out, idx, idx, cur, launch_mode="flush")
    with pytest.raises(ValueError, match="`beta_cache` needs both"):
        ds.replayssm_verify(t["q"][None], t["k"][None], t["v"][None], t["a"][None],
                            t["b"][None], out[None], ck, idx, *rings, *cur, A_log=t["A_log"],
                            dt_bias=t["dt_bias"], cu_seqlens=t["qsl"], beta_cache=raws[2])
    bad = torch.tensor([2, 9, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"`replay_indices`\[1\]=9 is out of range for rings of 5"):
        _spec(t, ck, rings, raws, out, idx, bad, cur)
    dup = torch.tensor([2, 4, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"`replay_indices`\[2\]=4 repeats a live row"):
        _spec(t, ck, rings, raws, out, idx, dup, cur)
    short = torch.zeros(5, HV, 8)
    with pytest.raises(ValueError, match=r"`beta_cache` must be a contiguous tensor of shape "
                                         r"\(5, 4, 8\) \(got \(5, 4, 8\)\)|`beta_cache` must be"):
        _spec(t, ck, rings, (raws[0], raws[1], short.bfloat16()), out, idx, idx, cur)
    with pytest.raises(ValueError, match="rows must be 0 \\(all\\), 1 \\(append\\) or 2"):
        ds.replayssm_verify(t["q"][None], t["k"][None], t["v"][None], t["a"][None],
                            t["b"][None], out[None], ck, idx, *rings, *cur, A_log=t["A_log"],
                            dt_bias=t["dt_bias"], cu_seqlens=t["qsl"], rows=3)
    with pytest.raises(ValueError, match="`is_flush` must be a contiguous 1D int32 or int8"):
        ds.commit_gdn_replayssm_spec(wp, base, fl.to(torch.int64),
                                     torch.ones(3, dtype=torch.int32), idx, 8, 3)
    # Tuning keywords and dot_precision: accepted and ignored.
    _spec(t, ck, rings, raws, out, idx, idx, cur, block_v=32, num_warps=4, nk=1, bs_min=8,
          dot_precision="ieee")


def test_signature_is_sglangs():
    import inspect
    names = list(inspect.signature(ds.gdn_replayssm_spec_decode).parameters)
    assert names[:37] == [
        "q", "k", "v", "a", "b", "A_log", "dt_bias", "checkpoint_state", "d_cache", "k_cache",
        "g_cache", "rawv_cache", "rawk_cache", "beta_cache", "out", "query_start_loc",
        "ssm_state_indices", "replay_indices", "write_pos", "cache_base", "is_flush",
        "max_cache_len", "max_spec_len", "scale", "use_qk_l2norm_in_kernel", "null_block_id",
        "block_v", "num_warps", "num_stages", "nk", "bs_min", "block_v_flush", "num_warps_flush",
        "num_stages_flush", "nk_flush", "launch_mode", "dot_precision"]
    names = list(inspect.signature(ds.commit_gdn_replayssm_spec).parameters)
    assert names[:10] == ["write_pos", "cache_base", "is_flush", "num_accepted",
                          "replay_indices", "max_cache_len", "max_spec_len", "fold_every_commit",
                          "cache_buf_len", "null_block_id"]


@pytest.mark.parametrize("flags", ["bool", "int8", "int32", "int64"])
def test_sglang_reset_cursors(fw, flags):
    """SGLang's reset_gdn_replayssm_spec_cursors (the prefill -> decode handoff): each live
    block whose do_reset is set gets write_pos = cache_base = 0 and is_flush = 2 * max_spec_len
    > max_cache_len; the null block (0 by default), padded rows, unflagged rows and every other
    slot keep their cursors; the flags may be bool (read as their bytes) at any stride."""
    def arr(a):  # the array in fw's framework, its own memory
        return __import__("torch").from_numpy(a) if fw.name == "torch" else a

    names = list(inspect.signature(ds.reset_gdn_replayssm_spec_cursors).parameters)
    assert names[:8] == ["write_pos", "cache_base", "is_flush", "do_reset", "state_batch_indices",
                         "max_cache_len", "max_spec_len", "null_block_id"]
    for L, T in ((16, 4), (6, 4)):  # the second starts the reset rows folding
        wp0 = np.arange(5, 12, dtype=np.int32)
        base0 = np.arange(2, 9, dtype=np.int32)
        fl0 = (np.arange(7) % 2).astype(np.int8)
        wp, base, fl = (arr(x.copy()) for x in (wp0, base0, fl0))
        rows = arr(np.array([3, 0, 5, 2, -1], dtype=np.int32))
        wide = np.array([1, 9, 1, 9, 7, 9, 0, 9, 1, 9]).astype(flags)
        do_reset = arr(wide)[::2]  # stride 2
        assert ds.reset_gdn_replayssm_spec_cursors(wp, base, fl, do_reset, rows, L, T) is None
        want_wp, want_base, want_fl = wp0.copy(), base0.copy(), fl0.copy()
        for s in (3, 5):
            want_wp[s], want_base[s], want_fl[s] = 0, 0, int(2 * T > L)
        np.testing.assert_array_equal(to64(wp), want_wp)
        np.testing.assert_array_equal(to64(base), want_base)
        np.testing.assert_array_equal(to64(fl), want_fl)
    # the core name: null_block_id -1 by default (slot 0 is live, as for its commit), returns
    # write_pos; every flag starts at 1 and the rule gives 0 (2 * 2 <= 8)
    wp, base, fl = (arr(x.copy()) for x in (wp0, base0, np.ones(7, np.int8)))
    got = ds.replayssm_reset_cursors(wp, base, fl, arr(np.ones(2, np.int32)),
                                     arr(np.array([0, 6], np.int64)), 8, 2)
    assert got is wp and to64(wp)[[0, 6]].tolist() == [0, 0]
    assert to64(base)[[0, 6]].tolist() == [0, 0] and to64(fl).tolist() == [0, 1, 1, 1, 1, 1, 0]
    # each name's own argument in the validator's text
    with pytest.raises(ValueError, match=r"^`state_batch_indices`\[0\]=7 is out of range for a "
                                         r"pool of 7 slots$"):
        ds.reset_gdn_replayssm_spec_cursors(wp, base, fl, arr(np.ones(1, np.int8)),
                                            arr(np.array([7], np.int32)), 8, 2)
    with pytest.raises(ValueError, match=r"^`state_indices`\[0\]=7 is out of range for a pool "
                                         r"of 7 slots$"):
        ds.replayssm_reset_cursors(wp, base, fl, arr(np.ones(1, np.int8)),
                                   arr(np.array([7], np.int32)), 8, 2)
    with pytest.raises(ValueError, match=r"^`replay_indices`\[0\]=7 is out of range for a pool "
                                         r"of 7 slots$"):
        ds.commit_gdn_replayssm_spec(wp, base, fl, arr(np.ones(1, np.int32)),
                                     arr(np.array([7], np.int32)), 8, 2)
    with pytest.raises(ValueError, match=r"`do_reset` must be bool, int8, int32 or int64"):
        ds.reset_gdn_replayssm_spec_cursors(wp, base, fl, arr(np.ones(1, np.float32)),
                                            arr(np.array([1], np.int32)), 8, 2)


def test_sglang_cursor_tables_apart_from_ring_rows(tfw, rng):
    """With replay_indices the cursor tables may have fewer entries than the rings have rows (as
    in SGLang's pools): the call equals the one with tables as long as the rings."""
    import torch
    t, ck, rings, raws, (wp, base, fl), lens = _sglang_setup(tfw, rng, slots=6, rows=5)
    idx = torch.tensor([3, 0, 5], dtype=torch.int32)
    ridx = torch.tensor([2, 0, 1], dtype=torch.int64)
    ck2, rings2, raws2 = ck.clone(), _clone(*rings), _clone(*raws)
    out = torch.full((8, HV, V), float("nan"))
    _spec(t, ck, rings, raws, out, idx, ridx, (wp, base, fl))
    out2 = torch.full((8, HV, V), float("nan"))
    _spec(t, ck2, rings2, raws2, out2, idx, ridx, (wp[:3].clone(), base[:3].clone(),
                                                   fl[:3].clone()))
    assert torch.equal(out, out2) and torch.equal(ck, ck2)
    for a, b in zip(rings + raws, rings2 + raws2):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"`replay_indices`\[2\]=3 is out of range for rings of "
                                         r"5 rows and cursor tables of 3 entries"):
        _spec(t, ck2, rings2, raws2, out2, idx, torch.tensor([2, 0, 3]),
              (wp[:3].clone(), base[:3].clone(), fl[:3].clone()))
