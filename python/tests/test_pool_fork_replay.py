"""Prefix caching with pending ReplaySSM records (issue #37 section 3): StatePool.fork of a slot
whose checkpoint lags its tokens by m ring records materializes them into the destination.

A prefix hit taken mid-ring must restore the exact state: on the CPU with fp32 checkpoints and
rings, a forced fold of the next token on the source (its checkpoint and m records) and on the
fork (its materialized checkpoint, no records) give the same output and checkpoint bits, in every
layer, for the basic ring, circular rings at any cache_base, KDA prefix gates and pre-decayed
keys; in circular mode a fork taken at m = L-1 equals, bit for bit, the history checkpoint the
source's next (natural) step stores. The materialized state also matches the exact per-token
recurrence of the source's tokens (fp64 reference, SGLang's fp32 flush tolerances), the source,
its rings and every other slot are left bit-untouched, and the destination's cursor is 0. On a
quantized or stochastically rounded pool the fork stores through the format with the source's
key at the layer's step: at m = L-1 it equals, byte for byte (codes and scales), the history
checkpoint the source's next step stores, the step counters untouched by the fork."""

import numpy as np
import pytest

import deltastate as ds
import reference as ref
from cases import gate_params, materialize_packed, packed_data
from helpers import Fw, assert_close, bits, poison, to64, torch
from test_replayssm import flush_tol
from test_state_format import emulate, state_bits, write_slot

MODES = [
    pytest.param(False, 0, False, False, None, id="gdn-basic"),
    pytest.param(False, 2, False, False, None, id="gdn-circular"),
    pytest.param(True, 0, False, False, None, id="kda-basic"),
    pytest.param(True, 3, True, False, None, id="kda-circular-prefix"),
    pytest.param(True, 1, True, True, -5.0, id="kda-predecay"),
]


class Layered:
    """A pool with rings, slots filled with random checkpoints, per-layer gate parameters, and a
    decode of one token on chosen rows of every layer."""

    def __init__(self, framework, rng, *, kda, L, lb, state_dtype="float32", state_rounding=None):
        self.fw, self.rng, self.kda, self.L, self.lb = Fw(framework), rng, kda, L, lb
        self.H, self.HV, self.V, self.K, self.layers = 2, 2, 8, 16, 2
        self.pool = ds.StatePool(layers=self.layers, slots=5, HV=self.HV, V=self.V, K=self.K,
                                 replay_len=L, H=self.H, kda=kda, ring_k_dtype="float32",
                                 state_dtype=state_dtype, state_rounding=state_rounding,
                                 rounding_seed=9, framework=framework)
        self.slots = [self.pool.allocate() for _ in range(4)]
        for layer in range(self.layers):
            st = self.pool.layer_state(layer)
            if self.pool.quantized:  # codes and row scales of random states
                for s in range(tuple(st.shape)[0]):
                    x = (rng.standard_normal(tuple(st.shape)[1:]) * 0.5).astype(np.float32)
                    write_slot(self.pool, layer, s, *emulate(x, state_dtype, False))
            else:
                st[...] = self.fw.from64(rng.standard_normal(tuple(st.shape)) * 0.5, state_dtype)
        self.params = [gate_params(rng, self.HV, self.K, kda) for _ in range(self.layers)]
        self.exact = ([None] * self.layers if self.pool.quantized
                      else [to64(self.pool.layer_state(l)) for l in range(self.layers)])

    def step(self, rows, wp, base, force, modes, inputs=None, exact_rows=()):
        """One token on `rows` in every layer (the same token for every row when `inputs` is
        given per layer); returns the outputs per layer and the inputs used."""
        fw, B = self.fw, len(rows)
        outs, used = [], []
        for layer in range(self.layers):
            if inputs is None:
                d = packed_data(self.rng, kda=self.kda, B=1, H=self.H, HV=self.HV, K=self.K,
                                V=self.V)
                d = {k: np.repeat(v, B, axis=0) for k, v in d.items()}
                if self.kda:
                    d["a"] = d["a"].reshape(B, self.HV, self.K)
            else:
                d = inputs[layer]
            used.append(d)
            x = materialize_packed(fw, d, "float32")
            out = poison(fw, (B, 1, self.HV, self.V), "float32")
            A_log, dt_bias = self.params[layer]
            if self.kda:
                dt_bias = dt_bias.reshape(self.HV, self.K)
            ds.fused_recurrent_linear_replayssm_decode(
                x["mixed_qkv"], x["a"], x["b"], fw.from64(A_log), fw.from64(dt_bias),
                self.K ** -0.5, self.pool.layer_state(layer), self.pool.d_cache(layer),
                self.pool.k_cache(layer), self.pool.g_cache(layer), out, fw.idx(rows),
                fw.idx(wp), fw.idx(force), self.lb, True, self.kda,
                cache_base=fw.idx(base), circular_replay=modes[0],
                prefix_gate_cache=modes[1], predecayed_k_cache=modes[2],
                **self.pool.state_format(layer))
            outs.append(to64(out))
            for n in exact_rows:  # the exact recurrence of row n's slot
                s = rows[n]
                _, self.exact[layer] = ref.packed_decode(
                    to64(x["mixed_qkv"])[n:n + 1], to64(x["a"]).reshape(B, -1)[n:n + 1],
                    to64(x["b"])[n:n + 1], A_log, self.params[layer][1].reshape(-1),
                    self.K ** -0.5, self.exact[layer], [s], kda=self.kda, lower_bound=self.lb)
        return outs, used

    def memory_bits(self):
        p = self.pool
        return [bits(a) for l in range(self.layers)
                for a in (p.layer_state(l), p.d_cache(l), p.k_cache(l), p.g_cache(l))]


def _pend_circular(t, src, L, base0, modes):
    """L - 1 circular steps of `src` from cursor 0 and base `base0`, so that it holds L - 1
    pending records: its cursor set to them; (cursor, base)."""
    m, base = 0, base0
    for _ in range(L - 1):
        t.step([src], [m], [base], [0], modes)
        m, base = _advance(True, L, m, base)
    assert m == L - 1
    t.pool.set_cursor(src, m)
    return m, base


def _advance(circular, L, m, base):
    """The caller's cursor rule after a non-forced step: (wp, base)."""
    if circular and m == L - 1 and L > 1:
        return 1, (base + m) % L
    if not circular and m == L - 1:
        return 0, base
    return m + 1, base


@pytest.mark.parametrize("framework", ["numpy"])
@pytest.mark.parametrize("kda,base0,prefix,predecay,lb", MODES)
@pytest.mark.parametrize("L,steps", [(4, 2), (4, 7), (8, 5)], ids=["L4-m2", "L4-wrap", "L8-m5"])
def test_fork_mid_ring_restores_the_exact_state(framework, rng, kda, base0, prefix, predecay, lb,
                                                L, steps):
    circular = base0 != 0 or predecay
    modes = (circular, prefix, predecay)
    t = Layered(framework, rng, kda=kda, L=L, lb=lb)
    src, dst, other = t.slots[0], t.slots[1], t.slots[2]
    m, base = 0, base0 % L
    for _ in range(steps):  # src decodes alone: appends, natural flushes, history checkpoints
        t.step([src], [m], [base], [0], modes, exact_rows=[0])
        m, base = _advance(circular, L, m, base)
    assert m > 0, "the fork must be taken mid-ring"
    t.pool.set_cursor(src, m)
    t.pool.set_cursor(dst, 3)
    before = t.memory_bits()
    t.pool.fork(src, dst, cache_base=base, prefix_gate_cache=prefix, predecayed_k_cache=predecay)
    assert t.pool.cursor(dst) == 0 and t.pool.cursor(src) == m
    after = t.memory_bits()
    for i, (b, a) in enumerate(zip(before, after)):
        changed = b != a
        if i % 4 == 0:  # a state: only dst's rows may change
            changed[dst] = False
        assert not changed.any(), f"fork wrote outside dst's checkpoint (view {i})"
    for layer in range(t.layers):  # the state after src's tokens
        assert_close(to64(t.pool.layer_state(layer))[dst], t.exact[layer][src],
                     flush_tol(kda, "float32"), "float32", f"materialized layer {layer}")

    # A prefix hit: the same next token folded (forced) on src with its records and on dst.
    outs, _ = t.step([src, dst, -1], [m, 0, 0], [base, 0, 0], [1, 1, 0], modes)
    for layer in range(t.layers):
        np.testing.assert_array_equal(outs[layer][0], outs[layer][1],
                                      err_msg=f"layer {layer} output")
        st = bits(t.pool.layer_state(layer))
        np.testing.assert_array_equal(st[src], st[dst], err_msg=f"layer {layer} checkpoint")
        assert (outs[layer][2] == 0).all()
    del other


@pytest.mark.parametrize("kda,base0,prefix,predecay,lb",
                         [p for p in MODES if p.id not in ("gdn-basic", "kda-basic")])
def test_fork_at_full_ring_equals_the_history_checkpoint(rng, kda, base0, prefix, predecay, lb):
    """Circular mode: a fork at m = L-1 materializes exactly what the source's next natural
    step stores as its history checkpoint (the state before that token)."""
    L = 4
    modes = (True, prefix, predecay)
    t = Layered("numpy", rng, kda=kda, L=L, lb=lb)
    src, dst = t.slots[0], t.slots[1]
    m, base = _pend_circular(t, src, L, base0, modes)
    t.pool.fork(src, dst, cache_base=base, prefix_gate_cache=prefix, predecayed_k_cache=predecay)
    t.step([src], [m], [base], [0], modes)  # natural: S0 <- the state before the token
    for layer in range(t.layers):
        st = bits(t.pool.layer_state(layer))
        np.testing.assert_array_equal(st[src], st[dst], err_msg=f"layer {layer}")


def test_fork_bf16_pool_and_refusals(rng):
    """A bf16 checkpoint pool materializes in fp32 and rounds once on store (within the bf16
    flush tolerance of the exact state); a bad cache_base or a pre-decay flag on a GDN pool is
    refused before anything is written."""
    t = Layered("torch" if torch is not None else "numpy", rng, kda=False, L=4, lb=None,
                state_dtype="bfloat16" if torch is not None else "float16")
    src, dst = t.slots[0], t.slots[1]
    m = 0
    for _ in range(3):
        t.step([src], [m], [0], [0], (False, False, False), exact_rows=[0])
        m += 1
    t.pool.set_cursor(src, m)
    before = t.memory_bits()
    with pytest.raises(ValueError, match=r"^StatePool.fork: cache_base=4 is outside the ring "
                                         r"\[0, L-1=3\]$"):
        t.pool.fork(src, dst, cache_base=4)
    with pytest.raises(ValueError, match="^Pre-decayed K requires KDA circular replay"):
        t.pool.fork(src, dst, cache_base=1, prefix_gate_cache=True, predecayed_k_cache=True)
    assert all((b == a).all() for b, a in zip(before, t.memory_bits()))
    t.pool.fork(src, dst)
    dt = str(t.pool.layer_state(0).dtype).replace("torch.", "")
    for layer in range(t.layers):
        assert_close(to64(t.pool.layer_state(layer))[dst], t.exact[layer][src],
                     flush_tol(False, dt), dt, f"materialized layer {layer}")


@pytest.mark.parametrize("dtype,rounding", [("float8_e4m3fn", None), ("int8", None),
                                            ("int8", "stochastic"), ("bfloat16", "stochastic")],
                         ids=["fp8-sr", "int8-rn", "int8-sr", "bf16-sr"])
@pytest.mark.parametrize("kda,base0,prefix,predecay,lb",
                         [p for p in MODES if p.id in ("gdn-circular", "kda-circular-prefix")])
def test_fork_formatted_pool_equals_the_flush(rng, kda, base0, prefix, predecay, lb, dtype,
                                              rounding):
    """A quantized or stochastically rounded pool: a fork at m = L-1 (circular rings) stores, byte
    for byte, the history checkpoint the source's next natural step stores (codes and scales,
    rounded with the source's key at the same step: the fork is the source's flush copied);
    the fork writes only dst's checkpoint and cursor and leaves the step counters alone."""
    if dtype == "bfloat16" and torch is None:
        pytest.skip("bfloat16 pools need torch")
    L = 4
    modes = (True, prefix, predecay)
    t = Layered("torch" if dtype == "bfloat16" else "numpy", rng, kda=kda, L=L, lb=lb,
                state_dtype=dtype, state_rounding=rounding)
    src, dst = t.slots[0], t.slots[1]
    m, base = _pend_circular(t, src, L, base0, modes)
    steps = [int(t.pool.rounding_step(l)[0]) for l in range(t.layers)] if t.pool.stochastic \
        else None
    def views():  # per layer: the state, the rings, the scales of a quantized pool
        v = t.memory_bits()
        if t.pool.quantized:
            v += [state_bits(t.pool, l)[1] for l in range(t.layers)]
        return v

    before = views()
    t.pool.fork(src, dst, cache_base=base, prefix_gate_cache=prefix)
    assert t.pool.cursor(dst) == 0 and t.pool.cursor(src) == m
    for i, (b, a) in enumerate(zip(before, views())):
        changed = b != a
        if i % 4 == 0 or i >= 4 * t.layers:  # a state or its scales: only dst's rows may change
            changed[dst] = False
        assert not changed.any(), f"fork wrote outside dst's checkpoint (view {i})"
    if steps is not None:
        assert [int(t.pool.rounding_step(l)[0]) for l in range(t.layers)] == steps
    for layer in range(t.layers):
        if t.pool.quantized:
            codes, scales = state_bits(t.pool, layer)
            assert not np.array_equal(codes[dst], codes[src]) or \
                not np.array_equal(scales[dst], scales[src]), "dst is not a plain copy"
    t.step([src], [m], [base], [0], modes)  # natural: S0 <- the state before the token
    for layer in range(t.layers):
        if t.pool.quantized:
            codes, scales = state_bits(t.pool, layer)
            np.testing.assert_array_equal(codes[src], codes[dst], err_msg=f"codes, layer {layer}")
            np.testing.assert_array_equal(scales[src], scales[dst],
                                          err_msg=f"scales, layer {layer}")
        else:
            st = bits(t.pool.layer_state(layer))
            np.testing.assert_array_equal(st[src], st[dst], err_msg=f"layer {layer}")
