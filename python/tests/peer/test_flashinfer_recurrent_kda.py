"""FlashInfer's ``recurrent_kda`` tests, ported to ``deltastate.recurrent_kda``.

Source (flashinfer-ai/flashinfer): tests/kda/test_recurrent_kda.py
@ 3c9da4747db034d97e2d235b0fa008c9bddef1bc (the speculative tests
@ fb28d7242b3506a2348265962041acc1fb56cca4). Ported: test_recurrent_kda_vs_naive,
test_recurrent_kda_vs_fla, test_vllm_decode, test_standard_decode_state_indices_update_pool,
test_vllm_padded_cuda_graph, test_non_compact_state_stride, test_non_contiguous_gate_stride.
Function: flashinfer/kda.py::recurrent_kda (the ``flashinfer.recurrent_kda`` facade) and
flashinfer/kda_kernels/recurrent_kda.py::run_recurrent_kda @ fb28d7242b3506a2348265962041acc1fb56cca4
(see docs/PEERS.md).

What changed in the port:
  * The op is ``deltastate.recurrent_kda`` called exactly as FlashInfer's test calls
    ``flashinfer.kda_decode.recurrent_kda`` (keywords only, FlashInfer's names).
  * FlashInfer skips the file without an SM100 GPU; here it runs on CPU tensors and, when
    available, CUDA tensors (``device`` parameter).
  * References: FlashInfer's inline ``naive_recurrent_kda`` / ``naive_kda_gate`` /
    ``naive_kda_lowerbound_gate`` (H == HV in every case) are the same computations as FLA's
    naive references; the rewritten FLA versions in _peer_common are used (for H == HV and a
    given A_log they are identical, including the bf16 output rounding).
    test_recurrent_kda_vs_fla's oracle is FLA's Triton ``fused_recurrent_kda``; the port uses
    FLA's naive reference with the same inputs (in-kernel L2 norm done on the reference's input).
  * FlashInfer's ``assert_close`` (NaN checks + torch.testing.assert_close, default atol = rtol =
    5e-3) is kept, as are all sizes, seeds, tolerances and assertions.
  * Speculative decode (recurrent_kda with num_spec_tokens runs deltastate's verify): ported
    test_spec_decode_basic, test_spec_decode_num_accepted_tokens (with its clamping of values
    above 1 + S), test_spec_decode_nat_heterogeneous, test_spec_decode_nat_with_padding,
    test_spec_decode_gate_modes, test_spec_decode_all_padded, test_spec_decode_batched_auto_ssi,
    test_spec_decode_batched_vs_cuseqlens, test_spec_decode_non_compact_state,
    test_spec_decode_nat_equals_one_matches_no_nat, test_spec_decode_checkpoint_correctness,
    test_spec_decode_separate_source_and_beta_logits (the separate read-only source pool,
    initial_state_source / initial_state_indices; its strided source and index views kept) and
    the helpers make_spec_decode_inputs / spec_decode_naive_reference /
    assert_spec_states (the naive reference is _peer_common's FLA one, as above), same sizes,
    seeds, tolerances and assertions, and test_spec_decode_shape_validation; the surface test
    test_surface_spec_decode_shim_slots_text pins one more text read from the source, and
    test_surface_separate_source_texts / test_surface_separate_source_padded_row_and_nat pin
    the separate source's checks (FlashInfer's texts, deltastate's dtype rule, the rejection
    outside speculative decode) and deltastate's rules (a source row < 0 is padding; FlashInfer
    reads row 0; num_accepted_tokens not read with a source, as FlashInfer's kernel). Not
    ported: the tests of its kernel schedule and CUDA-graph padding specifics
    (test_kernel_schedule, test_spec_decode_padded_cuda_graph, test_t1_cu_seqlens_*), and the
    remaining test_spec_decode_validate_slots_collision (FlashInfer's own slot-collision
    validator), _cu_seqlens_validation (a shape check only), and _nat_gate_modes, left for a
    later port.
  * "Surface" tests at the end are not FlashInfer tests: they pin FlashInfer call-surface facts
    read from its source (signature; in-place state; return values with and without indices;
    ``initial_state=None`` with indices allocating).
"""

import inspect
import re

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F

from _peer_common import (NO_DEFAULT, P, check_signature, device_param,
                          fla_naive_kda_gate, fla_naive_kda_lowerbound_gate,
                          fla_naive_recurrent_kda, manual_seed, peer_op)

naive_recurrent_kda = fla_naive_recurrent_kda
naive_kda_gate = fla_naive_kda_gate


def naive_kda_lowerbound_gate(g, A_log, dt_bias=None, lower_bound=-5.0):
    return fla_naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound)


def recurrent_kda(**kwargs):
    return peer_op("recurrent_kda")(**kwargs)


def assert_close(prefix, ref, tri, atol=5e-3, rtol=5e-3):
    """Assert tensors are close with bf16-appropriate tolerances."""
    ref_f, tri_f = ref.float(), tri.float()
    abs_diff = (ref_f - tri_f).flatten().abs().max().item()
    assert not torch.isnan(ref).any(), f"{prefix}: NaN in ref"
    assert not torch.isnan(tri).any(), f"{prefix}: NaN in tri"
    torch.testing.assert_close(ref_f, tri_f, atol=atol, rtol=rtol,
                               msg=f"{prefix} diff: {abs_diff:.6f}")


def maybe_l2norm(x, enabled):
    x = x.float()
    return F.normalize(x, p=2, dim=-1) if enabled else x


_VS_REFERENCE_CONFIGS = [
    (1, 1, 4, 64, 1, 1, True, torch.bfloat16),
    (1, 1, 4, 64, 1, 1, False, torch.bfloat16),
    (4, 1, 4, 128, 0.1, 1, True, torch.bfloat16),
    (4, 1, 4, 128, 0.1, 1, False, torch.bfloat16),
    (16, 1, 4, 128, 0.1, 1, True, torch.bfloat16),
]
_VS_REFERENCE_PARAMS = [
    pytest.param(*test, id="B{}-T{}-H{}-D{}-scale{}-norm{}-qk_l2{}-{}".format(*test))
    for test in _VS_REFERENCE_CONFIGS
]
_VS_NAMES = ("B", "T", "H", "D", "scale", "gate_logit_normalizer", "use_qk_l2norm_in_kernel",
             "dtype")


def _make_vs_reference_tensors(device, B, T, H, D, gate_logit_normalizer, dtype):
    manual_seed(42)
    q = torch.rand(B, T, H, D, dtype=dtype, device=device)
    k = torch.rand(B, T, H, D, dtype=dtype, device=device)
    v = torch.rand(B, T, H, D, dtype=dtype, device=device)
    g = (F.logsigmoid(torch.randn(B, T, H, D, dtype=torch.float, device=device))
         / gate_logit_normalizer).to(dtype)
    beta = torch.randn(B, T, H, dtype=dtype, device=device).sigmoid()
    h0_bf16 = torch.randn(B, H, D, D, dtype=torch.bfloat16, device=device) * 0.01
    h0_f32 = h0_bf16.transpose(-1, -2).float()
    return q, k, v, g, beta, h0_bf16, h0_f32


@device_param
@pytest.mark.parametrize(_VS_NAMES, _VS_REFERENCE_PARAMS)
def test_recurrent_kda_vs_naive(device, B, T, H, D, scale, gate_logit_normalizer,
                                use_qk_l2norm_in_kernel, dtype):
    """Recurrent KDA kernel matches naive recurrent KDA reference."""
    q, k, v, g, beta, h0_bf16, h0_f32 = _make_vs_reference_tensors(device, B, T, H, D,
                                                                   gate_logit_normalizer, dtype)
    ref, ref_ht = naive_recurrent_kda(
        q=maybe_l2norm(q, use_qk_l2norm_in_kernel),
        k=maybe_l2norm(k, use_qk_l2norm_in_kernel),
        v=v.float(),
        g=g.float(),
        beta=beta.float(),
        scale=scale,
        initial_state=h0_f32.clone(),
        output_final_state=True,
    )
    tri, tri_ht = recurrent_kda(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0_bf16.clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    assert_close("o", ref, tri)
    assert_close("ht", ref_ht, tri_ht.transpose(-1, -2).float())


@device_param
@pytest.mark.parametrize(_VS_NAMES, _VS_REFERENCE_PARAMS)
def test_recurrent_kda_vs_fla(device, B, T, H, D, scale, gate_logit_normalizer,
                              use_qk_l2norm_in_kernel, dtype):
    """Recurrent KDA kernel matches FLA's fused_recurrent_kda (here: FLA's naive reference)."""
    q, k, v, g, beta, h0_bf16, h0_f32 = _make_vs_reference_tensors(device, B, T, H, D,
                                                                   gate_logit_normalizer, dtype)
    ref, ref_ht = fla_naive_recurrent_kda(
        q=maybe_l2norm(q, use_qk_l2norm_in_kernel),
        k=maybe_l2norm(k, use_qk_l2norm_in_kernel),
        v=v.float(),
        g=g.float(),
        beta=beta.float(),
        scale=scale,
        initial_state=h0_f32.clone(),
        output_final_state=True,
    )
    tri, tri_ht = recurrent_kda(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0_bf16.clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    assert_close("o", ref, tri)
    assert_close("ht", ref_ht, tri_ht.transpose(-1, -2).float())


@device_param
@pytest.mark.parametrize(
    ("B", "H", "D", "scale", "gate_logit_normalizer", "use_qk_l2norm_in_kernel",
     "use_gate_in_kernel", "safe_gate", "dtype"),
    [
        pytest.param(*test, id="B{}-H{}-D{}-scale{}-norm{}-qk_l2{}-gate{}-safe{}-{}".format(*test))
        for test in [
            (16, 16, 128, 0.1, 1.0, True, False, False, torch.bfloat16),
            (4, 16, 128, 0.1, 1.0, False, False, False, torch.bfloat16),
            (32, 8, 64, 1.0, 1.0, True, False, False, torch.bfloat16),
            (8, 8, 64, 1.0, 1.0, False, True, False, torch.bfloat16),
            (7, 32, 128, 0.5, 0.5, True, False, False, torch.bfloat16),
            (16, 16, 128, 0.1, 1.0, True, True, False, torch.bfloat16),
            (32, 8, 64, 1.0, 1.0, True, True, False, torch.bfloat16),
            (7, 32, 128, 0.5, 0.5, True, True, False, torch.bfloat16),
            (7, 32, 128, 0.5, 0.5, True, True, True, torch.bfloat16),
            (4, 32, 128, 0.5, 0.5, False, True, True, torch.bfloat16),
        ]
    ],
)
def test_vllm_decode(device, B, H, D, scale, gate_logit_normalizer, use_qk_l2norm_in_kernel,
                     use_gate_in_kernel, safe_gate, dtype):
    """vLLM-style decoding: continuous batching with paged state, Recurrent KDA vs naive."""
    manual_seed(42)
    max_cache_slots = B * 3
    state_pool_bf16 = torch.randn(max_cache_slots, H, D, D, dtype=torch.bfloat16, device=device)
    state_indices = torch.randperm(max_cache_slots, device=device)[:B].int()

    HUGE_VALUE = 1e4  # bf16 max is ~65504, use 1e4 as sentinel
    unaccessed = torch.ones(max_cache_slots, dtype=torch.bool, device=device)
    unaccessed[state_indices.long()] = False
    state_pool_bf16[unaccessed] = HUGE_VALUE

    T = 1
    total_tokens = B * T
    q = torch.rand(1, total_tokens, H, D, dtype=dtype, device=device)
    k = torch.rand(1, total_tokens, H, D, dtype=dtype, device=device)
    v = torch.rand(1, total_tokens, H, D, dtype=dtype, device=device)
    g = torch.randn(1, total_tokens, H, D,
                    dtype=torch.float if not use_gate_in_kernel else dtype, device=device)
    if use_gate_in_kernel:
        A_log = torch.log(torch.randn(1, 1, H, 1, dtype=torch.float32,
                                      device=device).uniform_(1, 16)).squeeze()
        dt_bias = torch.randn(H * D, dtype=torch.float32, device=device)
        lower_bound = -5.0 if safe_gate else None
        naive_gate_fn = naive_kda_lowerbound_gate if safe_gate else naive_kda_gate
    else:
        g = (F.logsigmoid(g) / gate_logit_normalizer).to(dtype)
        A_log = None
        dt_bias = None
        lower_bound = None
        naive_gate_fn = None
    beta = torch.randn(1, total_tokens, H, dtype=dtype, device=device).sigmoid()
    cu_seqlens = torch.arange(0, total_tokens + 1, step=T, device=device, dtype=torch.long)
    ref_state_pool = state_pool_bf16.transpose(-1, -2).float()
    tri_state_pool_bf16 = state_pool_bf16.clone()

    ref_outputs = []
    for i in range(B):
        start, end = i, i + 1
        slot_idx = state_indices[i].item()
        q_i, k_i, v_i, g_i, beta_i = (x[:, start:end] for x in (q, k, v, g, beta))
        h_init = ref_state_pool[slot_idx].unsqueeze(0)
        gate_kwargs = dict(lower_bound=lower_bound) if safe_gate else {}
        ref_o_i, ref_ht_i = naive_recurrent_kda(
            q=maybe_l2norm(q_i, use_qk_l2norm_in_kernel),
            k=maybe_l2norm(k_i, use_qk_l2norm_in_kernel),
            v=v_i.float(),
            g=(naive_gate_fn(g_i, A_log, dt_bias, **gate_kwargs).float()
               if use_gate_in_kernel else g_i.float()),
            beta=beta_i.float(),
            scale=scale,
            initial_state=h_init.clone(),
            output_final_state=True,
        )
        ref_outputs.append(ref_o_i)
        ref_state_pool[slot_idx] = ref_ht_i.squeeze(0)
    ref_out = torch.cat(ref_outputs, dim=1)

    tri_out, _ = recurrent_kda(
        q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
        initial_state=tri_state_pool_bf16, output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        lower_bound=lower_bound, cu_seqlens=cu_seqlens, ssm_state_indices=state_indices,
    )

    assert_close("o", ref_out, tri_out)
    tri_ht_f32 = tri_state_pool_bf16[state_indices.long()].transpose(-1, -2).float()
    assert_close("ht", ref_state_pool[state_indices.long()], tri_ht_f32)
    tri_untouched = tri_state_pool_bf16[unaccessed].transpose(-1, -2).float()
    ref_untouched = state_pool_bf16[unaccessed].transpose(-1, -2).float()
    assert_close("Untouched ht", ref_untouched, tri_untouched, atol=1e-2, rtol=1e-2)


@device_param
def test_standard_decode_state_indices_update_pool(device):
    """Standard decode with ssm_state_indices updates the caller's state pool."""
    manual_seed(42)
    dtype = torch.bfloat16
    B, H, D = 4, 8, 64
    HV = H
    n_slots = B * 3
    q = torch.rand(B, 1, H, D, dtype=dtype, device=device)
    k = torch.rand(B, 1, H, D, dtype=dtype, device=device)
    v = torch.rand(B, 1, HV, D, dtype=dtype, device=device)
    g = F.logsigmoid(torch.randn(B, 1, HV, D, device=device)).to(dtype)
    beta = torch.rand(B, 1, HV, dtype=dtype, device=device).sigmoid()
    scale = D ** -0.5

    state_pool = torch.randn(n_slots, HV, D, D, dtype=dtype, device=device) * 0.01
    state_indices = torch.randperm(n_slots, device=device)[:B].int()
    untouched = torch.ones(n_slots, dtype=torch.bool, device=device)
    untouched[state_indices.long()] = False

    compact_state = state_pool[state_indices].clone()
    ref_out, ref_state = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                                       initial_state=compact_state, output_final_state=True)
    indexed_pool = state_pool.clone()
    original_untouched = indexed_pool[untouched].clone()
    tri_out, tri_state = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                                       initial_state=indexed_pool, output_final_state=True,
                                       ssm_state_indices=state_indices)

    assert_close("indexed output", ref_out.float(), tri_out.float())
    assert_close("indexed returned state", ref_state.float(), tri_state.float())
    assert_close("indexed state pool", ref_state.float(),
                 indexed_pool[state_indices.long()].float())
    assert_close("indexed untouched state", original_untouched.float(),
                 indexed_pool[untouched].float(), atol=1e-3, rtol=1e-3)


@device_param
@pytest.mark.parametrize(
    ("H", "D", "use_gate_in_kernel", "use_qk_l2norm_in_kernel"),
    [
        pytest.param(8, 64, False, True, id="H8-D64-precomputed"),
        pytest.param(16, 128, False, True, id="H16-D128-precomputed"),
        pytest.param(8, 64, False, False, id="H8-D64-precomputed-no-qk-l2"),
        pytest.param(8, 64, True, True, id="H8-D64-in-kernel"),
        pytest.param(16, 128, True, True, id="H16-D128-in-kernel"),
    ],
)
def test_vllm_padded_cuda_graph(device, H, D, use_gate_in_kernel, use_qk_l2norm_in_kernel):
    """Padded slots (PAD_SLOT_ID=-1, seq_len=0) must not corrupt any state, and active slots
    must produce correct output + state."""
    manual_seed(42)
    dtype = torch.bfloat16
    B_active = 4
    B_padded = 3
    B_total = B_active + B_padded
    max_slots = 32
    SENTINEL = 7.0
    state_pool = torch.zeros(max_slots, H, D, D, dtype=dtype, device=device)
    state_pool[0] = SENTINEL
    active_indices = torch.randperm(max_slots - 1, device=device)[:B_active] + 1
    state_pool[active_indices.long()] = (
        torch.randn(B_active, H, D, D, dtype=dtype, device=device) * 0.01)
    state_pool_ref = state_pool.clone()

    q = torch.rand(1, B_total, H, D, dtype=dtype, device=device)
    k = torch.rand(1, B_total, H, D, dtype=dtype, device=device)
    v = torch.rand(1, B_total, H, D, dtype=dtype, device=device)
    if use_gate_in_kernel:
        g = torch.randn(1, B_total, H, D, dtype=dtype, device=device)
        A_log = torch.log(torch.ones(H, dtype=torch.float32, device=device).uniform_(1, 16))
        dt_bias = torch.randn(H * D, dtype=torch.float32, device=device)
        lower_bound = None
        naive_gate_fn = naive_kda_gate
    else:
        g = (F.logsigmoid(torch.randn(1, B_total, H, D, device=device)) / 1.0).to(dtype)
        A_log = None
        dt_bias = None
        lower_bound = None
        naive_gate_fn = None
    beta = torch.rand(1, B_total, H, dtype=dtype, device=device).sigmoid()

    # cu_seqlens: active tokens have 1 token each, padded tokens have 0
    cu_seqlens = torch.cat([
        torch.arange(B_active + 1, device=device, dtype=torch.int32),
        torch.full((B_padded,), B_active, device=device, dtype=torch.int32),
    ])
    ssm_state_indices = torch.cat([
        active_indices.int(),
        torch.full((B_padded,), -1, device=device, dtype=torch.int32),
    ])
    scale = 1.0 / D ** 0.5

    tri_out, _ = recurrent_kda(
        q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
        initial_state=state_pool, output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        lower_bound=lower_bound, cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
    )

    slot0_after = state_pool[0]
    assert torch.all(slot0_after == SENTINEL), (
        f"State slot 0 corrupted! Expected all {SENTINEL}, "
        f"got min={slot0_after.min().item():.3f} max={slot0_after.max().item():.3f}")

    ref_state_pool = state_pool_ref.transpose(-1, -2).float()
    ref_outputs = []
    for i in range(B_active):
        slot_idx = active_indices[i].item()
        q_i, k_i, v_i, g_i, beta_i = (x[:, i:i + 1] for x in (q, k, v, g, beta))
        ref_o_i, ref_ht_i = naive_recurrent_kda(
            q=maybe_l2norm(q_i, use_qk_l2norm_in_kernel),
            k=maybe_l2norm(k_i, use_qk_l2norm_in_kernel),
            v=v_i.float(),
            g=(naive_gate_fn(g_i, A_log, dt_bias).float() if use_gate_in_kernel
               else g_i.float()),
            beta=beta_i.float(),
            scale=scale,
            initial_state=ref_state_pool[slot_idx].unsqueeze(0).clone(),
            output_final_state=True,
        )
        ref_outputs.append(ref_o_i)
        ref_state_pool[slot_idx] = ref_ht_i.squeeze(0)
    ref_out = torch.cat(ref_outputs, dim=1)

    assert_close("active output", ref_out, tri_out[:, :B_active])
    tri_ht = state_pool[active_indices.long()].transpose(-1, -2).float()
    assert_close("active state", ref_state_pool[active_indices.long()], tri_ht, atol=0.1,
                 rtol=0.05)


@device_param
@pytest.mark.parametrize(("H", "D"), [pytest.param(8, 64, id="H8-D64"),
                                      pytest.param(16, 128, id="H16-D128")])
def test_non_compact_state_stride(device, H, D):
    """State tensor with non-compact stride[0] (vLLM block-based cache) gives the same result."""
    manual_seed(42)
    dtype = torch.bfloat16
    B = 4
    HV = H
    PADDING = 32
    compact_stride = HV * D * D
    padded_stride = compact_stride + PADDING
    backing = torch.zeros(B * padded_stride, dtype=dtype, device=device)
    state_noncompact = backing.as_strided(size=(B, HV, D, D), stride=(padded_stride, D * D, D, 1))
    state_init = torch.randn(B, HV, D, D, dtype=dtype, device=device) * 0.01
    state_noncompact.copy_(state_init)
    state_compact = state_init.clone()

    q = torch.rand(1, B, H, D, dtype=dtype, device=device)
    k = torch.rand(1, B, H, D, dtype=dtype, device=device)
    v = torch.rand(1, B, H, D, dtype=dtype, device=device)
    g = (F.logsigmoid(torch.randn(1, B, H, D, device=device)) / 1.0).to(dtype)
    beta = torch.rand(1, B, H, dtype=dtype, device=device).sigmoid()
    scale = 1.0 / D ** 0.5
    cu_seqlens = torch.arange(B + 1, device=device, dtype=torch.int32)
    ssm_state_indices = torch.arange(B, device=device, dtype=torch.int32)

    out_nc, _ = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                              initial_state=state_noncompact, cu_seqlens=cu_seqlens,
                              ssm_state_indices=ssm_state_indices)
    out_c, _ = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                             initial_state=state_compact, cu_seqlens=cu_seqlens,
                             ssm_state_indices=ssm_state_indices)
    assert_close("non-compact output", out_c, out_nc)
    nc_vals = state_noncompact.transpose(-1, -2).float()
    c_vals = state_compact.transpose(-1, -2).float()
    assert_close("non-compact state", c_vals, nc_vals, atol=0.1, rtol=0.05)


@device_param
@pytest.mark.parametrize("H, D", [pytest.param(8, 64, id="H8-D64"),
                                  pytest.param(16, 128, id="H16-D128")])
def test_non_contiguous_gate_stride(device, H, D):
    """Gate tensor with non-contiguous strides (a split of a fused projection) gives the same
    result; batched path and cu_seqlens path."""
    manual_seed(42)
    dtype = torch.bfloat16
    B = 4
    HV = H
    EXTRA = 256
    gate_dim = HV * D
    total_proj_dim = gate_dim + EXTRA
    batch_stride = 1 * total_proj_dim

    backing = torch.zeros(B * batch_stride + EXTRA, dtype=dtype, device=device)
    g_values = F.logsigmoid(torch.randn(B, 1, HV, D, device=device)).to(dtype)
    for b in range(B):
        offset = b * batch_stride + EXTRA
        backing[offset: offset + gate_dim] = g_values[b, 0].reshape(-1)
    g_noncontiguous = backing[EXTRA:].as_strided(size=(B, 1, HV, D),
                                                 stride=(batch_stride, total_proj_dim, D, 1))
    assert g_noncontiguous.stride()[1] == total_proj_dim
    g_contiguous = g_noncontiguous.contiguous()

    q = torch.rand(B, 1, H, D, dtype=dtype, device=device)
    k = torch.rand(B, 1, H, D, dtype=dtype, device=device)
    v = torch.rand(B, 1, HV, D, dtype=dtype, device=device)
    beta = torch.rand(B, 1, HV, dtype=dtype, device=device).sigmoid()
    scale = 1.0 / D ** 0.5
    state_nc = torch.randn(B, HV, D, D, dtype=dtype, device=device) * 0.01
    state_c = state_nc.clone()

    out_nc, _ = recurrent_kda(q=q, k=k, v=v, g=g_noncontiguous, beta=beta, scale=scale,
                              initial_state=state_nc)
    out_c, _ = recurrent_kda(q=q, k=k, v=v, g=g_contiguous, beta=beta, scale=scale,
                             initial_state=state_c)
    assert_close("non-contiguous gate output (batched)", out_c, out_nc)
    assert_close("non-contiguous gate state (batched)", state_c.transpose(-1, -2).float(),
                 state_nc.transpose(-1, -2).float(), atol=0.1, rtol=0.05)

    cu_seqlens = torch.arange(B + 1, device=device, dtype=torch.int32)
    ssm_state_indices = torch.arange(B, device=device, dtype=torch.int32)
    token_stride_cu = total_proj_dim
    batch_stride_cu = B * total_proj_dim
    backing_cu = torch.zeros(batch_stride_cu + EXTRA, dtype=dtype, device=device)
    g_vals_cu = F.logsigmoid(torch.randn(1, B, HV, D, device=device)).to(dtype)
    for s in range(B):
        offset = s * token_stride_cu + EXTRA
        backing_cu[offset: offset + gate_dim] = g_vals_cu[0, s].reshape(-1)
    g_nc_cu = backing_cu[EXTRA:].as_strided(size=(1, B, HV, D),
                                            stride=(batch_stride_cu, token_stride_cu, D, 1))
    assert g_nc_cu.stride()[1] == total_proj_dim
    g_c_cu = g_nc_cu.contiguous()

    q_cu = torch.rand(1, B, H, D, dtype=dtype, device=device)
    k_cu = torch.rand(1, B, H, D, dtype=dtype, device=device)
    v_cu = torch.rand(1, B, HV, D, dtype=dtype, device=device)
    beta_cu = torch.rand(1, B, HV, dtype=dtype, device=device).sigmoid()
    state_nc_cu = torch.randn(B, HV, D, D, dtype=dtype, device=device) * 0.01
    state_c_cu = state_nc_cu.clone()

    out_nc_cu, _ = recurrent_kda(q=q_cu, k=k_cu, v=v_cu, g=g_nc_cu, beta=beta_cu, scale=scale,
                                 initial_state=state_nc_cu, cu_seqlens=cu_seqlens,
                                 ssm_state_indices=ssm_state_indices)
    out_c_cu, _ = recurrent_kda(q=q_cu, k=k_cu, v=v_cu, g=g_c_cu, beta=beta_cu, scale=scale,
                                initial_state=state_c_cu, cu_seqlens=cu_seqlens,
                                ssm_state_indices=ssm_state_indices)
    assert_close("non-contiguous gate output (cu_seqlens)", out_c_cu, out_nc_cu)
    assert_close("non-contiguous gate state (cu_seqlens)", state_c_cu.transpose(-1, -2).float(),
                 state_nc_cu.transpose(-1, -2).float(), atol=0.1, rtol=0.05)


# ---- FlashInfer surface facts (from the source, not FlashInfer tests) ----------------------------
FLASHINFER_RECURRENT_KDA = [
    ("q", P, NO_DEFAULT), ("k", P, NO_DEFAULT), ("v", P, NO_DEFAULT), ("g", P, NO_DEFAULT),
    ("beta", P, NO_DEFAULT), ("A_log", P, None), ("dt_bias", P, None), ("scale", P, None),
    ("initial_state", P, None), ("output_final_state", P, False),
    ("use_qk_l2norm_in_kernel", P, True), ("use_gate_in_kernel", P, False),
    ("lower_bound", P, None), ("cu_seqlens", P, None), ("ssm_state_indices", P, None),
    ("num_spec_tokens", P, None), ("num_accepted_tokens", P, None), ("output", P, None),
    ("initial_state_source", P, None), ("initial_state_indices", P, None),
    ("beta_is_logit", P, False),
    # flashinfer.recurrent_kda (the kda.py facade) continues with its prefill parameters
    ("seq_order", P, None), ("prefill_workspace", P, None), ("state_checkpoints", P, None),
    ("checkpoint_cu_starts", P, None), ("checkpoint_every_n_tokens", P, 0),
]


def test_surface_signature():
    op = peer_op("recurrent_kda")
    check_signature(op, FLASHINFER_RECURRENT_KDA)
    params = inspect.signature(op).parameters
    assert "backend" in params and params["backend"].kind.name == "KEYWORD_ONLY", (
        "FlashInfer's `backend` keyword-only argument is missing")
    assert params["backend"].default == "auto"


def _decode_inputs(device, B=3, H=2, D=64, seed=3):
    manual_seed(seed)
    dtype = torch.bfloat16
    q = torch.rand(B, 1, H, D, dtype=dtype, device=device)
    k = torch.rand(B, 1, H, D, dtype=dtype, device=device)
    v = torch.rand(B, 1, H, D, dtype=dtype, device=device)
    g = F.logsigmoid(torch.randn(B, 1, H, D, device=device)).to(dtype)
    beta = torch.rand(B, 1, H, dtype=dtype, device=device).sigmoid()
    return q, k, v, g, beta


@device_param
def test_surface_state_updated_in_place_without_indices(device):
    """Without indices FlashInfer updates ``initial_state`` in place and returns it."""
    q, k, v, g, beta = _decode_inputs(device)
    h0 = torch.randn(3, 2, 64, 64, dtype=torch.bfloat16, device=device) * 0.01
    before = h0.clone()
    o, ht = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0,
                          output_final_state=True)
    assert ht is h0
    assert not torch.equal(h0, before)
    h1 = before.clone()
    o2, ht2 = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=h1)
    assert ht2 is None
    assert torch.equal(h1, h0)
    assert torch.equal(o, o2)


@device_param
def test_surface_indices_returns(device):
    """With indices and no cu_seqlens FlashInfer returns the gathered [B, HV, V, K] states (the
    pool is updated); with cu_seqlens it returns the pool itself."""
    q, k, v, g, beta = _decode_inputs(device)
    pool = torch.randn(6, 2, 64, 64, dtype=torch.bfloat16, device=device) * 0.01
    idx = torch.tensor([4, 0, 2], device=device, dtype=torch.int32)
    p1 = pool.clone()
    _, st = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=p1,
                          output_final_state=True, ssm_state_indices=idx)
    assert tuple(st.shape) == (3, 2, 64, 64)
    assert torch.equal(st, p1[idx.long()])
    p2 = pool.clone()
    flat = [x.reshape(1, 3, *x.shape[2:]) for x in (q, k, v, g)]
    _, st2 = recurrent_kda(q=flat[0], k=flat[1], v=flat[2], g=flat[3], beta=beta.reshape(1, 3, 2),
                           initial_state=p2, output_final_state=True,
                           cu_seqlens=torch.arange(4, device=device, dtype=torch.int32),
                           ssm_state_indices=idx)
    assert st2 is p2
    assert torch.equal(p1, p2)


@device_param
def test_surface_none_state_with_indices_allocates(device):
    """``initial_state=None`` with cu_seqlens + indices: FlashInfer allocates a zero bf16 pool of
    max(index)+1 slots and returns it."""
    q, k, v, g, beta = _decode_inputs(device)
    flat = [x.reshape(1, 3, *x.shape[2:]) for x in (q, k, v, g)]
    idx = torch.tensor([4, -1, 2], device=device, dtype=torch.int32)
    o, st = recurrent_kda(q=flat[0], k=flat[1], v=flat[2], g=flat[3], beta=beta.reshape(1, 3, 2),
                          initial_state=None, output_final_state=True,
                          cu_seqlens=torch.arange(4, device=device, dtype=torch.int32),
                          ssm_state_indices=idx)
    assert tuple(st.shape) == (5, 2, 64, 64) and st.dtype == torch.bfloat16
    assert torch.count_nonzero(st[[0, 1, 3]]).item() == 0
    assert torch.count_nonzero(o[:, 1]).item() == 0


# ---- speculative decode (FlashInfer's "Speculative decoding tests") ----------------------------
def make_spec_decode_inputs(N, H, HV, D, num_spec_tokens, device, dtype=torch.bfloat16):
    """Packed spec-decode inputs: q, k, v, g, beta [1, N*T, ...], cu_seqlens [0, T, ..., N*T],
    ssm_state_indices [N, T] (sequence i: slots i*T .. i*T+T-1), a pool of N*T + 5 slots."""
    T = 1 + num_spec_tokens
    total_tokens = N * T
    ssm_state_indices = torch.stack([torch.arange(i * T, i * T + T, dtype=torch.int32,
                                                  device=device) for i in range(N)])
    n_pool = N * T + 5
    state_pool = torch.randn(n_pool, HV, D, D, dtype=dtype, device=device) * 0.1
    cu_seqlens = torch.arange(0, total_tokens + 1, step=T, dtype=torch.int32, device=device)
    scale = D ** -0.5
    q = torch.rand(1, total_tokens, H, D, dtype=dtype, device=device)
    k = torch.rand(1, total_tokens, H, D, dtype=dtype, device=device)
    v = torch.rand(1, total_tokens, HV, D, dtype=dtype, device=device)
    g = F.logsigmoid(torch.randn(1, total_tokens, HV, D, device=device)).to(dtype)
    beta = torch.rand(1, total_tokens, HV, dtype=dtype, device=device).sigmoid()
    return q, k, v, g, beta, cu_seqlens, ssm_state_indices, state_pool, scale, T


def spec_decode_naive_reference(q, k, v, g, beta, ssm_state_indices, state_pool, scale, N, T, H,
                                HV, num_accepted_tokens=None, use_qk_l2norm_in_kernel=True):
    """T sequential naive tokens per sequence from slot ssm_state_indices[b, nat[b] - 1] (column
    0 without num_accepted_tokens). Returns the output [1, N*T, HV, D] and each token's state
    [HV, K, V]."""
    D = q.shape[-1]
    ref_out = torch.zeros(1, N * T, HV, D, dtype=torch.float32, device=q.device)
    ref_states = []
    gqa_ratio = HV // H
    for b in range(N):
        init_col = (max(int(num_accepted_tokens[b]) - 1, 0) if num_accepted_tokens is not None
                    else 0)
        init_slot = int(ssm_state_indices[b, init_col].item())
        current = state_pool[init_slot].float().transpose(-1, -2).unsqueeze(0)
        b_states = []
        for t in range(T):
            i = b * T + t
            q_t, k_t = q[:, i:i + 1, :H, :], k[:, i:i + 1, :H, :]
            if gqa_ratio > 1:
                q_t = q_t.repeat_interleave(gqa_ratio, dim=2)
                k_t = k_t.repeat_interleave(gqa_ratio, dim=2)
            o_t, ht = naive_recurrent_kda(
                q=maybe_l2norm(q_t, use_qk_l2norm_in_kernel),
                k=maybe_l2norm(k_t, use_qk_l2norm_in_kernel), v=v[:, i:i + 1, :HV, :].float(),
                g=g[:, i:i + 1, :HV, :].float(), beta=beta[:, i:i + 1, :HV].float(),
                scale=scale, initial_state=current.clone(), output_final_state=True)
            ref_out[0, i] = o_t[0, 0]
            current = ht
            b_states.append(ht[0].clone())
        ref_states.append(b_states)
    return ref_out, ref_states


def assert_spec_states(state_pool, ssm_state_indices, ref_states, N, T, atol=1e-1, rtol=5e-2,
                       num_accepted_tokens=None):
    """Each per-token slot against the reference (from nat[b] - 1 on with num_accepted_tokens)."""
    for b in range(N):
        start_t = (max(int(num_accepted_tokens[b]) - 1, 0) if num_accepted_tokens is not None
                   else 0)
        for t in range(start_t, T):
            slot = int(ssm_state_indices[b, t].item())
            assert_close(f"spec_state[b={b}, t={t}]", ref_states[b][t],
                         state_pool[slot].float().transpose(-1, -2), atol=atol, rtol=rtol)


_SPEC_BASIC = [
    pytest.param(4, 8, 8, 64, 1, True, id="N4-H8-D64-S1"),
    pytest.param(4, 8, 8, 64, 3, True, id="N4-H8-D64-S3"),
    pytest.param(4, 8, 8, 64, 1, False, id="N4-H8-D64-S1-no-qk-l2"),
    pytest.param(8, 16, 16, 128, 2, True, id="N8-H16-D128-S2"),
    pytest.param(8, 16, 16, 128, 4, True, id="N8-H16-D128-S4"),
    pytest.param(8, 16, 16, 128, 2, False, id="N8-H16-D128-S2-no-qk-l2"),
    pytest.param(4, 4, 8, 64, 2, True, id="N4-H4-HV8-D64-S2-GQA"),
    pytest.param(4, 8, 8, 128, 3, True, id="N4-H8-D128-S3"),
]


@device_param
@pytest.mark.parametrize(("N", "H", "HV", "D", "num_spec_tokens", "use_qk_l2norm_in_kernel"),
                         _SPEC_BASIC)
def test_spec_decode_basic(device, N, H, HV, D, num_spec_tokens, use_qk_l2norm_in_kernel):
    """Single spec-decode call matches T sequential naive calls."""
    manual_seed(42)
    q, k, v, g, beta, cu_seqlens, ssm_state_indices, state_pool, scale, T = (
        make_spec_decode_inputs(N, H, HV, D, num_spec_tokens, device))
    ref_out, ref_states = spec_decode_naive_reference(
        q, k, v, g, beta, ssm_state_indices, state_pool, scale, N, T, H, HV,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    tri_state_pool = state_pool.clone()
    tri_out, _ = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                               initial_state=tri_state_pool, cu_seqlens=cu_seqlens,
                               ssm_state_indices=ssm_state_indices,
                               num_spec_tokens=num_spec_tokens,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    assert_close("spec_output", ref_out.bfloat16().float(), tri_out.float(), atol=1e-1,
                 rtol=5e-2)
    assert_spec_states(tri_state_pool, ssm_state_indices, ref_states, N, T, atol=1e-1,
                       rtol=5e-2)


@device_param
def test_spec_decode_num_accepted_tokens(device):
    """num_accepted_tokens selects initial state checkpoint; kernel outputs differ by nat."""
    manual_seed(42)
    N, H, HV, D, num_spec_tokens = 4, 8, 8, 64, 2
    T = 1 + num_spec_tokens
    q, k, v, g, beta, cu_seqlens, ssm_state_indices, state_pool, scale, _ = (
        make_spec_decode_inputs(N, H, HV, D, num_spec_tokens, device, torch.bfloat16))
    common = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, cu_seqlens=cu_seqlens,
                  ssm_state_indices=ssm_state_indices, num_spec_tokens=num_spec_tokens)
    nat_1 = torch.ones(N, dtype=torch.int32, device=device)
    tri_pool_none = state_pool.clone()
    out_none, _ = recurrent_kda(initial_state=tri_pool_none, num_accepted_tokens=None, **common)
    tri_pool_1 = state_pool.clone()
    out_1, _ = recurrent_kda(initial_state=tri_pool_1, num_accepted_tokens=nat_1, **common)
    assert_close("nat1_vs_none_out", out_none, out_1, atol=0, rtol=0)

    nat_T = torch.full((N,), T, dtype=torch.int32, device=device)
    tri_pool_T = state_pool.clone()
    out_T, _ = recurrent_kda(initial_state=tri_pool_T, num_accepted_tokens=nat_T, **common)
    ref_out_T, ref_states_T = spec_decode_naive_reference(
        q, k, v, g, beta, ssm_state_indices, state_pool, scale, N, T, H, HV,
        num_accepted_tokens=nat_T)
    for b in range(N):
        for t in range(T - 1, T):
            i = b * T + t
            assert_close(f"nat_T_out[b={b},t={t}]", ref_out_T[0, i], out_T[0, i].float(),
                         atol=1e-1, rtol=5e-2)
    assert_spec_states(tri_pool_T, ssm_state_indices, ref_states_T, N, T,
                       num_accepted_tokens=nat_T)

    # Values above T clamp to the final checkpoint instead of indexing the next row.
    nat_over = torch.full((N,), T + 2, dtype=torch.int32, device=device)
    tri_pool_over = state_pool.clone()
    out_over, _ = recurrent_kda(initial_state=tri_pool_over, num_accepted_tokens=nat_over,
                                **common)
    assert_close("nat_over_vs_T_out", out_over, out_T, atol=0, rtol=0)
    assert_close("nat_over_vs_T_state", tri_pool_over, tri_pool_T, atol=0, rtol=0)


@device_param
def test_spec_decode_batched_auto_ssi(device):
    """ssm_state_indices=None: auto-generates sequential slots 0,1,...,B*T-1."""
    manual_seed(42)
    dtype = torch.bfloat16
    B, H, HV, D, S = 4, 8, 8, 64, 1
    T = 1 + S
    scale = D ** -0.5
    q = torch.rand(B, T, H, D, dtype=dtype, device=device)
    k = torch.rand(B, T, H, D, dtype=dtype, device=device)
    v = torch.rand(B, T, HV, D, dtype=dtype, device=device)
    g = F.logsigmoid(torch.randn(B, T, HV, D, device=device)).to(dtype)
    beta = torch.rand(B, T, HV, dtype=dtype, device=device).sigmoid()
    n_pool = B * T + 5
    state_pool = torch.randn(n_pool, HV, D, D, dtype=dtype, device=device) * 0.1
    tri_state_pool = state_pool.clone()
    tri_out, final_state = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                                         initial_state=tri_state_pool, output_final_state=True,
                                         num_spec_tokens=S, ssm_state_indices=None)
    assert tri_out.shape == (B, T, HV, D), (
        f"Expected [{B},{T},{HV},{D}], got {list(tri_out.shape)}")
    expected_ssi = torch.arange(B * T, dtype=torch.int32, device=device).reshape(B, T)
    ref_out, ref_states = spec_decode_naive_reference(
        q.reshape(1, B * T, H, D), k.reshape(1, B * T, H, D), v.reshape(1, B * T, HV, D),
        g.reshape(1, B * T, HV, D), beta.reshape(1, B * T, HV), expected_ssi, state_pool, scale,
        B, T, H, HV)
    assert_close("auto_ssi_out", ref_out.reshape(B, T, HV, D).bfloat16().float(),
                 tri_out.float(), atol=1e-1, rtol=5e-2)
    assert_spec_states(tri_state_pool, expected_ssi, ref_states, B, T, atol=1e-1, rtol=5e-2)
    assert final_state is tri_state_pool
    assert final_state.shape == (n_pool, HV, D, D)


@device_param
def test_spec_decode_batched_vs_cuseqlens(device):
    """Batched shim and cu_seqlens path produce identical results."""
    manual_seed(42)
    B, H, HV, D, S = 4, 8, 8, 64, 2
    T = 1 + S
    scale = D ** -0.5
    q, k, v, g, beta, cu_seqlens, ssm_state_indices, state_pool, _, _ = (
        make_spec_decode_inputs(B, H, HV, D, S, device, torch.bfloat16))
    state_pool_csl = state_pool.clone()
    out_csl, _ = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                               initial_state=state_pool_csl, cu_seqlens=cu_seqlens,
                               ssm_state_indices=ssm_state_indices, num_spec_tokens=S)
    state_pool_bat = state_pool.clone()
    out_bat, _ = recurrent_kda(q=q.reshape(B, T, H, D), k=k.reshape(B, T, H, D),
                               v=v.reshape(B, T, HV, D), g=g.reshape(B, T, HV, D),
                               beta=beta.reshape(B, T, HV), scale=scale,
                               initial_state=state_pool_bat,
                               ssm_state_indices=ssm_state_indices, num_spec_tokens=S)
    assert_close("batched_vs_csl_out", out_csl.reshape(B, T, HV, D).float(), out_bat.float(),
                 atol=0, rtol=0)
    assert_close("batched_vs_csl_state", state_pool_csl.float(), state_pool_bat.float(),
                 atol=0, rtol=0)


@device_param
def test_spec_decode_non_compact_state(device):
    """Non-compact stride[0] state pool (vLLM's paged cache) works with spec decode."""
    manual_seed(42)
    N, H, HV, D, num_spec_tokens = 4, 8, 8, 64, 2
    q, k, v, g, beta, cu_seqlens, ssm_state_indices, state_pool, scale, T = (
        make_spec_decode_inputs(N, H, HV, D, num_spec_tokens, device, torch.bfloat16))
    n_slots = state_pool.shape[0]
    padded_stride = HV * D * D + 32
    backing = torch.zeros(n_slots * padded_stride, dtype=torch.bfloat16, device=device)
    state_nc = backing.as_strided(size=(n_slots, HV, D, D), stride=(padded_stride, D * D, D, 1))
    state_nc.copy_(state_pool)
    ref_out, ref_states = spec_decode_naive_reference(
        q, k, v, g, beta, ssm_state_indices, state_pool, scale, N, T, H, HV)
    tri_out, _ = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                               initial_state=state_nc, cu_seqlens=cu_seqlens,
                               ssm_state_indices=ssm_state_indices,
                               num_spec_tokens=num_spec_tokens)
    assert_close("nc_output", ref_out.bfloat16().float(), tri_out.float(), atol=1e-1, rtol=5e-2)
    for b in range(N):
        for t in range(T):
            slot = int(ssm_state_indices[b, t].item())
            assert_close(f"nc_state[b={b},t={t}]", ref_states[b][t],
                         state_nc[slot].float().transpose(-1, -2), atol=1e-1, rtol=5e-2)


@device_param
def test_spec_decode_shape_validation(device):
    """ValueError raised for invalid inputs in spec mode."""
    manual_seed(42)
    N, H, HV, D, num_spec_tokens = 4, 8, 8, 64, 2
    T = 3
    q, k, v, g, beta, cu_seqlens, ssm_state_indices, state_pool, scale, _ = (
        make_spec_decode_inputs(N, H, HV, D, num_spec_tokens, device, torch.bfloat16))

    def try_call(**overrides):
        kw = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=state_pool.clone(),
                  cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
                  num_spec_tokens=num_spec_tokens)
        kw.update(overrides)
        return recurrent_kda(**kw)

    with pytest.raises(ValueError, match="num_spec_tokens must be >= 1"):
        try_call(num_spec_tokens=0)
    with pytest.raises(ValueError, match="ssm_state_indices is required"):
        try_call(ssm_state_indices=None)
    with pytest.raises(ValueError, match="2D"):
        try_call(ssm_state_indices=torch.arange(N, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="2D"):
        try_call(ssm_state_indices=torch.zeros(N, T + 1, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="must equal 1\\+num_spec_tokens"):
        try_call(cu_seqlens=None)
    with pytest.raises(ValueError, match="shape\\[0\\]"):
        try_call(ssm_state_indices=torch.zeros(N + 1, T, dtype=torch.int32, device=device))


@device_param
def test_surface_spec_decode_shim_slots_text(device):
    """The batched shim's slot-count check, FlashInfer's text (run_recurrent_kda)."""
    q, k, v, g, beta, cu_seqlens, ssi, pool, scale, T = make_spec_decode_inputs(
        2, 4, 4, 64, 2, device)
    with pytest.raises(ValueError, match=r"initial_state must have at least B\*\(1\+num_spec"):
        recurrent_kda(q=q.view(2, T, 4, 64), k=k.view(2, T, 4, 64), v=v.view(2, T, 4, 64),
                      g=g.view(2, T, 4, 64), beta=beta.view(2, T, 4), scale=scale,
                      initial_state=pool[:5], num_spec_tokens=2)


@device_param
@pytest.mark.parametrize("D", [64, 128], ids=["D64", "D128"])
def test_spec_decode_separate_source_and_beta_logits(device, D):
    """Committed state is read in-kernel and beta logits are activated there."""
    manual_seed(42)
    N, H, HV, num_spec_tokens = 4, 8, 8, 3

    q, k, v, g, _, cu_seqlens, ssm_state_indices, scratch, scale, T = (
        make_spec_decode_inputs(N, H, HV, D, num_spec_tokens, device))
    beta_logits = torch.randn(1, N * T, HV, dtype=torch.bfloat16, device=device)
    beta = beta_logits.sigmoid()
    source_values = torch.randn(N + 3, HV, D, D, dtype=torch.bfloat16, device=device)
    source_stride = HV * D * D + 32
    source_backing = torch.zeros((N + 3) * source_stride, dtype=torch.bfloat16, device=device)
    source = source_backing.as_strided(size=(N + 3, HV, D, D),
                                       stride=(source_stride, D * D, D, 1))
    source.copy_(source_values)
    source_backing_before = source_backing.clone()
    source_indices_storage = torch.tensor([3, -1, 1, -1, 5, -1, 0, -1], dtype=torch.int32,
                                          device=device)
    source_indices = source_indices_storage[::2]
    assert not source_indices.is_contiguous()

    reference_pool = scratch.clone()
    for batch_idx in range(N):
        reference_pool[ssm_state_indices[batch_idx, 0]] = source[source_indices[batch_idx]]
    ref_out, ref_states = spec_decode_naive_reference(
        q, k, v, g, beta, ssm_state_indices, reference_pool, scale, N, T, H, HV)

    output_pool = scratch.clone()
    out, _ = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta_logits, beta_is_logit=True, scale=scale,
                           initial_state=output_pool, initial_state_source=source,
                           initial_state_indices=source_indices, cu_seqlens=cu_seqlens,
                           ssm_state_indices=ssm_state_indices, num_spec_tokens=num_spec_tokens)

    assert_close("separate_source_output", ref_out.bfloat16().float(), out.float(), atol=1e-1,
                 rtol=5e-2)
    assert_spec_states(output_pool, ssm_state_indices, ref_states, N, T, atol=1e-1, rtol=5e-2)
    assert torch.equal(source_backing, source_backing_before)


@device_param
def test_surface_separate_source_texts(device):
    """FlashInfer's checks of the separate source, its texts (run_recurrent_kda), and
    deltastate's dtype rule (any floating dtype, the pool's; FlashInfer: bfloat16 only)."""
    N, S = 3, 2
    q, k, v, g, beta, cu_seqlens, ssi, pool, scale, T = make_spec_decode_inputs(
        N, 2, 2, 64, S, device)
    src = torch.randn(N, 2, 64, 64, dtype=torch.bfloat16, device=device)
    rows = torch.arange(N, dtype=torch.int32, device=device)

    def call(**overrides):
        kw = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=pool.clone(),
                  cu_seqlens=cu_seqlens, ssm_state_indices=ssi, num_spec_tokens=S,
                  initial_state_source=src, initial_state_indices=rows)
        kw.update(overrides)
        return recurrent_kda(**kw)

    together = "initial_state_source and initial_state_indices must be provided together"
    with pytest.raises(ValueError, match=together):
        call(initial_state_indices=None)
    with pytest.raises(ValueError, match=together):
        call(initial_state_source=None)
    with pytest.raises(ValueError, match=re.escape("initial_state_indices must be 1D, got shape "
                                                   "[3, 1]")):
        call(initial_state_indices=rows.view(N, 1))
    with pytest.raises(ValueError, match=re.escape(
            "initial_state_source must have the dtype of initial_state (torch.bfloat16), got "
            "torch.float32")):
        call(initial_state_source=src.float())
    with pytest.raises(ValueError, match=re.escape(
            "initial_state_source must have trailing shape [2, 64, 64], got [3, 2, 64, 32]")):
        call(initial_state_source=src[..., :32])
    with pytest.raises(ValueError, match=re.escape(
            "initial_state_indices must contain one entry per sequence, got 2 entries for N=3")):
        call(initial_state_indices=rows[:2])
    # Extra entries are not read (FlashInfer's rule: at least one per sequence).
    out, _ = call(initial_state_indices=torch.arange(N + 2, dtype=torch.int32, device=device))
    ref, _ = call()
    assert torch.equal(out, ref)
    # Outside speculative decode FlashInfer takes the source too: not implemented here.
    with pytest.raises(NotImplementedError, match="initial_state_source.*num_spec_tokens=None"):
        qd, kd, vd, gd, bd = _decode_inputs(device)
        recurrent_kda(q=qd, k=kd, v=vd, g=gd, beta=bd,
                      initial_state=torch.zeros(3, 2, 64, 64, dtype=torch.bfloat16,
                                                device=device),
                      initial_state_source=src, initial_state_indices=rows)


@device_param
def test_surface_separate_source_padded_row_and_nat(device):
    """deltastate's rules with a source: a source row < 0 marks a padded sequence (output zero,
    no slot written; FlashInfer reads row 0 instead), every other sequence starts from its
    source row whatever num_accepted_tokens says (FlashInfer's kernel does not read it with a
    source), the state after token t lands in slot ssm_state_indices[n, t], the source and every
    other slot stay bit-untouched. A float32 pool and source (FlashInfer: bfloat16 only)."""
    manual_seed(7)
    N, H, HV, D, S = 3, 2, 4, 64, 2
    q, k, v, g, beta, cu_seqlens, ssi, pool, scale, T = make_spec_decode_inputs(
        N, H, HV, D, S, device)
    pool = pool.float()
    source = torch.randn(N + 1, HV, D, D, dtype=torch.float32, device=device) * 0.1
    source_before = source.clone()
    rows = torch.tensor([2, -1, 0], dtype=torch.int64, device=device)
    nat = torch.tensor([3, 2, 2], dtype=torch.int32, device=device)
    reference_pool = pool.clone()
    for b in (0, 2):
        reference_pool[ssi[b, 0]] = source[rows[b]]
    ref_out, ref_states = spec_decode_naive_reference(
        q, k, v, g, beta, ssi, reference_pool, scale, N, T, H, HV)
    out_pool = pool.clone()
    out = torch.full((1, N * T, HV, D), float("nan"), dtype=q.dtype, device=device)
    recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=out_pool,
                  cu_seqlens=cu_seqlens, ssm_state_indices=ssi, num_spec_tokens=S,
                  num_accepted_tokens=nat, initial_state_source=source,
                  initial_state_indices=rows, output=out)
    assert torch.equal(source, source_before)
    assert torch.count_nonzero(out[0, T:2 * T]).item() == 0  # the padded sequence
    live = torch.cat([torch.arange(0, T), torch.arange(2 * T, 3 * T)]).to(device)
    assert_close("source_output", ref_out[0, live].bfloat16().float(), out[0, live].float(),
                 atol=1e-1, rtol=5e-2)
    for b in (0, 2):
        for t in range(T):
            slot = int(ssi[b, t])
            assert_close(f"source_state[b={b}, t={t}]", ref_states[b][t],
                         out_pool[slot].transpose(-1, -2), atol=1e-1, rtol=5e-2)
    written = {int(ssi[b, t]) for b in (0, 2) for t in range(T)}
    for slot in range(pool.shape[0]):
        if slot not in written:
            assert torch.equal(out_pool[slot], pool[slot]), f"slot {slot} changed"


@device_param
@pytest.mark.parametrize("D", [64, 128], ids=["D64", "D128"])
def test_spec_decode_nat_heterogeneous(device, D):
    """Different nat values per sequence in the same batch."""
    manual_seed(77)
    H = HV = 8 if D == 64 else 16
    N, num_spec_tokens = 6, 3
    T = 1 + num_spec_tokens
    q, k, v, g, beta, cu_seqlens, ssm_state_indices, state_pool, scale, _ = (
        make_spec_decode_inputs(N, H, HV, D, num_spec_tokens, device))
    nat_values = [1, 2, 3, T, 1, 2]
    nat = torch.tensor(nat_values, dtype=torch.int32, device=device)
    tri_pool = state_pool.clone()
    tri_out, _ = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                               initial_state=tri_pool, cu_seqlens=cu_seqlens,
                               ssm_state_indices=ssm_state_indices,
                               num_spec_tokens=num_spec_tokens, num_accepted_tokens=nat)
    ref_out, ref_states = spec_decode_naive_reference(
        q, k, v, g, beta, ssm_state_indices, state_pool, scale, N, T, H, HV,
        num_accepted_tokens=nat)
    for b in range(N):
        for t in range(nat_values[b] - 1, T):
            i = b * T + t
            assert_close(f"hetero_out[b={b},t={t}]", ref_out[0, i], tri_out[0, i].float(),
                         atol=1e-1, rtol=5e-2)
    assert_spec_states(tri_pool, ssm_state_indices, ref_states, N, T, num_accepted_tokens=nat)


@device_param
def test_spec_decode_nat_with_padding(device):
    """Mixed active (varying nat) + padded (-1) sequences."""
    manual_seed(99)
    N_active, N_padded = 3, 2
    N = N_active + N_padded
    H, HV, D, num_spec_tokens = 8, 8, 64, 2
    T = 1 + num_spec_tokens
    dtype = torch.bfloat16
    ssm_active = torch.stack([torch.arange(1 + i * T, 1 + i * T + T, dtype=torch.int32,
                                           device=device) for i in range(N_active)])
    ssm_padded = torch.full((N_padded, T), -1, dtype=torch.int32, device=device)
    ssm_state_indices = torch.cat([ssm_active, ssm_padded], dim=0)
    n_pool = N_active * T + 1 + 5
    state_pool = torch.randn(n_pool, HV, D, D, dtype=dtype, device=device) * 0.1
    scale = D ** -0.5
    q = torch.rand(1, N_active * T, H, D, dtype=dtype, device=device)
    k = torch.rand(1, N_active * T, H, D, dtype=dtype, device=device)
    v = torch.rand(1, N_active * T, HV, D, dtype=dtype, device=device)
    g = F.logsigmoid(torch.randn(1, N_active * T, HV, D, device=device)).to(dtype)
    beta = torch.rand(1, N_active * T, HV, dtype=dtype, device=device).sigmoid()
    pad = lambda x, *inner: torch.cat(  # noqa: E731
        [x, torch.zeros(1, N_padded * T, *inner, dtype=dtype, device=device)], dim=1)
    q_full, k_full, v_full = pad(q, H, D), pad(k, H, D), pad(v, HV, D)
    g_full, beta_full = pad(g, HV, D), pad(beta, HV)
    cu_seqlens = torch.arange(0, N * T + 1, step=T, dtype=torch.int32, device=device)
    nat_active = torch.tensor([1, 2, T], dtype=torch.int32, device=device)
    nat = torch.cat([nat_active, torch.ones(N_padded, dtype=torch.int32, device=device)])
    ref_out, ref_states = spec_decode_naive_reference(
        q, k, v, g, beta, ssm_active, state_pool, scale, N_active, T, H, HV,
        num_accepted_tokens=nat_active)
    state_pool_kernel = state_pool.clone()
    slot0_before = state_pool_kernel[0].clone()
    tri_out, _ = recurrent_kda(q=q_full, k=k_full, v=v_full, g=g_full, beta=beta_full,
                               scale=scale, initial_state=state_pool_kernel,
                               cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
                               num_spec_tokens=num_spec_tokens, num_accepted_tokens=nat)
    assert_spec_states(state_pool_kernel, ssm_active, ref_states, N_active, T,
                       num_accepted_tokens=nat_active)
    padded_out = tri_out[:, N_active * T:]
    assert padded_out.abs().max().item() == 0.0, (
        f"Padded output should be zero, max={padded_out.abs().max().item()}")
    assert_close("slot0_not_corrupted", slot0_before.float().transpose(-1, -2),
                 state_pool_kernel[0].float().transpose(-1, -2), atol=1e-3, rtol=1e-3)


@device_param
@pytest.mark.parametrize("gate_mode", ["precomputed", "softplus", "lower_bound"])
def test_spec_decode_gate_modes(device, gate_mode):
    """All 3 gate modes work correctly with spec decode."""
    manual_seed(42)
    N, H, HV, D, num_spec_tokens = 4, 16, 16, 128, 2
    q, k, v, g, beta, cu_seqlens, ssm_state_indices, state_pool, scale, T = (
        make_spec_decode_inputs(N, H, HV, D, num_spec_tokens, device, torch.bfloat16))
    if gate_mode == "precomputed":
        use_gate_in_kernel, lower_bound, A_log, dt_bias = False, None, None, None
        g_ref = g.float()
    elif gate_mode == "softplus":
        use_gate_in_kernel, lower_bound, dt_bias = True, None, None
        A_log = torch.log(torch.rand(H, device=device, dtype=torch.float32) + 1).squeeze()
        g_ref = naive_kda_gate(g, A_log).float()
    else:
        use_gate_in_kernel, lower_bound = True, -5.0
        A_log = torch.log(torch.rand(H, device=device, dtype=torch.float32) + 1).squeeze()
        dt_bias = torch.randn(H * D, dtype=torch.float32, device=device)
        g_ref = naive_kda_lowerbound_gate(g, A_log, dt_bias).float()
    ref_out, ref_states = spec_decode_naive_reference(
        q, k, v, g_ref.bfloat16(), beta, ssm_state_indices, state_pool, scale, N, T, H, HV)
    tri_state_pool = state_pool.clone()
    tri_out, _ = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                               initial_state=tri_state_pool, cu_seqlens=cu_seqlens,
                               ssm_state_indices=ssm_state_indices,
                               num_spec_tokens=num_spec_tokens,
                               use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                               dt_bias=dt_bias, lower_bound=lower_bound)
    assert_close("spec_output_gate", ref_out.bfloat16().float(), tri_out.float(), atol=1e-1,
                 rtol=5e-2)
    assert_spec_states(tri_state_pool, ssm_state_indices, ref_states, N, T, atol=1e-1,
                       rtol=5e-2)


@device_param
def test_spec_decode_all_padded(device):
    """All-padded spec batch: output=0, state pool slot 0 not corrupted."""
    manual_seed(42)
    N, H, HV, D, num_spec_tokens = 4, 8, 8, 64, 2
    T = 1 + num_spec_tokens
    dtype = torch.bfloat16
    total_tokens = N * T
    cu_seqlens = torch.arange(0, total_tokens + 1, step=T, dtype=torch.int32, device=device)
    ssm_state_indices = torch.full((N, T), -1, dtype=torch.int32, device=device)
    q = torch.rand(1, total_tokens, H, D, dtype=dtype, device=device)
    k = torch.rand(1, total_tokens, H, D, dtype=dtype, device=device)
    v = torch.rand(1, total_tokens, HV, D, dtype=dtype, device=device)
    g = torch.zeros(1, total_tokens, HV, D, dtype=dtype, device=device)
    beta = torch.ones(1, total_tokens, HV, dtype=dtype, device=device) * 0.1
    scale = D ** -0.5
    state_pool = torch.randn(1, HV, D, D, dtype=dtype, device=device) * 0.5
    slot0_before = state_pool[0].clone()
    tri_out, _ = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                               initial_state=state_pool, cu_seqlens=cu_seqlens,
                               ssm_state_indices=ssm_state_indices,
                               num_spec_tokens=num_spec_tokens)
    assert tri_out.abs().max().item() == 0.0, (
        f"All-padded output should be zero, max={tri_out.abs().max().item()}")
    assert_close("allpad_slot0", slot0_before.float().transpose(-1, -2),
                 state_pool[0].float().transpose(-1, -2), atol=1e-3, rtol=1e-3)


@device_param
def test_spec_decode_nat_equals_one_matches_no_nat(device):
    """nat=1 for all sequences produces bit-identical output to nat=None."""
    manual_seed(123)
    for D in [64, 128]:
        H = HV = 8 if D == 64 else 16
        N, num_spec_tokens = 4, 2
        q, k, v, g, beta, cu_seqlens, ssm_state_indices, state_pool, scale, _ = (
            make_spec_decode_inputs(N, H, HV, D, num_spec_tokens, device))
        pool_a, pool_b = state_pool.clone(), state_pool.clone()
        common = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, cu_seqlens=cu_seqlens,
                      ssm_state_indices=ssm_state_indices, num_spec_tokens=num_spec_tokens)
        out_none, _ = recurrent_kda(initial_state=pool_a, **common)
        nat_1 = torch.ones(N, dtype=torch.int32, device=device)
        out_1, _ = recurrent_kda(initial_state=pool_b, num_accepted_tokens=nat_1, **common)
        assert_close(f"nat1_compat_D{D}_out", out_none, out_1, atol=0, rtol=0)
        assert_close(f"nat1_compat_D{D}_state", pool_a, pool_b, atol=0, rtol=0)


@device_param
def test_spec_decode_checkpoint_correctness(device):
    """Stress test: N=8, H=16, D=128, S=4 -- all T checkpoint slots correct."""
    manual_seed(42)
    N, H, HV, D, num_spec_tokens = 8, 16, 16, 128, 4
    q, k, v, g, beta, cu_seqlens, ssm_state_indices, state_pool, scale, T = (
        make_spec_decode_inputs(N, H, HV, D, num_spec_tokens, device, torch.bfloat16))
    ref_out, ref_states = spec_decode_naive_reference(
        q, k, v, g, beta, ssm_state_indices, state_pool, scale, N, T, H, HV)
    tri_state_pool = state_pool.clone()
    tri_out, _ = recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                               initial_state=tri_state_pool, cu_seqlens=cu_seqlens,
                               ssm_state_indices=ssm_state_indices,
                               num_spec_tokens=num_spec_tokens)
    assert_close("checkpoint_out", ref_out.bfloat16().float(), tri_out.float(), atol=1e-1,
                 rtol=5e-2)
    assert_spec_states(tri_state_pool, ssm_state_indices, ref_states, N, T, atol=1e-1,
                       rtol=5e-2)
