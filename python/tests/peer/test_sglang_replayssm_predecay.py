"""SGLang's tests of the circular ReplaySSM decode modes, ported to deltastate's
``fused_recurrent_linear_replayssm_decode``.

Source (sgl-project/sglang):
  * test/registered/attention/unittests/kda/test_replayssm_predecay.py
    @ 25e3dfbcf0dde0bd4c7f35081f9b70b434cd07ed ("Correctness tests for bounded-gate KDA ReplaySSM
    pre-decay decode": circular replay with cache_base, prefix gates and pre-decayed keys, its
    caller cursor protocol with history checkpoints at natural flushes and full folds at forced
    ones).
  Function: python/sglang/kernels/ops/attention/fla/fused_recurrent_linear_replayssm.py
  @ 03a70bf334be953130693f4f67453c33ca7f3290 (see docs/PEERS.md).

What changed in the port:
  * The op is deltastate's ``fused_recurrent_linear_replayssm_decode``, called with SGLang's
    keywords (including its Triton tuning keywords ``block_v``, ``num_warps``, ``num_stages``,
    ``nk``, which deltastate accepts and ignores).
  * "cuda" became a device parameter (deltastate's CUDA ring-modes kernel, on a GPU machine).
  * Random inputs come from a CPU ``torch.Generator`` with SGLang's seeds (SGLang seeds a CUDA
    generator, so the values differ); A_log/dt_bias of the wrap test are drawn after
    ``torch.manual_seed(0)`` (SGLang draws them from the unseeded global generator).
  * test_predecay_cuda_graph_replay captures a CUDA graph; on CPU (no graphs) it runs the same
    in-place buffers eagerly, refilled every step as the graph replay does.
  * The reference step (``_reference_step``), sizes, seeds, tolerances and assertions are
    SGLang's.

Not ported: test_predecay_cursor_snapshot_advance_and_padding (SGLang's backend helper
``_advance_replayssm_predecay_cursor``; deltastate leaves cursor advance in circular mode to the
caller, and ``_advance`` below is that protocol) and
test_predecay_fresh_slot_resets_independent_cursor_fields (SGLang's HybridReqToTokenPool with a
per-slot cache_base table; deltastate's StatePool has none).
"""

import pytest

torch = pytest.importorskip("torch")

from _peer_common import device_param, manual_seed, peer_op  # noqa: E402

def _inputs(batch, heads, dim, dtype, seed, device):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=generator, dtype=dtype)
    k = torch.randn(batch, heads, dim, generator=generator, dtype=dtype)
    v = torch.randn(batch, heads, dim, generator=generator, dtype=dtype)
    a = (torch.randn(batch, heads, dim, generator=generator, dtype=dtype) * 0.25).contiguous()
    b = torch.randn(batch, heads, generator=generator, dtype=dtype)
    mixed = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=-1)
    return mixed.to(device), a.to(device), b.to(device)


def _reference_step(mixed_qkv, a, b, a_log, dt_bias, state, lower_bound):
    """SGLang's torch reference: one exact KDA step (safe gate, fp32 beta) in place on state."""
    batch, heads, value_dim, key_dim = state.shape
    width = heads * key_dim
    q, k, v = mixed_qkv.split((width, width, heads * value_dim), dim=-1)
    q = q.reshape(batch, heads, key_dim).float()
    k = k.reshape(batch, heads, key_dim).float()
    v = v.reshape(batch, heads, value_dim).float()
    q = q / torch.sqrt(torch.sum(q * q, dim=-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt(torch.sum(k * k, dim=-1, keepdim=True) + 1e-6)
    q = q * (key_dim ** -0.5)
    gate = lower_bound * torch.sigmoid(torch.exp(a_log)[None, :, None] * (a.float() + dt_bias[None]))
    alpha = torch.exp(gate)
    beta = torch.sigmoid(b.float())
    decayed = state * alpha.unsqueeze(-2)
    delta = beta.unsqueeze(-1) * (v - torch.einsum("bhvk,bhk->bhv", decayed, k))
    state.copy_(decayed + delta.unsqueeze(-1) * k.unsqueeze(-2))
    return torch.einsum("bhvk,bhk->bhv", state, q)


def _allocate(batch, heads, dim, cache_len, ring_dtype, device):
    generator = torch.Generator().manual_seed(20260821)
    state = torch.randn(batch, heads, dim, dim, generator=generator, dtype=torch.float32) * 0.03
    return {
        "state": state.to(device),
        "d": torch.zeros(batch, heads, cache_len, dim, device=device, dtype=ring_dtype),
        "k": torch.zeros(batch, heads, cache_len, dim, device=device, dtype=ring_dtype),
        "g": torch.zeros(batch, heads, cache_len, dim, device=device, dtype=torch.float32),
        "base": torch.zeros(batch, device=device, dtype=torch.int32),
    }


def _decode(replay, mixed_qkv, a, b, a_log, dt_bias, write_pos, force_flush):
    op = peer_op("fused_recurrent_linear_replayssm_decode")
    batch, heads, dim = a.shape
    out = mixed_qkv.new_empty(batch, 1, heads, dim)
    op(
        mixed_qkv=mixed_qkv,
        a=a,
        b=b,
        A_log=a_log,
        dt_bias=dt_bias,
        scale=dim ** -0.5,
        initial_state=replay["state"],
        d_cache=replay["d"],
        k_cache=replay["k"],
        g_cache=replay["g"],
        out=out,
        ssm_state_indices=torch.arange(batch, device=mixed_qkv.device, dtype=torch.int32),
        write_pos=write_pos,
        cache_base=replay["base"],
        force_flush=force_flush,
        lower_bound=-5.0,
        use_qk_l2norm_in_kernel=True,
        is_kda=True,
        block_v=16 if batch == 1 else 32,
        num_warps=2 if batch == 1 else 1,
        num_stages=2,
        nk=1,
        circular_replay=True,
        prefix_gate_cache=True,
        predecayed_k_cache=True,
    )
    return out


def _advance(replay, write_pos, force_flush):
    """SGLang's caller protocol: forced -> (base 0, wp 0); natural history flush -> (base
    (base + wp) mod L, wp 1); otherwise wp + 1."""
    natural = write_pos == replay["d"].shape[2] - 1
    forced = force_flush.bool()
    history_flush = natural & ~forced
    replay["base"].copy_(
        torch.where(
            forced,
            torch.zeros_like(replay["base"]),
            torch.where(history_flush, (replay["base"] + write_pos) % replay["d"].shape[2],
                        replay["base"]),
        ))
    return torch.where(forced, torch.zeros_like(write_pos),
                       torch.where(history_flush, torch.ones_like(write_pos), write_pos + 1))


@device_param
def test_predecay_accepts_page_major_slot_stride(device):
    batch, heads, dim, cache_len = 2, 4, 32, 4
    replay = _allocate(batch, heads, dim, cache_len, torch.bfloat16, device)
    backing = torch.zeros(batch, 2, heads, dim, dim, device=device, dtype=torch.float32)
    replay["state"] = backing[:, 0]
    assert not replay["state"].is_contiguous()
    assert replay["state"].stride()[1:] == (dim * dim, dim, 1)
    mixed, a, b = _inputs(batch, heads, dim, torch.bfloat16, 7000, device)
    out = _decode(replay, mixed, a, b, torch.zeros(heads, device=device),
                  torch.zeros(heads, dim, device=device),
                  torch.zeros(batch, device=device, dtype=torch.int32),
                  torch.zeros(batch, device=device, dtype=torch.int32))
    assert torch.isfinite(out).all()


@device_param
@pytest.mark.parametrize("cache_len", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("ring_dtype", [torch.bfloat16, torch.float32])
def test_predecay_matches_recurrence_across_wraps(device, cache_len, ring_dtype):
    batch, heads, dim = 3, 4, 32
    replay = _allocate(batch, heads, dim, cache_len, ring_dtype, device)
    reference_state = replay["state"].clone()
    cursor = torch.zeros(batch, device=device, dtype=torch.int32)
    manual_seed(0)
    a_log = (torch.randn(heads) * 0.2).float().contiguous().to(device)
    dt_bias = (torch.randn(heads, dim) * 0.1).float().contiguous().to(device)

    for step in range(3 * cache_len + 5):
        mixed_qkv, a, b = _inputs(batch, heads, dim, torch.bfloat16, 1000 + step, device)
        expected = _reference_step(mixed_qkv, a, b, a_log, dt_bias, reference_state, -5.0)
        write_pos = cursor.clone()
        force_flush = torch.zeros_like(write_pos)
        if step in (2, cache_len + 2):
            force_flush[1] = 1
        actual = _decode(replay, mixed_qkv, a, b, a_log, dt_bias, write_pos, force_flush)
        torch.testing.assert_close(actual[:, 0].float(), expected.to(torch.bfloat16).float(),
                                   atol=3e-2, rtol=3e-2)
        if force_flush.any():
            mask = force_flush.bool()
            torch.testing.assert_close(replay["state"][mask], reference_state[mask], atol=5e-2,
                                       rtol=3e-2)
        cursor = _advance(replay, write_pos, force_flush)


@device_param
def test_predecay_cuda_graph_replay(device):
    """SGLang captures one decode in a CUDA graph and replays it over 9 steps with the inputs,
    cursor and force_flush refilled in place; on CPU the same buffers run eagerly."""
    batch, heads, dim, cache_len = 2, 4, 32, 4
    replay = _allocate(batch, heads, dim, cache_len, torch.bfloat16, device)
    initial_state = replay["state"].clone()
    reference_state = initial_state.clone()
    a_log = torch.zeros(heads, device=device)
    dt_bias = torch.zeros(heads, dim, device=device)
    mixed, a, b = _inputs(batch, heads, dim, torch.bfloat16, 8000, device)
    write_pos = torch.zeros(batch, device=device, dtype=torch.int32)
    force_flush = torch.zeros_like(write_pos)

    _decode(replay, mixed, a, b, a_log, dt_bias, write_pos, force_flush)  # the warm-up call
    replay["state"].copy_(initial_state)
    replay["d"].zero_()
    replay["k"].zero_()
    replay["g"].zero_()
    replay["base"].zero_()
    graph = None
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _decode(replay, mixed, a, b, a_log, dt_bias, write_pos, force_flush)
        replay["state"].copy_(initial_state)
        replay["d"].zero_()
        replay["k"].zero_()
        replay["g"].zero_()
        replay["base"].zero_()

    cursor = torch.zeros_like(write_pos)
    for step in range(9):
        new_mixed, new_a, new_b = _inputs(batch, heads, dim, torch.bfloat16, 8100 + step, device)
        expected = _reference_step(new_mixed, new_a, new_b, a_log, dt_bias, reference_state, -5.0)
        mixed.copy_(new_mixed)
        a.copy_(new_a)
        b.copy_(new_b)
        write_pos.copy_(cursor)
        force_flush.zero_()
        if step == 2:
            force_flush[0] = 1
        if graph is not None:
            graph.replay()
        else:
            out = _decode(replay, mixed, a, b, a_log, dt_bias, write_pos, force_flush)
        torch.testing.assert_close(out[:, 0].float(), expected.to(torch.bfloat16).float(),
                                   atol=3e-2, rtol=3e-2)
        cursor = _advance(replay, cursor, force_flush)


@device_param
@pytest.mark.parametrize(("heads", "value_heads", "lower_bound", "match"), [
    (2, 4, -5.0, "one K head"),
    (4, 4, None, "finite negative"),
    (4, 4, -6.0, "inverse-prefix scaling is unsafe"),
])
def test_predecay_rejects_unsafe_configuration(device, heads, value_heads, lower_bound, match):
    op = peer_op("fused_recurrent_linear_replayssm_decode")
    batch, dim, cache_len = 2, 32, 16
    mixed, a, b = _inputs(batch, value_heads, dim, torch.bfloat16, 9000, device)
    if heads != value_heads:
        width = heads * dim
        mixed = torch.cat((mixed[:, :width],
                           mixed[:, value_heads * dim:value_heads * dim + width],
                           mixed[:, 2 * value_heads * dim:]), dim=-1).contiguous()
    state = torch.zeros(batch, value_heads, dim, dim, device=device)
    with pytest.raises(ValueError, match=match):
        op(
            mixed_qkv=mixed,
            a=a,
            b=b,
            A_log=torch.zeros(value_heads, device=device),
            dt_bias=torch.zeros(value_heads, dim, device=device),
            scale=dim ** -0.5,
            initial_state=state,
            d_cache=torch.zeros(batch, value_heads, cache_len, dim, device=device,
                                dtype=torch.bfloat16),
            k_cache=torch.zeros(batch, heads, cache_len, dim, device=device, dtype=torch.bfloat16),
            g_cache=torch.zeros(batch, value_heads, cache_len, dim, device=device),
            out=torch.empty(batch, 1, value_heads, dim, device=device, dtype=torch.bfloat16),
            ssm_state_indices=torch.arange(batch, device=device, dtype=torch.int32),
            write_pos=torch.zeros(batch, device=device, dtype=torch.int32),
            cache_base=torch.zeros(batch, device=device, dtype=torch.int32),
            lower_bound=lower_bound,
            is_kda=True,
            circular_replay=True,
            prefix_gate_cache=True,
            predecayed_k_cache=True,
        )
