"""No-GPU checks of chunk_prefill_tc_kernel (src/cuda/chunk_prefill/tc_kernel.cuh), with numpy.

    python3 tests/gpu/emulate_tc_kernel.py          # all checks, about a minute

1. ldmatrix / mma.m16n8k16 fragment semantics (PTX ISA), emulated per lane, against the address
   helpers of src/cuda/chunk_prefill/mma.cuh (a_tile, b_pair, b_pair_trans, c_pair_trans) and the
   accumulator-to-A-fragment packing.
2. One chunk of the kernel (K = V = 128, a partial chunk of 50 tokens, GDN and KDA), transcribed
   lane by lane from the kernel (K K^T / Q K^T strips or KDA's factored pairwise tiles, the blocked inverse
   as written, the split Y / Tb products, the output staging, the state update), against the
   chunk algebra of src/cpu/chunk_prefill.cpp in fp64. With bf16 rounding off it must agree to
   fp32 (~1e-7): that checks every fragment index of the transcription.
3. The kernel's arithmetic over whole sequences (bf16 rounding at the kernel's points) against an
   fp64 token recurrence: the error estimate behind tests/gpu/test_chunk_prefill_gpu.cpp's bounds.
A change to the kernel's fragment code should be mirrored here and checked before it goes to a GPU.
"""

import numpy as np

f32 = np.float32
EXACT = False  # section 2 runs both ways


def bf16(x):
    """x rounded to bf16 (round to nearest even), as float32; identity when EXACT."""
    x = np.asarray(x, np.float32)
    if EXACT:
        return x
    u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def bf16_input(x):  # inputs are bf16 in both modes
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


# ---- lanes, ldmatrix, mma ------------------------------------------------------------------------
L = np.arange(32)
G8, Q4 = L >> 2, L & 3


def a_tile(r0, c0, ld): return (r0 + (L & 7) + ((L >> 3) & 1) * 8) * ld + c0 + (L >> 4) * 8
def b_pair(r0, c0, ld): return (r0 + (L & 7) + (L >> 4) * 8) * ld + c0 + ((L >> 3) & 1) * 8
def b_pair_trans(r0, c0, ld): return (r0 + (L & 7) + ((L >> 3) & 1) * 8) * ld + c0 + (L >> 4) * 8
def c_pair_trans(r0, c0, ld): return (r0 + (L & 7) + (L >> 4) * 8) * ld + c0 + ((L >> 3) & 1) * 8


def ldsm(flat, addr, trans=False):
    """ldmatrix.x4: lanes 8i..8i+7 address matrix i's rows; -> registers [lane][4][2]."""
    out = np.zeros((32, 4, 2), np.float64)
    for i in range(4):
        M = np.stack([flat[addr[8 * i + r]: addr[8 * i + r] + 8] for r in range(8)])
        if trans:
            M = M.T
        out[:, i, 0], out[:, i, 1] = M[G8, 2 * Q4], M[G8, 2 * Q4 + 1]
    return out


def A_of(a):
    A = np.zeros((16, 16))
    c = 2 * Q4[:, None] + [0, 1]
    A[G8[:, None], c], A[G8[:, None] + 8, c] = a[:, 0], a[:, 1]
    A[G8[:, None], c + 8], A[G8[:, None] + 8, c + 8] = a[:, 2], a[:, 3]
    return A


def B_of(b0, b1):
    B = np.zeros((16, 8))
    r = 2 * Q4[:, None] + [0, 1]
    B[r, G8[:, None]], B[r + 8, G8[:, None]] = b0, b1
    return B


def C_of(c):  # accumulators [lane][4] -> 16x8
    M = np.zeros((16, 8))
    M[G8, 2 * Q4], M[G8, 2 * Q4 + 1], M[G8 + 8, 2 * Q4], M[G8 + 8, 2 * Q4 + 1] = c.T
    return M


def mma(d, a, b0, b1):
    P = A_of(a) @ B_of(b0, b1)
    d[:, 0] += P[G8, 2 * Q4]
    d[:, 1] += P[G8, 2 * Q4 + 1]
    d[:, 2] += P[G8 + 8, 2 * Q4]
    d[:, 3] += P[G8 + 8, 2 * Q4 + 1]


def pack(lo, hi):
    return np.stack([bf16(lo), bf16(hi)], -1).astype(np.float64)


def split_pack(x, y):
    h = pack(x, y)
    return h, pack(x - h[:, 0], y - h[:, 1])


# ---- 1. fragments --------------------------------------------------------------------------------
def check_fragments():
    rng = np.random.default_rng(0)
    ld = 136
    X = rng.standard_normal((64, ld))
    fl = X.reshape(-1)
    for r0, c0 in [(0, 0), (16, 32), (48, 112)]:
        assert np.array_equal(A_of(ldsm(fl, a_tile(r0, c0, ld))), X[r0:r0 + 16, c0:c0 + 16])
        b = ldsm(fl, b_pair(r0, c0, ld))
        assert np.array_equal(B_of(b[:, 0], b[:, 1]), X[r0:r0 + 8, c0:c0 + 16].T)
        assert np.array_equal(B_of(b[:, 2], b[:, 3]), X[r0 + 8:r0 + 16, c0:c0 + 16].T)
        b = ldsm(fl, b_pair_trans(r0, c0, ld), trans=True)
        assert np.array_equal(B_of(b[:, 0], b[:, 1]), X[r0:r0 + 16, c0:c0 + 8])
        assert np.array_equal(B_of(b[:, 2], b[:, 3]), X[r0:r0 + 16, c0 + 8:c0 + 16])
        c = ldsm(fl, c_pair_trans(r0, c0, ld), trans=True)
        for tile, (i0, i1) in enumerate([(0, 1), (2, 3)]):
            want = X[r0 + 8 * tile:r0 + 8 * tile + 8, c0:c0 + 16].T
            acc = np.stack([c[:, i0, 0], c[:, i0, 1], c[:, i1, 0], c[:, i1, 1]], 1)
            assert np.array_equal(C_of(acc), want)
    Cl, Cr = rng.standard_normal((16, 8)), rng.standard_normal((16, 8))

    def lanes(M):
        return np.stack([M[G8, 2 * Q4], M[G8, 2 * Q4 + 1], M[G8 + 8, 2 * Q4], M[G8 + 8, 2 * Q4 + 1]], 1)
    l, r = lanes(Cl), lanes(Cr)
    a = np.stack([l[:, 0:2], l[:, 2:4], r[:, 0:2], r[:, 2:4]], 1)
    assert np.array_equal(A_of(a), np.hstack([Cl, Cr]))
    print("1. fragment helpers and C->A packing: ok")


# ---- 2. one chunk, lane by lane --------------------------------------------------------------------
D, C, NW = 128, 64, 8
LDI, LDT, LDB, LDO, LDX = D + 8, C + 4, C + 8, D + 4, 36


def invert(Tf):
    """invert_unit_lower as written (fp32)."""
    T2, X = Tf.copy(), np.zeros((32, LDX), f32)
    for b in range(4):
        for j in range(16):
            x = np.zeros(16, f32)
            for i in range(16):
                acc = f32(1.0 if i == j else 0.0)
                for l_ in range(i):
                    acc = f32(acc - T2[16 * b + i, 16 * b + l_] * x[l_])
                x[i] = acc
            T2[16 * b:16 * b + 16, 16 * b + j] = x
    for it in range(128):
        blk, r, c = it >> 6, (it >> 2) & 15, (it & 3) * 4
        X[16 * blk + r, c:c + 4] = (T2[16 + 32 * blk + r, 32 * blk:32 * blk + 16]
                                    @ T2[32 * blk:32 * blk + 16, 32 * blk + c:32 * blk + c + 4])
    for it in range(128):
        blk, r, c = it >> 6, (it >> 2) & 15, (it & 3) * 4
        T2[16 + 32 * blk + r, 32 * blk + c:32 * blk + c + 4] = -(
            T2[16 + 32 * blk + r, 16 + 32 * blk:32 + 32 * blk] @ X[16 * blk:16 * blk + 16, c:c + 4])
    for it in range(256):
        r, c = it >> 3, (it & 7) * 4
        X[r, c:c + 4] = T2[32 + r, 0:32] @ T2[0:32, c:c + 4]
    for it in range(256):
        r, c = it >> 3, (it & 7) * 4
        T2[32 + r, c:c + 4] = -(T2[32 + r, 32:64] @ X[0:32, c:c + 4])
    return T2


def kda_pairs(G, KT, QT, beta, Tf, Pb):
    """kda_pairs of tc_kernel.cuh (shared by the split kernels' intra-chunk kernel): the decayed
    K K^T and Q K^T over the 136 4x4 tiles of the lower triangle, fp32 sums, written into Tf
    [C][LDT] (beta * k k^T, strictly lower) and Pb [C][LDB] (q k^T, lower, bf16), their upper
    tiles zeroed; the padding columns are left as they were."""
    for item in range(136):  # off-diagonal tiles 0..119, diagonal 120..135
        diagonal = item >= 120
        if diagonal:
            tb = sb = item - 120
        else:
            tb = 1
            while (tb + 1) * tb // 2 <= item:
                tb += 1
            sb = item - tb * (tb - 1) // 2
        t0, s0 = 4 * tb, 4 * sb
        ti, si = t0 + np.arange(4)[:, None], s0 + np.arange(4)[None, :]
        gt, gs = G.T[:, t0:t0 + 4], G.T[:, s0:s0 + 4]  # [c][4]
        if diagonal:
            e = np.where((si <= ti)[None], np.exp(gt[:, :, None] - gs[:, None, :]), 0)
        else:  # e^{G_t - G_t0} e^{G_t0 - G_s3} e^{G_s3 - G_s}, each factor <= 1
            ea = np.exp(gt - gt[:, :1])
            eb = np.exp(gt[:, :1] - gs[:, 3:]) * np.exp(gs[:, 3:] - gs)
            e = ea[:, :, None] * eb[:, None, :]
        e = e.astype(f32)
        kk = np.einsum("ci,cj,cij->ij", KT[:, t0:t0 + 4], KT[:, s0:s0 + 4], e).astype(f32)
        qk = np.einsum("ci,cj,cij->ij", QT[:, t0:t0 + 4], KT[:, s0:s0 + 4], e).astype(f32)
        Tf[t0:t0 + 4, s0:s0 + 4] = np.where(si < ti, beta[t0:t0 + 4, None] * kk, 0)
        Pb[t0:t0 + 4, s0:s0 + 4] = bf16(np.where(si <= ti, qk, 0))
        if not diagonal:
            Tf[s0:s0 + 4, t0:t0 + 4] = 0
            Pb[s0:s0 + 4, t0:t0 + 4] = 0


def chunk(kda, cv=50, seed=7):
    """Runs one chunk as the kernel does; returns (out, state) errors against fp64 algebra."""
    rng = np.random.default_rng(seed)
    scale = D ** -0.5
    q, k, v = (np.zeros((C, D), f32) for _ in range(3))
    q[:cv] = bf16_input(rng.standard_normal((cv, D)))
    k[:cv] = bf16_input(rng.standard_normal((cv, D)))
    v[:cv] = bf16_input(rng.uniform(-.5, .5, (cv, D)))
    beta = np.zeros(C, f32)
    beta[:cv] = rng.uniform(0.05, .95, cv)
    S0 = rng.uniform(-.3, .3, (D, D)).astype(f32)
    gw = D if kda else 1
    g = np.zeros((C, gw), f32)
    g[:cv] = -rng.uniform(0, 1.5 if kda else 0.3, (cv, gw))
    G = np.cumsum(g, 0).astype(f32)  # [t][gw]
    valid = np.arange(C) < cv
    rk = np.where(valid, 1 / np.sqrt((k ** 2).sum(1) + 1e-6), 0).astype(f32)
    rq = np.where(valid, scale / np.sqrt((q ** 2).sum(1) + 1e-6), 0).astype(f32)
    pad = lambda M: np.pad(M, ((0, 0), (0, LDI - D))).reshape(-1)  # noqa: E731
    Qf, Kf, Vf = pad(q), pad(k), pad(v)
    kh, qh = (k * rk[:, None]).astype(np.float64), (q * rq[:, None]).astype(np.float64)
    E3 = np.exp(G[:, None, :] - G[None, :, :]) * (np.arange(C)[:, None, None] >= np.arange(C)[None, :, None])
    A_true = np.tril(beta[:, None] * np.einsum("tc,sc,tsc->ts", kh, kh, np.broadcast_to(E3, (C, C, D))), -1)
    P_true = np.einsum("tc,sc,tsc->ts", qh, kh, np.broadcast_to(E3, (C, C, D)))
    Tf = np.full((C, LDT), np.nan, f32)
    Pb = np.full((C, LDB), np.nan, f32)
    if not kda:
        G1 = G[:, 0]
        sKf, sQf, sDf, decL = rk * np.exp(G1), rq * np.exp(G1), rk * np.exp(G1[-1] - G1), np.exp(G1[-1])
        for job in range(8):  # the strips
            is_p, r = job >= 4, job & 3
            acc = np.zeros((8, 32, 4))
            for kk in range(D // 16):
                a = ldsm(Qf if is_p else Kf, a_tile(16 * r, 16 * kk, LDI))
                for jp in range(r + 1):
                    b = ldsm(Kf, b_pair(16 * jp, 16 * kk, LDI))
                    mma(acc[2 * jp], a, b[:, 0], b[:, 1])
                    mma(acc[2 * jp + 1], a, b[:, 2], b[:, 3])
            for j in range(8):
                for h in range(2):
                    t, sc = 16 * r + G8 + 8 * h, 8 * j + 2 * Q4
                    out = []
                    for e in range(2):
                        sj = sc + e
                        lower = (sj <= t) if is_p else (sj < t)
                        f = rq[t] * rk[sj] if is_p else beta[t] * rk[t] * rk[sj]
                        dec = np.exp(np.where(lower, G1[t] - G1[sj], 0))
                        out.append(np.where(lower & (j < 2 * (r + 1)), f * dec * acc[j][:, 2 * h + e], 0))
                    if is_p:
                        pk = pack(out[0], out[1])
                        Pb[t, sc], Pb[t, sc + 1] = pk[:, 0], pk[:, 1]
                    else:
                        Tf[t, sc], Tf[t, sc + 1] = out[0], out[1]
        Kx = Kf
    else:
        sKf = sQf = sDf = np.ones(C, f32)
        decL = np.exp(G[-1])
        KT, QT = (k * rk[:, None]).T, (q * rq[:, None]).T
        kda_pairs(G, KT, QT, beta, Tf, Pb)
        Kf = pad(bf16(k * rk[:, None] * np.exp(G)))       # k^ e^G in place of k
        Qf = pad(bf16(q * rq[:, None] * np.exp(G)))       # q^ e^G in place of q
        Kx = pad(bf16(k * rk[:, None] * np.exp(G[-1][None] - G)))
    assert not np.isnan(Tf[:, :C]).any() and not np.isnan(Pb[:, :C]).any(), "unwritten A/P entries"
    assert np.abs(Tf[:, :C] - A_true).max() < 1e-5, "A"
    T2 = invert(Tf)
    T_true = np.linalg.inv(np.eye(C) + A_true)
    assert np.abs(np.tril(T2[:, :C]) - T_true).max() < 1e-4 and not np.triu(T2[:, :C], 1).any(), "T"
    x = np.where(np.tril(np.ones((C, C))) > 0, T2[:, :C] * beta[None], 0).astype(f32)
    Tb = np.pad(bf16(x), ((0, 0), (0, LDB - C)))
    Tl = np.pad(bf16(x - bf16(x)), ((0, 0), (0, LDB - C)))
    Tbf, Tlf, Pbf = Tb.reshape(-1), Tl.reshape(-1), Pb.reshape(-1)
    Os = np.zeros((C, LDO))
    S_new = np.zeros((D, D))
    for w in range(NW):
        V0 = 16 * w
        S = np.zeros((16, 32, 4))
        for j in range(16):
            for h in range(2):
                S[j][:, 2 * h] = S0[V0 + G8 + 8 * h, 8 * j + 2 * Q4]
                S[j][:, 2 * h + 1] = S0[V0 + G8 + 8 * h, 8 * j + 2 * Q4 + 1]
        Sa = [np.stack([pack(S[2 * kk][:, 0], S[2 * kk][:, 1]), pack(S[2 * kk][:, 2], S[2 * kk][:, 3]),
                        pack(S[2 * kk + 1][:, 0], S[2 * kk + 1][:, 1]),
                        pack(S[2 * kk + 1][:, 2], S[2 * kk + 1][:, 3])], 1) for kk in range(8)]
        Yh, Yl = np.zeros((4, 32, 4, 2)), np.zeros((4, 32, 4, 2))
        for jp in range(4):
            ak = np.zeros((2, 32, 4))
            for kk in range(8):
                b = ldsm(Kf, b_pair(16 * jp, 16 * kk, LDI))
                mma(ak[0], Sa[kk], b[:, 0], b[:, 1])
                mma(ak[1], Sa[kk], b[:, 2], b[:, 3])
            vv = ldsm(Vf, c_pair_trans(16 * jp, V0, LDI), trans=True)
            for jj in range(2):
                t = 8 * (2 * jp + jj) + 2 * Q4
                lo, hi = vv[:, 2 * jj], vv[:, 2 * jj + 1]
                Yh[jp][:, 2 * jj], Yl[jp][:, 2 * jj] = split_pack(
                    lo[:, 0] - sKf[t] * ak[jj][:, 0], lo[:, 1] - sKf[t + 1] * ak[jj][:, 1])
                Yh[jp][:, 2 * jj + 1], Yl[jp][:, 2 * jj + 1] = split_pack(
                    hi[:, 0] - sKf[t] * ak[jj][:, 2], hi[:, 1] - sKf[t + 1] * ak[jj][:, 3])
        ao = np.zeros((8, 32, 4))
        for kk in range(8):
            for jp in range(4):
                b = ldsm(Qf, b_pair(16 * jp, 16 * kk, LDI))
                mma(ao[2 * jp], Sa[kk], b[:, 0], b[:, 1])
                mma(ao[2 * jp + 1], Sa[kk], b[:, 2], b[:, 3])
        for j in range(8):
            for e in range(2):
                t = 8 * j + 2 * Q4 + e
                Os[t, V0 + G8] = sQf[t] * ao[j][:, e]
                Os[t, V0 + G8 + 8] = sQf[t] * ao[j][:, 2 + e]
        Ua, Ud, ao = np.zeros((4, 32, 4, 2)), np.zeros((4, 32, 4, 2)), np.zeros((8, 32, 4))
        for jp in range(4):
            au = np.zeros((2, 32, 4))
            for kk in range(jp + 1):
                bh, bl = ldsm(Tbf, b_pair(16 * jp, 16 * kk, LDB)), ldsm(Tlf, b_pair(16 * jp, 16 * kk, LDB))
                for n in range(2):
                    mma(au[n], Yh[kk], bh[:, 2 * n], bh[:, 2 * n + 1])
                    mma(au[n], Yh[kk], bl[:, 2 * n], bl[:, 2 * n + 1])
                    mma(au[n], Yl[kk], bh[:, 2 * n], bh[:, 2 * n + 1])
            for jj in range(2):
                t = 8 * (2 * jp + jj) + 2 * Q4
                Ua[jp][:, 2 * jj] = pack(au[jj][:, 0], au[jj][:, 1])
                Ua[jp][:, 2 * jj + 1] = pack(au[jj][:, 2], au[jj][:, 3])
                Ud[jp][:, 2 * jj] = pack(au[jj][:, 0] * sDf[t], au[jj][:, 1] * sDf[t + 1])
                Ud[jp][:, 2 * jj + 1] = pack(au[jj][:, 2] * sDf[t], au[jj][:, 3] * sDf[t + 1])
        for jp in range(4):
            for kk in range(jp + 1):
                b = ldsm(Pbf, b_pair(16 * jp, 16 * kk, LDB))
                mma(ao[2 * jp], Ua[kk], b[:, 0], b[:, 1])
                mma(ao[2 * jp + 1], Ua[kk], b[:, 2], b[:, 3])
        for j in range(8):
            for e in range(2):
                t = 8 * j + 2 * Q4 + e
                Os[t, V0 + G8] += ao[j][:, e]
                Os[t, V0 + G8 + 8] += ao[j][:, 2 + e]
        cc = 8 * np.arange(16)[:, None] + 2 * Q4[None]
        dl = np.broadcast_to(decL, (D,)) if not kda else decL
        S[:, :, 0] *= dl[cc]
        S[:, :, 1] *= dl[cc + 1]
        S[:, :, 2] *= dl[cc]
        S[:, :, 3] *= dl[cc + 1]
        for kk in range(4):
            for n_ in range(8):
                b = ldsm(Kx, b_pair_trans(16 * kk, 16 * n_, LDI), trans=True)
                mma(S[2 * n_], Ud[kk], b[:, 0], b[:, 1])
                mma(S[2 * n_ + 1], Ud[kk], b[:, 2], b[:, 3])
        for j in range(16):
            for h in range(2):
                S_new[V0 + G8 + 8 * h, 8 * j + 2 * Q4] = S[j][:, 2 * h]
                S_new[V0 + G8 + 8 * h, 8 * j + 2 * Q4 + 1] = S[j][:, 2 * h + 1]
    eG = np.exp(G.astype(np.float64))  # [t][gw], broadcast over channels
    U = T_true @ (beta[:, None] * v - beta[:, None] * (kh * eG) @ S0.T.astype(np.float64))
    o_ref = (qh * eG) @ S0.T + P_true @ U
    S_ref = S0 * np.exp(G[-1])[None, :] + U.T @ (kh * np.exp(G[-1][None] - G))
    eo = np.linalg.norm(Os[:cv, :D] - o_ref[:cv]) / np.linalg.norm(o_ref[:cv])
    es = np.linalg.norm(S_new - S_ref) / np.linalg.norm(S_ref)
    return eo, es


# ---- 3. whole sequences --------------------------------------------------------------------------
def softplus(x):
    return np.where(x <= 20, np.log1p(np.exp(np.minimum(x, 20))), x)


def sequence_inputs(L_, kda, lb, seed, d=None):
    """Random inputs over L_ tokens at head size d (default D): bf16 q, k, v; the in-kernel gate
    (softplus, or lower_bound's sigmoid) per token (GDN) or per channel (KDA); beta from a logit;
    a random state; the scale."""
    d = d or D
    rng = np.random.default_rng(seed)
    q, k = bf16_input(rng.standard_normal((L_, d))), bf16_input(rng.standard_normal((L_, d)))
    v = bf16_input(rng.uniform(-0.5, 0.5, (L_, d)))
    A_log = rng.uniform(-8, 0.5)
    gw = d if kda else 1
    a = bf16_input(rng.normal(0, 1.5, (L_, gw)))
    dt = rng.uniform(-1, 1, gw)
    g = (-np.exp(A_log) * softplus(a + dt) if lb is None
         else lb / (1 + np.exp(-np.exp(A_log) * (a + dt)))).astype(f32)
    beta = (1 / (1 + np.exp(-bf16_input(rng.normal(0, 1.5, L_))))).astype(f32)
    return q, k, v, g, beta, rng.uniform(-0.3, 0.3, (d, d)), d ** -0.5


def recurrence(q, k, v, g, beta, S0, scale):
    """The fp64 token recurrence (q, k L2-normalized): -> (outputs, final state)."""
    qh = q / np.sqrt((q.astype(np.float64) ** 2).sum(1, keepdims=True) + 1e-6) * scale
    kh = k / np.sqrt((k.astype(np.float64) ** 2).sum(1, keepdims=True) + 1e-6)
    S, o = S0.copy(), np.zeros(v.shape)
    for t in range(len(q)):
        S = S * np.exp(g[t].astype(np.float64))[None, :]
        S = S + np.outer(beta[t] * (v[t] - S @ kh[t]), kh[t])
        o[t] = S @ qh[t]
    return o, S


def sequence(L_, kda=False, lb=None, seed=1, inputs=None):
    """The kernel's arithmetic (bf16 at its rounding points) over L_ tokens, from a random state,
    against the fp64 recurrence; returns the (output, final state) relative norm errors. inputs:
    (q, k, v, g, beta, S0, scale) in place of sequence_inputs' draw (other gates)."""
    if inputs is None:
        inputs = sequence_inputs(L_, kda, lb, seed)
    q, k, v, g, beta, S0, scale = inputs
    gw = g.shape[1]
    o_ref, S_ref = recurrence(q, k, v, g, beta, S0, scale)
    S, out = S0.astype(f32), np.zeros((L_, D))
    for c0 in range(0, L_, C):
        cv = min(C, L_ - c0)
        Q, K_, V_ = (np.zeros((C, D), f32) for _ in range(3))
        Q[:cv], K_[:cv], V_[:cv] = q[c0:c0 + cv], k[c0:c0 + cv], v[c0:c0 + cv]
        gg = np.zeros((C, gw), f32)
        gg[:cv] = g[c0:c0 + cv]
        G = np.cumsum(gg, 0, dtype=f32)
        be = np.zeros(C, f32)
        be[:cv] = beta[c0:c0 + cv]
        rk, rq = np.zeros(C, f32), np.zeros(C, f32)
        rk[:cv] = 1 / np.sqrt((K_[:cv] ** 2).sum(1) + 1e-6)
        rq[:cv] = scale / np.sqrt((Q[:cv] ** 2).sum(1) + 1e-6)
        kh_, qh_ = K_ * rk[:, None], Q * rq[:, None]
        E3 = np.exp(np.minimum(G[:, None, :] - G[None, :, :], 0)) * (np.arange(C)[:, None, None] >= np.arange(C)[None, :, None])
        E3 = np.broadcast_to(E3, (C, C, D))
        Am = np.tril(be[:, None] * np.einsum("tc,sc,tsc->ts", kh_, kh_, E3), -1)
        P = bf16(np.einsum("tc,sc,tsc->ts", qh_, kh_, E3))
        T = np.linalg.inv(np.eye(C) + Am)
        x = (np.tril(T) * be[None, :]).astype(f32)
        Tb, Tl = bf16(x), bf16(x - bf16(x))
        Sb = bf16(S)
        if not kda:
            eG, eL = np.exp(G[:, 0]), np.exp(G[-1, 0] - G[:, 0])
            Y = V_.T - (Sb @ K_.T) * (rk * eG)[None, :]
            O1, Kx, d, dec = (Sb @ Q.T) * (rq * eG)[None, :], K_, rk * eL, np.exp(G[-1, 0])
        else:
            Y = V_.T - Sb @ bf16(kh_ * np.exp(G)).T
            O1, Kx = Sb @ bf16(qh_ * np.exp(G)).T, bf16(kh_ * np.exp(G[-1][None] - G))
            d, dec = np.ones(C), np.exp(G[-1])[None, :]
        Yh, Yl = bf16(Y), bf16(Y - bf16(Y))
        U = Yh @ Tb.T + Yh @ Tl.T + Yl @ Tb.T
        out[c0:c0 + cv] = (O1 + bf16(U) @ P.T).T[:cv]
        S = S * dec + bf16(U * d[None, :]) @ Kx
    return (np.linalg.norm(out - o_ref) / np.linalg.norm(o_ref),
            np.linalg.norm(S - S_ref) / np.linalg.norm(S_ref))


if __name__ == "__main__":
    check_fragments()
    for kda in (False, True):
        name = "KDA" if kda else "GDN"
        EXACT = True
        eo, es = chunk(kda)
        assert eo < 1e-6 and es < 1e-6, (name, eo, es)
        print(f"2. {name} chunk, rounding off: out {eo:.1e} state {es:.1e} (transcription exact)")
        EXACT = False
        eo, es = chunk(kda)
        print(f"   {name} chunk, bf16 operands: out {eo:.2e} state {es:.2e}")
    for kw in (dict(L_=300), dict(L_=1000, seed=2), dict(L_=65, seed=3), dict(kda=True, L_=400),
               dict(kda=True, lb=-5.0, L_=400, seed=3)):
        eo, es = sequence(**kw)
        print(f"3. {kw}: out {eo:.2e} state {es:.2e}")
