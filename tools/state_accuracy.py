#!/usr/bin/env python3
"""The accuracy of recurrent-state storage formats (issue #36, section 1): decodes long sequences
of gated delta-rule steps with the state kept in each format and reports the error against an
fp64 recurrence of the same inputs. numpy only; no GPU and no compiled deltastate.

The step is deltastate's decode math (src/core/delta_math.h, src/cpu/recurrent.cpp) per value
head, state S [V, K] (row v, column c):

    q, k  <- x / sqrt(sum x^2 + 1e-6);  q <- q * K^-0.5
    alpha  = exp(g)     GDN: g = -exp(A_log) * softplus(a + dt_bias), one per (token, head)
                        KDA: the same per channel, A_log per head, dt_bias per (head, channel)
    beta   = sigmoid(b)
    S'     = S * alpha  (per column for KDA);  u = beta * (v - S' k);  S = S' + u k^T
    o      = S' q + u (k.q)  (= S q)

A quantized format runs it the way a kernel does in every decode step: load the state and its
scales, dequantize to fp32, compute the step in fp32, requantize with a fresh scale and store.
The output comes from the fp32 state before it is stored. The reference keeps S in fp64.

Formats (``--formats`` takes a comma list of names or globs, e.g. ``'fp8/*/448/*,int8/row/*'``):

    fp32                      fp32 state (the arithmetic's own error)
    bf16/rn, bf16/sr          bf16, round to nearest even / stochastic (16 random bits added
                              below the kept mantissa, then truncated)
    fp8/{row,tile,head}/{448,240}/{rn,sr}
                              e4m3fn (max 448, subnormals from 2^-9, saturating) with one fp32
                              scale per (slot, head, V row) over K, per (slot, head, 32-row V
                              tile), or per (slot, head); scale = amax / 448, or amax / 240 (the
                              SGLang RFC's choice, e4m3fnuz's range)
    int8/{row,tile,head}/{rn,sr}
                              symmetric int8 in [-127, 127], scale = amax / 127, the same layouts

Stochastic rounding (dithered nearest): |y| + u quantum rounded to nearest even, u = (U + 1/2)
2^-16 - 1/2 with U a 16-bit uniform integer (e4m3fn: not below |y|'s binade floor), exact in
fp32, so y rounds up with probability frac(|y| / quantum) on the 2^-16 grid; bf16: U added to
the 16 dropped bits. The random bits come from a counter-based generator: splitmix64 keyed by
(seed, slot, layer, step), one draw per 4 consecutive elements of the layer's state [HV, V, K]
(element e: 16-bit field e mod 4 of draw e / 4 + 1), so a run is reproducible and any element's
bits can be recomputed alone (sr_bits). Every stochastic format of a step uses the same bits.

Inputs (``--inputs``, both by default): ``random``: q, k standard normal (then normalized as
above), v with per-channel standard deviations drawn log-normally (``--v-spread``, normalized to
unit mean square: unit-variance entries on average, some channels larger than others as
activations have them); every token is new to the state, so the updates are as large as v.
``recall``: each (slot, head) has 64 (key, value) pairs of those distributions; a token writes
one pair (k = key_j, v = value_j, each plus 0.1 standard-normal noise) and queries another, so
the state learns the table and v - S'k shrinks to the noise and the forgetting, as a state that
predicts its inputs does: small updates on a large state, where round-to-nearest stalls. Both:
beta = sigmoid(N(0, 1)), raw gate input a ~ N(0, 1). Gates span the spectrum as trained layers
have them: value head h of HV gets exp(A_log) = 1 + 15 t and dt = softplus(dt_bias) = 6e-4 *
(0.1 / 6e-4)^t, t = h / (HV - 1), so the slowest head decays by ~0.999 per token and the fastest
by ~0.1 (geometric means over tokens; the header prints them per head); KDA spreads each
channel's dt further by 10^U(-0.5, 0.5). ``--heads`` value heads evenly spread over HV are
simulated, each with its own q and k (GVA's sharing of q/k between value heads is not modelled;
it does not change a head's recurrence), for ``--slots`` independent sequences.

Errors, per (slot, head): state ||S - S_ref||_F / ||S_ref||_F sampled every ``--state-every``
steps; output ||o - o_ref|| / ||o_ref|| over consecutive windows of ``--window`` steps (sums of
squares over the window's steps, so a near-zero single output does not dominate). The table
shows the worst (slot, head) at steps 100, 1000, 10000 (those <= --steps, and the last step)
and the maximum over time.

    python tools/state_accuracy.py                         # 10^4 steps, both models, all formats
    python tools/state_accuracy.py --steps 300 --heads 2 --slots 1 --json out.json
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import time
from dataclasses import dataclass

import numpy as np

# ---- shapes ------------------------------------------------------------------------------------
MODELS = {
    # name: (kind, H q/k heads, HV value heads, K, V)
    "qwen3-next": ("gdn", 16, 32, 128, 128),
    "kimi-linear": ("kda", 32, 32, 128, 128),
}
TILE_ROWS = 32
L2_EPS = 1e-6
INPUT_MODES = ("random", "recall")
RECALL_PAIRS = 64  # (key, value) pairs per (slot, head) in the recall inputs
RECALL_NOISE = 0.1  # their noise, relative to the entries' unit scale

# ---- e4m3fn ------------------------------------------------------------------------------------
E4M3_MAX = 448.0
E4M3_MIN_EXP = -6  # smallest normal 2^-6; subnormals are multiples of 2^-9
E4M3_MANT_BITS = 3


def _e4m3_quantum(a: np.ndarray) -> np.ndarray:
    """The spacing of e4m3fn values in the binade of the fp32 |a| (2^-9 in the subnormal range):
    a's exponent field, raised to at least 2^-6's, less the 3 mantissa bits; fp32."""
    e = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) & np.uint32(0x7F800000)
    e = np.maximum(e, np.uint32((127 + E4M3_MIN_EXP) << 23))
    return (e - np.uint32(E4M3_MANT_BITS << 23)).view(np.float32)


def dither(U: np.ndarray) -> np.ndarray:
    """The dither (U + 1/2) 2^-16 - 1/2 of 16-bit integers U, fp32 (exact; never +-1/2)."""
    return (np.asarray(U).astype(np.float32) * np.float32(2) + np.float32(1)) * np.float32(
        2.0 ** -17) - np.float32(0.5)


def round_e4m3(x: np.ndarray, U: np.ndarray | None = None) -> np.ndarray:
    """x (fp32) rounded to e4m3fn and returned as fp32: to nearest even (U None) or stochastically
    (U: 16-bit random integers, same shape: |x| + dither(U) quantum, not below |x|'s binade
    floor, to nearest), saturating at +-448 (inf too); NaN stays NaN; signed zeros kept. Exact:
    the division by the power-of-two quantum is exact in fp32, as is the dithered sum in |x|'s
    binade."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x)
    if U is not None:
        with np.errstate(invalid="ignore"):
            d = a + dither(U) * _e4m3_quantum(a)
            bits = a.view(np.uint32) if a.flags.c_contiguous else np.ascontiguousarray(a).view(
                np.uint32)
            floor = np.where(a >= np.float32(2.0 ** E4M3_MIN_EXP),
                             (bits & np.uint32(0x7F800000)).view(np.float32), np.float32(0))
            a = np.where(d < floor, floor, d).astype(np.float32)
    q = _e4m3_quantum(a)
    r = np.minimum(np.rint(a / q) * q, np.float32(E4M3_MAX))  # round half to even
    return np.copysign(r, x)


def e4m3_bits(x: np.ndarray) -> np.ndarray:
    """The e4m3fn encodings (uint8) of values that are e4m3fn values (round_e4m3's results)."""
    x = np.asarray(x, dtype=np.float32)
    sign = np.signbit(x).astype(np.uint8) << 7
    a = np.abs(x).astype(np.float64)
    nan = np.isnan(a)
    a = np.where(nan, 0.0, a)
    m, e = np.frexp(a)  # a = m 2^e
    normal = a >= 2.0 ** E4M3_MIN_EXP
    exp_field = np.where(normal, e - 1 + 7, 0)
    mant = np.where(normal, (m * 2.0 - 1.0) * 8.0, a / 2.0 ** (E4M3_MIN_EXP - E4M3_MANT_BITS))
    if not np.all(mant == np.floor(mant)):
        raise ValueError("e4m3_bits takes e4m3fn values only")
    bits = (exp_field.astype(np.uint8) << 3) | mant.astype(np.uint8)
    return np.where(nan, np.uint8(0x7F), bits).astype(np.uint8) | sign


# ---- bf16 --------------------------------------------------------------------------------------
def round_bf16(x: np.ndarray, U: np.ndarray | None = None) -> np.ndarray:
    """x (fp32) rounded to bf16, returned as fp32: nearest even (U None) or stochastic (U: 16-bit
    random integers added below the kept mantissa before truncation)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    if U is None:
        b = b + (np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
    else:
        b = b + np.asarray(U).astype(np.uint32)
    return (b & np.uint32(0xFFFF0000)).view(np.float32)


# ---- stochastic-rounding bits ------------------------------------------------------------------
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (Stafford's mix13), elementwise on uint64."""
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):  # multiplication mod 2^64 is the point
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def sr_key(seed: int, slot, layer: int, step: int) -> np.ndarray:
    """The generator's key for (seed, slot, layer, step); slot may be an array of slots."""
    z = _mix64(np.uint64(seed) ^ _GOLDEN)
    for field in (slot, layer, step):
        z = _mix64(z ^ np.asarray(field, dtype=np.uint64))
    return z


def sr_draw(key: np.ndarray, group: np.ndarray) -> np.ndarray:
    """64 random bits per group of 4 elements: draw number group + 1 of the splitmix64 stream
    seeded with key."""
    with np.errstate(over="ignore"):
        z = np.asarray(group, np.uint64) + np.uint64(1)
        z = np.asarray(key, dtype=np.uint64) + z * _GOLDEN
    return _mix64(z)


def sr_bits(key: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The 16-bit random integer U of each element (uint32): field index mod 4 of draw index / 4
    (key broadcasts against index, the element's offset in the layer's [HV, V, K] state)."""
    index = np.asarray(index, np.uint64)
    d = sr_draw(key, index >> np.uint64(2))
    return ((d >> ((index & np.uint64(3)) * np.uint64(16))) & np.uint64(0xFFFF)).astype(np.uint32)


# ---- formats -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Format:
    name: str
    kind: str  # fp32 | bf16 | fp8 | int8
    layout: str | None = None  # row | tile | head (fp8, int8)
    qmax: float = 0.0  # the value amax maps to
    stochastic: bool = False


def all_formats() -> list[Format]:
    out = [Format("fp32", "fp32"), Format("bf16/rn", "bf16"),
           Format("bf16/sr", "bf16", stochastic=True)]
    for layout in ("row", "tile", "head"):
        for qmax in (448, 240):
            for sr in (False, True):
                out.append(Format(f"fp8/{layout}/{qmax}/{'sr' if sr else 'rn'}", "fp8", layout,
                                  float(qmax), sr))
    for layout in ("row", "tile", "head"):
        for sr in (False, True):
            out.append(Format(f"int8/{layout}/{'sr' if sr else 'rn'}", "int8", layout, 127.0, sr))
    return out


def select_formats(spec: str | None) -> list[Format]:
    """Formats whose names match any of the comma-separated names or globs (all when None)."""
    formats = all_formats()
    if not spec:
        return formats
    pats = [p.strip() for p in spec.split(",") if p.strip()]
    chosen = [f for f in formats if any(fnmatch.fnmatchcase(f.name, p) for p in pats)]
    unknown = [p for p in pats if not any(fnmatch.fnmatchcase(f.name, p) for f in formats)]
    if unknown:
        raise ValueError(f"no format matches {unknown}; formats: {[f.name for f in formats]}")
    return chosen


def scales(x: np.ndarray, layout: str, qmax: float) -> np.ndarray:
    """fp32 scales amax / qmax of x [..., V, K] per row ([..., V, 1]), per 32-row tile
    ([..., V/32, 1, 1]) or per head ([..., 1, 1]); 1 where the group is all zero."""
    a = np.abs(x)
    if layout == "row":
        amax = a.max(axis=-1, keepdims=True)
    elif layout == "tile":
        V, K = x.shape[-2:]
        amax = a.reshape(*x.shape[:-2], V // TILE_ROWS, TILE_ROWS, K).max(axis=(-2, -1),
                                                                          keepdims=True)
    elif layout == "head":
        amax = a.max(axis=(-2, -1), keepdims=True)
    else:
        raise ValueError(f"layout must be row, tile or head, got {layout!r}")
    s = (amax / np.float32(qmax)).astype(np.float32)
    return np.where(s > 0, s, np.float32(1.0))


def _grouped(x: np.ndarray, layout: str) -> np.ndarray:
    """x viewed so that a scale from scales() broadcasts against it."""
    if layout == "tile":
        V, K = x.shape[-2:]
        return x.reshape(*x.shape[:-2], V // TILE_ROWS, TILE_ROWS, K)
    return x


def quantize(x: np.ndarray, fmt: Format, bits: np.ndarray | None = None) -> np.ndarray:
    """The fp32 state x [..., V, K] stored in fmt and loaded back (fp32). bits: the 16-bit random
    integers of x's shape (sr_bits), required for stochastic formats."""
    x = np.asarray(x, dtype=np.float32)
    if fmt.stochastic and bits is None:
        raise ValueError(f"{fmt.name} needs random bits")
    U = _grouped(np.asarray(bits), fmt.layout) if fmt.stochastic and fmt.kind != "bf16" else None
    if fmt.kind == "fp32":
        return x.copy()
    if fmt.kind == "bf16":
        return round_bf16(x, bits if fmt.stochastic else None)
    s = scales(x, fmt.layout, fmt.qmax)
    y = _grouped(x, fmt.layout) / s
    if fmt.kind == "fp8":
        r = round_e4m3(y, U)
    elif fmt.kind == "int8":
        r = np.rint(y if U is None else y + dither(U))
        r = np.clip(r, -fmt.qmax, fmt.qmax)
    else:
        raise ValueError(f"unknown format kind {fmt.kind!r}")
    return (r.astype(np.float32) * s).reshape(x.shape)


# ---- inputs ------------------------------------------------------------------------------------
def head_ids(HV: int, n: int) -> np.ndarray:
    """n value heads evenly spread over 0..HV-1 (both ends included)."""
    if n >= HV:
        return np.arange(HV)
    return np.unique(np.round(np.linspace(0, HV - 1, n)).astype(int))


def gate_params(kind: str, HV: int, K: int, heads: np.ndarray, seed: int = 0):
    """(A_log [n], dt_bias [n] or [n, K]) for the chosen value heads (see the module doc)."""
    t = heads / max(HV - 1, 1)
    A_log = np.log1p(15.0 * t)
    dt = 6e-4 * (0.1 / 6e-4) ** t
    if kind == "kda":
        spread = np.random.default_rng(seed + 7919).uniform(-0.5, 0.5, (HV, K))[heads]
        dt = dt[:, None] * 10.0 ** spread
    dt_bias = np.log(np.expm1(dt))  # softplus^-1
    return A_log, dt_bias


def _softplus(x):
    return np.where(x <= 20.0, np.log1p(np.exp(np.minimum(x, 20.0))), x)


class Inputs:
    """One model's token inputs for `slots` sequences and the chosen heads, drawn `block` steps
    at a time from one numpy generator (PCG64), in fp32 (the kernels' input precision here)."""

    def __init__(self, model: str, heads: np.ndarray, slots: int, seed: int, v_spread: float,
                 mode: str = "random", pairs: int = RECALL_PAIRS, noise: float = RECALL_NOISE):
        if mode not in INPUT_MODES:
            raise ValueError(f"inputs must be one of {INPUT_MODES}, got {mode!r}")
        self.kind, self.H, self.HV, self.K, self.V = MODELS[model]
        self.heads, self.slots, self.mode, self.noise = heads, slots, mode, noise
        self.rng = np.random.default_rng(seed)
        self.A_log, self.dt_bias = gate_params(self.kind, self.HV, self.K, heads, seed)
        sd = np.exp(v_spread * self.rng.standard_normal((len(heads), self.V)))
        self.v_sd = (sd / np.sqrt(np.mean(sd ** 2))).astype(np.float32)
        if mode == "recall":  # per (slot, head): `pairs` keys and the values stored under them
            shape = (slots, len(heads), pairs)
            self.keys = self.rng.standard_normal((*shape, self.K), dtype=np.float32)
            self.vals = self.rng.standard_normal((*shape, self.V), dtype=np.float32)
            self.vals *= self.v_sd[:, None, :]

    def _pick(self, table: np.ndarray, n: int) -> np.ndarray:
        """table[slot, head, j] for a random j per (token, slot, head), plus relative noise."""
        B, Hn, M, D = table.shape
        j = self.rng.integers(0, M, (n, B, Hn))
        x = table[np.arange(B)[:, None], np.arange(Hn), j]  # [n, B, Hn, D]
        return x + self.noise * self.rng.standard_normal(x.shape, dtype=np.float32)

    def block(self, n: int) -> dict:
        B, Hn, K, V = self.slots, len(self.heads), self.K, self.V
        r = self.rng
        f32 = np.float32
        gate_shape = (n, B, Hn, K) if self.kind == "kda" else (n, B, Hn)
        if self.mode == "recall":
            j = r.integers(0, self.keys.shape[2], (n, B, Hn))
            b_i, h_i = np.arange(B)[:, None], np.arange(Hn)
            k = self.keys[b_i, h_i, j] + self.noise * r.standard_normal((n, B, Hn, K), dtype=f32)
            v = self.vals[b_i, h_i, j] + self.noise * r.standard_normal((n, B, Hn, V), dtype=f32)
            q = self._pick(self.keys, n)
        else:
            q = r.standard_normal((n, B, Hn, K), dtype=f32)
            k = r.standard_normal((n, B, Hn, K), dtype=f32)
            v = r.standard_normal((n, B, Hn, V), dtype=f32) * self.v_sd
        return {"q": q, "k": k, "v": v, "a": r.standard_normal(gate_shape, dtype=f32),
                "b": r.standard_normal((n, B, Hn), dtype=f32)}

    def prepared(self, x: dict, dtype) -> dict:
        """q, k normalized (q scaled), alpha, beta in dtype (fp32: the kernel's arithmetic;
        fp64: the reference's)."""
        q, k = x["q"].astype(dtype), x["k"].astype(dtype)
        eps = dtype(L2_EPS)
        q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + eps) * dtype(self.K ** -0.5)
        k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + eps)
        a = x["a"].astype(dtype)
        dt_bias = self.dt_bias.astype(dtype)
        A = np.exp(self.A_log.astype(dtype))
        if self.kind == "kda":
            g = -A[:, None] * _softplus(a + dt_bias).astype(dtype)
        else:
            g = -A * _softplus(a + dt_bias).astype(dtype)
        beta = (1.0 / (1.0 + np.exp(-x["b"].astype(dtype)))).astype(dtype)
        return {"q": q, "k": k, "v": x["v"].astype(dtype), "alpha": np.exp(g).astype(dtype),
                "beta": beta, "kq": np.sum(k * q, axis=-1).astype(dtype)}


# ---- the recurrence ----------------------------------------------------------------------------
def delta_step(S: np.ndarray, t: dict, i: int, kda: bool) -> np.ndarray:
    """One token in place on S [..., B, H, V, K] (leading format axes broadcast); returns the
    output [..., B, H, V]. t: prepared inputs, i: the token within them."""
    alpha = t["alpha"][i]
    S *= alpha[..., None, :] if kda else alpha[..., None, None]
    k, q = t["k"][i], t["q"][i]
    d = S @ np.stack([k, q], axis=-1)  # [..., B, H, V, 2]: S'k, S'q
    u = t["beta"][i][..., None] * (t["v"][i] - d[..., 0])
    S += u[..., None] * k[..., None, :]
    return d[..., 1] + u * t["kq"][i][..., None]


def report_steps(steps: int) -> list[int]:
    return sorted({s for s in (100, 1000, 10000) if s <= steps} | {steps})


def simulate(model: str, formats: list[Format], steps: int, heads: int = 8, slots: int = 2,
             seed: int = 0, layer: int = 0, v_spread: float = 0.5, inputs: str = "random",
             window: int = 100, state_every: int = 10, block: int = 100,
             progress=None) -> dict:
    """Runs one model; returns the per-(slot, head) error series and the summary per format."""
    kind, H, HV, K, V = MODELS[model]
    kda = kind == "kda"
    hs = head_ids(HV, heads)
    inp = Inputs(model, hs, slots, seed, v_spread, inputs)
    F, B, Hn = len(formats), slots, len(hs)
    X = np.zeros((F, B, Hn, V, K), np.float32)  # each format's state, as loaded (dequantized)
    R = np.zeros((B, Hn, V, K), np.float64)  # the fp64 reference
    index = ((hs[:, None, None] * V + np.arange(V)[:, None]) * K + np.arange(K)).astype(np.uint64)
    slot_ids = np.arange(B, dtype=np.uint64)
    any_sr = any(f.stochastic for f in formats)
    marks = set(report_steps(steps))
    state_at, state_err = [], []  # sample steps, [F, B, H] relative errors
    out_at, out_err = [], []
    o_num = np.zeros((F, B, Hn))
    o_den = np.zeros((B, Hn))
    alpha_log = np.zeros((B, Hn))
    t0 = time.time()
    for start in range(0, steps, block):
        n = min(block, steps - start)
        raw = inp.block(n)
        t32, t64 = inp.prepared(raw, np.float32), inp.prepared(raw, np.float64)
        lg = np.log(t64["alpha"])
        alpha_log += (lg.mean(axis=-1) if kda else lg).sum(axis=0)
        for i in range(n):
            step = start + i + 1
            o = delta_step(X, t32, i, kda)
            o_ref = delta_step(R, t64, i, kda)
            if any_sr:
                key = sr_key(seed, slot_ids, layer, step)[:, None, None, None]
                bits = sr_bits(key, index)
            for f, fmt in enumerate(formats):
                if fmt.kind != "fp32":
                    X[f] = quantize(X[f], fmt, bits if fmt.stochastic else None)
            o_num += np.sum((o - o_ref) ** 2, axis=-1)
            o_den += np.sum(o_ref ** 2, axis=-1)
            if step % window == 0 or step == steps:
                out_at.append(step)
                out_err.append(np.sqrt(o_num / np.maximum(o_den, 1e-300)))
                o_num[:] = 0.0
                o_den[:] = 0.0
            if step % state_every == 0 or step in marks:
                den = np.sum(R * R, axis=(-2, -1))
                num = np.stack([np.sum((X[f] - R) ** 2, axis=(-2, -1)) for f in range(F)])
                state_at.append(step)
                state_err.append(np.sqrt(num / np.maximum(den, 1e-300)))
        if progress:
            progress(f"{model}: step {start + n}/{steps}, {time.time() - t0:.0f} s")
    state_err = np.array(state_err)  # [samples, F, B, H]
    out_err = np.array(out_err)
    summary = {}
    for f, fmt in enumerate(formats):
        row = {}
        for s in report_steps(steps):
            row[f"state@{s}"] = float(state_err[state_at.index(s), f].max())
            w = next(j for j, a in enumerate(out_at) if a >= s)
            row[f"out@{s}"] = float(out_err[w, f].max())
        row["state_max"] = float(state_err[:, f].max())
        row["out_max"] = float(out_err[:, f].max())
        row["state_max_per_head"] = state_err[:, f].max(axis=(0, 1)).tolist()
        row["out_max_per_head"] = out_err[:, f].max(axis=(0, 1)).tolist()
        row["state_series"] = state_err[:, f].max(axis=(1, 2)).tolist()  # worst (slot, head)
        row["out_series"] = out_err[:, f].max(axis=(1, 2)).tolist()
        summary[fmt.name] = row
    return {
        "model": model, "kind": kind, "H": H, "HV": HV, "K": K, "V": V, "steps": steps,
        "slots": slots, "heads": hs.tolist(), "seed": seed, "layer": layer, "v_spread": v_spread,
        "inputs": inputs, "window": window, "state_every": state_every,
        "mean_decay_per_head": np.exp(alpha_log / steps).mean(axis=0).tolist(),
        "state_steps": state_at, "out_steps": out_at, "formats": summary,
        "seconds": time.time() - t0,
    }


# ---- report ------------------------------------------------------------------------------------
def _e(x: float) -> str:
    return f"{x:.2e}" if x == x else "nan"


def table(result: dict) -> str:
    """A markdown table: the worst (slot, head) per format."""
    steps = report_steps(result["steps"])
    cols = [f"state@{s}" for s in steps] + ["state max"] + [f"out@{s}" for s in steps] + [
        "out max"]
    lines = ["| format | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, row in result["formats"].items():
        vals = [row[f"state@{s}"] for s in steps] + [row["state_max"]] + [
            row[f"out@{s}"] for s in steps] + [row["out_max"]]
        lines.append(f"| {name} | " + " | ".join(_e(v) for v in vals) + " |")
    return "\n".join(lines)


def header(result: dict) -> str:
    decays = ", ".join(f"{d:.4f}" for d in result["mean_decay_per_head"])
    return (f"{result['model']} ({result['kind'].upper()}: H={result['H']}, HV={result['HV']}, "
            f"K={result['K']}, V={result['V']}), {result['inputs']} inputs, {result['steps']} "
            f"steps, {result['slots']} "
            f"slots x value heads {result['heads']} (geometric-mean decay per token {decays}), "
            f"seed {result['seed']}, {result['seconds']:.0f} s")


# ---- command line (shared with tools/state_accuracy_model.py) ----------------------------------
def parser(doc: str, models) -> argparse.ArgumentParser:
    """The options both tools take: --models, --formats, --seed, --json, --quiet."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(models), help="comma list of " + ", ".join(models))
    p.add_argument("--formats", default=None, help="comma list of names or globs (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def listed(p: argparse.ArgumentParser, text: str, known, what: str) -> list[str]:
    """A comma list of names, each one of known (else the parser's usage error)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    for x in names:
        if x not in known:
            p.error(f"unknown {what} {x!r}; choose from {', '.join(known)}")
    return names


def progress_printer(quiet: bool):
    return None if quiet else (lambda s: print(s, file=sys.stderr, flush=True))


def write_json(path: str, tool: str, argv, results: list) -> None:
    """{"command": how the tool was run, "results": [...]} to path."""
    given = sys.argv[1:] if argv is None else list(argv)
    with open(path, "w") as fh:
        json.dump({"command": " ".join(["python", tool, *given]), "results": results}, fh,
                  indent=1)


def main(argv=None) -> int:
    p = parser(__doc__, MODELS)
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--heads", type=int, default=8, help="value heads simulated per model")
    p.add_argument("--slots", type=int, default=2, help="independent sequences")
    p.add_argument("--layer", type=int, default=0, help="the layer id in the rounding key")
    p.add_argument("--v-spread", type=float, default=0.5,
                   help="log-normal sigma of v's per-channel scale (0: iid unit variance)")
    p.add_argument("--inputs", default=",".join(INPUT_MODES),
                   help="comma list: random (iid tokens), recall (keys and values drawn from a "
                   "small per-head table, so the state learns them)")
    p.add_argument("--window", type=int, default=100, help="output-error window, steps")
    p.add_argument("--state-every", type=int, default=10, help="state-error sampling, steps")
    args = p.parse_args(argv)
    formats = select_formats(args.formats)
    models = listed(p, args.models, MODELS, "model")
    modes = listed(p, args.inputs, INPUT_MODES, "inputs")
    results = []
    for mode, model in [(mode, model) for mode in modes for model in models]:
        r = simulate(model, formats, args.steps, args.heads, args.slots, args.seed, args.layer,
                     args.v_spread, mode, args.window, args.state_every,
                     progress=progress_printer(args.quiet))
        results.append(r)
        print(header(r))
        print("worst (slot, head): state = ||S - S_ref||/||S_ref||, out = ||o - o_ref||/||o_ref||"
              f" over the {r['window']}-step window ending at the step\n")
        print(table(r))
        print()
    if args.json:
        write_json(args.json, "tools/state_accuracy.py", argv, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
