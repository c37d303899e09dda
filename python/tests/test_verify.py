"""Speculative verify and its commit through the Python surface against the numpy float64
reference (reference.verify_sequence): the core `verify` / `update_state_after_verify`, SGLang's
`fused_sigmoid_gating_delta_rule_update` (scratch rows, EAGLE trees, disable_state_update) and
`fused_mamba_state_scatter_with_mask`, FlashInfer's `gated_delta_rule_mtp` (batch rows, per-token
slots, output slots), vLLM's per-token slots with num_accepted_tokens; fp32 and bf16 states,
padded sequences, envelope pools with sentinel slots left bit-untouched, NaN-poisoned outputs."""

import numpy as np
import pytest

import deltastate as ds
import reference as ref
from cases import gate_logits, gate_params
from helpers import SENTINEL, TOL_OUT, TOL_STATE, PoolBuf, assert_close, poison, to64

H, HV, K, V = 2, 4, 32, 16


def _inputs(rng, fw, *, kda, B, T, act="float32"):
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    d = {
        "q": rng.standard_normal((B, T, H, K)), "k": rng.standard_normal((B, T, H, K)),
        "v": rng.standard_normal((B, T, HV, V)),
        "a": gate_logits(rng, (B, T, HV, K) if kda else (B, T, HV)),
        "b": rng.standard_normal((B, T, HV)), "A_log": A_log, "dt_bias": dt_bias,
    }
    t = {n: fw.from64(d[n], act) for n in ("q", "k", "v", "b")}
    t["a"] = fw.from64(d["a"], "float32")
    t["A_log"], t["dt_bias"] = fw.from64(A_log), fw.from64(dt_bias)
    # The reference reads what the kernels read: the inputs rounded to their dtypes.
    r = {n: to64(t[n]) for n in t}
    return t, r


def _want(r, pool64, slot, n, *, kda, parents=None, state_dtype="float32"):
    return ref.verify_sequence(pool64[slot], r["q"][n], r["k"][n], r["v"][n], r["a"][n],
                               r["b"][n], kda=kda, A_log=r["A_log"], dt_bias=r["dt_bias"],
                               parents=parents, state_dtype=state_dtype)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sglang_target_verify_then_commit(rng, fw, kda, state_dtype, tree):
    if not fw.supports(state_dtype):
        pytest.skip("numpy has no bfloat16")
    B, T, slots = 3, 4, 7
    t, r = _inputs(rng, fw, kda=kda, B=B, T=T)
    live = [5, -1, 2]
    pool = PoolBuf(fw, slots, HV, V, K, state_dtype, rng, [s for s in live if s >= 0])
    pool64, pool_bits = pool.state64(), pool.bits()
    rows = [2, 0, 1]
    buf = fw.full((4, T + 1, HV, V, K), SENTINEL,
                  state_dtype)
    buf0 = to64(buf)
    parents = np.full((B, T), -1, dtype=np.int64)
    for n in range(B):
        for s in range(1, T):
            parents[n, s] = rng.integers(-1, s) if tree else s - 1
    o = ds.fused_sigmoid_gating_delta_rule_update(
        t["A_log"], t["a"].reshape(B, T, -1) if kda else t["a"], t["dt_bias"], 1.0, 20.0,
        t["q"], t["k"], t["v"], t["b"], pool.view, fw.idx(live), scale=None,
        use_qk_l2norm_in_kernel=True, is_kda=kda, disable_state_update=True,
        intermediate_states_buffer=buf, intermediate_state_indices=fw.idx(rows),
        cache_steps=T + 1, retrieve_parent_token=fw.idx(parents) if tree else None)
    assert tuple(o.shape) == (B, T, HV, V)
    assert np.array_equal(pool.bits(), pool_bits), "disable_state_update: the pool is untouched"
    got_o, got_buf = to64(o), to64(buf)
    want_states = {}
    for n in range(B):
        if live[n] < 0:
            assert np.all(got_o[n] == 0)
            np.testing.assert_array_equal(got_buf[rows[n]], buf0[rows[n]])
            continue
        wo, ws = _want(r, pool64, live[n], n, kda=kda, parents=parents[n] if tree else None,
                       state_dtype=state_dtype)
        want_states[n] = ws
        assert_close(got_o[n], wo, TOL_OUT, "float32", what=f"o[{n}]")
        assert_close(got_buf[rows[n], :T], ws, TOL_STATE[state_dtype], state_dtype,
                     what=f"buffer[{n}]")
        np.testing.assert_array_equal(got_buf[rows[n], T], buf0[rows[n], T])  # past T: untouched
    # Commit the accepted prefixes (accepted lengths; 0: nothing) from the scratch rows.
    steps = [2, 3, -1]
    before = pool.bits()
    ds.update_state_after_verify(pool.view, buf, fw.idx(live), fw.idx([s + 1 for s in steps]),
                                 intermediate_state_indices=fw.idx(rows))
    for n in range(B):
        if live[n] >= 0 and steps[n] >= 0:
            np.testing.assert_array_equal(to64(pool.view)[live[n]], got_buf[rows[n], steps[n]])
            assert_close(to64(pool.view)[live[n]], want_states[n][steps[n]],
                         TOL_STATE[state_dtype], state_dtype)
    moved = [live[n] for n in range(B) if live[n] >= 0 and steps[n] >= 0]
    pool.assert_untouched_outside(before, moved, "the commit")


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_verify_equals_plain_decode_every_prefix(rng, fw, kda):
    """verify over T tokens == T recurrent steps of one token, bit for bit (fp32 state)."""
    B, T = 3, 5
    t, r = _inputs(rng, fw, kda=kda, B=B, T=T)
    pool = PoolBuf(fw, 6, HV, V, K, "float32", rng, [0, 3, 4])
    idx = fw.idx([3, 0, 4])
    plain = PoolBuf(fw, 6, HV, V, K, "float32", rng, [])
    plain.flat[...] = pool.flat
    buf = fw.full((B, T, HV, V, K), 0.0)
    out = poison(fw, (B, T, HV, V), "float32")
    ds.verify(t["q"], t["k"], t["v"], t["a"], t["b"], out, pool.view, idx, A_log=t["A_log"],
              dt_bias=t["dt_bias"], is_kda=kda, intermediate_states=buf)
    op = ds.recurrent_kda if kda else ds.recurrent_gated_delta_rule
    for s in range(T):
        o1 = poison(fw, (B, 1, HV, V), "float32")
        op(t["q"][:, s:s + 1], t["k"][:, s:s + 1], t["v"][:, s:s + 1], t["a"][:, s:s + 1],
           t["b"][:, s:s + 1], A_log=t["A_log"], dt_bias=t["dt_bias"], initial_state=plain.view,
           ssm_state_indices=idx, use_gate_in_kernel=True, beta_is_logit=True, output=o1)
        np.testing.assert_array_equal(to64(out)[:, s], to64(o1)[:, 0])
        for n, slot in enumerate([3, 0, 4]):
            np.testing.assert_array_equal(to64(buf)[n, s], to64(plain.view)[slot])
    np.testing.assert_array_equal(pool.bits(), plain.bits())


def test_flashinfer_mtp_conventions(rng, fw):
    B, T = 3, 4
    t, r = _inputs(rng, fw, kda=False, B=B, T=T, act="float32")
    pool = PoolBuf(fw, 16, HV, V, K, "float32", rng, [1, 4])
    pool64 = pool.state64()
    live = [1, -1, 4]
    # Batch-row buffer and output slots.
    buf = fw.full((B, T, HV, V, K), 0.0)
    out_idx = [9, -1, 10]
    before = pool.bits()
    o, st = ds.gated_delta_rule_mtp(t["q"], t["k"], t["v"], pool.view, fw.idx(live), t["A_log"],
                                    t["a"], t["dt_bias"], t["b"], intermediate_states_buffer=buf,
                                    disable_state_update=False,
                                    output_state_indices=fw.idx(out_idx))
    assert st is pool.view
    for n in range(B):
        if live[n] < 0:
            assert np.all(to64(o)[n] == 0)
            continue
        wo, ws = _want(r, pool64, live[n], n, kda=False)
        assert_close(to64(o)[n], wo, TOL_OUT)
        assert_close(to64(buf)[n], ws, TOL_STATE["float32"])
        if out_idx[n] >= 0:
            np.testing.assert_array_equal(to64(pool.view)[out_idx[n]], to64(buf)[n, T - 1])
    pool.assert_untouched_outside(before, [9, 10])
    # Per-token slots: state after token t at ssm_state_indices[b, t], no final write-back.
    table = np.arange(B * T).reshape(B, T) + 3
    table[0, 1] = -1
    pool2 = PoolBuf(fw, 16, HV, V, K, "float32", rng, [0, 1, 2])
    p64, before = pool2.state64(), pool2.bits()
    o2, _ = ds.gated_delta_rule_mtp(t["q"], t["k"], t["v"], pool2.view, fw.idx([0, 1, 2]),
                                    t["A_log"], t["a"], t["dt_bias"], t["b"],
                                    ssm_state_indices=fw.idx(table), disable_state_update=False)
    written = []
    for n in range(B):
        wo, ws = _want(r, p64, n, n, kda=False)
        assert_close(to64(o2)[n], wo, TOL_OUT)
        for s in range(T):
            if table[n, s] >= 0:
                assert_close(to64(pool2.view)[table[n, s]], ws[s], TOL_STATE["float32"])
                written.append(int(table[n, s]))
    pool2.assert_untouched_outside(before, written)
    with pytest.raises(AssertionError, match="mutually exclusive"):
        ds.gated_delta_rule_mtp(t["q"], t["k"], t["v"], pool2.view, fw.idx([0, 1, 2]), t["A_log"],
                                t["a"], t["dt_bias"], t["b"], intermediate_states_buffer=buf,
                                ssm_state_indices=fw.idx(table), disable_state_update=False)
    with pytest.warns(UserWarning, match="disable_state_update"):
        ds.gated_delta_rule_mtp(t["q"], t["k"], t["v"], pool2.view, fw.idx([0, 1, 2]), t["A_log"],
                                t["a"], t["dt_bias"], t["b"])


def test_vllm_per_token_slots_from_num_accepted(rng, fw):
    B, T = 3, 3
    t, r = _inputs(rng, fw, kda=True, B=B, T=T)
    cols = T + 1
    table = np.arange(B * cols).reshape(B, cols)
    accepted = [1, 3, 2]
    table[2, 1] = -1  # sequence 2 starts from a padded slot
    pool = PoolBuf(fw, B * cols + 2, HV, V, K, "float32", rng, [0, 6])
    p64, before = pool.state64(), pool.bits()
    out = poison(fw, (B, T, HV, V), "float32")
    ds.verify(t["q"], t["k"], t["v"], t["a"], t["b"], out, pool.view, A_log=t["A_log"],
              dt_bias=t["dt_bias"], is_kda=True, token_state_indices=fw.idx(table),
              num_accepted_tokens=fw.idx(accepted))
    written = []
    for n in range(B):
        start = table[n, accepted[n] - 1]
        if start < 0:
            assert np.all(to64(out)[n] == 0)
            continue
        wo, ws = _want(r, p64, start, n, kda=True)
        assert_close(to64(out)[n], wo, TOL_OUT)
        for s in range(T):
            assert_close(to64(pool.view)[table[n, s]], ws[s], TOL_STATE["float32"])
            written.append(int(table[n, s]))
    pool.assert_untouched_outside(before, written)


def test_commit_layers_and_errors(rng, fw):
    layers, slots, rows, steps = 2, 5, 3, 4
    pool = fw.from64(rng.standard_normal((layers, slots, HV, V, K)))
    inter = fw.from64(rng.standard_normal((layers, rows, steps, HV, V, K)))
    before = to64(pool).copy()
    ret = ds.update_state_after_verify(pool, inter, fw.idx([4, -1, 0]), fw.idx([2, 1, 0]))
    assert ret is pool
    got = to64(pool)
    np.testing.assert_array_equal(got[:, 4], to64(inter)[:, 0, 1])
    np.testing.assert_array_equal(got[:, [1, 2, 3]], before[:, [1, 2, 3]])
    np.testing.assert_array_equal(got[:, 0], before[:, 0])  # accepted 0: nothing
    # SGLang's scatter: request i's row is i, step_indices the last accepted step (-1: none).
    ds.fused_mamba_state_scatter_with_mask(pool, inter, fw.idx([3, 2, -1]), fw.idx([-1, 3, 0]))
    got = to64(pool)
    np.testing.assert_array_equal(got[:, 2], to64(inter)[:, 1, 3])
    np.testing.assert_array_equal(got[:, 3], before[:, 3])
    with pytest.raises(ValueError, match="needs step 4 but `intermediate_states` holds 4 steps"):
        ds.update_state_after_verify(pool, inter, fw.idx([4, 1, 0]), fw.idx([5, 1, 0]))
    with pytest.raises(ValueError, match="Layer dimension mismatch"):
        ds.fused_mamba_state_scatter_with_mask(pool[:1], inter, fw.idx([0]), fw.idx([0]))
    with pytest.raises(NotImplementedError, match="softplus_beta"):
        t, _ = _inputs(rng, fw, kda=False, B=1, T=2)
        ds.fused_sigmoid_gating_delta_rule_update(
            t["A_log"], t["a"], t["dt_bias"], 2.0, 20.0, t["q"], t["k"], t["v"], t["b"], None,
            None)


def test_sglang_varlen_without_initial_state(rng, fw):
    """cu_seqlens with 2-D a / b rows; no initial state: every sequence from zeros."""
    lens = [2, 0, 3]
    Ttot = sum(lens)
    t, r = _inputs(rng, fw, kda=False, B=1, T=Ttot)
    cu = np.concatenate([[0], np.cumsum(lens)])
    o = ds.fused_sigmoid_gating_delta_rule_update(
        t["A_log"], t["a"].reshape(Ttot, HV), t["dt_bias"], 1.0, 20.0, t["q"], t["k"], t["v"],
        t["b"].reshape(Ttot, HV), None, None, use_qk_l2norm_in_kernel=True,
        cu_seqlens=fw.idx(cu))
    zero = np.zeros((1, HV, V, K))
    for n in range(3):
        s0, s1 = cu[n], cu[n + 1]
        if s1 == s0:
            continue
        sub = {k: v[:, s0:s1] if k not in ("A_log", "dt_bias") else v for k, v in r.items()}
        wo, _ = _want(sub, zero, 0, 0, kda=False)
        assert_close(to64(o)[0, s0:s1], wo, TOL_OUT)
