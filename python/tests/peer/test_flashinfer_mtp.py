"""FlashInfer's MTP (multi-token verify) tests, ported to ``deltastate.gated_delta_rule_mtp``.

Source (flashinfer-ai/flashinfer): tests/gdn/test_decode_delta_rule.py (its
``_test_verify_kernel_mtp`` with test_verify_kernel_mtp and
test_mtp_fp32_state_with_cache_and_state_update, as stored in the public index in December 2026,
e.g. at 01a03f3c84bb6c128286915215b521da8408d5dc). From the same file, as stored in the public
index in December 2026 (its commit unknown): ``_test_mtp_fp32_state_pool`` with
test_mtp_fp32_state_pool; ``_packed_qkv`` / ``_packed_qkv_params`` with test_mtp_packed_qkv;
``_dtype_case_inputs`` / ``_dtype_case_run`` / ``_dtype_case_reference`` (its "fp32_state_mtp"
case) with test_gdn_decode_mtp_honors_non_bf16_output_buffer and
test_gdn_decode_mtp_non_bf16_output_preserves_padding_slots. Function: flashinfer/gdn_decode.py::
gated_delta_rule_mtp @ 0012242372e76773b328c4bbfb0045409898888d (see docs/PEERS.md).

What changed in the port:
  * The op is ``deltastate.gated_delta_rule_mtp`` called exactly as FlashInfer's test calls it
    (keywords, FlashInfer's names), its return values used as FlashInfer's test uses them.
  * FlashInfer's oracle is ``tests/gdn/reference_delta_rule.py::verify_delta_rule`` (a torch
    float32 recurrence on K-major [B, HV, K, V] states). The port's ``verify_delta_rule`` is a
    rewrite of the same recurrence on the V-major layout the op takes (FlashInfer's test transposes
    between the two): g = -exp(A_log) * softplus(a + dt_bias) (beta 1, threshold 20),
    beta = sigmoid(b), q and k L2-normalized after the GQA expansion, q scaled; per token
    S <- exp(g) S, S <- S + k (beta (v - S k))^T, o = S q; the state after every token kept.
  * Inputs, sizes, seeds, tolerances (bf16 inputs: atol = rtol = 1e-2 on outputs and states) and
    assertions are kept. FlashInfer skips without an SM90+ GPU; here CPU tensors always run and
    CUDA tensors when present. On CPU the batch sizes above 4 are skipped (a [B, T, 32, 128, 128]
    fp32 buffer per case); CUDA runs use FlashInfer's sizes.
  * test_mtp_fp32_state_pool: FlashInfer's oracle is the op itself (gather the read slots, run
    them as a B-sized pool with identity indices, compare outputs, written slots and cached
    intermediates at atol = rtol = 1e-3, untouched slots exactly); kept, with its seeding
    (``random`` and torch). Batch 16 is skipped on CPU (a [48, 32, 128, 128] pool and up to
    two [16, 4, 32, 128, 128] fp32 buffers per case), as above.
  * test_mtp_packed_qkv: kept as is (bit-identical outputs for packed and contiguous q/k/v), all
    of FlashInfer's batch sizes on CPU too (no [B, T, ...] state buffer; under a second each).
  * The two non-bf16 output tests: ``_dtype_case_inputs`` takes the device; ``_DTYPE_CASES`` and
    ``_dtype_case_run`` keep only FlashInfer's "fp32_state_mtp" case (its other cases run
    FlashInfer's decode kernels, not gated_delta_rule_mtp); ``_dtype_case_reference`` calls the
    port's V-major ``verify_delta_rule`` on the state as given (FlashInfer transposes it to its
    reference's K-major layout). Inputs are bf16 as in FlashInfer; tolerances (atol 3e-4,
    rtol 3e-2; sentinel rows exact) kept. deltastate writes the fp16 output directly (FlashInfer
    stages through bf16), which the assertions allow.
  * Not ported: test_mtp_fp32_state_pool_non_contiguous: deltastate refuses a pool whose head
    stride is not V*K (FlashInfer's 4-D pool indexing, vLLM's page-strided pools), a documented
    difference (README drop-in table, docs/PEERS.md section 10). Also not ported:
    test_gdn_decode_fp16_inputs_are_converted_not_reinterpreted: it asserts the fp16-input
    output equals the bf16-input output rounded to fp16 bit for bit, i.e. that fp16 inputs are
    converted to bf16 and the result stored through bf16, while deltastate computes in the given
    dtypes and rounds its fp32 result straight to fp16 (documented); the other dtype-case tests
    (compile-cache and dt_bias interleaving, default output not shared) run FlashInfer's decode
    kernels (its bf16-state cases), not gated_delta_rule_mtp.
"""

import math
import os
import random

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F

from _peer_common import device_param

import deltastate as ds


def verify_delta_rule(q, k, v, state, A_log, a, dt_bias, b, scale_factor):
    """Returns (o [B,T,HV,V] float32, final state [B,HV,V,K], states [B,T,HV,V,K])."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    rep = HV // H
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), beta=1.0,
                                               threshold=20.0)
    beta = torch.sigmoid(b.float())
    S = state.float().clone()
    o = torch.zeros(B, T, HV, v.shape[3], dtype=torch.float32, device=q.device)
    states = torch.zeros((B, T) + tuple(state.shape[1:]), dtype=torch.float32, device=q.device)
    for t in range(T):
        qt = q[:, t].float().repeat_interleave(rep, 1)
        kt = k[:, t].float().repeat_interleave(rep, 1)
        qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6) * scale_factor
        kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
        S = S * torch.exp(g[:, t])[..., None, None]
        u = beta[:, t][..., None] * (v[:, t].float() - torch.einsum("bhvk,bhk->bhv", S, kt))
        S = S + u[..., :, None] * kt[..., None, :]
        o[:, t] = torch.einsum("bhvk,bhk->bhv", S, qt)
        states[:, t] = S
    return o, S, states


def _test_verify_kernel_mtp(device, dtype, batch_size, num_q_heads, num_k_heads, num_v_heads,
                            head_size, seq_len, scale, alpha, beta, cache_intermediate_states=True,
                            disable_state_update=True, seed=0):
    if device == "cpu" and batch_size > 4:
        pytest.skip("batch above 4: CUDA only in the port (CPU memory and time)")
    torch.manual_seed(seed)
    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    B, T, H, HV, K, V = batch_size, seq_len, num_q_heads, num_v_heads, head_size, head_size
    q = torch.randn(B, T, H, K, dtype=torch_dtype, device=device) * 0.1
    k = torch.randn(B, T, num_k_heads, K, dtype=torch_dtype, device=device) * 0.1
    v = torch.randn(B, T, HV, V, dtype=torch_dtype, device=device) * 0.1
    A_log = (torch.randn(HV, dtype=torch.float32, device=device) * 0.1 if alpha
             else torch.zeros(HV, dtype=torch.float32, device=device))
    dt_bias = (torch.randn(HV, dtype=torch.float32, device=device) * 0.1 if alpha
               else torch.zeros(HV, dtype=torch.float32, device=device))
    a = (torch.randn(B, T, HV, dtype=torch_dtype, device=device) * 0.1 if alpha
         else torch.zeros(B, T, HV, dtype=torch_dtype, device=device))
    b_tensor = (torch.randn(B, T, HV, dtype=torch_dtype, device=device) * 0.1 if beta
                else torch.zeros(B, T, HV, dtype=torch_dtype, device=device))
    pool_size = B
    initial_state = torch.randn(pool_size, HV, V, K, dtype=torch.float32, device=device) * 0.01
    initial_state_indices = torch.arange(B, dtype=torch.int32, device=device)
    intermediate_states_buffer = (
        torch.zeros(pool_size, T, HV, V, K, dtype=torch.float32, device=device)
        if cache_intermediate_states else None)
    scale_val = 1.0 / math.sqrt(K) if scale == "auto" else scale
    initial_state_kernel = initial_state.clone()
    output_kernel, final_state_kernel = ds.gated_delta_rule_mtp(
        q=q, k=k, v=v, initial_state=initial_state_kernel,
        initial_state_indices=initial_state_indices, A_log=A_log, a=a, dt_bias=dt_bias,
        b=b_tensor, scale=scale_val, output=None,
        intermediate_states_buffer=intermediate_states_buffer,
        disable_state_update=disable_state_update, use_qk_l2norm=True)
    output_ref, final_state_ref, intermediate_states_ref = verify_delta_rule(
        q, k, v, initial_state.clone(), A_log, a, dt_bias, b_tensor, scale_val)
    if dtype == "bfloat16":
        atol_o = rtol_o = atol_s = rtol_s = 1e-2
    else:
        atol_o = rtol_o = atol_s = rtol_s = 1e-3
    torch.testing.assert_close(output_kernel.float(), output_ref.float(), atol=atol_o,
                               rtol=rtol_o,
                               msg=f"Output mismatch for MTP kernel (B={B}, T={T}, dtype={dtype})")
    if cache_intermediate_states:
        torch.testing.assert_close(intermediate_states_buffer.float(),
                                   intermediate_states_ref.float(), atol=atol_s, rtol=rtol_s)
    if not disable_state_update:
        torch.testing.assert_close(final_state_kernel.float(), final_state_ref.float(),
                                   atol=atol_s, rtol=rtol_s)
    else:
        assert torch.equal(final_state_kernel, initial_state), "disable_state_update"


@device_param
@pytest.mark.parametrize("cache_intermediate_states", [True, False])
@pytest.mark.parametrize("seq_len", [2, 4, 8])
@pytest.mark.parametrize("batch_size", [1, 2, 4, 8, 16])
def test_verify_kernel_mtp(device, batch_size, seq_len, cache_intermediate_states,
                           seed=int(os.environ.get("SEED", "0"))):
    _test_verify_kernel_mtp(device, "bfloat16", batch_size, 16, 16, 32, 128, seq_len, 1.0, True,
                            True, cache_intermediate_states, True, seed)


@device_param
@pytest.mark.parametrize("seq_len", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("batch_size", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
def test_mtp_fp32_state_with_cache_and_state_update(device, batch_size, seq_len,
                                                    seed=int(os.environ.get("SEED", "0"))):
    _test_verify_kernel_mtp(device, "bfloat16", batch_size, 16, 16, 32, 128, seq_len,
                            1.0 / math.sqrt(128), True, True, True, False, seed)


# ---- fp32 pool + indices (gather -> direct -> scatter) -----------------------------------------
def _test_mtp_fp32_state_pool(device, batch_size, seq_len, head_size=128, pool_multiplier=3,
                              use_separate_output_indices=False, cache_intermediate_states=False,
                              dtype="bfloat16", seed=None):
    """fp32 MTP pool path must match gather -> direct -> scatter reference."""
    if device == "cpu" and batch_size > 4:
        pytest.skip("batch above 4: CUDA only in the port (CPU memory and time)")
    if seed is not None:
        random.seed(seed)
        torch.random.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed(seed)
    num_q_heads, num_k_heads, num_v_heads = 16, 16, 32
    HV = num_v_heads
    K = V = head_size
    B, T = batch_size, seq_len
    pool_size = B * pool_multiplier
    dtype_torch = getattr(torch, dtype)
    scale_val = 1.0 / math.sqrt(K)

    q = torch.randn(B, T, num_q_heads, K, dtype=dtype_torch, device=device) * 0.1
    k = F.normalize(torch.randn(B, T, num_k_heads, K, dtype=dtype_torch, device=device), p=2.0,
                    dim=-1)
    v = torch.randn(B, T, HV, V, dtype=dtype_torch, device=device) * 0.1
    A_log = torch.randn(HV, dtype=torch.float32, device=device) * 0.1
    dt_bias = torch.randn(HV, dtype=torch.float32, device=device) * 0.1
    a = torch.randn(B, T, HV, dtype=dtype_torch, device=device) * 0.1
    b = torch.randn(B, T, HV, dtype=dtype_torch, device=device)
    # fp32 pool in [pool, HV, V, K] K-last layout
    pool = torch.randn(pool_size, HV, V, K, dtype=torch.float32, device=device) * 0.01
    # every pool_multiplier-th slot: non-selected slots interleaved with selected ones
    read_indices = torch.arange(B, dtype=torch.int32, device=device) * pool_multiplier
    write_indices = read_indices + 1 if use_separate_output_indices else None
    intermediate_buffer = (torch.zeros(B, T, HV, V, K, dtype=torch.float32, device=device)
                           if cache_intermediate_states else None)

    # pool path under test
    pool_under_test = pool.clone()
    out_pool, _ = ds.gated_delta_rule_mtp(
        q=q, k=k, v=v, initial_state=pool_under_test, initial_state_indices=read_indices,
        A_log=A_log, a=a, dt_bias=dt_bias, b=b, scale=scale_val,
        intermediate_states_buffer=intermediate_buffer, disable_state_update=False,
        use_qk_l2norm=True, output_state_indices=write_indices)

    # gather -> direct -> scatter reference: the gathered states as a B-sized pool, identity
    # indices, its own intermediate buffer
    gathered_state = pool[read_indices].clone()
    direct_indices = torch.arange(B, dtype=torch.int32, device=device)
    intermediate_buffer_ref = (torch.zeros(B, T, HV, V, K, dtype=torch.float32, device=device)
                               if cache_intermediate_states else None)
    out_direct, updated_direct = ds.gated_delta_rule_mtp(
        q=q, k=k, v=v, initial_state=gathered_state, initial_state_indices=direct_indices,
        A_log=A_log, a=a, dt_bias=dt_bias, b=b, scale=scale_val,
        intermediate_states_buffer=intermediate_buffer_ref, disable_state_update=False,
        use_qk_l2norm=True)

    atol = 1e-3
    rtol = 1e-3
    torch.testing.assert_close(out_pool, out_direct, atol=atol, rtol=rtol)
    expected_write_indices = write_indices if write_indices is not None else read_indices
    torch.testing.assert_close(pool_under_test[expected_write_indices], updated_direct,
                               atol=atol, rtol=rtol)
    # non-targeted slots exactly unchanged (read slots count as non-targeted when read != write)
    touched = torch.zeros(pool_size, dtype=torch.bool, device=device)
    touched[expected_write_indices] = True
    torch.testing.assert_close(pool_under_test[~touched], pool[~touched], atol=0.0, rtol=0.0)
    if cache_intermediate_states:
        torch.testing.assert_close(intermediate_buffer, intermediate_buffer_ref, atol=atol,
                                   rtol=rtol)


@device_param
@pytest.mark.parametrize("cache_intermediate_states", [False, True])
@pytest.mark.parametrize("use_separate_output_indices", [False, True])
@pytest.mark.parametrize("seq_len", [2, 4])
@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_mtp_fp32_state_pool(device, batch_size, seq_len, use_separate_output_indices,
                             cache_intermediate_states, seed=int(os.environ.get("SEED", "0"))):
    _test_mtp_fp32_state_pool(device, batch_size=batch_size, seq_len=seq_len,
                              use_separate_output_indices=use_separate_output_indices,
                              cache_intermediate_states=cache_intermediate_states, seed=seed)


# ---- packed q/k/v (head-dim slices of one fused buffer) ----------------------------------------
def _packed_qkv(batch_size, seq_len, num_q_heads, num_k_heads, num_v_heads, head_size, device):
    """q/k/v as non-compact head-dim slices of one fused [B, T, Htot, D] buffer."""
    htot = num_q_heads + num_k_heads + num_v_heads
    fused = torch.randn(batch_size, seq_len, htot, head_size, dtype=torch.bfloat16,
                        device=device)
    q = fused[:, :, :num_q_heads, :]
    k = fused[:, :, num_q_heads:num_q_heads + num_k_heads, :]
    v = fused[:, :, num_q_heads + num_k_heads:, :]
    assert not q.is_contiguous(), "expected a non-compact (packed) view"
    return q, k, v


def _packed_qkv_params(batch_size, seq_len, num_v_heads, device):
    a = torch.randn(batch_size, seq_len, num_v_heads, dtype=torch.bfloat16, device=device) * 0.1
    b = torch.randn(batch_size, seq_len, num_v_heads, dtype=torch.bfloat16, device=device)
    A_log = torch.randn(num_v_heads, dtype=torch.float32, device=device) * 0.1
    dt_bias = torch.randn(num_v_heads, dtype=torch.float32, device=device) * 0.1
    return a, b, A_log, dt_bias


@device_param
@pytest.mark.parametrize("batch_size", [2, 8, 64])
@pytest.mark.parametrize("seq_len", [2, 4])
def test_mtp_packed_qkv(device, batch_size, seq_len):
    """MTP decode must accept packed q/k/v (bit-identical to contiguous)."""
    torch.manual_seed(0)
    Hq = Hk = 16
    HV = 32
    D = 128
    scale = 1.0 / math.sqrt(D)
    q, k, v = _packed_qkv(batch_size, seq_len, Hq, Hk, HV, D, device)
    a, b, A_log, dt_bias = _packed_qkv_params(batch_size, seq_len, HV, device)
    pool = torch.randn(batch_size, HV, D, D, dtype=torch.float32, device=device)
    idx = torch.arange(batch_size, dtype=torch.int32, device=device)
    kw = dict(A_log=A_log, a=a, dt_bias=dt_bias, b=b, initial_state_indices=idx, scale=scale,
              disable_state_update=True, use_qk_l2norm=True)
    o_p, _ = ds.gated_delta_rule_mtp(q=q, k=k, v=v, initial_state=pool.clone(), **kw)
    o_c, _ = ds.gated_delta_rule_mtp(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(),
                                     initial_state=pool.clone(), **kw)
    torch.testing.assert_close(o_p, o_c, atol=0, rtol=0)


# ---- caller-supplied non-bf16 output buffers ---------------------------------------------------
# case -> (seq_len, state dtype); only FlashInfer's MTP case (the others run its decode kernels)
_DTYPE_CASES = {
    "fp32_state_mtp": (2, torch.float32),
}


def _dtype_case_inputs(case, dtype, batch_size, device, seed=0, dt_bias_dtype=torch.float32):
    seq_len, state_dtype = _DTYPE_CASES[case]
    H, HV, D = 16, 32, 128
    torch.manual_seed(seed)
    return dict(
        q=torch.randn(batch_size, seq_len, H, D, dtype=dtype, device=device) * 0.1,
        k=torch.randn(batch_size, seq_len, H, D, dtype=dtype, device=device) * 0.1,
        v=torch.randn(batch_size, seq_len, HV, D, dtype=dtype, device=device) * 0.1,
        a=torch.randn(batch_size, seq_len, HV, dtype=dtype, device=device) * 0.1,
        b=torch.randn(batch_size, seq_len, HV, dtype=dtype, device=device) * 0.1,
        A_log=torch.randn(HV, dtype=torch.float32, device=device) * 0.1,
        dt_bias=(torch.randn(HV, dtype=torch.float32, device=device) * 0.1).to(dt_bias_dtype),
        state=(torch.randn(batch_size, HV, D, D, dtype=state_dtype, device=device)
               * 0.01).contiguous(),
        scale=1.0 / math.sqrt(D),
    )


def _dtype_case_run(case, x, output=None):
    assert case == "fp32_state_mtp"
    batch_size = x["q"].shape[0]
    out, _ = ds.gated_delta_rule_mtp(
        q=x["q"], k=x["k"], v=x["v"], A_log=x["A_log"], a=x["a"], dt_bias=x["dt_bias"],
        b=x["b"], scale=x["scale"], use_qk_l2norm=True, output=output,
        initial_state=x["state"].clone(),
        initial_state_indices=torch.arange(batch_size, dtype=torch.int32,
                                           device=x["q"].device),
        disable_state_update=True)
    return out


def _dtype_case_reference(x):
    # FlashInfer transposes to its reference's K-major state; the port's reference is V-major.
    out, _, _ = verify_delta_rule(x["q"], x["k"], x["v"], x["state"].float(),
                                  x["A_log"].float(), x["a"], x["dt_bias"].float(), x["b"],
                                  x["scale"])
    return out


@device_param
def test_gdn_decode_mtp_honors_non_bf16_output_buffer(device, batch_size=4):
    """A caller-supplied non-bf16 `output=` must receive the real result."""
    out_dtype = torch.float16
    x = _dtype_case_inputs("fp32_state_mtp", torch.bfloat16, batch_size, device)
    B, T, _, D = x["q"].shape
    HV = x["v"].shape[2]
    output = torch.zeros(B, T, HV, D, dtype=out_dtype, device=x["q"].device)
    returned = _dtype_case_run("fp32_state_mtp", x, output=output)
    ref = _dtype_case_reference(x).float()
    assert returned.dtype == out_dtype
    torch.testing.assert_close(returned.float(), ref, atol=3e-4, rtol=3e-2)
    torch.testing.assert_close(output.float(), ref, atol=3e-4, rtol=3e-2)


@device_param
def test_gdn_decode_mtp_non_bf16_output_preserves_padding_slots(device, batch_size=4):
    """Non-bf16 `output=` must not clobber padding rows: negative `initial_state_indices` rows
    keep what the caller put there."""
    out_dtype = torch.float16
    x = _dtype_case_inputs("fp32_state_mtp", torch.bfloat16, batch_size, device)
    B, T, _, D = x["q"].shape
    HV = x["v"].shape[2]
    indices = torch.arange(B, dtype=torch.int32, device=device)
    indices[-1] = -1
    sentinel = 42.0
    output = torch.full((B, T, HV, D), sentinel, dtype=out_dtype, device=device)
    returned, _ = ds.gated_delta_rule_mtp(
        q=x["q"], k=x["k"], v=x["v"], initial_state=x["state"].clone(),
        initial_state_indices=indices, A_log=x["A_log"], a=x["a"], dt_bias=x["dt_bias"],
        b=x["b"], scale=x["scale"], disable_state_update=True, use_qk_l2norm=True,
        output=output)
    assert returned.dtype == out_dtype
    torch.testing.assert_close(returned.float(), output.float(), atol=0, rtol=0)
    padding_rows = indices < 0
    assert padding_rows.any(), "test needs at least one padding slot"
    torch.testing.assert_close(output[padding_rows].float(),
                               torch.full_like(output[padding_rows].float(), sentinel),
                               atol=0, rtol=0)
    valid_rows = ~padding_rows
    ref = _dtype_case_reference(x).float()
    torch.testing.assert_close(output[valid_rows].float(), ref[valid_rows], atol=3e-4,
                               rtol=3e-2)
