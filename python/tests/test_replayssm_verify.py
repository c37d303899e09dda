"""ReplaySSM speculative verify through the Python surface: the core `replayssm_verify` /
`replayssm_commit` and SGLang's `gdn_replayssm_spec_decode` / `commit_gdn_replayssm_spec`, over
random accept/reject steps with forced folds, against the numpy float64 reference
(reference.verify_sequence from the committed state) and bit for bit against the
intermediate-state verify (`verify` + `update_state_after_verify`) with fp32 checkpoints and
rings; bf16 checkpoints; padded sequences, envelope pools with sentinel slots left
bit-untouched, NaN-poisoned outputs, the cursors against the commit's rule; the SGLang surface's
differences and errors."""

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


def _sglang_setup(tfw, rng, slots=5, L=8, T=3):
    torch = pytest.importorskip("torch")
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
    rings = (torch.zeros(slots, HV, L, V), torch.zeros(slots, H, L, K),
             torch.zeros(slots, HV, L))
    cursors = (torch.tensor([0, 2, 1, 0, 3], dtype=torch.int32),
               torch.tensor([0, 5, 7, 0, 1], dtype=torch.int32),
               torch.tensor([0, 0, 1, 0, 0], dtype=torch.int8))
    return t, ck, rings, cursors, lens


def test_sglang_surface_equals_core(tfw, rng):
    """gdn_replayssm_spec_decode and commit_gdn_replayssm_spec (SGLang's argument order,
    null_block_id=0: slot 0 is the null block; int8 is_flush read as int32) equal the core ops."""
    import torch
    t, ck, rings, (wp, base, fl), lens = _sglang_setup(tfw, rng)
    idx = torch.tensor([2, 0, 4], dtype=torch.int32)  # row 1: the null block (padded)
    ck2, rings2 = ck.clone(), tuple(x.clone() for x in rings)
    out = torch.full((8, HV, V), float("nan"))
    ret = ds.gdn_replayssm_spec_decode(t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"],
                                       t["dt_bias"], ck, *rings, out, t["qsl"], idx, wp, base,
                                       fl, 8, 3)
    assert ret is out
    out2 = torch.full((1, 8, HV, V), float("nan"))
    ds.replayssm_verify(t["q"][None], t["k"][None], t["v"][None], t["a"][None], t["b"][None],
                        out2, ck2, idx, *rings2, wp, base, fl.to(torch.int32),
                        A_log=t["A_log"], dt_bias=t["dt_bias"], cu_seqlens=t["qsl"],
                        null_block_id=0)
    assert torch.equal(out, out2[0])
    assert torch.all(out[3:5] == 0), "the null block's rows are zero"
    assert torch.equal(ck, ck2)
    for a, b in zip(rings, rings2):
        assert torch.equal(a, b)
    fl32 = fl.to(torch.int32)
    wp2, base2, fl2 = wp.clone(), base.clone(), fl32.clone()
    acc = torch.tensor([2, 1, 3], dtype=torch.int32)
    assert ds.commit_gdn_replayssm_spec(wp, base, fl32, acc, idx, 8, 3) is None
    ds.replayssm_commit(wp2, base2, fl2, acc, idx, 8, 3, null_block_id=0)
    assert torch.equal(wp, wp2) and torch.equal(base, base2) and torch.equal(fl32, fl2)
    # slot 2 was folding: its cursor restarts at the accepted count, its origin moves by wp.
    assert wp[2] == 2 and base[2] == (7 + 1) % 8 and fl32[2] == 0
    assert wp[4] == 3 + 3 and fl32[4] == 1  # 6 + 2 * 3 > 8: the next step folds
    assert wp[0] == 0, "the null block's cursor is left alone"


def test_sglang_surface_errors(tfw, rng):
    import torch
    t, ck, rings, (wp, base, fl), lens = _sglang_setup(tfw, rng)
    idx = torch.tensor([2, 1, 4], dtype=torch.int32)
    out = torch.empty(8, HV, V)
    args = (t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"], ck, *rings, out,
            t["qsl"], idx, wp, base, fl)
    with pytest.raises(NotImplementedError, match="launch_mode"):
        ds.gdn_replayssm_spec_decode(*args, 8, 3, launch_mode="verify")
    with pytest.raises(AssertionError, match="circular cache requires power-of-two"):
        ds.gdn_replayssm_spec_decode(*args, 6, 3)
    with pytest.raises(ValueError, match="needs max_cache_len >= 2 \\* max_spec_len"):
        ds.gdn_replayssm_spec_decode(*args, 8, 5)
    with pytest.raises(NotImplementedError, match="cache_buf_len"):
        ds.commit_gdn_replayssm_spec(wp, base, fl.to(torch.int32), torch.ones(3, dtype=torch.int32),
                                     idx, 8, 3, cache_buf_len=16)
    # int8 tensors reach the core (the 1-byte state format): the cursor contract names it
    with pytest.raises(ValueError, match="`is_flush` must be a contiguous 1D int32 tensor"):
        ds.commit_gdn_replayssm_spec(wp, base, fl, torch.ones(3, dtype=torch.int32), idx, 8, 3)
    wp_bad = wp.clone()
    wp_bad[4] = 7  # 7 + 3 drafts > 8
    with pytest.raises(ValueError, match="sequence 2: write_pos=7 plus 3 draft tokens overflows"):
        ds.gdn_replayssm_spec_decode(*args[:14], wp_bad, base, fl, 8, 3)
    # Tuning keywords: accepted and ignored.
    ds.gdn_replayssm_spec_decode(*args, 8, 3, block_v=32, num_warps=4, nk=1, bs_min=8)


def test_signature_is_sglangs():
    import inspect
    names = list(inspect.signature(ds.gdn_replayssm_spec_decode).parameters)
    assert names[:27] == [
        "q", "k", "v", "a", "b", "A_log", "dt_bias", "checkpoint_state", "d_cache", "k_cache",
        "g_cache", "out", "query_start_loc", "ssm_state_indices", "write_pos", "cache_base",
        "is_flush", "max_cache_len", "max_spec_len", "scale", "use_qk_l2norm_in_kernel",
        "null_block_id", "block_v", "num_warps", "num_stages", "nk", "bs_min"]
    names = list(inspect.signature(ds.commit_gdn_replayssm_spec).parameters)
    assert names[:9] == ["write_pos", "cache_base", "is_flush", "num_accepted",
                         "state_batch_indices", "max_cache_len", "max_spec_len", "cache_buf_len",
                         "null_block_id"]
