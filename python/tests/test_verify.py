"""Speculative verify and its commits through the Python surface against the numpy float64
reference (reference.verify_sequence): the core `verify` / `update_state_after_verify`, SGLang's
`fused_sigmoid_gating_delta_rule_update` (scratch rows, EAGLE trees, disable_state_update) and
`fused_mamba_state_scatter_with_mask`, FlashInfer's `gated_delta_rule_mtp` (batch rows, per-token
slots, output slots), vLLM's per-token slots with num_accepted_tokens; fp32 and bf16 states,
padded sequences, envelope pools with sentinel slots left bit-untouched, NaN-poisoned outputs.
The conv windows' commit `update_conv_state_after_verify` (and SGLang's
`fused_conv_window_scatter_with_mask`, and `fused_mamba_state_scatter_with_mask` routed to it)
against a plain numpy copy: window- and dim-contiguous envelope pools, dense and SGLang's
overlapping deduplicated scratch, padding rows, lengths and steps, the error texts."""

import numpy as np
import pytest

import deltastate as ds
import reference as ref
from cases import gate_logits, gate_params
from helpers import (SENTINEL, TOL_OUT, TOL_STATE, PoolBuf, assert_close, bits, poison,
                     sentinel_for, to64)

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


def test_flashinfer_mtp_leaves_padded_rows_as_given(rng, fw):
    """FlashInfer's gated_delta_rule_mtp skips a padded row's writes: a caller's output keeps its
    values there (FlashInfer's test_gdn_decode_mtp_non_bf16_output_preserves_padding_slots), a
    default output is zeros there; the live rows are the reference's. The core verify zeroes
    them unless keep_padded_outputs."""
    B, T = 3, 4
    t, r = _inputs(rng, fw, kda=False, B=B, T=T, act="float32")
    pool = PoolBuf(fw, 8, HV, V, K, "float32", rng, [1, 4])
    pool64 = pool.state64()
    live = [1, -1, 4]
    given = fw.full((B, T, HV, V), 42.0)
    o, _ = ds.gated_delta_rule_mtp(t["q"], t["k"], t["v"], pool.view, fw.idx(live), t["A_log"],
                                   t["a"], t["dt_bias"], t["b"], disable_state_update=True,
                                   output=given)
    assert o is given
    assert np.all(to64(given)[1] == 42.0), "a padded row's output was written"
    for n in (0, 2):
        wo, _ = _want(r, pool64, live[n], n, kda=False)
        assert_close(to64(given)[n], wo, TOL_OUT)
    o, _ = ds.gated_delta_rule_mtp(t["q"], t["k"], t["v"], pool.view, fw.idx(live), t["A_log"],
                                   t["a"], t["dt_bias"], t["b"], disable_state_update=True)
    assert np.all(to64(o)[1] == 0.0)
    for keep, want in ((False, 0.0), (True, 42.0)):
        out = fw.full((B, T, HV, V), 42.0)
        ds.verify(t["q"], t["k"], t["v"], t["a"], t["b"], out, pool.view, fw.idx(live),
                  A_log=t["A_log"], dt_bias=t["dt_bias"], update_state=False,
                  keep_padded_outputs=keep)
        assert np.all(to64(out)[1] == want), keep
        assert not np.any(to64(out)[[0, 2]] == 42.0)


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


# ---- the conv windows' commit (update_conv_state_after_verify) -------------------------------
CL, CSLOTS, CDIM, CW1, CROWS, CSTEPS = 2, 6, 5, 3, 5, 4


def _conv_pool(fw, dtype, layout, layers=CL):
    """The windows [layers, slots, dim, W1] in a page-major envelope of sentinels (slot j of
    layer l at 2 + j*(layers*dim*W1 + 5) + l*dim*W1), window- (SGLang) or dim-contiguous (vLLM).
    Returns (pool view, the whole buffer, the buffer offsets of element [l, s, i, j])."""
    win = CDIM * CW1
    ss = layers * win + 5
    flat = fw.flat(CSLOTS * ss + 4, dtype, sentinel_for(dtype))
    rs, cs = (CW1, 1) if layout == "sglang" else (1, CDIM)
    pool = fw.as_strided(flat, (layers, CSLOTS, CDIM, CW1), (win, ss, rs, cs), 2)
    l, s, i, j = np.meshgrid(*(np.arange(n) for n in (layers, CSLOTS, CDIM, CW1)), indexing="ij")
    return pool, flat, 2 + l * win + s * ss + i * rs + j * cs


def _conv_scratch(fw, dtype, rng, layout, layers=CL):
    """The scratch [layers, rows, steps, dim, W1]: dense (window-contiguous), dense with
    dim-contiguous windows, or SGLang's deduplicated view (an overlapping as_strided view over one
    [dim, steps + W1 - 1] buffer per row: step t is the window at column t)."""
    if layout == "dedup":
        P = CSTEPS + CW1 - 1
        shared = fw.from64(rng.standard_normal((layers, CROWS, CDIM, P)), dtype)
        return fw.as_strided(shared.reshape(-1), (layers, CROWS, CSTEPS, CDIM, CW1),
                             (CROWS * CDIM * P, CDIM * P, 1, P, 1))
    if layout == "vllm":
        x = fw.from64(rng.standard_normal((layers, CROWS, CSTEPS, CW1, CDIM)), dtype)
        return x.swapaxes(3, 4) if fw.name == "numpy" else x.transpose(3, 4)
    return fw.from64(rng.standard_normal((layers, CROWS, CSTEPS, CDIM, CW1)), dtype)


def _conv_commit_ref(pool64, scratch64, slots, rows, accepted, is_step):
    """The commit, plainly: pool[:, slot_b] = scratch[:, row_b, step_b] for every request with a
    step, a slot and a row >= 0."""
    out = pool64.copy()
    for b, slot in enumerate(slots):
        step = accepted[b] - (0 if is_step else 1)
        row = b if rows is None else rows[b]
        if step < 0 or slot < 0 or row < 0:
            continue
        out[:, slot] = scratch64[:, row, step]
    return out


def _check_commit(pool, flat, where, before_bits, want, written_slots):
    """The pool equals `want`; every buffer element outside the written slots' windows (the other
    slots, the envelope gaps) is bit-untouched."""
    np.testing.assert_array_equal(to64(pool), want)
    untouched = np.ones(bits(flat).shape, dtype=bool)
    untouched[where[:, written_slots].ravel()] = False
    assert np.array_equal(bits(flat)[untouched], before_bits[untouched])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("pool_layout", ["sglang", "vllm"])
@pytest.mark.parametrize("scratch_layout", ["dense", "vllm", "dedup"])
@pytest.mark.parametrize("is_step", [False, True], ids=["lengths", "steps"])
def test_conv_commit_layouts(rng, fw, dtype, pool_layout, scratch_layout, is_step):
    if not fw.supports(dtype):
        pytest.skip("numpy has no bfloat16")
    pool, flat, where = _conv_pool(fw, dtype, pool_layout)
    scratch = _conv_scratch(fw, dtype, rng, scratch_layout)
    slots, rows, lengths = [4, -1, 0, 5, 2], [3, 1, -1, 0, 4], [2, 3, 4, 0, 4]
    accepted = [a - 1 for a in lengths] if is_step else lengths
    before, before_bits = to64(pool), bits(flat)
    scratch_bits = bits(scratch)
    ret = ds.update_conv_state_after_verify(pool, scratch, fw.idx(slots, "int64"),
                                            fw.idx(accepted), fw.idx(rows),
                                            accepted_is_step=is_step)
    assert ret is pool
    want = _conv_commit_ref(before, to64(scratch), slots, rows, accepted, is_step)
    assert not np.array_equal(want, before)
    _check_commit(pool, flat, where, before_bits, want, [4, 2])  # not: row -1, nothing accepted
    assert np.array_equal(bits(scratch), scratch_bits)
    # One layer, no scratch-row table (request b reads row b).
    pool1, flat1, where1 = _conv_pool(fw, dtype, pool_layout, layers=1)
    scratch1 = _conv_scratch(fw, dtype, rng, scratch_layout, layers=1)
    before1, bits1 = to64(pool1), bits(flat1)
    ds.update_conv_state_after_verify(pool1[0], scratch1[0], fw.idx(slots), fw.idx(accepted),
                                      accepted_is_step=is_step)
    want1 = _conv_commit_ref(before1, to64(scratch1), slots, None, accepted, is_step)
    _check_commit(pool1, flat1, where1, bits1, want1, [4, 0, 2])


def test_conv_commit_sglang_names(rng, fw):
    """SGLang's fused_conv_window_scatter_with_mask, and fused_mamba_state_scatter_with_mask
    routed to the conv commit for 4-D windows and 3-D flat entries: request i's row is i,
    step_indices the last accepted step (-1: none); both return None."""
    idx, steps = [4, 1, 0], [3, -1, 0]
    for name in ("fused_conv_window_scatter_with_mask", "fused_mamba_state_scatter_with_mask"):
        pool, flat, where = _conv_pool(fw, "float32", "vllm")
        scratch = _conv_scratch(fw, "float32", rng, "dedup")
        before, before_bits = to64(pool), bits(flat)
        assert getattr(ds, name)(pool, scratch, fw.idx(idx), fw.idx(steps, "int64")) is None
        want = _conv_commit_ref(before, to64(scratch), idx, None, steps, True)
        _check_commit(pool, flat, where, before_bits, want, [4, 0])
    dst = fw.full((CL, CSLOTS, 7), SENTINEL)
    src = fw.from64(rng.standard_normal((CL, 3, CSTEPS, 7)))
    before = to64(dst)
    ds.fused_mamba_state_scatter_with_mask(dst, src, fw.idx(idx), fw.idx(steps))
    np.testing.assert_array_equal(to64(dst),
                                  _conv_commit_ref(before, to64(src), idx, None, steps, True))


def test_conv_commit_errors(rng, fw):
    pool, _, _ = _conv_pool(fw, "float32", "sglang")
    scratch = _conv_scratch(fw, "float32", rng, "dedup")
    before = bits(pool)
    i3, s3 = fw.idx([0, 1, 2]), fw.idx([0, 1, 2])
    with pytest.raises(ValueError, match=r"^`state_indices`\[1\]=9 is out of range for a state "
                                         r"pool of 6 slots"):
        ds.update_conv_state_after_verify(pool, scratch, fw.idx([0, 9, 2]), s3)
    with pytest.raises(ValueError, match=r"^`accepted`\[2\]=5 needs step 4 but "
                                         r"`intermediate_conv_window` holds 4 steps per row$"):
        ds.update_conv_state_after_verify(pool, scratch, i3, fw.idx([1, 1, 5]))
    with pytest.raises(ValueError, match=r"^`intermediate_conv_window` must have the dtype of "
                                         r"`conv_state` \((torch\.)?float32\); got "
                                         r"(torch\.)?float16$"):
        ds.update_conv_state_after_verify(pool, fw.from64(to64(scratch), "float16"), i3, s3)
    # SGLang's texts (its checks come first), then the core's, naming SGLang's arguments.
    for name in ("fused_conv_window_scatter_with_mask", "fused_mamba_state_scatter_with_mask"):
        f = getattr(ds, name)
        with pytest.raises(ValueError, match=r"^indices length mismatch: "
                                             r"dst_indices_raw.shape\[0\]=3 vs "
                                             r"step_indices_raw.shape\[0\]=2$"):
            f(pool, scratch, i3, fw.idx([0, 1]))
        with pytest.raises(ValueError, match=r"^`dst_indices_raw`\[0\]=99 is out of range"):
            f(pool, scratch, fw.idx([99, 1, 2]), s3)
    with pytest.raises(ValueError, match=r"^Unexpected ranks: dst.ndim=3 \(want 4\) "
                                         r"src.ndim=5 \(want 5\)$"):
        ds.fused_conv_window_scatter_with_mask(pool[0], scratch, i3, s3)
    with pytest.raises(ValueError, match=r"^Layer dim mismatch: dst.shape\[0\]=1 vs "
                                         r"src.shape\[0\]=2$"):
        ds.fused_conv_window_scatter_with_mask(pool[:1], scratch, i3, s3)
    with pytest.raises(ValueError, match=r"^Window dims mismatch: dst.shape\[2:\]=\(5, 2\) vs "
                                         r"src.shape\[3:\]=\(5, 3\)$"):
        ds.fused_conv_window_scatter_with_mask(pool[:, :, :, :2], scratch, i3, s3)
    with pytest.raises(ValueError, match=r"^Trailing dims mismatch: dst.shape\[2:\]=\(5, 2\) vs "
                                         r"src.shape\[3:\]=\(5, 3\)$"):
        ds.fused_mamba_state_scatter_with_mask(pool[:, :, :, :2], scratch, i3, s3)
    assert np.array_equal(bits(pool), before)
