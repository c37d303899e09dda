"""No-GPU checks of the split prefill kernels (src/cuda/chunk_prefill/split.cuh), with numpy.

    python3 tests/gpu/emulate_split_kernels.py

1. The chunk slots: off(n) = cu_seqlens[n] // 64 + n gives every chunk of every sequence its own
   slot below T // 64 + N, and split_locate's binary search finds (n, ci) back (holes: none).
2. One chunk (K = V = 128 and 64, 50 tokens, GDN and KDA) through the three kernels, transcribed
   lane by lane from split.cuh with emulate_tc_kernel.py's ldmatrix / mma emulation: the U^T and
   W products of kernel 1 (KDA: A and P by the fused kernel's factored pairwise tiles, its blocked
   inverse, the decayed operands, P's copy to the workspace), the chunk-start state, v'^T and the
   state update of kernel 2 (every row tile; KDA: the decay per column, the stored keys), the
   outputs of kernel 3, against the chunk algebra in fp64 (KDA: per-channel decays). With bf16
   rounding off it must agree to fp32 (~1e-7): that checks every fragment index of the
   transcription; with it on, the error is the fused kernel's kind.
3. KDA over several chunks (the state carried from kernel 2 to the next chunk), the in-kernel
   gate (softplus, or lower_bound's sigmoid) and beta from a logit, against the fp64 token
   recurrence: rounding off ~1e-7; on, the fused kernel's emulated errors (emulate_tc_kernel.py
   section 3) on the same inputs.
A change to split.cuh's fragment code should be mirrored here and checked before it goes to a GPU.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import emulate_tc_kernel as et  # noqa: E402
from emulate_tc_kernel import (G8, Q4, a_tile, b_pair, b_pair_trans, bf16, bf16_input,  # noqa: E402
                               c_pair_trans, ldsm, mma, pack, split_pack)

f32 = np.float32
D, C = 128, 64
LDI, LDB = D + 8, C + 8
R = 32  # kSplitRows
LDU = C + 4


# ---- 1. chunk slots ------------------------------------------------------------------------------
def check_slots():
    rng = np.random.default_rng(3)
    for _ in range(200):
        N = int(rng.integers(1, 12))
        lens = rng.integers(0, 300, N)
        lens[rng.random(N) < 0.2] = 0
        cu = np.concatenate([[0], np.cumsum(lens)])
        T = int(cu[-1]) + int(rng.integers(0, 100))  # q may hold more rows than cu_seqlens uses
        slots = T // C + N
        off = lambda n: cu[n] // C + n  # noqa: E731
        seen = {}
        for n in range(N):
            for ci in range((lens[n] + C - 1) // C):
                j = off(n) + ci
                assert 0 <= j < slots and j not in seen, (cu, n, ci)
                seen[j] = (n, ci)
        for j in range(slots):  # split_locate as written
            lo, hi = 0, N - 1
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if off(mid) <= j:
                    lo = mid
                else:
                    hi = mid - 1
            n, ci = lo, j - off(lo)
            got = (n, ci) if (n < N and ci * C < lens[n]) else None
            assert got == seen.get(j), (cu, j, got, seen.get(j))
    print("1. chunk slots and their binary search: ok")


# ---- 2. one chunk --------------------------------------------------------------------------------
def lanes_of(M, r0, c0):
    """The C-layout accumulators [lane][4] of the 16x8 tile of M at (r0, c0)."""
    return np.stack([M[r0 + G8, c0 + 2 * Q4], M[r0 + G8, c0 + 2 * Q4 + 1],
                     M[r0 + G8 + 8, c0 + 2 * Q4], M[r0 + G8 + 8, c0 + 2 * Q4 + 1]], 1)


def copy_matrix(src, rows, cols, ld):
    """split_copy_matrix: a contiguous [rows][cols] block into [rows][ld] (16-byte pieces)."""
    dst = np.full(rows * ld, np.nan)
    for i in range(rows * (cols // 8)):
        r, c = i // (cols // 8), i % (cols // 8)
        dst[r * ld + 8 * c:r * ld + 8 * c + 8] = src[r * cols + 8 * c:r * cols + 8 * c + 8]
    return dst


def kda_pairs(G, KT, QT, beta):
    """kda_pairs of tc_kernel.cuh (the factored 4x4 tiles, fp32 sums) -> Tf [C][LDT], Pb [C][LDB]."""
    Tf, Pb = np.full((C, C + 4), np.nan, f32), np.full((C, LDB), np.nan, f32)
    et.kda_pairs(G, KT, QT, beta, Tf, Pb)
    Pb[:, C:] = 0
    return Tf, Pb.reshape(-1)


def kernels(kda, q, k, v, beta, G, S0, cv):
    """The three kernels on one chunk, lane by lane. q, k, v [C][D] (zeros past cv), beta [C], G
    [C] (GDN) or [C][D] (KDA), the chunk-start state S0 [D][D]; -> (o [C][D], S1, U, W)."""
    scale = D ** -0.5
    valid = np.arange(C) < cv
    pad = lambda M, ld: np.pad(M, ((0, 0), (0, ld - M.shape[1]))).reshape(-1)  # noqa: E731
    Vf = pad(v, LDI)
    if not kda:
        GL = G[-1]
        rk = np.where(valid, 1 / np.sqrt((k.astype(np.float64) ** 2).sum(1) + 1e-6), 0)
        rq = np.where(valid, scale / np.sqrt((q.astype(np.float64) ** 2).sum(1) + 1e-6), 0)
        kf, df, qf, dec = rk * np.exp(G), rk * np.exp(GL - G), rq * np.exp(G), np.exp(GL)
        kh, qh = k * rk[:, None], q * rq[:, None]
        E = np.exp(G[:, None] - G[None, :])
        A = np.tril(beta[:, None] * (kh @ kh.T) * E, -1)
        T = np.linalg.inv(np.eye(C) + A)
        P = np.tril((qh @ kh.T) * E)
        x = T * beta[None, :]
        y = x * kf[None, :]
        Tb, Tl = pad(bf16(x), LDB), pad(bf16(x - bf16(x)), LDB)
        Ah, Al = pad(bf16(y), LDB), pad(bf16(y - bf16(y)), LDB)
        WB = pad(k, LDI)  # W's B operand: raw k
        Kup = pad(k, LDI)  # kernel 2's keys: raw k
        Qs3 = pad(q, LDI)  # kernel 3's queries: raw q
        Pb3 = pad(bf16(P), LDB)
    else:
        rk = np.where(valid, 1 / np.sqrt((k ** 2).sum(1) + 1e-6), 0).astype(f32)
        rq = np.where(valid, scale / np.sqrt((q ** 2).sum(1) + 1e-6), 0).astype(f32)
        kh, qh = (k * rk[:, None]).astype(f32), (q * rq[:, None]).astype(f32)
        Tf, Pg_s = kda_pairs(G, kh.T, qh.T, beta)  # Pb in shared memory [C][LDB]
        Pg = np.full(C * C, np.nan)  # kernel 1's copy of P to the workspace
        for i in range(C * (C // 8)):
            t, c = i // (C // 8), i % (C // 8)
            Pg[8 * i:8 * i + 8] = Pg_s[t * LDB + 8 * c:t * LDB + 8 * c + 8]
        WB = pad(bf16(kh * np.exp(G)), LDI)  # k^ e^{G} in place of k
        Kdg = bf16(kh * np.exp(G[-1][None] - G)).reshape(-1)  # [C][D] to the workspace
        Qgg = bf16(qh * np.exp(G)).reshape(-1)
        T2 = et.invert(Tf)
        tri = np.arange(C)[None, :] <= np.arange(C)[:, None]
        x = np.where(tri, T2[:, :C] * beta[None, :], 0).astype(f32)
        Tb, Tl = pad(bf16(x), LDB), pad(bf16(x - bf16(x)), LDB)
        Ah, Al = Tb, Tl
        sc = np.full(4 * C, np.nan)
        sc[2 * C:2 * C + D] = np.exp(G[-1])  # e^{G_L} [D] from row 2
        Kup = copy_matrix(Kdg, C, D, LDI)
        Qs3 = copy_matrix(Qgg, C, D, LDI)
        Pb3 = copy_matrix(Pg, C, C, LDB)
        Pb3[np.isnan(Pb3)] = 0  # the pad columns of [C][LDB] are never read
        df = np.ones(C)

    # kernel 1: U^T (v as M), W (t as M)
    Ug = np.full(D * C, np.nan)
    for warp in range(D // 16):
        V0 = 16 * warp
        va = [ldsm(Vf, c_pair_trans(16 * kk, V0, LDI), trans=True) for kk in range(4)]
        for jp in range(4):
            au = np.zeros((2, 32, 4))
            for kk in range(jp + 1):
                bh, bl = ldsm(Tb, b_pair(16 * jp, 16 * kk, LDB)), ldsm(Tl, b_pair(16 * jp, 16 * kk, LDB))
                for n in range(2):
                    mma(au[n], va[kk], bh[:, 2 * n], bh[:, 2 * n + 1])
                    mma(au[n], va[kk], bl[:, 2 * n], bl[:, 2 * n + 1])
            for n in range(2):
                t = 8 * (2 * jp + n) + 2 * Q4
                Ug[(V0 + G8) * C + t], Ug[(V0 + G8) * C + t + 1] = au[n][:, 0], au[n][:, 1]
                Ug[(V0 + G8 + 8) * C + t], Ug[(V0 + G8 + 8) * C + t + 1] = au[n][:, 2], au[n][:, 3]
    Wh, Wl = np.full(C * D, np.nan), np.full(C * D, np.nan)
    for warp in range(D // 16):
        r, cb = warp & 3, 64 * (warp >> 2)
        acc = np.zeros((8, 32, 4))
        for kk in range(r + 1):
            ah, al = ldsm(Ah, a_tile(16 * r, 16 * kk, LDB)), ldsm(Al, a_tile(16 * r, 16 * kk, LDB))
            for np_ in range(4):
                b = ldsm(WB, b_pair_trans(16 * kk, cb + 16 * np_, LDI), trans=True)
                for a in (ah, al):
                    mma(acc[2 * np_], a, b[:, 0], b[:, 1])
                    mma(acc[2 * np_ + 1], a, b[:, 2], b[:, 3])
        for j in range(8):
            for h in range(2):
                t, c = 16 * r + G8 + 8 * h, cb + 8 * j + 2 * Q4
                hi, lo = split_pack(acc[j][:, 2 * h], acc[j][:, 2 * h + 1])
                Wh[t * D + c], Wh[t * D + c + 1] = hi[:, 0], hi[:, 1]
                Wl[t * D + c], Wl[t * D + c + 1] = lo[:, 0], lo[:, 1]
    assert not np.isnan(Ug).any() and not np.isnan(Wh).any()

    # kernel 2: every row tile, two warps each
    Sg, VNg = np.full(D * D, np.nan), np.full(D * C, np.nan)
    S1 = np.full((D, D), np.nan)
    Whf, Wlf = copy_matrix(Wh, C, D, LDI), copy_matrix(Wl, C, D, LDI)
    sD = sc[2 * C:] if kda else None
    for tile in range(D // R):
        Us = pad(Ug.reshape(D, C)[R * tile:R * tile + R], LDU)
        for warp in range(R // 16):
            V0 = R * tile + 16 * warp
            S = [lanes_of(S0.astype(np.float64), V0, 8 * j) for j in range(D // 8)]
            Sa = []
            for kk in range(D // 16):
                a = np.stack([pack(S[2 * kk][:, 0], S[2 * kk][:, 1]), pack(S[2 * kk][:, 2], S[2 * kk][:, 3]),
                              pack(S[2 * kk + 1][:, 0], S[2 * kk + 1][:, 1]),
                              pack(S[2 * kk + 1][:, 2], S[2 * kk + 1][:, 3])], 1)
                Sa.append(a)
                c = 16 * kk + 2 * Q4
                for (row, col, i) in ((0, 0, 0), (8, 0, 1), (0, 8, 2), (8, 8, 3)):
                    e = (V0 + G8 + row) * D + c + col
                    Sg[e], Sg[e + 1] = a[:, i, 0], a[:, i, 1]
            Ud = [None] * 4
            vl = 16 * warp + G8
            for jp in range(4):
                ak = np.zeros((2, 32, 4))
                for kk in range(D // 16):
                    bh, bl = ldsm(Whf, b_pair(16 * jp, 16 * kk, LDI)), ldsm(Wlf, b_pair(16 * jp, 16 * kk, LDI))
                    mma(ak[0], Sa[kk], bh[:, 0], bh[:, 1])
                    mma(ak[1], Sa[kk], bh[:, 2], bh[:, 3])
                    mma(ak[0], Sa[kk], bl[:, 0], bl[:, 1])
                    mma(ak[1], Sa[kk], bl[:, 2], bl[:, 3])
                regs = [None] * 4
                for jj in range(2):
                    t = 8 * (2 * jp + jj) + 2 * Q4
                    x0, x1 = Us[vl * LDU + t] - ak[jj][:, 0], Us[vl * LDU + t + 1] - ak[jj][:, 1]
                    y0, y1 = Us[(vl + 8) * LDU + t] - ak[jj][:, 2], Us[(vl + 8) * LDU + t + 1] - ak[jj][:, 3]
                    px, py = pack(x0, x1), pack(y0, y1)
                    VNg[(V0 + G8) * C + t], VNg[(V0 + G8) * C + t + 1] = px[:, 0], px[:, 1]
                    VNg[(V0 + G8 + 8) * C + t], VNg[(V0 + G8 + 8) * C + t + 1] = py[:, 0], py[:, 1]
                    if kda:
                        regs[2 * jj], regs[2 * jj + 1] = pack(x0, x1), pack(y0, y1)
                    else:
                        d0, d1 = df[t], df[t + 1]
                        regs[2 * jj], regs[2 * jj + 1] = pack(x0 * d0, x1 * d1), pack(y0 * d0, y1 * d1)
                Ud[jp] = np.stack(regs, 1)
            if kda:  # per column: c = 8 j + 2 q (+1)
                for j in range(D // 8):
                    c = 8 * j + 2 * Q4
                    S[j] = S[j] * np.stack([sD[c], sD[c + 1], sD[c], sD[c + 1]], 1)
            else:
                S = [s * dec for s in S]
            for kk in range(4):
                for np_ in range(D // 16):
                    bk = ldsm(Kup, b_pair_trans(16 * kk, 16 * np_, LDI), trans=True)
                    mma(S[2 * np_], Ud[kk], bk[:, 0], bk[:, 1])
                    mma(S[2 * np_ + 1], Ud[kk], bk[:, 2], bk[:, 3])
            for j in range(D // 8):  # store_state_rows
                for h in range(2):
                    S1[V0 + G8 + 8 * h, 8 * j + 2 * Q4] = S[j][:, 2 * h]
                    S1[V0 + G8 + 8 * h, 8 * j + 2 * Q4 + 1] = S[j][:, 2 * h + 1]
    assert not np.isnan(Sg).any() and not np.isnan(VNg).any() and not np.isnan(S1).any()

    # kernel 3
    Os = np.full((C, D), np.nan)
    for warp in range(D // 16):
        V0 = 16 * warp
        Sa = []
        for kk in range(D // 16):
            c = 16 * kk + 2 * Q4
            Sa.append(np.stack([np.stack([Sg[e], Sg[e + 1]], -1) for e in (
                (V0 + G8) * D + c, (V0 + G8 + 8) * D + c, (V0 + G8) * D + c + 8, (V0 + G8 + 8) * D + c + 8)], 1))
        ao = np.zeros((8, 32, 4))
        for kk in range(D // 16):
            for jp in range(4):
                b = ldsm(Qs3, b_pair(16 * jp, 16 * kk, LDI))
                mma(ao[2 * jp], Sa[kk], b[:, 0], b[:, 1])
                mma(ao[2 * jp + 1], Sa[kk], b[:, 2], b[:, 3])
        if not kda:
            for j in range(8):
                t = 8 * j + 2 * Q4
                ao[j][:, 0] *= qf[t]
                ao[j][:, 1] *= qf[t + 1]
                ao[j][:, 2] *= qf[t]
                ao[j][:, 3] *= qf[t + 1]
        Ua = []
        for kk in range(4):
            t = 16 * kk + 2 * Q4
            Ua.append(np.stack([np.stack([VNg[e], VNg[e + 1]], -1) for e in (
                (V0 + G8) * C + t, (V0 + G8 + 8) * C + t, (V0 + G8) * C + t + 8, (V0 + G8 + 8) * C + t + 8)], 1))
        for jp in range(4):
            for kk in range(jp + 1):
                b = ldsm(Pb3, b_pair(16 * jp, 16 * kk, LDB))
                mma(ao[2 * jp], Ua[kk], b[:, 0], b[:, 1])
                mma(ao[2 * jp + 1], Ua[kk], b[:, 2], b[:, 3])
        for j in range(8):
            for e in range(2):
                t = 8 * j + 2 * Q4 + e
                Os[t, V0 + G8] = ao[j][:, e]
                Os[t, V0 + G8 + 8] = ao[j][:, 2 + e]
    return Os, S1, Ug.reshape(D, C).T, (Wh + Wl).reshape(C, D)


def rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def chunk(kda=False, cv=50, seed=7):
    """One chunk against the chunk algebra in fp64 (per-channel decays for KDA)."""
    rng = np.random.default_rng(seed)
    scale = D ** -0.5
    q, k, v = (np.zeros((C, D), f32) for _ in range(3))
    q[:cv] = bf16_input(rng.standard_normal((cv, D)))
    k[:cv] = bf16_input(rng.standard_normal((cv, D)))
    v[:cv] = bf16_input(rng.uniform(-.5, .5, (cv, D)))
    beta = np.zeros(C, f32)
    beta[:cv] = rng.uniform(0.05, .95, cv)
    S0 = rng.uniform(-.3, .3, (D, D)).astype(f32)
    gw = (C, D) if kda else C
    g = np.zeros(gw, f32)
    g[:cv] = -rng.uniform(0, 1.5 if kda else 0.3, (cv, D) if kda else cv)
    G = np.cumsum(g, 0).astype(f32)
    valid = np.arange(C) < cv
    rk = np.where(valid, 1 / np.sqrt((k.astype(np.float64) ** 2).sum(1) + 1e-6), 0)
    rq = np.where(valid, scale / np.sqrt((q.astype(np.float64) ** 2).sum(1) + 1e-6), 0)
    kh, qh = k * rk[:, None], q * rq[:, None]
    Gd = G.astype(np.float64).reshape(C, -1)  # [t][1 or D]
    E3 = np.exp(np.minimum(Gd[:, None, :] - Gd[None, :, :], 0))  # [t][s][1 or D]
    A = np.tril(beta[:, None] * np.einsum("tc,sc,tsc->ts", kh, kh, np.broadcast_to(E3, (C, C, D))), -1)
    P = np.tril(np.einsum("tc,sc,tsc->ts", qh, kh, np.broadcast_to(E3, (C, C, D))))
    T = np.linalg.inv(np.eye(C) + A)
    eG, eL = np.exp(Gd), np.exp(Gd[-1][None] - Gd)  # broadcast over channels
    W_ref = T @ (beta[:, None] * kh * eG)
    U_ref = T @ (beta[:, None] * v)
    vn_ref = U_ref - W_ref @ S0.T
    o_ref = (qh * eG) @ S0.T + P @ vn_ref
    S_ref = S0 * np.exp(Gd[-1])[None, :] + vn_ref.T @ (kh * eL)
    o, S1, U, W = kernels(kda, q, k, v, beta, G, S0, cv)
    return rel(o[:cv], o_ref[:cv]), rel(S1, S_ref), rel(U, U_ref), rel(W, W_ref)


def sequence(L_, lb=None, seed=1):
    """KDA over L_ tokens (several chunks, the kernels' state carried), with the in-kernel gate
    (softplus, or lower_bound's sigmoid) and beta as a logit, against the fp64 token recurrence;
    -> (output, final state) relative norm errors."""
    q, k, v, g, beta, S0, scale = et.sequence_inputs(L_, True, lb, seed, D)
    o_ref, S_ref = et.recurrence(q, k, v, g, beta, S0, scale)
    S, out = S0.astype(f32), np.zeros((L_, D))
    for c0 in range(0, L_, C):
        cv = min(C, L_ - c0)
        Q, K_, V_ = (np.zeros((C, D), f32) for _ in range(3))
        Q[:cv], K_[:cv], V_[:cv] = q[c0:c0 + cv], k[c0:c0 + cv], v[c0:c0 + cv]
        gg = np.zeros((C, D), f32)
        gg[:cv] = g[c0:c0 + cv]
        be = np.zeros(C, f32)
        be[:cv] = beta[c0:c0 + cv]
        o, S, _, _ = kernels(True, Q, K_, V_, be, np.cumsum(gg, 0, dtype=f32), S, cv)
        out[c0:c0 + cv] = o[:cv]
    return rel(out, o_ref), rel(S, S_ref)


def set_head_size(d):
    global D, LDI
    D, LDI = d, d + 8


if __name__ == "__main__":
    check_slots()
    for d, kda in ((128, False), (128, True), (64, False), (64, True)):
        set_head_size(d)
        name = ("KDA" if kda else "GDN") + f" D={d}"
        et.EXACT = True
        eo, es, eu, ew = chunk(kda)
        print(f"2. {name} chunk, rounding off: out {eo:.1e} state {es:.1e} U {eu:.1e} W {ew:.1e}")
        assert max(eo, es, eu, ew) < 1e-6, "the transcription does not match the algebra"
        et.EXACT = False
        eo, es, eu, ew = chunk(kda)
        print(f"   {name} chunk, bf16 operands: out {eo:.2e} state {es:.2e} U {eu:.2e} W {ew:.2e}")
    set_head_size(128)
    for kw in (dict(L_=400), dict(lb=-5.0, L_=400, seed=3), dict(L_=130, seed=4)):
        for exact in (True, False):
            et.EXACT = exact
            eo, es = sequence(**kw)
            print(f"3. KDA {kw}, rounding {'off' if exact else 'on'}: out {eo:.2e} state {es:.2e}")
            if exact:
                assert max(eo, es) < 1e-5, "the kernels' chunk chain does not match the recurrence"
