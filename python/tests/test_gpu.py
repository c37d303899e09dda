"""The CUDA backend through the Python package (runs on a device machine; skipped without CUDA):

* every op on CUDA tensors against the CPU backend on the same inputs (copied): GVA, K != V,
  padding rows, envelope pools as torch.as_strided views with sentinel slots (bit-untouched),
  fp32/fp16/bf16;
* CUDA graphs: one packed-decode step and one ReplaySSM step (advance_write_pos) captured into a
  torch.cuda.CUDAGraph and replayed with new inputs copied into the captured buffers give results
  bit-identical to eager calls on the same inputs;
* programmatic dependent launch (pdl=True): every op bit-identical to pdl=False over back-to-back
  launches, and a chain of dependent pdl=True launches captured into a CUDAGraph replays to the
  eager pdl=False results bit for bit;
* the ops run on torch's current stream (a side stream under `with torch.cuda.stream(s)`);
* the StatePool on CUDA.

Tolerances: SGLang's (its packed KDA Helion-vs-Triton tolerance for two implementations of the
same math; its ReplaySSM tolerances for ReplaySSM). Two backends that both round a result to a
reduced-precision dtype can differ by one ulp there, so those comparisons add twice the unit
roundoff to rtol.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltastate as ds  # noqa: E402
from cases import (gate_params, make_pool, materialize_packed, materialize_recurrent,  # noqa: E402
                   packed_data, pool_data, recurrent_data)
from helpers import (SENTINEL, TOL_OUT, TOL_REPLAY_G, TOL_REPLAY_GDN_FLUSH,  # noqa: E402
                     TOL_REPLAY_KDA_FLUSH, TOL_REPLAY_KDA_OUT, TOL_REPLAY_RING, TOL_STATE,
                     UNIT_ROUNDOFF, Fw, assert_close, bits, poison, sentinel_for, to64)

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and ds.cuda_available()),
    reason="needs a CUDA device and deltastate built with its CUDA backend")

CPU = Fw("torch", "cpu")
GPU = Fw("torch", "cuda")


def close2(got, want, tol, dtype, what):
    """Both sides computed by a kernel and rounded to `dtype`: allow one ulp (2u) of rounding."""
    atol, rtol = tol
    assert_close(got, want, (atol, rtol + 2 * UNIT_ROUNDOFF[dtype]), "float32", what)


def pools(data64, dtype, live, envelope=True):
    return make_pool(CPU, data64, dtype, live, envelope=envelope), \
        make_pool(GPU, data64, dtype, live, envelope=envelope)


def check_pools(pc, pg, used, before_gpu, what="state"):
    got, want = pg.state64(), pc.state64()
    for s in used:
        close2(got[s], want[s], TOL_STATE[pc.dtype], pc.dtype, f"{what}[{s}]")
    pg.assert_untouched_outside(before_gpu, used, what)


def packed_op(kda):
    return (ds.fused_recurrent_kda_packed_decode if kda
            else ds.fused_recurrent_gated_delta_rule_packed_decode)


# ---- packed decode ----------------------------------------------------------------------------
PACKED_SHAPES = [
    pytest.param(2, 4, 16, 8, id="gva-K16-V8"),
    pytest.param(1, 3, 8, 24, id="gva3-K8-V24"),
    pytest.param(4, 4, 64, 64, id="K64"),
    pytest.param(16, 32, 128, 128, id="qwen3-next"),
    pytest.param(2, 2, 200, 96, id="K200"),
]
DTYPES = [
    pytest.param("float32", "float32", id="f32"),
    pytest.param("bfloat16", "float32", id="bf16act"),
    pytest.param("bfloat16", "bfloat16", id="bf16all"),
    pytest.param("float16", "float16", id="f16all"),
]


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("act,state_dtype", DTYPES)
@pytest.mark.parametrize("H,HV,K,V", PACKED_SHAPES)
def test_packed_decode_cuda_matches_cpu(rng, kda, act, state_dtype, H, HV, K, V):
    slots, live = 9, [1, 2, 4, 5, 7]
    pc, pg = pools(pool_data(rng, slots, HV, V, K, scale=0.3), state_dtype, live)
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    kw = {"lower_bound": -5.0} if kda and K != 64 else {}
    kw["use_qk_l2norm_in_kernel"] = True
    for step, indices in enumerate([[4, -1, 1, 2, 7], [2, 5, 4, -1, 1], [-1, -1, 7, 5, -1]]):
        d = packed_data(rng, kda=kda, B=len(indices), H=H, HV=HV, K=K, V=V)
        outs = []
        before = pg.bits()
        for fw, pool in ((CPU, pc), (GPU, pg)):
            x = materialize_packed(fw, d, act, row_pad=3 if step == 1 else 0)
            out = poison(fw, (len(indices), 1, HV, V), act)
            res = packed_op(kda)(x["mixed_qkv"], x["a"], x["b"], fw.from64(A_log), fw.from64(dt_bias),
                                 K ** -0.5, pool.view, out, fw.idx(indices, "int64" if step else "int32"),
                                 **kw)
            assert res[0] is out and res[1] is pool.view
            outs.append(to64(out))
        torch.cuda.synchronize()
        assert not np.isnan(outs[1]).any()
        for n, s in enumerate(indices):
            if s < 0:
                assert (outs[1][n] == 0).all()
        close2(outs[1], outs[0], TOL_OUT, act, "out")
        check_pools(pc, pg, [s for s in indices if s >= 0], before)
        if state_dtype != "float32":  # one step's rounding at a time
            pg.view.copy_(pc.view.to("cuda"))


def test_packed_decode_device_mismatch_changes_nothing(rng):
    H, HV, K, V = 1, 2, 16, 16
    pc, pg = pools(pool_data(rng, 3, HV, V, K), "float32", [0, 1, 2])
    d = packed_data(rng, kda=False, B=2, H=H, HV=HV, K=K, V=V)
    x = materialize_packed(GPU, d, "float32")
    A_log, dt_bias = gate_params(rng, HV, K, False)
    out = poison(GPU, (2, 1, HV, V), "float32")
    before = pg.bits()
    with pytest.raises(ValueError) as e:
        ds.fused_recurrent_gated_delta_rule_packed_decode(
            x["mixed_qkv"], x["a"], x["b"], GPU.from64(A_log), GPU.from64(dt_bias), K ** -0.5,
            pg.view, out, CPU.idx([0, 2]))
    assert str(e.value) == "All inputs must be on the same device."
    np.testing.assert_array_equal(pg.bits(), before)
    assert torch.isnan(out).all()


# ---- recurrent --------------------------------------------------------------------------------
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("act,state_dtype", DTYPES)
@pytest.mark.parametrize("H,HV,K,V", [pytest.param(2, 4, 16, 8, id="gva-K16-V8"),
                                      pytest.param(4, 4, 128, 128, id="K128")])
def test_recurrent_cuda_matches_cpu(rng, kda, act, state_dtype, H, HV, K, V):
    """[B, T] in-pool (padded row), varlen in-pool (padded and empty sequences), and a start state
    without indices with output_final_state: CUDA against the CPU backend."""
    op = ds.recurrent_kda if kda else ds.recurrent_gated_delta_rule
    A_log, dt_bias = gate_params(rng, HV, K, kda)

    # [B, T], pooled, gate in the kernel, beta logits.
    pc, pg = pools(pool_data(rng, 6, HV, V, K, scale=0.3), state_dtype, [0, 2, 3, 5])
    d = recurrent_data(rng, kda=kda, B=3, T=4, H=H, HV=HV, K=K, V=V, use_gate_in_kernel=True,
                       beta_is_logit=True)
    outs, before = [], pg.bits()
    for fw, pool in ((CPU, pc), (GPU, pg)):
        x = materialize_recurrent(fw, d, act, strided_qkv=True)
        o, ret = op(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=fw.from64(A_log),
                    dt_bias=fw.from64(dt_bias), initial_state=pool.view,
                    ssm_state_indices=fw.idx([5, -1, 2]), use_gate_in_kernel=True,
                    lower_bound=-5.0 if kda else None, beta_is_logit=True)
        assert ret is None  # FlashInfer's rule: output_final_state=False
        outs.append(to64(o))
    assert (outs[1][1] == 0).all()
    close2(outs[1], outs[0], TOL_OUT, act, "o")
    check_pools(pc, pg, [5, 2], before)

    # varlen, pooled.
    lens = [3, 0, 1, 4]
    cu = np.concatenate([[0], np.cumsum(lens)])
    pc, pg = pools(pool_data(rng, 5, HV, V, K, scale=0.3), state_dtype, [0, 1, 3, 4])
    d = recurrent_data(rng, kda=kda, B=1, T=int(cu[-1]), H=H, HV=HV, K=K, V=V,
                       use_gate_in_kernel=False, beta_is_logit=False)
    outs, before = [], pg.bits()
    for fw, pool in ((CPU, pc), (GPU, pg)):
        x = materialize_recurrent(fw, d, act)
        out = poison(fw, tuple(x["v"].shape), act)
        o, _ = op(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool.view,
                  cu_seqlens=fw.idx(cu, "int64"), ssm_state_indices=fw.idx([4, 1, -1, 0]),
                  output=out)
        assert o is out
        outs.append(to64(o))
    assert not np.isnan(outs[1]).any() and (outs[1][0, cu[2]:cu[3]] == 0).all()
    close2(outs[1], outs[0], TOL_OUT, act, "o (varlen)")
    check_pools(pc, pg, [4, 1, 0], before)

    # A start state without indices: FLA's rule (read only, a new float32 final state; the
    # V-first layout, the one CUDA runs) and FlashInfer's (updated in place and returned).
    init64 = pool_data(rng, 2, HV, V, K, scale=0.3)
    d = recurrent_data(rng, kda=kda, B=2, T=3, H=H, HV=HV, K=K, V=V, use_gate_in_kernel=False,
                       beta_is_logit=True)
    fla = ds.fused_recurrent_kda if kda else ds.fused_recurrent_gated_delta_rule
    res = []
    for fw in (CPU, GPU):
        x = materialize_recurrent(fw, d, act)
        init = fw.aligned(init64, state_dtype)
        snap = bits(init)
        o, final = fla(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=init,
                       output_final_state=True, use_qk_l2norm_in_kernel=True,
                       use_beta_sigmoid_in_kernel=True, state_v_first=True)
        np.testing.assert_array_equal(bits(init), snap)
        assert final.device.type == fw.device and final.dtype == torch.float32
        o2, st = op(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=init,
                    output_final_state=True, beta_is_logit=True)
        assert st is init
        res.append((to64(o), to64(final), to64(o2), to64(init)))
    close2(res[1][0], res[0][0], TOL_OUT, act, "o (initial_state)")
    close2(res[1][1], res[0][1], TOL_STATE["float32"], "float32", "final_state")
    close2(res[1][2], res[0][2], TOL_OUT, act, "o (in place)")
    close2(res[1][3], res[0][3], TOL_STATE[state_dtype], state_dtype, "state (in place)")


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_fla_k_first_state_rejected_on_cuda(rng, kda):
    """FLA's default K-first state runs on the CPU only: on CUDA a clear NotImplementedError
    naming state_v_first, nothing written (never a silent transpose)."""
    H, HV, K, V = 1, 2, 16, 16
    d = recurrent_data(rng, kda=kda, B=2, T=2, H=H, HV=HV, K=K, V=V, use_gate_in_kernel=False,
                       beta_is_logit=False)
    x = materialize_recurrent(GPU, d, "float32")
    init = GPU.aligned(pool_data(rng, 2, HV, K, V))  # [N, HV, K, V]
    snap = bits(init)
    fla = ds.fused_recurrent_kda if kda else ds.fused_recurrent_gated_delta_rule
    with pytest.raises(NotImplementedError, match="state_v_first"):
        fla(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=init,
            output_final_state=True)
    np.testing.assert_array_equal(bits(init), snap)


# ---- ReplaySSM --------------------------------------------------------------------------------
class ReplayTwin:
    """The same ReplaySSM memory (envelope checkpoint with sentinel slots, rings, cursors) on the
    CPU and on CUDA."""

    def __init__(self, rng, *, kda, H, HV, K, V, L, slots, live, state_dtype, k_dtype, B):
        self.kda, self.H, self.HV, self.K, self.V, self.L = kda, H, HV, K, V, L
        self.state_dtype, self.k_dtype = state_dtype, k_dtype
        data = pool_data(rng, slots, HV, V, K, scale=0.3)
        self.mem = {}
        for fw in (CPU, GPU):
            self.mem[fw.device] = {
                "pool": make_pool(fw, data, state_dtype, live),
                "d": fw.full((slots, HV, L, V), sentinel_for(state_dtype), state_dtype),
                "k": fw.full((slots, H, L, K), sentinel_for(k_dtype), k_dtype),
                "g": fw.full((slots, HV, L, K) if kda else (slots, HV, L), 1e30, "float32"),
                "wp": fw.idx(np.zeros(B)),
            }
        self.A_log, self.dt_bias = gate_params(rng, HV, K, kda)

    def call(self, fw, x, idx, ff, out, *, advance=True, lower_bound=None):
        m = self.mem[fw.device]
        a = x["a"].reshape(x["a"].shape[0], self.HV, self.K) if self.kda else x["a"]
        dt = fw.from64(self.dt_bias.reshape(self.HV, self.K) if self.kda else self.dt_bias)
        return ds.fused_recurrent_linear_replayssm_decode(
            x["mixed_qkv"], a, x["b"], fw.from64(self.A_log), dt, self.K ** -0.5, m["pool"].view,
            m["d"], m["k"], m["g"], out, idx, m["wp"], ff, is_kda=self.kda,
            lower_bound=lower_bound, use_qk_l2norm_in_kernel=True, advance_write_pos=advance)

    def compare(self, flushed_slots):
        c, g = self.mem["cpu"], self.mem["cuda"]
        np.testing.assert_array_equal(to64(g["wp"]), to64(c["wp"]))
        tol = TOL_REPLAY_KDA_FLUSH
        for s in flushed_slots:
            close2(g["pool"].state64()[s], c["pool"].state64()[s], tol, self.state_dtype,
                   f"checkpoint[{s}]")
        for name, ring_tol, dtype in (("d", TOL_REPLAY_RING, self.state_dtype),
                                      ("k", TOL_REPLAY_RING, self.k_dtype),
                                      ("g", TOL_REPLAY_G, "float32")):
            got, want = to64(g[name]), to64(c[name])
            finite = np.isfinite(want) & (np.abs(want) < 1e29)
            np.testing.assert_array_equal(bits(g[name])[~finite], bits(c[name])[~finite])
            close2(got[finite], want[finite], ring_tol, dtype, f"{name} ring")

    def resync(self):
        c, g = self.mem["cpu"], self.mem["cuda"]
        g["pool"].flat.copy_(c["pool"].flat.to("cuda"))
        for name in ("d", "k", "g"):
            g[name].copy_(c[name].to("cuda"))


REPLAY_CASES = [
    pytest.param(False, 1, 2, 4, 16, 8, "float32", "float32", "float32", id="gdn-L1"),
    pytest.param(False, 4, 2, 4, 16, 8, "float32", "float32", "float32", id="gdn-L4"),
    pytest.param(False, 8, 16, 32, 128, 128, "bfloat16", "float32", "bfloat16", id="gdn-qwen3-next-L8"),
    pytest.param(True, 4, 1, 2, 8, 16, "float32", "float32", "float32", id="kda-L4-K8"),
    pytest.param(True, 16, 4, 4, 128, 128, "bfloat16", "float32", "bfloat16", id="kda-L16-K128"),
    pytest.param(True, 4, 2, 2, 64, 64, "float16", "float16", "float16", id="kda-L4-f16all"),
]


@pytest.mark.parametrize("kda,L,H,HV,K,V,act,state_dtype,k_dtype", REPLAY_CASES)
def test_replayssm_cuda_matches_cpu(rng, kda, L, H, HV, K, V, act, state_dtype, k_dtype):
    rows = np.array([3, -1, 1, 6])
    tw = ReplayTwin(rng, kda=kda, H=H, HV=HV, K=K, V=V, L=L, slots=8, live=[1, 3, 5, 6],
                    state_dtype=state_dtype, k_dtype=k_dtype, B=len(rows))
    lb = -5.0 if kda else None
    for step in range(3 * L + 2):
        indices = rows.copy()
        if step % 4 == 2:
            indices[2] = -1
        ff = (rng.random(len(rows)) < 0.2).astype(np.int64) if step % 3 == 0 else None
        d = packed_data(rng, kda=kda, B=len(rows), H=H, HV=HV, K=K, V=V)
        wp_before = to64(tw.mem["cpu"]["wp"])
        outs = []
        before = tw.mem["cuda"]["pool"].bits()
        for fw in (CPU, GPU):
            x = materialize_packed(fw, d, act)
            out = poison(fw, (len(rows), 1, HV, V), act)
            res = tw.call(fw, x, fw.idx(indices), None if ff is None else fw.idx(ff), out,
                          lower_bound=lb)
            assert res[0] is out and res[1] is tw.mem[fw.device]["pool"].view
            outs.append(to64(out))
        torch.cuda.synchronize()
        assert not np.isnan(outs[1]).any()
        close2(outs[1], outs[0], TOL_REPLAY_KDA_OUT, act, f"out, step {step}")
        flushed = [int(s) for n, s in enumerate(indices) if s >= 0 and (
            wp_before[n] == L - 1 or (ff is not None and ff[n]))]
        tw.compare(flushed)
        tw.mem["cuda"]["pool"].assert_untouched_outside(before, flushed, "checkpoint")
        if state_dtype != "float32" or k_dtype != "float32":
            tw.resync()


MODE_CASES = [  # (kda, L, H, HV, K, V, act, k ring, circular, prefix, predecay, lower_bound)
    pytest.param(False, 4, 2, 4, 16, 8, "float32", "float32", True, False, False, None,
                 id="gdn-circular-L4"),
    pytest.param(False, 8, 16, 32, 128, 128, "bfloat16", "bfloat16", True, False, False, None,
                 id="gdn-circular-qwen3-next-L8"),
    pytest.param(True, 4, 2, 2, 64, 64, "float32", "float32", False, True, False, -5.0,
                 id="kda-prefix-L4"),
    pytest.param(True, 5, 4, 4, 128, 128, "bfloat16", "float32", True, True, False, None,
                 id="kda-circular-prefix-L5"),
    pytest.param(True, 16, 4, 4, 128, 128, "bfloat16", "bfloat16", True, True, True, -5.0,
                 id="kda-predecay-L16"),
]


@pytest.mark.parametrize("kda,L,H,HV,K,V,act,k_dtype,circular,prefix,predecay,lb", MODE_CASES)
def test_replayssm_ring_modes_cuda_match_cpu(rng, kda, L, H, HV, K, V, act, k_dtype, circular,
                                             prefix, predecay, lb):
    """SGLang's ring modes on CUDA (the generic modes kernel) against the CPU backend, 3L + 2
    steps: circular rings from different cache_base values, history checkpoints, forced folds,
    a padded and an idle row; the caller advances write_pos and cache_base on the CPU side and
    copies them to both (SGLang's protocol)."""
    rows = np.array([3, -1, 1, 6])
    B = len(rows)
    tw = ReplayTwin(rng, kda=kda, H=H, HV=HV, K=K, V=V, L=L, slots=8, live=[1, 3, 5, 6],
                    state_dtype="float32", k_dtype=k_dtype, B=B)
    if predecay and k_dtype != "float32":  # the d and k rings of one dtype
        for fw in (CPU, GPU):
            tw.mem[fw.device]["d"] = fw.full((8, HV, L, V), sentinel_for(k_dtype), k_dtype)
    wp = np.zeros(B, np.int64)
    base = np.array([1 % L, 0, L - 1, 0]) if circular else np.zeros(B, np.int64)
    for step in range(3 * L + 2):
        indices = rows.copy()
        if step % 4 == 2:
            indices[2] = -1
        ff = (rng.random(B) < 0.2).astype(np.int64) if step % 3 == 0 else np.zeros(B, np.int64)
        d = packed_data(rng, kda=kda, B=B, H=H, HV=HV, K=K, V=V)
        outs = []
        before = tw.mem["cuda"]["pool"].bits()
        for fw in (CPU, GPU):
            m = tw.mem[fw.device]
            x = materialize_packed(fw, d, act)
            out = poison(fw, (B, 1, HV, V), act)
            a = x["a"].reshape(B, HV, K) if kda else x["a"]
            dt = fw.from64(tw.dt_bias.reshape(HV, K) if kda else tw.dt_bias)
            ds.fused_recurrent_linear_replayssm_decode(
                x["mixed_qkv"], a, x["b"], fw.from64(tw.A_log), dt, K ** -0.5, m["pool"].view,
                m["d"], m["k"], m["g"], out, fw.idx(indices), fw.idx(wp), fw.idx(ff), lb, True,
                kda, cache_base=fw.idx(base), circular_replay=circular, prefix_gate_cache=prefix,
                predecayed_k_cache=predecay)
            outs.append(to64(out))
        torch.cuda.synchronize()
        assert not np.isnan(outs[1]).any()
        close2(outs[1], outs[0], TOL_REPLAY_KDA_OUT, act, f"out, step {step}")
        written = []
        for n, s in enumerate(indices):
            if s < 0:
                continue
            forced, natural = ff[n] != 0, wp[n] == L - 1
            if forced or natural:
                written.append(int(s))
            if circular and forced:
                wp[n], base[n] = 0, 0
            elif circular and natural and L > 1:
                wp[n], base[n] = 1, (base[n] + wp[n]) % L
            else:
                wp[n] = 0 if (forced or natural) else wp[n] + 1
        tw.compare(written)
        tw.mem["cuda"]["pool"].assert_untouched_outside(before, written, "checkpoint")
        if act != "float32" or k_dtype != "float32":
            tw.resync()


@pytest.mark.parametrize("ring_dtype", ["bfloat16", "float16"])
def test_replayssm_verify_residual_ring_cuda_matches_cpu(rng, ring_dtype):
    """The hi/lo residual ring of replayssm_verify (rawv_cache, rawk_cache without beta_cache)
    on CUDA against the CPU backend: four sequences (one padded, two folding, one whose last
    draft falls past the ring), NaN-poisoned outputs, sentinel-filled residual rings and a
    sentinel checkpoint slot no sequence names: outputs, checkpoints and rings within the
    ReplaySSM tolerances, each written record's hi + lo (d + its residual, k + its residual) as
    the CPU's; what the CPU leaves a sentinel stays one on CUDA, bit for bit."""
    H, HV, K, V, L, slots = 2, 4, 32, 16, 8, 5
    lens = [3, 2, 3, 2]
    Tt = sum(lens)
    A_log, dt_bias = gate_params(rng, HV, K, False)
    shapes = {"q": (1, Tt, H, K), "k": (1, Tt, H, K), "v": (1, Tt, HV, V), "a": (1, Tt, HV),
              "b": (1, Tt, HV)}
    t = {n: torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for n, s in shapes.items()}
    t["A_log"] = torch.from_numpy(A_log.astype(np.float32))
    t["dt_bias"] = torch.from_numpy(dt_bias.astype(np.float32))
    t["cu"] = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    dt, sent = getattr(torch, ring_dtype), sentinel_for(ring_dtype)
    mem = {
        "ck": torch.from_numpy(rng.standard_normal((slots, HV, V, K)).astype(np.float32)),
        "d": (torch.from_numpy(rng.standard_normal((slots, HV, L, V))) * 0.3).to(dt),
        "k": (torch.from_numpy(rng.standard_normal((slots, H, L, K))) * 0.3).to(dt),
        "g": -(torch.from_numpy(np.abs(rng.standard_normal((slots, HV, L)))) * 0.3).float(),
        "dres": torch.full((slots, HV, L, V), sent, dtype=dt),
        "kres": torch.full((slots, H, L, K), sent, dtype=dt),
        "idx": torch.tensor([1, -1, 4, 0], dtype=torch.int32),  # slot 3: no sequence's
        "wp": torch.tensor([7, 5, 0, 0, 3], dtype=torch.int32),  # slot 0: a draft past the ring
        "base": torch.tensor([2, 1, 0, 0, 6], dtype=torch.int32),
        "fl": torch.tensor([0, 1, 0, 0, 1], dtype=torch.int8),  # slots 1 and 4 fold
    }
    mem["ck"][3] = SENTINEL
    got = {}
    for dev in ("cpu", "cuda"):
        m = {n: x.clone().to(dev) for n, x in mem.items()}
        x = {n: y.to(dev) for n, y in t.items()}
        out = torch.full((1, Tt, HV, V), float("nan"), device=dev)
        ds.replayssm_verify(x["q"], x["k"], x["v"], x["a"], x["b"], out, m["ck"], m["idx"], m["d"],
                            m["k"], m["g"], m["wp"], m["base"], m["fl"], A_log=x["A_log"],
                            dt_bias=x["dt_bias"], cu_seqlens=x["cu"], rawv_cache=m["dres"],
                            rawk_cache=m["kres"])
        if dev == "cuda":
            torch.cuda.synchronize()
        got[dev] = {n: y.cpu() for n, y in m.items()}
        got[dev]["out"] = out.cpu()
    c, g = got["cpu"], got["cuda"]
    assert torch.all(g["out"][0, 3:5] == 0), "the padded sequence's outputs are zero"
    close2(to64(g["out"]), to64(c["out"]), TOL_OUT, "float32", "out")
    close2(to64(g["ck"]), to64(c["ck"]), TOL_REPLAY_GDN_FLUSH["float32"], "float32", "checkpoints")
    assert np.array_equal(bits(g["ck"][3]), bits(mem["ck"][3])), "slot 3 untouched"
    close2(to64(g["d"]), to64(c["d"]), TOL_OUT, ring_dtype, "d ring")
    close2(to64(g["k"]), to64(c["k"]), (1e-6, 1e-5), ring_dtype, "k ring")
    close2(to64(g["g"]), to64(c["g"]), TOL_REPLAY_G, "float32", "g ring")
    for hi, lo, tol in (("d", "dres", TOL_OUT), ("k", "kres", (1e-5, 1e-4))):
        left = bits(c[lo]) == bits(mem[lo])  # what the CPU did not write (still sentinels)
        assert (~left).any() and left.any()
        assert np.array_equal(bits(g[lo])[left], bits(c[lo])[left]), f"{lo}: sentinels"
        assert_close((to64(g[hi]) + to64(g[lo]))[~left], (to64(c[hi]) + to64(c[lo]))[~left], tol,
                     "float32", f"{hi} + {lo}")


def test_state_pool_cuda_fork_materializes_pending_records(rng):
    """StatePool.fork of a CUDA pool's slot with pending records (the materialize kernel) equals
    the CPU pool's fork of the same memory (SGLang's fp32 flush tolerance; the CPU fork is
    checked bit for bit against a forced fold in test_pool_fork_replay.py); src and the rings
    are not written."""
    HV, V, K, H, L = 4, 64, 128, 4, 8
    for kda, kw in ((False, dict(cache_base=3)), (True, dict(cache_base=5, prefix_gate_cache=True)),
                    (True, dict(cache_base=2, prefix_gate_cache=True, predecayed_k_cache=True))):
        pools = [ds.StatePool(layers=2, slots=4, HV=HV, V=V, K=K, replay_len=L, H=H, kda=kda,
                              device=dev) for dev in ("cpu", "cuda")]
        slots = [[p.allocate() for _ in range(2)] for p in pools]
        assert slots[0] == slots[1]
        src, dst = slots[0]
        for layer in range(2):
            st = torch.from_numpy((rng.standard_normal((HV, V, K)) * 0.3).astype(np.float32))
            dr = torch.from_numpy((rng.standard_normal((HV, L, V)) * 0.3).astype(np.float32))
            kr = torch.from_numpy((rng.standard_normal((H, L, K)) * 0.1).astype(np.float32))
            gshape = (HV, L, K) if kda else (HV, L)
            gr = torch.from_numpy(-np.abs(rng.standard_normal(gshape) * 0.3).astype(np.float32))
            if kw.get("prefix_gate_cache"):  # cumulative gates along the circular ring
                order = [(kw["cache_base"] + j) % L for j in range(L)]
                gr[:, order] = torch.cumsum(gr[:, order], dim=1)
            for p in pools:
                dev = p.layer_state(layer).device
                p.layer_state(layer)[src].copy_(st.to(dev))
                p.d_cache(layer)[src].copy_(dr.to(dev))
                p.k_cache(layer)[src].copy_(kr.to(dev))
                p.g_cache(layer)[src].copy_(gr.to(dev))
        for p in pools:
            p.set_cursor(src, 6)
        rings_before = [bits(pools[1].d_cache(0)), bits(pools[1].k_cache(0)),
                        bits(pools[1].g_cache(0))]
        src_before = bits(pools[1].layer_state(0)[src])
        for p in pools:
            p.fork(src, dst, **kw)
        torch.cuda.synchronize()
        assert pools[1].cursor(dst) == 0 and pools[1].cursor(src) == 6
        for layer in range(2):
            close2(to64(pools[1].layer_state(layer)[dst]), to64(pools[0].layer_state(layer)[dst]),
                   TOL_REPLAY_KDA_FLUSH, "float32", f"materialized layer {layer}")
        np.testing.assert_array_equal(bits(pools[1].layer_state(0)[src]), src_before)
        for got, want in zip((bits(pools[1].d_cache(0)), bits(pools[1].k_cache(0)),
                              bits(pools[1].g_cache(0))), rings_before):
            np.testing.assert_array_equal(got, want)


# ---- CUDA graphs ------------------------------------------------------------------------------
def _warmup_then_capture(fn):
    """Warm up on a side stream (as torch recommends), then capture `fn` into a CUDAGraph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_cuda_graph_packed_decode(rng, kda):
    """Capture one packed decode step; replay it with new inputs (and a new padding pattern)
    copied into the captured buffers; compare bit for bit with eager calls on the same inputs."""
    H, HV, K, V, B = 16, 32, 128, 128, 4
    act = "bfloat16"
    data = pool_data(rng, 6, HV, V, K, scale=0.3)
    static_pool = make_pool(GPU, data, "float32", [1, 2, 3, 4])
    eager_pool = make_pool(GPU, data, "float32", [1, 2, 3, 4])
    A_log, dt_bias = (GPU.from64(t) for t in gate_params(rng, HV, K, kda))
    d = packed_data(rng, kda=kda, B=B, H=H, HV=HV, K=K, V=V)
    static = materialize_packed(GPU, d, act)
    static_idx = GPU.idx([1, 2, 3, 4])
    static_out = poison(GPU, (B, 1, HV, V), act)
    kw = {"lower_bound": -5.0} if kda else {}
    kw["use_qk_l2norm_in_kernel"] = True

    def step():
        packed_op(kda)(static["mixed_qkv"], static["a"], static["b"], A_log, dt_bias, K ** -0.5,
                       static_pool.view, static_out, static_idx, **kw)

    g = _warmup_then_capture(step)
    eager_pool.flat.copy_(static_pool.flat)  # the warm-up step moved the static pool on
    for it, indices in enumerate([[1, 2, 3, 4], [4, -1, 2, 1], [-1, 3, -1, -1], [2, 1, 4, 3]]):
        d = packed_data(rng, kda=kda, B=B, H=H, HV=HV, K=K, V=V)
        fresh = materialize_packed(GPU, d, act)
        for name in ("mixed_qkv", "a", "b"):
            static[name].copy_(fresh[name])
        static_idx.copy_(GPU.idx(indices))
        static_out.fill_(float("nan"))
        g.replay()
        eager_out = poison(GPU, (B, 1, HV, V), act)
        packed_op(kda)(fresh["mixed_qkv"], fresh["a"], fresh["b"], A_log, dt_bias, K ** -0.5,
                       eager_pool.view, eager_out, GPU.idx(indices), **kw)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(bits(static_out), bits(eager_out), err_msg=f"out, replay {it}")
        np.testing.assert_array_equal(static_pool.bits(), eager_pool.bits(), err_msg=f"pool, replay {it}")
        assert not torch.isnan(static_out).any()


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_cuda_graph_replayssm_advancing_cursors(rng, kda):
    """Capture one ReplaySSM step with advance_write_pos: each replay appends or flushes as the
    device-side cursors say; results bit-identical to the same sequence of eager calls."""
    H, HV, K, V, L = 2, 4, 64, 64, 4
    rows = np.array([1, 3, -1])
    B = len(rows)
    mems = []
    data = pool_data(rng, 5, HV, V, K, scale=0.3)
    for _ in range(2):
        mems.append({
            "pool": make_pool(GPU, data, "float32", [1, 3, 4]),
            "d": GPU.full((5, HV, L, V), 0.0), "k": GPU.full((5, H, L, K), 0.0, "bfloat16"),
            "g": GPU.full((5, HV, L, K) if kda else (5, HV, L), 0.0),
            "wp": GPU.idx([0, 2, 0]),
        })
    static_m, eager_m = mems
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    A_log, dt_bias = GPU.from64(A_log), GPU.from64(dt_bias.reshape(HV, K) if kda else dt_bias)
    d = packed_data(rng, kda=kda, B=B, H=H, HV=HV, K=K, V=V)
    static = materialize_packed(GPU, d, "bfloat16")
    if kda:
        static["a"] = static["a"].reshape(B, HV, K)
    static_idx, static_ff = GPU.idx(rows), GPU.idx([0, 0, 0])
    static_out = poison(GPU, (B, 1, HV, V), "bfloat16")

    def call(m, x, idx, ff, out):
        ds.fused_recurrent_linear_replayssm_decode(
            x["mixed_qkv"], x["a"], x["b"], A_log, dt_bias, K ** -0.5, m["pool"].view, m["d"],
            m["k"], m["g"], out, idx, m["wp"], ff, is_kda=kda, use_qk_l2norm_in_kernel=True,
            advance_write_pos=True)

    g = _warmup_then_capture(lambda: call(static_m, static, static_idx, static_ff, static_out))
    for name in ("d", "k", "g", "wp"):
        eager_m[name].copy_(static_m[name])
    eager_m["pool"].flat.copy_(static_m["pool"].flat)
    for it in range(3 * L):
        d = packed_data(rng, kda=kda, B=B, H=H, HV=HV, K=K, V=V)
        fresh = materialize_packed(GPU, d, "bfloat16")
        if kda:
            fresh["a"] = fresh["a"].reshape(B, HV, K)
        ff = [0, int(it == 5), 0]
        for name in ("mixed_qkv", "a", "b"):
            static[name].copy_(fresh[name])
        static_ff.copy_(GPU.idx(ff))
        g.replay()
        eager_out = poison(GPU, (B, 1, HV, V), "bfloat16")
        call(eager_m, fresh, GPU.idx(rows), GPU.idx(ff), eager_out)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(bits(static_out), bits(eager_out), err_msg=f"out, replay {it}")
        for name in ("d", "k", "g", "wp"):
            np.testing.assert_array_equal(bits(static_m[name]), bits(eager_m[name]),
                                          err_msg=f"{name}, replay {it}")
        np.testing.assert_array_equal(static_m["pool"].bits(), eager_m["pool"].bits(),
                                      err_msg=f"checkpoint, replay {it}")
    assert to64(static_m["wp"])[2] == 0  # the padded row's cursor never moves


# ---- programmatic dependent launch (pdl=True) --------------------------------------------------
# pdl only changes how the kernel is launched (it may be scheduled while the stream's previous
# kernel still runs, and waits on the device before touching global memory), so every result must
# be bit-identical to pdl=False. The calls below are queued back to back without host syncs, each
# reading what the previous one wrote (the same pool slots), which is where an early start shows.
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("act,state_dtype", [pytest.param("float32", "float32", id="f32"),
                                             pytest.param("bfloat16", "bfloat16", id="bf16all")])
@pytest.mark.parametrize("H,HV,K,V", [pytest.param(2, 4, 16, 8, id="small"),
                                      pytest.param(16, 32, 128, 128, id="qwen3-next")])
def test_packed_decode_pdl_bit_identical(rng, kda, act, state_dtype, H, HV, K, V):
    data = pool_data(rng, 9, HV, V, K, scale=0.3)
    live = [1, 2, 4, 5, 7]
    pools = {pdl: make_pool(GPU, data, state_dtype, live) for pdl in (False, True)}
    A_log, dt_bias = (GPU.from64(t) for t in gate_params(rng, HV, K, kda))
    kw = {"lower_bound": -5.0} if kda else {}
    kw["use_qk_l2norm_in_kernel"] = True
    steps = [[4, -1, 1, 2, 7], [2, 5, 4, -1, 1], [-1, -1, 7, 5, -1], [7, 1, 2, 4, 5]] * 2
    inputs = [materialize_packed(GPU, packed_data(rng, kda=kda, B=5, H=H, HV=HV, K=K, V=V), act)
              for _ in steps]
    outs = {}
    for pdl, pool in pools.items():
        outs[pdl] = [poison(GPU, (5, 1, HV, V), act) for _ in steps]
        torch.cuda.synchronize()
        for x, indices, out in zip(inputs, steps, outs[pdl]):  # no sync in between
            res = packed_op(kda)(x["mixed_qkv"], x["a"], x["b"], A_log, dt_bias, K ** -0.5,
                                 pool.view, out, GPU.idx(indices), pdl=pdl, **kw)
            assert res[0] is out and res[1] is pool.view
        torch.cuda.synchronize()
    for step, (a, b) in enumerate(zip(outs[True], outs[False])):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"out, step {step}")
    np.testing.assert_array_equal(pools[True].bits(), pools[False].bits())


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("H,HV,K,V", [pytest.param(2, 4, 16, 8, id="gva-K16-V8"),
                                      pytest.param(4, 4, 128, 128, id="K128")])
def test_recurrent_pdl_bit_identical(rng, kda, H, HV, K, V):
    """[B, T] in-pool, varlen in-pool (padded and empty sequences) and a start state with final
    states out, each queued back to back with pdl=False and with pdl=True."""
    op = ds.recurrent_kda if kda else ds.recurrent_gated_delta_rule
    act = "bfloat16"
    A_log, dt_bias = (GPU.from64(t) for t in gate_params(rng, HV, K, kda))
    data = pool_data(rng, 6, HV, V, K, scale=0.3)
    pools = {pdl: make_pool(GPU, data, "float32", [0, 1, 2, 3, 5]) for pdl in (False, True)}
    d_bt = recurrent_data(rng, kda=kda, B=3, T=4, H=H, HV=HV, K=K, V=V, use_gate_in_kernel=True,
                          beta_is_logit=True)
    x_bt = materialize_recurrent(GPU, d_bt, act, strided_qkv=True)
    lens = [3, 0, 1, 4]
    cu = GPU.idx(np.concatenate([[0], np.cumsum(lens)]), "int64")
    d_vl = recurrent_data(rng, kda=kda, B=1, T=sum(lens), H=H, HV=HV, K=K, V=V,
                          use_gate_in_kernel=False, beta_is_logit=False)
    x_vl = materialize_recurrent(GPU, d_vl, act)
    d_in = recurrent_data(rng, kda=kda, B=2, T=3, H=H, HV=HV, K=K, V=V, use_gate_in_kernel=False,
                          beta_is_logit=True)
    x_in = materialize_recurrent(GPU, d_in, act)
    init64 = pool_data(rng, 2, HV, V, K, scale=0.3)
    res = {}
    for pdl, pool in pools.items():
        init = GPU.aligned(init64)  # updated in place (FlashInfer's rule): a copy per pdl
        torch.cuda.synchronize()
        got = []
        for _ in range(2):  # no sync in between: each call reads the pool the previous one wrote
            o, ret = op(x_bt["q"], x_bt["k"], x_bt["v"], x_bt["g"], x_bt["beta"], A_log=A_log,
                        dt_bias=dt_bias, initial_state=pool.view,
                        ssm_state_indices=GPU.idx([5, -1, 2]), use_gate_in_kernel=True,
                        lower_bound=-5.0 if kda else None, beta_is_logit=True, pdl=pdl)
            assert ret is None
            got.append(o)
            out = poison(GPU, tuple(x_vl["v"].shape), act)
            o, _ = op(x_vl["q"], x_vl["k"], x_vl["v"], x_vl["g"], x_vl["beta"],
                      initial_state=pool.view, cu_seqlens=cu,
                      ssm_state_indices=GPU.idx([2, 1, -1, 0]), output=out, pdl=pdl)
            assert o is out
            got.append(o)
            o, final = op(x_in["q"], x_in["k"], x_in["v"], x_in["g"], x_in["beta"],
                          initial_state=init, output_final_state=True, beta_is_logit=True,
                          pdl=pdl)
            assert final is init
            got += [o, final.clone()]
        torch.cuda.synchronize()
        res[pdl] = [bits(t) for t in got]
    for i, (a, b) in enumerate(zip(res[True], res[False])):
        np.testing.assert_array_equal(a, b, err_msg=f"result {i}")
    np.testing.assert_array_equal(pools[True].bits(), pools[False].bits())


@pytest.mark.parametrize("kda,L,H,HV,K,V,act,state_dtype,k_dtype", REPLAY_CASES)
def test_replayssm_pdl_bit_identical(rng, kda, L, H, HV, K, V, act, state_dtype, k_dtype):
    """3L + 2 ReplaySSM steps (appends, flushes, forced flushes, an idle row, cursors advanced on
    the device) queued back to back with pdl=False and with pdl=True: the same memory, bit for
    bit."""
    rows = np.array([3, -1, 1, 6])
    data = pool_data(rng, 8, HV, V, K, scale=0.3)
    mems = {}
    for pdl in (False, True):
        mems[pdl] = {
            "pool": make_pool(GPU, data, state_dtype, [1, 3, 5, 6]),
            "d": GPU.full((8, HV, L, V), sentinel_for(state_dtype), state_dtype),
            "k": GPU.full((8, H, L, K), sentinel_for(k_dtype), k_dtype),
            "g": GPU.full((8, HV, L, K) if kda else (8, HV, L), 1e30, "float32"),
            "wp": GPU.idx([0, 0, min(1, L - 1), L - 1]),
        }
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    A_log, dt_bias = GPU.from64(A_log), GPU.from64(dt_bias.reshape(HV, K) if kda else dt_bias)
    steps = []
    for step in range(3 * L + 2):
        indices = rows.copy()
        if step % 4 == 2:
            indices[2] = -1
        ff = (rng.random(len(rows)) < 0.2).astype(np.int64) if step % 3 == 0 else None
        x = materialize_packed(GPU, packed_data(rng, kda=kda, B=len(rows), H=H, HV=HV, K=K, V=V),
                               act)
        if kda:
            x["a"] = x["a"].reshape(len(rows), HV, K)
        steps.append((x, GPU.idx(indices), None if ff is None else GPU.idx(ff)))
    outs = {}
    for pdl, m in mems.items():
        outs[pdl] = [poison(GPU, (len(rows), 1, HV, V), act) for _ in steps]
        torch.cuda.synchronize()
        for (x, idx, ff), out in zip(steps, outs[pdl]):  # no sync in between
            res = ds.fused_recurrent_linear_replayssm_decode(
                x["mixed_qkv"], x["a"], x["b"], A_log, dt_bias, K ** -0.5, m["pool"].view, m["d"],
                m["k"], m["g"], out, idx, m["wp"], ff, is_kda=kda,
                lower_bound=-5.0 if kda else None, advance_write_pos=True, pdl=pdl)
            assert res[0] is out
        torch.cuda.synchronize()
    for step, (a, b) in enumerate(zip(outs[True], outs[False])):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"out, step {step}")
    for name in ("d", "k", "g", "wp"):
        np.testing.assert_array_equal(bits(mems[True][name]), bits(mems[False][name]), err_msg=name)
    np.testing.assert_array_equal(mems[True]["pool"].bits(), mems[False]["pool"].bits())


@pytest.mark.parametrize("act", ["bfloat16", "float32"])
def test_cuda_graph_pdl_chain_matches_eager(rng, act):
    """A chain of dependent pdl=True launches captured into one CUDAGraph: GDN packed decode twice
    on the same slots, recurrent GDN (T = 1) whose `v` is the second decode's `out` on the same
    pool, KDA packed decode, GDN and KDA ReplaySSM steps (cursors advanced on the device), each
    kernel reading what the previous one wrote. Several replays with new inputs copied into the
    captured buffers give, bit for bit, what the same calls give eagerly one after another with
    pdl=False."""
    H, HV, K, V, L = 4, 8, 128, 128, 3
    rows = [1, 3, -1, 4]
    B = len(rows)
    gdn_pool = pool_data(rng, 6, HV, V, K, scale=0.3)
    kda_pool = pool_data(rng, 6, HV, V, K, scale=0.3)

    def memory():
        m = {"gdn": make_pool(GPU, gdn_pool, "float32", [1, 3, 4]),
             "kda": make_pool(GPU, kda_pool, "float32", [1, 3, 4])}
        for kind, kda in (("rg", False), ("rk", True)):
            m[kind] = {
                "pool": make_pool(GPU, kda_pool if kda else gdn_pool, "float32", [1, 3, 4]),
                "d": GPU.full((6, HV, L, V), 0.0), "k": GPU.full((6, H, L, K), 0.0, act),
                "g": GPU.full((6, HV, L, K) if kda else (6, HV, L), 0.0),
                "wp": GPU.idx([0, 1, 0, L - 1]),
            }
        m["outs"] = [poison(GPU, (B, 1, HV, V), act) for _ in range(6)]
        return m

    static_m, eager_m = memory(), memory()
    gA, gdt = (GPU.from64(t) for t in gate_params(rng, HV, K, False))
    kA, kdt = gate_params(rng, HV, K, True)
    kA, kdt = GPU.from64(kA), GPU.from64(kdt.reshape(HV, K))

    def fresh_inputs():
        x = {}
        for i, kda in enumerate((False, False, True, False, True)):
            p = materialize_packed(GPU, packed_data(rng, kda=kda, B=B, H=H, HV=HV, K=K, V=V), act)
            for name, t in p.items():
                x[f"{name}{i}"] = t
        x["a4"] = x["a4"].reshape(B, HV, K)
        r = recurrent_data(rng, kda=False, B=B, T=1, H=H, HV=HV, K=K, V=V,
                           use_gate_in_kernel=False, beta_is_logit=True)
        for name in ("q", "k", "g", "beta"):
            x[f"r_{name}"] = (GPU.from64(r[name]) if name == "g"
                              else GPU.from64(r[name], act))
        x["idx"] = GPU.idx(rows)
        x["ff"] = GPU.idx([0, 0, 0, int(rng.random() < 0.5)])
        return x

    def chain(m, x, pdl):
        o = m["outs"]
        gdn, kdap = ds.fused_recurrent_gated_delta_rule_packed_decode, \
            ds.fused_recurrent_kda_packed_decode
        gdn(x["mixed_qkv0"], x["a0"], x["b0"], gA, gdt, K ** -0.5, m["gdn"].view, o[0], x["idx"],
            True, pdl=pdl)
        gdn(x["mixed_qkv1"], x["a1"], x["b1"], gA, gdt, K ** -0.5, m["gdn"].view, o[1], x["idx"],
            True, pdl=pdl)
        ds.recurrent_gated_delta_rule(x["r_q"], x["r_k"], o[1], x["r_g"], x["r_beta"],
                                      initial_state=m["gdn"].view, ssm_state_indices=x["idx"],
                                      output=o[2], beta_is_logit=True, pdl=pdl)
        kdap(x["mixed_qkv2"], x["a2"], x["b2"], kA, kdt.reshape(-1), K ** -0.5, m["kda"].view,
             o[3], x["idx"], True, lower_bound=-5.0, pdl=pdl)
        for i, kind, kda, A, dt in ((3, "rg", False, gA, gdt), (4, "rk", True, kA, kdt)):
            r = m[kind]
            ds.fused_recurrent_linear_replayssm_decode(
                x[f"mixed_qkv{i}"], x[f"a{i}"], x[f"b{i}"], A, dt, K ** -0.5, r["pool"].view,
                r["d"], r["k"], r["g"], o[i + 1], x["idx"], r["wp"], x["ff"], is_kda=kda,
                use_qk_l2norm_in_kernel=True, advance_write_pos=True, pdl=pdl)

    def snapshot_of(m):
        snap = {"gdn": m["gdn"].bits(), "kda": m["kda"].bits()}
        for kind in ("rg", "rk"):
            snap[kind + ".pool"] = m[kind]["pool"].bits()
            for name in ("d", "k", "g", "wp"):
                snap[f"{kind}.{name}"] = bits(m[kind][name])
        for i, t in enumerate(m["outs"]):
            snap[f"out{i}"] = bits(t)
        return snap

    static_x = fresh_inputs()
    g = _warmup_then_capture(lambda: chain(static_m, static_x, True))
    # The warm-up moved the static memory on: start the eager twin from the same point.
    eager_m["gdn"].flat.copy_(static_m["gdn"].flat)
    eager_m["kda"].flat.copy_(static_m["kda"].flat)
    for kind in ("rg", "rk"):
        eager_m[kind]["pool"].flat.copy_(static_m[kind]["pool"].flat)
        for name in ("d", "k", "g", "wp"):
            eager_m[kind][name].copy_(static_m[kind][name])
    torch.cuda.synchronize()
    for it in range(2 * L + 1):
        x = fresh_inputs()
        for name, t in x.items():
            static_x[name].copy_(t)
        for t in static_m["outs"]:
            t.fill_(float("nan"))
        g.replay()
        chain(eager_m, x, False)
        torch.cuda.synchronize()
        want, got = snapshot_of(eager_m), snapshot_of(static_m)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name}, replay {it}")
        for i, t in enumerate(static_m["outs"]):  # every output written (padded rows: 0)
            assert not torch.isnan(t).any(), f"out{i}, replay {it}"
    # Cursors advanced on the device across replays (the padded row's never moves).
    assert to64(static_m["rg"]["wp"])[2] == 0


# ---- streams ----------------------------------------------------------------------------------
def test_ops_run_on_torch_current_stream(rng):
    """On a side stream, queue a long GPU spin and then the write of the inputs; the op must
    run after them (on that stream), so its result is the one for the new inputs."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is not available")
    H, HV, K, V, B = 2, 4, 64, 32, 3
    data = pool_data(rng, 4, HV, V, K, scale=0.3)
    pc, pg = make_pool(CPU, data, "float32", [0, 1, 3]), make_pool(GPU, data, "float32", [0, 1, 3])
    A_log, dt_bias = gate_params(rng, HV, K, False)
    d_old = packed_data(rng, kda=False, B=B, H=H, HV=HV, K=K, V=V)
    d_new = packed_data(rng, kda=False, B=B, H=H, HV=HV, K=K, V=V)
    x = materialize_packed(GPU, d_old, "float32")
    new = materialize_packed(GPU, d_new, "float32")
    A_g, dt_g, idx = GPU.from64(A_log), GPU.from64(dt_bias), GPU.idx([3, -1, 0])
    out = poison(GPU, (B, 1, HV, V), "float32")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU time on s
        for name in ("mixed_qkv", "a", "b"):
            x[name].copy_(new[name], non_blocking=True)
        ds.fused_recurrent_gated_delta_rule_packed_decode(
            x["mixed_qkv"], x["a"], x["b"], A_g, dt_g, K ** -0.5, pg.view, out, idx, True)
        result = out.clone()
    s.synchronize()
    xc = materialize_packed(CPU, d_new, "float32")
    out_c = poison(CPU, (B, 1, HV, V), "float32")
    ds.fused_recurrent_gated_delta_rule_packed_decode(
        xc["mixed_qkv"], xc["a"], xc["b"], CPU.from64(A_log), CPU.from64(dt_bias), K ** -0.5,
        pc.view, out_c, CPU.idx([3, -1, 0]), True)
    close2(to64(result), to64(out_c), TOL_OUT, "float32", "out on a side stream")
    for slot in (3, 0):
        close2(pg.state64()[slot], pc.state64()[slot], TOL_STATE["float32"], "float32", "state")


# ---- the out-of-range guard -------------------------------------------------------------------
def _clear_device_errors():
    try:
        ds.check_errors()  # whatever an earlier test left
    except ValueError:
        pass


def _expect_guarded(buf_bad, buf_ref, slots, text):
    """The pool of a call with a bad index equals the call's with that row padded, bit for bit;
    the 1e30 memory past the pool view is untouched; check_errors raises `text`, then passes."""
    assert torch.equal(buf_bad.view(torch.int32), buf_ref.view(torch.int32))
    assert (buf_bad[slots] == 1e30).all(), "the memory past the pool was written"
    with pytest.raises(ValueError) as e:
        ds.check_errors()
    assert str(e.value) == text
    ds.check_errors()  # cleared


def test_check_errors_reports_a_skipped_row(rng):
    """An index >= slots on CUDA: the row is skipped (its slot memory past the pool view's end,
    sentinel-filled, stays bit-untouched), its output is NaN, the other rows are bit-identical to
    the same call with that row padded; ds.check_errors() raises ValueError naming it, then
    passes (cleared); check_indices=True raises from the op itself."""
    H, HV, K, V, B, slots = 2, 4, 128, 64, 3, 4
    _clear_device_errors()
    data = pool_data(rng, slots + 1, HV, V, K, scale=0.3)
    A_log, dt_bias = gate_params(rng, HV, K, False)
    x = materialize_packed(GPU, packed_data(rng, kda=False, B=B, H=H, HV=HV, K=K, V=V), "float32")
    A_g, dt_g = GPU.from64(A_log), GPU.from64(dt_bias)
    text = ("recurrent: `ssm_state_indices`[1]=4 is out of range for a state pool of 4 slots "
            "(valid: 0..3; < 0 marks a padded row); the row was skipped (state, rings and cursor "
            "untouched) and its output is NaN")

    def run(indices, **kw):
        buf = torch.full((slots + 1, HV, V, K), 1e30, dtype=torch.float32, device="cuda")
        buf[:slots].copy_(torch.from_numpy(data[:slots]).to(torch.float32))
        out = poison(GPU, (B, 1, HV, V), "float32")
        ds.fused_recurrent_gated_delta_rule_packed_decode(
            x["mixed_qkv"], x["a"], x["b"], A_g, dt_g, K ** -0.5, buf[:slots], out,
            GPU.idx(indices), True, **kw)
        return buf, out

    buf_bad, out_bad = run([2, slots, 0])
    buf_ref, out_ref = run([2, -1, 0])
    torch.cuda.synchronize()
    assert torch.isnan(out_bad[1]).all()
    assert torch.equal(out_bad[0::2].view(torch.int32), out_ref[0::2].view(torch.int32))
    _expect_guarded(buf_bad, buf_ref, slots, text)
    ds.check_errors(torch.cuda.current_stream())

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        run([2, slots, 0])
    with pytest.raises(ValueError, match="is out of range for a state pool of 4 slots"):
        ds.check_errors(s)
    ds.check_errors(s)

    with pytest.raises(ValueError) as e:
        run([2, slots, 0], check_indices=True)
    assert str(e.value) == text
    ds.check_errors()


@pytest.mark.parametrize("kda", [False, True])
def test_check_errors_reports_a_skipped_prefill_sequence(kda):
    """chunk_gated_delta_rule / chunk_kda on CUDA with an initial_state_indices entry >= slots:
    that sequence is skipped (no pool write: the slot past the pool view, 1e30-filled, stays
    bit-untouched; outputs NaN), the others are bit-identical to the call with it padded;
    ds.check_errors() raises the validator's text, then passes; check_indices=True raises from
    the op itself."""
    H, HV, K, slots = 2, 4, 128, 4
    T = 65 + 130 + 7
    _clear_device_errors()
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, T, H, K, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(1, T, H, K, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(1, T, HV, K, generator=g).to("cuda", torch.bfloat16)
    gate = (torch.rand(1, T, HV, K, generator=g) if kda else torch.rand(1, T, HV, generator=g))
    gate = torch.nn.functional.logsigmoid(gate).to("cuda")
    beta = torch.rand(1, T, HV, generator=g).to("cuda")
    cu = torch.tensor([0, 65, 195, 202], dtype=torch.int32, device="cuda")
    init = torch.randn(slots, HV, K, K, generator=g) * 0.1
    fn = ds.chunk_kda if kda else ds.chunk_gated_delta_rule
    name = "chunk_kda" if kda else "chunk_gated_delta_rule"
    text = (f"{name}: `initial_state_indices`[1]=4 is out of range for a state pool of 4 slots "
            "(valid: 0..3; < 0 marks a padded row); its sequence was skipped (no pool slot "
            "written) and its outputs are NaN")

    def run(indices, **kw):
        buf = torch.full((slots + 1, HV, K, K), 1e30, dtype=torch.float32, device="cuda")
        buf[:slots].copy_(init)
        o, _ = fn(q, k, v, gate, beta, initial_state=buf[:slots], state_v_first=True,
                  cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                  initial_state_indices=torch.tensor(indices, dtype=torch.int32, device="cuda"),
                  **kw)
        return buf, o

    buf_bad, o_bad = run([2, slots, 0])
    buf_ref, o_ref = run([2, -1, 0])
    torch.cuda.synchronize()
    assert torch.isnan(o_bad[:, 65:195].float()).all()
    for a, b in ((0, 65), (195, 202)):
        assert torch.equal(o_bad[:, a:b].view(torch.int16), o_ref[:, a:b].view(torch.int16))
    _expect_guarded(buf_bad, buf_ref, slots, text)
    with pytest.raises(ValueError) as e:
        run([2, slots, 0], check_indices=True)
    assert str(e.value) == text
    ds.check_errors()


# ---- StatePool on CUDA ------------------------------------------------------------------------
def test_check_errors_reports_a_circular_track_slot_past_the_pool(rng):
    """replayssm_circular_commit with a track slot >= slots (the CPU validator raises): on CUDA
    the row is skipped whole (its checkpoint, its cursors and the 1e30 memory past the pool view,
    where that track state would land, bit-untouched), the other row commits as in the same call
    with that row padded, and ds.check_errors() raises the CPU's text, then passes."""
    H, HV, K, V, L, R, slots = 2, 4, 32, 16, 8, 4, 4
    _clear_device_errors()
    data = pool_data(rng, slots, HV, V, K, scale=0.3)
    rings = (rng.standard_normal((R, HV, L, V)) * 0.3, rng.standard_normal((R, H, L, K)) * 0.3,
             -np.abs(rng.standard_normal((R, HV, L))) * 0.3)
    cursors = ([5, 0, 3, 0], [0, 0, 6, 0], [1, 0, 1, 0])  # write_pos, cache_base, is_flush

    def run(fw, slots_of_rows, device):
        buf = torch.full((slots + 1, HV, V, K), 1e30, dtype=torch.float32, device=device)
        buf[:slots].copy_(torch.from_numpy(data).to(torch.float32))
        cur = [fw.idx(c) for c in cursors]
        ds.replayssm_circular_commit(
            buf[:slots], *(fw.from64(x) for x in rings), fw.idx(slots_of_rows), fw.idx([2, 0]),
            *cur, fw.idx([2, 2]), track_indices=fw.idx([slots, 0]),
            steps_to_track=fw.idx([0, 1]))
        return buf, cur

    with pytest.raises(ValueError, match=r"`mamba_track_indices`\[0\]=4 is out of range for a "
                                         r"pool of 4 slots"):
        run(CPU, [1, 3], "cpu")
    buf_bad, cur_bad = run(GPU, [1, 3], "cuda")
    buf_ref, cur_ref = run(GPU, [-1, 3], "cuda")
    torch.cuda.synchronize()
    for a, b in zip(cur_bad, cur_ref):
        assert torch.equal(a, b), "cursors"
    assert to64(cur_bad[0])[2] == 3 and to64(cur_bad[2])[2] == 1, "the skipped row's cursors"
    _expect_guarded(buf_bad, buf_ref, slots,
                    "commit_gdn_replayssm_circular: `mamba_track_indices`[0]=4 is out of range "
                    "for a pool of 4 slots; the row was skipped (state, rings and cursor "
                    "untouched) and its output is NaN")


def test_state_pool_cuda(rng):
    HV, V, K, H, L = 2, 16, 64, 1, 4
    gp = ds.StatePool(layers=2, slots=4, HV=HV, V=V, K=K, layout="envelope",
                      envelope_extra_bytes=96, replay_len=L, H=H, device="cuda")
    cp = ds.StatePool(layers=2, slots=4, HV=HV, V=V, K=K, layout="envelope",
                      envelope_extra_bytes=96, replay_len=L, H=H, device="cpu")
    assert gp.layer_state(1).device.type == "cuda" and gp.layer_state(1).stride() == cp.layer_state(1).stride()
    slots = [gp.allocate() for _ in range(3)]
    assert slots == [cp.allocate() for _ in range(3)]
    for layer in range(2):
        val = torch.from_numpy((rng.standard_normal((3, HV, V, K)) * 0.3).astype(np.float32))
        for i, s in enumerate(slots):
            gp.layer_state(layer)[s].copy_(val[i])
            cp.layer_state(layer)[s].copy_(val[i])

    # An op through the pool's view, on CUDA and on the CPU.
    A_log, dt_bias = gate_params(rng, HV, K, False)
    d = packed_data(rng, kda=False, B=2, H=H, HV=HV, K=K, V=V)
    outs = []
    for fw, pool in ((CPU, cp), (GPU, gp)):
        x = materialize_packed(fw, d, "float32")
        out = poison(fw, (2, 1, HV, V), "float32")
        ds.fused_recurrent_gated_delta_rule_packed_decode(
            x["mixed_qkv"], x["a"], x["b"], fw.from64(A_log), fw.from64(dt_bias), K ** -0.5,
            pool.layer_state(1), out, fw.idx([slots[2], slots[0]]), True)
        outs.append(to64(out))
    close2(outs[1], outs[0], TOL_OUT, "float32", "out")
    close2(to64(gp.layer_state(1)), to64(cp.layer_state(1)), TOL_STATE["float32"], "float32", "pool")
    np.testing.assert_array_equal(bits(gp.layer_state(0)), bits(cp.layer_state(0)))

    # Cursors advanced by an op on a side stream are seen by cursor() and fork().
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000) if hasattr(torch.cuda, "_sleep") else None
        gp.write_pos()[slots[1]] = 2
        assert gp.cursor(slots[1]) == 2
        with pytest.raises(ValueError) as e:  # the cursor seen: cache_base checked against it
            gp.fork(slots[1], slots[2], cache_base=L)
        assert str(e.value) == f"StatePool.fork: cache_base={L} is outside the ring [0, L-1={L - 1}]"
        gp.set_cursor(slots[1], 0)
        gp.fork(slots[1], slots[2])
        assert gp.cursor(slots[2]) == 0
        # allocate(clear) zeroes on this stream, after the writes queued before it.
        gp.free(slots[0])
        gp.layer_state(0)[slots[0]].fill_(5.0)
        assert gp.allocate() == slots[0]
        cleared = gp.layer_state(0)[slots[0]].clone()
    s.synchronize()
    assert (cleared == 0).all()
    for layer in range(2):
        np.testing.assert_array_equal(bits(gp.layer_state(layer)[slots[2]]),
                                      bits(gp.layer_state(layer)[slots[1]]))


# ---- the chunked prefill on a quantized / stochastically rounded pool (issue #36) -------------
QPREFILL_FORMATS = [
    pytest.param("float8_e4m3fn", "stochastic", id="fp8-sr"),
    pytest.param("int8", "nearest", id="int8-rn"),
    pytest.param("bfloat16", "stochastic", id="bf16-sr"),
]
QPREFILL_CASES = [  # (kda, H, HV, K, V, input dtype, sequence lengths, checkpoint_every)
    pytest.param(False, 1, 2, 16, 16, "float32", [130, 5, 70], 64, id="gdn-K16-fallback"),
    # the Hopper kernels on compute capability 9.0 (the tensor-core kernels elsewhere)
    pytest.param(False, 4, 8, 128, 128, "bfloat16", [130, 5, 70], 64, id="gdn-K128"),
    # one long sequence: the Hopper kernels' context parallelism (transfer, combine, segments)
    pytest.param(False, 4, 8, 128, 128, "bfloat16", [4096], 512, id="gdn-K128-long"),
    pytest.param(True, 2, 4, 128, 128, "bfloat16", [130, 5, 70], 64, id="kda-K128"),
]


@pytest.mark.parametrize("dtype,rounding", QPREFILL_FORMATS)
@pytest.mark.parametrize("kda,H,HV,K,V,act,lengths,every", QPREFILL_CASES)
def test_chunked_prefill_formatted_pool_cuda_matches_its_fp32_twin(rng, kda, H, HV, K, V, act,
                                                                   lengths, every, dtype,
                                                                   rounding):
    """The CUDA chunked prefill on a quantized (or bf16 stochastic) pool against the same call
    on an fp32 CUDA pool holding the dequantized initial states (the same kernel: the same fp32
    results): outputs bit-identical, final states and checkpoint slots the emulation's rounding of
    the twin's (tools/state_accuracy.py, bit for bit, the key's step 0), the step counter
    advanced once; a padded sequence's, a skipped checkpoint's and unused slots' sentinels
    untouched."""
    from test_state_format import (SENTINEL_CODE, SENTINEL_SCALE, dequantize, emulate,
                                   fill_sentinels, sa, state_bits, write_slot)
    quantized = dtype != "bfloat16"
    slots, layer, seed = 8, 1, 77
    pool = ds.StatePool(layers=2, slots=slots, HV=HV, V=V, K=K, state_dtype=dtype,
                        state_rounding=rounding, rounding_seed=seed, device="cuda")
    twin = ds.StatePool(layers=1, slots=slots, HV=HV, V=V, K=K, device="cuda")
    if quantized:
        fill_sentinels(pool, layer)
    else:
        pool.layer_state(layer).view(torch.int16).fill_(0x5A5A)
    host = (rng.standard_normal((slots, HV, V, K)) * 0.5).astype(np.float32)
    for s in (0, 2):  # the initial states read
        if quantized:
            codes, sc = emulate(host[s], dtype, False)
            write_slot(pool, layer, s, codes, sc)
        else:
            pool.layer_state(layer)[s].copy_(torch.from_numpy(host[s]))
    before = bits(pool.layer_state(layer)).copy()
    before_scales = bits(pool.layer_scales(layer)).copy() if quantized else None
    for s in (0, 2):
        if quantized:
            c, sc = state_bits(pool, layer)
            twin.layer_state(0)[s].copy_(torch.from_numpy(
                dequantize(c[s], sc[s].view(np.float32), dtype)))
        else:
            twin.layer_state(0)[s].copy_(pool.layer_state(layer)[s].float())
    T = sum(lengths)
    gshape = (1, T, HV, K) if kda else (1, T, HV)
    f = lambda x: torch.from_numpy(x.astype(np.float32)).to(  # noqa: E731
        device="cuda", dtype=getattr(torch, act))
    q, k = f(rng.standard_normal((1, T, H, K))), f(rng.standard_normal((1, T, H, K)))
    v, beta = f(rng.standard_normal((1, T, HV, V))), f(rng.uniform(0.05, 0.95, (1, T, HV)))
    g = f(-rng.uniform(0.0, 0.3, gshape))
    idx = lambda x: torch.tensor(x, dtype=torch.int64, device="cuda")  # noqa: E731
    cu = idx(np.concatenate([[0], np.cumsum(lengths)]).tolist())
    counts = [n // every for n in lengths]
    ck_starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
    ck_slots = ([5, -1, 6] + [-1] * ck_starts[-1])[:ck_starts[-1]]  # -1: a skipped checkpoint
    written_ck = [s for s in ck_slots if s >= 0]
    N = len(lengths)  # sequence 1 padded (when there is one)
    initial, output = [0, -1, 2][:N], [3, -1, 4][:N]
    finals = [s for s in output if s >= 0]
    op = ds.chunk_kda if kda else ds.chunk_gated_delta_rule
    outs = []
    for p, l, kw in ((pool, layer, pool.state_format(layer)), (twin, 0, {})):
        o, _ = op(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                  initial_state=p.layer_state(l), initial_state_indices=idx(initial),
                  output_state_indices=idx(output), output_final_state=False,
                  state_v_first=True, checkpoint_every_n_tokens=every,
                  checkpoint_cu_starts=idx(ck_starts), checkpoint_slot_indices=idx(ck_slots),
                  **kw)
        outs.append(bits(o).view(np.uint16 if act != "float32" else np.uint32))
    torch.cuda.synchronize()
    np.testing.assert_array_equal(outs[0], outs[1])
    new32 = twin.layer_state(0).cpu().numpy()
    now = bits(pool.layer_state(layer))
    for s in finals + written_ck:  # final states and checkpoints
        key = sa.sr_key(seed, s, layer, 0) if rounding == "stochastic" else None
        if quantized:
            codes, scales = state_bits(pool, layer)
            want_codes, want_scales = emulate(new32[s], dtype, rounding == "stochastic", key)
            np.testing.assert_array_equal(codes[s], want_codes, err_msg=f"slot {s}")
            np.testing.assert_array_equal(scales[s], want_scales.view(np.uint32),
                                          err_msg=f"scales of slot {s}")
        else:
            index = np.arange(HV * V * K, dtype=np.uint64).reshape(HV, V, K)
            want = sa.round_bf16(new32[s], sa.sr_bits(key, index))
            got = pool.layer_state(layer)[s].float().cpu().numpy()
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32),
                                          err_msg=f"slot {s}")
    untouched = [s for s in range(slots) if s not in finals + written_ck]
    for s in untouched:  # read (0, 2), padded (1), unused: as before
        np.testing.assert_array_equal(now[s], before[s], err_msg=f"slot {s}")
        if quantized:
            np.testing.assert_array_equal(bits(pool.layer_scales(layer))[s], before_scales[s])
    if quantized:
        codes, scales = state_bits(pool, layer)
        for s in untouched:
            if s not in (0, 2):
                assert np.all(codes[s] == SENTINEL_CODE)
                assert np.all(scales[s] == SENTINEL_SCALE.view(np.uint32))
    if rounding == "stochastic":
        assert int(pool.rounding_step(layer)[0]) == 1  # one advance per call
        assert int(pool.rounding_step(0)[0]) == 0  # the other layer's counter


def check_formatted_slots(pg, pc, layer, dtype, live, written, before):
    """A CUDA pool's formatted layer against the CPU pool's after the same calls: in the `written`
    slots scales to 1e-4 relative and dequantized codes within one quantum (bf16: one unit in the
    last place, plus 2^-16 of the row's amax), at most 2% of them differing; every other slot bit
    for bit as `before` (the CUDA pool's bits before the calls), the quantized pool's slots
    neither `live` nor written still sentinels on both."""
    from test_state_format import SENTINEL_CODE, dequantize, state_bits
    quantized = dtype != "bfloat16"
    slots = pg.layer_state(layer).shape[0]
    if quantized:
        cg, sg = state_bits(pg, layer)
        cc, sc = state_bits(pc, layer)
        qmax = 448.0 if dtype == "float8_e4m3fn" else 127.0
        differ = total = 0
        for s in written:
            hs, gs = sc[s].view(np.float32), sg[s].view(np.float32)
            np.testing.assert_allclose(gs, hs, rtol=1e-4, err_msg=f"scales of slot {s}")
            hv, gv = dequantize(cc[s], hs, dtype), dequantize(cg[s], gs, dtype)
            if dtype == "float8_e4m3fn":
                quantum = np.maximum(np.abs(hv) * 0.125, hs[..., None] * 2.0 ** -9)
            else:
                quantum = np.broadcast_to(hs[..., None], hv.shape)
            assert np.all(np.abs(gv - hv) <= quantum * 1.0001 + 1e-5 * hs[..., None] * qmax), s
            differ += int(np.sum(cg[s] != cc[s]))
            total += cg[s].size
        assert differ <= total // 50, (differ, total)
        for s in range(slots):
            if s not in live and s not in written:
                assert np.all(cg[s] == SENTINEL_CODE) and np.all(sg[s] == sc[s]), s
    else:
        g32 = pg.layer_state(layer).float().cpu().numpy()
        h32 = pc.layer_state(layer).float().numpy()
        differ = total = 0
        for s in written:
            mag = np.maximum(np.abs(g32[s]), np.abs(h32[s]))
            amax = np.abs(h32[s]).max(axis=-1, keepdims=True)
            assert np.all(np.abs(g32[s] - h32[s]) <= mag * 2.0 ** -7 * 1.0001 + amax * 2.0 ** -16)
            differ += int(np.sum(g32[s] != h32[s]))
            total += g32[s].size
        assert differ <= total // 50, (differ, total)
    now = bits(pg.layer_state(layer))
    for s in range(slots):
        if s not in written:
            np.testing.assert_array_equal(now[s], before[s], err_msg=f"slot {s}, not written")


def checkpoint_values(pool, layer, slot, dtype):
    """One slot of a formatted layer, dequantized: fp32 [HV, V, K] (numpy)."""
    from test_state_format import dequantize, state_bits
    if dtype == "bfloat16":
        return pool.layer_state(layer)[slot].float().cpu().numpy()
    codes, scales = state_bits(pool, layer)
    return dequantize(codes[slot], scales[slot].view(np.float32), dtype)


def folded_draft_slack(pg, pc, layer, dtype, slot, positions, H):
    """[HV, L, V] of the d ring of a folding row's slot: how far the two backends' stored
    checkpoints (each its own rounding of its own fp32 fold; the CUDA fold's exp and reduction
    order are not the CPU's, so a code may sit one quantum apart, which check_formatted_slots
    bounds) can move the drafts' records at `positions` (oldest first), which run from them. With
    e = |S_cuda - S_cpu| per element, draft t's d = beta (v - sum_k alpha_k S_k k_k) moves by at
    most sum_k e_k |k_k| (beta in (0, 1], a sigmoid; alpha = e^g in (0, 1], g <= 0) and the state
    it leaves, alpha S + d k, by at most e_k + |delta d| |k_k|: the next draft's e. The drafts are
    linear in the state, so this holds but for fp32 rounding. k: the CPU's k ring record. Zero
    elsewhere (and in rows whose checkpoints are equal)."""
    e = np.abs(checkpoint_values(pg, layer, slot, dtype).astype(np.float64)
               - checkpoint_values(pc, layer, slot, dtype))  # [HV, V, K]
    kr = pc.k_cache(layer)[slot].float().numpy().astype(np.float64)  # [H, L, K]
    HV = e.shape[0]
    slack = np.zeros(tuple(pc.d_cache(layer)[slot].shape), np.float64)  # [HV, L, V]
    for p in positions:
        k = np.abs(kr[np.arange(HV) // (HV // H), p])  # [HV, K]
        dd = np.einsum("hvk,hk->hv", e, k)
        slack[:, p] = dd
        e = e + dd[..., None] * k[:, None, :]
    return slack


# ---- the fused decode step on a quantized / stochastically rounded pool (issue #36) ------------
@pytest.mark.parametrize("replay", [False, True], ids=["plain", "replayssm"])
@pytest.mark.parametrize("dtype,rounding", QPREFILL_FORMATS)
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_fused_step_formatted_pool_cuda_matches_cpu(rng, kda, dtype, rounding, replay):
    """The CUDA fused decode step (plain mode, or ReplaySSM mode with the pool's rings: one row
    flushing, one appending, the cursors advanced by the op) on a quantized (or bf16 stochastic)
    pool, its workspace allocated by the wrapper from the query (which reads state_rounding),
    against the CPU backend's on the same pool bytes: outputs (2e-4), conv windows bit for bit,
    live slots' scales to 1e-4 relative and dequantized codes within one quantum (bf16: one unit
    in the last place), at most 2% of them differing, the rings (1e-5) and cursors, the step
    counter advanced once on both, the padded row's output zero and the unused slots' bytes
    untouched. Not yet run on a GPU in ReplaySSM mode."""
    from test_state_format import emulate, fill_sentinels, write_slot
    quantized = dtype != "bfloat16"
    H, HV, K, V, slots, layer, seed, width = 2, 4, 128, 64, 6, 0, 5, 4
    conv_dim = 2 * H * K + HV * V
    kw = dict(layers=1, slots=slots, HV=HV, V=V, K=K, state_dtype=dtype, state_rounding=rounding,
              rounding_seed=seed, conv_dim=conv_dim)
    if replay:  # the pool's rings (zeros: records a cursor reads add nothing), L = 3
        kw.update(replay_len=3, H=H, kda=kda, ring_k_dtype="float32")
    pg, pc = ds.StatePool(device="cuda", **kw), ds.StatePool(**kw)
    live = [4, 1]
    if quantized:
        fill_sentinels(pg, layer)
    else:
        pg.layer_state(layer).view(torch.int16).fill_(0x5A5A)
    for s in live:
        x32 = (rng.standard_normal((HV, V, K)) * 0.4).astype(np.float32)
        if quantized:
            codes, sc = emulate(x32, dtype, False)
            write_slot(pg, layer, s, codes, sc)
        else:
            pg.layer_state(layer)[s].copy_(torch.from_numpy(x32))
    win = torch.from_numpy(rng.standard_normal((slots, conv_dim, width - 1)).astype(np.float32))
    pg.conv_state(layer).copy_(win)
    torch.cuda.synchronize()
    pc.storage.copy_(pg.storage.cpu())  # the same pool bytes on the CPU
    before = bits(pg.layer_state(layer))
    t = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32))  # noqa
    B = 3
    A_log = torch.from_numpy(rng.uniform(-1, 0.5, HV).astype(np.float32))
    dt_bias = t(HV * K if kda else HV) * 0.5
    w, bias = t(conv_dim, width) * 0.5, t(conv_dim) * 0.2
    nw, z = torch.rand(V) + 0.5, t(B, HV, V)
    x, a, b = t(B, conv_dim), t(B, HV * K if kda else HV), t(B, HV)
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    op = ds.kda_fused_decode_step if kda else ds.gdn_fused_decode_step
    outs, cursors = [], []
    for p, dev in ((pg, "cuda"), (pc, "cpu")):
        d = lambda u: u.to(dev)  # noqa: E731
        out = torch.full((B, HV, V), float("nan"), device=dev)
        rings = {}
        if replay:  # row 0 flushes (cursor L-1), row 2 appends at 1
            wp = torch.tensor([2, 0, 1], dtype=torch.int32, device=dev)
            rings = dict(d_cache=p.d_cache(layer), k_cache=p.k_cache(layer),
                         g_cache=p.g_cache(layer), write_pos=wp, advance_write_pos=True)
            cursors.append(wp)
        op(d(x), d(w), p.conv_state(layer), d(a), d(b), d(A_log), d(dt_bias),
           p.layer_state(layer), out, d(idx), conv_bias=d(bias), norm_weight=d(nw), z=d(z),
           **rings, **p.state_format(layer))
        outs.append(out.cpu())
    torch.cuda.synchronize()
    if replay:
        assert cursors[0].cpu().tolist() == cursors[1].tolist() == [0, 0, 2]
        for name in ("d_cache", "k_cache", "g_cache"):
            torch.testing.assert_close(getattr(pg, name)(layer).cpu(), getattr(pc, name)(layer),
                                       atol=1e-5, rtol=1e-5, msg=name)
    close2(outs[0], outs[1], (2e-4, 2e-4), "float32", "out")
    assert torch.all(outs[0][1] == 0)  # the padded row
    np.testing.assert_array_equal(bits(pg.conv_state(layer)), bits(pc.conv_state(layer)))
    check_formatted_slots(pg, pc, layer, dtype, live, live, before)
    assert pg.stochastic == (rounding == "stochastic")
    if pg.stochastic:  # one advance per call on both backends
        assert int(pg.rounding_step(layer)[0]) == 1
        assert int(pc.rounding_step(layer)[0]) == 1


# ---- ReplaySSM verify on a formatted checkpoint; verify's float source (issue #36) ------------
@pytest.mark.parametrize("exact", [False, True], ids=["basic", "exact"])
@pytest.mark.parametrize("dtype,rounding", QPREFILL_FORMATS)
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_replayssm_verify_formatted_checkpoint_cuda_matches_cpu(rng, kda, dtype, rounding, exact):
    """replayssm_verify on a quantized (or bf16 stochastic) checkpoint pool with its float rings,
    on CUDA against the CPU backend on the same pool bytes: slot 4 folds 3 records, slot 1
    appends after 2, slot 3 folds with no record (nothing stored), a padded sequence; outputs
    (2e-4), the rings (1e-5; the exact-raw ring's too), the folded slot within one quantum and
    every other slot bit for bit, the step counter one on both. Not yet run on a GPU."""
    from test_state_format import emulate, fill_sentinels, write_slot
    H, HV, K, V, L, slots, layer, seed = 2, 4, 128, 64, 8, 6, 0, 9
    kw = dict(layers=1, slots=slots, HV=HV, V=V, K=K, state_dtype=dtype, state_rounding=rounding,
              rounding_seed=seed, replay_len=L, H=H, kda=kda, ring_k_dtype="float32")
    pg, pc = ds.StatePool(device="cuda", **kw), ds.StatePool(**kw)
    live = [4, 1, 3]
    if dtype != "bfloat16":
        fill_sentinels(pg, layer)
    else:
        pg.layer_state(layer).view(torch.int16).fill_(0x5A5A)
    t = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32))  # noqa
    for s in live:
        x32 = (rng.standard_normal((HV, V, K)) * 0.4).astype(np.float32)
        if dtype != "bfloat16":
            codes, sc = emulate(x32, dtype, False)
            write_slot(pg, layer, s, codes, sc)
        else:
            pg.layer_state(layer)[s].copy_(torch.from_numpy(x32))
        pg.d_cache(layer)[s].copy_(t(HV, L, V) * 0.3)
        pg.k_cache(layer)[s].copy_(t(H, L, K) * 0.1)
        pg.g_cache(layer)[s].copy_(-t(*pg.g_cache(layer)[s].shape).abs() * 0.3)
    torch.cuda.synchronize()
    pc.storage.copy_(pg.storage.cpu())  # the same pool bytes on the CPU
    before = bits(pg.layer_state(layer))
    lens = [3, 2, 2, 3]
    Tt = sum(lens)
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    x = {"q": t(1, Tt, H, K), "k": t(1, Tt, H, K), "v": t(1, Tt, HV, V),
         "a": t(1, Tt, HV, K) if kda else t(1, Tt, HV), "b": t(1, Tt, HV),
         "A_log": torch.from_numpy(A_log.astype(np.float32)),
         "dt_bias": torch.from_numpy(dt_bias.astype(np.float32)),
         "cu": torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)}
    mem = {"idx": torch.tensor([4, -1, 1, 3], dtype=torch.int32),
           "wp": torch.tensor([0, 2, 0, 0, 3, 0], dtype=torch.int32),
           "base": torch.tensor([0, 6, 0, 1, 5, 0], dtype=torch.int32),
           "fl": torch.tensor([0, 0, 0, 1, 1, 0], dtype=torch.int32)}
    if exact:
        beta = rng.uniform(0.05, 0.95, (slots, HV, L)).astype(np.float32)
        mem.update(rawv=t(slots, HV, L, V), rawk=t(slots, H, L, K), beta=torch.from_numpy(beta))
    outs, raws = [], []
    for p, dev in ((pg, "cuda"), (pc, "cpu")):
        m = {n: y.clone().to(dev) for n, y in mem.items()}
        y = {n: u.to(dev) for n, u in x.items()}
        out = torch.full((1, Tt, HV, V), float("nan"), device=dev)
        raw = {}
        if exact:
            raw = dict(rawv_cache=m["rawv"], rawk_cache=m["rawk"], beta_cache=m["beta"])
        ds.replayssm_verify(y["q"], y["k"], y["v"], y["a"], y["b"], out, p.layer_state(layer),
                            m["idx"], p.d_cache(layer), p.k_cache(layer), p.g_cache(layer),
                            m["wp"], m["base"], m["fl"], A_log=y["A_log"], dt_bias=y["dt_bias"],
                            is_kda=kda, cu_seqlens=y["cu"], **raw, **p.state_format(layer))
        outs.append(out.cpu())
        raws.append({n: v.cpu() for n, v in m.items()})
    torch.cuda.synchronize()
    close2(outs[0], outs[1], (2e-4, 2e-4), "float32", "out")
    assert torch.all(outs[0][0, 3:5] == 0)  # the padded sequence
    # Slot 4 folds its 3 records, then its drafts (3 tokens) run from the checkpoint each backend
    # stored: their d records at (5 + 3 + t) % 8 also take what the two checkpoints' difference
    # moves them by (folded_draft_slack; 1% over it for its own rounding); every other ring
    # element to 1e-5.
    dg, dc = pg.d_cache(layer).cpu().double(), pc.d_cache(layer).double()
    draft_pos = [(5 + 3 + t) % 8 for t in range(lens[0])]
    slack = torch.from_numpy(folded_draft_slack(pg, pc, layer, dtype, 4, draft_pos, H))
    allow = 1e-5 + 1e-5 * dc[4].abs() + 2.0 ** -7 * dc[4].abs() * (dtype == "bfloat16")
    bad = (dg[4] - dc[4]).abs() > allow + slack * 1.01
    assert not bool(bad.any()), ("d_cache: slot 4's drafts", torch.nonzero(bad)[:5].tolist())
    dg[4], dc[4] = 0.0, 0.0
    torch.testing.assert_close(dg, dc, atol=1e-5, rtol=1e-5, msg="d_cache")
    for name in ("k_cache", "g_cache"):
        torch.testing.assert_close(getattr(pg, name)(layer).cpu(), getattr(pc, name)(layer),
                                   atol=1e-5, rtol=1e-5, msg=name)
    for n in raws[0]:
        torch.testing.assert_close(raws[0][n], raws[1][n], atol=1e-5, rtol=1e-5, msg=n)
    check_formatted_slots(pg, pc, layer, dtype, live, [4], before)
    if pg.stochastic:  # one advance per call on both backends
        assert int(pg.rounding_step(layer)[0]) == 1
        assert int(pc.rounding_step(layer)[0]) == 1


@pytest.mark.parametrize("source_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype,rounding", QPREFILL_FORMATS)
def test_verify_float_source_on_formatted_pool_cuda_matches_cpu(rng, dtype, rounding,
                                                                source_dtype):
    """verify with a float source_state (fp32 or bf16; FlashInfer's initial_state_source) on a
    quantized (or bf16 stochastic) pool, on CUDA against the CPU backend on the same pool bytes:
    outputs (2e-4), the stored slots within one quantum, every other slot bit for bit, the source
    untouched, the step counter one on both. Not yet run on a GPU."""
    H, HV, K, V, slots, layer, seed, T = 2, 4, 128, 64, 6, 0, 13, 3
    kw = dict(layers=1, slots=slots, HV=HV, V=V, K=K, state_dtype=dtype, state_rounding=rounding,
              rounding_seed=seed)
    pg, pc = ds.StatePool(device="cuda", **kw), ds.StatePool(**kw)
    from test_state_format import fill_sentinels
    if dtype != "bfloat16":
        fill_sentinels(pg, layer)
    else:
        pg.layer_state(layer).view(torch.int16).fill_(0x5A5A)
    torch.cuda.synchronize()
    pc.storage.copy_(pg.storage.cpu())
    before = bits(pg.layer_state(layer))
    t = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32))  # noqa
    src = (t(5, HV, V, K) * 0.5).to(getattr(torch, source_dtype))
    src_bits = bits(src).copy()
    N = 4
    q, k, v = t(N, T, H, K), t(N, T, H, K), t(N, T, HV, V)
    g = -t(N, T, HV).abs() * 0.3
    beta = torch.from_numpy(rng.uniform(0.05, 0.95, (N, T, HV)).astype(np.float32))
    outs, srcs = [], []
    for p, dev in ((pg, "cuda"), (pc, "cpu")):
        d = lambda u: u.to(dev)  # noqa: E731
        out = torch.full((N, T, HV, V), float("nan"), device=dev)
        s = d(src)
        ds.verify(d(q), d(k), d(v), d(g), d(beta), out, p.layer_state(layer),
                  d(torch.tensor([5, 1, 3, -1], dtype=torch.int32)), use_gate_in_kernel=False,
                  beta_is_logit=False, source_state=s,
                  source_state_indices=d(torch.tensor([4, -1, 1, 3], dtype=torch.int32)),
                  **p.state_format(layer))
        outs.append(out.cpu())
        srcs.append(s.cpu())
    torch.cuda.synchronize()
    close2(outs[0], outs[1], (2e-4, 2e-4), "float32", "out")
    assert torch.all(outs[0][1] == 0)  # the padded sequence
    for s in srcs:
        np.testing.assert_array_equal(bits(s), src_bits)
    check_formatted_slots(pg, pc, layer, dtype, [], [5, 3], before)
    if pg.stochastic:
        assert int(pg.rounding_step(layer)[0]) == 1
        assert int(pc.rounding_step(layer)[0]) == 1
