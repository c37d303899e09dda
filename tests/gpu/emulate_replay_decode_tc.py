"""No-GPU check of ReplaySSM decode's tensor-core rows (src/cuda/replayssm/decode_tc.cuh and the TC
row phase of replayssm/decode.cuh), with numpy.

    python3 tests/gpu/emulate_replay_decode_tc.py

A warp owns 16 rows of a bf16 checkpoint (K = 128). Lane (g = lane / 4, t = lane % 4) stages the
16-byte chunks of rows g and g + 8 at physical columns 32c + 8t .. 32c + 8t + 7 (c = 0..3); words
0, 1 of chunk c are its A registers of k-step 2c, words 2, 3 of k-step 2c + 1. Its B registers of
the same steps are the same words of B column g (g < 6) read from shared memory at byte
g * kTcColPitch + (32c + 8t) * 2; column 2s + 0 holds part s (hi, mid, lo) of e*alpha*k, 2s + 1
part s of e*alpha*q. Lane t adds the records j = t, t + 4, ... to its accumulators, the quad sums
them, and lanes 0 / 1 store the outputs of rows g / g + 8, lanes 2 / 3 their d records; a flush
reads the tile back in the rows kernel's layout.
This script transcribes those index maps lane by lane, places every register's two elements where
PTX's m16n8k16 fragment layout puts them (A[g][2t..], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..];
B[2t..][g], B[2t+8..][g]; C[g][2t..], C[g+8][2t..]), runs the products, and checks:
(1) rounding off (fp64, the vectors unsplit in part 0): sk and sq of every row equal the plain
    fp64 dots with the records' terms to ~1e-12, every (row, k) of every step is placed exactly
    once, and every row gets exactly one output and one d store;
(2) rounding on (the checkpoint in bf16, each vector split into three bf16 parts as
    split_bf16x3 does; the exact products summed in fp64, where the tensor core sums in fp32):
    the split is exact (a float's 24 significant bits in three 8-bit parts, all in bf16's normal
    range here), and the dots' error is within 2^-23 of their absolute-value sums;
(3) the B reads: each quarter warp's eight 16-byte reads cover the 32 banks once (kTcColPitch);
(4) a flush's rows, read in the rows kernel's layout (load_tc_tile_rows), come from the words the
    staging threads wrote them to, every chunk of the CTA's 128 rows once.
The one-warp kernel (replayssm/decode_warp.cuh, GDN) takes its records' coefficients from the same
product: the k ring's 16 records as A rows against split3(kn), split3(qn); lane t's record j = t,
t + 4, ... comes from quad j % 8 (c0 / c1 for j < 8, c2 / c3 above); the checkpoint's dots scaled
by e * alpha. Checked: (5) its appending dots against fp64 (ring records past m filled with
garbage that must not leak), (6) its k-ring and d-ring reads (kWarpKPitch 320, kDPitch 144) cover
the banks without conflict, (7) a flush's chunk map stores every (row, column) of its 64 rows
once, from the chunk it loaded.
For KDA (per-column decays) the one-warp kernel forms the records' coefficients on CUDA cores:
lane l's columns 4l .. 4l + 3 give each record j a partial W_j*k_j . (alpha*kn) (and q), and one
transposed butterfly (warp_transpose_sum: at step S a lane keeps the half its bit S selects and
adds its partner's other half) leaves the total of value v in lane v: ck_j in lane j, cq_j in lane
16 + j. Checked: (8) that map, lane by lane; the appending dots S0.(e*alpha*kn) + sum_j d_j ck_j
and a flush's rebuild (e*alpha) S0 + sum_j d_j (alpha W_j k_j) against the CPU's
alpha (e S0 + sum_j d_j W_j k_j), rounding off.
A GDN flush takes the records' terms on tensor cores: per m-tile one [16 rows, 16 records] x
[16 records, 128 columns] product, A = d_j W_j (split in three bf16 parts; zero at and past m),
B = the k ring as stored (zero at and past m), n-tile n = 4c + q's column jc the physical column
32c + 8 (jc / 2) + 2q + jc % 2, so that C's (row g, columns 2t, 2t + 1) land on the lane's chunk
elements S[.][8c + 2q], S[.][8c + 2q + 1]. Checked: (9) from the lanes' fragments placed as PTX
places them, every A and B element once, every (row, column) of C once and on the chunk element of
its physical column; the rebuilt rows against e S0 + sum_j d_j W_j k_j (fp64, stale records
poisoned with NaN past m), with and without the split's rounding.
"""

import sys

import numpy as np

K, ROWS = 128, 16
COL_PITCH = 128 * 2 + 64  # kTcColPitch, bytes


def bf16(x):
    """Round to the nearest bf16 (ties to even), as __float2bfloat16_rn; returns float64."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def split3(x):
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    hi = bf16(x)
    r1 = (x - hi).astype(np.float32)  # exact in fp32
    mid = bf16(r1)
    lo = bf16((r1 - mid).astype(np.float32))
    return hi, mid, lo


def phys(c, t, e):
    """Physical column of element e (0..7) of lane group t's chunk c."""
    return 32 * c + 8 * t + e


def lane_tile_dots(S, parts_k, parts_q, d, ck, cq):
    """The warp's 16 x 8 C tile and, per lane, its quad-summed accumulators, as the kernel forms
    them. S: [16, K] checkpoint rows; parts_*: 3 parts [K]; d: [m, 16]; ck, cq: [m]."""
    bcols = np.zeros((8, K))
    for s in range(3):
        bcols[2 * s], bcols[2 * s + 1] = parts_k[s], parts_q[s]
    C = np.zeros((16, 8))
    for step in range(8):
        c, half = divmod(step, 2)  # chunk c, words 2*half and 2*half + 1
        A = np.full((16, 16), np.nan)
        B = np.full((16, 8), np.nan)
        for lane in range(32):
            g, t = divmod(lane, 4)
            # A registers: (row g, word 2h), (row g+8, word 2h), (row g, word 2h+1), (row g+8, ...)
            regs = [(g, 2 * half), (g + 8, 2 * half), (g, 2 * half + 1), (g + 8, 2 * half + 1)]
            places = [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]
            for (row, word), (prow, pk) in zip(regs, places):
                for i in range(2):  # the low half holds the lower k
                    assert np.isnan(A[prow, pk + i]), "A element placed twice"
                    A[prow, pk + i] = S[row, phys(c, t, 2 * word + i)]
            # B registers: words 2h, 2h+1 of column g's chunk c
            for j, word in enumerate((2 * half, 2 * half + 1)):
                for i in range(2):
                    k = 2 * t + 8 * j + i
                    assert np.isnan(B[k, g]), "B element placed twice"
                    B[k, g] = bcols[g, phys(c, t, 2 * word + i)] if g < 6 else 0.0
        assert not np.isnan(A).any() and not np.isnan(B).any(), "a fragment element unset"
        C += A @ B
    acc = np.zeros((32, 4))
    for lane in range(32):
        g, t = divmod(lane, 4)
        acc[lane] = [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]
        for j in range(t, len(ck), 4):
            acc[lane] += [d[j, g] * ck[j], d[j, g] * cq[j], d[j, g + 8] * ck[j],
                          d[j, g + 8] * cq[j]]
    quad = acc.reshape(8, 4, 4).sum(axis=1)  # [g, (sk g, sq g, sk g+8, sq g+8)]
    sk = np.concatenate([quad[:, 0], quad[:, 2]])
    sq = np.concatenate([quad[:, 1], quad[:, 3]])
    return sk, sq


def check_stores():
    outs, ds = [], []
    for lane in range(32):
        g, t = divmod(lane, 4)
        row = g + 8 * (t & 1)
        (outs if t < 2 else ds).append(row)
    assert sorted(outs) == list(range(ROWS)) and sorted(ds) == list(range(ROWS)), "stores"
    cover = np.zeros((ROWS, K), dtype=int)  # the staged chunks: each (row, column) once
    for lane in range(32):
        g, t = divmod(lane, 4)
        for h in range(2):
            for c in range(4):
                cover[g + 8 * h, phys(c, t, 0):phys(c, t, 8)] += 1
    assert (cover == 1).all(), "the lanes' chunks do not cover the tile once"


def check_flush_rows():
    """load_tc_tile_rows: the rows kernel's lanes (16 a row, 8 columns each, RG = 2 row groups,
    R = 4 rows a lane, 8 warps of 8 rows a block, 2 blocks) find each of their chunks in the
    word that stage_tc_tile's thread wrote it to."""
    staged = {}  # word index -> (CTA row, first column)
    for thread in range(256):
        warp, lane = divmod(thread, 32)
        g, t = divmod(lane, 4)
        for h in range(2):
            for c in range(4):
                staged[(2 * c + h) * 256 + thread] = (16 * warp + g + 8 * h, phys(c, t, 0))
    seen = set()
    for b in range(2):
        for warp in range(8):
            for lane in range(32):
                kofs = (lane % 16) * 8
                local0 = 8 * warp + lane // 16
                for r in range(4):
                    row = 64 * b + local0 + 2 * r
                    c, t = kofs >> 5, (kofs >> 3) & 3
                    word = (2 * c + ((row >> 3) & 1)) * 256 + (row >> 4) * 32 + (row & 7) * 4 + t
                    assert staged[word] == (row, kofs), "flush row read from the wrong word"
                    seen.add((row, kofs))
    assert len(seen) == 128 * 16, "the flush does not read every chunk"


def check_banks():
    for quarter in range(4):
        for c in range(4):
            units = set()
            for lane in range(8 * quarter, 8 * quarter + 8):
                g, t = divmod(lane, 4)
                addr = g * COL_PITCH + phys(c, t, 0) * 2
                units.add((addr // 16) % 8)
            assert len(units) == 8, f"bank conflict in quarter {quarter}, chunk {c}"


K_PITCH, MT = 320, 4  # kWarpKPitch (bytes); m-tiles a warp (64 rows)
D_PITCH = 16 * MT * 2 + 16  # WarpSmem<4>::kDPitch (bytes)


def warp_kernel_dots(S0, kn, qn, kring, d, w, a, e, m):
    """The one-warp kernel's appending dots of one m-tile (16 rows): records' coefficients from
    the ring product and the lanes' shuffle map, then e*a*(S0.kn) plus each lane's records."""
    pk, pq = split3(kn), split3(qn)
    zero = np.zeros((0, ROWS))
    # The ring product per quad: lane_tile_dots' quad sums, rows g and g + 8 (records).
    C_k, C_q = lane_tile_dots(kring, pk, pq, zero, np.zeros(0), np.zeros(0))
    quad = np.stack([C_k[:8], C_q[:8], C_k[8:], C_q[8:]], axis=1)  # [g, (c0, c1, c2, c3)]
    ck, cq = np.zeros(16), np.zeros(16)
    for lane in range(32):
        t = lane % 4
        for i in range(4):
            j = t + 4 * i
            src = 4 * (j & 7)
            k0, q0, k1, q1 = quad[src // 4]
            if j < m:
                ck[j] = w[j] * (a * (k0 if j < 8 else k1))
                cq[j] = w[j] * (a * (q0 if j < 8 else q1))
    s_k, s_q = lane_tile_dots(S0, pk, pq, zero, np.zeros(0), np.zeros(0))
    return e * a * s_k + d[:m].T @ ck[:m], e * a * s_q + d[:m].T @ cq[:m]


def check_warp_kernel(rng):
    worst = 0.0
    for _ in range(30):
        m = int(rng.integers(0, 16))
        S0 = bf16(rng.standard_normal((ROWS, K)))
        kn = rng.standard_normal(K).astype(np.float32).astype(np.float64)
        qn = rng.standard_normal(K).astype(np.float32).astype(np.float64)
        kring = bf16(rng.standard_normal((16, K)) * 0.1)
        kring[m:] = bf16(rng.standard_normal((16 - m, K)) * 1e30)  # stale records
        d = bf16(rng.standard_normal((16, ROWS)))
        w = np.exp(-rng.uniform(0, 2, 16))
        a, e = float(np.exp(-rng.uniform(0, 1))), float(np.exp(-rng.uniform(0, 3)))
        sk, sq = warp_kernel_dots(S0, kn, qn, kring, d, w, a, e, m)
        ck = w[:m] * a * (kring[:m] @ kn)
        cq = w[:m] * a * (kring[:m] @ qn)
        ref_k = e * a * (S0 @ kn) + d[:m].T @ ck
        ref_q = e * a * (S0 @ qn) + d[:m].T @ cq
        mag = e * a * (np.abs(S0) @ np.abs(kn)) + np.abs(d[:m].T) @ np.abs(ck) + 1e-300
        magq = e * a * (np.abs(S0) @ np.abs(qn)) + np.abs(d[:m].T) @ np.abs(cq) + 1e-300
        worst = max(worst, np.max(np.abs(sk - ref_k) / mag), np.max(np.abs(sq - ref_q) / magq))
    # (6) banks: the k ring's A reads (a quarter warp: records g, g + 1 of row half hh, chunk c)
    for quarter in range(4):
        for hh in range(2):
            for c in range(4):
                units = {(((g + 8 * hh) * K_PITCH + (32 * c + 8 * t) * 2) // 16) % 8
                         for lane in range(8 * quarter, 8 * quarter + 8)
                         for g, t in [divmod(lane, 4)]}
                assert len(units) == 8, "k ring bank conflict"
    for mt in range(MT):  # the d ring's scalar reads: lane (g, t) reads record t + 4i, row g (+8)
        for i in range(4):
            for hh in range(2):
                banks = {}
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    addr = (t + 4 * i) * D_PITCH + (16 * mt + g + 8 * hh) * 2
                    banks.setdefault((addr // 4) % 32, set()).add(addr // 4)
                assert all(len(v) == 1 for v in banks.values()), "d ring bank conflict"
    # (7) a flush's chunk map: lane (g, t), m-tile mt, row half hh, chunk c, element i holds row
    # 16 mt + g + 8 hh, column 32c + 8t + i, loaded from and stored to the same place.
    seen = np.zeros((16 * MT, K), dtype=int)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for mt in range(MT):
            for hh in range(2):
                for c in range(4):
                    row = 16 * mt + g + 8 * hh
                    load0 = phys(c, t, 0)  # cp.async source column of the chunk
                    store0 = 8 * t + 32 * c  # the flush's 16-byte store
                    assert load0 == store0, "flush stores a chunk where it did not load it"
                    seen[row, load0:load0 + 8] += 1
    assert (seen == 1).all(), "a flush does not cover its rows once"
    return worst


def transpose_sum(parts):
    """warp_transpose_sum over 32 lanes' 32 values: each lane's part[0] at the end."""
    parts = [list(p) for p in parts]
    S = 16
    while S >= 1:
        nxt = []
        for lane in range(32):
            upper = (lane & S) != 0
            partner = parts[lane ^ S]
            p_upper = not upper
            send = [partner[i] if p_upper else partner[i + S] for i in range(S)]
            keep = [parts[lane][i + S] if upper else parts[lane][i] for i in range(S)]
            nxt.append([keep[i] + send[i] for i in range(S)] + parts[lane][2 * S:])
        parts = nxt
        S //= 2
    return [p[0] for p in parts]


def check_warp_kda(rng):
    """(8) KDA's coefficients, their map, the appending dots and a flush's rebuild (fp64)."""
    worst = 0.0
    for _ in range(20):
        m = int(rng.integers(0, 16))
        S0 = bf16(rng.standard_normal((ROWS, K)))
        kn, qn = rng.standard_normal(K), rng.standard_normal(K)
        kring = bf16(rng.standard_normal((16, K)) * 0.1)
        g = -rng.uniform(0, 0.5, (16, K))
        alpha = np.exp(-rng.uniform(0, 0.5, K))
        d = bf16(rng.standard_normal((16, ROWS)))
        gtot = g[:m].sum(axis=0)
        e = np.exp(gtot)
        W = np.exp(gtot[None, :] - np.cumsum(g[:m], axis=0))  # [m, K]
        parts = []
        for lane in range(32):
            cols = slice(4 * lane, 4 * lane + 4)
            part = [0.0] * 32
            for j in range(m):
                kw = kring[j, cols] * W[j, cols]
                part[j] = float(kw @ (alpha[cols] * kn[cols]))
                part[16 + j] = float(kw @ (alpha[cols] * qn[cols]))
            parts.append(part)
        total = transpose_sum(parts)
        for v in range(32):
            assert abs(total[v] - sum(p[v] for p in parts)) <= 1e-12 * (1 + abs(total[v])), \
                "transposed sum: a lane holds the wrong value"
        ck = np.array([total[j] for j in range(m)])
        cq = np.array([total[16 + j] for j in range(m)])
        # the CPU: S = alpha * (e S0 + sum_j d_j W_j k_j), then the dots
        S_ref = alpha[None, :] * (e[None, :] * S0 + d[:m].T @ (W * kring[:m]))
        sk = S0 @ (e * alpha * kn) + d[:m].T @ ck
        sq = S0 @ (e * alpha * qn) + d[:m].T @ cq
        S_flush = (e * alpha)[None, :] * S0 + d[:m].T @ (alpha[None, :] * W * kring[:m])
        mag = np.abs(S_ref).sum() + 1e-300
        worst = max(worst, np.max(np.abs(sk - S_ref @ kn)) / (np.abs(S_ref) @ np.abs(kn)).max(),
                    np.max(np.abs(sq - S_ref @ qn)) / (np.abs(S_ref) @ np.abs(qn)).max(),
                    np.abs(S_flush - S_ref).sum() / mag)
    return worst


def pi_col(n, jc):
    """The physical column of n-tile n's column jc in a GDN flush's product."""
    c, q = divmod(n, 4)
    return 32 * c + 8 * (jc // 2) + 2 * q + jc % 2


def check_warp_flush_tc(rng):
    """(9) A GDN flush's records' product: the fragment maps and the rebuild (fp64)."""
    worst_exact, worst_split = 0.0, 0.0
    for _ in range(20):
        m = int(rng.integers(1, 16))
        S0 = bf16(rng.standard_normal((ROWS, K)))
        e = float(np.exp(-rng.uniform(0, 3)))
        kring = bf16(rng.standard_normal((16, K)))
        kring[m:] = np.nan  # stale bytes
        d = bf16(rng.standard_normal((16, ROWS)))
        d[m:] = np.nan
        w = np.exp(-rng.uniform(0, 2, 16))
        ref = e * S0 + (d[:m] * w[:m, None]).T @ kring[:m]
        for split in (False, True):
            S = {}  # (lane, hh, element) -> value, the lane's chunk registers
            for lane in range(32):
                g, t = divmod(lane, 4)
                for hh in range(2):
                    for el in range(32):
                        c, i = divmod(el, 8)
                        S[lane, hh, el] = e * S0[g + 8 * hh, 32 * c + 8 * t + i]
            parts = 3 if split else 1
            for sp in range(parts):
                A = np.full((16, 16), np.inf)  # placed from the lanes' registers
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    for r in range(4):
                        hh, j0 = r & 1, 2 * t + 8 * (r >> 1)
                        for jj in (j0, j0 + 1):
                            x = d[jj, g + 8 * hh] * w[jj] if jj < m else 0.0
                            x = split3(np.array([np.float32(x)]))[sp][0] if split else x
                            assert A[g + 8 * hh, jj] == np.inf, "A element placed twice"
                            A[g + 8 * hh, jj] = x
                assert np.isfinite(A).all(), "an A element not placed"
                for n in range(16):
                    B = np.full((16, 8), np.inf)
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        col = 32 * (n >> 2) + 8 * (g >> 1) + 2 * (n & 3) + (g & 1)  # kernel
                        assert col == pi_col(n, g)
                        for jj in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9):
                            assert B[jj, g] == np.inf, "B element placed twice"
                            B[jj, g] = kring[jj, col] if jj < m else 0.0
                    assert np.isfinite(B).all(), "a B element not placed"
                    C = A @ B
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        e0 = 8 * (n >> 2) + 2 * (n & 3)
                        for hh in range(2):
                            for b in range(2):
                                el = e0 + b
                                c, i = divmod(el, 8)
                                assert 32 * c + 8 * t + i == pi_col(n, 2 * t + b), \
                                    "C lands on another column's chunk element"
                                S[lane, hh, el] += C[g + 8 * hh, 2 * t + b]
            got = np.zeros((ROWS, K))
            for (lane, hh, el), v in S.items():
                g, t = divmod(lane, 4)
                c, i = divmod(el, 8)
                got[g + 8 * hh, 32 * c + 8 * t + i] = v
            err = np.max(np.abs(got - ref) / (np.abs(e * S0) + np.abs(d[:m] * w[:m, None]).T
                                               @ np.abs(kring[:m]) + 1e-300))
            if split:
                worst_split = max(worst_split, err)
            else:
                worst_exact = max(worst_exact, err)
    return worst_exact, worst_split


def main() -> int:
    rng = np.random.default_rng(20261207)
    check_stores()
    check_flush_rows()
    check_banks()
    worst_exact, worst_rounded, worst_split = 0.0, 0.0, 0.0
    for trial in range(40):
        m = int(rng.integers(0, 16))
        scale = 10.0 ** rng.uniform(-6, 3)
        S = bf16(rng.standard_normal((ROWS, K)) * scale)
        ek = rng.standard_normal(K) * np.exp(rng.uniform(-8, 0, K))
        eq = rng.standard_normal(K) * np.exp(rng.uniform(-8, 0, K))
        d = bf16(rng.standard_normal((m, ROWS)))
        ck, cq = rng.standard_normal(m), rng.standard_normal(m)
        ref_k = S @ ek + d.T @ ck
        ref_q = S @ eq + d.T @ cq
        zero = np.zeros(K)
        # (1) rounding off: the whole vector in part 0
        sk, sq = lane_tile_dots(S, [ek, zero, zero], [eq, zero, zero], d, ck, cq)
        mag = np.abs(S) @ np.abs(ek) + np.abs(d.T) @ np.abs(ck) + 1e-300
        magq = np.abs(S) @ np.abs(eq) + np.abs(d.T) @ np.abs(cq) + 1e-300
        worst_exact = max(worst_exact, np.max(np.abs(sk - ref_k) / mag),
                          np.max(np.abs(sq - ref_q) / magq))
        # (2) rounding on: fp32 vectors split in three bf16 parts
        ek32, eq32 = ek.astype(np.float32).astype(np.float64), eq.astype(np.float32).astype(np.float64)
        pk, pq = split3(ek32), split3(eq32)
        for x, p in ((ek32, pk), (eq32, pq)):
            nz = x != 0
            worst_split = max(worst_split, np.max(np.abs(x - sum(p))[nz] / np.abs(x[nz]), initial=0))
        sk, sq = lane_tile_dots(S, pk, pq, d, ck, cq)
        rk = S @ ek32 + d.T @ ck
        rq = S @ eq32 + d.T @ cq
        worst_rounded = max(worst_rounded, np.max(np.abs(sk - rk) / mag),
                            np.max(np.abs(sq - rq) / magq))
    print(f"rounding off: worst |dot - fp64| / sum|.| = {worst_exact:.2e}")
    print(f"rounding on: split residual {worst_split:.2e} of |x| (exact: 0); "
          f"dots {worst_rounded:.2e} of sum|.| (bound 2^-23)")
    warp = check_warp_kernel(rng)
    print(f"one-warp kernel: appending dots {warp:.2e} of sum|.| (bound 2^-23)")
    kda = check_warp_kda(rng)
    print(f"one-warp kernel, KDA: coefficients' map exact; dots and flush {kda:.2e} (fp64)")
    flush_exact, flush_split = check_warp_flush_tc(rng)
    print(f"one-warp kernel, GDN flush on tensor cores: maps exact; rebuild {flush_exact:.2e} "
          f"(unsplit), {flush_split:.2e} (three bf16 parts, bound 2^-23) of sum|.|")
    ok = (worst_exact < 1e-12 and worst_split == 0.0 and worst_rounded <= 2.0**-23
          and warp <= 2.0**-23 and kda < 1e-12 and flush_exact < 1e-12
          and flush_split <= 2.0**-23)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
