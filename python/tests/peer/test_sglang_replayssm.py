"""SGLang's ReplaySSM tests, ported to deltastate's SGLang-named ops.

Sources (sgl-project/sglang):
  * test/registered/attention/unittests/gdn/test_linear_replayssm_decode.py
    @ 078e5e2a5227bb6af1727574bb6212f0afb25250 (TestLinearReplaySSMDecode: the L sweep of
    ``fused_recurrent_linear_replayssm_decode`` against the packed decodes, GDN and KDA, fp32 and
    bf16, forced flushes, the L=1 exact case).
  * test/registered/attention/unittests/gdn/test_decode_keeps_beta_in_fp32.py
    @ 67a25468c7762686f4eb40e5f90f58a5c182d901 (test_linear_replayssm_decode: the fp32-beta
    regression of sgl-project/sglang#38975 / PR #38977).
  * test/registered/kernels/ops/attention/test_kda_helion.py
    @ 253bb88152e6ec6952d81c19428d80dbeff9d163 (the Helion KDA ReplaySSM contract tests:
    test_public_signatures_match_triton (ReplaySSM half), test_replayssm_decode_contract,
    test_replayssm_per_row_flush_contract, test_replayssm_cuda_graph_replay_with_strided_state).
  Functions: python/sglang/kernels/ops/attention/fla/fused_recurrent_linear_replayssm.py
  @ 03a70bf334be953130693f4f67453c33ca7f3290 and python/sglang/kernels/ops/attention/helion/
  kda_replayssm.py @ 4c4e07cfa258cd5190a7257cb076dc7201fe2af6 (see docs/PEERS.md).

What changed in the port:
  * The ops are deltastate's ``fused_recurrent_linear_replayssm_decode``,
    ``fused_recurrent_gated_delta_rule_packed_decode``, ``fused_recurrent_kda_packed_decode`` and
    ``helion_fused_recurrent_kda_replayssm_decode``, called with SGLang's keywords (including the
    Triton tuning keyword ``nk``, which deltastate must accept and ignore).
  * Oracles. The L sweep's oracle in SGLang is its packed decode, and the Helion tests' oracle is
    SGLang's generic Triton ReplaySSM (or, with a lower bound, the packed decode): these tests
    assert that two entry points of the same library agree, so the port asserts the same of the
    deltastate ops with those names. The packed decodes themselves are checked against a torch
    reference in test_sglang_packed_decode.py.
  * unittest subTests became pytest parameters; "cuda" became a device parameter.
  * test_replayssm_cuda_graph_replay_with_strided_state captures a CUDA graph on CUDA; on CPU
    (no graphs) it runs the same strided-state call eagerly.
  * Helion signature test: SGLang compares the first 15 Helion parameters with the Triton
    function's and expects ``lower_bound`` last; at 03a70bf the Triton function has
    ``lower_bound`` at position 14, so the port checks each deltastate function against its own
    SGLang signature instead (names, order, kinds, defaults; extra keyword-only options allowed).
  * Sizes, seeds, tolerances and assertions are SGLang's. Trim: on CPU tensors the L sweep runs
    24 decode steps instead of 40 (DELTASTATE_PEER_FULL=1 restores 40); CUDA runs 40. The L-sweep
    draws A_log/dt_bias after ``torch.manual_seed(0)`` (SGLang draws them from the unseeded
    global generator).
"""

import pytest

torch = pytest.importorskip("torch")

from _peer_common import (FULL, NO_DEFAULT, P, check_signature, device_param, manual_seed,
                          peer_op)


# ---- signatures ---------------------------------------------------------------------------------
SGLANG_REPLAYSSM = [
    ("mixed_qkv", P, NO_DEFAULT), ("a", P, NO_DEFAULT), ("b", P, NO_DEFAULT),
    ("A_log", P, NO_DEFAULT), ("dt_bias", P, NO_DEFAULT), ("scale", P, NO_DEFAULT),
    ("initial_state", P, NO_DEFAULT), ("d_cache", P, NO_DEFAULT), ("k_cache", P, NO_DEFAULT),
    ("g_cache", P, NO_DEFAULT), ("out", P, NO_DEFAULT), ("ssm_state_indices", P, NO_DEFAULT),
    ("write_pos", P, NO_DEFAULT), ("force_flush", P, None), ("lower_bound", P, None),
    ("use_qk_l2norm_in_kernel", P, False), ("is_kda", P, False), ("block_v", P, None),
    ("num_warps", P, 1), ("num_stages", P, 3), ("nk", P, 2), ("cache_base", P, None),
    ("circular_replay", P, False), ("prefix_gate_cache", P, False),
    ("predecayed_k_cache", P, False),
]
SGLANG_HELION_KDA_REPLAYSSM = SGLANG_REPLAYSSM[:14] + [
    ("use_qk_l2norm_in_kernel", P, False), ("lower_bound", P, None),
]


def test_public_signatures_match_sglang():
    check_signature(peer_op("fused_recurrent_linear_replayssm_decode"), SGLANG_REPLAYSSM)
    check_signature(peer_op("helion_fused_recurrent_kda_replayssm_decode"),
                    SGLANG_HELION_KDA_REPLAYSSM)
    # The shared head (mixed_qkv .. force_flush) is identical between the two names.
    import inspect

    generic = list(inspect.signature(peer_op("fused_recurrent_linear_replayssm_decode"))
                   .parameters.values())[:14]
    helion = list(inspect.signature(peer_op("helion_fused_recurrent_kda_replayssm_decode"))
                  .parameters.values())[:14]
    assert helion == generic


# ---- the L sweep (test_linear_replayssm_decode.py) ---------------------------------------------
def _build_inputs(B, H, HV, K, V, dtype, device, seed=0, is_kda=False):
    g = torch.Generator(device=device).manual_seed(seed)
    qk_dim = 2 * H * K
    v_dim = HV * V
    mixed_qkv = torch.randn(B, qk_dim + v_dim, generator=g, device=device, dtype=dtype)
    if is_kda:
        a = (torch.randn(B, HV, K, generator=g, device=device, dtype=dtype) * 0.5).contiguous()
    else:
        a = torch.randn(B, HV, generator=g, device=device, dtype=dtype) * 0.5
    b = torch.randn(B, HV, generator=g, device=device, dtype=dtype)
    return mixed_qkv, a, b


def _tols(dtype):
    if dtype == torch.float32:
        return dict(atol=1e-4, rtol=1e-3)
    return dict(atol=1e-3, rtol=1e-2)  # bf16


CONFIGS = (
    dict(B=4, H=4, HV=8, K=128, V=128),
    dict(B=4, H=8, HV=16, K=128, V=128),
)
NUM_STEPS = 40  # > 16 -> multiple flush cycles for L in {4,8,16}
# CPU trim (the only one in this file): 24 steps still cross the L=16 flush (step 15), three L=8
# flushes and every forced-flush step (3, 5, 11, 20). CUDA runs SGLang's 40.
CPU_NUM_STEPS = NUM_STEPS if FULL else 24
L_SWEEP = (1, 4, 8, 16)


def _run_one(device, cfg, L, dtype, force_flush_steps=(), is_kda=False):
    gdn_packed = peer_op("fused_recurrent_gated_delta_rule_packed_decode")
    kda_packed = peer_op("fused_recurrent_kda_packed_decode")
    replayssm = peer_op("fused_recurrent_linear_replayssm_decode")
    B, H, HV, K, V = (cfg[x] for x in ("B", "H", "HV", "K", "V"))
    scale = K ** -0.5
    manual_seed(0)
    A_log = (torch.randn(HV, device=device, dtype=torch.float32) * 0.3).contiguous()
    if is_kda:
        dt_bias = (torch.randn(HV, K, device=device, dtype=torch.float32) * 0.1).contiguous()
    else:
        dt_bias = (torch.randn(HV, device=device, dtype=torch.float32) * 0.1).contiguous()

    num_slots = B
    sg = torch.Generator(device=device).manual_seed(2024)
    ref_state = torch.randn(num_slots, HV, V, K, generator=sg, device=device, dtype=torch.float32)
    rep_state = ref_state.clone()
    cache_indices = torch.arange(B, device=device, dtype=torch.int32)

    d_cache = torch.zeros(num_slots, HV, L, V, device=device, dtype=dtype)
    k_cache = torch.zeros(num_slots, H, L, K, device=device, dtype=dtype)
    if is_kda:
        g_cache = torch.zeros(num_slots, HV, L, K, device=device, dtype=torch.float32)
    else:
        g_cache = torch.zeros(num_slots, HV, L, device=device, dtype=torch.float32)
    write_pos = torch.zeros(B, device=device, dtype=torch.int32)

    tols = _tols(dtype)
    flush_step_seen = False

    for step in range(NUM_STEPS if device != "cpu" else CPU_NUM_STEPS):
        mixed_qkv, a, b = _build_inputs(B, H, HV, K, V, dtype, device, seed=1000 + step,
                                        is_kda=is_kda)
        ref_out = mixed_qkv.new_empty(B, 1, HV, V)
        if is_kda:
            kda_packed(
                mixed_qkv=mixed_qkv,
                a=a.reshape(B, HV * K).contiguous(),
                b=b,
                A_log=A_log,
                dt_bias=dt_bias.reshape(HV * K).contiguous(),
                scale=scale,
                initial_state=ref_state,
                out=ref_out,
                ssm_state_indices=cache_indices,
                use_qk_l2norm_in_kernel=True,
            )
        else:
            gdn_packed(
                mixed_qkv=mixed_qkv,
                a=a,
                b=b,
                A_log=A_log,
                dt_bias=dt_bias,
                scale=scale,
                initial_state=ref_state,
                out=ref_out,
                ssm_state_indices=cache_indices,
                use_qk_l2norm_in_kernel=True,
            )

        rep_out = mixed_qkv.new_empty(B, 1, HV, V)
        force_now = step in force_flush_steps
        ff_tensor = torch.ones(B, device=device, dtype=torch.int32) if force_now else None
        is_flush = bool((write_pos[0].item()) == L - 1) or force_now
        flush_step_seen = flush_step_seen or is_flush
        replayssm(
            mixed_qkv=mixed_qkv,
            a=a,
            b=b,
            A_log=A_log,
            dt_bias=dt_bias,
            scale=scale,
            initial_state=rep_state,
            d_cache=d_cache,
            k_cache=k_cache,
            g_cache=g_cache,
            out=rep_out,
            ssm_state_indices=cache_indices,
            write_pos=write_pos,
            force_flush=ff_tensor,
            use_qk_l2norm_in_kernel=True,
            is_kda=is_kda,
            nk=1 if L == 1 else 2,
        )

        if dtype == torch.float32 and L == 1 and not is_kda:
            torch.testing.assert_close(rep_out, ref_out, atol=2e-6, rtol=1e-5,
                                       msg=f"GDN L=1 step={step} out")
        else:
            torch.testing.assert_close(rep_out, ref_out,
                                       msg=f"is_kda={is_kda} L={L} step={step} out", **tols)

        if is_flush:
            if dtype == torch.float32 and L == 1 and not is_kda:
                torch.testing.assert_close(rep_state, ref_state, atol=2e-6, rtol=1e-5,
                                           msg=f"GDN L=1 step={step} state")
            else:
                state_tols = (dict(atol=1.5e-3, rtol=1e-3) if dtype == torch.float32
                              else dict(atol=3e-3, rtol=1e-2))
                torch.testing.assert_close(rep_state, ref_state,
                                           msg=f"is_kda={is_kda} L={L} step={step} state(flush)",
                                           **state_tols)

        if force_now:
            write_pos = torch.zeros_like(write_pos)
        else:
            write_pos = torch.where(write_pos == L - 1, torch.zeros_like(write_pos),
                                    write_pos + 1)

    assert flush_step_seen, f"flush boundary never hit for L={L}"


_CFG_IDS = ["H4-HV8", "H8-HV16"]
_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@device_param
@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("L", L_SWEEP, ids=[f"L{x}" for x in L_SWEEP])
@pytest.mark.parametrize("cfg", CONFIGS, ids=_CFG_IDS)
def test_replayssm_matches_gdn_packed_decode(device, cfg, L, dtype):
    _run_one(device, cfg, L, dtype)


@device_param
@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("L", L_SWEEP, ids=[f"L{x}" for x in L_SWEEP])
@pytest.mark.parametrize("cfg", CONFIGS, ids=_CFG_IDS)
def test_replayssm_matches_kda_packed_decode(device, cfg, L, dtype):
    _run_one(device, cfg, L, dtype, is_kda=True)


@device_param
@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("is_kda", [False, True], ids=["gdn", "kda"])
def test_force_flush_matches_reference(device, is_kda, dtype):
    cfg = dict(B=4, H=8, HV=16, K=128, V=128)
    _run_one(device, cfg, L=8, dtype=dtype, force_flush_steps=(3, 5, 11, 20), is_kda=is_kda)


@device_param
def test_flush_boundary_state_exact_l1(device):
    _run_one(device, dict(B=4, H=4, HV=8, K=128, V=128), L=1, dtype=torch.float32)


# ---- fp32 beta regression (test_decode_keeps_beta_in_fp32.py) -----------------------------------
@device_param
def test_linear_replayssm_decode_keeps_beta_in_fp32(device):
    replayssm_decode = peer_op("fused_recurrent_linear_replayssm_decode")
    dtype = torch.bfloat16
    K = V = 16
    mixed_qkv = torch.zeros((1, 2 * K + V), device=device, dtype=dtype)
    mixed_qkv[0, K] = 1.0  # k = e_0
    mixed_qkv[0, 2 * K] = 1.0  # v = e_0
    a = torch.zeros((1, 1), device=device, dtype=dtype)
    b = torch.full((1, 1), 0.5, device=device, dtype=dtype)
    params = torch.zeros((1,), device=device, dtype=dtype)
    state = torch.zeros((1, 1, V, K), device=device, dtype=torch.float32)
    out = torch.empty((1, 1, 1, V), device=device, dtype=dtype)
    L = 1  # write_pos == L-1: this step is a flush
    replayssm_decode(
        mixed_qkv=mixed_qkv,
        a=a,
        b=b,
        A_log=params,
        dt_bias=params,
        scale=1.0,
        initial_state=state,
        d_cache=torch.zeros((1, 1, L, V), device=device, dtype=dtype),
        k_cache=torch.zeros((1, 1, L, K), device=device, dtype=dtype),
        g_cache=torch.zeros((1, 1, L), device=device, dtype=torch.float32),
        out=out,
        ssm_state_indices=torch.zeros((1,), device=device, dtype=torch.int32),
        write_pos=torch.zeros((1,), device=device, dtype=torch.int32),
        nk=1,
    )
    expected = torch.zeros((1, V, K), device=device, dtype=torch.float32)
    expected[0, 0, 0] = torch.sigmoid(b.float()).item()
    torch.testing.assert_close(state[0], expected, atol=1e-6, rtol=1e-6,
                               msg="replayssm decode must keep sigmoid(beta) in fp32")


# ---- Helion KDA ReplaySSM contract (test_kda_helion.py) -----------------------------------------
@device_param
@pytest.mark.parametrize(
    ("state_dtype", "lower_bound", "v_heads"),
    [
        (torch.float32, None, 4),
        (torch.bfloat16, None, 4),
        (torch.bfloat16, -5.0, 4),
        (torch.bfloat16, None, 16),
    ],
    ids=["fp32", "bf16-small-head", "bf16-small-head-lower-bound", "bf16"],
)
def test_replayssm_decode_contract(device, state_dtype, lower_bound, v_heads):
    """Match the generic ReplaySSM's ring writes, forced flushes, and natural flushes."""
    generic = peer_op("fused_recurrent_linear_replayssm_decode")
    kda_packed = peer_op("fused_recurrent_kda_packed_decode")
    helion = peer_op("helion_fused_recurrent_kda_replayssm_decode")
    batch, q_heads, key_dim, value_dim = 3, 2, 128, 128
    cache_length, pool_size = 4, 5
    scale = key_dim ** -0.5
    manual_seed(721)
    a_log = torch.randn(v_heads, device=device, dtype=torch.float32) * 0.3
    dt_bias = torch.randn(v_heads, key_dim, device=device, dtype=torch.float32) * 0.1
    initial = torch.randn(pool_size, v_heads, value_dim, key_dim, device=device, dtype=state_dtype)
    triton_state = initial.clone()
    helion_state = initial.clone()
    triton_d = torch.zeros(pool_size, v_heads, cache_length, value_dim, device=device,
                           dtype=state_dtype)
    helion_d = triton_d.clone()
    triton_k = torch.zeros(pool_size, q_heads, cache_length, key_dim, device=device,
                           dtype=state_dtype)
    helion_k = triton_k.clone()
    triton_g = torch.zeros(pool_size, v_heads, cache_length, key_dim, device=device,
                           dtype=torch.float32)
    helion_g = triton_g.clone()
    indices = torch.tensor([3, -1, 1], device=device, dtype=torch.int32)
    write_pos = torch.zeros(batch, device=device, dtype=torch.int32)

    for step in range(7):
        generator = torch.Generator(device=device).manual_seed(900 + step)
        mixed_qkv = torch.randn(batch, 2 * q_heads * key_dim + v_heads * value_dim,
                                generator=generator, device=device, dtype=torch.bfloat16)
        gate = torch.randn(batch, v_heads, key_dim, generator=generator, device=device,
                           dtype=torch.bfloat16) * 0.5
        beta = torch.randn(batch, v_heads, generator=generator, device=device,
                           dtype=torch.bfloat16)
        triton_out = torch.empty(batch, 1, v_heads, value_dim, device=device, dtype=torch.bfloat16)
        helion_out = torch.empty_like(triton_out)
        force_flush = (torch.ones(batch, device=device, dtype=torch.int32) if step == 2 else None)

        if lower_bound is None:
            generic(
                mixed_qkv=mixed_qkv, a=gate, b=beta, A_log=a_log, dt_bias=dt_bias, scale=scale,
                initial_state=triton_state, d_cache=triton_d, k_cache=triton_k, g_cache=triton_g,
                out=triton_out, ssm_state_indices=indices, write_pos=write_pos,
                force_flush=force_flush, use_qk_l2norm_in_kernel=True, is_kda=True, nk=2,
            )
        else:
            kda_packed(
                mixed_qkv=mixed_qkv, a=gate.view(batch, -1), b=beta, A_log=a_log,
                dt_bias=dt_bias.view(-1), scale=scale, initial_state=triton_state, out=triton_out,
                ssm_state_indices=indices, use_qk_l2norm_in_kernel=True, lower_bound=lower_bound,
            )
        helion(
            mixed_qkv=mixed_qkv, a=gate, b=beta, A_log=a_log, dt_bias=dt_bias, scale=scale,
            initial_state=helion_state, d_cache=helion_d, k_cache=helion_k, g_cache=helion_g,
            out=helion_out, ssm_state_indices=indices, write_pos=write_pos,
            force_flush=force_flush, use_qk_l2norm_in_kernel=True, lower_bound=lower_bound,
        )

        torch.testing.assert_close(helion_out, triton_out, atol=5e-4, rtol=1e-2)
        assert torch.count_nonzero(helion_out[1]).item() == 0
        is_flush = force_flush is not None or write_pos[0].item() == cache_length - 1
        if is_flush:
            torch.testing.assert_close(helion_state.float(), triton_state.float(), atol=4e-3,
                                       rtol=1e-2)
            write_pos.zero_()
        else:
            write_pos.add_(1)

    assert torch.equal(helion_state[4], initial[4])


@device_param
@pytest.mark.parametrize(
    ("write_pos_values", "force_flush_values", "flushed_rows"),
    [
        ([0, 2, 3], None, [False, False, True]),
        ([1, 2, 1], [1, 0, 1], [True, False, True]),
    ],
    ids=["divergent-natural-flush", "mixed-forced-flush"],
)
def test_replayssm_per_row_flush_contract(device, write_pos_values, force_flush_values,
                                          flushed_rows):
    """Keep each row's cursor and partial-ring flush decision independent."""
    generic = peer_op("fused_recurrent_linear_replayssm_decode")
    helion = peer_op("helion_fused_recurrent_kda_replayssm_decode")
    batch, q_heads, v_heads, key_dim, value_dim = 3, 2, 4, 128, 128
    cache_length = 4
    manual_seed(977)
    mixed_qkv = torch.randn(batch, 2 * q_heads * key_dim + v_heads * value_dim, device=device,
                            dtype=torch.bfloat16)
    gate = torch.randn(batch, v_heads, key_dim, device=device, dtype=torch.bfloat16)
    beta = torch.randn(batch, v_heads, device=device, dtype=torch.bfloat16)
    a_log = torch.randn(v_heads, device=device, dtype=torch.float32) * 0.2
    dt_bias = torch.randn(v_heads, key_dim, device=device, dtype=torch.float32) * 0.1
    initial = torch.randn(batch, v_heads, value_dim, key_dim, device=device,
                          dtype=torch.float32) * 0.02
    d_cache = torch.randn(batch, v_heads, cache_length, value_dim, device=device,
                          dtype=torch.float32) * 0.02
    k_cache = torch.randn(batch, q_heads, cache_length, key_dim, device=device,
                          dtype=torch.float32)
    g_cache = -torch.rand(batch, v_heads, cache_length, key_dim, device=device,
                          dtype=torch.float32) * 0.1
    indices = torch.arange(batch, device=device, dtype=torch.int32)
    write_pos = torch.tensor(write_pos_values, device=device, dtype=torch.int32)
    force_flush = (None if force_flush_values is None
                   else torch.tensor(force_flush_values, device=device, dtype=torch.int32))

    triton_state = initial.clone()
    helion_state = initial.clone()
    triton_d, helion_d = d_cache.clone(), d_cache.clone()
    triton_k, helion_k = k_cache.clone(), k_cache.clone()
    triton_g, helion_g = g_cache.clone(), g_cache.clone()
    triton_out = torch.empty(batch, 1, v_heads, value_dim, device=device, dtype=torch.bfloat16)
    helion_out = torch.empty_like(triton_out)

    common_args = dict(
        mixed_qkv=mixed_qkv, a=gate, b=beta, A_log=a_log, dt_bias=dt_bias,
        scale=key_dim ** -0.5, ssm_state_indices=indices, write_pos=write_pos,
        force_flush=force_flush, use_qk_l2norm_in_kernel=True,
    )
    generic(**common_args, initial_state=triton_state, d_cache=triton_d, k_cache=triton_k,
            g_cache=triton_g, out=triton_out, is_kda=True, nk=2)
    helion(**common_args, initial_state=helion_state, d_cache=helion_d, k_cache=helion_k,
           g_cache=helion_g, out=helion_out)

    torch.testing.assert_close(helion_out, triton_out, atol=5e-4, rtol=1e-2)
    torch.testing.assert_close(helion_state, triton_state, atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(helion_d, triton_d, atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(helion_k, triton_k, atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(helion_g, triton_g, atol=1e-5, rtol=1e-4)
    for row, flushed in enumerate(flushed_rows):
        if flushed:
            assert not torch.equal(helion_state[row], initial[row])
        else:
            assert torch.equal(helion_state[row], initial[row])


@device_param
def test_replayssm_cuda_graph_replay_with_strided_state(device):
    """Keep cursor branches dynamic and preserve envelope-strided state I/O."""
    generic = peer_op("fused_recurrent_linear_replayssm_decode")
    helion = peer_op("helion_fused_recurrent_kda_replayssm_decode")
    batch, q_heads, v_heads, key_dim, value_dim = 2, 2, 4, 128, 128
    cache_length, pool_size = 4, 3
    state_size = v_heads * value_dim * key_dim
    slot_stride = state_size + 257
    storage = torch.empty(pool_size * slot_stride, device=device, dtype=torch.float32)
    state = torch.as_strided(storage, (pool_size, v_heads, value_dim, key_dim),
                             (slot_stride, value_dim * key_dim, key_dim, 1))
    manual_seed(811)
    initial = torch.randn_like(state)
    state.copy_(initial)
    mixed_qkv = torch.randn(batch, 2 * q_heads * key_dim + v_heads * value_dim, device=device,
                            dtype=torch.bfloat16)
    gate = torch.randn(batch, v_heads, key_dim, device=device, dtype=torch.bfloat16)
    beta = torch.randn(batch, v_heads, device=device, dtype=torch.bfloat16)
    a_log = torch.randn(v_heads, device=device, dtype=torch.float32)
    dt_bias = torch.randn(v_heads, key_dim, device=device, dtype=torch.float32)
    d_cache = torch.zeros(pool_size, v_heads, cache_length, value_dim, device=device,
                          dtype=torch.float32)
    k_cache = torch.zeros(pool_size, q_heads, cache_length, key_dim, device=device,
                          dtype=torch.float32)
    g_cache = torch.zeros(pool_size, v_heads, cache_length, key_dim, device=device,
                          dtype=torch.float32)
    indices = torch.tensor([2, 0], device=device, dtype=torch.int32)
    write_pos = torch.zeros(batch, device=device, dtype=torch.int32)
    force_flush = torch.zeros(batch, device=device, dtype=torch.int32)
    output = torch.empty(batch, 1, v_heads, value_dim, device=device, dtype=torch.bfloat16)

    def run_helion():
        helion(
            mixed_qkv=mixed_qkv, a=gate, b=beta, A_log=a_log, dt_bias=dt_bias,
            scale=key_dim ** -0.5, initial_state=state, d_cache=d_cache, k_cache=k_cache,
            g_cache=g_cache, out=output, ssm_state_indices=indices, write_pos=write_pos,
            force_flush=force_flush, use_qk_l2norm_in_kernel=True,
        )

    def reset():
        state.copy_(initial)
        d_cache.zero_()
        k_cache.zero_()
        g_cache.zero_()
        write_pos.fill_(1)

    use_graph = device == "cuda"
    if use_graph:
        run_helion()
        torch.cuda.synchronize()
        reset()
        force_flush.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_helion()

    reset()
    force_flush.copy_(torch.tensor([1, 0], device=device, dtype=torch.int32))
    reference_state = initial.clone()
    reference_out = torch.empty_like(output)
    generic(
        mixed_qkv=mixed_qkv, a=gate, b=beta, A_log=a_log, dt_bias=dt_bias, scale=key_dim ** -0.5,
        initial_state=reference_state, d_cache=d_cache.clone(), k_cache=k_cache.clone(),
        g_cache=g_cache.clone(), out=reference_out, ssm_state_indices=indices,
        write_pos=write_pos, force_flush=force_flush, use_qk_l2norm_in_kernel=True, is_kda=True,
        nk=2,
    )
    if use_graph:
        graph.replay()
        torch.cuda.synchronize()
    else:
        run_helion()

    torch.testing.assert_close(output, reference_out, atol=5e-4, rtol=1e-2)
    torch.testing.assert_close(state, reference_state, atol=2e-3, rtol=1e-3)


# ---- SGLang surface facts (from the source, not SGLang tests) -----------------------------------
def _tiny_gdn(device):
    manual_seed(5)
    B, H, HV, K, V, L = 2, 1, 2, 16, 16, 4
    x = torch.randn(B, 2 * H * K + HV * V, device=device)
    a = torch.randn(B, HV, device=device) * 0.5
    b = torch.randn(B, HV, device=device)
    A_log = torch.randn(HV, device=device) * 0.3
    dt = torch.randn(HV, device=device) * 0.1
    st = torch.randn(3, HV, V, K, device=device) * 0.1
    d = torch.zeros(3, HV, L, V, device=device)
    k = torch.zeros(3, H, L, K, device=device)
    g = torch.zeros(3, HV, L, device=device)
    out = torch.empty(B, 1, HV, V, device=device)
    idx = torch.tensor([2, 0], device=device, dtype=torch.int32)
    wp = torch.zeros(B, device=device, dtype=torch.int32)
    return x, a, b, A_log, dt, K ** -0.5, st, d, k, g, out, idx, wp


def _clone(args):
    return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in args)


@device_param
def test_surface_returns_out_and_state(device):
    """SGLang returns ``(out, initial_state)``, the caller's tensors."""
    op = peer_op("fused_recurrent_linear_replayssm_decode")
    args = _tiny_gdn(device)
    res = op(*args)
    assert isinstance(res, tuple) and len(res) == 2
    assert res[0] is args[10] and res[1] is args[6]


@device_param
def test_surface_positional_flags(device):
    """SGLang's flags are positional: force_flush, lower_bound, use_qk_l2norm_in_kernel, is_kda."""
    op = peer_op("fused_recurrent_linear_replayssm_decode")
    a1 = _tiny_gdn(device)
    a2 = _clone(a1)
    op(*a1, None, None, True, False)
    op(*a2, force_flush=None, lower_bound=None, use_qk_l2norm_in_kernel=True, is_kda=False)
    assert torch.equal(a1[10], a2[10]) and torch.equal(a1[7], a2[7])


@device_param
@pytest.mark.parametrize("knob", [dict(nk=1), dict(block_v=16), dict(num_warps=4),
                                  dict(num_stages=2)], ids=lambda d: next(iter(d)))
def test_surface_tuning_keywords_accepted(device, knob):
    """SGLang's Triton tuning keywords are accepted and change nothing."""
    op = peer_op("fused_recurrent_linear_replayssm_decode")
    a1 = _tiny_gdn(device)
    a2 = _clone(a1)
    op(*a1)
    op(*a2, **knob)
    assert torch.equal(a1[10], a2[10])


@device_param
@pytest.mark.parametrize("mode", [dict(circular_replay=True), dict(prefix_gate_cache=True),
                                  dict(predecayed_k_cache=True)], ids=lambda d: next(iter(d)))
def test_surface_mode_keywords_clear(device, mode):
    """SGLang's mode keywords exist; a value deltastate does not implement is rejected with a
    ValueError/NotImplementedError naming the keyword (never a TypeError, never ignored)."""
    op = peer_op("fused_recurrent_linear_replayssm_decode")
    args = _tiny_gdn(device)
    name = next(iter(mode))
    try:
        op(*args, **mode)
    except (ValueError, NotImplementedError) as e:
        assert name in str(e) or "circular" in str(e) or "Pre-decayed" in str(e), str(e)
    except TypeError as e:
        pytest.fail(f"`{name}` is not accepted: {e}")


def _ring_error_cases():
    # (argument index in _tiny_gdn's tuple, replacement builder, SGLang 03a70bf text)
    return [
        pytest.param(8, lambda d: torch.zeros(3, 1, 3, 16, device=d),
                     "`k_cache` shape must be (3, 1, 4, 16) (got (3, 1, 3, 16)).", id="k_cache"),
        pytest.param(9, lambda d: torch.zeros(3, 2, 5, device=d),
                     "`g_cache` shape must be (3, 2, 4) (got (3, 2, 5)).", id="g_cache"),
        pytest.param(9, lambda d: torch.zeros(3, 2, 4, device=d, dtype=torch.float16),
                     "`g_cache` must be float32 (got torch.float16).", id="g_cache-dtype"),
        pytest.param(7, lambda d: torch.zeros(2, 2, 4, 16, device=d),
                     "`d_cache` shape must be (3, 2, 4, 16) (got (2, 2, 4, 16)).",
                     id="d_cache-slots"),
    ]


@device_param
@pytest.mark.parametrize(("pos", "make", "text"), _ring_error_cases())
def test_surface_ring_error_texts(device, pos, make, text):
    """SGLang's exact ValueError texts for the ring shapes and the g ring dtype (03a70bf)."""
    import re

    op = peer_op("fused_recurrent_linear_replayssm_decode")
    args = list(_tiny_gdn(device))
    args[pos] = make(device)
    with pytest.raises(ValueError, match="^" + re.escape(text) + "$"):
        op(*args)
