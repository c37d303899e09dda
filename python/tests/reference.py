"""An independent numpy float64 reference of the deltastate ops, written from the behaviour of
SGLang's kernels (`fused_recurrent_gated_delta_rule_packed_decode`,
`fused_recurrent_kda_packed_decode`, `fused_recurrent_linear_replayssm_decode`) and FlashInfer's
`recurrent_kda`. It shares no code with the library: plain numpy on float64 arrays.

Conventions:
  * heads: value head hv reads key head h = hv // (HV // H);
  * state S of one (slot, hv) is [V, K] (K contiguous);
  * QK L2 norm: x / sqrt(sum x^2 + 1e-6); then q *= scale (default K^-0.5);
  * gates, with x = a + dt_bias: standard g = -exp(A_log) * softplus(x) (softplus = log(1+e^x) for
    x <= 20, else x); safe g = lower_bound * sigmoid(exp(A_log) * x); alpha = exp(g);
    beta = sigmoid(b);
  * per token, in this order: S <- S*alpha (KDA: column k by alpha[k]); u = v - S k; u <- beta*u;
    S <- S + u k^T; o = S q.
  * padding: a state index < 0 gives a zero output and leaves the state alone.

Storage. Values the kernels store in reduced precision (ReplaySSM rings and checkpoints, beta
rounded to b's dtype, with round_beta) are modelled by `rd`, float64 -> float32 -> dtype with round-to-nearest-even,
applied when a stored value is read back (rounding on read equals rounding on store). Results are
returned unrounded, so a test compares the kernel's rounded output against them with SGLang's
tolerance plus the storage rounding (half an ulp of the stored dtype).
"""

from __future__ import annotations

import numpy as np

L2_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0


# ---- rounding to the storage dtypes -----------------------------------------------------------
def _round_bf16(x32: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float32, round to nearest even (NaN kept quiet)."""
    x32 = np.ascontiguousarray(x32, dtype=np.float32)
    u = x32.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    out = rounded.view(np.float32).copy()
    nan = np.isnan(x32)
    out[nan] = np.nan
    return out


def rd(x, dtype: str) -> np.ndarray:
    """The float64 value of `x` stored as `dtype` ('float32', 'float16', 'bfloat16')."""
    x32 = np.asarray(x, dtype=np.float64).astype(np.float32)
    if dtype == "float32":
        return x32.astype(np.float64)
    if dtype == "float16":
        return x32.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        return _round_bf16(x32).astype(np.float64)
    raise ValueError(f"unknown dtype {dtype}")


# ---- shared pieces ---------------------------------------------------------------------------
def softplus(x):
    x = np.asarray(x, dtype=np.float64)
    return np.where(x <= SOFTPLUS_THRESHOLD, np.log1p(np.exp(np.minimum(x, SOFTPLUS_THRESHOLD))), x)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


def l2norm(x):
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def gate(a, A_log, dt_bias, lower_bound=None):
    """Log-space decay g from the raw gate input a (broadcasting: A_log already shaped to a)."""
    x = np.asarray(a, dtype=np.float64) + (0.0 if dt_bias is None else dt_bias)
    if lower_bound is None:
        return -np.exp(A_log) * softplus(x)
    return lower_bound * sigmoid(np.exp(A_log) * x)


def key_head_of(HV: int, H: int) -> np.ndarray:
    """For every value head hv, its key head h = hv // (HV // H)."""
    assert HV % H == 0
    return np.arange(HV) // (HV // H)


def delta_step(S, q, k, v, alpha, beta):
    """One token of the delta rule on S [..., V, K]; q, k [..., K]; v [..., V]; alpha [..., K]
    (GDN: the scalar repeated); beta [...]. Returns (S', o)."""
    S = S * alpha[..., None, :]
    u = v - np.einsum("...vk,...k->...v", S, k)
    u = beta[..., None] * u
    S = S + u[..., :, None] * k[..., None, :]
    o = np.einsum("...vk,...k->...v", S, q)
    return S, o


def _prep_qk(q, k, scale, use_l2norm):
    if use_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * scale, k


def split_packed(mixed_qkv, HV, V, K):
    """[B, 2HK + HV V] -> q, k [B, H, K], v [B, HV, V]."""
    B, width = mixed_qkv.shape
    qk = width - HV * V
    assert qk > 0 and qk % 2 == 0 and (qk // 2) % K == 0
    H = qk // 2 // K
    q = mixed_qkv[:, : H * K].reshape(B, H, K)
    k = mixed_qkv[:, H * K: 2 * H * K].reshape(B, H, K)
    v = mixed_qkv[:, 2 * H * K:].reshape(B, HV, V)
    return q, k, v, H


def token_log_decay(a, A_log, dt_bias, B, HV, K, kda, lower_bound):
    """The log decay g of one token per row: KDA [B, HV, K] (a and dt_bias per K element, any of
    their accepted shapes), GDN [B, HV]."""
    A = np.asarray(A_log, dtype=np.float64)
    if kda:
        return gate(np.asarray(a, np.float64).reshape(B, HV, K), A[:, None],
                    np.asarray(dt_bias, np.float64).reshape(HV, K), lower_bound)
    return gate(np.asarray(a, np.float64), A, np.asarray(dt_bias, np.float64), lower_bound)


# ---- packed decode (GDN, KDA) -----------------------------------------------------------------
def packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, pool, indices, *, kda,
                  lower_bound=None, use_qk_l2norm=True, beta_dtype=None):
    """GDN (kda=False: a [B,HV], dt_bias [HV]) or KDA (a [B,HV*K], dt_bias [HV*K]) packed decode.
    pool: float64 [slots, HV, V, K]. Returns (out [B,1,HV,V], new pool). `beta_dtype` rounds
    sigmoid(b) to that dtype (the optional round_beta flag)."""
    x = np.asarray(mixed_qkv, dtype=np.float64)
    pool = np.array(pool, dtype=np.float64, copy=True)
    _, HV, V, K = pool.shape
    q, k, v, H = split_packed(x, HV, V, K)
    B = x.shape[0]
    hmap = key_head_of(HV, H)
    q, k = _prep_qk(q[:, hmap], k[:, hmap], scale, use_qk_l2norm)  # [B, HV, K]
    g = token_log_decay(a, A_log, dt_bias, B, HV, K, kda, lower_bound if kda else None)
    if not kda:
        g = np.repeat(g[..., None], K, axis=-1)
    beta = sigmoid(b)
    if beta_dtype is not None:
        beta = rd(beta, beta_dtype)
    out = np.zeros((B, 1, HV, V))
    for n in range(B):
        slot = int(indices[n])
        if slot < 0:
            continue
        S, o = delta_step(pool[slot], q[n], k[n], v[n], np.exp(g[n]), beta[n])
        pool[slot] = S
        out[n, 0] = o
    return out, pool


# ---- recurrent (B,T and varlen) ---------------------------------------------------------------
def recurrent(q, k, v, g, beta, *, kda, A_log=None, dt_bias=None, scale=None, initial_state=None,
              ssm_state_indices=None, cu_seqlens=None, use_gate_in_kernel=False, lower_bound=None,
              beta_is_logit=False, use_qk_l2norm=True):
    """q, k [B,T,H,K]; v [B,T,HV,V]; g GDN [B,T,HV] / KDA [B,T,HV,K]; beta [B,T,HV]; with
    cu_seqlens B == 1 and sequence n is tokens [cu[n], cu[n+1]). initial_state: with
    ssm_state_indices a pool [slots,HV,V,K] (index < 0: padded sequence), else [N,HV,V,K] or None.
    Returns (o [B,T,HV,V], final [N,HV,V,K] (zeros for padded sequences), new pool or None)."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    g, beta = np.asarray(g, dtype=np.float64), np.asarray(beta, dtype=np.float64)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    hmap = key_head_of(HV, H)
    scale = K ** -0.5 if scale is None else scale
    if use_gate_in_kernel:
        A = np.asarray(A_log, dtype=np.float64)
        if kda:
            dt = None if dt_bias is None else np.asarray(dt_bias, np.float64).reshape(HV, K)
            g = gate(g, A[:, None], dt, lower_bound)
        else:
            dt = None if dt_bias is None else np.asarray(dt_bias, np.float64).reshape(HV)
            g = gate(g, A, dt, lower_bound)
    if not kda:
        g = np.repeat(g[..., None], K, axis=-1)  # [B,T,HV,K]
    if beta_is_logit:
        beta = sigmoid(beta)
    if cu_seqlens is not None:
        cu = [int(c) for c in cu_seqlens]
        seqs = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    else:
        seqs = [(n, 0, T) for n in range(B)]
    N = len(seqs)
    pooled = ssm_state_indices is not None
    pool = None if not pooled else np.array(initial_state, dtype=np.float64, copy=True)
    o = np.zeros((B, T, HV, V))
    final = np.zeros((N, HV, V, K))
    for n, (bi, t0, t1) in enumerate(seqs):
        if pooled:
            slot = int(ssm_state_indices[n])
            if slot < 0:
                continue  # padded: zero output, zero final state, pool untouched
            S = pool[slot].copy()
        elif initial_state is not None:
            S = np.asarray(initial_state[n], dtype=np.float64).copy()
        else:
            S = np.zeros((HV, V, K))
        for t in range(t0, t1):
            qt, kt = _prep_qk(q[bi, t, hmap], k[bi, t, hmap], scale, use_qk_l2norm)
            S, o[bi, t] = delta_step(S, qt, kt, v[bi, t], np.exp(g[bi, t]), beta[bi, t])
        final[n] = S
        if pooled:
            pool[slot] = S
    return o, final, pool


# ---- ReplaySSM, basic mode --------------------------------------------------------------------
class ReplayMemory:
    """The caller memory ReplaySSM works on, as float64 "values before storage rounding"; every
    read goes through `rd` with the dtype the kernel stores it in."""

    def __init__(self, state, d_cache, k_cache, g_cache, *, state_dtype, d_dtype, k_dtype):
        self.state = np.array(state, dtype=np.float64, copy=True)  # [S, HV, V, K]
        self.d = np.array(d_cache, dtype=np.float64, copy=True)  # [S, HV, L, V]
        self.k = np.array(k_cache, dtype=np.float64, copy=True)  # [S, H, L, K]
        self.g = np.array(g_cache, dtype=np.float64, copy=True)  # [S, HV, L(, K)]
        self.state_dtype, self.d_dtype, self.k_dtype = state_dtype, d_dtype, k_dtype

    @property
    def L(self):
        return self.d.shape[2]


def replayssm_decode(mem: ReplayMemory, mixed_qkv, a, b, A_log, dt_bias, scale, indices,
                     write_pos, force_flush=None, *, kda, b_dtype, lower_bound=None,
                     use_qk_l2norm=True, round_beta=False, cache_base=None, circular=False,
                     prefix=False, predecay=False):
    """One ReplaySSM step on `mem` (updated in place). a: GDN [B,HV], KDA [B,HV,K] or [B,HV*K];
    dt_bias GDN [HV], KDA [HV,K] or [HV*K]. Beta is sigmoid(b) in fp32, rounded to `b_dtype`
    with `round_beta` (never with `predecay`).

    SGLang's ring modes: `circular` puts record j at ring position (cache_base + j) mod L; a
    natural flush (m == L-1, not forced, L > 1) then makes the state before the token the
    checkpoint and still appends the token's record, while a forced flush (or L = 1) folds the
    token in. `prefix` (KDA only; SGLang's GDN path ignores it): the g ring holds the cumulative
    gate G_j since the checkpoint. `predecay`: the k ring holds k_j / exp(G_j).

    Returns (out [B,1,HV,V], flushed [B] bool (the checkpoint was written), new write_pos [B],
    new cache_base [B] per the caller protocol: basic wp = flushed ? 0 : m + 1; circular forced
    -> (wp 0, base 0), natural -> (wp 1, base (base + m) mod L), else wp + 1; padded rows keep
    theirs)."""
    x = np.asarray(mixed_qkv, dtype=np.float64)
    _, HV, V, K = mem.state.shape
    L = mem.L
    q, k, v, H = split_packed(x, HV, V, K)
    B = x.shape[0]
    hmap = key_head_of(HV, H)
    prefix = prefix and kda
    q, k = _prep_qk(q, k, scale, use_qk_l2norm)  # per key head [B, H, K]: q scaled, k normalized
    g = token_log_decay(a, A_log, dt_bias, B, HV, K, kda, lower_bound)
    beta = rd(sigmoid(b), "float32")
    if round_beta and not predecay:
        beta = rd(beta, b_dtype)  # the round_beta option: beta rounded to b.dtype
    out = np.zeros((B, 1, HV, V))
    flushed = np.zeros(B, dtype=bool)
    new_wp = np.array(write_pos, dtype=np.int64, copy=True)
    base_in = np.zeros(B, np.int64) if cache_base is None else np.asarray(cache_base, np.int64)
    new_base = base_in.copy()
    for n in range(B):
        slot = int(indices[n])
        if slot < 0:
            continue
        m = int(write_pos[n])
        forced = force_flush is not None and int(force_flush[n]) != 0
        natural = m == L - 1
        base = int(base_in[n]) if circular else 0
        history = circular and natural and not forced and L > 1
        fold = (forced or L == 1) if circular else (natural or forced)
        flushed[n] = fold or history
        pos = [(base + j) % L for j in range(L)]
        for hv in range(HV):
            h = hmap[hv]
            S0 = rd(mem.state[slot, hv], mem.state_dtype)
            # Ring records j < m at pos[j]: G_j the cumulative gate, Gtot = G_{m-1}.
            gj = np.array([rd(mem.g[slot, hv, pos[j]], "float32") for j in range(m)])
            gj = gj.reshape(m, K if kda else 1)
            if not kda:
                gj = np.repeat(gj, K, axis=1)
            G = gj if prefix else np.cumsum(gj, axis=0)
            Gtot = G[m - 1] if m > 0 else np.zeros(K)
            S = S0 * np.exp(Gtot)[None, :]
            for j in range(m):
                dj = rd(mem.d[slot, hv, pos[j]], mem.d_dtype)
                kj = rd(mem.k[slot, h, pos[j]], mem.k_dtype)
                wk = np.exp(Gtot) * kj if predecay else np.exp(Gtot - G[j]) * kj
                S = S + np.outer(dj, wk)
            # The current token.
            gcur = g[n, hv] if kda else np.full(K, g[n, hv])
            alpha = np.exp(gcur)
            qs, kh = q[n, h], k[n, h]
            sq = S @ (alpha * qs)
            sk = S @ (alpha * kh)
            d = beta[n, hv] * (v[n, hv] - sk)
            out[n, 0, hv] = sq + d * np.dot(kh, qs)
            if fold:
                mem.state[slot, hv] = S * alpha[None, :] + np.outer(d, kh)
                continue
            if history:
                mem.state[slot, hv] = S
            Gnew = gcur if (history or m == 0) else Gtot + gcur  # cumulative through the token
            at = pos[m]
            mem.d[slot, hv, at] = d
            mem.k[slot, h, at] = kh / np.exp(Gnew) if predecay else kh
            if kda:
                mem.g[slot, hv, at] = Gnew if prefix else gcur
            else:
                mem.g[slot, hv, at] = gcur[0]
        if circular:
            if forced:
                new_wp[n], new_base[n] = 0, 0
            elif history:
                new_wp[n], new_base[n] = 1, (base + m) % L
            else:
                new_wp[n] = 0 if fold else m + 1  # L = 1: every step folds
        else:
            new_wp[n] = 0 if fold else m + 1
    if cache_base is None and not circular:
        return out, flushed, new_wp
    return out, flushed, new_wp, new_base


# ---- speculative verify ---------------------------------------------------------------------
def verify_sequence(S0, q, k, v, g, beta, *, kda, A_log, dt_bias, scale=None, parents=None,
                    lower_bound=None, use_qk_l2norm=True, state_dtype="float32"):
    """One sequence of SGLang's target verify: q, k [T,H,K]; v [T,HV,V]; g the raw gate input
    (GDN [T,HV], KDA [T,HV,K]); beta logits [T,HV]; S0 [HV,V,K]. A chain (parents None) runs the
    tokens in order; in a tree token t > 0 starts from the state after token parents[t] (< 0: S0).
    A parent's state other than the previous token's is read back from the scratch buffer, so it
    is rounded to `state_dtype` first. Returns (o [T,HV,V], states [T,HV,V,K]: the state after
    each token, unrounded)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    T, H, K = q.shape
    HV = v.shape[1]
    hmap = key_head_of(HV, H)
    scale = K ** -0.5 if scale is None else scale
    A = np.asarray(A_log, np.float64)
    if kda:
        gl = gate(g, A[:, None], np.asarray(dt_bias, np.float64).reshape(HV, K), lower_bound)
    else:
        gl = np.repeat(gate(g, A, np.asarray(dt_bias, np.float64))[..., None], K, axis=-1)
    b = sigmoid(beta)
    o = np.zeros((T, HV, v.shape[2]))
    states = np.zeros((T,) + np.shape(S0))
    for t in range(T):
        if t == 0:
            S = np.asarray(S0, np.float64)
        elif parents is None:
            S = states[t - 1]
        else:
            p = parents[t]
            S = (np.asarray(S0, np.float64) if p < 0 else states[p] if p == t - 1
                 else rd(states[p], state_dtype))
        qt, kt = _prep_qk(q[t, hmap], k[t, hmap], scale, use_qk_l2norm)
        states[t], o[t] = delta_step(S, qt, kt, v[t], np.exp(gl[t]), b[t])
    return o, states
