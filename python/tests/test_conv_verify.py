"""causal_conv1d_update's speculative-verify options (SGLang's causal_conv1d_update arguments:
intermediate_conv_window / intermediate_state_indices, num_accept_tokens, the EAGLE tree's
retrieve_next_token / retrieve_next_sibling / retrieve_parent_token) on CPU tensors (numpy, and
torch for 16-bit windows), against a float64 reference written from the semantics: token t
convolves the window followed by its ancestors in the tree (a chain: the tokens before it), the
window after token t is that sequence's last width-1 values, the conv state rolls as SGLang's
kernel rolls it. A chain's windows equal plain single-token decode steps bit for bit; padded rows
and unused buffer rows are bit-untouched; every error text, with the caller's memory unchanged."""

import re

import numpy as np
import pytest

import deltastate as ds
from helpers import eagle_tree, torch

SENTINEL = np.float32(1e30)


def silu(y):
    return y / (1.0 + np.exp(-y))


def ref_row(hist, x, w, bias, act, parent):
    """Row outputs [dim, T] and windows [T, dim, W-1] in float64: token t's input sequence is
    the window `hist` [dim, W-1] followed by x at the ancestors of t (root first)."""
    dim, T = x.shape
    W = w.shape[1]
    out = np.zeros((dim, T))
    wins = np.zeros((T, dim, W - 1))
    for t in range(T):
        chain = [t]
        while chain[-1] > 0:
            chain.append(parent[chain[-1]] if parent is not None else chain[-1] - 1)
        seq = np.concatenate([hist.astype(np.float64), x[:, chain[::-1]].astype(np.float64)], 1)
        y = (seq[:, -W:] * w.astype(np.float64)).sum(1)
        if bias is not None:
            y = y + bias
        out[:, t] = silu(y) if act else y
        wins[t] = seq[:, -(W - 1):]
    return out, wins


def make(rng, B, dim, T, W, slots, state_len, dtype=np.float32):
    x = rng.standard_normal((B, dim, T)).astype(dtype)
    st = rng.standard_normal((slots, dim, state_len)).astype(dtype)
    w = (rng.standard_normal((dim, W)) * 0.5).astype(dtype)
    bias = (rng.standard_normal(dim) * 0.2).astype(dtype)
    return x, st, w, bias


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("T", [1, 3, 5])
def test_chain_windows_are_single_token_steps(W, T):
    rng = np.random.default_rng(10 * W + T)
    B, dim, slots, N_scr = 4, 12, 7, 6
    x, st, w, bias = make(rng, B, dim, T, W, slots, W - 1)
    idx = np.array([5, -1, 0, 3], dtype=np.int32)
    rows = np.array([4, 2, -1, 0], dtype=np.int32)
    inter = np.full((N_scr, T + 1, dim, W - 1), SENTINEL, dtype=np.float32)
    before = st.copy()
    plain_st = st.copy()
    plain = ds.causal_conv1d_update(x, plain_st, w, bias, "silu", None, idx)
    out = ds.causal_conv1d_update(x, st, w, bias, "silu", None, idx, None, inter, rows)
    # the outputs and the rolled windows are plain causal_conv1d_update's, bit for bit
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(st, plain_st)
    for b in range(B):
        if idx[b] < 0:
            assert np.all(out[b] == 0)
            continue
        ref, wins = ref_row(before[idx[b]], x[b], w, bias, True, None)
        np.testing.assert_allclose(out[b], ref, rtol=1e-5, atol=1e-5)
        if rows[b] < 0:
            continue
        # the window after token t is the window after t + 1 single-token steps
        step = before[idx[b] : idx[b] + 1].copy()
        for t in range(T):
            ds.causal_conv1d_update(x[b : b + 1, :, t], step, w, bias, "silu")
            np.testing.assert_array_equal(inter[rows[b], t], step[0])
        np.testing.assert_array_equal(inter[rows[b], T:], SENTINEL)  # steps past T untouched
        np.testing.assert_array_equal(inter[rows[b], :T], wins.astype(np.float32))
    # scratch rows no live row names, and the padded row's slot, are untouched
    for r in set(range(N_scr)) - {4, 0}:
        np.testing.assert_array_equal(inter[r], SENTINEL)
    np.testing.assert_array_equal(st[[1, 2, 4, 6]], before[[1, 2, 4, 6]])


@pytest.mark.parametrize("W", [2, 3, 4])
def test_eagle_tree(W):
    rng = np.random.default_rng(30 + W)
    B, dim, T, slots = 5, 9, 7, 6
    x, st, w, bias = make(rng, B, dim, T, W, slots, W - 1)
    idx = np.array([2, 0, -1, 5, 1], dtype=np.int32)
    trees = [eagle_tree(rng, T) for _ in range(B)]
    nxt = np.stack([t[1] for t in trees]).astype(np.int64)  # int64 beside int32 tables
    sib = np.stack([t[2] for t in trees])
    parents = np.full((B, T + 2), -7, dtype=np.int64)  # wider than T: the tail is untouched
    inter = np.full((B, T, dim, W - 1), SENTINEL, dtype=np.float32)
    before = st.copy()
    plain_st = st.copy()
    ds.causal_conv1d_update(x, plain_st, w, None, None, None, idx)
    out = ds.causal_conv1d_update(x, st, w, None, None, None, idx, None, inter, None, nxt, sib,
                                  parents)
    np.testing.assert_array_equal(st, plain_st)  # the window rolls as a chain's (SGLang's)
    for b in range(B):
        if idx[b] < 0:
            assert np.all(out[b] == 0)
            np.testing.assert_array_equal(parents[b], -7)
            np.testing.assert_array_equal(inter[b], SENTINEL)
            continue
        parent = trees[b][0]
        np.testing.assert_array_equal(parents[b, :T], parent)
        np.testing.assert_array_equal(parents[b, T:], -7)
        ref, wins = ref_row(before[idx[b]], x[b], w, None, False, parent)
        np.testing.assert_allclose(out[b], ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(inter[b], wins.astype(np.float32))


@pytest.mark.parametrize("W", [2, 3, 4])
def test_num_accept_rounds_follow_the_accepted_tokens(W):
    """vLLM's and SGLang's in-place scheme: the state holds width-2 older entries and the last
    drafts, the next round reads the window after the accepted ones. Every round's outputs equal
    plain causal_conv1d_update from the window a plain decode of the accepted tokens keeps."""
    rng = np.random.default_rng(50 + W)
    B, dim, T, slots = 3, 10, 4, 5
    L = W - 2 + T + 1  # one entry beyond what the scheme needs: never written
    _, st, w, bias = make(rng, B, dim, T, W, slots, L)
    idx = np.array([4, 1, 2], dtype=np.int32)
    plain = st[idx, :, : W - 1].copy()  # the windows a plain decode keeps, entries 0..W-2
    accept = np.ones(B, dtype=np.int32)
    last_entry = st[:, :, L - 1].copy()
    for _ in range(6):
        x = rng.standard_normal((B, dim, T)).astype(np.float32)
        want = ds.causal_conv1d_update(x, plain.copy(), w, bias, "silu")
        got = ds.causal_conv1d_update(x, st, w, bias, "silu", None, idx, accept)
        np.testing.assert_array_equal(got, want)
        accept = rng.integers(1, T + 1, size=B).astype(np.int32)
        for b in range(B):  # the plain windows follow the accepted drafts
            seq = np.concatenate([plain[b], x[b, :, : accept[b]]], 1)
            plain[b] = seq[:, -(W - 1):]
            np.testing.assert_array_equal(st[idx[b], :, W - 2 : W - 2 + T], x[b])
        np.testing.assert_array_equal(st[:, :, L - 1], last_entry)


def test_num_accept_with_intermediate_windows_and_a_tree():
    rng = np.random.default_rng(7)
    B, dim, T, W, slots = 2, 6, 5, 4, 3
    L = W - 2 + T
    x, st, w, bias = make(rng, B, dim, T, W, slots, L)
    idx = np.array([2, 0], dtype=np.int32)
    accept = np.array([3, 1], dtype=np.int64)
    trees = [eagle_tree(rng, T) for _ in range(B)]
    nxt = np.stack([t[1] for t in trees]).astype(np.int32)
    sib = np.stack([t[2] for t in trees]).astype(np.int32)
    parents = np.zeros((B, T), dtype=np.int32)
    inter = np.full((B, T, dim, W - 1), SENTINEL, dtype=np.float32)
    before = st.copy()
    out = ds.causal_conv1d_update(x, st, w, bias, None, None, idx, accept, inter, None, nxt, sib,
                                  parents)
    for b in range(B):
        a, s = int(accept[b]), idx[b]
        hist = before[s, :, a - 1 : a - 1 + W - 1]
        ref, wins = ref_row(hist, x[b], w, bias, False, trees[b][0])
        np.testing.assert_allclose(out[b], ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(inter[b], wins.astype(np.float32))
        rolled = before[s].copy()
        rolled[:, : W - 2] = before[s, :, a : a + W - 2]
        rolled[:, W - 2 : W - 2 + T] = x[b]
        np.testing.assert_array_equal(st[s], rolled)


def test_layouts_and_the_deduplicated_window_view():
    """vLLM's dim-contiguous conv state; SGLang's deduplicated intermediate view (step stride =
    window stride over one [dim, T + W - 2] buffer per row) ends as [window[1:], x]."""
    rng = np.random.default_rng(11)
    B, dim, T, W = 3, 8, 4, 4
    x = rng.standard_normal((B, dim, T)).astype(np.float32)
    st = np.ascontiguousarray(rng.standard_normal((B, W - 1, dim)).astype(np.float32))
    st_view = st.transpose(0, 2, 1)  # [B, dim, W-1], stride 1 along dim
    w = rng.standard_normal((dim, W)).astype(np.float32)
    before = st_view.copy()
    span = T + W - 2
    buf = np.full((B, dim, span), SENTINEL, dtype=np.float32)
    es = buf.itemsize
    dedup = np.lib.stride_tricks.as_strided(
        buf, shape=(B, T, dim, W - 1), strides=(dim * span * es, es, span * es, es),
        writeable=True)
    out = ds.causal_conv1d_update(x, st_view, w, None, "silu", None, None, None, dedup)
    for b in range(B):
        ref, _ = ref_row(before[b], x[b], w, None, True, None)
        np.testing.assert_allclose(out[b], ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(buf[b], np.concatenate([before[b, :, 1:], x[b]], 1))
        np.testing.assert_array_equal(st_view[b],
                                      np.concatenate([before[b], x[b]], 1)[:, -(W - 1):])


def test_bf16_windows_through_torch():
    if torch is None:
        pytest.skip("torch is not installed")
    gen = torch.Generator().manual_seed(3)
    B, dim, T, W, slots = 3, 16, 4, 4, 4
    x = torch.randn(B, dim, T, generator=gen).to(torch.bfloat16)
    st = torch.randn(slots, dim, W - 1, generator=gen).to(torch.bfloat16)
    w = torch.randn(dim, W, generator=gen).to(torch.bfloat16)
    idx = torch.tensor([3, 0, -1], dtype=torch.int32)
    inter = torch.zeros(B, T, dim, W - 1, dtype=torch.bfloat16)
    before = st.clone()
    out = ds.causal_conv1d_update(x, st, w, None, "silu", conv_state_indices=idx,
                                  intermediate_conv_window=inter,
                                  intermediate_state_indices=torch.arange(B, dtype=torch.int32))
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    for b in range(2):
        ref, wins = ref_row(before[idx[b]].float().numpy(), x[b].float().numpy(),
                            w.float().numpy(), None, True, None)
        np.testing.assert_allclose(out[b].float().numpy(), ref, rtol=1e-2, atol=1e-2)
        np.testing.assert_array_equal(inter[b].float().numpy(), wins)  # copies: exact
    assert torch.all(out[2] == 0) and torch.all(inter[2] == 0)
    with pytest.raises(ValueError, match="must have the dtype of `conv_state`"):
        ds.causal_conv1d_update(x, st, w, conv_state_indices=idx,
                                intermediate_conv_window=inter.float())


def _base(rng, T=3, W=4, L=None):
    B, dim, slots = 2, 6, 4
    x, st, w, _ = make(rng, B, dim, T, W, slots, L or W - 1)
    return x, st, w


ERRORS = [
    (dict(cache_seqlens=np.zeros(2, np.int32), num_accept_tokens=np.ones(2, np.int32)),
     "`cache_seqlens` (a circular window) cannot be combined with `num_accept_tokens`, "
     "`intermediate_conv_window` or the `retrieve_*` tree tables."),
    (dict(num_accept_tokens=np.ones(3, np.int32)),
     "`num_accept_tokens` must have shape [batch]=(2) (got (3,))."),
    (dict(num_accept_tokens=np.ones(2, np.float32)), "num_accept_tokens"),
    (dict(num_accept_tokens=np.ones(2, np.int32)),
     "`conv_state` must have state_len >= width - 2 + seqlen = 5 with `num_accept_tokens` "
     "(got 3)."),
    (dict(intermediate_state_indices=np.zeros(2, np.int32)),
     "`intermediate_state_indices` needs `intermediate_conv_window`."),
    (dict(intermediate_conv_window=np.zeros((2, 2, 6, 3), np.float32)),
     "`intermediate_conv_window` must have shape [N_scr, >= seqlen, dim, width - 1]="
     "(N_scr, >= 3, 6, 3) (got (2, 2, 6, 3))."),
    (dict(intermediate_conv_window=np.zeros((2, 3, 6, 3), np.float32),
          intermediate_state_indices=np.zeros((2, 1), np.int32)),
     "`intermediate_state_indices` must have shape [batch]=(2) (got (2, 1))."),
    (dict(retrieve_next_token=np.full((2, 3), -1, np.int32)),
     "`retrieve_next_token`, `retrieve_next_sibling` and `retrieve_parent_token` go together "
     "(the EAGLE tree's child and sibling tables and the parents the op writes)."),
    (dict(retrieve_next_token=np.full((2, 2), -1, np.int32),
          retrieve_next_sibling=np.full((2, 3), -1, np.int32),
          retrieve_parent_token=np.zeros((2, 3), np.int32)),
     "`retrieve_next_token` must have shape [batch, >= seqlen]=(2, >= 3) (got (2, 2))."),
]


@pytest.mark.parametrize("kwargs,text", ERRORS)
def test_contract_errors_leave_memory_unchanged(kwargs, text):
    x, st, w = _base(np.random.default_rng(5))
    before = st.copy()
    with pytest.raises((ValueError, TypeError), match=re.escape(text)):
        ds.causal_conv1d_update(x, st, w, conv_state_indices=np.array([1, 3], np.int32), **kwargs)
    np.testing.assert_array_equal(st, before)


def test_host_range_errors_leave_memory_unchanged():
    rng = np.random.default_rng(6)
    x, st, w = _base(rng, T=3, W=4, L=5)
    idx = np.array([1, 3], dtype=np.int32)
    inter = np.full((2, 3, 6, 3), SENTINEL, dtype=np.float32)
    before = st.copy()
    cases = [
        (dict(num_accept_tokens=np.array([1, 0], np.int32)),
         r"`num_accept_tokens`\[1\]=0 is outside \[1, 3\]"),
        (dict(num_accept_tokens=np.array([4, 1], np.int32)),
         r"`num_accept_tokens`\[0\]=4 is outside \[1, 3\]"),
        (dict(intermediate_conv_window=inter, intermediate_state_indices=np.array([0, 2], np.int32)),
         r"`intermediate_state_indices`\[1\]=2 is out of range for an intermediate_conv_window of "
         r"2 rows"),
        (dict(retrieve_next_token=np.array([[1, -1, -1], [0, -1, -1]], np.int32),
              retrieve_next_sibling=np.full((2, 3), -1, np.int32),
              retrieve_parent_token=np.zeros((2, 3), np.int32)),
         r"`retrieve_next_token`\[1, 0\]=0 must name a later draft token \(1..2\) or be -1"),
        (dict(retrieve_next_token=np.array([[1, -1, -1], [1, -1, -1]], np.int32),
              retrieve_next_sibling=np.array([[-1, 2, -1], [-1, 3, -1]], np.int32),
              retrieve_parent_token=np.zeros((2, 3), np.int32)),
         r"`retrieve_next_sibling`\[1, 1\]=3 must name a later draft token \(2..2\) or be -1"),
    ]
    for kwargs, text in cases:
        out_inter = inter.copy()
        if "intermediate_conv_window" in kwargs:
            kwargs["intermediate_conv_window"] = out_inter
        with pytest.raises(ValueError, match=text):
            ds.causal_conv1d_update(x, st, w, conv_state_indices=idx, **kwargs)
        np.testing.assert_array_equal(st, before)
        np.testing.assert_array_equal(out_inter, SENTINEL)
    # a padded row's entries are not checked (nothing of it is read)
    ds.causal_conv1d_update(x, st, w, conv_state_indices=np.array([-1, 3], np.int32),
                            num_accept_tokens=np.array([0, 1], np.int32))


def test_sglang_only_arguments():
    x, st, w = _base(np.random.default_rng(8))
    idx = np.array([0, 2], np.int32)
    with pytest.raises(NotImplementedError, match="pad_slot_id"):
        ds.causal_conv1d_update(x, st, w, conv_state_indices=idx, pad_slot_id=0)
    ds.causal_conv1d_update(x, st, w, conv_state_indices=idx, pad_slot_id=-1, metadata=object(),
                            validate_data=True)


def test_tree_token_limit():
    rng = np.random.default_rng(9)
    T = 65
    x, st, w = _base(rng, T=T)
    tables = [np.full((2, T), -1, np.int32) for _ in range(2)] + [np.zeros((2, T), np.int32)]
    with pytest.raises(NotImplementedError, match="trees of up to 64 draft tokens"):
        ds.causal_conv1d_update(x, st, w, None, None, None, np.array([0, 1], np.int32), None, None,
                                None, *tables)
