"""SGLang's fold-every-commit tests, ported to ``deltastate.fused_sigmoid_gating_delta_rule_update``
(its ``cache_ring``) and ``deltastate.commit_gdn_replayssm_fold_all_layers``.

Source (sgl-project/sglang):
  * test/registered/attention/unittests/gdn/test_gdn_replayssm_spec_fold.py
    @ 05128bf1afb3613140a5ea0c32bc8b79d9796761 (TestGdnReplayssmSpecFold: every test).
Functions: python/sglang/kernels/ops/attention/fla/fused_sigmoid_gating_recurrent.py
@ 00e1106f4ab55cfb7dceeba2dfbc04b0cc40bb6f (``cache_ring``, ``replayssm_rawv`` .. ``replayssm_beta``)
and python/sglang/kernels/ops/attention/fla/gdn_replayssm_spec_fold.py
@ 250b57e9470b06d2a01c9189bc9ca7258a075696 (``commit_gdn_replayssm_fold_all_layers``); the KDA
twins (``commit_kda_replayssm_spec[_all_layers]``, kda_replayssm_spec_decode.py
@ 17f89f31cefde8bccdcfe3a875cc4c5446f34e6b) have no SGLang test; their signatures are checked
here and their semantics in python/tests/test_replayssm_fold.py.

What changed in the port:
  * Every assertion is SGLang's ``torch.equal``: the design contract is bitwise parity with the
    recurrent verify's per-draft snapshots, and deltastate's fold runs the recurrent op's own token
    step, so the port keeps it exactly.
  * unittest became pytest; "cuda" became a device parameter. The fold-every-commit verify ring
    and commit are CPU-only in deltastate so far, so only CPU runs.
  * Sizes, seeds (torch generators with SGLang's seeds, on the CPU) and the 256-iteration chain
    are SGLang's.
  * The state is SGLang's [NUM_SLOTS, HV, K, V] draw, read as deltastate's [slots, HV, V, K]
    (K == V here, as in the test).
"""

import pytest

torch = pytest.importorskip("torch")

from _peer_common import NO_DEFAULT, P, check_signature, peer_op

B, T = 3, 4
H, HV = 4, 8
K = V = 64
NUM_SLOTS = 8
DEVICE = "cpu"


def _make_window(step_seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(step_seed)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=DEVICE, dtype=dtype, generator=gen)

    return {"q": rand(1, B * T, H, K), "k": rand(1, B * T, H, K), "v": rand(1, B * T, HV, V),
            "a": rand(B * T, HV), "b": rand(B * T, HV)}


def _run_verify(inputs, gating, state, slots, *, snapshots=None, rings=None):
    kwargs = {}
    if snapshots is not None:
        kwargs.update(intermediate_states_buffer=snapshots, intermediate_state_indices=slots,
                      cache_steps=T)
    if rings is not None:
        # Per-layer views, matching the backend's mamba2_layer_cache slices.
        kwargs.update(cache_ring=True, replayssm_rawv=rings["rawv"][0],
                      replayssm_rawk=rings["rawk"][0], replayssm_g=rings["g"][0],
                      replayssm_beta=rings["beta"][0])
    cu_seqlens = torch.arange(0, B * T + 1, step=T, dtype=torch.int32, device=DEVICE)
    return peer_op("fused_sigmoid_gating_delta_rule_update")(
        A_log=gating["A_log"], dt_bias=gating["dt_bias"], softplus_beta=1.0,
        softplus_threshold=20.0, q=inputs["q"], k=inputs["k"], v=inputs["v"], b=inputs["b"],
        a=inputs["a"], initial_state_source=state, initial_state_indices=slots,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True, is_kda=False,
        disable_state_update=True, **kwargs)


def _make_rings(dtype=torch.bfloat16):
    return {"rawv": torch.zeros(1, NUM_SLOTS, HV, T, V, device=DEVICE, dtype=dtype),
            "rawk": torch.zeros(1, NUM_SLOTS, H, T, K, device=DEVICE, dtype=dtype),
            "g": torch.zeros(1, NUM_SLOTS, HV, T, device=DEVICE, dtype=torch.float32),
            "beta": torch.zeros(1, NUM_SLOTS, HV, T, device=DEVICE, dtype=torch.float32)}


def _fold(state, rings, slots, accept_lens, track_slots=None, track_steps=None):
    peer_op("commit_gdn_replayssm_fold_all_layers")(
        checkpoint_state=state, rawv_cache=rings["rawv"], rawk_cache=rings["rawk"],
        g_cache=rings["g"], beta_cache=rings["beta"], ssm_state_indices=slots,
        accept_lens=accept_lens, max_cache_len=T, num_k_heads=H,
        mamba_track_indices=track_slots, mamba_steps_to_track=track_steps, null_block_id=-1)


@pytest.fixture
def setup():
    torch.manual_seed(0)
    gating = {"A_log": torch.randn(HV, device=DEVICE) * 0.1,
              "dt_bias": torch.randn(HV, device=DEVICE) * 0.1}
    slots = torch.tensor([5, 2, 7], dtype=torch.int32, device=DEVICE)
    accept_lens = torch.tensor([3, 1, 4], dtype=torch.int32, device=DEVICE)
    return gating, slots, accept_lens


def _state(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    return torch.randn(NUM_SLOTS, HV, K, V, device=DEVICE, dtype=dtype, generator=gen)


def test_ring_write_does_not_change_verify_output(setup):
    gating, slots, _ = setup
    for dtype in (torch.float32, torch.bfloat16):
        state = _state(dtype)
        inputs = _make_window(11)
        out_plain = _run_verify(inputs, gating, state.clone(), slots)
        out_ring = _run_verify(inputs, gating, state.clone(), slots, rings=_make_rings())
        assert torch.equal(out_plain, out_ring), f"{dtype=}"


def test_ring_write_accepts_strided_qkv_views(setup):
    gating, slots, accept_lens = setup
    state = _state(torch.float32)
    inputs = _make_window(12)
    packed_qkv = torch.cat([inputs["q"].reshape(B * T, -1), inputs["k"].reshape(B * T, -1),
                            inputs["v"].reshape(B * T, -1)], dim=-1)
    q, k, v = packed_qkv.split([H * K, H * K, HV * V], dim=-1)
    strided_inputs = {**inputs, "q": q.view(1, B * T, H, K), "k": k.view(1, B * T, H, K),
                      "v": v.view(1, B * T, HV, V)}
    contiguous_inputs = {**inputs, "q": strided_inputs["q"].contiguous(),
                         "k": strided_inputs["k"].contiguous(),
                         "v": strided_inputs["v"].contiguous()}
    assert strided_inputs["q"].stride(1) == packed_qkv.shape[-1]
    assert not strided_inputs["q"].is_contiguous()

    contiguous_rings = _make_rings()
    strided_rings = _make_rings()
    contiguous_state = state.clone().unsqueeze(0).contiguous()
    strided_state = state.clone().unsqueeze(0).contiguous()
    contiguous_out = _run_verify(contiguous_inputs, gating, contiguous_state[0], slots,
                                 rings=contiguous_rings)
    strided_out = _run_verify(strided_inputs, gating, strided_state[0], slots,
                              rings=strided_rings)

    assert torch.equal(contiguous_out, strided_out)
    for name in contiguous_rings:
        assert torch.equal(contiguous_rings[name], strided_rings[name]), name

    _fold(contiguous_state, contiguous_rings, slots, accept_lens)
    _fold(strided_state, strided_rings, slots, accept_lens)
    assert torch.equal(contiguous_state, strided_state)


def test_fold_matches_snapshot_baseline_bitwise(setup):
    gating, slots, accept_lens = setup
    for dtype in (torch.float32, torch.bfloat16):
        state = _state(dtype)
        inputs = _make_window(22)

        snapshots = torch.zeros(NUM_SLOTS, T, HV, K, V, device=DEVICE, dtype=dtype)
        _run_verify(inputs, gating, state.clone(), slots, snapshots=snapshots)

        fold_state = state.clone().unsqueeze(0).contiguous()
        rings = _make_rings()
        _run_verify(inputs, gating, fold_state[0], slots, rings=rings)
        _fold(fold_state, rings, slots, accept_lens)

        for s, n in zip(slots.tolist(), accept_lens.tolist()):
            assert torch.equal(snapshots[s, n - 1], fold_state[0, s]), \
                f"{dtype=} slot={s} accept_len={n}"
        untouched = set(range(NUM_SLOTS)) - set(slots.tolist())
        for s in untouched:
            assert torch.equal(fold_state[0, s], state[s])


def test_track_store_and_null_slots(setup):
    gating, slots, accept_lens = setup
    dtype = torch.float32
    state = _state(dtype)
    inputs = _make_window(33)

    snapshots = torch.zeros(NUM_SLOTS, T, HV, K, V, device=DEVICE, dtype=dtype)
    _run_verify(inputs, gating, state.clone(), slots, snapshots=snapshots)

    fold_state = state.clone().unsqueeze(0).contiguous()
    rings = _make_rings()
    _run_verify(inputs, gating, fold_state[0], slots, rings=rings)

    track_slots = torch.tensor([1, 0, 3], dtype=torch.int64, device=DEVICE)
    track_steps = torch.tensor([1, -1, 2], dtype=torch.int64, device=DEVICE)
    slots_with_null = slots.clone()
    slots_with_null[1] = -1
    _fold(fold_state, rings, slots_with_null, accept_lens, track_slots=track_slots,
          track_steps=track_steps)

    assert torch.equal(fold_state[0, 1], snapshots[5, 1])
    assert torch.equal(fold_state[0, 3], snapshots[7, 2])
    # Null slot: neither committed nor tracked (track step 1 is masked
    # to -1 only for row 1's -1 step; row 1's slot itself was nulled).
    assert torch.equal(fold_state[0, 2], state[2])
    assert torch.equal(fold_state[0, 0], state[0])


def test_long_chain_no_accumulation(setup):
    """256 chained verify->commit iterations stay bitwise equal to the baseline chain at every
    iteration (fp32 + bf16): no error channel can accumulate with sequence length."""
    gating, slots, _ = setup
    num_iters = 256
    for dtype in (torch.float32, torch.bfloat16):
        base_state = _state(dtype)
        fold_state = base_state.clone().unsqueeze(0).contiguous()
        snapshots = torch.zeros(NUM_SLOTS, T, HV, K, V, device=DEVICE, dtype=dtype)
        gen = torch.Generator().manual_seed(7)
        for it in range(num_iters):
            inputs = _make_window(1000 + it)
            accept_lens = torch.randint(1, T + 1, (B,), generator=gen).to(device=DEVICE,
                                                                          dtype=torch.int32)

            out_base = _run_verify(inputs, gating, base_state, slots, snapshots=snapshots)
            for s, n in zip(slots.tolist(), accept_lens.tolist()):
                base_state[s] = snapshots[s, n - 1]

            rings = _make_rings()
            out_fold = _run_verify(inputs, gating, fold_state[0], slots, rings=rings)
            _fold(fold_state, rings, slots, accept_lens)

            assert torch.equal(out_base, out_fold), f"{dtype=} {it=}"
            assert torch.equal(base_state, fold_state[0]), f"{dtype=} {it=}"


# ---- signatures (SGLang's, as read at the commits above) -------------------------------------
_FOLD_ALL = [("checkpoint_state", P, NO_DEFAULT), ("rawv_cache", P, NO_DEFAULT),
             ("rawk_cache", P, NO_DEFAULT), ("g_cache", P, NO_DEFAULT),
             ("beta_cache", P, NO_DEFAULT), ("ssm_state_indices", P, NO_DEFAULT),
             ("accept_lens", P, NO_DEFAULT), ("max_cache_len", P, NO_DEFAULT),
             ("num_k_heads", P, NO_DEFAULT), ("mamba_track_indices", P, None),
             ("mamba_steps_to_track", P, None), ("use_qk_l2norm_in_kernel", P, True),
             ("null_block_id", P, -1)]
_KDA = [(n if n != "g_cache" else "gk_cache", k, d if n != "null_block_id" else 0)
        for n, k, d in _FOLD_ALL]


@pytest.mark.parametrize("name,expected", [
    ("commit_gdn_replayssm_fold_all_layers", _FOLD_ALL),
    ("commit_kda_replayssm_spec", _KDA),
    ("commit_kda_replayssm_spec_all_layers", _KDA),
])
def test_signatures_match_sglang(name, expected):
    check_signature(peer_op(name), expected)


def test_verify_cache_ring_keywords_and_asserts(setup):
    """fused_sigmoid_gating_delta_rule_update's cache_ring keywords, after
    retrieve_parent_token, and SGLang's asserts on them."""
    import inspect
    names = list(inspect.signature(peer_op("fused_sigmoid_gating_delta_rule_update")).parameters)
    i = names.index("retrieve_parent_token")
    assert names[i + 1:i + 6] == ["cache_ring", "replayssm_rawv", "replayssm_rawk",
                                  "replayssm_g", "replayssm_beta"]
    gating, slots, _ = setup
    rings = _make_rings()
    with pytest.raises(AssertionError, match="cache_ring expects per-layer ring views"):
        peer_op("fused_sigmoid_gating_delta_rule_update")(
            gating["A_log"], _make_window(1)["a"], gating["dt_bias"], 1.0, 20.0,
            *(_make_window(1)[n] for n in ("q", "k", "v", "b")), _state(torch.float32), slots,
            cu_seqlens=torch.arange(0, B * T + 1, T, dtype=torch.int32),
            use_qk_l2norm_in_kernel=True, disable_state_update=True, cache_ring=True,
            replayssm_rawv=rings["rawv"], replayssm_rawk=rings["rawk"][0],
            replayssm_g=rings["g"][0], replayssm_beta=rings["beta"][0])
