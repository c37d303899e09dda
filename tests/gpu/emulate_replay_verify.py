"""No-GPU check of the factored ReplaySSM verify kernel's algebra (src/cuda/replayssm/verify.cuh,
phase 3f and its factor_pass), with numpy.

    python3 tests/gpu/emulate_replay_verify.py

The kernel never updates its rows for a draft: with the rows S in registers (the checkpoint S0 on
an appending step with one staging round of records, else the state the replay rebuilt) and the
records before draft t (mf factored committed ones, then drafts 0..t-1), per row

    sk_t = S.(E_t*k_t) + sum_{j < mf + t} d_j ck[j][t],   ck[j][t] = (A_jt*k_j).k_t
    sq_t = S.(E_t*q_t) + sum_{j < mf + t} d_j cq[j][t],   cq[j][t] = (A_jt*k_j).q_t
    u_t = beta_t (v_t - sk_t),   o_t = sq_t + u_t (k_t.q_t)

with A_jt = exp(sum of g over records j+1 .. draft t itself) (per K column for KDA) and E_t =
A_{-1,t}. This script transcribes that (the per-pair walk of factor_pass, the kernel's choice of
factored / replayed records, its fold rule) and runs it against the plain delta-rule recurrence
in fp64, GDN and KDA: (1) one verify for every committed count m = 0 .. L - T, appending and
folding, (2) random verify / commit sequences (the commit's cursor rule, circular rings, random
accept counts and draft counts). The emulation in fp64 ("rounding off") must agree to ~1e-12:
that checks the algebra (outputs, every draft's d record, the folded checkpoint); in fp32 the
error is reported and bounded by the GPU tests' output tolerance.

The tensor-core kernel (src/cuda/replayssm/verify_tc.cuh) runs the same algebra with the rows'
dots on mma.sync.m16n8k8 (tf32). (3) Its lanes are transcribed: the staged tile's placement
(rv_tc_tile_place), each lane's A and B fragments of the permuted K order as the kernel reads
them, placed where PTX's fragment layout puts them, the products, the records' terms on the
accumulator lanes, and the drafts' quad loop (u_t from the holder lane t % 4, shuffled, folded
into the later drafts): with rounding off (fp64, operands unsplit) it must equal the factored
algebra to ~1e-12; with the kernel's 3xTF32 split (each operand's hi and lo with 13 low bits
cleared, the three products summed in fp64) the dots' error must stay within 2^-19 of
sum |S||b|.
"""

import sys

import numpy as np

RC, TOK = 16, 8  # rv_rec_chunk<128>(), kRvTokChunk


def gates(rng, n, K, kda):
    """Log decays of n tokens: per column (KDA) or one per token (GDN), broadcast over K."""
    g = -np.exp(rng.uniform(np.log(0.01), np.log(3.0), (n, K if kda else 1)))
    return np.broadcast_to(g, (n, K)).copy()


def plain_step(S, q, k, g, v, beta):
    """The recurrent step (delta_math.h): decay, u = beta (v - S.k), S += u k^T, o = S.q."""
    S = S * np.exp(g)[None, :]
    u = beta * (v - S @ k)
    S = S + np.outer(u, k)
    return S, S @ q, u


def tc_place(P):
    """rv_tc_tile_place: the CTA row and 16-byte chunk that the staged tile's float4 P holds."""
    return (P >> 9) * 16 + ((P >> 5) & 1) * 8 + ((P >> 2) & 7), ((P >> 6) & 7) * 4 + (P & 3)


def tf32_split(x):
    """split_tf32: hi = x with its low 13 bits cleared, lo = (x - hi) likewise (fp32 inputs)."""
    x = np.asarray(x, np.float32)
    mask = np.uint32(0xFFFFE000)
    hi = (x.view(np.uint32) & mask).view(np.float32)
    lo = ((x - hi).astype(np.float32).view(np.uint32) & mask).view(np.float32)
    return hi.astype(np.float64), lo.astype(np.float64)


def mma_m16n8k8(a, b):
    """C = A B of one m16n8k8 from the lanes' fragments (PTX: a0 = A[g][t], a1 = A[g+8][t],
    a2 = A[g][t+4], a3 = A[g+8][t+4]; b0 = B[t][g], b1 = B[t+4][g]); returns c[lane][4] (c0 =
    C[g][2t], c1 = C[g][2t+1], c2 = C[g+8][2t], c3 = C[g+8][2t+1])."""
    A = np.full((16, 8), np.nan)
    B = np.full((8, 8), np.nan)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4] = a[lane]
        B[t, g], B[t + 4, g] = b[lane]
    C = A @ B
    return np.array([[C[lane >> 2, 2 * (lane & 3)], C[lane >> 2, 2 * (lane & 3) + 1],
                      C[(lane >> 2) + 8, 2 * (lane & 3)], C[(lane >> 2) + 8, 2 * (lane & 3) + 1]]
                     for lane in range(32)])


def tc_lanes(S, E, k, q, v, beta, mf, d_rec, ck, cq, split):
    """The tensor-core kernel's lanes on one CTA (128 rows, K = 128): outputs and d records
    [T][128], and the dots before the records' terms with their absolute-value sums."""
    T = k.shape[0]
    tile = np.zeros((4096, 4))
    for P in range(4096):
        row, chunk = tc_place(P)
        tile[P] = S[row, 4 * chunk:4 * chunk + 4]
    out = np.zeros((T, 128))
    urec = np.zeros((T, 128))
    dots = np.zeros((T, 2, 128))
    for warp in range(8):
        acc = np.zeros((2, 32, 4))
        for pp in range(8):
            x0 = tile[warp * 512 + (pp * 2) * 32:warp * 512 + (pp * 2) * 32 + 32]
            x1 = tile[warp * 512 + (pp * 2 + 1) * 32:warp * 512 + (pp * 2 + 1) * 32 + 32]
            for nt in range(2):
                if 4 * nt >= T:
                    continue
                b = np.zeros((32, 4))
                for lane in range(32):
                    g, t4 = lane >> 2, lane & 3
                    t = 4 * nt + (g >> 1)
                    if t < T:
                        cols = slice(16 * pp + 4 * t4, 16 * pp + 4 * t4 + 4)
                        b[lane] = E[t, cols] * (q[t, cols] if g & 1 else k[t, cols])
                for st in range(2):
                    a = np.stack([x0[:, 2 * st], x1[:, 2 * st], x0[:, 2 * st + 1],
                                  x1[:, 2 * st + 1]], axis=1)
                    bb = b[:, 2 * st:2 * st + 2]
                    if split:
                        ah, al = tf32_split(a)
                        bh, bl = tf32_split(bb)
                        acc[nt] += mma_m16n8k8(al, bh) + mma_m16n8k8(ah, bl) + mma_m16n8k8(ah, bh)
                    else:
                        acc[nt] += mma_m16n8k8(a, bb)
        for lane in range(32):
            g, t4 = lane >> 2, lane & 3
            for nt in range(2):
                t = 4 * nt + t4
                if t < T:
                    for h in range(2):
                        dots[t, 0, warp * 16 + g + 8 * h] = acc[nt, lane, 2 * h]
                        dots[t, 1, warp * 16 + g + 8 * h] = acc[nt, lane, 2 * h + 1]
        for j in range(mf):  # the factored records' terms
            for lane in range(32):
                g, t4 = lane >> 2, lane & 3
                lrow = warp * 16 + g
                for nt in range(2):
                    t = 4 * nt + t4
                    if t < T:
                        for h in range(2):
                            acc[nt, lane, 2 * h] += d_rec[j][lrow + 8 * h] * ck[j, t]
                            acc[nt, lane, 2 * h + 1] += d_rec[j][lrow + 8 * h] * cq[j, t]
        for t in range(T):  # the quad loop
            nt = t >> 2
            u = np.zeros((32, 2))
            for lane in range(32):
                lrow = warp * 16 + (lane >> 2)
                for h in range(2):
                    u[lane, h] = beta[t] * (v[t, lrow + 8 * h] - acc[nt, lane, 2 * h])
            u = u[[(lane & ~3) | (t & 3) for lane in range(32)]]  # __shfl_sync from the holder
            for lane in range(32):
                g, t4 = lane >> 2, lane & 3
                lrow = warp * 16 + g
                if t4 == (t & 3):
                    for h in range(2):
                        out[t, lrow + 8 * h] = acc[nt, lane, 2 * h + 1] + u[lane, h] * (k[t] @ q[t])
                        urec[t, lrow + 8 * h] = u[lane, h]
                for nt2 in range(2):
                    t2 = 4 * nt2 + t4
                    if t < t2 < T:
                        for h in range(2):
                            acc[nt2, lane, 2 * h] += u[lane, h] * ck[mf + t, t2]
                            acc[nt2, lane, 2 * h + 1] += u[lane, h] * cq[mf + t, t2]
    return out, urec, dots


def factored_verify(S0, ring, m, base, fold, tok, dt, tc=None):
    """The kernel's verify of one head: returns (outputs [T][V], d records [T][V], the checkpoint
    after a fold or None). ring = (d [L][V], k [L][K], g [L][K]); tok = (q, k, g, v, beta) with
    leading draft axis."""
    d_ring, k_ring, g_ring = ring
    L = d_ring.shape[0]
    q, k, g, v, beta = (np.asarray(x, dt) for x in tok)
    T = q.shape[0]
    assert T <= TOK
    frecs = not fold and m <= RC
    mf = m if frecs else 0
    pos = [(base + c) % L for c in range(m)]
    S = S0.astype(dt)
    folded = None
    if not frecs:  # the replay: s = fma(d, k, s * alpha) per record, oldest first
        for c in pos:
            S = S * np.exp(g_ring[c].astype(dt))[None, :] + np.outer(d_ring[c], k_ring[c]).astype(dt)
        if fold and m > 0:
            folded = S.copy()
    # factor_pass: records 0 .. mf-1 committed, then the drafts
    rk = [k_ring[c].astype(dt) for c in pos[:mf]] + [k[t] for t in range(T)]
    rg = [g_ring[c].astype(dt) for c in pos[:mf]] + [g[t] for t in range(T)]
    nrec = mf + T
    E = np.zeros((T, S.shape[1]), dt)
    ck = np.zeros((nrec, T), dt)
    cq = np.zeros((nrec, T), dt)
    for j in range(-1, nrec - 1):  # walker j: sums g forward from record j + 1
        s = np.zeros(S.shape[1], dt)
        for r in range(j + 1, nrec):
            s = s + rg[r]
            if r < mf:
                continue
            t = r - mf
            if j < 0:
                E[t] = np.exp(s)
            else:
                w = np.exp(s) * rk[j]
                ck[j, t] = w @ k[t]
                cq[j, t] = w @ q[t]
    d_rec = [d_ring[c].astype(dt) for c in pos[:mf]]
    if tc is not None:  # the tensor-core kernel's lanes (tc = split)
        out, u, dots = tc_lanes(S, E, k, q, v, beta, mf, d_rec, ck, cq, tc)
        return out, u, folded, (S, E, k, q, dots)
    red_k = np.stack([S @ (E[t] * k[t]) + sum((d_rec[j] * ck[j, t] for j in range(mf)),
                                              np.zeros(S.shape[0], dt)) for t in range(T)])
    red_q = np.stack([S @ (E[t] * q[t]) + sum((d_rec[j] * cq[j, t] for j in range(mf)),
                                              np.zeros(S.shape[0], dt)) for t in range(T)])
    u = np.zeros((T, S.shape[0]), dt)
    out = np.zeros((T, S.shape[0]), dt)
    for t in range(T):
        sk = red_k[t] + sum((u[i] * ck[mf + i, t] for i in range(t)), np.zeros(S.shape[0], dt))
        u[t] = beta[t] * (v[t] - sk)
        sq = red_q[t] + sum((u[i] * cq[mf + i, t] for i in range(t)), np.zeros(S.shape[0], dt))
        out[t] = sq + u[t] * (k[t] @ q[t])
    return out, u, folded


def draw_tokens(rng, T, K, V, kda):
    q = rng.standard_normal((T, K)) * K ** -0.5
    k = rng.standard_normal((T, K))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    return q, k, gates(rng, T, K, kda), rng.standard_normal((T, V)), rng.uniform(0.05, 1.0, T)


def check_tc(rng, L, T, kda, m, fold, split):
    """The tensor-core kernel's lanes on one head (K = V = 128) against the factored algebra in
    fp64: the worst relative error of outputs and d records, and of the dots against
    sum |S||b| (split)."""
    K = V = 128
    S0 = 0.3 * rng.standard_normal((V, K))
    base = int(rng.integers(0, L))
    d_ring = rng.standard_normal((L, V))
    k_ring = rng.standard_normal((L, K))
    k_ring /= np.linalg.norm(k_ring, axis=1, keepdims=True)
    ring = (d_ring, k_ring, gates(rng, L, K, kda))
    tok = draw_tokens(rng, T, K, V, kda)
    if split:  # the kernel's operands are fp32
        S0 = S0.astype(np.float32).astype(np.float64)
    out, u, _ = factored_verify(S0, ring, m, base, fold, tok, np.float64)
    out_tc, u_tc, _, (S, E, k, q, dots) = factored_verify(S0, ring, m, base, fold, tok, np.float64,
                                                         tc=split)
    err = max(np.max(np.abs(out_tc - out)) / (1 + np.max(np.abs(out))),
              np.max(np.abs(u_tc - u)) / (1 + np.max(np.abs(u))))
    dot_err = 0.0
    for t in range(T):
        for kind, vec in enumerate((E[t] * k[t], E[t] * q[t])):
            b = vec.astype(np.float32).astype(np.float64) if split else vec
            exact = S @ b
            scale = np.abs(S) @ np.abs(b)
            dot_err = max(dot_err, np.max(np.abs(dots[t, kind] - exact) / scale))
    return err, dot_err


def check_one(rng, K, V, L, T, kda, m, fold, dt):
    """One verify with m committed records against the recurrence; the worst relative error."""
    S0 = 0.3 * rng.standard_normal((V, K))
    base = int(rng.integers(0, L))
    d_ring = rng.standard_normal((L, V))
    k_ring = rng.standard_normal((L, K))
    k_ring /= np.linalg.norm(k_ring, axis=1, keepdims=True)
    g_ring = gates(rng, L, K, kda)
    S = S0.copy()
    for c in range(m):
        p = (base + c) % L
        S = S * np.exp(g_ring[p])[None, :] + np.outer(d_ring[p], k_ring[p])
    tok = draw_tokens(rng, T, K, V, kda)
    out, u, folded = factored_verify(S0, (d_ring, k_ring, g_ring), m, base, fold, tok, dt)
    err = 0.0
    if fold and m > 0:
        err = max(err, np.max(np.abs(folded - S)) / (1 + np.max(np.abs(S))))
    for t in range(T):
        S, o, ut = plain_step(S, *(x[t] for x in tok))
        err = max(err, np.max(np.abs(out[t] - o)) / (1 + np.max(np.abs(o))),
                  np.max(np.abs(u[t] - ut)) / (1 + np.max(np.abs(ut))))
    return err


def check_sequence(rng, K, V, L, T, kda, steps, dt):
    """Random verify / commit steps on one slot (replayssm_commit's cursor rule): the worst
    relative error of outputs, d records and folded checkpoints against the recurrence."""
    S0 = 0.3 * rng.standard_normal((V, K))
    d_ring = np.zeros((L, V))
    k_ring = np.zeros((L, K))
    g_ring = np.zeros((L, K))
    wp, base, flush = 0, int(rng.integers(0, L)), 0
    S_true = S0.copy()  # the state after the committed tokens
    err, ms = 0.0, set()
    for _ in range(steps):
        n = int(rng.integers(1, T + 1))
        tok = draw_tokens(rng, n, K, V, kda)
        m, fold = wp, flush != 0
        ms.add((m, fold))
        out, u, folded = factored_verify(S0, (d_ring, k_ring, g_ring), m, base, fold, tok, dt)
        for t in range(n):  # the drafts' records, as the kernel appends them
            p = (base + m + t) % L
            d_ring[p], k_ring[p], g_ring[p] = u[t], tok[1][t], tok[2][t]
        if fold and m > 0:
            err = max(err, np.max(np.abs(folded - S_true)) / (1 + np.max(np.abs(S_true))))
            S0 = folded.astype(np.float64)
        S = S_true.copy()
        states = []
        for t in range(n):
            S, o, ut = plain_step(S, *(x[t] for x in tok))
            states.append(S)
            err = max(err, np.max(np.abs(out[t] - o)) / (1 + np.max(np.abs(o))),
                      np.max(np.abs(u[t] - ut)) / (1 + np.max(np.abs(ut))))
        a = int(rng.integers(0, n + 1))
        if a > 0:
            S_true = states[a - 1]
        if flush:
            if a > 0:
                base = (base + wp) % L
            wp = a
        else:
            wp += a
        flush = 1 if wp + 2 * T > L else 0
    return err, ms


def main() -> int:
    rng = np.random.default_rng(11)
    ok = True
    for dt, name, bound in ((np.float64, "fp64 (rounding off)", 1e-11), (np.float32, "fp32", 1e-4)):
        worst = 0.0
        for kda in (False, True):
            for K, V, L, T in ((16, 8, 8, 4), (32, 12, 16, 4), (16, 8, 24, 8)):
                for m in range(0, L - T + 1):
                    for fold in (False, True):
                        worst = max(worst, check_one(rng, K, V, L, T, kda, m, fold, dt))
                e, ms = check_sequence(rng, K, V, L, T, kda, 60, dt)
                worst = max(worst, e)
                if dt is np.float64 and not any(f for _, f in ms):
                    print(f"no fold reached: K={K} L={L} T={T}")
                    ok = False
        status = "ok" if worst <= bound else "FAILED"
        ok &= worst <= bound
        print(f"factored verify vs the fp64 recurrence, {name}: worst relative error "
              f"{worst:.2e} (bound {bound:.0e}): {status}")
    # the tensor-core kernel's lanes: fp64 unsplit (rounding off), then the 3xTF32 split
    for split, name, bound, dot_bound in ((False, "fp64 (rounding off)", 1e-11, 1e-12),
                                          (True, "3xTF32", 1e-5, 2.0 ** -19)):
        worst = worst_dot = 0.0
        for kda, L, T, m, fold in ((False, 8, 4, 0, False), (False, 8, 4, 4, False),
                                   (False, 16, 8, 8, False), (False, 16, 8, 5, True),
                                   (True, 16, 3, 13, False), (True, 8, 4, 3, True),
                                   (False, 16, 6, 0, True)):
            e, de = check_tc(rng, L, T, kda, m, fold, split)
            worst, worst_dot = max(worst, e), max(worst_dot, de)
        good = worst <= bound and worst_dot <= dot_bound
        ok &= good
        print(f"tensor-core lanes vs the factored algebra, {name}: worst relative error "
              f"{worst:.2e} (bound {bound:.0e}), dots {worst_dot:.2e} of sum |S||b| (bound "
              f"{dot_bound:.1e}): {'ok' if good else 'FAILED'}")
    placed = sorted(tc_place(P) for P in range(4096))
    if placed != [(row, chunk) for row in range(128) for chunk in range(32)]:
        print("the staged tile does not hold every (row, chunk) once: FAILED")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
