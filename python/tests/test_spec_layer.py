"""Speculative decoding of a GDN layer's recurrent half through one StatePool, on CPU (numpy):
the pool's speculative scratch (intermediate states and conv windows), causal_conv1d_update with
SGLang's per-draft windows and EAGLE tree tables, verify into the scratch, then the commits of
the accepted step for every layer in one call each (update_state_after_verify on the states,
update_conv_state_after_verify on the conv windows). Against the same layer run by plain
single-token decode steps (the conv of one token, verify of one token in place) over each
accepted path: the draft outputs equal the plain steps along each token's path, the committed
states and windows equal the plain ones bit for bit, rejected drafts and unused slots leave the
pool bit-unchanged."""

import numpy as np
import pytest

import deltastate as ds
from helpers import eagle_tree

H, HV, K, V, W = 1, 2, 8, 8, 4
CONV_DIM = 2 * H * K + HV * V
SENTINEL = np.float32(1e30)


def make_pool(layers, slots, rows, steps):
    return ds.StatePool(layers, slots, HV, V, K, H=H, conv_dim=CONV_DIM, conv_width=W,
                        spec_rows=rows, spec_steps=steps, framework="numpy")


def test_pool_scratch_views():
    pool = make_pool(3, 4, 5, 6)
    inter = pool.intermediate_states()
    assert inter.shape == (3, 5, 6, HV, V, K) and inter.dtype == np.float32
    assert pool.intermediate_states(1).shape == (5, 6, HV, V, K)
    win = pool.intermediate_conv_window()
    assert win.shape == (3, 5, 6, CONV_DIM, W - 1)
    assert pool.intermediate_conv_window(2, "v").shape == (5, 6, HV * V, W - 1)
    assert pool.states().shape == (3, 4, HV, V, K)
    assert pool.conv_states().shape == (3, 4, CONV_DIM, W - 1)
    # the views alias: a write through one shows through the other
    pool.intermediate_states(1)[2, 3] = 7.0
    assert np.all(inter[1, 2, 3] == 7.0) and np.all(inter[0] == 0) and np.all(inter[2] == 0)
    pool.intermediate_conv_window(2, "k")[1, 0] = 5.0
    assert np.all(win[2, 1, 0, H * K:2 * H * K] == 5.0) and np.all(win[2, 1, 0, :H * K] == 0)
    pool.layer_state(2)[3] = 2.0
    assert np.all(pool.states()[2, 3] == 2.0)
    pool.conv_state(1)[0] = 3.0
    assert np.all(pool.conv_states()[1, 0] == 3.0)
    # accounting: the scratch once, not per slot
    plain = make_pool(3, 4, 0, 0)
    assert plain.spec_nbytes == 0
    assert pool.nbytes - plain.nbytes == pool.spec_nbytes
    assert pool.spec_nbytes >= 3 * 5 * 6 * (HV * V * K + CONV_DIM * (W - 1)) * 4
    kw = dict(H=H, conv_dim=CONV_DIM, conv_width=W)
    assert (ds.StatePool.bytes_per_slot(3, HV, V, K, **kw)
            == ds.StatePool.bytes_per_slot(3, HV, V, K, **kw))
    budget = plain.nbytes
    assert ds.StatePool.slots_for_budget(budget, 3, HV, V, K, **kw) == 4
    assert ds.StatePool.slots_for_budget(budget, 3, HV, V, K, spec_rows=5, spec_steps=6,
                                         **kw) < 4
    with pytest.raises(ValueError, match="spec_rows and spec_steps go together"):
        make_pool(3, 4, 2, 0)
    with pytest.raises(ValueError, match="no speculative-verify scratch"):
        plain.intermediate_states()
    with pytest.raises(ValueError, match="conv part must be None"):
        pool.intermediate_conv_window(0, "z")


def split_qkv(y):
    """[B, conv_dim, T] conv output -> q, k [B, T, H, K], v [B, T, HV, V] (contiguous)."""
    B, _, T = y.shape
    yt = np.ascontiguousarray(y.transpose(0, 2, 1))
    q = np.ascontiguousarray(yt[..., :H * K]).reshape(B, T, H, K)
    k = np.ascontiguousarray(yt[..., H * K:2 * H * K]).reshape(B, T, H, K)
    v = np.ascontiguousarray(yt[..., 2 * H * K:]).reshape(B, T, HV, V)
    return q, k, v


class Layer:
    def __init__(self, rng):
        self.w = (rng.standard_normal((CONV_DIM, W)) * 0.5).astype(np.float32)
        self.bias = (rng.standard_normal(CONV_DIM) * 0.1).astype(np.float32)
        self.A_log = (rng.random(HV) * 2 - 1).astype(np.float32)
        self.dt_bias = (rng.random(HV) * 2 - 1).astype(np.float32)

    def plain_step(self, state, window, slot, x, a, b):
        """One token of one row by the plain ops: the conv (in place on window[slot]), then a
        one-token verify that updates state[slot] in place. Returns the output [HV, V]."""
        y = ds.causal_conv1d_update(x[None, :], window, self.w, self.bias, "silu", None,
                                    np.array([slot], np.int32))
        q, k, v = split_qkv(y[:, :, None])
        out = np.zeros((1, 1, HV, V), np.float32)
        ds.verify(q, k, v, a[None, None], b[None, None], out, state,
                  np.array([slot], np.int32), A_log=self.A_log, dt_bias=self.dt_bias)
        return out[0, 0]


def path_to(parent, t):
    path = [t]
    while path[-1] > 0:
        path.append(int(parent[path[-1]]))
    return path[::-1]


@pytest.mark.parametrize("tree", [False, True])
def test_speculative_rounds_equal_plain_decode(tree):
    rng = np.random.default_rng(41 + tree)
    layers, slots, T = 2, 5, 4
    pool = make_pool(layers, slots, 4, T)
    L = [Layer(rng) for _ in range(layers)]
    rows = [pool.allocate() for _ in range(3)]  # slots 0, 1, 2; 3 and 4 stay free
    idx = np.array([rows[2], -1, rows[0], rows[1]], np.int32)  # row 1 padded
    B = len(idx)
    scratch_rows = np.array([3, 0, 1, 2], np.int32)
    for layer in range(layers):  # random committed states and windows
        pool.layer_state(layer)[rows] = rng.uniform(-0.3, 0.3, (3, HV, V, K))
        pool.conv_state(layer)[rows] = rng.uniform(-1, 1, (3, CONV_DIM, W - 1))
    free = [s for s in range(slots) if s not in rows]
    pool.states()[:, free] = SENTINEL
    pool.conv_states()[:, free] = SENTINEL
    # the plain decoder's own copies
    ref_state = [pool.layer_state(layer).copy() for layer in range(layers)]
    ref_win = [pool.conv_state(layer).copy() for layer in range(layers)]

    for _ in range(3):
        x = rng.standard_normal((layers, B, CONV_DIM, T)).astype(np.float32)
        a = rng.standard_normal((layers, B, T, HV)).astype(np.float32)
        b = rng.standard_normal((layers, B, T, HV)).astype(np.float32)
        trees = [eagle_tree(rng, T) for _ in range(B)] if tree else None
        parents = np.zeros((B, T), np.int32)
        outs = []
        committed_before = (pool.states().copy(), pool.conv_states().copy())
        for layer in range(layers):
            kw = {}
            if tree:
                kw = dict(retrieve_next_token=np.stack([t[1] for t in trees]),
                          retrieve_next_sibling=np.stack([t[2] for t in trees]),
                          retrieve_parent_token=parents)
            y = ds.causal_conv1d_update(
                x[layer], pool.conv_state(layer), L[layer].w, L[layer].bias, "silu", None, idx,
                None, pool.intermediate_conv_window(layer), scratch_rows, **kw)
            q, k, v = split_qkv(y)
            out = np.full((B, T, HV, V), np.nan, np.float32)
            ds.verify(q, k, v, a[layer], b[layer], out, pool.layer_state(layer), idx,
                      A_log=L[layer].A_log, dt_bias=L[layer].dt_bias, update_state=False,
                      intermediate_states=pool.intermediate_states(layer),
                      intermediate_state_indices=scratch_rows,
                      parent_tokens=parents if tree else None)
            outs.append(out)
        # the verify leaves the committed states alone (the conv rolls its windows, as SGLang's)
        np.testing.assert_array_equal(pool.states(), committed_before[0])
        if tree:
            for r in range(B):
                if idx[r] >= 0:
                    np.testing.assert_array_equal(parents[r], trees[r][0])

        # the drafts' outputs against plain decode along each token's path
        last = np.zeros(B, np.int64)
        for r in range(B):
            if idx[r] < 0:
                for layer in range(layers):
                    assert np.all(outs[layer][r] == 0)
                continue
            s = idx[r]
            parent = trees[r][0] if tree else np.arange(T) - 1
            for t in range(T):
                path = path_to(parent, t) if tree else list(range(t + 1))
                for layer in range(layers):
                    st = ref_state[layer].copy()
                    wn = ref_win[layer].copy()
                    for u in path:
                        o = L[layer].plain_step(st, wn, s, x[layer, r, :, u], a[layer, r, u],
                                                b[layer, r, u])
                    np.testing.assert_allclose(outs[layer][r, t], o, rtol=1e-6, atol=1e-6)
            last[r] = rng.integers(0, T)  # the accepted step: its path is what stays

        # commit every layer in one call each; then the plain decoder follows the accepted paths
        steps = np.where(idx >= 0, last, -1).astype(np.int64)
        ds.update_state_after_verify(pool.states(), pool.intermediate_states(), idx, steps,
                                     scratch_rows, accepted_is_step=True)
        ds.update_conv_state_after_verify(pool.conv_states(), pool.intermediate_conv_window(),
                                          idx, steps, scratch_rows, accepted_is_step=True)
        for r in range(B):
            if idx[r] < 0:
                continue
            parent = trees[r][0] if tree else np.arange(T) - 1
            path = path_to(parent, int(last[r])) if tree else list(range(int(last[r]) + 1))
            for layer in range(layers):
                for u in path:
                    L[layer].plain_step(ref_state[layer], ref_win[layer], idx[r], x[layer, r, :, u],
                                        a[layer, r, u], b[layer, r, u])
        for layer in range(layers):
            np.testing.assert_array_equal(pool.layer_state(layer)[rows], ref_state[layer][rows])
            np.testing.assert_array_equal(pool.conv_state(layer)[rows], ref_win[layer][rows])
        np.testing.assert_array_equal(pool.states()[:, free], SENTINEL)
        np.testing.assert_array_equal(pool.conv_states()[:, free], SENTINEL)


def test_vllm_rounds_without_a_commit():
    """vLLM's scheme, no scratch and no commit copy: the conv state holds width-2 older entries
    and the last round's drafts (num_accept_tokens picks the window after the accepted ones),
    and verify writes the state after each draft t to its own pool slot token_state_indices[n, t]
    and starts from slot [n, num_accepted - 1]. Every round's outputs equal plain single-token
    decode from the state and window the accepted drafts of the earlier rounds leave."""
    rng = np.random.default_rng(77)
    B, T, slots_per_row = 3, 4, 5
    L = Layer(rng)
    state = np.zeros((B * slots_per_row + 1, HV, V, K), np.float32)  # one row of T + 1 slots each
    table = np.arange(B * slots_per_row, dtype=np.int32).reshape(B, slots_per_row)[:, :T]
    win = np.zeros((B, CONV_DIM, W - 2 + T), np.float32)  # vLLM's spec conv state
    ref_state = np.zeros((B, HV, V, K), np.float32)
    ref_win = rng.uniform(-1, 1, (B, CONV_DIM, W - 1)).astype(np.float32)
    win[:, :, :W - 1] = ref_win
    for r in range(B):
        state[table[r, 0]] = ref_state[r] = rng.uniform(-0.3, 0.3, (HV, V, K))
    accepted = np.ones(B, np.int32)  # the first round starts from column 0
    for _ in range(4):
        x = rng.standard_normal((B, CONV_DIM, T)).astype(np.float32)
        a = rng.standard_normal((B, T, HV)).astype(np.float32)
        b = rng.standard_normal((B, T, HV)).astype(np.float32)
        y = ds.causal_conv1d_update(x, win, L.w, L.bias, "silu", None, None, accepted)
        q, k, v = split_qkv(y)
        out = np.full((B, T, HV, V), np.nan, np.float32)
        ds.verify(q, k, v, a, b, out, state, A_log=L.A_log, dt_bias=L.dt_bias,
                  token_state_indices=table, num_accepted_tokens=accepted)
        for r in range(B):  # plain decode of every draft from the committed state and window
            st, wn = ref_state.copy(), ref_win.copy()
            for t in range(T):
                o = L.plain_step(st, wn, r, x[r, :, t], a[r, t], b[r, t])
                np.testing.assert_allclose(out[r, t], o, rtol=1e-6, atol=1e-6)
                np.testing.assert_array_equal(state[table[r, t]], st[r])  # the slot of draft t
        accepted = rng.integers(1, T + 1, size=B).astype(np.int32)
        for r in range(B):  # the plain decoder keeps the accepted drafts only
            for t in range(accepted[r]):
                L.plain_step(ref_state, ref_win, r, x[r, :, t], a[r, t], b[r, t])


def test_kda_round_with_split_windows():
    """Kimi-Linear's layout: three conv windows (q, k, v) per layer in the pool, each with its own
    scratch windows and commit, the KDA gate per key channel. Two rounds of a chain, committed
    over every layer per part; states and windows equal plain single-token decode bit for bit."""
    rng = np.random.default_rng(99)
    Hk = HVk = 2
    T, layers = 3, 2
    dims = {"q": Hk * K, "k": Hk * K, "v": HVk * V}
    pool = ds.StatePool(layers, 4, HVk, V, K, H=Hk, conv_dim=sum(dims.values()), conv_width=W,
                        conv_split_qkv=True, spec_rows=3, spec_steps=T, framework="numpy")
    live = [pool.allocate() for _ in range(2)]
    idx = np.array([live[1], -1, live[0]], np.int32)
    rows = np.arange(3, dtype=np.int32)
    B = len(idx)
    w = [{p: (rng.standard_normal((d, W)) * 0.5).astype(np.float32) for p, d in dims.items()}
         for _ in range(layers)]
    A_log = [(rng.random(HVk) * 2 - 1).astype(np.float32) for _ in range(layers)]
    dt_bias = [(rng.random(HVk * K) - 0.5).astype(np.float32) for _ in range(layers)]
    for layer in range(layers):
        pool.layer_state(layer)[live] = rng.uniform(-0.3, 0.3, (2, HVk, V, K))
        for p, d in dims.items():
            pool.conv_state(layer, p)[live] = rng.uniform(-1, 1, (2, d, W - 1))
    ref_state = [pool.layer_state(layer).copy() for layer in range(layers)]
    ref_win = [{p: pool.conv_state(layer, p).copy() for p in dims} for layer in range(layers)]

    def qkv(ys, T_):
        q = np.ascontiguousarray(ys["q"].transpose(0, 2, 1)).reshape(-1, T_, Hk, K)
        k = np.ascontiguousarray(ys["k"].transpose(0, 2, 1)).reshape(-1, T_, Hk, K)
        v = np.ascontiguousarray(ys["v"].transpose(0, 2, 1)).reshape(-1, T_, HVk, V)
        return q, k, v

    def plain_step(layer, s, xs, a, b):  # one token of slot s on the reference copies
        ys = {p: ds.causal_conv1d_update(xs[p][None, :], ref_win[layer][p], w[layer][p], None,
                                         "silu", None, np.array([s], np.int32))[:, :, None]
              for p in dims}
        q, k, v = qkv(ys, 1)
        out = np.zeros((1, 1, HVk, V), np.float32)
        ds.verify(q, k, v, a[None, None], b[None, None], out, ref_state[layer],
                  np.array([s], np.int32), A_log=A_log[layer], dt_bias=dt_bias[layer],
                  is_kda=True)
        return out[0, 0]

    for _ in range(2):
        steps = np.array([rng.integers(0, T), -1, rng.integers(0, T)], np.int64)
        for layer in range(layers):
            x = {p: rng.standard_normal((B, d, T)).astype(np.float32) for p, d in dims.items()}
            a = rng.standard_normal((B, T, HVk, K)).astype(np.float32)
            b = rng.standard_normal((B, T, HVk)).astype(np.float32)
            ys = {p: ds.causal_conv1d_update(x[p], pool.conv_state(layer, p), w[layer][p], None,
                                             "silu", None, idx, None,
                                             pool.intermediate_conv_window(layer, p), rows)
                  for p in dims}
            q, k, v = qkv(ys, T)
            out = np.full((B, T, HVk, V), np.nan, np.float32)
            ds.verify(q, k, v, a, b, out, pool.layer_state(layer), idx, A_log=A_log[layer],
                      dt_bias=dt_bias[layer], is_kda=True, update_state=False,
                      intermediate_states=pool.intermediate_states(layer),
                      intermediate_state_indices=rows)
            for r in range(B):  # plain decode of the accepted chain, checking each output
                if idx[r] < 0:
                    assert np.all(out[r] == 0)
                    continue
                for t in range(int(steps[r]) + 1):
                    o = plain_step(layer, idx[r], {p: x[p][r, :, t] for p in dims}, a[r, t],
                                   b[r, t])
                    np.testing.assert_allclose(out[r, t], o, rtol=1e-6, atol=1e-6)
        ds.update_state_after_verify(pool.states(), pool.intermediate_states(), idx, steps, rows,
                                     accepted_is_step=True)
        for p in dims:
            ds.update_conv_state_after_verify(pool.conv_states(p),
                                              pool.intermediate_conv_window(None, p), idx, steps,
                                              rows, accepted_is_step=True)
        for layer in range(layers):
            np.testing.assert_array_equal(pool.layer_state(layer)[live], ref_state[layer][live])
            for p in dims:
                np.testing.assert_array_equal(pool.conv_state(layer, p)[live],
                                              ref_win[layer][p][live])
