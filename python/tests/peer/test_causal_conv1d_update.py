"""causal-conv1d's causal_conv1d_update tests, ported to deltastate's ``causal_conv1d_update``.

Source (Dao-AILab/causal-conv1d): tests/test_causal_conv1d.py
@ 0d2252d161f25f7907bbd05985c08ab98d255874
    - test_causal_conv1d_update                  -> test_causal_conv1d_update
    - test_causal_conv1d_update_with_batch_gather -> test_causal_conv1d_update_with_batch_gather
    - test_causal_conv1d_update_with_padding      -> test_causal_conv1d_update_with_padding
The function under test is causal_conv1d/causal_conv1d_interface.py's causal_conv1d_update,
whose reference is causal_conv1d_update_ref in the same file (rewritten below from its
semantics: concatenate window and x, a depthwise conv in the weight's dtype, copy the window's
tail; or, with cache_seqlens, gather and scatter at cache_seqlens % state_len).

What changed in the port:
  * Device: "cuda" in the package; here CPU and (when available) CUDA tensors.
  * Sizes: dim {2048, 2064, 4096} and batch 64 in the package; on the CPU dim 80 and batch
    8 (DELTASTATE_PEER_FULL=1 restores the package's sizes), every other parameter as the
    package has it (widths 2-4, seqlen 1/4/5, bias, silu, cache_seqlens, the dtypes).
  * Tolerances, the x and window layouts (transposed views: stride 1 along dim) and the
    assertions (windows exactly equal, outputs allclose) are the package's.
"""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F

from _peer_common import DEVICES, FULL, peer_op

def causal_conv1d_update_ref(x, conv_state, weight, bias=None, activation=None,
                             cache_seqlens=None):
    dtype_in = x.dtype
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    state_len = conv_state.shape[-1]
    if cache_seqlens is None:
        seq = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
        conv_state.copy_(seq[:, :, -state_len:])
    else:
        offs = (torch.arange(-(width - 1), 0, device=x.device).unsqueeze(0)
                + cache_seqlens.unsqueeze(1))
        gather = torch.remainder(offs, state_len).unsqueeze(1).expand(-1, dim, -1)
        seq = torch.cat([conv_state.gather(2, gather), x], dim=-1).to(weight.dtype)
        put = torch.arange(seqlen, device=x.device).unsqueeze(0) + cache_seqlens.unsqueeze(1)
        put = torch.remainder(put, state_len).unsqueeze(1).expand(-1, dim, -1)
        conv_state.scatter_(2, put, x)
    out = F.conv1d(seq, weight.unsqueeze(1), bias, padding=0, groups=dim)[:, :, -seqlen:]
    if squeeze:
        out = out.squeeze(-1)
    return (out if activation is None else F.silu(out)).to(dtype=dtype_in)


def _sizes(device):
    if FULL or device != "cpu":
        return [2048, 2048 + 16, 4096], 64
    return [80], 8


def _tol(itype):
    rtol, atol = (3e-4, 1e-3) if itype == torch.float32 else (3e-3, 5e-3)
    if itype == torch.bfloat16:
        rtol, atol = 1e-2, 5e-2
    return rtol, atol


PARAMS = [(d, dim, w, s, c, hb, a, it)
          for d in DEVICES
          for dim in _sizes(d)[0]
          for w in (2, 3, 4)
          for s in (1, 4, 5)
          for c in (False, True)
          for hb in (False, True)
          for a in (False, True)
          for it in (torch.float32, torch.float16, torch.bfloat16)]
IDS = [f"{d}-dim{dim}-w{w}-T{s}-cache{int(c)}-bias{int(hb)}-silu{int(a)}-{str(it)[6:]}"
       for d, dim, w, s, c, hb, a, it in PARAMS]


def _inputs(device, dim, width, seqlen, itype, entries, batch, has_bias):
    x = torch.randn(batch, seqlen, dim, device=device, dtype=itype).transpose(-1, -2)
    state_len = torch.randint(width - 1, width + 10, (1,)).item()
    conv_state = torch.randn(entries, state_len, dim, device=device, dtype=itype).transpose(-1, -2)
    weight = torch.randn(dim, width, device=device, dtype=torch.float32)
    bias = torch.randn(dim, device=device, dtype=torch.float32) if has_bias else None
    return x, conv_state, weight, bias


@pytest.mark.parametrize("device,dim,width,seqlen,has_cache_seqlens,has_bias,silu_activation,itype",
                         PARAMS, ids=IDS)
def test_causal_conv1d_update(device, dim, width, seqlen, has_cache_seqlens, has_bias,
                              silu_activation, itype):
    op = peer_op("causal_conv1d_update")
    rtol, atol = _tol(itype)
    torch.random.manual_seed(0)
    batch = _sizes(device)[1]
    x, conv_state, weight, bias = _inputs(device, dim, width, seqlen, itype, batch, batch, has_bias)
    conv_state_ref = conv_state.detach().clone()
    activation = None if not silu_activation else "silu"
    cache_seqlens = (torch.randint(0, 1024, (batch,), dtype=torch.int32, device=device)
                     if has_cache_seqlens else None)
    out = op(x, conv_state, weight, bias, activation=activation, cache_seqlens=cache_seqlens)
    out_ref = causal_conv1d_update_ref(x, conv_state_ref, weight, bias, activation=activation,
                                       cache_seqlens=cache_seqlens)
    assert torch.equal(conv_state, conv_state_ref)
    assert torch.allclose(out, out_ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("device,dim,width,seqlen,has_cache_seqlens,has_bias,silu_activation,itype",
                         PARAMS, ids=IDS)
def test_causal_conv1d_update_with_batch_gather(device, dim, width, seqlen, has_cache_seqlens,
                                                has_bias, silu_activation, itype):
    op = peer_op("causal_conv1d_update")
    rtol, atol = _tol(itype)
    torch.random.manual_seed(0)
    batch = _sizes(device)[1]
    total_entries = 10 * batch
    x, conv_state, weight, bias = _inputs(device, dim, width, seqlen, itype, total_entries, batch,
                                          has_bias)
    conv_state_indices = torch.randperm(total_entries)[:batch].to(dtype=torch.int32, device=device)
    conv_state_ref = conv_state[conv_state_indices, :].detach().clone()
    activation = None if not silu_activation else "silu"
    cache_seqlens = (torch.randint(0, 1024, (batch,), dtype=torch.int32, device=device)
                     if has_cache_seqlens else None)
    out = op(x, conv_state, weight, bias, activation=activation, cache_seqlens=cache_seqlens,
             conv_state_indices=conv_state_indices)
    out_ref = causal_conv1d_update_ref(x, conv_state_ref, weight, bias, activation=activation,
                                       cache_seqlens=cache_seqlens)
    assert torch.equal(conv_state[conv_state_indices, :], conv_state_ref)
    assert torch.allclose(out, out_ref, rtol=rtol, atol=atol)


PAD_PARAMS = [p for p in PARAMS if not p[4]]  # the package runs padding without cache_seqlens
PAD_IDS = [i for p, i in zip(PARAMS, IDS) if not p[4]]


@pytest.mark.parametrize("device,dim,width,seqlen,has_cache_seqlens,has_bias,silu_activation,itype",
                         PAD_PARAMS, ids=PAD_IDS)
def test_causal_conv1d_update_with_padding(device, dim, width, seqlen, has_cache_seqlens,
                                           has_bias, silu_activation, itype):
    op = peer_op("causal_conv1d_update")
    rtol, atol = _tol(itype)
    torch.random.manual_seed(0)
    batch = _sizes(device)[1]
    total_entries = 10 * batch
    x, conv_state, weight, bias = _inputs(device, dim, width, seqlen, itype, total_entries, batch,
                                          has_bias)
    num_valid = batch // 2
    valid = torch.randperm(total_entries)[:num_valid].to(device=device)
    padded = torch.full((batch - num_valid,), -1, device=device)
    perm = torch.randperm(batch, device=device)
    conv_state_indices = torch.cat([valid, padded])[perm].to(dtype=torch.int32)
    activation = "silu" if silu_activation else None
    conv_state_original = conv_state.clone()
    out = op(x, conv_state, weight, bias, activation=activation, cache_seqlens=None,
             conv_state_indices=conv_state_indices)
    out_ref = torch.zeros_like(out)
    conv_state_expected = conv_state_original.clone()
    mask = conv_state_indices != -1
    live = conv_state_indices[mask]
    updated = conv_state_original[live, :].detach().clone()
    out_ref[mask] = causal_conv1d_update_ref(x[mask], updated, weight, bias,
                                             activation=activation)
    conv_state_expected[live] = updated
    assert torch.equal(conv_state, conv_state_expected)
    assert torch.allclose(out, out_ref, rtol=rtol, atol=atol)
    assert torch.all(out[~mask] == 0)
