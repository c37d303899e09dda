"""Tensor-parallel linear attention over torch.distributed: one Qwen3-Next GatedDeltaNet layer and
one Kimi-Linear KDA layer, sharded by heads, with deltastate's chunked prefill and packed decode on
each rank's shard and a per-rank :class:`deltastate.StatePool`.

Sharding (Megatron-style, the engines' own scheme; docs/TENSOR_PARALLEL.md):

- every input projection is column-parallel by heads: rank r holds the rows of its key heads
  (and of the value heads grouped under them) of every projection, the conv weights of its
  channels, its A_log / dt_bias entries, the state pool for its value heads and the conv window
  of its channels; the input activations are replicated;
- the per-head RMS norm is local (it normalizes over one head's V channels);
- the output projection is row-parallel: each rank multiplies its heads' columns and the partial
  sums are added with ``torch.distributed.all_reduce``.

Heads are split at key-head granularity, as evenly as possible (the first ``H % tp`` ranks hold
one key head more), so a head count that does not divide by ``tp`` (TP = 3 on Qwen3-Next's 16 key
heads: 6, 5, 5) runs, unbalanced; ``tp > H`` is rejected naming the head counts, and
``uneven=False`` rejects any split that is not even.

Run it with ``python -m deltastate.tp`` under ``torchrun`` (scripts/tp.sh): gloo on the CPU, NCCL
on CUDA, NVLink multicast switched off before the process group exists.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import ops as _ops
from .pool import StatePool

# NVLink multicast (NVLS) can take a host's GPUs out of service; these switches keep it off in
# NCCL, PyTorch's symmetric memory and NVSHMEM. They are set before any process group exists.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def multicast_off() -> None:
    """Set the NVLink-multicast switches off in this process's environment (overriding any
    other value: the setting protects shared hosts)."""
    os.environ.update(MULTICAST_OFF)


# ---- geometry --------------------------------------------------------------------------------
@dataclass(frozen=True)
class GDNConfig:
    """Qwen3-Next GatedDeltaNet geometry: H key heads, HV value heads (HV % H == 0), head dims
    K and V, the depthwise causal conv's width, the gated RMS norm's epsilon."""

    hidden: int = 2048
    H: int = 16
    HV: int = 32
    K: int = 128
    V: int = 128
    conv_kernel: int = 4
    eps: float = 1e-6
    kind: str = field(default="gdn", init=False)

    @staticmethod
    def qwen3_next() -> "GDNConfig":
        return GDNConfig()

    @staticmethod
    def small() -> "GDNConfig":
        """CPU-test size with Qwen3-Next's head ratio (HV = 2 H)."""
        return GDNConfig(hidden=64, H=4, HV=8, K=16, V=16)


@dataclass(frozen=True)
class KDAConfig:
    """Kimi-Linear KDA geometry: H heads (query, key and value alike), head dim K = V."""

    hidden: int = 2304
    H: int = 32
    K: int = 128
    conv_kernel: int = 4
    eps: float = 1e-5
    kind: str = field(default="kda", init=False)

    @property
    def HV(self) -> int:
        return self.H

    @property
    def V(self) -> int:
        return self.K

    @staticmethod
    def kimi_linear() -> "KDAConfig":
        return KDAConfig()

    @staticmethod
    def small() -> "KDAConfig":
        return KDAConfig(hidden=64, H=4, K=16)


@dataclass(frozen=True)
class Shard:
    """The heads one rank holds: key heads [h0, h0 + h) and value heads [v0, v0 + hv)."""

    rank: int
    tp: int
    h0: int
    h: int
    v0: int
    hv: int


def head_shards(H: int, HV: int, tp: int, *, uneven: bool = True) -> List[Shard]:
    """Split H key heads (and the HV // H value heads grouped under each) over tp ranks.

    Every rank gets whole key-head groups, so GQA groups never straddle ranks; the first H % tp
    ranks get one key head more. Raises ValueError naming the head counts when tp > H (a rank
    would hold no head), when HV is not a multiple of H, or, with ``uneven=False``, when H does
    not divide by tp."""
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1; got tp={tp}")
    if H < 1 or HV % H != 0:
        raise ValueError(f"value heads HV={HV} must be a positive multiple of key heads H={H}")
    if tp > H:
        raise ValueError(f"cannot shard H={H} key heads (HV={HV} value heads) over tp={tp} ranks: "
                         f"every rank needs at least one key head; use tp <= {H}")
    if not uneven and H % tp != 0:
        raise ValueError(f"H={H} key heads (HV={HV} value heads) do not divide by tp={tp}; pass "
                         f"uneven=True to give the first {H % tp} rank(s) one key head more")
    r = HV // H
    base, extra = divmod(H, tp)
    shards, h0 = [], 0
    for rank in range(tp):
        h = base + (1 if rank < extra else 0)
        shards.append(Shard(rank, tp, h0, h, h0 * r, h * r))
        h0 += h
    return shards


# ---- random weights in the checkpoints' layouts -------------------------------------------------
def _normal(g: torch.Generator, *shape, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64).mul_(std).float()


def gdn_weights(cfg: GDNConfig, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Random full (TP = 1) weights in HF Qwen3NextGatedDeltaNet's layout: in_proj_qkvz rows
    grouped per key head [q K | k K | v r*V | z r*V], in_proj_ba grouped [b r | a r], the conv
    over the packed [q | k | v] channels, A_log / dt_bias per value head, the norm weight [V]."""
    g = torch.Generator().manual_seed(seed)
    r = cfg.HV // cfg.H
    conv_dim = 2 * cfg.H * cfg.K + cfg.HV * cfg.V
    s = cfg.hidden ** -0.5
    return {
        "in_proj_qkvz": _normal(g, cfg.H * (2 * cfg.K + 2 * r * cfg.V), cfg.hidden, std=s),
        "in_proj_ba": _normal(g, cfg.H * 2 * r, cfg.hidden, std=s),
        "conv1d": _normal(g, conv_dim, cfg.conv_kernel, std=cfg.conv_kernel ** -0.5),
        "A_log": torch.empty(cfg.HV).uniform_(0.01, 16, generator=g).log(),
        "dt_bias": 1.0 + _normal(g, cfg.HV, std=0.1),
        "norm": 1.0 + _normal(g, cfg.V, std=0.1),
        "out_proj": _normal(g, cfg.hidden, cfg.HV * cfg.V, std=(cfg.HV * cfg.V) ** -0.5),
    }


def kda_weights(cfg: KDAConfig, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Random full weights in Kimi-Linear's KimiDeltaAttention layout: q/k/v projections and
    their separate depthwise convs, the forget gate f_a [K, hidden] / f_b [H*K, K] with dt_bias
    [H*K] and A_log [H], beta b_proj [H, hidden], the output gate g_a / g_b, o_norm [K]."""
    g = torch.Generator().manual_seed(seed)
    D, s = cfg.H * cfg.K, cfg.hidden ** -0.5
    w = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        w[name] = _normal(g, D, cfg.hidden, std=s)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        w[name] = _normal(g, D, cfg.conv_kernel, std=cfg.conv_kernel ** -0.5)
    w["f_a_proj"] = _normal(g, cfg.K, cfg.hidden, std=s)
    w["f_b_proj"] = _normal(g, D, cfg.K, std=cfg.K ** -0.5)
    w["dt_bias"] = _normal(g, D, std=0.3)
    w["A_log"] = torch.empty(cfg.H).uniform_(1.0, 16.0, generator=g).log()
    w["b_proj"] = _normal(g, cfg.H, cfg.hidden, std=s)
    w["g_a_proj"] = _normal(g, cfg.K, cfg.hidden, std=s)
    w["g_b_proj"] = _normal(g, D, cfg.K, std=cfg.K ** -0.5)
    w["o_norm"] = 1.0 + _normal(g, cfg.K, std=0.1)
    w["o_proj"] = _normal(g, cfg.hidden, D, std=D ** -0.5)
    return w


def shard_gdn_weights(w: Dict[str, torch.Tensor], cfg: GDNConfig, s: Shard):
    """The rows / columns of rank s.rank: contiguous per-key-head groups of in_proj_qkvz and
    in_proj_ba (their rows are grouped by key head), the conv channels of its q, k and v heads,
    its value heads' A_log / dt_bias and out_proj columns; the norm weight is replicated."""
    r = cfg.HV // cfg.H
    gq, gb = 2 * cfg.K + 2 * r * cfg.V, 2 * r
    HK = cfg.H * cfg.K
    conv = w["conv1d"]
    return {
        "in_proj_qkvz": w["in_proj_qkvz"][s.h0 * gq:(s.h0 + s.h) * gq],
        "in_proj_ba": w["in_proj_ba"][s.h0 * gb:(s.h0 + s.h) * gb],
        "conv1d": torch.cat([conv[s.h0 * cfg.K:(s.h0 + s.h) * cfg.K],
                             conv[HK + s.h0 * cfg.K:HK + (s.h0 + s.h) * cfg.K],
                             conv[2 * HK + s.v0 * cfg.V:2 * HK + (s.v0 + s.hv) * cfg.V]]),
        "A_log": w["A_log"][s.v0:s.v0 + s.hv],
        "dt_bias": w["dt_bias"][s.v0:s.v0 + s.hv],
        "norm": w["norm"],
        "out_proj": w["out_proj"][:, s.v0 * cfg.V:(s.v0 + s.hv) * cfg.V],
    }


def shard_kda_weights(w: Dict[str, torch.Tensor], cfg: KDAConfig, s: Shard):
    """Column-parallel rows of rank s.rank (q/k/v, their convs, f_b, g_b, b_proj, dt_bias,
    A_log), row-parallel o_proj columns; the low-rank f_a / g_a and o_norm are replicated."""
    rows = slice(s.h0 * cfg.K, (s.h0 + s.h) * cfg.K)
    out = {name: w[name][rows] for name in ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d",
                                            "v_conv1d", "f_b_proj", "g_b_proj", "dt_bias")}
    out.update(f_a_proj=w["f_a_proj"], g_a_proj=w["g_a_proj"], o_norm=w["o_norm"],
               A_log=w["A_log"][s.h0:s.h0 + s.h], b_proj=w["b_proj"][s.h0:s.h0 + s.h],
               o_proj=w["o_proj"][:, rows])
    return out


# ---- plain-torch conv window and gated norm ------------------------------------------------------
def conv_prefill(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor,
                 cu: Sequence[int], slots: Sequence[int]) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU over varlen sequences x [T, C] (sequence n: rows
    [cu[n], cu[n+1])), each continuing from its slot's window [C, W-1] of earlier inputs; the
    windows are updated in place to each sequence's last W-1 inputs."""
    W = weight.shape[1]
    out = torch.empty_like(x)
    for n, slot in enumerate(slots):
        seq = x[cu[n]:cu[n + 1]]
        full = torch.cat([window[slot], seq.t()], dim=1)  # [C, W-1+L]
        y = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=full.shape[0])
        out[cu[n]:cu[n + 1]] = F.silu(y[0]).t()
        window[slot] = full[:, full.shape[1] - (W - 1):]
    return out


def conv_decode(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
    """One conv1d + SiLU step for rows x [B, C] at slots [B]; the windows shift in place."""
    full = torch.cat([window[slots], x.unsqueeze(2)], dim=2)  # [B, C, W]
    window[slots] = full[:, :, 1:]
    return F.silu((full * weight).sum(-1))


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                  act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """RMS norm over the last dim (one head's V channels) in fp32, times weight, times act(gate)
    (Qwen3-Next: SiLU; Kimi-Linear: sigmoid)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * act(gate.float())).to(x.dtype)


# ---- one layer's shard -------------------------------------------------------------------------
class _LayerShard:
    """State and weights of one rank: a StatePool of `slots` slots for the shard's value heads and
    a conv window [slots, C, W-1] for its channels; `prefill` / `decode` return the layer output
    [tokens, hidden], all-reduced over `group` when it has more than one rank.

    ``decode_core`` is the seam for a fused decode step: it takes the projected row (pre-conv
    mixed_qkv [B, C], the gate inputs, the norm gate) and the slot indices and returns the normed
    attention output [B, HV_local * V]. The default runs the conv window and the norm in plain
    torch around deltastate's packed decode; a fused conv + decode + norm op replaces it with one
    call (same arguments, same result)."""

    kind = ""

    def __init__(self, cfg, shard: Shard, weights, *, slots: int, device, dtype=torch.float32,
                 group=None, state_dtype="float32"):
        self.cfg, self.shard, self.device, self.dtype, self.group = cfg, shard, device, dtype, group
        self.w = {k: v.to(device=device, dtype=torch.float32 if k in ("A_log", "dt_bias") else
                          dtype).contiguous() for k, v in weights.items()}
        self.pool = StatePool(layers=1, slots=slots, HV=shard.hv, V=cfg.V, K=cfg.K,
                              state_dtype=state_dtype, device=device, framework="torch")
        self.state = self.pool.layer_state(0)
        self.conv_dim = (2 * shard.h * cfg.K + shard.hv * cfg.V)
        self.window = torch.zeros(slots, self.conv_dim, cfg.conv_kernel - 1, device=device,
                                  dtype=dtype)
        self.reduce = True  # bench: False measures the step without its all-reduce
        self.decode_core = self._decode_core_torch

    # slots: one pool slot and one conv window per request
    def allocate(self) -> int:
        slot = self.pool.allocate()
        self.window[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        self.pool.free(slot)

    def _all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        if self.reduce and self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(y, group=self.group)
        return y

    def _split(self, mixed: torch.Tensor):
        """q [N, h, K], k [N, h, K], v [N, hv, V] views of a packed row [N, C]."""
        s, K, V = self.shard, self.cfg.K, self.cfg.V
        q, k, v = torch.split(mixed, [s.h * K, s.h * K, s.hv * V], dim=-1)
        return (q.unflatten(-1, (s.h, K)), k.unflatten(-1, (s.h, K)), v.unflatten(-1, (s.hv, V)))

    def prefill(self, x: torch.Tensor, cu: Sequence[int], slots: Sequence[int]) -> torch.Tensor:
        """Varlen prefill of x [T, hidden] (sequence n: rows [cu[n], cu[n+1])) continuing each
        sequence from its slot (zero for a fresh slot); states and windows updated in place."""
        mixed, gate_in, beta_in, norm_gate = self._project(x)
        mixed = conv_prefill(mixed, self.w["conv"], self.window, cu, slots)
        q, k, v = (t.unsqueeze(0).contiguous() for t in self._split(mixed))
        idx = torch.tensor(list(slots), dtype=torch.int32, device=self.device)
        cu_t = torch.tensor(list(cu), dtype=torch.int64, device=self.device)
        o = self._chunk(q, k, v, gate_in.unsqueeze(0).contiguous(),
                        beta_in.unsqueeze(0).contiguous(), cu_t, idx)[0]
        y = gated_rmsnorm(o[0], norm_gate, self.w["norm"], self.cfg.eps, self._act)
        return self._all_reduce(y.flatten(1) @ self.w["out"].t())

    def decode(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One decode step of x [B, hidden] at slots [B] (int32)."""
        mixed, gate_in, beta_in, norm_gate = self._project(x)
        y = self.decode_core(mixed, gate_in, beta_in, norm_gate, slots)
        return self._all_reduce(y @ self.w["out"].t())

    def _decode_core_torch(self, mixed, gate_in, beta_in, norm_gate, slots):
        post = conv_decode(mixed, self.w["conv"], self.window, slots)
        o = torch.empty(post.shape[0], 1, self.shard.hv, self.cfg.V, device=self.device,
                        dtype=self.dtype)
        self._packed(post.contiguous(), gate_in.contiguous(), beta_in.contiguous(), o, slots)
        return gated_rmsnorm(o[:, 0], norm_gate, self.w["norm"], self.cfg.eps,
                             self._act).flatten(1)


class GDNShard(_LayerShard):
    """A rank's shard of Qwen3NextGatedDeltaNet (HF modeling_qwen3_next.py): the conv over the
    packed [q | k | v] row, g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) in the
    kernels, q/k L2-normed in the kernels, the SiLU-gated RMS norm, out_proj."""

    kind = "gdn"
    _act = staticmethod(F.silu)

    def __init__(self, cfg: GDNConfig, shard: Shard, weights, **kw):
        super().__init__(cfg, shard, weights, **kw)
        self.w["conv"], self.w["out"] = self.w.pop("conv1d"), self.w.pop("out_proj")

    def _project(self, x):
        s, K, V = self.shard, self.cfg.K, self.cfg.V
        r = s.hv // s.h
        qkvz = (x @ self.w["in_proj_qkvz"].t()).unflatten(-1, (s.h, 2 * K + 2 * r * V))
        q, k, v, z = torch.split(qkvz, [K, K, r * V, r * V], dim=-1)
        ba = (x @ self.w["in_proj_ba"].t()).unflatten(-1, (s.h, 2 * r))
        b, a = torch.split(ba, [r, r], dim=-1)
        mixed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=-1)
        return mixed, a.flatten(1), b.flatten(1), z.reshape(x.shape[0], s.hv, V)

    def _chunk(self, q, k, v, a, b, cu, idx):
        return _ops.chunk_gated_delta_rule(
            q, k, v, a, b, initial_state=self.state, use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, state_v_first=True, cu_seqlens=cu,
            use_gate_in_kernel=True, A_log=self.w["A_log"], dt_bias=self.w["dt_bias"],
            initial_state_indices=idx)

    def _packed(self, mixed, a, b, out, slots):
        _ops.fused_recurrent_gated_delta_rule_packed_decode(
            mixed, a, b, self.w["A_log"], self.w["dt_bias"], self.cfg.K ** -0.5, self.state, out,
            slots, True)


class KDAShard(_LayerShard):
    """A rank's shard of Kimi-Linear's KimiDeltaAttention (HF modeling_kimi_linear.py): q/k/v
    projections each with its own depthwise conv (channel-separable, so run as one conv over the
    concatenated [q | k | v] row), the forget gate f_b(f_a(x)) with -exp(A_log) * softplus(. +
    dt_bias) in the kernels, beta = sigmoid(b_proj x), the sigmoid-gated RMS norm with gate
    g_b(g_a(x)), o_proj."""

    kind = "kda"
    _act = staticmethod(torch.sigmoid)

    def __init__(self, cfg: KDAConfig, shard: Shard, weights, **kw):
        super().__init__(cfg, shard, weights, **kw)
        w = self.w
        w["qkv"] = torch.cat([w.pop("q_proj"), w.pop("k_proj"), w.pop("v_proj")])
        w["conv"] = torch.cat([w.pop("q_conv1d"), w.pop("k_conv1d"), w.pop("v_conv1d")])
        w["norm"], w["out"] = w.pop("o_norm"), w.pop("o_proj")

    def _project(self, x):
        s, K = self.shard, self.cfg.K
        w = self.w
        mixed = x @ w["qkv"].t()
        f = (x @ w["f_a_proj"].t()) @ w["f_b_proj"].t()  # raw gate [N, h*K]
        b = x @ w["b_proj"].t()  # beta logits [N, h]
        g = ((x @ w["g_a_proj"].t()) @ w["g_b_proj"].t()).unflatten(-1, (s.h, K))
        return mixed, f, b, g

    def _chunk(self, q, k, v, f, b, cu, idx):
        return _ops.chunk_kda(
            q, k, v, f.unflatten(-1, (self.shard.h, self.cfg.K)), b, initial_state=self.state,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, state_v_first=True, cu_seqlens=cu,
            A_log=self.w["A_log"], dt_bias=self.w["dt_bias"], initial_state_indices=idx)

    def _packed(self, mixed, f, b, out, slots):
        _ops.fused_recurrent_kda_packed_decode(
            mixed, f, b, self.w["A_log"], self.w["dt_bias"], self.cfg.K ** -0.5, self.state, out,
            slots, True)


def build_layer(cfg, rank: int = 0, tp: int = 1, *, group=None, seed: int = 0, slots: int = 64,
                device="cpu", dtype=torch.float32, uneven: bool = True):
    """Rank `rank`'s shard (of `tp`) of the layer `cfg` describes, with the random weights of
    `seed` (identical on every rank, so every rank builds the same full layer and keeps its
    part)."""
    shard = head_shards(cfg.H, cfg.HV, tp, uneven=uneven)[rank]
    if cfg.kind == "gdn":
        w = shard_gdn_weights(gdn_weights(cfg, seed), cfg, shard)
        cls = GDNShard
    else:
        w = shard_kda_weights(kda_weights(cfg, seed), cfg, shard)
        cls = KDAShard
    return cls(cfg, shard, w, slots=slots, device=device, dtype=dtype, group=group)


# ---- continuous batching -----------------------------------------------------------------------
@dataclass
class Event:
    """What one scheduler step does: requests leaving, requests joining (with prompt lengths),
    then one decode step of every active request in `batch` order."""

    leave: List[int]
    join: List[Tuple[int, int]]
    batch: List[int]


def schedule(steps: int = 64, seed: int = 0, *, start: int = 6, max_active: int = 12,
             max_prompt: int = 80, max_gen: int = 24) -> List[Event]:
    """A deterministic continuous-batching schedule: `start` requests at step 0, then requests
    joining with probability 1/2 per step (up to max_active), each decoding 1..max_gen tokens
    and leaving after its last one. Prompt lengths 1..max_prompt cross the 64-token chunk when
    max_prompt > 64."""
    g = torch.Generator().manual_seed(seed + 1)

    def rand(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    active: Dict[int, int] = {}  # request -> decode steps left
    order: List[int] = []
    events, next_id = [], 0
    for t in range(steps):
        leave = [r for r in order if active[r] == 0]
        for r in leave:
            del active[r]
            order.remove(r)
        n_join = start if t == 0 else (rand(0, 2) if rand(0, 1) else 0)
        join = []
        for _ in range(min(n_join, max_active - len(order))):
            join.append((next_id, rand(1, max_prompt)))
            active[next_id] = rand(1, max_gen)
            order.append(next_id)
            next_id += 1
        if not order:  # keep the batch non-empty
            join.append((next_id, rand(1, max_prompt)))
            active[next_id] = rand(1, max_gen)
            order.append(next_id)
            next_id += 1
        for r in order:
            active[r] -= 1
        events.append(Event(leave, join, list(order)))
    return events


def run_schedule(layer: _LayerShard, events: List[Event], seed: int = 0) -> Dict[str, object]:
    """Run the schedule on one rank: each joining group prefilled in one varlen call, then one
    decode step of the active batch. Inputs come from a generator seeded by `seed` (the same on
    every rank: activations are replicated in TP). Returns the CPU outputs: "prefill" {request:
    [L, hidden]} and "decode" [(batch, [B, hidden])] per step, and the slots used."""
    g = torch.Generator().manual_seed(seed + 2)
    hidden = layer.cfg.hidden
    slot_of: Dict[int, int] = {}
    prefill, decode = {}, []
    for ev in events:
        for r in ev.leave:
            layer.free(slot_of.pop(r))
        if ev.join:
            lengths = [n for _, n in ev.join]
            x = torch.randn(sum(lengths), hidden, generator=g).to(layer.device, layer.dtype)
            slots = []
            for r, _ in ev.join:
                slot_of[r] = layer.allocate()
                slots.append(slot_of[r])
            cu = [0]
            for n in lengths:
                cu.append(cu[-1] + n)
            y = layer.prefill(x, cu, slots).float().cpu()
            for i, (r, _) in enumerate(ev.join):
                prefill[r] = y[cu[i]:cu[i + 1]]
        x = torch.randn(len(ev.batch), hidden, generator=g).to(layer.device, layer.dtype)
        idx = torch.tensor([slot_of[r] for r in ev.batch], dtype=torch.int32, device=layer.device)
        decode.append((list(ev.batch), layer.decode(x, idx).float().cpu()))
    return {"prefill": prefill, "decode": decode}


def max_error(a: Dict[str, object], b: Dict[str, object]) -> Tuple[float, float]:
    """(max |a - b|, max |b|) over every prefill and decode output of two runs of one schedule."""
    err, mag = 0.0, 0.0
    pairs = [(a["prefill"][r], b["prefill"][r]) for r in b["prefill"]]
    for (ba, ya), (bb, yb) in zip(a["decode"], b["decode"]):
        if ba != bb:
            raise ValueError(f"the runs decoded different batches: {ba} vs {bb}")
        pairs.append((ya, yb))
    if len(a["decode"]) != len(b["decode"]) or set(a["prefill"]) != set(b["prefill"]):
        raise ValueError("the runs followed different schedules")
    for x, y in pairs:
        err = max(err, float((x - y).abs().max()))
        mag = max(mag, float(y.abs().max()))
    return err, mag


# ---- process group -----------------------------------------------------------------------------
def init_distributed(device: str = "auto") -> Tuple[int, int, torch.device]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the
    environment): NCCL when the run is on CUDA (device "cuda", or "auto" with a GPU), gloo on the
    CPU. NVLink multicast is switched off first. Returns (rank, world size, this rank's device)."""
    multicast_off()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        kw = {"device_id": dev} if cuda else {}
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world, **kw)
    return rank, world, dev


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`torchrun --nproc-per-node N -m deltastate.tp`: every rank runs the schedule on its shard;
    rank 0 also runs the TP = 1 layer on its own device and reports the largest difference."""
    p = argparse.ArgumentParser(prog="python -m deltastate.tp", description=main.__doc__)
    p.add_argument("--layer", choices=["gdn", "kda", "both"], default="both")
    p.add_argument("--size", choices=["small", "model"], default="small",
                   help="small: CPU-test geometry with the models' head ratios; model: "
                        "Qwen3-Next / Kimi-Linear per-layer shapes")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--uneven", choices=["allow", "reject"], default="allow")
    p.add_argument("--out", default="", help="rank 0 saves its outputs here (torch.save)")
    args = p.parse_args(argv)
    rank, world, dev = init_distributed(args.device)
    torch.manual_seed(args.seed)
    kinds = ["gdn", "kda"] if args.layer == "both" else [args.layer]
    events = schedule(args.steps, args.seed)
    results, rc = {}, 0
    for kind in kinds:
        cfg = (GDNConfig.small() if args.size == "small" else GDNConfig.qwen3_next()) \
            if kind == "gdn" else (KDAConfig.small() if args.size == "small" else
                                   KDAConfig.kimi_linear())
        layer = build_layer(cfg, rank, world, group=dist.group.WORLD, seed=args.seed,
                            device=dev, uneven=args.uneven == "allow")
        t0 = time.perf_counter()
        res = run_schedule(layer, events, args.seed)
        took = time.perf_counter() - t0
        results[kind] = res
        if rank == 0:
            ref = run_schedule(build_layer(cfg, 0, 1, seed=args.seed, device=dev), events,
                               args.seed)
            err, mag = max_error(res, ref)
            ok = err <= TOLERANCE * max(mag, 1.0)
            rc |= 0 if ok else 1
            print(f"{kind}: tp={world} backend={dist.get_backend()} device={dev} "
                  f"heads/rank={layer.shard.h}/{layer.shard.hv} steps={len(events)} "
                  f"{took:.2f}s max|tp-tp1|={err:.3g} max|y|={mag:.3g} "
                  f"{'OK' if ok else 'MISMATCH'}", flush=True)
    if rank == 0 and args.out:
        torch.save(results, args.out)
    # The layer holds the process group. Released here, the group's last reference is the one
    # destroy_process_group drops, so gloo tears the group down there, on every rank right after
    # the barrier, rather than when main's frame goes, when another rank may have exited already
    # (an abort at exit, "terminate called without an active exception", was seen once in ~50
    # runs with the barrier alone). The barrier makes every rank leave together: without it a
    # rank that exits while rank 0 still runs the TP = 1 comparison aborted in gloo 1 run in 4.
    del layer
    dist.barrier()
    dist.destroy_process_group()
    return rc


# fp32 throughout; TP changes only summation orders: the all-reduce adds tp partial out_proj sums
# instead of one GEMM over every head's channels, and sharded GEMMs may block differently. Each is
# a few ulps of the output's magnitude (~1e-6 relative); the delta-rule state is contractive
# (gates in (0, 1], L2-normed keys, beta in (0, 1)), so 64 steps do not amplify it. 1e-4 of the
# largest output leaves two decades of margin while a wrong head, slot or shard is O(1).
TOLERANCE = 1e-4

if __name__ == "__main__":
    # Leave without the interpreter's teardown: after destroy_process_group, a gloo rank's
    # static destructors at exit still abort at times ("terminate called without an active
    # exception", about 1 run in 10 of 3 ranks on 2 loaded cores); every result is written and
    # flushed by then.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
