"""The lossless invariant of speculative decoding (sgl-project/sglang#35150, #25587): whatever the
drafts and however many of them are accepted, a scheme's committed state and the outputs of the
accepted tokens equal plain decode of the accepted tokens alone.

Every scheme runs 1,000 verify -> commit steps over three sequences (one padded) with random
draft counts and random acceptance, all-rejected steps (nothing accepted) included; beside it
the plain packed decode (fused_recurrent_*_packed_decode, one token per call) runs the accepted
tokens only. With fp32 checkpoints and rings every comparison is bit for bit:
  * plain verify + commit (verify with intermediate states, update_state_after_verify): the
    accepted tokens' outputs, and the committed pool after every commit;
  * ReplaySSM verify + cursor commit (replayssm_verify, replayssm_commit; random forced folds as
    well as the commit's own): the accepted tokens' outputs, and the checkpoint at every fold;
  * ReplaySSM with the exact-raw ring and bfloat16 d/k rings: the checkpoint at every fold (the
    outputs are rebuilt from the rounded d/k records: within 2e-2 there);
  * fold-every-commit (verify writing the raw ring, commit_gdn_replayssm_fold_all_layers /
    the KDA one): the accepted tokens' outputs and the committed checkpoint after every commit.
The GPU twin (CUDA against the CPU plain decode, with its bound) is
tests/gpu/test_lossless_gpu.cpp.
"""

import numpy as np
import pytest

import deltastate as ds
from cases import gate_logits, gate_params
from helpers import to64

H, HV, K, V = 1, 2, 16, 8
N, SLOTS, L, T = 3, 5, 8, 3
LIVE = [3, -1, 1]
STEPS = 1000


class Plain:
    """Plain decode of the accepted tokens: the packed decode, one token per call."""

    def __init__(self, fw, kda, S0, A_log, dt_bias):
        self.fw, self.kda = fw, kda
        self.pool = fw.from64(S0)
        self.A_log, self.dt_bias = A_log, dt_bias

    def decode(self, tok, n_acc):
        """Token j of every live sequence with n_acc[n] > j; returns its outputs [T, N, HV, V]."""
        outs = np.full((T, N, HV, V), np.nan)
        for j in range(max(n_acc)):
            idx = [s if s >= 0 and n_acc[n] > j else -1 for n, s in enumerate(LIVE)]
            x = {name: self.fw.from64(v[:, j]) for name, v in tok.items()}
            qkv = self.fw.from64(np.concatenate(
                [tok["q"][:, j].reshape(N, -1), tok["k"][:, j].reshape(N, -1),
                 tok["v"][:, j].reshape(N, -1)], axis=1))
            out = self.fw.full((N, 1, HV, V), float("nan"))
            a = self.fw.from64(tok["a"][:, j].reshape(N, -1))
            op = (ds.fused_recurrent_kda_packed_decode if self.kda
                  else ds.fused_recurrent_gated_delta_rule_packed_decode)
            op(qkv, a, x["b"], self.A_log, self.dt_bias, K ** -0.5, self.pool, out,
               self.fw.idx(idx), True)
            outs[j] = to64(out)[:, 0]
        return outs


def _window(rng, kda):
    """One window of T draft tokens per sequence (float64, [N, T, ...])."""
    return {"q": rng.standard_normal((N, T, H, K)), "k": rng.standard_normal((N, T, H, K)),
            "v": rng.standard_normal((N, T, HV, V)),
            "a": gate_logits(rng, (N, T, HV, K) if kda else (N, T, HV)) * 0.5,
            "b": rng.standard_normal((N, T, HV))}


def _accepted(rng):
    """Accepted counts: none (all rejected) 20% of the time, else 1..T."""
    return [0 if rng.random() < 0.2 else int(rng.integers(1, T + 1)) for _ in range(N)]


def _setup(rng, kda):
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    S0 = np.zeros((SLOTS, HV, V, K))
    for s in LIVE:
        if s >= 0:
            S0[s] = rng.standard_normal((HV, V, K)) * 0.5
    return A_log, dt_bias, S0


def _outputs_equal(got, want, n_acc, what, tol=None):
    for n, s in enumerate(LIVE):
        if s < 0:
            continue
        a = n_acc[n]
        if tol is None:
            np.testing.assert_array_equal(got[n, :a], want[:a, n], err_msg=what)
        else:
            np.testing.assert_allclose(got[n, :a], want[:a, n], atol=tol, rtol=tol, err_msg=what)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_plain_verify_commit_is_lossless(rng, kda):
    from helpers import Fw
    fw = Fw("numpy")
    A_log, dt_bias, S0 = _setup(rng, kda)
    At, Dt = fw.from64(A_log), fw.from64(dt_bias)
    plain = Plain(fw, kda, S0, At, Dt)
    pool = fw.from64(S0)
    inter = fw.full((N, T, HV, V, K), 0.0)
    idx = fw.idx(LIVE)
    rejected = 0
    for step in range(STEPS):
        tok = _window(rng, kda)
        x = {n: fw.from64(v) for n, v in tok.items()}
        out = fw.full((N, T, HV, V), float("nan"))
        ds.verify(x["q"], x["k"], x["v"], x["a"], x["b"], out, pool, idx, A_log=At, dt_bias=Dt,
                  is_kda=kda, update_state=False, intermediate_states=inter)
        n_acc = _accepted(rng)
        rejected += sum(1 for n, s in enumerate(LIVE) if s >= 0 and n_acc[n] == 0)
        ds.update_state_after_verify(pool, inter, idx, fw.idx(n_acc))
        want = plain.decode(tok, n_acc)
        _outputs_equal(to64(out), want, n_acc, f"outputs, step {step}")
        np.testing.assert_array_equal(pool, plain.pool, err_msg=f"committed state, step {step}")
    assert rejected > 100


def _replay_run(rng, kda, fw, ring_dtype, raw):
    """ReplaySSM verify + cursor commit against plain decode; returns (folds, max output error)."""
    A_log, dt_bias, S0 = _setup(rng, kda)
    At, Dt = fw.from64(A_log), fw.from64(dt_bias)
    plain = Plain(fw, kda, S0, At, Dt)
    ck = fw.from64(S0)
    d_cache = fw.full((SLOTS, HV, L, V), 0.0, ring_dtype)
    k_cache = fw.full((SLOTS, H, L, K), 0.0, ring_dtype)
    g_cache = fw.full((SLOTS, HV, L, K) if kda else (SLOTS, HV, L), 0.0)
    raws = {}
    if raw:
        raws = {"rawv_cache": fw.full((SLOTS, HV, L, V), 0.0),
                "rawk_cache": fw.full((SLOTS, H, L, K), 0.0),
                "beta_cache": fw.full((SLOTS, HV, L), 0.0)}
    wp, base, flush = (fw.idx(np.zeros(SLOTS, np.int64)) for _ in range(3))
    idx = fw.idx(LIVE)
    folds, rejected, err = 0, 0, 0.0
    for step in range(STEPS):
        tok = _window(rng, kda)
        x = {n: fw.from64(v) for n, v in tok.items()}
        fl = to64(flush)
        for s in LIVE:  # forced folds beside the commit's own
            if s >= 0 and rng.random() < 0.05:
                fl[s] = 1
        fw.assign(flush, fl, "int32")
        wps = to64(wp)
        out = fw.full((N, T, HV, V), float("nan"))
        ds.replayssm_verify(x["q"], x["k"], x["v"], x["a"], x["b"], out, ck, idx, d_cache,
                            k_cache, g_cache, wp, base, flush, A_log=At, dt_bias=Dt, is_kda=kda,
                            **raws)
        for s in LIVE:
            if s >= 0 and fl[s] and wps[s] > 0:
                folds += 1
                np.testing.assert_array_equal(to64(ck)[s], to64(plain.pool)[s],
                                              err_msg=f"folded checkpoint, step {step}")
        n_acc = _accepted(rng)
        rejected += sum(1 for n, s in enumerate(LIVE) if s >= 0 and n_acc[n] == 0)
        ds.replayssm_commit(wp, base, flush, fw.idx(n_acc), idx, L, T)
        want = plain.decode(tok, n_acc)
        if ring_dtype == "float32":
            _outputs_equal(to64(out), want, n_acc, f"outputs, step {step}")
        else:
            for n, s in enumerate(LIVE):
                if s >= 0 and n_acc[n]:
                    err = max(err, float(np.abs(to64(out)[n, :n_acc[n]] - want[:n_acc[n], n]).max()))
    assert folds > 100 and rejected > 100
    return err


@pytest.mark.parametrize("raw", [False, True], ids=["dk_ring", "exact_raw"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_replayssm_verify_cursor_commit_is_lossless(rng, kda, raw):
    from helpers import Fw
    _replay_run(rng, kda, Fw("numpy"), "float32", raw)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_replayssm_exact_raw_ring_is_lossless_with_bf16_rings(rng, tfw, kda):
    """bfloat16 d/k rings: the checkpoint at every fold is still plain decode's state bit for bit
    (the fold replays the raw ring); the outputs, rebuilt from the rounded records, stay within
    2e-2 of plain decode's over the 1,000 steps (no drift: the fold resets the error)."""
    err = _replay_run(rng, kda, tfw, "bfloat16", True)
    assert err < 2e-2, err


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_fold_every_commit_is_lossless(rng, kda):
    """The verify records each draft's raw inputs (ring_v/k/g/beta, SGLang's cache_ring), the
    commit (replayssm_fold_commit) replays the accepted prefix into the checkpoint: after every
    commit the checkpoint is plain decode's state, and the accepted outputs are its outputs."""
    from helpers import Fw
    fw = Fw("numpy")
    A_log, dt_bias, S0 = _setup(rng, kda)
    At, Dt = fw.from64(A_log), fw.from64(dt_bias)
    plain = Plain(fw, kda, S0, At, Dt)
    ck = fw.from64(S0)
    rings = {"ring_v": fw.full((SLOTS, HV, T, V), 0.0), "ring_k": fw.full((SLOTS, H, T, K), 0.0),
             "ring_g": fw.full((SLOTS, HV, T, K) if kda else (SLOTS, HV, T), 0.0),
             "ring_beta": fw.full((SLOTS, HV, T), 0.0)}
    idx = fw.idx(LIVE)
    rejected = 0
    for step in range(STEPS):
        tok = _window(rng, kda)
        x = {n: fw.from64(v) for n, v in tok.items()}
        out = fw.full((N, T, HV, V), float("nan"))
        ds.verify(x["q"], x["k"], x["v"], x["a"], x["b"], out, ck, idx, A_log=At, dt_bias=Dt,
                  is_kda=kda, update_state=False, **rings)
        n_acc = _accepted(rng)
        rejected += sum(1 for n, s in enumerate(LIVE) if s >= 0 and n_acc[n] == 0)
        ds.replayssm_fold_commit(ck, rings["ring_v"], rings["ring_k"], rings["ring_g"],
                                 rings["ring_beta"], idx, fw.idx(n_acc), is_kda=kda)
        want = plain.decode(tok, n_acc)
        _outputs_equal(to64(out), want, n_acc, f"outputs, step {step}")
        np.testing.assert_array_equal(ck, plain.pool, err_msg=f"committed state, step {step}")
    assert rejected > 100
