"""ReplaySSM buffered decode (SGLang's `fused_recurrent_linear_replayssm_decode`, basic mode),
GDN and KDA, on numpy and torch-CPU inputs: many steps against the float64 reference (outputs,
checkpoint at flushes, ring records, cursors), against the exact per-token recurrence, and
L = 1 against packed decode. Cursors are advanced by the caller (wp = flushed ? 0 : wp + 1) or by the kernel (advance_write_pos); force_flush marks
rows at random; envelope checkpoint pools and rings start as sentinels and everything the step
must not write is checked bit for bit."""

import copy

import numpy as np
import pytest

import deltastate as ds
import reference as ref
from cases import gate_params, make_pool, materialize_packed, packed_data, pool_data
from helpers import (TOL_REPLAY_G, TOL_REPLAY_GDN_FLUSH, TOL_REPLAY_GDN_OUT, TOL_REPLAY_KDA_FLUSH,
                     TOL_REPLAY_KDA_OUT, TOL_REPLAY_L1, TOL_REPLAY_RING, assert_close, bits, poison,
                     sentinel_for, to64)


def out_tol(kda, act):
    if kda:
        return TOL_REPLAY_KDA_OUT
    return TOL_REPLAY_GDN_OUT["float32" if act == "float32" else "low"]


def flush_tol(kda, dtype):
    if kda:
        return TOL_REPLAY_KDA_FLUSH
    return TOL_REPLAY_GDN_FLUSH["float32" if dtype == "float32" else "low"]


class ReplaySetup:
    """Checkpoint pool (envelope as_strided view, sentinels outside the live slots), rings filled
    with sentinels, per-row cursors, and the float64 reference memory."""

    def __init__(self, fw, rng, *, kda, H, HV, K, V, L, slots, live, state_dtype, k_dtype,
                 a_3d=False, envelope=True, a_rows=False):
        self.fw, self.kda, self.a_3d, self.a_rows = fw, kda, a_3d, a_rows
        self.H, self.HV, self.K, self.V, self.L = H, HV, K, V, L
        self.state_dtype, self.k_dtype = state_dtype, k_dtype
        self.pool = make_pool(fw, pool_data(rng, slots, HV, V, K), state_dtype, live,
                              envelope=envelope)
        self.d_cache = fw.full((slots, HV, L, V), sentinel_for(state_dtype), state_dtype)
        self.k_cache = fw.full((slots, H, L, K), sentinel_for(k_dtype), k_dtype)
        gshape = (slots, HV, L, K) if kda else (slots, HV, L)
        self.g_cache = fw.full(gshape, 1e30, "float32")
        A_log, dt_bias = gate_params(rng, HV, K, kda)
        if kda and a_3d:
            dt_bias = dt_bias.reshape(HV, K)
        self.A_log, self.dt_bias = fw.from64(A_log), fw.from64(dt_bias)
        self.mem = ref.ReplayMemory(self.pool.state64(), to64(self.d_cache), to64(self.k_cache),
                                    to64(self.g_cache), state_dtype=state_dtype,
                                    d_dtype=state_dtype, k_dtype=k_dtype)

    def resync(self):
        """Restart the reference from the stored memory (reduced-precision runs: one step's
        rounding is checked at a time)."""
        self.mem = ref.ReplayMemory(self.pool.state64(), to64(self.d_cache), to64(self.k_cache),
                                    to64(self.g_cache), state_dtype=self.state_dtype,
                                    d_dtype=self.state_dtype, k_dtype=self.k_dtype)

    def inputs(self, rng, B, act):
        d = packed_data(rng, kda=self.kda, B=B, H=self.H, HV=self.HV, K=self.K, V=self.V)
        if self.kda and self.a_3d:
            d["a"] = d["a"].reshape(B, self.HV, self.K)
        if self.a_rows:  # GDN `a` as the second half of a [B, 2 HV] b/a projection's rows
            d["a"] = np.concatenate([np.full_like(d["a"], 7.0), d["a"]], axis=1)
        self.last = materialize_packed(self.fw, d, act)
        if self.a_rows:
            self.last["a"] = self.last["a"][:, self.HV:]
        return self.last

    def step(self, rng, act, indices, write_pos, force_flush=None, *, advance, lower_bound=None,
             scale=None, check=True, round_beta=False):
        """One step: run the op and the reference; check the output, the checkpoint, the rings
        and the cursors. Returns (reference out, flushed rows, new write_pos)."""
        fw, B = self.fw, len(indices)
        x = self.inputs(rng, B, act)
        idx = fw.idx(indices)
        wp = fw.idx(write_pos)
        ff = None if force_flush is None else fw.idx(force_flush)
        out = poison(fw, (B, 1, self.HV, self.V), act)
        scale = self.K ** -0.5 if scale is None else scale
        before = [self.pool.bits(), bits(self.d_cache), bits(self.k_cache), bits(self.g_cache)]
        res = ds.fused_recurrent_linear_replayssm_decode(
            x["mixed_qkv"], x["a"], x["b"], self.A_log, self.dt_bias, scale, self.pool.view,
            self.d_cache, self.k_cache, self.g_cache, out, idx, wp, ff, lower_bound, True,
            self.kda, advance_write_pos=advance, round_beta=round_beta)
        assert res[0] is out and res[1] is self.pool.view  # SGLang's (out, initial_state)
        want_out, flushed, new_wp = ref.replayssm_decode(
            self.mem, to64(x["mixed_qkv"]), to64(x["a"]), to64(x["b"]), to64(self.A_log),
            to64(self.dt_bias), scale, indices, write_pos, force_flush, kda=self.kda, b_dtype=act,
            lower_bound=lower_bound, round_beta=round_beta)
        if not check:
            return want_out, flushed, new_wp, out

        got = to64(out)
        assert not np.isnan(got).any(), "an output element was not written"
        for n, s in enumerate(indices):
            if s < 0:
                assert (got[n] == 0).all(), "padded rows must output zeros"
        assert_close(got, want_out, out_tol(self.kda, act), act, "out")

        # Cursors: the kernel advances them per the caller protocol, or leaves them alone.
        got_wp = to64(wp)
        np.testing.assert_array_equal(got_wp, new_wp if advance else np.asarray(write_pos))

        # Checkpoint: written exactly for the flushed rows' slots.
        flushed_slots = [s for n, s in enumerate(indices) if s >= 0 and flushed[n]]
        state = self.pool.state64()
        for s in flushed_slots:
            assert_close(state[s], self.mem.state[s], flush_tol(self.kda, self.state_dtype),
                         self.state_dtype, f"checkpoint[{s}]")
        self.pool.assert_untouched_outside(before[0], flushed_slots, "checkpoint")

        # Rings: the record at position m of every live row that did not flush; nothing else.
        rec = [(s, int(write_pos[n])) for n, s in enumerate(indices) if s >= 0 and not flushed[n]]
        for name, arr, tol, dtype, before_bits in (
                ("d_cache", self.d_cache, TOL_REPLAY_RING, self.state_dtype, before[1]),
                ("k_cache", self.k_cache, TOL_REPLAY_RING, self.k_dtype, before[2]),
                ("g_cache", self.g_cache, TOL_REPLAY_G, "float32", before[3])):
            got_ring = to64(arr)
            want_ring = {"d_cache": self.mem.d, "k_cache": self.mem.k, "g_cache": self.mem.g}[name]
            mask = np.zeros(got_ring.shape, dtype=bool)
            for s, m in rec:
                mask[s, :, m] = True
                assert_close(got_ring[s, :, m], want_ring[s, :, m], tol, dtype, f"{name}[{s},:,{m}]")
            changed = (bits(arr) != before_bits) & ~mask
            assert not changed.any(), f"{name}: entries other than the new records changed"
        return want_out, flushed, new_wp, out


# (kda, L, act, state dtype, k ring dtype, cursor advance, KDA a/dt_bias 3-D, lower_bound, steps)
CASES = [
    pytest.param(False, 1, "float32", "float32", "float32", True, False, None, 6, id="gdn-L1"),
    pytest.param(False, 4, "float32", "float32", "float32", False, False, None, 16, id="gdn-L4-caller"),
    pytest.param(False, 8, "float32", "float32", "float32", True, False, None, 20, id="gdn-L8-kernel"),
    pytest.param(False, 4, "float16", "float32", "float16", True, False, None, 12, id="gdn-L4-f16"),
    pytest.param(False, 4, "bfloat16", "bfloat16", "bfloat16", False, False, None, 12, id="gdn-L4-bf16all"),
    pytest.param(False, 8, "float16", "float16", "float16", True, False, None, 12, id="gdn-L8-f16all"),
    pytest.param(True, 1, "float32", "float32", "float32", False, False, None, 6, id="kda-L1"),
    pytest.param(True, 4, "float32", "float32", "float32", True, True, -5.0, 16, id="kda-L4-lb-3d"),
    pytest.param(True, 8, "float32", "float32", "float32", False, True, None, 20, id="kda-L8-3d-caller"),
    pytest.param(True, 4, "float16", "float32", "float16", True, False, -5.0, 12, id="kda-L4-f16-lb"),
    pytest.param(True, 4, "bfloat16", "float32", "bfloat16", True, True, None, 12, id="kda-L4-bf16"),
]


@pytest.mark.parametrize("kda,L,act,state_dtype,k_dtype,advance,a_3d,lb,steps", CASES)
def test_replayssm_matches_reference(fw, rng, kda, L, act, state_dtype, k_dtype, advance, a_3d, lb,
                                     steps):
    if not all(fw.supports(t) for t in (act, state_dtype, k_dtype)):
        pytest.skip("numpy has no bfloat16")
    H, HV, K, V = (2, 4, 16, 8) if not kda else (1, 2, 8, 16)
    setup = ReplaySetup(fw, rng, kda=kda, H=H, HV=HV, K=K, V=V, L=L, slots=7, live=[1, 3, 4, 6],
                        state_dtype=state_dtype, k_dtype=k_dtype, a_3d=a_3d)
    rows = np.array([4, 1, -1, 6])  # row -> slot; row 2 is padding
    write_pos = np.zeros(len(rows), dtype=np.int64)
    for step in range(steps):
        indices = rows.copy()
        if step % 5 == 3:
            indices[0] = -1  # row 0 idle this step: its cursor stays
        force = None
        if step % 3 == 1:
            force = (rng.random(len(rows)) < 0.3).astype(np.int64)
        # Beta in fp32 (every op's default) and, every third step, rounded to b's dtype.
        _, _, new_wp, _ = setup.step(rng, act, indices, write_pos, force, advance=advance,
                                     lower_bound=lb, round_beta=step % 3 == 2)
        write_pos = new_wp
        if "float32" != state_dtype or "float32" != k_dtype:
            setup.resync()


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("L", [4, 8])
def test_replayssm_matches_exact_recurrence(fw, rng, kda, L):
    """40 steps of ReplaySSM against the exact per-token recurrence (what packed decode
    computes): the output every step and the checkpoint at every flush (the tolerances of
    SGLang's ReplaySSM tests)."""
    H, HV, K, V = 1, 2, 16, 16
    setup = ReplaySetup(fw, rng, kda=kda, H=H, HV=HV, K=K, V=V, L=L, slots=4, live=[0, 2, 3],
                        state_dtype="float32", k_dtype="float32", a_3d=kda)
    rows = np.array([2, 0, 3])
    exact = setup.pool.state64()
    write_pos = np.zeros(3, dtype=np.int64)
    flushes = 0
    for step in range(40):
        force = np.array([0, int(step % 11 == 5), 0])
        _, flushed, write_pos_next, out = setup.step(rng, "float32", rows, write_pos, force,
                                                     advance=True)
        x = setup.last
        want_out, exact = ref.packed_decode(
            to64(x["mixed_qkv"]), to64(x["a"]).reshape(len(rows), -1), to64(x["b"]),
            to64(setup.A_log), to64(setup.dt_bias).reshape(-1), K ** -0.5, exact, rows, kda=kda)
        assert_close(to64(out), want_out, out_tol(kda, "float32"), "float32", f"out, step {step}")
        state = setup.pool.state64()
        for n, s in enumerate(rows):
            if flushed[n]:
                flushes += 1
                assert_close(state[s], exact[s], flush_tol(kda, "float32"), "float32",
                             f"checkpoint[{s}] at a flush, step {step}")
        write_pos = write_pos_next
    assert flushes >= 3 * (40 // L) - 3


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_replayssm_L1_equals_packed_decode(fw, rng, kda):
    """With L = 1 every step flushes, and ReplaySSM equals packed decode (within 2e-6/1e-5 in
    fp32, as in SGLang's ReplaySSM test), output and state, over several steps."""
    H, HV, K, V = 2, 4, 16, 8
    setup = ReplaySetup(fw, rng, kda=kda, H=H, HV=HV, K=K, V=V, L=1, slots=5, live=[0, 1, 4],
                        state_dtype="float32", k_dtype="float32")
    twin = make_pool(fw, setup.pool.state64(), "float32", [0, 1, 4])
    rows = np.array([4, -1, 0, 1])
    op = (ds.fused_recurrent_kda_packed_decode if kda
          else ds.fused_recurrent_gated_delta_rule_packed_decode)
    for step in range(5):
        _, _, _, out = setup.step(rng, "float32", rows, np.zeros(4, np.int64), None, advance=True)
        x = setup.last
        out2 = poison(fw, (len(rows), 1, HV, V), "float32")
        a = x["a"] if not kda else x["a"].reshape(len(rows), HV * K)
        op(x["mixed_qkv"], a, x["b"], setup.A_log, setup.dt_bias, K ** -0.5, twin.view, out2,
           fw.idx(rows), True)
        assert_close(to64(out), to64(out2), TOL_REPLAY_L1, "float32", "out vs packed decode")
        assert_close(setup.pool.state64()[[0, 1, 4]], twin.state64()[[0, 1, 4]], TOL_REPLAY_L1,
                     "float32", "state vs packed decode")


def test_replayssm_gdn_a_with_a_row_stride(fw, rng):
    """GDN `a` with a row stride (a slice of the b/a projection's [B, 2 HV] rows, SGLang's kernel
    reads it by its row stride) runs as the contiguous one: the reference over 2L + 2 steps."""
    setup = ReplaySetup(fw, rng, kda=False, H=2, HV=4, K=16, V=8, L=4, slots=5, live=[0, 2, 3],
                        state_dtype="float32", k_dtype="float32", a_rows=True)
    rows = np.array([3, -1, 0, 2])
    write_pos = np.zeros(len(rows), dtype=np.int64)
    for step in range(10):
        _, _, write_pos, _ = setup.step(rng, "float32", rows, write_pos, None, advance=True)
        assert fw.to64(setup.last["a"]).shape == (4, 4)


def test_replayssm_qwen3_next_shape(tfw, rng):
    """GDN ReplaySSM at the Qwen3-Next per-rank shape (H=16, HV=32, K=V=128), L=4, bf16
    activations and k ring, fp32 checkpoint and d ring, cursors advanced by the kernel."""
    setup = ReplaySetup(tfw, rng, kda=False, H=16, HV=32, K=128, V=128, L=4, slots=3, live=[1, 2],
                        state_dtype="float32", k_dtype="bfloat16")
    rows = np.array([2, -1, 1])
    write_pos = np.zeros(3, dtype=np.int64)
    for step in range(5):
        _, _, write_pos, _ = setup.step(rng, "bfloat16", rows, write_pos, None, advance=True)
        setup.resync()


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_replayssm_pdl_is_ignored_on_cpu(fw, rng, kda):
    """pdl=True (a CUDA launch attribute) changes nothing on the CPU: twin ReplaySSM memories
    stepped 2L + 2 times with the same inputs (appends, flushes, forced flushes, a padded row,
    cursors advanced by the kernel) stay bit-identical, outputs included."""
    H, HV, K, V, L = 2, 4, 16, 8, 4
    rng2 = copy.deepcopy(rng)  # the same random pool, rings and gate parameters twice
    twins = {pdl: ReplaySetup(fw, r, kda=kda, H=H, HV=HV, K=K, V=V, L=L, slots=6,
                              live=[1, 2, 4], state_dtype="float32", k_dtype="float32",
                              a_3d=kda)
             for pdl, r in ((False, rng), (True, rng2))}
    rows = [4, -1, 1, 2]
    wps = {pdl: fw.idx([0, 0, 0, 2]) for pdl in twins}
    for step in range(2 * L + 2):
        d = packed_data(rng, kda=kda, B=len(rows), H=H, HV=HV, K=K, V=V)
        if kda:
            d["a"] = d["a"].reshape(len(rows), HV, K)
        ff = [0, 0, int(step == 3), 0]
        outs = {}
        for pdl, s in twins.items():
            x = materialize_packed(fw, d, "float32")
            out = poison(fw, (len(rows), 1, HV, V), "float32")
            res, _ = ds.fused_recurrent_linear_replayssm_decode(
                x["mixed_qkv"], x["a"], x["b"], s.A_log, s.dt_bias, K ** -0.5, s.pool.view,
                s.d_cache, s.k_cache, s.g_cache, out, fw.idx(rows), wps[pdl], fw.idx(ff),
                is_kda=kda, lower_bound=-5.0 if kda else None, advance_write_pos=True, pdl=pdl,
                use_qk_l2norm_in_kernel=True)
            assert res is out
            outs[pdl] = bits(out)
        np.testing.assert_array_equal(outs[True], outs[False], err_msg=f"out, step {step}")
        a, b = twins[True], twins[False]
        np.testing.assert_array_equal(a.pool.bits(), b.pool.bits(), err_msg=f"step {step}")
        for name in ("d_cache", "k_cache", "g_cache"):
            np.testing.assert_array_equal(bits(getattr(a, name)), bits(getattr(b, name)),
                                          err_msg=f"{name}, step {step}")
        np.testing.assert_array_equal(bits(wps[True]), bits(wps[False]))
    # The alias takes it too.
    assert ds.fused_recurrent_gdn_replayssm_decode is ds.fused_recurrent_linear_replayssm_decode
