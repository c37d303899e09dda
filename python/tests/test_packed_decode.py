"""GDN / KDA packed decode (SGLang's `fused_recurrent_gated_delta_rule_packed_decode` and
`fused_recurrent_kda_packed_decode`) on numpy and torch-CPU inputs against the float64
reference: GVA, K != V, padding rows, envelope pools as as_strided views updated in place,
sentinel slots bit-untouched, outputs poisoned with NaN, fp32/fp16 (and bf16 through torch)."""

import numpy as np
import pytest

import deltastate as ds
import reference as ref
from cases import gate_params, make_pool, materialize_packed, packed_data, pool_data
from helpers import TOL_OUT, TOL_STATE, Fw, assert_close, bits, poison, to64, torch

# (H, HV, K, V, lower_bound (KDA only), index dtype)
SHAPES = [
    pytest.param(2, 4, 16, 8, None, "int32", id="gva2-K16-V8"),
    pytest.param(1, 3, 8, 24, -5.0, "int64", id="gva3-K8-V24-lb"),
    pytest.param(2, 2, 32, 16, -2.5, "int32", id="mha-K32-V16-lb"),
]
# (activation dtype, state dtype)
DTYPES = [
    pytest.param("float32", "float32", id="f32"),
    pytest.param("float16", "float32", id="f16act"),
    pytest.param("float32", "float16", id="f16state"),
    pytest.param("bfloat16", "float32", id="bf16act"),
    pytest.param("bfloat16", "bfloat16", id="bf16all"),
]


def op_for(kda):
    return (ds.fused_recurrent_kda_packed_decode if kda
            else ds.fused_recurrent_gated_delta_rule_packed_decode)


def run_step(fw, rng, pool, *, kda, H, HV, K, V, act, indices, index_dtype="int32",
             lower_bound=None, scale=None, A_log=None, dt_bias=None, row_pad=0,
             use_l2=True, round_beta=False, ref_pool=None):
    """One decode step on `pool` (a PoolBuf): run the op and the reference, check everything.
    Returns the reference pool after the step (float64)."""
    B = len(indices)
    d = packed_data(rng, kda=kda, B=B, H=H, HV=HV, K=K, V=V)
    x = materialize_packed(fw, d, act, row_pad=row_pad)
    A_log_t = fw.from64(A_log, "float32")
    dt_t = fw.from64(dt_bias, "float32")
    idx = fw.idx(indices, index_dtype)
    out = poison(fw, (B, 1, HV, V), act)
    scale = K ** -0.5 if scale is None else scale
    before = pool.bits()
    start = pool.state64() if ref_pool is None else ref_pool

    kwargs = {"lower_bound": lower_bound} if kda else {}
    if round_beta:
        kwargs["round_beta"] = True
    res = op_for(kda)(x["mixed_qkv"], x["a"], x["b"], A_log_t, dt_t, scale, pool.view, out, idx,
                      use_l2, **kwargs)
    assert res[0] is out and res[1] is pool.view

    want_out, want_pool = ref.packed_decode(
        to64(x["mixed_qkv"]), to64(x["a"]), to64(x["b"]), to64(A_log_t), to64(dt_t), scale, start,
        indices, kda=kda, lower_bound=lower_bound if kda else None, use_qk_l2norm=use_l2,
        beta_dtype=act if round_beta else None)
    got_out = to64(out)
    padded = [n for n, s in enumerate(indices) if s < 0]
    assert not np.isnan(got_out).any(), "an output element was not written"
    assert (got_out[padded] == 0).all(), "padded rows must output zeros"
    assert_close(got_out, want_out, TOL_OUT, act, "out")
    used = [s for s in indices if s >= 0]
    got_pool = pool.state64()
    for s in used:
        assert_close(got_pool[s], want_pool[s], TOL_STATE[pool.dtype], pool.dtype, f"state[{s}]")
    pool.assert_untouched_outside(before, used)
    return want_pool


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("act,state_dtype", DTYPES)
@pytest.mark.parametrize("H,HV,K,V,lb,index_dtype", SHAPES)
@pytest.mark.parametrize("envelope", [True, False], ids=["envelope", "dense"])
def test_packed_decode_matches_reference(fw, rng, kda, act, state_dtype, H, HV, K, V, lb,
                                         index_dtype, envelope):
    if not (fw.supports(act) and fw.supports(state_dtype)):
        pytest.skip("numpy has no bfloat16")
    slots = 7
    live = [1, 2, 4, 5]  # slots 0, 3, 6 stay sentinels
    pool = make_pool(fw, pool_data(rng, slots, HV, V, K), state_dtype, live, envelope=envelope)
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    lower_bound = lb if kda else None
    # Three steps: the state carries over; rows padded in different places each step.
    steps = [[4, -1, 1, 2], [2, 5, 4, -1], [-1, 1, -1, 5]]
    ref_pool = None
    for indices in steps:
        want = run_step(fw, rng, pool, kda=kda, H=H, HV=HV, K=K, V=V, act=act, indices=indices,
                        index_dtype=index_dtype, lower_bound=lower_bound, A_log=A_log,
                        dt_bias=dt_bias, ref_pool=ref_pool)
        # float32 pools: the reference runs on its own; reduced-precision pools restart from the
        # stored (rounded) state each step, so one step's rounding is checked at a time.
        ref_pool = want if state_dtype == "float32" else None


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_packed_decode_strided_rows_and_options(fw, rng, kda):
    """mixed_qkv / a / b with a row stride larger than their width (any row stride is allowed),
    an explicit scale, the L2 norm off, int64 indices."""
    H, HV, K, V = 2, 4, 8, 16
    pool = make_pool(fw, pool_data(rng, 5, HV, V, K), "float32", [0, 3, 4], envelope=True)
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    run_step(fw, rng, pool, kda=kda, H=H, HV=HV, K=K, V=V, act="float32", indices=[3, -1, 0],
             index_dtype="int64", A_log=A_log, dt_bias=dt_bias, row_pad=5, scale=0.3,
             use_l2=False, lower_bound=-5.0 if kda else None)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_packed_decode_round_beta(tfw, rng, kda):
    """round_beta rounds sigmoid(b) to b's dtype (for parity with ReplaySSM, which rounds it so)."""
    H, HV, K, V = 1, 2, 16, 16
    pool = make_pool(tfw, pool_data(rng, 3, HV, V, K), "float32", [1, 2])
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    run_step(tfw, rng, pool, kda=kda, H=H, HV=HV, K=K, V=V, act="bfloat16", indices=[2, 1],
             A_log=A_log, dt_bias=dt_bias, round_beta=True)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_packed_decode_all_padded_and_empty(fw, rng, kda):
    H, HV, K, V = 1, 2, 8, 8
    pool = make_pool(fw, pool_data(rng, 3, HV, V, K), "float32", [0, 1, 2])
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    run_step(fw, rng, pool, kda=kda, H=H, HV=HV, K=K, V=V, act="float32", indices=[-1, -1],
             A_log=A_log, dt_bias=dt_bias)
    # B = 0: nothing to do, nothing written.
    before = pool.bits()
    d = packed_data(rng, kda=kda, B=0, H=H, HV=HV, K=K, V=V)
    x = materialize_packed(fw, d, "float32")
    out = poison(fw, (0, 1, HV, V), "float32")
    op_for(kda)(x["mixed_qkv"], x["a"], x["b"], fw.from64(A_log), fw.from64(dt_bias), K ** -0.5,
                pool.view, out, fw.idx([]))
    pool.assert_untouched_outside(before, [])


@pytest.mark.parametrize("act", ["bfloat16", "float16"])
def test_packed_decode_qwen3_next_shape(rng, act):
    """Qwen3-Next per-rank shape (H=16, HV=32, K=V=128), small batch, float32 envelope pool;
    bf16 through torch, fp16 through numpy."""
    if act == "bfloat16" and torch is None:
        pytest.skip("bfloat16 needs torch")
    fw = Fw("torch") if act == "bfloat16" else Fw("numpy")
    H, HV, K, V = 16, 32, 128, 128
    pool = make_pool(fw, pool_data(rng, 4, HV, V, K, scale=0.1), "float32", [1, 2, 3])
    A_log, dt_bias = gate_params(rng, HV, K, False)
    want = run_step(fw, rng, pool, kda=False, H=H, HV=HV, K=K, V=V, act=act, indices=[3, -1, 1],
                    A_log=A_log, dt_bias=dt_bias)
    run_step(fw, rng, pool, kda=False, H=H, HV=HV, K=K, V=V, act=act, indices=[1, 3, 2],
             A_log=A_log, dt_bias=dt_bias, ref_pool=want)


def test_packed_decode_kimi_shape_safe_gate(tfw, rng):
    """KDA at head_dim 128 with the safe gate (lower_bound -5, as Kimi-K3), bf16 activations."""
    H = HV = 4
    K = V = 128
    pool = make_pool(tfw, pool_data(rng, 3, HV, V, K, scale=0.1), "float32", [0, 2])
    A_log, dt_bias = gate_params(rng, HV, K, True)
    run_step(tfw, rng, pool, kda=True, H=H, HV=HV, K=K, V=V, act="bfloat16", indices=[2, 0],
             A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_packed_decode_pdl_is_ignored_on_cpu(fw, rng, kda):
    """pdl=True (programmatic dependent launch, a CUDA launch attribute) changes nothing on the
    CPU: over several steps on twin envelope pools, outputs and pools (envelope gaps and sentinel
    slots included) are bit-identical to pdl=False."""
    H, HV, K, V = 2, 4, 16, 8
    data = pool_data(rng, 6, HV, V, K)
    live = [0, 2, 3, 5]
    pools = {pdl: make_pool(fw, data, "float32", live) for pdl in (False, True)}
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    kwargs = {"lower_bound": -5.0} if kda else {}
    for indices in ([5, -1, 2, 0], [2, 3, -1, 5], [0, 5, 3, 2]):
        d = packed_data(rng, kda=kda, B=len(indices), H=H, HV=HV, K=K, V=V)
        outs = {}
        for pdl, pool in pools.items():
            x = materialize_packed(fw, d, "float32")
            out = poison(fw, (len(indices), 1, HV, V), "float32")
            res = op_for(kda)(x["mixed_qkv"], x["a"], x["b"], fw.from64(A_log),
                              fw.from64(dt_bias), K ** -0.5, pool.view, out, fw.idx(indices),
                              pdl=pdl, **kwargs)
            assert res[0] is out and res[1] is pool.view
            outs[pdl] = bits(out)
        np.testing.assert_array_equal(outs[True], outs[False])
        np.testing.assert_array_equal(pools[True].bits(), pools[False].bits())
    with pytest.raises(TypeError):  # keyword-only
        op_for(kda)(x["mixed_qkv"], x["a"], x["b"], fw.from64(A_log), fw.from64(dt_bias),
                    K ** -0.5, pools[True].view, out, fw.idx(indices), True,
                    *((-5.0,) if kda else ()), True)
