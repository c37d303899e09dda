"""SGLang's ReplaySSM ring modes in `fused_recurrent_linear_replayssm_decode` (circular replay
with cache_base and history checkpoints, prefix gates, pre-decayed keys), GDN and KDA, on numpy
and torch-CPU inputs: many steps against the float64 reference (outputs, the checkpoint where it
is written, the ring record at its circular position, nothing else touched), against the exact
per-token recurrence, the caller's cursor protocol (forced -> base 0, wp 0; natural -> base
(base+wp) mod L, wp 1; otherwise wp + 1), and every new error text."""

import numpy as np
import pytest

import deltastate as ds
import reference as ref
from helpers import (TOL_REPLAY_G, TOL_REPLAY_RING, assert_close, bits, poison, to64)
from test_replayssm import ReplaySetup, flush_tol, out_tol


class ModeSetup(ReplaySetup):
    d_dtype = None  # the d ring's dtype when not the state's (pre-decayed keys: the k ring's)

    def resync(self):
        super().resync()
        if self.d_dtype is not None:
            self.mem.d_dtype = self.d_dtype

    def step_modes(self, rng, act, indices, write_pos, cache_base, force_flush=None, *,
                   circular, prefix, predecay, lower_bound=None, check=True, advance=False):
        fw, B = self.fw, len(indices)
        x = self.inputs(rng, B, act)
        idx, wp, cb = fw.idx(indices), fw.idx(write_pos), fw.idx(cache_base)
        ff = None if force_flush is None else fw.idx(force_flush)
        out = poison(fw, (B, 1, self.HV, self.V), act)
        scale = self.K ** -0.5
        before = [self.pool.bits(), bits(self.d_cache), bits(self.k_cache), bits(self.g_cache)]
        cb_before = bits(cb)
        res = ds.fused_recurrent_linear_replayssm_decode(
            x["mixed_qkv"], x["a"], x["b"], self.A_log, self.dt_bias, scale, self.pool.view,
            self.d_cache, self.k_cache, self.g_cache, out, idx, wp, ff, lower_bound, True,
            self.kda, None, 1, 3, 2, cb, circular, prefix, predecay, advance_write_pos=advance)
        assert res[0] is out and res[1] is self.pool.view
        want_out, flushed, new_wp, new_base = ref.replayssm_decode(
            self.mem, to64(x["mixed_qkv"]), to64(x["a"]), to64(x["b"]), to64(self.A_log),
            to64(self.dt_bias), scale, indices, write_pos, force_flush, kda=self.kda,
            b_dtype=act, lower_bound=lower_bound, cache_base=cache_base, circular=circular,
            prefix=prefix, predecay=predecay)
        if advance:  # the caller's rule, in the kernel; padded rows keep theirs
            np.testing.assert_array_equal(to64(wp), new_wp)
            np.testing.assert_array_equal(to64(cb), new_base)
        else:  # the kernel moves no cursor and never writes cache_base
            np.testing.assert_array_equal(to64(wp), np.asarray(write_pos))
            assert (bits(cb) == cb_before).all(), "cache_base was written"
        if not check:
            return flushed, new_wp, new_base, out
        got = to64(out)
        assert not np.isnan(got).any(), "an output element was not written"
        for n, s in enumerate(indices):
            if s < 0:
                assert (got[n] == 0).all(), "padded rows must output zeros"
        assert_close(got, want_out, out_tol(self.kda, act), act, "out")

        L = self.L
        flushed_slots = [s for n, s in enumerate(indices) if s >= 0 and flushed[n]]
        state = self.pool.state64()
        for s in flushed_slots:
            assert_close(state[s], self.mem.state[s], flush_tol(self.kda, self.state_dtype),
                         self.state_dtype, f"checkpoint[{s}]")
        self.pool.assert_untouched_outside(before[0], flushed_slots, "checkpoint")

        # The record of every appending row lies at (base + m) mod L (circular) or m.
        rec = []
        for n, s in enumerate(indices):
            if s < 0:
                continue
            m = int(write_pos[n])
            forced = force_flush is not None and force_flush[n] != 0
            folds = (forced or L == 1) if circular else (m == L - 1 or forced)
            if not folds:
                rec.append((s, (int(cache_base[n]) + m) % L if circular else m))
        for name, arr, tol, dtype, before_bits in (
                ("d_cache", self.d_cache, TOL_REPLAY_RING, self.state_dtype, before[1]),
                ("k_cache", self.k_cache, TOL_REPLAY_RING, self.k_dtype, before[2]),
                ("g_cache", self.g_cache, TOL_REPLAY_G, "float32", before[3])):
            got_ring = to64(arr)
            want_ring = {"d_cache": self.mem.d, "k_cache": self.mem.k, "g_cache": self.mem.g}[name]
            mask = np.zeros(got_ring.shape, dtype=bool)
            for s, p in rec:
                mask[s, :, p] = True
                assert_close(got_ring[s, :, p], want_ring[s, :, p], tol, dtype, f"{name}[{s},:,{p}]")
            changed = (bits(arr) != before_bits) & ~mask
            assert not changed.any(), f"{name}: entries other than the new records changed"
        return flushed, new_wp, new_base, out


# (kda, L, circular, prefix, predecay, act, state dtype, ring dtypes, lower_bound, steps)
CASES = [
    pytest.param(False, 4, True, False, False, "float32", "float32", "float32", None, 18,
                 id="gdn-circ-L4"),
    pytest.param(False, 3, True, True, False, "float32", "float32", "float32", None, 14,
                 id="gdn-circ-prefix-ignored-L3"),
    pytest.param(False, 1, True, False, False, "float32", "float32", "float32", None, 5,
                 id="gdn-circ-L1"),
    pytest.param(True, 4, True, False, False, "float32", "float32", "float32", None, 18,
                 id="kda-circ-L4"),
    pytest.param(True, 4, False, True, False, "float32", "float32", "float32", -5.0, 14,
                 id="kda-prefix-L4"),
    pytest.param(True, 5, True, True, False, "float32", "float32", "float32", None, 18,
                 id="kda-circ-prefix-L5"),
    pytest.param(True, 4, True, True, True, "float32", "float32", "float32", -5.0, 18,
                 id="kda-predecay-L4"),
    pytest.param(True, 8, True, True, True, "float16", "float32", "float32", -5.0, 20,
                 id="kda-predecay-L8-f16"),
    pytest.param(True, 4, True, True, True, "bfloat16", "float32", "bfloat16", -5.0, 12,
                 id="kda-predecay-L4-bf16"),
    pytest.param(False, 4, True, False, False, "bfloat16", "bfloat16", "bfloat16", None, 12,
                 id="gdn-circ-L4-bf16all"),
]


@pytest.mark.parametrize("kda,L,circular,prefix,predecay,act,state_dtype,ring_dtype,lb,steps",
                         CASES)
def test_modes_match_reference(fw, rng, kda, L, circular, prefix, predecay, act, state_dtype,
                               ring_dtype, lb, steps):
    if not all(fw.supports(t) for t in (act, state_dtype, ring_dtype)):
        pytest.skip("numpy has no bfloat16")
    H, HV, K, V = (2, 4, 16, 8) if not kda else (2, 2, 8, 16)
    setup = ModeSetup(fw, rng, kda=kda, H=H, HV=HV, K=K, V=V, L=L, slots=7, live=[1, 3, 4, 6],
                      state_dtype=state_dtype, k_dtype=ring_dtype, a_3d=kda)
    if predecay and ring_dtype != state_dtype:  # predecay: d and k rings of one dtype
        setup.d_cache = fw.full((7, HV, L, V), 1e30 if ring_dtype == "float32" else 1e4,
                                ring_dtype)
        setup.d_dtype = setup.mem.d_dtype = ring_dtype
        setup.mem.d = to64(setup.d_cache)
    rows = np.array([4, 1, -1, 6])  # row -> slot; row 2 is padding
    write_pos = np.zeros(len(rows), dtype=np.int64)
    base = np.array([0, L - 1, 0, L // 2], dtype=np.int64)  # circular rings start anywhere
    histories = 0
    for step in range(steps):
        indices = rows.copy()
        if step % 5 == 3:
            indices[0] = -1  # row 0 idle this step: its cursors stay
        force = None
        if step % 4 == 1:
            force = (rng.random(len(rows)) < 0.3).astype(np.int64)
        flushed, new_wp, new_base, _ = setup.step_modes(
            rng, act, indices, write_pos, base, force, circular=circular, prefix=prefix,
            predecay=predecay, lower_bound=lb, advance=step % 2 == 1)
        histories += int(((new_wp == 1) & (write_pos == L - 1)).sum()) if circular else 0
        write_pos, base = new_wp, new_base
        if state_dtype != "float32" or ring_dtype != "float32":
            setup.resync()
    if circular and L > 1:
        assert histories > 0, "no history checkpoint was exercised"


@pytest.mark.parametrize("kda,prefix,predecay,lb", [
    (False, False, False, None), (True, False, False, None), (True, True, False, None),
    (True, True, True, -5.0)], ids=["gdn", "kda", "kda-prefix", "kda-predecay"])
@pytest.mark.parametrize("L", [3, 4, 8])
def test_circular_matches_exact_recurrence(fw, rng, kda, prefix, predecay, lb, L):
    """40 steps of circular ReplaySSM against the exact per-token recurrence (packed decode): the
    output every step, and the checkpoint after every forced fold (the state after the token) and
    after every history checkpoint (the state before the token), at SGLang's fp32 tolerances."""
    H, HV, K, V = (1, 2, 16, 16) if not predecay else (2, 2, 16, 16)
    setup = ModeSetup(fw, rng, kda=kda, H=H, HV=HV, K=K, V=V, L=L, slots=4, live=[0, 2, 3],
                      state_dtype="float32", k_dtype="float32", a_3d=kda)
    rows = np.array([2, 0, 3])
    exact = setup.pool.state64()
    write_pos = np.zeros(3, dtype=np.int64)
    base = np.array([1 % L, 0, L - 1], dtype=np.int64)
    checked = 0
    for step in range(40):
        force = np.array([0, int(step % 11 == 5), int(step % 7 == 2)])
        before_exact = exact.copy()
        flushed, new_wp, new_base, out = setup.step_modes(
            rng, "float32", rows, write_pos, base, force, circular=True, prefix=prefix,
            predecay=predecay, lower_bound=lb)
        x = setup.last
        want_out, exact = ref.packed_decode(
            to64(x["mixed_qkv"]), to64(x["a"]).reshape(len(rows), -1), to64(x["b"]),
            to64(setup.A_log), to64(setup.dt_bias).reshape(-1), K ** -0.5, exact, rows, kda=kda,
            lower_bound=lb)
        assert_close(to64(out), want_out, out_tol(kda, "float32"), "float32", f"out, step {step}")
        state = setup.pool.state64()
        for n, s in enumerate(rows):
            if not flushed[n]:
                continue
            checked += 1
            want = exact[s] if force[n] else before_exact[s]  # fold vs history checkpoint
            assert_close(state[s], want, flush_tol(kda, "float32"), "float32",
                         f"checkpoint[{s}], step {step}")
        write_pos, base = new_wp, new_base
    assert checked >= 3 * (40 // L) - 3


_OK = object()  # a valid cache_base


def _mode_call(fw, *, kda=True, B=2, H=2, HV=2, K=16, V=16, L=4, act="float32",
               state_dtype="float32", d_dtype=None, k_dtype=None, lb=-5.0, cache_base=_OK,
               circular=True, prefix=True, predecay=True, advance=False, wp=None, idx=None):
    rng = np.random.default_rng(0)
    x = fw.from64(rng.standard_normal((B, 2 * H * K + HV * V)), act)
    a = fw.from64(rng.standard_normal((B, HV, K) if kda else (B, HV)), act)
    b = fw.from64(rng.standard_normal((B, HV)), act)
    A_log = fw.from64(np.zeros(HV))
    dt = fw.from64(np.zeros((HV, K) if kda else (HV,)))
    state = fw.full((3, HV, V, K), 0.0, state_dtype)
    d = fw.full((3, HV, L, V), 0.0, d_dtype or state_dtype)
    kc = fw.full((3, H, L, K), 0.0, k_dtype or "float32")
    g = fw.full((3, HV, L, K) if kda else (3, HV, L), 0.0, "float32")
    out = fw.full((B, 1, HV, V), 0.0, act)
    idx = fw.idx(np.arange(B) if idx is None else idx)
    wp = fw.idx(np.zeros(B, np.int64) if wp is None else wp)
    if cache_base is _OK:
        cache_base = fw.idx(np.zeros(B, np.int64))
    return ds.fused_recurrent_linear_replayssm_decode(
        x, a, b, A_log, dt, K ** -0.5, state, d, kc, g, out, idx, wp, None, lb, True, kda,
        cache_base=cache_base, circular_replay=circular, prefix_gate_cache=prefix,
        predecayed_k_cache=predecay, advance_write_pos=advance)


def test_modes_run_and_predecay_preconditions(fw):
    _mode_call(fw)  # a valid pre-decayed call
    _mode_call(fw, kda=False, prefix=False, predecay=False, lb=None)  # GDN circular
    with pytest.raises(ValueError, match=r"^`cache_base` must be a contiguous 1D int32 tensor "
                                         r"for circular replay\.$"):
        _mode_call(fw, cache_base=None)
    with pytest.raises(ValueError, match=r"for circular replay"):
        _mode_call(fw, cache_base=fw.idx([0, 0]).reshape(2, 1))
    with pytest.raises(ValueError, match=r"^`cache_base` must have shape \(2,\) \(got \(3,\)\)\.$"):
        _mode_call(fw, cache_base=fw.idx(np.zeros(3, np.int64)))
    texts = [
        (dict(prefix=False), "Pre-decayed K requires KDA circular replay with prefix gates."),
        (dict(circular=False), "Pre-decayed K requires KDA circular replay with prefix gates."),
        (dict(kda=False, lb=-5.0),
         "Pre-decayed K requires KDA circular replay with prefix gates."),
        (dict(H=1), "Pre-decayed K requires one K head per value head."),
        (dict(state_dtype="float16", d_dtype="float32"),
         "Pre-decayed K requires a float32 checkpoint state."),
        (dict(d_dtype="float32", k_dtype="float16"),
         "Pre-decayed K requires matching d/k ring dtypes."),
        (dict(d_dtype="float16", k_dtype="float16"),
         "Pre-decayed K d/k rings must use the activation dtype or float32."),
        (dict(L=1), "Pre-decayed K requires a cache length between 2 and 16."),
        (dict(L=17), "Pre-decayed K requires a cache length between 2 and 16."),
        (dict(lb=None), "Pre-decayed K requires a finite negative safe-gate lower bound."),
        (dict(lb=0.0), "Pre-decayed K requires a finite negative safe-gate lower bound."),
        (dict(lb=-6.0, L=16), "Pre-decayed K inverse-prefix scaling is unsafe: (cache_len - 1) "
                              "* abs(lower_bound) must be <= 80."),
        (dict(act="float16", d_dtype="float16", k_dtype="float16"),
         "Pre-decayed K with FP16 activations requires an FP32 ring."),
    ]
    for kw, text in texts:
        with pytest.raises(ValueError) as e:
            _mode_call(fw, **kw)
        assert str(e.value) == text, (kw, str(e.value))
    # Beyond SGLang: cursor ranges on the CPU, and no kernel-side advance in circular mode.
    with pytest.raises(ValueError, match=r"^`cache_base`\[1\]=4 is outside the ring \[0, L-1=3\]"):
        _mode_call(fw, cache_base=fw.idx(np.array([0, 4])))
    _mode_call(fw, cache_base=fw.idx(np.array([0, 9])), idx=[1, -1])  # a padded row's base: free
    _mode_call(fw, advance=True)  # the device advance moves cache_base too (tested below)


def test_prefix_gates_with_device_cursor_advance(fw, rng):
    """Prefix gates on the basic ring keep advance_write_pos (wp = flushed ? 0 : wp + 1, padded
    rows untouched), and give what the caller-advanced run gives, bit for bit."""
    H, HV, K, V, L = 2, 2, 8, 16, 3
    twins = []
    for _ in range(2):
        r = np.random.default_rng(7)
        twins.append(ModeSetup(fw, r, kda=True, H=H, HV=HV, K=K, V=V, L=L, slots=5,
                               live=[0, 2, 4], state_dtype="float32", k_dtype="float32",
                               a_3d=True))
    rows = np.array([2, -1, 4])
    wp_dev = fw.idx([0, 1, 0])
    wp_host = np.array([0, 1, 0])
    for step in range(2 * L + 1):
        ff = np.array([0, 0, int(step == 2)])
        data = {}
        for i, (t, advance) in enumerate(zip(twins, (True, False))):
            x = t.inputs(np.random.default_rng(100 + step), len(rows), "float32")
            out = poison(fw, (len(rows), 1, HV, V), "float32")
            ds.fused_recurrent_linear_replayssm_decode(
                x["mixed_qkv"], x["a"], x["b"], t.A_log, t.dt_bias, K ** -0.5, t.pool.view,
                t.d_cache, t.k_cache, t.g_cache, out, fw.idx(rows),
                wp_dev if advance else fw.idx(wp_host), fw.idx(ff), -5.0, True, True,
                prefix_gate_cache=True, advance_write_pos=advance)
            data[i] = bits(out)
        np.testing.assert_array_equal(data[0], data[1])
        for n, s in enumerate(rows):
            if s >= 0:
                wp_host[n] = 0 if (wp_host[n] == L - 1 or ff[n]) else wp_host[n] + 1
        np.testing.assert_array_equal(to64(wp_dev), wp_host)
    for a, b in ((twins[0].g_cache, twins[1].g_cache), (twins[0].pool.view, twins[1].pool.view)):
        np.testing.assert_array_equal(bits(a), bits(b))
