"""Random inputs for the ops, as float64 data first and framework arrays second, so the same
inputs can be materialized on several frameworks/devices (numpy, torch CPU, torch CUDA)."""

from __future__ import annotations

import numpy as np

from helpers import Fw, PoolBuf


def gate_logits(rng, shape):
    """Raw gate inputs `a`: mostly N(0, 1), with one value past the softplus threshold (20)."""
    a = rng.standard_normal(shape)
    if a.size:
        a.reshape(-1)[0] = 25.0
    return a


def gate_params(rng, HV, K, kda):
    A_log = rng.uniform(-1.0, 0.5, HV)
    dt_bias = rng.standard_normal(HV * K if kda else HV) * 0.5
    return A_log, dt_bias


# ---- packed decode / ReplaySSM step -----------------------------------------------------------
def packed_data(rng, *, kda, B, H, HV, K, V):
    """float64 inputs of one packed decode step: mixed_qkv, a, b (A_log/dt_bias: gate_params)."""
    return {
        "mixed_qkv": rng.standard_normal((B, 2 * H * K + HV * V)),
        "a": gate_logits(rng, (B, HV * K if kda else HV)),
        "b": rng.standard_normal((B, HV)),
    }


def materialize_packed(fw: Fw, d, act: str, *, row_pad: int = 0):
    """mixed_qkv, a, b in the activation dtype. With row_pad > 0 the rows of mixed_qkv, a and b
    are `row_pad` elements longer than their width (row-strided views of wider buffers)."""
    out = {}
    for name in ("mixed_qkv", "a", "b"):
        x = d[name]
        if row_pad:
            wide = np.concatenate([x, np.full((x.shape[0], row_pad), 7.0)], axis=1)
            full = fw.from64(wide, act)
            out[name] = full[:, : x.shape[1]]
        else:
            out[name] = fw.from64(x, act)
    return out


def pool_data(rng, slots, HV, V, K, scale=0.5):
    return rng.standard_normal((slots, HV, V, K)) * scale


def make_pool(fw: Fw, data64, dtype, live, *, envelope=True):
    """A PoolBuf holding data64[s] in every live slot, sentinels elsewhere."""
    slots, HV, V, K = data64.shape
    p = PoolBuf(fw, slots, HV, V, K, dtype, None, [], envelope=envelope)
    for s in live:
        fw.assign(p.view[s], data64[s], dtype)
    p.live = list(live)
    return p


# ---- recurrent --------------------------------------------------------------------------------
def recurrent_data(rng, *, kda, B, T, H, HV, K, V, use_gate_in_kernel, beta_is_logit):
    """float64 q, k [B,T,H,K], v [B,T,HV,V], g, beta. g is the raw gate input with the in-kernel
    gate, else a log-space decay in (-1, 0); beta a logit or a probability."""
    gshape = (B, T, HV, K) if kda else (B, T, HV)
    if use_gate_in_kernel:
        g = gate_logits(rng, gshape)
    else:
        g = -rng.uniform(0.01, 1.0, gshape)
    beta = rng.standard_normal((B, T, HV)) if beta_is_logit else rng.uniform(0.05, 0.95, (B, T, HV))
    return {
        "q": rng.standard_normal((B, T, H, K)),
        "k": rng.standard_normal((B, T, H, K)),
        "v": rng.standard_normal((B, T, HV, V)),
        "g": g,
        "beta": beta,
    }


def materialize_recurrent(fw: Fw, d, act: str, *, strided_qkv: bool = False):
    """q, k, v, g, beta in the activation dtype. With strided_qkv, q/k/v are views into one fused
    [B, T, 2HK + HV V] buffer (vector dims contiguous, other strides not)."""
    out = {}
    if strided_qkv:
        B, T, H, K = d["q"].shape
        HV, V = d["v"].shape[2:]
        fused = np.concatenate([d["q"].reshape(B, T, H * K), d["k"].reshape(B, T, H * K),
                                d["v"].reshape(B, T, HV * V)], axis=-1)
        f = fw.from64(fused, act)
        out["k"] = _head_view(fw, f, H * K, (B, T, H, K))
        out["v"] = _head_view(fw, f, 2 * H * K, (B, T, HV, V))
        out["q"] = _head_view(fw, f, 0, (B, T, H, K))
    else:
        for name in ("q", "k", "v"):
            out[name] = fw.from64(d[name], act)
    out["g"] = fw.from64(d["g"], "float32")
    out["beta"] = fw.from64(d["beta"], act)
    return out


def _head_view(fw: Fw, fused, start, shape):
    """[B, T, heads, dim] view of columns [start, start + heads*dim) of a [B, T, W] buffer."""
    B, T, heads, dim = shape
    if fw.name == "torch":
        return fused[..., start: start + heads * dim].unflatten(-1, (heads, dim))
    item = fused.itemsize
    return np.lib.stride_tricks.as_strided(fused[..., start:], shape,
                                           (fused.strides[0], fused.strides[1], dim * item, item))
