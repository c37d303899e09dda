"""recurrent_gated_delta_rule / recurrent_kda (FlashInfer's signature) on numpy and torch-CPU
inputs against the float64 reference: the [B, T] form and the varlen cu_seqlens form, in-pool with
ssm_state_indices (padding, envelope as_strided pools, sentinel slots), initial_state without
indices plus output_final_state, the gate in the kernel or a precomputed g, beta as a logit or a
probability, GVA, K != V, fp32/fp16/bf16."""

import numpy as np
import pytest

import deltastate as ds
import reference as ref
from cases import gate_params, make_pool, materialize_recurrent, pool_data, recurrent_data
from helpers import TOL_OUT, TOL_STATE, assert_close, bits, poison, snapshot, assert_unchanged, to64

SHAPES = [
    pytest.param(2, 4, 16, 8, id="gva2-K16-V8"),
    pytest.param(1, 3, 8, 24, id="gva3-K8-V24"),
    pytest.param(2, 2, 16, 16, id="mha-K16"),
]
DTYPES = [
    pytest.param("float32", "float32", id="f32"),
    pytest.param("float16", "float32", id="f16act"),
    pytest.param("float32", "float16", id="f16state"),
    pytest.param("bfloat16", "bfloat16", id="bf16all"),
]


def op_for(kda):
    return ds.recurrent_kda if kda else ds.recurrent_gated_delta_rule


def gate_kwargs(fw, rng, kda, HV, K, use_gate_in_kernel, lower_bound=None, dt_2d=False,
                with_dt=True):
    """A_log / dt_bias / lower_bound arguments (framework arrays) and their float64 values."""
    if not use_gate_in_kernel:
        return {}, {}
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    if dt_2d:
        dt_bias = dt_bias.reshape(HV, K)
    kw = {"A_log": fw.from64(A_log), "dt_bias": fw.from64(dt_bias) if with_dt else None,
          "lower_bound": lower_bound, "use_gate_in_kernel": True}
    kw64 = {"A_log": to64(kw["A_log"]), "dt_bias": None if not with_dt else to64(kw["dt_bias"]),
            "lower_bound": lower_bound, "use_gate_in_kernel": True}
    return kw, kw64


def check_out(o, want, act, padded_tokens=()):
    got = to64(o)
    assert not np.isnan(got).any(), "an output element was not written"
    for b, t in padded_tokens:
        assert (got[b, t] == 0).all(), "tokens of padded sequences must output zeros"
    assert_close(got, want, TOL_OUT, act, "o")


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("act,state_dtype", DTYPES)
@pytest.mark.parametrize("H,HV,K,V", SHAPES)
def test_recurrent_pooled_bt(fw, rng, kda, act, state_dtype, H, HV, K, V):
    """[B, T] form, in-pool (envelope as_strided view) with a padded row, the gate in the kernel
    and beta as a logit; the pool is updated in place and returned."""
    if not (fw.supports(act) and fw.supports(state_dtype)):
        pytest.skip("numpy has no bfloat16")
    B, T, slots = 3, 4, 6
    live = [0, 2, 3, 5]
    pool = make_pool(fw, pool_data(rng, slots, HV, V, K), state_dtype, live)
    indices = [5, -1, 2]
    d = recurrent_data(rng, kda=kda, B=B, T=T, H=H, HV=HV, K=K, V=V, use_gate_in_kernel=True,
                       beta_is_logit=True)
    x = materialize_recurrent(fw, d, act)
    gk, gk64 = gate_kwargs(fw, rng, kda, HV, K, True, dt_2d=kda and H == 2)
    idx = fw.idx(indices)
    before = pool.bits()
    start = pool.state64()
    out = poison(fw, (B, T, HV, V), act)
    o, ret = op_for(kda)(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool.view,
                         ssm_state_indices=idx, beta_is_logit=True, output_final_state=True,
                         output=out, **gk)
    assert ret is pool.view and o is out
    want_o, _, want_pool = ref.recurrent(*(to64(x[n]) for n in ("q", "k", "v", "g", "beta")),
                                         kda=kda, initial_state=start, ssm_state_indices=indices,
                                         beta_is_logit=True, **gk64)
    check_out(o, want_o, act, padded_tokens=[(1, t) for t in range(T)])
    got = pool.state64()
    for s in (5, 2):
        assert_close(got[s], want_pool[s], TOL_STATE[state_dtype], state_dtype, f"state[{s}]")
    pool.assert_untouched_outside(before, [5, 2])


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("act,state_dtype", [("float32", "float32"), ("float16", "float16"),
                                             ("bfloat16", "bfloat16")])
def test_recurrent_initial_state_and_final_state(fw, rng, kda, act, state_dtype):
    """No indices: initial_state [N, HV, V, K] is only read; output_final_state returns a new
    float32 [N, HV, V, K] of the caller's framework. Precomputed g, beta a probability, and an
    output buffer passed in (returned as is)."""
    if not (fw.supports(act) and fw.supports(state_dtype)):
        pytest.skip("numpy has no bfloat16")
    H, HV, K, V, B, T = 2, 4, 8, 16, 2, 5
    d = recurrent_data(rng, kda=kda, B=B, T=T, H=H, HV=HV, K=K, V=V, use_gate_in_kernel=False,
                       beta_is_logit=False)
    x = materialize_recurrent(fw, d, act)
    # recurrent_kda applies its compiled stride contract (base 32-byte aligned) to any state.
    init = fw.aligned(pool_data(rng, B, HV, V, K), state_dtype)
    out = poison(fw, (B, T, HV, V), act)
    snap = snapshot(init, x["q"], x["k"], x["v"], x["g"], x["beta"])
    o, final = op_for(kda)(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=init,
                           output_final_state=True, output=out)
    assert o is out
    assert_unchanged(snap, init, x["q"], x["k"], x["v"], x["g"], x["beta"], what="input")
    assert type(final) is type(init) and "float32" in str(final.dtype)
    assert tuple(final.shape) == (B, HV, V, K)
    want_o, want_final, _ = ref.recurrent(*(to64(x[n]) for n in ("q", "k", "v", "g", "beta")),
                                          kda=kda, initial_state=to64(init))
    check_out(o, want_o, act)
    assert_close(to64(final), want_final, TOL_STATE["float32"], "float32", "final_state")

    # Without output_final_state: (o, None).
    o2, none = op_for(kda)(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=init)
    assert none is None
    np.testing.assert_array_equal(bits(o2), bits(o))


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("cu_dtype", ["int32", "int64"])
def test_recurrent_varlen_pooled(fw, rng, kda, cu_dtype):
    """cu_seqlens form: q/k [1, T_total, H, K], sequences of lengths 3, 1, 0, 5, 2 (one padded,
    one empty) over an envelope pool with sentinel slots."""
    H, HV, K, V = 1, 2, 16, 8
    lens = [3, 1, 0, 5, 2]
    indices = [4, -1, 1, 0, 6]
    cu = np.concatenate([[0], np.cumsum(lens)])
    T = int(cu[-1])
    pool = make_pool(fw, pool_data(rng, 8, HV, V, K), "float32", [0, 1, 3, 4, 6])
    d = recurrent_data(rng, kda=kda, B=1, T=T, H=H, HV=HV, K=K, V=V, use_gate_in_kernel=True,
                       beta_is_logit=True)
    x = materialize_recurrent(fw, d, "float32")
    gk, gk64 = gate_kwargs(fw, rng, kda, HV, K, True)
    before = pool.bits()
    start = pool.state64()
    cu_t = fw.idx(cu, cu_dtype)
    o, ret = op_for(kda)(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool.view,
                         cu_seqlens=cu_t, ssm_state_indices=fw.idx(indices), beta_is_logit=True,
                         **gk)
    assert ret is pool.view
    want_o, _, want_pool = ref.recurrent(*(to64(x[n]) for n in ("q", "k", "v", "g", "beta")),
                                         kda=kda, initial_state=start, ssm_state_indices=indices,
                                         cu_seqlens=cu, beta_is_logit=True, **gk64)
    check_out(o, want_o, "float32", padded_tokens=[(0, t) for t in range(cu[1], cu[2])])
    got = pool.state64()
    used = [s for s in indices if s >= 0]
    for s in used:
        assert_close(got[s], want_pool[s], TOL_STATE["float32"], "float32", f"state[{s}]")
    # The empty sequence (slot 1) keeps its state bit for bit.
    np.testing.assert_array_equal(got[1], start[1])
    pool.assert_untouched_outside(before, used)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_recurrent_varlen_initial_state(fw, rng, kda):
    """cu_seqlens without a pool: initial_state [N, ...] read per sequence, final states out."""
    H, HV, K, V = 2, 4, 8, 8
    lens = [2, 4, 1]
    cu = np.concatenate([[0], np.cumsum(lens)])
    d = recurrent_data(rng, kda=kda, B=1, T=int(cu[-1]), H=H, HV=HV, K=K, V=V,
                       use_gate_in_kernel=False, beta_is_logit=True)
    x = materialize_recurrent(fw, d, "float32")
    init = fw.aligned(pool_data(rng, 3, HV, V, K))
    snap = snapshot(init)
    o, final = op_for(kda)(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=init,
                           output_final_state=True, cu_seqlens=fw.idx(cu, "int64"),
                           beta_is_logit=True)
    assert_unchanged(snap, init, what="initial_state")
    want_o, want_final, _ = ref.recurrent(*(to64(x[n]) for n in ("q", "k", "v", "g", "beta")),
                                          kda=kda, initial_state=to64(init), cu_seqlens=cu,
                                          beta_is_logit=True)
    check_out(o, want_o, "float32")
    assert_close(to64(final), want_final, TOL_STATE["float32"], "float32", "final_state")


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_recurrent_zero_state_safe_gate_strided(fw, rng, kda):
    """No initial state (S starts at 0), the safe gate (lower_bound) without dt_bias, an explicit
    scale, q/k/v as strided views into one fused buffer."""
    H, HV, K, V, B, T = 2, 4, 16, 8, 2, 3
    d = recurrent_data(rng, kda=kda, B=B, T=T, H=H, HV=HV, K=K, V=V, use_gate_in_kernel=True,
                       beta_is_logit=False)
    x = materialize_recurrent(fw, d, "float32", strided_qkv=True)
    if fw.name == "torch":
        assert not x["q"].is_contiguous()
    else:
        assert not x["q"].flags.c_contiguous
    gk, gk64 = gate_kwargs(fw, rng, kda, HV, K, True, lower_bound=-5.0, with_dt=False)
    o, final = op_for(kda)(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.2,
                           output_final_state=True, **gk)
    want_o, want_final, _ = ref.recurrent(*(to64(x[n]) for n in ("q", "k", "v", "g", "beta")),
                                          kda=kda, scale=0.2, **gk64)
    check_out(o, want_o, "float32")
    assert_close(to64(final), want_final, TOL_STATE["float32"], "float32", "final_state")
    # Neither state nor final state: (o, None), same output.
    o2, none = op_for(kda)(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.2, **gk)
    assert none is None
    np.testing.assert_array_equal(bits(o2), bits(o))


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_recurrent_no_l2norm_bf16_inputs(tfw, rng, kda):
    """use_qk_l2norm_in_kernel=False with bf16 q/k/v/beta (torch) and a bf16 dense pool."""
    H, HV, K, V, B, T = 1, 2, 16, 16, 2, 2
    pool = make_pool(tfw, pool_data(rng, 3, HV, V, K), "bfloat16", [0, 2], envelope=False)
    d = recurrent_data(rng, kda=kda, B=B, T=T, H=H, HV=HV, K=K, V=V, use_gate_in_kernel=False,
                       beta_is_logit=False)
    d["q"] *= 0.25
    d["k"] *= 0.25
    x = materialize_recurrent(tfw, d, "bfloat16")
    before = pool.bits()
    start = pool.state64()
    o, _ = op_for(kda)(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool.view,
                       ssm_state_indices=tfw.idx([2, 0], "int64"), use_qk_l2norm_in_kernel=False)
    want_o, _, want_pool = ref.recurrent(*(to64(x[n]) for n in ("q", "k", "v", "g", "beta")),
                                         kda=kda, initial_state=start, ssm_state_indices=[2, 0],
                                         use_qk_l2norm=False)
    check_out(o, want_o, "bfloat16")
    for s in (0, 2):
        assert_close(pool.state64()[s], want_pool[s], TOL_STATE["bfloat16"], "bfloat16", f"state[{s}]")
    pool.assert_untouched_outside(before, [0, 2])


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_recurrent_pdl_is_ignored_on_cpu(fw, rng, kda):
    """pdl=True (a CUDA launch attribute) changes nothing on the CPU: varlen in-pool (padded and
    empty sequences, envelope pools with sentinel slots) and a start state with final states
    out give bit-identical outputs, pools and final states to pdl=False."""
    H, HV, K, V = 2, 4, 16, 8
    lens = [3, 1, 0, 4]
    indices = [4, -1, 1, 0]
    cu = np.concatenate([[0], np.cumsum(lens)])
    data = pool_data(rng, 6, HV, V, K)
    pools = {pdl: make_pool(fw, data, "float32", [0, 1, 3, 4]) for pdl in (False, True)}
    d = recurrent_data(rng, kda=kda, B=1, T=int(cu[-1]), H=H, HV=HV, K=K, V=V,
                       use_gate_in_kernel=True, beta_is_logit=True)
    x = materialize_recurrent(fw, d, "float32")
    gk, _ = gate_kwargs(fw, rng, kda, HV, K, True, lower_bound=-5.0 if kda else None)
    outs = {}
    for pdl, pool in pools.items():
        for _ in range(2):  # twice: the second call starts from the updated pool
            o, ret = op_for(kda)(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                 initial_state=pool.view, cu_seqlens=fw.idx(cu, "int64"),
                                 ssm_state_indices=fw.idx(indices), beta_is_logit=True, pdl=pdl,
                                 **gk)
            assert ret is pool.view
        outs[pdl] = bits(o)
    np.testing.assert_array_equal(outs[True], outs[False])
    np.testing.assert_array_equal(pools[True].bits(), pools[False].bits())

    # No pool: a start state [B, HV, V, K], final states returned.
    d = recurrent_data(rng, kda=kda, B=2, T=3, H=H, HV=HV, K=K, V=V, use_gate_in_kernel=False,
                       beta_is_logit=False)
    x = materialize_recurrent(fw, d, "float32")
    init = fw.aligned(pool_data(rng, 2, HV, V, K))
    res = {}
    for pdl in (False, True):
        o, final = op_for(kda)(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=init,
                               output_final_state=True, pdl=pdl)
        res[pdl] = (bits(o), bits(final))
    for a, b in zip(res[True], res[False]):
        np.testing.assert_array_equal(a, b)
