"""Quantized state pools (float8_e4m3fn, int8 with fp32 scales per (slot, head, V row)) and
stochastic rounding, through GDN / KDA packed decode on the CPU backend (issue #36).

The op must agree bit for bit with tools/state_accuracy.py's emulation of the formats: each step
is checked against a twin run on an fp32 pool holding the dequantized state (the same fp32
arithmetic), whose new state is then rounded with the emulation's rules and random bits (key
(seed, slot, layer, step), the element's index in [HV, V, K]); the codes and the scales must be
identical. Also: the dequantized state against the fp64 reference within the format's
resolution, torch's float8_e4m3fn conversion, padded rows and unused slots (sentinel codes and
scales bit-untouched), NaN-poisoned outputs, envelope pools, the step counter, numpy pools (codes
as uint8), bf16 stochastic rounding, and fork."""

import pathlib
import sys

import numpy as np
import pytest

import deltastate as ds
import reference as ref
from cases import (gate_logits, gate_params, materialize_packed, materialize_recurrent,
                   packed_data, recurrent_data)
from helpers import Fw, bits, poison, to64, torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
import state_accuracy as sa  # noqa: E402  (the formats' numpy emulation)

QMAX = {"float8_e4m3fn": 448.0, "int8": 127.0}
SENTINEL_CODE = 0x5A
SENTINEL_SCALE = np.float32(1e30)


def op_for(kda):
    return (ds.fused_recurrent_kda_packed_decode if kda
            else ds.fused_recurrent_gated_delta_rule_packed_decode)


def codes_of(view) -> np.ndarray:
    """The pool view's codes as a numpy uint8 array [slots, HV, V, K] (any framework)."""
    return bits(view).reshape(tuple(view.shape))


def emulate(x32: np.ndarray, dtype: str, stochastic: bool, key=None):
    """tools/state_accuracy.py's rules on an fp32 state [HV, V, K] of one slot: (codes as uint8,
    scales [HV, V] fp32)."""
    HV, V, K = x32.shape
    s = sa.scales(x32, "row", QMAX[dtype])
    y = x32 / s
    U = None
    if stochastic:
        index = np.arange(HV * V * K, dtype=np.uint64).reshape(HV, V, K)
        U = sa.sr_bits(key, index)
    if dtype == "float8_e4m3fn":
        codes = sa.e4m3_bits(sa.round_e4m3(y, U))
    else:
        r = np.rint(y if U is None else y + sa.dither(U))
        codes = np.clip(r, -127, 127).astype(np.int8).view(np.uint8)
    return codes, s[..., 0]


def dequantize(codes: np.ndarray, scales: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 values code * scale (the kernels' load)."""
    if dtype == "float8_e4m3fn":
        vals = np.array([_e4m3_value(c) for c in range(256)], np.float32)[codes]
    else:
        vals = codes.view(np.int8).astype(np.float32)
    return vals * scales[..., None].astype(np.float32)


def _e4m3_value(c: int) -> float:
    e, m = (c >> 3) & 15, c & 7
    if e == 15 and m == 7:
        return np.nan
    v = m * 2.0 ** -9 if e == 0 else (8 + m) * 2.0 ** (e - 10)
    return -v if c & 0x80 else v


def write_slot(pool, layer, slot, codes, scales):
    """Codes (uint8) and scales of one slot into the pool's memory."""
    st, sc = pool.layer_state(layer), pool.layer_scales(layer)
    if pool.framework == "torch":
        st[slot].view(torch.uint8).copy_(torch.from_numpy(codes))
        sc[slot].copy_(torch.from_numpy(scales))
    else:
        st[slot] = codes.view(st.dtype)
        sc[slot] = scales


def write_random_slot(pool, layer, slot, rng, dtype, shape, scale):
    """A random state (normal times `scale`) in one slot, rounded to the pool's format to nearest
    by the emulation: its codes and scales written."""
    codes, sc = emulate((rng.standard_normal(shape) * scale).astype(np.float32), dtype, False)
    write_slot(pool, layer, slot, codes, sc)


def fill_sentinels(pool, layer):
    st, sc = pool.layer_state(layer), pool.layer_scales(layer)
    if pool.framework == "torch":
        st.view(torch.uint8).fill_(SENTINEL_CODE)
        sc.fill_(float(SENTINEL_SCALE))
    else:
        st.view(np.uint8)[...] = SENTINEL_CODE
        sc[...] = SENTINEL_SCALE


def state_bits(pool, layer):
    return codes_of(pool.layer_state(layer)), bits(pool.layer_scales(layer)).reshape(
        tuple(pool.layer_scales(layer).shape))


CASES = [  # (kda, H, HV, K, V)
    pytest.param(False, 2, 4, 16, 8, id="gdn-gva2-K16-V8"),
    pytest.param(True, 2, 2, 32, 12, id="kda-K32-V12"),
]
FORMATS = [
    pytest.param("float8_e4m3fn", None, id="fp8-sr"),  # the default: stochastic
    pytest.param("float8_e4m3fn", "nearest", id="fp8-rn"),
    pytest.param("int8", None, id="int8-rn"),  # the default: nearest
    pytest.param("int8", "stochastic", id="int8-sr"),
]


@pytest.mark.parametrize("layout", ["per_layer", "envelope"])
@pytest.mark.parametrize("dtype,rounding", FORMATS)
@pytest.mark.parametrize("kda,H,HV,K,V", CASES)
def test_packed_decode_matches_the_emulation(fw, rng, kda, H, HV, K, V, dtype, rounding, layout):
    slots, layer, seed = 7, 1, 12345
    pool = ds.StatePool(layers=2, slots=slots, HV=HV, V=V, K=K, state_dtype=dtype, layout=layout,
                        state_rounding=rounding, rounding_seed=seed, framework=fw.name,
                        envelope_extra_bytes=24 if layout == "envelope" else 0)
    stochastic = pool.stochastic
    assert stochastic == (rounding == "stochastic" or (rounding is None and dtype != "int8"))
    # the twin: an fp32 pool of the same slots holding the dequantized state
    twin = ds.StatePool(layers=1, slots=slots, HV=HV, V=V, K=K, framework=fw.name)
    fill_sentinels(pool, layer)
    live = [5, 0, 3, 6]
    for s in live:  # a quantized start state: the emulation's nearest rounding of a random one
        write_random_slot(pool, layer, s, rng, dtype, (HV, V, K), 0.5)
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    A_log_t, dt_t = fw.from64(A_log, "float32"), fw.from64(dt_bias, "float32")
    indices = [5, -1, 0, 3, 6, -1]  # padded rows; slots 1, 2, 4 unused (sentinels)
    idx = fw.idx(indices, "int32")
    kw = pool.state_format(layer)
    assert ("rounding_step" in kw) == stochastic
    for step in range(3):
        codes0, scales0 = state_bits(pool, layer)
        deq = dequantize(codes0, scales0.view(np.float32), dtype)
        tw = twin.layer_state(0)
        for s in live:
            if fw.name == "torch":
                tw[s].copy_(torch.from_numpy(deq[s]))
            else:
                tw[s] = deq[s]
        d = packed_data(rng, kda=kda, B=len(indices), H=H, HV=HV, K=K, V=V)
        x = materialize_packed(fw, d, "float32")
        out = poison(fw, (len(indices), 1, HV, V), "float32")
        out_twin = poison(fw, (len(indices), 1, HV, V), "float32")
        op_for(kda)(x["mixed_qkv"], x["a"], x["b"], A_log_t, dt_t, None, pool.layer_state(layer),
                    out, idx, True, **kw)
        op_for(kda)(x["mixed_qkv"], x["a"], x["b"], A_log_t, dt_t, None, tw, out_twin, idx, True)
        # the same fp32 arithmetic on the same dequantized state: the same outputs, bit for bit
        np.testing.assert_array_equal(bits(out), bits(out_twin))
        np.testing.assert_array_equal(to64(out)[[1, 5]], 0.0)  # padded rows
        # the fp64 reference from the dequantized start state: outputs to fp32 accuracy
        want_out, want_pool = ref.packed_decode(
            to64(x["mixed_qkv"]), to64(x["a"]), to64(x["b"]), A_log.astype(np.float32),
            dt_bias.astype(np.float32), K ** -0.5, deq.astype(np.float64), indices, kda=kda,
            use_qk_l2norm=True)
        np.testing.assert_allclose(to64(out), want_out, rtol=2e-4, atol=2e-5)
        # the stored state: the emulation's rounding of the twin's fp32 state, bit for bit
        codes1, scales1 = state_bits(pool, layer)
        new32 = to64(tw).astype(np.float32)
        for s in live:
            key = sa.sr_key(seed, s, layer, step) if stochastic else None
            want_codes, want_scales = emulate(new32[s], dtype, stochastic, key)
            np.testing.assert_array_equal(codes1[s], want_codes, err_msg=f"codes, slot {s}")
            np.testing.assert_array_equal(scales1[s], want_scales.view(np.uint32),
                                          err_msg=f"scales, slot {s}")
            # within the format's resolution of the fp64 state: nearest rounding errs by at most
            # half a quantum (int8: scale / 2; e4m3: 2^-4 relative, 2^-10 scale in subnormals),
            # stochastic by less than one
            got = dequantize(codes1[s], scales1[s].view(np.float32), dtype).astype(np.float64)
            sc = scales1[s].view(np.float32).astype(np.float64)[..., None]
            w = want_pool[s]
            if dtype == "int8":
                quantum = sc
            else:
                quantum = np.maximum(np.abs(w) * 2.0 ** -3, sc * 2.0 ** -9)
            slack = 1e-5 * sc * QMAX[dtype]  # the fp32 step's own error, relative to the amax
            bound = (quantum if stochastic else quantum / 2) * (1 + 1e-6) + slack
            assert np.all(np.abs(got - w) <= bound), f"slot {s}: off by more than the resolution"
        # unused slots (sentinels) bit-untouched, live slots rewritten
        for s in (1, 2, 4):
            assert np.all(codes1[s] == SENTINEL_CODE)
            assert np.all(scales1[s] == SENTINEL_SCALE.view(np.uint32))
        if stochastic:
            assert int(to64(kw["rounding_step"])[0]) == step + 1  # advanced once per call


def test_nearest_e4m3_matches_torch(tfw, rng):
    """The op's float8 codes (nearest rounding) are torch's float8_e4m3fn conversion of the
    scaled fp32 state."""
    HV, V, K = 2, 16, 32
    pool = ds.StatePool(layers=1, slots=2, HV=HV, V=V, K=K, state_dtype="float8_e4m3fn",
                        state_rounding="nearest")
    twin = ds.StatePool(layers=1, slots=2, HV=HV, V=V, K=K)
    A_log, dt_bias = gate_params(rng, HV, K, False)
    for step in range(4):
        twin.layer_state(0).copy_(pool.layer_state(0).float() * pool.layer_scales(0)[..., None])
        d = packed_data(rng, kda=False, B=2, H=1, HV=HV, K=K, V=V)
        x = materialize_packed(tfw, d, "float32")
        for p, kw in ((pool, pool.state_format(0)), (twin, {})):
            out = poison(tfw, (2, 1, HV, V), "float32")
            ds.fused_recurrent_gated_delta_rule_packed_decode(
                x["mixed_qkv"], x["a"], x["b"], torch.tensor(A_log, dtype=torch.float32),
                torch.tensor(dt_bias, dtype=torch.float32), None, p.layer_state(0), out,
                torch.tensor([1, 0], dtype=torch.int32), True, **kw)
        s = twin.layer_state(0).abs().amax(-1) / 448
        s = torch.where(s > 0, s, torch.ones_like(s))
        assert torch.equal(pool.layer_scales(0), s)
        theirs = (twin.layer_state(0) / s[..., None]).to(torch.float8_e4m3fn)
        assert torch.equal(pool.layer_state(0).view(torch.uint8), theirs.view(torch.uint8))


def test_bf16_stochastic_rounding(tfw, rng):
    """A bfloat16 pool with state_rounding='stochastic': the emulation's rule (16 random bits
    added below the kept mantissa, then truncated) with the same key, bit for bit."""
    HV, V, K, seed, layer = 2, 8, 16, 99, 2
    pool = ds.StatePool(layers=3, slots=3, HV=HV, V=V, K=K, state_dtype="bfloat16",
                        state_rounding="stochastic", rounding_seed=seed)
    twin = ds.StatePool(layers=1, slots=3, HV=HV, V=V, K=K)
    pool.layer_state(layer)[2].copy_(torch.randn(HV, V, K))
    A_log, dt_bias = gate_params(rng, HV, K, False)
    kw = pool.state_format(layer)
    for step in range(2):
        twin.layer_state(0).copy_(pool.layer_state(layer).float())
        d = packed_data(rng, kda=False, B=1, H=1, HV=HV, K=K, V=V)
        x = materialize_packed(tfw, d, "float32")
        for p, l, k in ((pool, layer, kw), (twin, 0, {})):
            ds.fused_recurrent_gated_delta_rule_packed_decode(
                x["mixed_qkv"], x["a"], x["b"], torch.tensor(A_log, dtype=torch.float32),
                torch.tensor(dt_bias, dtype=torch.float32), None, p.layer_state(l),
                poison(tfw, (1, 1, HV, V), "float32"), torch.tensor([2], dtype=torch.int32), True,
                **k)
        key = sa.sr_key(seed, 2, layer, step)
        index = np.arange(HV * V * K, dtype=np.uint64).reshape(HV, V, K)
        want = sa.round_bf16(twin.layer_state(0)[2].numpy(), sa.sr_bits(key, index))
        got = pool.layer_state(layer)[2].float().numpy()
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        assert int(kw["rounding_step"][0]) == step + 1


def test_numpy_pool_views(rng):
    """numpy has no float8: a numpy pool's float8 view is the codes as uint8 (the ops read a
    uint8 state as float8_e4m3fn codes); int8 is int8; the scales are float32."""
    p8 = ds.StatePool(layers=1, slots=2, HV=2, V=4, K=8, state_dtype="float8_e4m3fn",
                      framework="numpy")
    assert p8.layer_state(0).dtype == np.uint8
    assert p8.layer_scales(0).dtype == np.float32 and p8.layer_scales(0).shape == (2, 2, 4)
    assert p8.rounding_step(0).dtype == np.int64
    pi = ds.StatePool(layers=1, slots=2, HV=2, V=4, K=8, state_dtype="int8", framework="numpy")
    assert pi.layer_state(0).dtype == np.int8
    assert pi.state_format(0).keys() == {"state_scales"}


def test_fork_and_accounting(fw):
    """fork copies the codes and the scales; the byte accounting counts both."""
    pool = ds.StatePool(layers=2, slots=3, HV=2, V=4, K=32, state_dtype="int8",
                        layout="envelope", framework=fw.name)
    a, b = pool.allocate(), pool.allocate()
    for layer in range(2):
        st, sc = pool.layer_state(layer), pool.layer_scales(layer)
        st[a] = fw.from64(np.arange(2 * 4 * 32).reshape(2, 4, 32) % 200 - 100, "int8") \
            if fw.name == "torch" else (np.arange(2 * 4 * 32).reshape(2, 4, 32) % 200 - 100)
        sc[a] = 0.25 + layer
    pool.fork(a, b)
    for layer in range(2):
        np.testing.assert_array_equal(to64(pool.layer_state(layer)[b]),
                                      to64(pool.layer_state(layer)[a]))
        np.testing.assert_array_equal(to64(pool.layer_scales(layer)[b]), 0.25 + layer)
    per_slot = ds.StatePool.bytes_per_slot(2, 2, 4, 32, state_dtype="int8")
    assert per_slot == 2 * (2 * 4 * 32 + 2 * 4 * 4) + 4
    assert per_slot < ds.StatePool.bytes_per_slot(2, 2, 4, 32, state_dtype="bfloat16")


def test_uint8_state_is_float8_codes(rng):
    """A uint8 state (a numpy pool's float8 view) is read as float8_e4m3fn codes: the same
    result as the torch pool's float8 view of the same bytes."""
    if torch is None:
        pytest.skip("torch is not installed")
    HV, V, K = 2, 8, 16
    pools = [ds.StatePool(layers=1, slots=2, HV=HV, V=V, K=K, state_dtype="float8_e4m3fn",
                          state_rounding="nearest", framework=f) for f in ("numpy", "torch")]
    codes, sc = emulate(rng.standard_normal((HV, V, K)).astype(np.float32), "float8_e4m3fn",
                        False)
    write_slot(pools[0], 0, 1, codes, sc)
    write_slot(pools[1], 0, 1, codes, sc)
    A_log, dt_bias = gate_params(rng, HV, K, False)
    d = packed_data(rng, kda=False, B=1, H=1, HV=HV, K=K, V=V)
    outs = []
    for p in pools:
        fwp = Fw(p.framework)
        x = materialize_packed(fwp, d, "float32")
        out = poison(fwp, (1, 1, HV, V), "float32")
        ds.fused_recurrent_gated_delta_rule_packed_decode(
            x["mixed_qkv"], x["a"], x["b"], fwp.from64(A_log, "float32"),
            fwp.from64(dt_bias, "float32"), None, p.layer_state(0), out, fwp.idx([1], "int32"),
            True, **p.state_format(0))
        outs.append(bits(out).view(np.uint32))  # torch gives int32 bits, numpy uint32
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(codes_of(pools[0].layer_state(0)),
                                  codes_of(pools[1].layer_state(0)))


@pytest.mark.parametrize("dtype,rounding", FORMATS)
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_fused_step_on_a_quantized_pool(tfw, rng, kda, dtype, rounding):
    """The fused decode step (conv -> delta rule -> gated norm) on a quantized StatePool layer:
    against the same step on an fp32 pool holding the dequantized state (outputs and conv windows
    bit-identical), and the stored codes and scales the emulation's rounding of that pool's new
    state; padded rows and unused slots untouched."""
    H, HV, K, V, B, slots, layer, seed, width = 2, 4, 16, 8, 4, 6, 0, 3, 4
    conv_dim = 2 * H * K + HV * V
    pool = ds.StatePool(layers=1, slots=slots, HV=HV, V=V, K=K, state_dtype=dtype,
                        state_rounding=rounding, rounding_seed=seed, conv_dim=conv_dim,
                        layout="envelope")
    twin = ds.StatePool(layers=1, slots=slots, HV=HV, V=V, K=K, conv_dim=conv_dim)
    fill_sentinels(pool, layer)
    live = [4, 1, 0]
    for s in live:
        write_random_slot(pool, layer, s, rng, dtype, (HV, V, K), 0.4)
    win = torch.from_numpy(rng.standard_normal((slots, conv_dim, width - 1)).astype(np.float32))
    pool.conv_state(layer).copy_(win)
    twin.conv_state(0).copy_(win)
    t = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32))  # noqa
    A_log = torch.from_numpy(rng.uniform(-1, 0.5, HV).astype(np.float32))
    dt_bias = t(HV * K if kda else HV) * 0.5
    w, bias = t(conv_dim, width) * 0.5, t(conv_dim) * 0.2
    nw, z = torch.rand(V) + 0.5, t(B, HV, V)
    idx = torch.tensor([4, -1, 1, 0], dtype=torch.int32)
    op = ds.kda_fused_decode_step if kda else ds.gdn_fused_decode_step
    for step in range(2):
        codes0, scales0 = state_bits(pool, layer)
        deq = dequantize(codes0, scales0.view(np.float32), dtype)
        for s in live:
            twin.layer_state(0)[s].copy_(torch.from_numpy(deq[s]))
        x, a, b = t(B, conv_dim), t(B, HV * K if kda else HV), t(B, HV)
        outs = []
        for p, kw in ((pool, pool.state_format(layer)), (twin, {})):
            out = torch.full((B, HV, V), float("nan"))
            op(x, w, p.conv_state(layer if p is pool else 0), a, b, A_log, dt_bias,
               p.layer_state(layer if p is pool else 0), out, idx, conv_bias=bias,
               norm_weight=nw, z=z, **kw)
            outs.append(out)
        assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
        assert torch.all(outs[0][1] == 0)  # the padded row
        assert torch.equal(pool.conv_state(layer), twin.conv_state(0))
        codes1, scales1 = state_bits(pool, layer)
        new32 = twin.layer_state(0).numpy()
        for s in live:
            key = sa.sr_key(seed, s, layer, step) if pool.stochastic else None
            want_codes, want_scales = emulate(new32[s], dtype, pool.stochastic, key)
            np.testing.assert_array_equal(codes1[s], want_codes, err_msg=f"codes, slot {s}")
            np.testing.assert_array_equal(scales1[s], want_scales.view(np.uint32))
        for s in (2, 3, 5):
            assert np.all(codes1[s] == SENTINEL_CODE)
            assert np.all(scales1[s] == SENTINEL_SCALE.view(np.uint32))


@pytest.mark.parametrize("dtype,rounding", FORMATS)
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_fused_step_replayssm_mode_on_a_quantized_pool(tfw, rng, kda, dtype, rounding):
    """The fused step's ReplaySSM mode on a quantized StatePool layer (its rings and conv window
    in the pool): over L + 2 steps (a forced flush, natural flushes at L-1, the op advancing the
    cursors) against the unfused chain causal_conv1d_update -> replayssm_decode on a byte copy
    of the pool with the same format keywords: every byte of the two pools (codes, scales,
    rings, windows, the step counter, sentinels) and the outputs bit-identical; the flushed
    rows' scales rewritten, the padded row's output zeros, the other slots' sentinels kept."""
    H, HV, K, V, B, slots, layer, seed, width, L = 2, 4, 16, 8, 4, 6, 1, 5, 4, 3
    conv_dim = 2 * H * K + HV * V
    kw = dict(layers=2, slots=slots, HV=HV, V=V, K=K, state_dtype=dtype, state_rounding=rounding,
              rounding_seed=seed, conv_dim=conv_dim, replay_len=L, H=H, kda=kda,
              ring_k_dtype="float32")
    pool, twin = ds.StatePool(**kw), ds.StatePool(**kw)
    fill_sentinels(pool, layer)
    live = [4, 1, 0]
    for s in live:
        write_random_slot(pool, layer, s, rng, dtype, (HV, V, K), 0.4)
        pool.conv_state(layer)[s] = torch.from_numpy(
            rng.standard_normal((conv_dim, width - 1)).astype(np.float32))
        for ring, scale in ((pool.d_cache(layer), 0.2), (pool.k_cache(layer), 0.3)):
            ring[s] = torch.from_numpy((rng.standard_normal(tuple(ring.shape[1:])) * scale)
                                       .astype(np.float32))
        g = pool.g_cache(layer)
        g[s] = torch.from_numpy(-rng.uniform(0, 0.5, tuple(g.shape[1:])).astype(np.float32))
    twin.storage.copy_(pool.storage)
    t = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32))  # noqa
    A_log = torch.from_numpy(rng.uniform(-1, 0.5, HV).astype(np.float32))
    dt_bias = t(HV * K if kda else HV) * 0.5
    w, bias = t(conv_dim, width) * 0.5, t(conv_dim) * 0.2
    idx = torch.tensor([4, -1, 1, 0], dtype=torch.int32)
    wp, wp2 = torch.tensor([0, 0, 2, 1], dtype=torch.int32), torch.tensor([0, 0, 2, 1],
                                                                          dtype=torch.int32)
    op = ds.kda_fused_decode_step if kda else ds.gdn_fused_decode_step
    flushed_rows = 0
    for step in range(L + 2):
        x, a, b = t(B, conv_dim), t(B, HV * K if kda else HV), t(B, HV)
        ff = torch.tensor([0, 0, 0, 1 if step == 1 else 0], dtype=torch.int32)
        flushed = [int(idx[n]) for n in range(B)
                   if idx[n] >= 0 and (int(wp[n]) == L - 1 or int(ff[n]))]
        flushed_rows += len(flushed)
        out = torch.full((B, HV, V), float("nan"))
        op(x, w, pool.conv_state(layer), a, b, A_log, dt_bias, pool.layer_state(layer), out, idx,
           conv_bias=bias, d_cache=pool.d_cache(layer), k_cache=pool.k_cache(layer),
           g_cache=pool.g_cache(layer), write_pos=wp, force_flush=ff, advance_write_pos=True,
           **pool.state_format(layer))
        y = ds.causal_conv1d_update(x, twin.conv_state(layer), w, bias, activation="silu",
                                    conv_state_indices=idx)
        want = torch.full((B, 1, HV, V), float("nan"))
        ds.fused_recurrent_linear_replayssm_decode(
            y, a.reshape(B, HV, K) if kda else a, b, A_log,
            dt_bias.reshape(HV, K) if kda else dt_bias, None, twin.layer_state(layer),
            twin.d_cache(layer), twin.k_cache(layer), twin.g_cache(layer), want, idx, wp2, ff,
            None, True, kda, advance_write_pos=True, **twin.state_format(layer))
        assert torch.equal(out.view(torch.int32), want[:, 0].view(torch.int32)), f"step {step}"
        assert torch.all(out[1] == 0)
        np.testing.assert_array_equal(bits(pool.storage), bits(twin.storage),
                                      err_msg=f"the pools, step {step}")
        assert torch.equal(wp, wp2)
        _, scales = state_bits(pool, layer)
        for s in flushed:  # fresh scales: never the sentinel
            assert np.all(scales[s] != SENTINEL_SCALE.view(np.uint32)), f"slot {s}, step {step}"
        for s in (2, 3, 5):
            codes, scales = state_bits(pool, layer)
            assert np.all(codes[s] == SENTINEL_CODE)
            assert np.all(scales[s] == SENTINEL_SCALE.view(np.uint32))
        if pool.stochastic:
            assert int(pool.rounding_step(layer)[0]) == step + 1
            assert int(pool.rounding_step(0)[0]) == 0
    assert flushed_rows >= 3


@pytest.mark.parametrize("dtype,rounding", FORMATS)
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_replayssm_quantized_checkpoint(fw, rng, kda, dtype, rounding):
    """ReplaySSM decode with a quantized checkpoint (the pool's rings float32): against the same
    steps on an fp32 pool whose checkpoint holds the dequantized state and whose rings are
    copies: outputs, rings and cursors bit-identical; a flushed row's checkpoint the emulation's
    rounding of the fp32 pool's, every other row's codes and scales untouched."""
    H, HV, K, V, L, slots, layer, seed = 1, 2, 16, 8, 3, 5, 0, 21
    kw_pool = dict(layers=1, slots=slots, HV=HV, V=V, K=K, replay_len=L, H=H, kda=kda,
                   framework=fw.name)
    pool = ds.StatePool(state_dtype=dtype, state_rounding=rounding, rounding_seed=seed,
                        **kw_pool)
    twin = ds.StatePool(**kw_pool)
    fill_sentinels(pool, layer)
    live = [3, 0, 4]
    for s in live:
        write_random_slot(pool, layer, s, rng, dtype, (HV, V, K), 0.5)
    codes, scales = state_bits(pool, layer)
    deq = dequantize(codes, scales.view(np.float32), dtype)
    for s in live:
        fw_assign(fw, twin.layer_state(0)[s], deq[s])
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    A_log_t, dt_t = fw.from64(A_log, "float32"), fw.from64(dt_bias, "float32")
    indices = [3, -1, 0, 4]
    write_pos = [0, 0, 1, 2]
    flushes_seen = 0
    for step in range(5):
        flush_rows = [n for n, s in enumerate(indices) if s >= 0 and write_pos[n] >= L - 1]
        flushes_seen += len(flush_rows)
        d = packed_data(rng, kda=kda, B=len(indices), H=H, HV=HV, K=K, V=V)
        x = materialize_packed(fw, d, "float32")
        codes0, scales0 = state_bits(pool, layer)
        outs, wps = [], []
        for p, kw in ((pool, pool.state_format(layer)), (twin, {})):
            out = poison(fw, (len(indices), 1, HV, V), "float32")
            wp = fw.idx(write_pos)
            ds.fused_recurrent_linear_replayssm_decode(
                x["mixed_qkv"], x["a"], x["b"], A_log_t, dt_t, None, p.layer_state(0),
                p.d_cache(0), p.k_cache(0), p.g_cache(0), out, fw.idx(indices), wp,
                is_kda=kda, use_qk_l2norm_in_kernel=True, advance_write_pos=True, **kw)
            outs.append(bits(out).view(np.uint32))
            wps.append(to64(wp))
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_array_equal(wps[0], wps[1])
        for ring in ("d_cache", "k_cache", "g_cache"):
            np.testing.assert_array_equal(bits(getattr(pool, ring)(0)),
                                          bits(getattr(twin, ring)(0)))
        codes1, scales1 = state_bits(pool, layer)
        new32 = to64(twin.layer_state(0)).astype(np.float32)
        for n, s in enumerate(indices):
            if s < 0:
                continue
            if n in flush_rows:
                key = sa.sr_key(seed, s, layer, step) if pool.stochastic else None
                want_codes, want_scales = emulate(new32[s], dtype, pool.stochastic, key)
                np.testing.assert_array_equal(codes1[s], want_codes)
                np.testing.assert_array_equal(scales1[s], want_scales.view(np.uint32))
                # the fp32 pool continues from the checkpoint the quantized pool now holds
                fw_assign(fw, twin.layer_state(0)[s],
                          dequantize(codes1[s], scales1[s].view(np.float32), dtype))
            else:
                np.testing.assert_array_equal(codes1[s], codes0[s])
                np.testing.assert_array_equal(scales1[s], scales0[s])
        for s in (1, 2):
            assert np.all(codes1[s] == SENTINEL_CODE)
        write_pos = [int(w) for w in wps[0]]
    assert flushes_seen >= 3


def fw_assign(fw, dst, values32):
    if fw.name == "torch":
        dst.copy_(torch.from_numpy(np.ascontiguousarray(values32, dtype=np.float32)))
    else:
        dst[...] = values32


@pytest.mark.parametrize("dtype,rounding", FORMATS)
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_recurrent_on_a_quantized_pool(fw, rng, kda, dtype, rounding, varlen):
    """FlashInfer's recurrent_kda / recurrent_gated_delta_rule with several tokens per sequence
    on a quantized pool: the state stays fp32 through a sequence and is stored once. Against the
    same call on an fp32 pool with the dequantized state: outputs bit-identical, the stored codes
    and scales the emulation's rounding of the fp32 pool's; padded sequences and unused slots
    untouched."""
    H, HV, K, V, slots, layer, seed = 1, 2, 16, 8, 6, 0, 5
    pool = ds.StatePool(layers=1, slots=slots, HV=HV, V=V, K=K, state_dtype=dtype,
                        state_rounding=rounding, rounding_seed=seed, framework=fw.name)
    twin = ds.StatePool(layers=1, slots=slots, HV=HV, V=V, K=K, framework=fw.name)
    fill_sentinels(pool, layer)
    indices = [2, -1, 5]
    live = [2, 5]
    for s in live:
        write_random_slot(pool, layer, s, rng, dtype, (HV, V, K), 0.5)
    codes0, scales0 = state_bits(pool, layer)
    deq = dequantize(codes0, scales0.view(np.float32), dtype)
    for s in live:
        fw_assign(fw, twin.layer_state(0)[s], deq[s])
    N, T = 3, 4
    if varlen:
        lens = [3, 2, 4]
        d = recurrent_data(rng, kda=kda, B=1, T=sum(lens), H=H, HV=HV, K=K, V=V,
                           use_gate_in_kernel=False, beta_is_logit=False)
        cu = fw.idx(np.concatenate([[0], np.cumsum(lens)]))
    else:
        d = recurrent_data(rng, kda=kda, B=N, T=T, H=H, HV=HV, K=K, V=V,
                           use_gate_in_kernel=False, beta_is_logit=False)
        cu = None
    x = materialize_recurrent(fw, d, "float32")
    op = ds.recurrent_kda if kda else ds.recurrent_gated_delta_rule
    outs = []
    for p, kw in ((pool, pool.state_format(layer)), (twin, {})):
        out = poison(fw, tuple(d["v"].shape), "float32")
        op(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=p.layer_state(0),
           ssm_state_indices=fw.idx(indices), cu_seqlens=cu, output=out,
           use_qk_l2norm_in_kernel=True, **kw)
        outs.append(bits(out).view(np.uint32))
    np.testing.assert_array_equal(outs[0], outs[1])
    codes1, scales1 = state_bits(pool, layer)
    new32 = to64(twin.layer_state(0)).astype(np.float32)
    for s in live:
        key = sa.sr_key(seed, s, layer, 0) if pool.stochastic else None
        want_codes, want_scales = emulate(new32[s], dtype, pool.stochastic, key)
        np.testing.assert_array_equal(codes1[s], want_codes)
        np.testing.assert_array_equal(scales1[s], want_scales.view(np.uint32))
    for s in (0, 1, 3, 4):
        assert np.all(codes1[s] == SENTINEL_CODE)
        assert np.all(scales1[s] == SENTINEL_SCALE.view(np.uint32))


@pytest.mark.parametrize("dtype,rounding", FORMATS)
def test_recurrent_zero_length_sequence_leaves_its_slot(fw, rng, dtype, rounding):
    """A varlen sequence of no tokens on a quantized pool: its slot's codes and scales stay bit
    for bit, as the CUDA kernels leave it; its neighbours are updated. The slot's rows reach only
    0.6 of the format's range, so a store (fresh scales) would change every byte."""
    H, HV, K, V, slots, layer, seed = 1, 2, 16, 8, 6, 0, 3
    pool = ds.StatePool(layers=1, slots=slots, HV=HV, V=V, K=K, state_dtype=dtype,
                        state_rounding=rounding, rounding_seed=seed, framework=fw.name)
    fill_sentinels(pool, layer)
    for s in (1, 3, 4):
        x = (rng.standard_normal((HV, V, K)) * 0.5).astype(np.float32)
        codes, sc = emulate(x, dtype, False)
        if s == 3:  # nearest codes of 0.6 x at x's scales
            y = 0.6 * x / sc[..., None]
            codes = (sa.e4m3_bits(sa.round_e4m3(y, None)) if dtype == "float8_e4m3fn" else
                     np.clip(np.rint(y), -127, 127).astype(np.int8).view(np.uint8))
        write_slot(pool, layer, s, codes, sc)
    codes0, scales0 = state_bits(pool, layer)
    lens = [3, 0, 2]
    d = recurrent_data(rng, kda=False, B=1, T=sum(lens), H=H, HV=HV, K=K, V=V,
                       use_gate_in_kernel=False, beta_is_logit=False)
    x = materialize_recurrent(fw, d, "float32")
    ds.recurrent_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool.layer_state(0),
        ssm_state_indices=fw.idx([1, 3, 4]),
        cu_seqlens=fw.idx(np.concatenate([[0], np.cumsum(lens)])),
        output=poison(fw, tuple(d["v"].shape), "float32"), use_qk_l2norm_in_kernel=True,
        **pool.state_format(layer))
    codes1, scales1 = state_bits(pool, layer)
    np.testing.assert_array_equal(codes1[3], codes0[3])
    np.testing.assert_array_equal(scales1[3], scales0[3])
    for s in (1, 4):
        assert not np.array_equal(codes1[s], codes0[s])


@pytest.mark.parametrize("dtype,rounding", FORMATS)
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_chunked_prefill_on_a_quantized_pool(fw, rng, kda, dtype, rounding):
    """FLA's chunk_gated_delta_rule / chunk_kda on a quantized pool: initial states read
    dequantized, final states stored to output slots and checkpoints to pool slots, each with
    fresh scales (the emulation's rounding of what the same call stores into an fp32 pool holding
    the dequantized states); outputs and the dense float final_state bit-identical to that call;
    a padded sequence's, a skipped checkpoint's and unused slots' sentinels untouched."""
    H, HV, K, V, slots, layer, seed = 1, 2, 16, 16, 8, 0, 77
    pool = ds.StatePool(layers=1, slots=slots, HV=HV, V=V, K=K, state_dtype=dtype,
                        state_rounding=rounding, rounding_seed=seed, framework=fw.name)
    twin = ds.StatePool(layers=1, slots=slots, HV=HV, V=V, K=K, framework=fw.name)
    fill_sentinels(pool, layer)
    for s in (0, 2):  # the initial states read
        write_random_slot(pool, layer, s, rng, dtype, (HV, V, K), 0.5)
    codes0, scales0 = state_bits(pool, layer)
    deq = dequantize(codes0, scales0.view(np.float32), dtype)
    for s in (0, 2):
        fw_assign(fw, twin.layer_state(0)[s], deq[s])
    lengths = [130, 5, 70]
    T = sum(lengths)
    gshape = (1, T, HV, K) if kda else (1, T, HV)
    f = lambda x: fw.from64(x, "float32")  # noqa: E731
    q, k = f(rng.standard_normal((1, T, H, K))), f(rng.standard_normal((1, T, H, K)))
    v, beta = f(rng.standard_normal((1, T, HV, V))), f(rng.uniform(0.05, 0.95, (1, T, HV)))
    g = f(-rng.uniform(0.0, 0.3, gshape))
    cu = fw.idx(np.concatenate([[0], np.cumsum(lengths)]), "int64")
    op = ds.chunk_kda if kda else ds.chunk_gated_delta_rule
    outs, finals = [], []
    for p, kw in ((pool, pool.state_format(layer)), (twin, {})):
        o, final = op(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                      initial_state=p.layer_state(0), initial_state_indices=fw.idx([0, -1, 2]),
                      output_state_indices=fw.idx([3, -1, 4]), output_final_state=True,
                      state_v_first=True, checkpoint_every_n_tokens=64,
                      checkpoint_cu_starts=fw.idx([0, 2, 2, 3]),
                      checkpoint_slot_indices=fw.idx([5, -1, 6]), **kw)
        outs.append(bits(o).view(np.uint32))
        finals.append(bits(final).view(np.uint32))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(finals[0], finals[1])
    codes1, scales1 = state_bits(pool, layer)
    new32 = to64(twin.layer_state(0)).astype(np.float32)
    for s in (3, 4, 5, 6):  # final states (3, 4) and checkpoints (5, 6)
        key = sa.sr_key(seed, s, layer, 0) if pool.stochastic else None
        want_codes, want_scales = emulate(new32[s], dtype, pool.stochastic, key)
        np.testing.assert_array_equal(codes1[s], want_codes, err_msg=f"slot {s}")
        np.testing.assert_array_equal(scales1[s], want_scales.view(np.uint32))
    for s in (0, 2):  # read, not written (the final states went to 3 and 4)
        np.testing.assert_array_equal(codes1[s], codes0[s])
        np.testing.assert_array_equal(scales1[s], scales0[s])
    for s in (1, 7):
        assert np.all(codes1[s] == SENTINEL_CODE)
        assert np.all(scales1[s] == SENTINEL_SCALE.view(np.uint32))
    if pool.stochastic:
        assert int(to64(pool.rounding_step(layer))[0]) == 1


@pytest.mark.parametrize("dtype,rounding", FORMATS)
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_verify_and_commit_on_a_quantized_pool(fw, rng, kda, dtype, rounding):
    """Speculative verify on a quantized pool with a float scratch (SGLang's convention: start
    states read dequantized, each draft's state kept in fp32 scratch, no write-back), then the
    commit of the accepted drafts into the pool (every layer at once), requantized with fresh
    scales; and FlashInfer's per-token slots, each stored quantized. Against the same calls on an
    fp32 pool with the dequantized states: outputs and scratch bit-identical, every stored slot
    the emulation's rounding (the commit's key: the slot, the layer, the layer's step)."""
    H, HV, K, V, layers, slots, seed, T = 1, 2, 16, 8, 2, 7, 11, 3
    pool = ds.StatePool(layers=layers, slots=slots, HV=HV, V=V, K=K, state_dtype=dtype,
                        state_rounding=rounding, rounding_seed=seed, framework=fw.name)
    twin = ds.StatePool(layers=layers, slots=slots, HV=HV, V=V, K=K, framework=fw.name)
    for layer in range(layers):
        fill_sentinels(pool, layer)
    live = [4, 1]
    for layer in range(layers):
        for s in live:
            write_random_slot(pool, layer, s, rng, dtype, (HV, V, K), 0.5)
        c, sc = state_bits(pool, layer)
        deq = dequantize(c, sc.view(np.float32), dtype)
        for s in live:
            fw_assign(fw, twin.layer_state(layer)[s], deq[s])
    N = 3
    indices = fw.idx([4, -1, 1])
    gshape = (N, T, HV, K) if kda else (N, T, HV)
    f = lambda x: fw.from64(x, "float32")  # noqa: E731
    scratch = {p: [fw.full((N, T, HV, V, K), 7.0, "float32") for _ in range(layers)]
               for p in ("q", "t")}
    for layer in range(layers):
        q, k = f(rng.standard_normal((N, T, H, K))), f(rng.standard_normal((N, T, H, K)))
        v, beta = f(rng.standard_normal((N, T, HV, V))), f(rng.uniform(0.05, 0.95, (N, T, HV)))
        g = f(-rng.uniform(0.0, 0.3, gshape))
        outs = []
        for name, p, kw in (("q", pool, pool.state_format(layer)), ("t", twin, {})):
            out = poison(fw, (N, T, HV, V), "float32")
            ds.verify(q, k, v, g, beta, out, p.layer_state(layer), indices, is_kda=kda,
                      use_gate_in_kernel=False, beta_is_logit=False, update_state=False,
                      intermediate_states=scratch[name][layer], **kw)
            outs.append(bits(out).view(np.uint32))
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_array_equal(bits(scratch["q"][layer]), bits(scratch["t"][layer]))
        if pool.stochastic:  # verify advanced its layer's step
            assert int(to64(pool.rounding_step(layer))[0]) == 1
    # the commit of every layer: request 0 accepted 2 drafts into slot 4, request 2 three
    # into slot 6 (a fresh slot), the padded request nothing
    stack = lambda xs: (torch.stack(xs) if fw.name == "torch" else np.stack(xs))  # noqa: E731
    inter = stack(scratch["q"])  # [layers, N, T, HV, V, K]
    before = [state_bits(pool, layer) for layer in range(layers)]
    steps0 = to64(pool.rounding_steps()).copy() if pool.stochastic else None
    ds.update_state_after_verify(pool.states(), inter, fw.idx([4, -1, 6]), fw.idx([2, 0, 3]),
                                 **pool.state_format())
    inter32 = to64(inter).astype(np.float32)
    for layer in range(layers):
        codes1, scales1 = state_bits(pool, layer)
        for b, slot, a in ((0, 4, 2), (2, 6, 3)):
            key = sa.sr_key(seed, slot, layer, int(steps0[layer])) if pool.stochastic else None
            want_codes, want_scales = emulate(inter32[layer, b, a - 1], dtype, pool.stochastic,
                                              key)
            np.testing.assert_array_equal(codes1[slot], want_codes, err_msg=f"{layer}, {slot}")
            np.testing.assert_array_equal(scales1[slot], want_scales.view(np.uint32))
        for s in (0, 1, 2, 3, 5):  # not committed to: as before
            np.testing.assert_array_equal(codes1[s], before[layer][0][s])
            np.testing.assert_array_equal(scales1[s], before[layer][1][s])
    if pool.stochastic:
        np.testing.assert_array_equal(to64(pool.rounding_steps()), steps0 + 1)

    # FlashInfer's per-token slots: the state after token t to slot token_slots[n, t]
    layer = 1
    tok = fw.idx([[0, 2, 3], [-1, -1, -1], [5, -1, 6]])
    q, k = f(rng.standard_normal((N, T, H, K))), f(rng.standard_normal((N, T, H, K)))
    v, beta = f(rng.standard_normal((N, T, HV, V))), f(rng.uniform(0.05, 0.95, (N, T, HV)))
    g = f(-rng.uniform(0.0, 0.3, gshape))
    c, sc = state_bits(pool, layer)
    deq = dequantize(c, sc.view(np.float32), dtype)
    for s in (4, 1):
        fw_assign(fw, twin.layer_state(layer)[s], deq[s])
    step = int(to64(pool.rounding_step(layer))[0]) if pool.stochastic else 0
    outs = []
    for p, kw in ((pool, pool.state_format(layer)), (twin, {})):
        out = poison(fw, (N, T, HV, V), "float32")
        ds.verify(q, k, v, g, beta, out, p.layer_state(layer), indices, is_kda=kda,
                  use_gate_in_kernel=False, beta_is_logit=False, token_state_indices=tok, **kw)
        outs.append(bits(out).view(np.uint32))
    np.testing.assert_array_equal(outs[0], outs[1])
    codes1, scales1 = state_bits(pool, layer)
    new32 = to64(twin.layer_state(layer)).astype(np.float32)
    for s in (0, 2, 3, 5, 6):
        key = sa.sr_key(seed, s, layer, step) if pool.stochastic else None
        want_codes, want_scales = emulate(new32[s], dtype, pool.stochastic, key)
        np.testing.assert_array_equal(codes1[s], want_codes, err_msg=f"slot {s}")
        np.testing.assert_array_equal(scales1[s], want_scales.view(np.uint32))


def _replay_rings(fw, rng, slots, H, HV, K, V, L, kda, exact):
    """Random committed ReplaySSM rings (fp32, numpy): d, k, g, and with `exact` the exact-raw
    ring's raw v, raw k and beta."""
    r = {"d": rng.standard_normal((slots, HV, L, V)) * 0.2,
         "k": rng.standard_normal((slots, H, L, K)) * 0.3,
         "g": -rng.uniform(0.0, 0.5, (slots, HV, L, K) if kda else (slots, HV, L))}
    if exact:
        r["rawv"] = rng.standard_normal((slots, HV, L, V))
        r["rawk"] = rng.standard_normal((slots, H, L, K))
        r["beta"] = rng.uniform(0.05, 0.95, (slots, HV, L))
    return {n: x.astype(np.float32) for n, x in r.items()}


@pytest.mark.parametrize("ring", ["basic", "exact"])
@pytest.mark.parametrize("dtype,rounding", FORMATS)
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_replayssm_verify_quantized_checkpoint(fw, rng, kda, dtype, rounding, ring):
    """ReplaySSM speculative verify with a quantized checkpoint (float rings; the exact-raw ring
    too), five steps from random cursors with folds, the odd steps as two calls (rows append,
    then fold). Against an fp32 twin checkpoint holding the dequantized state: a fold-only call
    gives the folded fp32 state, whose emulated rounding (key: the slot, the layer, the call's
    step) must be the pool's codes and scales; a second twin call from that stored checkpoint
    (the folding rows' cursors moved past their records) gives the outputs and ring records,
    which must be the pool's bit for bit (the drafts of a folding row run from the checkpoint as
    stored). Every other slot's codes and scales untouched (sentinels included), outputs
    NaN-poisoned before, the step counter one on per step (split or not)."""
    H, HV, K, V, L, T, slots, layer, seed = 1, 2, 16, 8, 8, 3, 6, 0, 23
    exact = ring == "exact"
    pool = ds.StatePool(layers=1, slots=slots, HV=HV, V=V, K=K, state_dtype=dtype,
                        state_rounding=rounding, rounding_seed=seed, framework=fw.name)
    fill_sentinels(pool, layer)
    indices = [3, -1, 0, 4]
    live = [s for s in indices if s >= 0]
    for s in live:
        write_random_slot(pool, layer, s, rng, dtype, (HV, V, K), 0.5)
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    f = lambda x: fw.from64(np.asarray(x, np.float64), "float32")  # noqa: E731
    A_log_t, dt_t = f(A_log), f(dt_bias)
    idx = fw.idx(indices)
    folds = 0
    for step in range(5):
        split = step % 2 == 1
        wp = np.zeros(slots, np.int64)
        base = np.zeros(slots, np.int64)
        flush = np.zeros(slots, np.int64)
        for s in live:
            wp[s] = rng.integers(0, L - T + 1)  # every draft's record fits the ring
            base[s] = rng.integers(0, L)
            flush[s] = int(rng.random() < 0.5)
        flush[live[0]], wp[live[0]] = 1, max(wp[live[0]], 1)  # a fold with records every step
        folding = [s for s in live if flush[s] and wp[s] > 0]
        folds += len(folding)
        rings = _replay_rings(fw, rng, slots, H, HV, K, V, L, kda, exact)
        lens = rng.integers(1, T + 1, len(indices))
        Tt = int(lens.sum())
        x = {"q": rng.standard_normal((1, Tt, H, K)), "k": rng.standard_normal((1, Tt, H, K)),
             "v": rng.standard_normal((1, Tt, HV, V)),
             "a": gate_logits(rng, (1, Tt, HV, K) if kda else (1, Tt, HV)),
             "b": rng.standard_normal((1, Tt, HV))}
        x = {n: f(v) for n, v in x.items()}
        cu = fw.idx(np.concatenate([[0], np.cumsum(lens)]))
        codes0, scales0 = state_bits(pool, layer)
        deq = dequantize(codes0, scales0.view(np.float32), dtype)
        step0 = int(to64(pool.rounding_step(layer))[0]) if pool.stochastic else 0

        def call(ck, rg, cursors, out, rows=0, **kw):
            raw = {}
            if exact:
                raw = dict(rawv_cache=rg["rawv"], rawk_cache=rg["rawk"], beta_cache=rg["beta"])
            ds.replayssm_verify(x["q"], x["k"], x["v"], x["a"], x["b"], out, ck, idx, rg["d"],
                                rg["k"], rg["g"], *(fw.idx(c) for c in cursors), A_log=A_log_t,
                                dt_bias=dt_t, is_kda=kda, cu_seqlens=cu, rows=rows, **raw, **kw)

        # the quantized pool: one call, or append then fold
        rq = {n: f(v) for n, v in rings.items()}
        out_q = poison(fw, (1, Tt, HV, V), "float32")
        if split:
            for rows in (1, 2):
                call(pool.layer_state(layer), rq, (wp, base, flush), out_q, rows,
                     **pool.state_format(layer))
        else:
            call(pool.layer_state(layer), rq, (wp, base, flush), out_q,
                 **pool.state_format(layer))
        codes1, scales1 = state_bits(pool, layer)
        if pool.stochastic:
            assert int(to64(pool.rounding_step(layer))[0]) == step0 + 1

        # the twin: the fold alone, then the step from the checkpoint the pool now holds
        ck = fw.full((slots, HV, V, K), 0.0, "float32")
        for s in live:
            fw_assign(fw, ck[s], deq[s])
        rt = {n: f(v) for n, v in rings.items()}
        call(ck, rt, (wp, base, flush), poison(fw, (1, Tt, HV, V), "float32"), rows=2)
        folded32 = to64(ck).astype(np.float32)
        for s in live:
            if s in folding:
                key = sa.sr_key(seed, s, layer, step0) if pool.stochastic else None
                want_codes, want_scales = emulate(folded32[s], dtype, pool.stochastic, key)
                np.testing.assert_array_equal(codes1[s], want_codes, err_msg=f"slot {s}")
                np.testing.assert_array_equal(scales1[s], want_scales.view(np.uint32))
                fw_assign(fw, ck[s], dequantize(codes1[s], scales1[s].view(np.float32), dtype))
            else:
                np.testing.assert_array_equal(codes1[s], codes0[s], err_msg=f"slot {s}")
                np.testing.assert_array_equal(scales1[s], scales0[s])
        for s in (1, 2, 5):  # never live: sentinel codes and scales
            assert np.all(codes1[s] == SENTINEL_CODE)
            np.testing.assert_array_equal(scales1[s].view(np.float32),
                                          np.full((HV, V), SENTINEL_SCALE))
        wp2, base2, flush2 = wp.copy(), base.copy(), flush.copy()
        for s in folding:
            wp2[s], base2[s], flush2[s] = 0, (base[s] + wp[s]) % L, 0
        out_t = poison(fw, (1, Tt, HV, V), "float32")
        call(ck, rt, (wp2, base2, flush2), out_t)
        np.testing.assert_array_equal(bits(out_q).view(np.uint32), bits(out_t).view(np.uint32))
        for n in rq:
            np.testing.assert_array_equal(bits(rq[n]), bits(rt[n]), err_msg=f"{n} ring")
    assert folds >= 5


@pytest.mark.parametrize("source_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype,rounding", FORMATS)
def test_verify_source_state_on_a_quantized_pool(fw, rng, dtype, rounding, source_dtype):
    """Verify with FlashInfer's read-only source pool (source_state, a float pool of any float
    dtype) and a quantized `state`: sequence n starts from source row source_state_indices[n]
    (< 0: padded), its final state is stored through the pool's format at state_indices[n]
    (< 0: not stored). Against the same call on an fp32 pool: outputs bit-identical, each stored
    slot the emulation's rounding of the fp32 pool's (key: the slot, the layer, the step), every
    other slot untouched, the source bit-untouched, the step counter one on."""
    if not fw.supports(source_dtype):
        pytest.skip("numpy has no bfloat16")
    H, HV, K, V, slots, N0, T, layer, seed = 1, 2, 16, 8, 6, 5, 3, 0, 31
    pool = ds.StatePool(layers=1, slots=slots, HV=HV, V=V, K=K, state_dtype=dtype,
                        state_rounding=rounding, rounding_seed=seed, framework=fw.name)
    twin = ds.StatePool(layers=1, slots=slots, HV=HV, V=V, K=K, framework=fw.name)
    fill_sentinels(pool, layer)
    for s in (0, 2):  # live pool slots the call must leave alone
        write_random_slot(pool, layer, s, rng, dtype, (HV, V, K), 0.5)
    source = fw.from64(rng.standard_normal((N0, HV, V, K)) * 0.5, source_dtype)
    source_bits = bits(source).copy()
    # the fp32 twin reads the same values (a bf16 source is exact in fp32)
    source32 = fw.from64(to64(source), "float32")
    src_idx = fw.idx([4, -1, 1, 3])
    home = [5, 1, 3, -1]  # sequence 3 is not stored; sequence 1 is padded (nothing stored)
    N = len(home)
    f = lambda x: fw.from64(x, "float32")  # noqa: E731
    q, k = f(rng.standard_normal((N, T, H, K))), f(rng.standard_normal((N, T, H, K)))
    v, beta = f(rng.standard_normal((N, T, HV, V))), f(rng.uniform(0.05, 0.95, (N, T, HV)))
    g = f(-rng.uniform(0.0, 0.3, (N, T, HV)))
    codes0, scales0 = state_bits(pool, layer)
    outs = []
    for p, src, kw in ((pool, source, pool.state_format(layer)), (twin, source32, {})):
        out = poison(fw, (N, T, HV, V), "float32")
        ds.verify(q, k, v, g, beta, out, p.layer_state(layer), fw.idx(home),
                  use_gate_in_kernel=False, beta_is_logit=False, source_state=src,
                  source_state_indices=src_idx, **kw)
        outs.append(bits(out).view(np.uint32))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(bits(source), source_bits)
    codes1, scales1 = state_bits(pool, layer)
    new32 = to64(twin.layer_state(layer)).astype(np.float32)
    for s in range(slots):
        if s in (5, 3):
            key = sa.sr_key(seed, s, layer, 0) if pool.stochastic else None
            want_codes, want_scales = emulate(new32[s], dtype, pool.stochastic, key)
            np.testing.assert_array_equal(codes1[s], want_codes, err_msg=f"slot {s}")
            np.testing.assert_array_equal(scales1[s], want_scales.view(np.uint32))
        else:
            np.testing.assert_array_equal(codes1[s], codes0[s], err_msg=f"slot {s}")
            np.testing.assert_array_equal(scales1[s], scales0[s])
    if pool.stochastic:
        assert int(to64(pool.rounding_step(layer))[0]) == 1
