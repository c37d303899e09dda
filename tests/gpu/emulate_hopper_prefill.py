"""No-GPU check of the Hopper GDN prefill's arithmetic (src/cuda/chunk_prefill/hopper_prep.cuh,
hopper_scan.cuh), with numpy.

    python3 tests/gpu/emulate_hopper_prefill.py          # about ten seconds

1. One chunk with rounding off: the scan kernel's five products (X1 = S K^T, X2 = S Q^T,
   v'^T = V^T Tb^T - (a X1) Tb^T, o^T = b X2 + v'^T P^T, S = gamma S + (v'^T d) K) on the prep
   kernel's factors, against the chunk algebra of src/cpu/chunk_prefill.cpp in fp64, a partial
   chunk of 50 tokens: must agree to fp32 (~1e-7).
2. The kernels' arithmetic over whole sequences, bf16 at their rounding points (S, a X1, v',
   v' d, Tb, P) and the inverse's fp16 operands (invert_tc), against an fp64 token recurrence: the error behind the bounds of
   tests/gpu/test_chunk_prefill_gpu.cpp's Hopper cases (printed, and asserted below 4e-3).
3. The same with context parallelism: each segment's M (from I, v = 0) and N (from 0), the fp32
   chain of start states, then the segments (asserted below 4e-3 too).
The layouts the kernel's registers and shared-memory views rely on are CuTe's own; the GPU test
binary checks them on the host (tests/gpu/test_hopper_layouts.cu).
"""

import numpy as np

import emulate_tc_kernel as tc  # bf16 rounding (its EXACT switch), the inputs' rounding

f32 = np.float32
C, D = 64, 128
bf16, bf16_input = tc.bf16, tc.bf16_input


def fp16(x):
    """fp16 rounding (off with tc.EXACT)."""
    return x.astype(f32) if tc.EXACT else x.astype(np.float16).astype(f32)


def invert_tc(A):
    """src/cuda/chunk_prefill/tc_inverse.cuh: T = (I + A)^-1 with the 16x16 diagonal blocks in
    fp32 and the two levels of block products from fp16 operands (A, T's blocks, the first
    product of each level), accumulated in fp32."""
    blk = lambda i, j: (slice(16 * i, 16 * i + 16), slice(16 * j, 16 * j + 16))
    T, Th, Ah = np.zeros((C, C), f32), np.zeros((C, C), f32), fp16(A)
    for b in range(4):
        T[blk(b, b)] = np.linalg.inv(np.eye(16) + A[blk(b, b)]).astype(f32)
        Th[blk(b, b)] = fp16(T[blk(b, b)])
    for bi, bj in ((1, 0), (3, 2)):
        T[blk(bi, bj)] = -(fp16(Th[blk(bi, bi)] @ Ah[blk(bi, bj)]) @ Th[blk(bj, bj)])
        Th[blk(bi, bj)] = fp16(T[blk(bi, bj)])
    lo, hi = slice(0, 32), slice(32, 64)
    T[hi, lo] = -(fp16(Th[hi, hi] @ Ah[hi, lo]) @ Th[lo, lo])
    return T


def prep(Q, K_, g, be, cv, scale):
    """The prep kernel: Tb, P (rounded), a, b, d, gamma for one chunk (rows past cv: zeros)."""
    G = np.cumsum(g, dtype=f32)
    rk, rq = np.zeros(C, f32), np.zeros(C, f32)
    rk[:cv] = 1 / np.sqrt((K_[:cv].astype(f32) ** 2).sum(1) + 1e-6)
    rq[:cv] = scale / np.sqrt((Q[:cv].astype(f32) ** 2).sum(1) + 1e-6)
    low = np.arange(C)[:, None] >= np.arange(C)[None, :]
    E = np.where(low, np.exp(np.minimum(G[:, None] - G[None, :], 0)), 0)
    A = np.tril(be[:, None] * rk[:, None] * rk[None, :] * E * (K_ @ K_.T), -1)
    P = bf16((rq[:, None] * rk[None, :] * E * (Q @ K_.T)).astype(f32))
    T = invert_tc(A.astype(f32))
    Tb = bf16((np.tril(T) * be[None, :]).astype(f32))
    eG = np.exp(G)
    return Tb, P, rk * eG, rq * eG, rk * np.exp(G[-1] - G), np.exp(G[-1])


def scan_chunk(S, Q, K_, V_, Tb, P, a, b, d, gamma):
    """The scan kernel's products for one chunk: -> (o [C, V], next S)."""
    Sa = bf16(S)
    X1, X2 = Sa @ K_.T, Sa @ Q.T
    U = V_.T @ Tb.T + bf16(-a[None, :] * X1) @ Tb.T
    O = b[None, :] * X2 + bf16(U) @ P.T
    S = gamma * S + bf16(U * d[None, :]) @ K_
    return O.T, S


def chunk_algebra(S0, Q, K_, V_, g, be, cv, scale):
    """src/cpu/chunk_prefill.cpp's chunk in fp64 (w, u, v' form)."""
    q, k = Q[:cv].astype(np.float64), K_[:cv].astype(np.float64)
    q = q / np.sqrt((q ** 2).sum(1, keepdims=True) + 1e-6) * scale
    k = k / np.sqrt((k ** 2).sum(1, keepdims=True) + 1e-6)
    G = np.cumsum(g[:cv].astype(np.float64))
    Gm = np.where(np.arange(cv)[:, None] >= np.arange(cv)[None, :], np.exp(G[:, None] - G[None, :]), 0)
    A = np.tril(be[:cv, None] * Gm * (k @ k.T), -1)
    T = np.linalg.inv(np.eye(cv) + A)
    w = T @ (be[:cv, None] * k * np.exp(G)[:, None])
    u = T @ (be[:cv, None] * V_[:cv])
    vn = u - w @ S0.T
    o = (q * np.exp(G)[:, None]) @ S0.T + (Gm * (q @ k.T)) @ vn
    S = S0 * np.exp(G[-1]) + vn.T @ (k * np.exp(G[-1] - G)[:, None])
    return o, S


def one_chunk(cv=50, seed=7):
    rng = np.random.default_rng(seed)
    Q, K_, V_ = (np.zeros((C, D), f32) for _ in range(3))
    Q[:cv], K_[:cv] = bf16_input(rng.standard_normal((cv, D))), bf16_input(rng.standard_normal((cv, D)))
    V_[:cv] = bf16_input(rng.uniform(-0.5, 0.5, (cv, D)))
    g, be = np.zeros(C, f32), np.zeros(C, f32)
    g[:cv] = -rng.uniform(0, 0.2, cv)
    be[:cv] = rng.uniform(0.1, 0.9, cv)
    S0 = rng.uniform(-0.3, 0.3, (D, D)).astype(f32)
    o, S = scan_chunk(S0, Q, K_, V_, *prep(Q, K_, g, be, cv, D ** -0.5))
    o_ref, S_ref = chunk_algebra(S0.astype(np.float64), Q, K_, V_, g, be, cv, D ** -0.5)
    return (np.linalg.norm(o[:cv] - o_ref) / np.linalg.norm(o_ref),
            np.linalg.norm(S - S_ref) / np.linalg.norm(S_ref))


def sequence(L_, seed=1):
    """Both kernels' arithmetic over L_ tokens from a random state against the fp64 recurrence,
    on tests/gpu/emulate_tc_kernel.py's inputs (the in-kernel softplus gate, beta from a logit);
    -> (output, final state) relative norm errors."""
    q, k, v, g, beta, S0, scale = tc.sequence_inputs(L_, False, None, seed)
    g = g[:, 0]
    o_ref, S_ref = tc.recurrence(q, k, v, g[:, None], beta, S0, scale)
    S, out = S0.astype(f32), np.zeros((L_, D))
    for c0 in range(0, L_, C):
        cv = min(C, L_ - c0)
        Q, K_, V_ = (np.zeros((C, D), f32) for _ in range(3))
        Q[:cv], K_[:cv], V_[:cv] = q[c0:c0 + cv], k[c0:c0 + cv], v[c0:c0 + cv]
        gg, be = np.zeros(C, f32), np.zeros(C, f32)
        gg[:cv], be[:cv] = g[c0:c0 + cv], beta[c0:c0 + cv]
        o, S = scan_chunk(S, Q, K_, V_, *prep(Q, K_, gg, be, cv, scale))
        out[c0:c0 + cv] = o[:cv]
    return (np.linalg.norm(out - o_ref) / np.linalg.norm(o_ref),
            np.linalg.norm(S - S_ref) / np.linalg.norm(S_ref))


def sequence_cp(L_, seg_chunks, seed=1):
    """Context parallelism (hopper_scan.cuh ScanPass, hopper_combine.cuh) over L_ tokens in
    segments of seg_chunks chunks: each segment but the last scanned from I with v = 0 (M) and
    from 0 (N) at the kernels' rounding points, S_{i+1} = S_i M_i + N_i in fp32, then every
    segment from its start with outputs; -> (output, final state) errors against the fp64
    recurrence, and the largest difference from the sequential scan's outputs (relative norm)."""
    q, k, v, g, beta, S0, scale = tc.sequence_inputs(L_, False, None, seed)
    g = g[:, 0]
    o_ref, S_ref = tc.recurrence(q, k, v, g[:, None], beta, S0, scale)
    chunks = []
    for c0 in range(0, L_, C):
        cv = min(C, L_ - c0)
        Q, K_, V_ = (np.zeros((C, D), f32) for _ in range(3))
        Q[:cv], K_[:cv], V_[:cv] = q[c0:c0 + cv], k[c0:c0 + cv], v[c0:c0 + cv]
        gg, be = np.zeros(C, f32), np.zeros(C, f32)
        gg[:cv], be[:cv] = g[c0:c0 + cv], beta[c0:c0 + cv]
        chunks.append((Q, K_, V_, prep(Q, K_, gg, be, cv, scale), cv))
    segs = [chunks[i:i + seg_chunks] for i in range(0, len(chunks), seg_chunks)]

    def scan(S, seg, zero_v=False):
        outs = []
        for Q, K_, V_, pr, cv in seg:
            o, S = scan_chunk(S, Q, K_, np.zeros_like(V_) if zero_v else V_, *pr)
            outs.append(o[:cv])
        return S.astype(f32), outs

    starts = [S0.astype(f32)]
    for seg in segs[:-1]:
        M, _ = scan(np.eye(D, dtype=f32), seg, zero_v=True)
        N, _ = scan(np.zeros((D, D), f32), seg)
        starts.append((starts[-1] @ M + N).astype(f32))
    out, S_end = [], None
    for start, seg in zip(starts, segs):
        S_end, outs = scan(start, seg)
        out += outs
    out = np.concatenate(out)
    _, seq_outs = scan(S0.astype(f32), chunks)
    seq = np.concatenate(seq_outs)
    return (np.linalg.norm(out - o_ref) / np.linalg.norm(o_ref),
            np.linalg.norm(S_end - S_ref) / np.linalg.norm(S_ref),
            np.linalg.norm(out - seq) / np.linalg.norm(seq))


if __name__ == "__main__":
    tc.EXACT = True
    eo, es = one_chunk()
    assert eo < 1e-6 and es < 1e-6, (eo, es)
    print(f"1. GDN chunk, rounding off: out {eo:.1e} state {es:.1e} (the products are the algebra)")
    eo, es, _ = sequence_cp(700, 3, seed=5)
    assert eo < 1e-5 and es < 1e-5, (eo, es)
    print(f"1. context parallel, 700 tokens, rounding off: out {eo:.1e} state {es:.1e} (exact)")
    tc.EXACT = False
    worst = 0.0
    for kw in (dict(L_=300), dict(L_=1000, seed=2), dict(L_=65, seed=3), dict(L_=2048, seed=4)):
        eo, es = sequence(**kw)
        worst = max(worst, eo, es)
        print(f"2. {kw}: out {eo:.2e} state {es:.2e}")
    for kw in (dict(L_=1000, seg_chunks=2, seed=2), dict(L_=2048, seg_chunks=5, seed=4)):
        eo, es, ed = sequence_cp(**kw)
        worst = max(worst, eo, es)
        print(f"3. context parallel {kw}: out {eo:.2e} state {es:.2e} (vs the sequential scan "
              f"{ed:.1e})")
    assert worst < 4e-3, worst
