"""Bad inputs: contract violations raise ValueError with the core's exact texts (SGLang's and
FlashInfer's), a rejected call changes no caller memory, and wrong Python types or missing arguments raise
TypeError/ValueError (never a crash)."""

import numpy as np
import pytest

import deltastate as ds
from helpers import Fw, assert_unchanged, poison, snapshot, to64, torch

B, H, HV, K, V, S, L = 3, 2, 4, 8, 16, 5, 4
W = 2 * H * K + HV * V  # 96


def strided_last(fw, arr_shape, dtype="float32"):
    """An array of `arr_shape` whose last dim has stride 2."""
    shape = tuple(arr_shape[:-1]) + (arr_shape[-1] * 2,)
    full = fw.full(shape, 0.5, dtype)
    return full[..., ::2]


def packed_args(fw, rng, kda):
    return {
        "mixed_qkv": fw.from64(rng.standard_normal((B, W))),
        "a": fw.from64(rng.standard_normal((B, HV * K if kda else HV))),
        "b": fw.from64(rng.standard_normal((B, HV))),
        "A_log": fw.from64(rng.standard_normal(HV)),
        "dt_bias": fw.from64(rng.standard_normal(HV * K if kda else HV)),
        "scale": K ** -0.5,
        "initial_state": fw.from64(rng.standard_normal((S, HV, V, K))),
        "out": poison(fw, (B, 1, HV, V), "float32"),
        "ssm_state_indices": fw.idx([1, -1, 3]),
    }


def call_packed(kda, args):
    op = (ds.fused_recurrent_kda_packed_decode if kda
          else ds.fused_recurrent_gated_delta_rule_packed_decode)
    return op(**args)


def torch_dtypes(message):
    """`message` with its dtype names as torch prints them (the ops print a caller's dtypes the
    way its framework does)."""
    import re

    return re.sub(r"\b(float32|bfloat16|float16|float64|int32|int64)\b", r"torch.\1", message)


def spelled(fw, message):
    """The text for `fw`'s arrays: numpy's dtype spelling as written, torch's with "torch."."""
    return torch_dtypes(message) if fw.name == "torch" else message


def expect_error(call, args, message, exc=ValueError):
    """`call(args)` raises `exc` whose text is exactly `message`, and no array changed."""
    arrays = [v for v in args.values() if hasattr(v, "shape")]
    before = snapshot(*arrays)
    with pytest.raises(exc) as info:
        call(args)
    assert str(info.value) == message
    assert_unchanged(before, *arrays, what="array argument of a rejected call")


# (id, mutation(fw, args, kda) -> None, GDN message, KDA message)
PACKED_CASES = [
    ("qkv-3d", lambda fw, a, kda: a.update(mixed_qkv=a["mixed_qkv"].reshape(B, 1, W)),
     "`mixed_qkv` must be a 2D tensor (got ndim=3).", None),
    ("qkv-last-stride", lambda fw, a, kda: a.update(mixed_qkv=strided_last(fw, (B, W))),
     "`mixed_qkv` must be contiguous in the last dim. `mixed_qkv` has strides (192, 2); expected a "
     "last stride of 1.", None),
    ("a-3d", lambda fw, a, kda: a.update(a=a["a"].reshape(B, 1, -1)),
     "`a` and `b` must be 2D tensors (got a.ndim=3, b.ndim=2).", None),
    ("b-last-stride", lambda fw, a, kda: a.update(b=strided_last(fw, (B, HV))),
     "`a`/`b` must be contiguous in the last dim. `b` has strides (8, 2); expected a last stride "
     "of 1.", None),
    ("A_log-2d", lambda fw, a, kda: a.update(A_log=a["A_log"].reshape(1, HV)),
     "`A_log`/`dt_bias` must be 1D tensors.", None),
    ("dt_bias-strided", lambda fw, a, kda: a.update(dt_bias=strided_last(fw, (HV * K if kda else HV,))),
     "`A_log`/`dt_bias` must be contiguous. `dt_bias` has strides (2,) for shape (4,); expected "
     "(1,).", "`A_log`/`dt_bias` must be contiguous. `dt_bias` has strides (2,) for shape (32,); "
     "expected (1,)."),
    ("indices-2d", lambda fw, a, kda: a.update(ssm_state_indices=fw.idx([[1, -1, 3]])),
     "`ssm_state_indices` must be 1D for packed decode (got ndim=2).", None),
    ("out-noncontiguous", lambda fw, a, kda: a.update(
        out=fw.as_strided(fw.full((B * HV * V * 2,), 0.0), (B, 1, HV, V), (HV * V * 2, 1, V * 2, 2))),
     "`out` must be contiguous. `out` has strides (128, 1, 32, 2) for shape (3, 1, 4, 16); "
     "expected (64, 64, 16, 1).", None),
    ("batch-mismatch", lambda fw, a, kda: a.update(a=a["a"][:2]),
     "Mismatched batch sizes: mixed_qkv.shape[0]=3, a.shape[0]=2, b.shape[0]=3.", None),
    ("indices-length", lambda fw, a, kda: a.update(ssm_state_indices=fw.idx([1, 2])),
     "`ssm_state_indices` must have shape [B] (got (2,); expected (3,)).", None),
    ("state-3d", lambda fw, a, kda: a.update(initial_state=a["initial_state"].reshape(S, HV * V, K)),
     "`initial_state` must be a 4D tensor (got ndim=3).", None),
    ("state-last-stride", lambda fw, a, kda: a.update(initial_state=fw.as_strided(
        fw.full((S * HV * V * K * 2,), 0.0), (S, HV, V, K), (HV * V * K * 2, V * K * 2, K * 2, 2))),
     "`initial_state` must be contiguous in the last dim. `initial_state` has strides (1024, "
     "256, 16, 2); expected a last stride of 1.", None),
    ("state-inner-strides", lambda fw, a, kda: a.update(initial_state=fw.as_strided(
        fw.full((S * HV * V * K * 2,), 0.0), (S, HV, V, K), (HV * V * K * 2, V * K * 2, K, 1))),
     "`initial_state` must be contiguous in its [HV, V, K] inner dimensions; an arbitrary slot "
     "stride is supported. `initial_state` has strides (1024, 256, 8, 1); expected (any, 128, 8, "
     "1).", None),
    ("a-cols", lambda fw, a, kda: a.update(a=fw.full((B, 5), 0.0)),
     "`a`/`b` must have shape [B, HV] with HV=4 (got a.shape=(3, 5), b.shape=(3, 4)).",
     "`a` must have shape [B, HV*K] with HV=4, K=8 (got a.shape=(3, 5))."),
    ("b-cols", lambda fw, a, kda: a.update(b=fw.full((B, 5), 0.0)),
     "`a`/`b` must have shape [B, HV] with HV=4 (got a.shape=(3, 4), b.shape=(3, 5)).",
     "`b` must have shape [B, HV] with HV=4 (got b.shape=(3, 5))."),
    ("A_log-numel", lambda fw, a, kda: a.update(A_log=fw.full((3,), 0.0)),
     "`A_log` and `dt_bias` must have 4 elements (got A_log.numel()=3, dt_bias.numel()=4).",
     "`A_log` must have 4 elements (got 3)."),
    ("dt_bias-numel", lambda fw, a, kda: a.update(dt_bias=fw.full((5,), 0.0)),
     "`A_log` and `dt_bias` must have 4 elements (got A_log.numel()=4, dt_bias.numel()=5).",
     "`dt_bias` must have 32 elements (got 5)."),
    ("out-shape", lambda fw, a, kda: a.update(out=fw.full((B, HV, V, 1), 0.0)),
     "`out` must have shape (3, 1, 4, 16) (got out.shape=(3, 4, 16, 1)).", None),
    ("width-odd", lambda fw, a, kda: a.update(mixed_qkv=fw.full((B, W + 1), 0.0)),
     "Invalid packed `mixed_qkv` last dim=97 for HV=4, V=16.", None),
    ("width-small", lambda fw, a, kda: a.update(mixed_qkv=fw.full((B, HV * V), 0.0)),
     "Invalid packed `mixed_qkv` last dim=64 for HV=4, V=16.", None),
    ("q-not-multiple-of-K", lambda fw, a, kda: a.update(mixed_qkv=fw.full((B, HV * V + 24), 0.0)),
     "Invalid packed Q size 12: must be divisible by K=8.",
     "Invalid packed Q size 12: must be divisible by K=8. KDA packed decode requires "
     "num_q_heads == num_k_heads and head_q_dim == head_k_dim."),
    ("heads-not-dividing", lambda fw, a, kda: a.update(mixed_qkv=fw.full((B, HV * V + 48), 0.0)),
     "Invalid head config inferred from mixed_qkv: H=3, HV=4.", None),
    ("index-out-of-range", lambda fw, a, kda: a.update(ssm_state_indices=fw.idx([1, 9, 3])),
     "`ssm_state_indices`[1]=9 is out of range for a state pool of 5 slots (valid: 0..4; < 0 "
     "marks a padded row)", None),
    ("index-duplicate", lambda fw, a, kda: a.update(ssm_state_indices=fw.idx([1, -1, 1], "int64")),
     "`ssm_state_indices` uses slot 1 for rows 0 and 2; each live row needs its own slot", None),
    ("scale-zero", lambda fw, a, kda: a.update(scale=0.0), "scale must be positive (got 0)", None),
    ("state-int", lambda fw, a, kda: a.update(initial_state=fw.idx(np.zeros((S, HV, V, K), int))),
     "`initial_state` must have dtype float32, bfloat16 or float16; got int32", None),
    ("indices-float", lambda fw, a, kda: a.update(ssm_state_indices=fw.full((B,), 1.0)),
     "`ssm_state_indices` must have dtype int32 or int64; got float32", None),
]


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("case", PACKED_CASES, ids=[c[0] for c in PACKED_CASES])
def test_packed_decode_errors(fw, rng, kda, case):
    name, mutate, msg_gdn, msg_kda = case
    args = packed_args(fw, rng, kda)
    mutate(fw, args, kda)
    msg = msg_kda if (kda and msg_kda) else msg_gdn
    if name in ("state-int", "indices-float"):
        msg = spelled(fw, msg)
    expect_error(lambda a: call_packed(kda, a), args, msg)


def test_packed_decode_kda_lower_bound_must_be_finite(fw, rng):
    args = packed_args(fw, rng, True)
    args["lower_bound"] = float("inf")
    expect_error(lambda a: call_packed(True, a), args, "lower_bound must be finite (got inf)")


# ---- ReplaySSM --------------------------------------------------------------------------------
def replay_args(fw, rng, kda):
    return {
        "mixed_qkv": fw.from64(rng.standard_normal((B, W))),
        "a": fw.from64(rng.standard_normal((B, HV, K) if kda else (B, HV))),
        "b": fw.from64(rng.standard_normal((B, HV))),
        "A_log": fw.from64(rng.standard_normal(HV)),
        "dt_bias": fw.from64(rng.standard_normal((HV, K) if kda else (HV,))),
        "scale": K ** -0.5,
        "initial_state": fw.from64(rng.standard_normal((S, HV, V, K))),
        "d_cache": fw.full((S, HV, L, V), 1e30),
        "k_cache": fw.full((S, H, L, K), 1e30),
        "g_cache": fw.full((S, HV, L, K) if kda else (S, HV, L), 1e30),
        "out": poison(fw, (B, 1, HV, V), "float32"),
        "ssm_state_indices": fw.idx([1, -1, 3]),
        "write_pos": fw.idx([0, 0, 2]),
        "force_flush": fw.idx([0, 1, 0]),
        "is_kda": kda,
        "advance_write_pos": True,
    }


def call_replay(args):
    return ds.fused_recurrent_linear_replayssm_decode(**args)


REPLAY_CASES = [
    ("qkv-3d", lambda fw, a, kda: a.update(mixed_qkv=a["mixed_qkv"].reshape(B, W, 1)),
     "`mixed_qkv` must be 2D (got ndim=3).", None),
    ("b-1d", lambda fw, a, kda: a.update(b=fw.full((B,), 0.0)), "`b` must be 2D (got b.ndim=1).", None),
    ("A_log-2d", lambda fw, a, kda: a.update(A_log=a["A_log"].reshape(HV, 1)),
     "`A_log` must be a 1D tensor.", None),
    ("state-3d", lambda fw, a, kda: a.update(initial_state=fw.full((S, HV, V * K), 0.0)),
     "`initial_state` must be 4D (got ndim=3).", None),
    ("qkv-last-stride", lambda fw, a, kda: a.update(mixed_qkv=strided_last(fw, (B, W))),
     "`mixed_qkv` must be contiguous in the last dim. `mixed_qkv` has strides (192, 2); expected a "
     "last stride of 1.", None),
    ("out-noncontiguous", lambda fw, a, kda: a.update(
        out=fw.as_strided(fw.full((B * HV * V * 2,), 0.0), (B, 1, HV, V), (HV * V * 2, 1, V * 2, 2))),
     "`out` must be contiguous. `out` has strides (128, 1, 32, 2) for shape (3, 1, 4, 16); "
     "expected (64, 64, 16, 1).", None),
    ("write_pos-int64", lambda fw, a, kda: a.update(write_pos=fw.idx([0, 0, 2], "int64")),
     "`write_pos` must be a contiguous 1D int32 tensor.", None),
    ("force_flush-int64", lambda fw, a, kda: a.update(force_flush=fw.idx([0, 1, 0], "int64")),
     "`force_flush` must be a contiguous 1D int32 tensor or None.", None),
    ("state-inner-strides", lambda fw, a, kda: a.update(initial_state=fw.as_strided(
        fw.full((S * HV * V * K * 2,), 0.0), (S, HV, V, K), (HV * V * K * 2, V * K * 2, K, 1))),
     "`initial_state` must be contiguous in its [HV, V, K] inner dimensions; an arbitrary slot "
     "stride is supported. `initial_state` has strides (1024, 256, 8, 1); expected (any, 128, 8, "
     "1).", None),
    ("width-odd", lambda fw, a, kda: a.update(mixed_qkv=fw.full((B, W + 1), 0.0)),
     "Invalid packed `mixed_qkv` last dim=97 for HV=4, V=16.", None),
    ("q-not-multiple-of-K", lambda fw, a, kda: a.update(mixed_qkv=fw.full((B, HV * V + 24), 0.0)),
     "Invalid packed `mixed_qkv` last dim=88 for HV=4, V=16, K=8.", None),
    ("heads-not-dividing", lambda fw, a, kda: a.update(mixed_qkv=fw.full((B, HV * V + 48), 0.0)),
     "Invalid head config inferred from mixed_qkv: H=3, HV=4.", None),
    ("b-shape", lambda fw, a, kda: a.update(b=fw.full((B, 5), 0.0)),
     "`b` must have contiguous shape (3, 4).", None),
    ("A_log-shape", lambda fw, a, kda: a.update(A_log=fw.full((5,), 0.0)),
     "`A_log` must have contiguous shape (4,).", None),
    ("d_cache-shape", lambda fw, a, kda: a.update(d_cache=fw.full((S, HV, L, V + 1), 0.0)),
     "`d_cache` shape must be (5, 4, 4, 16) (got (5, 4, 4, 17)).", None),
    ("L-zero", lambda fw, a, kda: a.update(d_cache=fw.full((S, HV, 0, V), 0.0)),
     "ReplaySSM cache length must be at least 1.", None),
    ("a-shape", lambda fw, a, kda: a.update(a=fw.full((B, HV, K + 1) if kda else (B, HV + 1), 0.0)),
     "GDN `a` must have shape (3, 4) (got (3, 5)).", "KDA `a` must have shape (3, 4, 8) (got (3, 4, 9))."),
    ("dt_bias-shape", lambda fw, a, kda: a.update(dt_bias=fw.full((HV * K + 1,) if kda else (HV * K,), 0.0)),
     "GDN `dt_bias` must have shape (4,) (got (32,)).", "KDA `dt_bias` must have shape (4, 8) (got (33,))."),
    ("a-strided", lambda fw, a, kda: a.update(a=strided_last(fw, (B, HV, K) if kda else (B, HV))),
     "GDN `a` must be contiguous in the last dim. `a` has strides (8, 2); expected a last "
     "stride of 1.", "KDA `a`/`dt_bias` must be contiguous. `a` has strides (64, 16, 2) for shape (3, 4, 8); "
     "expected (32, 8, 1)."),
    ("ring-noncontiguous", lambda fw, a, kda: a.update(k_cache=strided_last(fw, (S, H, L, K))),
     "ReplaySSM ring caches must be contiguous. `k_cache` has strides (128, 64, 16, 2) for shape "
     "(5, 2, 4, 8); expected (64, 32, 8, 1).", None),
    ("k_cache-shape", lambda fw, a, kda: a.update(k_cache=fw.full((S, HV, L, K), 0.0)),
     "`k_cache` shape must be (5, 2, 4, 8) (got (5, 4, 4, 8)).", None),
    ("g_cache-shape", lambda fw, a, kda: a.update(g_cache=fw.full((S, HV, L, 1), 0.0)),
     "`g_cache` shape must be (5, 4, 4) (got (5, 4, 4, 1)).",
     "`g_cache` shape must be (5, 4, 4, 8) (got (5, 4, 4, 1))."),
    ("g_cache-dtype", lambda fw, a, kda: a.update(
        g_cache=fw.full((S, HV, L, K) if kda else (S, HV, L), 0.0, "float16")),
     "`g_cache` must be float32 (got float16).", None),
    ("out-shape", lambda fw, a, kda: a.update(out=fw.full((B, HV, V), 0.0)),
     "`out` must have shape (3, 1, 4, 16) (got (3, 4, 16)).", None),
    ("indices-int64", lambda fw, a, kda: a.update(ssm_state_indices=fw.idx([1, -1, 3], "int64")),
     "`ssm_state_indices` must be a 1D int32 tensor.", None),
    ("write_pos-length", lambda fw, a, kda: a.update(write_pos=fw.idx([0, 0])),
     "`write_pos` and `ssm_state_indices` must both have length B=3 (got 2, 3).", None),
    ("force_flush-length", lambda fw, a, kda: a.update(force_flush=fw.idx([0, 0, 0, 0])),
     "`force_flush` must have length B=3.", None),
    ("write_pos-outside-ring", lambda fw, a, kda: a.update(write_pos=fw.idx([4, 0, 0])),
     "`write_pos`[0]=4 is outside the ring [0, L-1=3]", None),
    ("index-out-of-range", lambda fw, a, kda: a.update(ssm_state_indices=fw.idx([1, -1, 5])),
     "`ssm_state_indices`[2]=5 is out of range for a state pool of 5 slots (valid: 0..4; < 0 "
     "marks a padded row)", None),
]


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("case", REPLAY_CASES, ids=[c[0] for c in REPLAY_CASES])
def test_replayssm_errors(fw, rng, kda, case):
    name, mutate, msg_gdn, msg_kda = case
    if name == "a-strided" and not kda:
        pytest.skip("GDN `a` is checked by shape and contiguity in one message")
    args = replay_args(fw, rng, kda)
    mutate(fw, args, kda)
    msg = msg_kda if (kda and msg_kda) else msg_gdn
    if name == "g_cache-dtype" and fw.name == "torch":
        msg = "`g_cache` must be float32 (got torch.float16)."  # SGLang's text: got {g_cache.dtype}
    expect_error(call_replay, args, msg)


def test_replayssm_g_cache_bf16(tfw, rng):
    args = replay_args(tfw, rng, False)
    args["g_cache"] = tfw.full((S, HV, L), 0.0, "bfloat16")
    expect_error(call_replay, args, "`g_cache` must be float32 (got torch.bfloat16).")


# ---- recurrent --------------------------------------------------------------------------------
T = 3


def recurrent_args(fw, rng, kda, pooled=True):
    args = {
        "q": fw.from64(rng.standard_normal((2, T, H, K))),
        "k": fw.from64(rng.standard_normal((2, T, H, K))),
        "v": fw.from64(rng.standard_normal((2, T, HV, V))),
        "g": fw.from64(-rng.uniform(0, 1, (2, T, HV, K) if kda else (2, T, HV))),
        "beta": fw.from64(rng.uniform(0, 1, (2, T, HV))),
        "output": poison(fw, (2, T, HV, V), "float32"),
    }
    if pooled:
        args["initial_state"] = fw.aligned(rng.standard_normal((S, HV, V, K)))
        args["ssm_state_indices"] = fw.idx([3, -1])
    return args


def call_recurrent(kda):
    op = ds.recurrent_kda if kda else ds.recurrent_gated_delta_rule
    return lambda args: op(**args)


def pool_view(fw, slot_stride, inner=(V * K, K, 1), offset=0):
    flat = fw.flat(S * slot_stride + 64, "float32", 0.0)
    return fw.as_strided(flat, (S, HV, V, K), (slot_stride,) + inner, offset)


def test_recurrent_gdn_state_ndim(fw, rng):
    args = recurrent_args(fw, rng, False)
    args["initial_state"] = fw.full((S, HV * V, K), 0.0)
    expect_error(call_recurrent(False), args, "`initial_state` must be a 4D tensor (got ndim=3).")


def test_recurrent_kda_stride_contract(fw, rng):
    """FlashInfer's recurrent_kda messages (`_check_state_stride_contract`), and the
    `'state pool' in str(e)` pattern."""
    call = call_recurrent(True)
    args = recurrent_args(fw, rng, True)
    args["initial_state"] = fw.full((6, HV, V * K), 0.0)
    expect_error(call, args, "recurrent_kda needs a [N, HV, V, K] state pool; got shape (6, 4, 128)")

    args = recurrent_args(fw, rng, True)
    args["initial_state"] = pool_view(fw, 2 * HV * V * K, inner=(2 * V * K, K, 1))
    expect_error(call, args, "recurrent_kda state inner strides must be compact (V*K, K, 1)=(128, 8, 1); "
                 "got (256, 8, 1) (only the slot stride may be non-compact)")

    args = recurrent_args(fw, rng, True)
    args["initial_state"] = pool_view(fw, HV * V * K + 8)
    expect_error(call, args, "recurrent_kda state pool breaks the compiled stride contract: slot stride "
                 "520 elements must be a multiple of 16 and the base byte offset 0 a multiple of 32 "
                 "(sym_int64(divisibility=16) / assumed_align=32)")

    args = recurrent_args(fw, rng, True)
    args["initial_state"] = pool_view(fw, HV * V * K + 16, offset=4)
    expect_error(call, args, "recurrent_kda state pool breaks the compiled stride contract: slot stride "
                 "528 elements must be a multiple of 16 and the base byte offset 16 a multiple of 32 "
                 "(sym_int64(divisibility=16) / assumed_align=32)")

    # The reference's handling pattern keeps working.
    handled = False
    try:
        call(args)
    except ValueError as e:
        if "state pool" in str(e):
            handled = True
    assert handled


def test_state_pool_pattern_index_out_of_range(fw, rng):
    args = recurrent_args(fw, rng, False)
    args["ssm_state_indices"] = fw.idx([3, 5])
    msg = ("`ssm_state_indices`[1]=5 is out of range for a state pool of 5 slots (valid: 0..4; "
           "< 0 marks a padded row)")
    expect_error(call_recurrent(False), args, msg)
    try:
        call_recurrent(False)(args)
    except ValueError as e:
        assert "state pool" in str(e)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_recurrent_errors(fw, rng, kda):
    op = "recurrent_kda" if kda else "recurrent_gated_delta_rule"
    call = call_recurrent(kda)

    args = recurrent_args(fw, rng, kda)
    args["cu_seqlens"] = fw.idx([0, 1, 3])
    expect_error(call, args, "The batch size is expected to be 1 rather than 2 when using "
                 "`cu_seqlens`.Please flatten variable-length inputs before processing.")

    args = recurrent_args(fw, rng, kda)
    args["ssm_state_indices"] = fw.idx([3, -1, 1])
    expect_error(call, args, "The number of initial states is expected to be equal to the number "
                 "of input sequences, i.e., 2 rather than 3.")

    args = recurrent_args(fw, rng, kda, pooled=False)
    args["initial_state"] = fw.aligned(rng.standard_normal((3, HV, V, K)))
    expect_error(call, args, "The number of initial states is expected to be equal to the number "
                 "of input sequences, i.e., 2 rather than 3.")

    args = recurrent_args(fw, rng, kda)
    args["v"] = fw.full((2, T, 3, V), 0.0)
    args["output"] = fw.full((2, T, 3, V), 0.0)
    args["beta"] = fw.full((2, T, 3), 0.0)
    args["g"] = fw.full((2, T, 3, K) if kda else (2, T, 3), 0.0)
    expect_error(call, args, f"{op}: `v` has HV=3 heads and `q`/`k` have H=2; HV must be a "
                 "positive multiple of H")

    args = recurrent_args(fw, rng, kda)
    for n in ("q", "k", "v", "g", "beta", "output"):
        args[n] = args[n][:1]
    args["ssm_state_indices"] = fw.idx([3, 1])
    args["cu_seqlens"] = fw.idx([0, 2, 1])
    expect_error(call, args, "`cu_seqlens` must start at 0 and be non-decreasing within [0, T=3]; "
                 "got cu_seqlens[2]=1 after 2")

    args = recurrent_args(fw, rng, kda)
    args["A_log"] = fw.full((HV,), 0.0)
    expect_error(call, args, f"{op}: `A_log`, `dt_bias` and lower_bound apply only with the "
                 "in-kernel gate (use_gate_in_kernel=True); `g` is otherwise the log-space decay "
                 "itself")

    args = recurrent_args(fw, rng, kda)
    args["use_gate_in_kernel"] = True
    expect_error(call, args, "A_log is required when use_gate_in_kernel=True")  # FlashInfer's

    args = recurrent_args(fw, rng, kda)
    args["lower_bound"] = -5.0
    expect_error(call, args, "lower_bound requires use_gate_in_kernel=True")

    args = recurrent_args(fw, rng, kda)
    args.update(use_gate_in_kernel=True, A_log=fw.full((HV,), 0.0), lower_bound=0.5)
    expect_error(call, args, "lower_bound must be negative")

    args = recurrent_args(fw, rng, kda)
    args["backend"] = "triton"
    expect_error(call, args, "backend must be 'auto', 'cute-dsl', or 'cake', got 'triton'")

    args = recurrent_args(fw, rng, kda)
    args.update(use_gate_in_kernel=True, A_log=fw.full((HV,), 0.0), dt_bias=fw.full((3,), 0.0))
    expect_error(call, args, f"`dt_bias` must have {HV * K if kda else HV} elements (got 3).")

    args = recurrent_args(fw, rng, kda)
    args["v"] = fw.full((2, T, HV, 8), 0.0)
    args["output"] = fw.full((2, T, HV, 8), 0.0)
    expect_error(call, args, "`initial_state` must have shape [slots, HV, V, K]=(5, 4, 8, 8); got "
                 "(5, 4, 16, 8) (V=8 from `v`)")
    # initial_state=None with ssm_state_indices is no error: FlashInfer allocates a zero state
    # (test_dropin.py).


# ---- wrong Python types, missing arguments -----------------------------------------------------
def test_wrong_types_packed(fw, rng):
    for kda in (False, True):
        op = (ds.fused_recurrent_kda_packed_decode if kda
              else ds.fused_recurrent_gated_delta_rule_packed_decode)
        name = op.__name__
        base = packed_args(fw, rng, kda)
        for arg, value, text in [
            ("initial_state", "pool", f"{name}: `initial_state` must be a tensor (a numpy array or a "
                                      "torch tensor); got str"),
            ("ssm_state_indices", [1, -1, 3], f"{name}: `ssm_state_indices` must be a tensor (a numpy "
                                              "array or a torch tensor); got list"),
            ("mixed_qkv", None, f"{name}: `mixed_qkv` must be a tensor (a numpy array or a torch "
                                "tensor); got NoneType"),
            ("scale", "0.1", "scale must be a number or None (got str)"),
            ("scale", True, "scale must be a number or None (got bool)"),
        ]:
            args = dict(base, **{arg: value})
            expect_error(lambda a: op(**a), args, text, TypeError)
        with pytest.raises(TypeError):
            op(base["mixed_qkv"], base["a"])  # missing arguments
        with pytest.raises(TypeError):
            op(**dict(base, bogus=1))
        # Numeric scalars of other types are fine.
        op(**dict(base, scale=np.float32(0.25)))
    args = packed_args(fw, rng, True)
    expect_error(lambda a: ds.fused_recurrent_kda_packed_decode(**a), dict(args, lower_bound="x"),
                 "lower_bound must be a number or None (got str)", TypeError)


def test_wrong_types_recurrent_and_replay(fw, rng):
    args = recurrent_args(fw, rng, False)
    expect_error(call_recurrent(False), dict(args, q=None),
                 "recurrent_gated_delta_rule: `q` is required (got None)", TypeError)
    expect_error(call_recurrent(False), dict(args, v=[[1.0]], output=None),
                 "recurrent_gated_delta_rule: `v` must be a tensor (a numpy array or a torch tensor); "
                 "got list", TypeError)
    expect_error(call_recurrent(True), dict(recurrent_args(fw, rng, True), cu_seqlens="0,1"),
                 "recurrent_kda: `cu_seqlens` must be a tensor (a numpy array or a torch tensor) or "
                 "None; got str", TypeError)
    with pytest.raises(TypeError):
        ds.recurrent_kda(args["q"], args["k"], args["v"])
    rargs = replay_args(fw, rng, False)
    expect_error(call_replay, dict(rargs, write_pos=None),
                 "fused_recurrent_linear_replayssm_decode: `write_pos` must be a tensor (a numpy "
                 "array or a torch tensor); got NoneType", TypeError)
    expect_error(call_replay, dict(rargs, force_flush=3),
                 "fused_recurrent_linear_replayssm_decode: `force_flush` must be a tensor (a numpy "
                 "array or a torch tensor) or None; got int", TypeError)
    with pytest.raises(TypeError):
        ds.fused_recurrent_linear_replayssm_decode(rargs["mixed_qkv"])


def test_unsupported_dtypes_and_read_only(rng):
    np_fw = Fw("numpy")
    args = packed_args(np_fw, rng, False)
    expect_error(lambda a: call_packed(False, a), dict(args, a=args["a"].astype(np.float64)),
                 "`a` has dtype float64, which deltastate does not take; `a` takes float32, "
                 "bfloat16 or float16")
    ro = args["A_log"].copy()
    ro.flags.writeable = False
    expect_error(lambda a: call_packed(False, a), dict(args, A_log=ro),
                 "fused_recurrent_gated_delta_rule_packed_decode: `A_log` is a read-only numpy "
                 "array, which DLPack cannot export; pass a writable array (e.g. a copy)")


def test_too_many_dims(tfw, rng):
    args = packed_args(tfw, rng, False)
    args["mixed_qkv"] = torch.zeros((1,) * 6 + (W,))
    expect_error(lambda a: call_packed(False, a), args,
                 "`mixed_qkv` has 7 dims; deltastate takes at most 6")


def test_pdl_keyword_errors_unchanged(fw, rng):
    """`pdl` is keyword-only and changes no error: with pdl=True a contract violation raises the
    same text and writes nothing, and a wrong argument type is still reported by name."""
    for kda in (False, True):
        args = dict(packed_args(fw, rng, kda), pdl=True)
        args["ssm_state_indices"] = fw.idx([1, -1, 5])
        expect_error(lambda a: call_packed(kda, a), args,
                     "`ssm_state_indices`[2]=5 is out of range for a state pool of 5 slots (valid: "
                     "0..4; < 0 marks a padded row)")
        name = ("fused_recurrent_kda_packed_decode" if kda
                else "fused_recurrent_gated_delta_rule_packed_decode")
        expect_error(lambda a: call_packed(kda, a),
                     dict(packed_args(fw, rng, kda), pdl=True, initial_state="pool"),
                     f"{name}: `initial_state` must be a tensor (a numpy array or a torch tensor); "
                     "got str", TypeError)
        expect_error(call_recurrent(kda), dict(recurrent_args(fw, rng, kda), pdl=True,
                                               cu_seqlens="0,1"),
                     f"{'recurrent_kda' if kda else 'recurrent_gated_delta_rule'}: `cu_seqlens` "
                     "must be a tensor (a numpy array or a torch tensor) or None; got str",
                     TypeError)
        expect_error(call_replay, dict(replay_args(fw, rng, kda), pdl=True, force_flush=3),
                     "fused_recurrent_linear_replayssm_decode: `force_flush` must be a tensor (a "
                     "numpy array or a torch tensor) or None; got int", TypeError)
    args = packed_args(fw, rng, False)
    with pytest.raises(TypeError):  # positional: one too many
        ds.fused_recurrent_gated_delta_rule_packed_decode(*args.values(), True, True)


# ---- quantized states (float8_e4m3fn, int8 with fp32 scales) ------------------------------------
def quantized_args(fw, rng, dtype="float8_e4m3fn"):
    """Packed-decode arguments on a quantized StatePool layer (S slots), stochastic rounding for
    float8 (its default), with the pool's keywords."""
    pool = ds.StatePool(layers=1, slots=S, HV=HV, V=V, K=K, state_dtype=dtype, framework=fw.name)
    st, sc = pool.layer_state(0), pool.layer_scales(0)
    codes = rng.integers(0, 100, (S, HV, V, K))  # finite codes of either format
    if fw.name == "torch":
        st.view(torch.uint8).copy_(torch.from_numpy(codes.astype(np.uint8)))
        sc.copy_(torch.from_numpy(rng.uniform(0.01, 1, (S, HV, V)).astype(np.float32)))
    else:
        st[...] = codes.astype(st.dtype)
        sc[...] = rng.uniform(0.01, 1, (S, HV, V))
    args = dict(packed_args(fw, rng, False), initial_state=st, **pool.state_format(0))
    return pool, args


def test_quantized_state_errors(fw, rng):
    op = "fused_recurrent_gated_delta_rule_packed_decode"
    call = lambda a: call_packed(False, a)  # noqa: E731
    pool, args = quantized_args(fw, rng)
    bad = dict(args)
    del bad["state_scales"]
    expect_error(call, bad, f"{op}: `state_scales` is required for the float8_e4m3fn state "
                 "`initial_state`: its fp32 scales [slots, HV, V] (StatePool.layer_scales)")
    expect_error(call, dict(args, state_scales=args["state_scales"][:, :, :8]),
                 "`state_scales` must have shape [slots, HV, V]=(5, 4, 16) (one per row of "
                 "`initial_state`); got (5, 4, 8)")
    expect_error(call, dict(args, state_scales=fw.full((S, HV, V), 0.0, "float16")),
                 spelled(fw, "`state_scales` must have dtype float32; got float16"))
    bad = dict(args)
    del bad["rounding_step"]
    expect_error(call, bad, f"{op}: stochastic rounding of the float8_e4m3fn state "
                 "`initial_state` needs `rounding_step`, an int64 [1] step counter on the "
                 "state's device (StatePool.rounding_step)")
    expect_error(call, dict(args, rounding_step=fw.idx([0], "int32")),
                 spelled(fw, "`rounding_step` must have dtype int64; got int32"))
    expect_error(call, dict(args, state_rounding="nearest"),
                 f"{op}: `rounding_step` is given, but the float8_e4m3fn state `initial_state` is "
                 "rounded to nearest (pass state_rounding stochastic, or no step)")
    expect_error(call, dict(args, state_rounding="up"),
                 "`state_rounding` must be None, 'nearest' or 'stochastic'; got 'up'")
    float_args = packed_args(fw, rng, False)
    expect_error(call, dict(float_args, state_scales=args["state_scales"]),
                 f"{op}: `state_scales` applies to float8_e4m3fn and int8 states; "
                 "`initial_state` is float32")
    expect_error(call, dict(float_args, state_rounding="stochastic"),
                 f"{op}: stochastic rounding applies to bfloat16, float16, float8_e4m3fn and int8 "
                 "states; `initial_state` is float32 (stored exactly)")
    assert int(pool.rounding_step(0)[0]) == 0  # no rejected call advanced the step


def test_quantized_scratch_errors(fw, rng):
    """A quantized verify scratch (intermediate_states in float8_e4m3fn / int8) and its fp32
    intermediate_state_scales, verify's and the commit's: each error names the tensor and what
    was expected; nothing is written, no step counter advances."""
    T, R, TA = 2, 3, 4
    pool = ds.StatePool(layers=2, slots=S, HV=HV, V=V, K=K, state_dtype="int8",
                        state_rounding="stochastic", framework=fw.name)
    inter = fw.from64(np.zeros((2, R, TA, HV, V, K)), "int8")
    iscales = fw.full((2, R, TA, HV, V), 1.0, "float32")
    f = lambda x: fw.from64(x, "float32")  # noqa: E731
    vargs = dict(q=f(rng.standard_normal((2, T, H, K))), k=f(rng.standard_normal((2, T, H, K))),
                 v=f(rng.standard_normal((2, T, HV, V))), g=f(-rng.uniform(0, 1, (2, T, HV))),
                 beta=f(rng.uniform(0, 1, (2, T, HV))), output=fw.full((2, T, HV, V), 0.0),
                 state=pool.layer_state(0), state_indices=fw.idx([1, 2]), update_state=False,
                 use_gate_in_kernel=False, beta_is_logit=False, intermediate_states=inter[0],
                 intermediate_state_scales=iscales[0], **pool.state_format(0))
    call = lambda a: ds.verify(**a)  # noqa: E731
    bad = dict(vargs)
    del bad["intermediate_state_scales"]
    expect_error(call, bad, "verify: `intermediate_state_scales` is required for the int8 scratch "
                 "`intermediate_states`: its fp32 scales [N_scr, T_alloc, HV, V], one per state "
                 "row")
    expect_error(call, dict(vargs, intermediate_state_scales=iscales[0][:, :3]),
                 "`intermediate_state_scales` must have shape [N_scr, T_alloc, HV, V]=(3, 4, 4, "
                 "16) (one per row of `intermediate_states`); got (3, 3, 4, 16)")
    expect_error(call, dict(vargs, intermediate_state_scales=fw.full((R, TA, HV, V), 1.0,
                                                                     "float16")),
                 spelled(fw, "`intermediate_state_scales` must have dtype float32; got float16"))
    expect_error(call, dict(vargs, intermediate_state_scales=fw.full((R, TA, V, HV), 1.0)
                            .transpose(2, 3) if fw.name == "torch"
                            else fw.full((R, TA, V, HV), 1.0).transpose(0, 1, 3, 2)),
                 "`intermediate_state_scales` must be contiguous in its [HV, V] inner dimensions "
                 "(strides (16, 1)); got strides (256, 64, 1, 4)")
    expect_error(call, dict(vargs, intermediate_states=fw.full((R, TA, HV, V, K), 0.0)),
                 "verify: `intermediate_state_scales` applies to a float8_e4m3fn or int8 "
                 "`intermediate_states`; it is float32")
    expect_error(call, dict(vargs, intermediate_states=None),
                 "`intermediate_state_scales` are the scales of a quantized `intermediate_states` "
                 "buffer, which was not given")
    fpool = {k: v for k, v in vargs.items()
             if k not in ("state_scales", "state_rounding", "rounding_step")}
    expect_error(call, dict(fpool, state=fw.full((S, HV, V, K), 0.0)),
                 "verify: a quantized `intermediate_states` (here int8) is built for "
                 "float8_e4m3fn and int8 pools; `state` is float32 (give a float32 scratch)",
                 NotImplementedError)
    # the commit: [layers, N_scr, T_alloc, ...] and its scales [layers, N_scr, T_alloc, HV, V]
    cargs = dict(state=pool.states(), intermediate_states=inter, state_indices=fw.idx([1, 2]),
                 accepted=fw.idx([1, 2]), intermediate_state_scales=iscales,
                 **pool.state_format())
    ccall = lambda a: ds.update_state_after_verify(**a)  # noqa: E731
    bad = dict(cargs)
    del bad["intermediate_state_scales"]
    expect_error(ccall, bad, "update_state_after_verify: `intermediate_state_scales` is required "
                 "for the int8 scratch `intermediate_states`: its fp32 scales [layers, N_scr, "
                 "T_alloc, HV, V], one per state row")
    expect_error(ccall, dict(cargs, intermediate_state_scales=iscales[:1]),
                 "`intermediate_state_scales` must have shape [layers, N_scr, T_alloc, HV, V]=(2, "
                 "3, 4, 4, 16) (one per row of `intermediate_states`); got (1, 3, 4, 4, 16)")
    fcargs = {k: v for k, v in cargs.items()
              if k not in ("state_scales", "state_rounding", "rounding_step")}
    expect_error(ccall, dict(fcargs, state=fw.full((2, S, HV, V, K), 0.0)),
                 "update_state_after_verify: a quantized `intermediate_states` (here int8) is "
                 "built for float8_e4m3fn and int8 pools; `state` is float32 (give a float32 "
                 "scratch)", NotImplementedError)
    assert np.all(to64(pool.rounding_steps()) == 0)  # no rejected call advanced a step


def test_formatted_source_and_replay_checkpoint_errors(fw, rng):
    """verify's source_state with a quantized pool is a float pool: a quantized one is a
    NotImplementedError naming it; replayssm_verify's checkpoint format keywords, named for that
    op. Nothing written, no step counter advanced."""
    T = 2
    pool = ds.StatePool(layers=1, slots=S, HV=HV, V=V, K=K, state_dtype="float8_e4m3fn",
                        framework=fw.name)
    f = lambda x: fw.from64(x, "float32")  # noqa: E731
    vargs = dict(q=f(rng.standard_normal((2, T, H, K))), k=f(rng.standard_normal((2, T, H, K))),
                 v=f(rng.standard_normal((2, T, HV, V))), g=f(-rng.uniform(0, 1, (2, T, HV))),
                 beta=f(rng.uniform(0, 1, (2, T, HV))), output=fw.full((2, T, HV, V), 0.0),
                 state=pool.layer_state(0), state_indices=fw.idx([1, 2]),
                 use_gate_in_kernel=False, beta_is_logit=False,
                 source_state=fw.from64(np.zeros((3, HV, V, K)), "int8"),
                 source_state_indices=fw.idx([0, 2]), **pool.state_format(0))
    expect_error(lambda a: ds.verify(**a), vargs,
                 "verify: `source_state` is int8: the read-only source pool of a float8_e4m3fn "
                 "`state` is a float pool (float32, bfloat16 or float16; issue #36)",
                 NotImplementedError)
    rargs = dict(q=vargs["q"], k=vargs["k"], v=vargs["v"], g=vargs["g"], beta=vargs["beta"],
                 output=vargs["output"], checkpoint_state=pool.layer_state(0),
                 state_indices=fw.idx([1, 2]), d_cache=fw.full((S, HV, L, V), 0.0),
                 k_cache=fw.full((S, H, L, K), 0.0), g_cache=fw.full((S, HV, L), 0.0),
                 write_pos=fw.idx([0] * S), cache_base=fw.idx([0] * S),
                 is_flush=fw.idx([0] * S), use_gate_in_kernel=False, beta_is_logit=False)
    expect_error(lambda a: ds.replayssm_verify(**a), rargs,
                 "replayssm_verify: `state_scales` is required for the float8_e4m3fn state "
                 "`state`: its fp32 scales [slots, HV, V] (StatePool.layer_scales)")
    expect_error(lambda a: ds.replayssm_verify(**a),
                 dict(rargs, state_scales=pool.layer_scales(0)),
                 "replayssm_verify: stochastic rounding of the float8_e4m3fn state `state` needs "
                 "`rounding_step`, an int64 [1] step counter on the state's device "
                 "(StatePool.rounding_step)")
    assert np.all(to64(pool.rounding_steps()) == 0)


# ---- each argument's own dtypes; each argument's own framework; strides in contiguity errors ----
def test_untaken_dtype_lists_what_that_argument_takes(fw, rng):
    """A dtype the binding has no type for: the dtypes that argument takes, not every dtype."""
    args = packed_args(fw, rng, False)
    t = "torch." if fw.name == "torch" else ""
    expect_error(lambda a: call_packed(False, a),
                 dict(args, ssm_state_indices=fw.from64(np.array([1, -1, 3]), "int16")),
                 f"`ssm_state_indices` has dtype {t}int16, which deltastate does not take; "
                 f"`ssm_state_indices` takes {t}int32 or {t}int64")
    expect_error(lambda a: call_packed(False, a),
                 dict(args, mixed_qkv=fw.from64(rng.standard_normal((B, W)), "float64")),
                 spelled(fw, "`mixed_qkv` has dtype float64, which deltastate does not take; "
                             "`mixed_qkv` takes float32, bfloat16 or float16"))


def test_mixed_frameworks_spell_each_argument_its_own_way(rng):
    """numpy and torch arguments in one call: a numpy argument's dtype as numpy prints it, a
    torch argument's as torch does."""
    if torch is None:
        pytest.skip("needs torch")
    args = packed_args(Fw("torch"), rng, False)
    expect_error(lambda a: call_packed(False, a),
                 dict(args, a=np.zeros((B, HV), np.float64)),
                 "`a` has dtype float64, which deltastate does not take; `a` takes float32, "
                 "bfloat16 or float16")
    expect_error(lambda a: call_packed(False, a),
                 dict(args, a=np.zeros((B, HV), np.int32)),
                 "`a` must have dtype float32, bfloat16 or float16; got int32")
    nargs = packed_args(Fw("numpy"), rng, False)
    expect_error(lambda a: call_packed(False, a),
                 dict(nargs, b=torch.zeros(B, HV, dtype=torch.int32)),
                 "`b` must have dtype torch.float32, torch.bfloat16 or torch.float16; got "
                 "torch.int32")


def test_contiguity_errors_show_strides(fw, rng):
    """After the peer's text, the strides found and the ones needed."""
    args = packed_args(fw, rng, False)
    out = fw.as_strided(fw.full((B * HV * V * 2,), 0.0), (B, 1, HV, V), (HV * V * 2, 1, V * 2, 2))
    expect_error(lambda a: call_packed(False, a), dict(args, out=out),
                 "`out` must be contiguous. `out` has strides (128, 1, 32, 2) for shape "
                 "(3, 1, 4, 16); expected (64, 64, 16, 1).")
    expect_error(lambda a: call_packed(False, a), dict(args, b=strided_last(fw, (B, HV))),
                 "`a`/`b` must be contiguous in the last dim. `b` has strides (8, 2); expected a "
                 "last stride of 1.")


def test_k_first_state_in_packed_decode_is_named(fw, rng):
    """FLA's K-first layout [slots, HV, K, V] with K != V: SGLang's `out` text, then the state,
    the layout packed decode takes and FLA's option that gives it."""
    args = packed_args(fw, rng, False)
    k_first = fw.from64(rng.standard_normal((S, HV, K, V)))
    expect_error(lambda a: call_packed(False, a), dict(args, initial_state=k_first),
                 "`out` must have shape (3, 1, 4, 8) (got out.shape=(3, 1, 4, 16)). "
                 "`initial_state` (5, 4, 8, 16) looks K-first [slots, HV, K, V]: packed decode "
                 "takes the pool's V-first layout [slots, HV, V, K] (FLA: state_v_first=True; "
                 "deltastate never transposes a state behind the caller's back).")
