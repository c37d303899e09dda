"""No-GPU check of the quantized decode kernel's lanes (src/cuda/recurrent/decode_quant.cuh), with
numpy.

    python3 tests/gpu/emulate_quant_decode.py

The kernel computes a 16-row tile's dots S.k and S.q with mma.sync.m16n8k16 in f16: lane
(g = lane / 4, t = lane % 4) holds rows g and g + 8 and, of each, the codes at K = [16t, 16t + 16)
and [64 + 16t, 64 + 16t + 16); its A fragment of k-block j is its code word j of each row, its B
fragment the f16 vectors (alpha k)_hi, (alpha k)_lo, (alpha q)_hi, (alpha q)_lo (B column g) at
the same K positions, read from the warp's table; lanes t = 0 and t = 1 sum the accumulator's
columns into sk and sq. This script transcribes those index maps lane by lane, places every
fragment element where PTX's fragment layout puts it (A[g][2t..], B[2t..][g], C[g][2t..]), runs
the products, and checks against a plain fp64 step:
(1) rounding off (fp64, the vectors unsplit): the dots, u, o and the updated rows agree to
    ~1e-12, and the stores cover every code of every row below V exactly once;
(2) rounding on (the kernel's f16 split with its power-of-two scaling; the exact f16 products
    summed in fp64, where the tensor core sums in fp32): the dots' relative error is within 2^-20
    of the dot's absolute-value sum, and the codes of the kernel's fp32 update within one quantum
    of the fp64 step's rows (float8: e4m3fn nearest; int8);
(3) the division rule: divide_by(x, s, 1 / s) equals x / s bit for bit on the kernel's operand
    range (|x| <= 448 s, s >= 2^-40), and any element it could miss (|x| < 2^-100) codes to zero;
(4) the vectors' power of two keeps every finite entry finite in f16, for any exponent.
The lanes' registers (code words as load_run fills them, B registers as read from the warp's
table, the codes' words as store_run writes them) are transcribed from the kernel's index
expressions, and checked against the layout's definition (quant_lane_k) and PTX's fragments.
"""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
import state_accuracy as sa  # noqa: E402  (the format rules' numpy emulation)

TILE = 16
KS = (128, 64)  # the K values the kernel takes
f32 = np.float32


class Layout:
    """QuantLayout<K>: a lane's two runs of RUN = K / 8 codes, WORDS 4-byte words a row (one
    k-block each), EPL token entries a lane."""

    def __init__(self, K):
        self.K, self.RUN, self.WORDS, self.EPL = K, K // 8, K // 16, K // 32


def lane_k(t, i, K):
    """The K position of lane t's code i (0 .. K / 4 - 1) of a row: two runs of K / 8
    (quant_lane_k)."""
    run = K // 8
    return (run * t if i < run else K // 2 + run * t - run) + i


def word_bytes(L, t, w):
    """The row offsets of the 4 bytes of lane t's word w as load_run / store_run move them:
    run w // (WORDS / 2) at run * K / 2 + RUN t, its words consecutive."""
    half = L.WORDS // 2
    base = (w // half) * (L.K // 2) + L.RUN * t + 4 * (w % half)
    return [base + b for b in range(4)]


def f16_split(v, up):
    """The kernel's hi / lo parts of v * up in f16 (as fp64 values)."""
    a = (np.asarray(v, f32) * f32(up)).astype(f32)
    hi = a.astype(np.float16)
    lo = (a - hi.astype(f32)).astype(np.float16)
    return hi.astype(np.float64), lo.astype(np.float64)


def scale_exponent(m):
    """e with the largest |entry| m * 2^e in [2^14, 2^15), at most 126 (the kernel's)."""
    eb = int(np.array([m], f32).view(np.uint32)[0] >> 23)
    return min(141 - eb, 126)


def mma(a_frag, b_frag):
    """One m16n8k16 product from the 32 lanes' fragments, laid out as PTX places them."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a = a_frag[lane]  # a0..a3, each a pair
        A[g, 2 * t:2 * t + 2] = a[0]
        A[g + 8, 2 * t:2 * t + 2] = a[1]
        A[g, 2 * t + 8:2 * t + 10] = a[2]
        A[g + 8, 2 * t + 8:2 * t + 10] = a[3]
        b = b_frag[lane]
        B[2 * t:2 * t + 2, g] = b[0]
        B[2 * t + 8:2 * t + 10, g] = b[1]
    D = A @ B
    out = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        out.append([D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]])
    return np.array(out)


def tile_dots(codes, s, ak, aq, row0, V, rounding):
    """The kernel's sk and sq of the tile's 16 rows (codes: [V, K] values, s: [V] scales),
    transcribed register by register: the warp's table of four vectors written EPL entries a
    lane, each lane's B registers bf read from it as the kernel indexes them, its code words
    cw as load_run fills them, a k-block's A pairs from its word j of rows g and g + 8."""
    K = codes.shape[1]
    L = Layout(K)
    if rounding:
        m = float(np.max(np.abs(np.concatenate([ak, aq]).astype(f32))))
        e = scale_exponent(m)
        vecs = [*f16_split(ak, 2.0 ** e), *f16_split(aq, 2.0 ** e)]
        down = 2.0 ** -e
    else:
        vecs = [np.asarray(ak, np.float64), np.zeros(K), np.asarray(aq, np.float64), np.zeros(K)]
        down = 1.0
    table = np.zeros((4, K))
    for lane in range(32):
        for i in range(L.EPL):
            for v in range(4):
                table[v, L.EPL * lane + i] = vecs[v][L.EPL * lane + i]
    bf, cw = [], []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        regs = [None] * (2 * L.WORDS)
        for run in range(2):
            for h2 in range(L.RUN // 8):
                base = run * (K // 2) + L.RUN * t + 8 * h2
                for i in range(4):
                    pair = table[g, base + 2 * i:base + 2 * i + 2] if g < 4 else np.zeros(2)
                    regs[run * L.WORDS + 4 * h2 + i] = pair
        bf.append(regs)
        rows = [row0 + g, row0 + g + 8]
        cw.append([[[codes[r, kk] if r < V else 0.0 for kk in word_bytes(L, t, w)]
                    for w in range(L.WORDS)] for r in rows])
    acc = np.zeros((32, 4))
    for j in range(L.WORDS):
        a_frag = [[cw[ln][0][j][0:2], cw[ln][1][j][0:2], cw[ln][0][j][2:4], cw[ln][1][j][2:4]]
                  for ln in range(32)]
        b_frag = [[bf[ln][2 * j], bf[ln][2 * j + 1]] for ln in range(32)]
        acc += mma(a_frag, b_frag)
    sk, sq = np.zeros(TILE), np.zeros(TILE)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for r, row in enumerate([g, g + 8]):
            dot = (acc[lane, 2 * r] + acc[lane, 2 * r + 1]) * down
            sc = s[row0 + row] if row0 + row < V else 0.0
            if t == 0:
                sk[row] = sc * dot
            elif t == 1:
                sq[row] = sc * dot
    return sk, sq


def quantize_rows(x, fmt):
    """Rows x quantized with fresh per-row scales: (values, scales) (nearest rounding)."""
    qmax = 448.0 if fmt == "f8" else 127.0
    amax = np.max(np.abs(x.astype(f32)), axis=1)
    s = (amax / f32(qmax)).astype(f32)
    s = np.where(s > 0, s, f32(1))
    y = (x.astype(f32) / s[:, None]).astype(f32)
    c = sa.round_e4m3(y) if fmt == "f8" else np.clip(np.rint(y), -127, 127).astype(f32)
    return c, s


def divide_by(x, d, r):
    """delta_math.h's divide_by in fp32: q = x r, e = x - q d (exact, via fp64), q + e r rounded
    once (the fused product and sum, exact in fp64 for these operands' widths)."""
    q = (x * r).astype(f32)
    e = (x.astype(np.float64) - q.astype(np.float64) * d.astype(np.float64)).astype(f32)
    return (q.astype(np.float64) + e.astype(np.float64) * r.astype(np.float64)).astype(f32)


def check_head(rng, fmt, kda, V, K, worst):
    state = rng.standard_normal((V, K)) * rng.uniform(0.01, 3.0, (V, 1))
    codes, s = quantize_rows(state, fmt)
    S = codes.astype(np.float64) * s[:, None].astype(np.float64)
    k = rng.standard_normal(K)
    q = rng.standard_normal(K)
    k /= np.linalg.norm(k)
    q /= np.linalg.norm(q) * np.sqrt(K)
    g = -np.exp(rng.uniform(np.log(0.01), np.log(3.0), K if kda else 1))
    alpha = np.broadcast_to(np.exp(g), (K,)).astype(f32).astype(np.float64)
    v = rng.standard_normal(V)
    beta = rng.uniform(0.1, 1.0)
    # the plain fp64 step
    S_dec = S * alpha[None, :]
    sk_ref, sq_ref = S_dec @ k, S_dec @ q
    u_ref = beta * (v - sk_ref)
    S_new = S_dec + u_ref[:, None] * k[None, :]
    o_ref = sq_ref + u_ref * (k @ q)
    written = np.zeros((V, K), int)
    u_kernel = np.zeros(V, f32)
    for row0 in range(0, V, TILE):
        rows = np.arange(row0, min(row0 + TILE, V))
        for rounding in (False, True):
            sk, sq = tile_dots(codes, s, alpha * k, alpha * q, row0, V, rounding)
            sk, sq = sk[:len(rows)], sq[:len(rows)]
            if not rounding:
                err = max(np.max(np.abs(sk - sk_ref[rows])), np.max(np.abs(sq - sq_ref[rows])))
                assert err < 1e-12, f"dots, rounding off: {err}"
                u = beta * (v[rows] - sk)
                assert np.max(np.abs(sq + u * (k @ q) - o_ref[rows])) < 1e-12
            else:
                mag = np.abs(S_dec[rows]) @ np.abs(k), np.abs(S_dec[rows]) @ np.abs(q)
                rel = max(np.max(np.abs(sk - sk_ref[rows]) / mag[0]),
                          np.max(np.abs(sq - sq_ref[rows]) / mag[1]))
                worst["dots"] = max(worst["dots"], rel)
                assert rel < 2.0 ** -20, f"dots, rounding on: {rel}"
                u_kernel[rows] = (f32(beta) * (v[rows].astype(f32) - sk.astype(f32))).astype(f32)
        # the stores: out[j] (the codes of positions lane_k(t, 4 j ..)) leaves through store_run
        # at word_bytes(t, j); every code of every row below V once
        L = Layout(K)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for row in (row0 + g, row0 + g + 8):
                if row < V:
                    for j in range(L.WORDS):
                        dst = word_bytes(L, t, j)
                        assert dst == [lane_k(t, 4 * j + b, K) for b in range(4)], (K, t, j)
                        written[row, dst] += 1
    assert np.all(written == 1), "every code of every row below V stored once"
    # the kernel's update in fp32 (x = u k + (c s) alpha, one rounding for the sum), quantized,
    # against the fp64 rows: within one quantum of the row
    sd = ((codes * s[:, None]).astype(f32) * alpha[None, :].astype(f32)).astype(f32)
    x = (u_kernel[:, None].astype(np.float64) * k.astype(f32)[None, :] + sd).astype(f32)
    new_codes, new_s = quantize_rows(x, fmt)
    deq = new_codes.astype(np.float64) * new_s[:, None]
    quantum = (new_s[:, None] * (1.0 if fmt == "i8" else 2.0 ** -3 * np.maximum(
        np.abs(new_codes), 2.0 ** -6)) + 1e-6 * np.max(np.abs(S_new), axis=1, keepdims=True))
    dev = np.max(np.abs(deq - S_new) / quantum)
    worst["codes"] = max(worst["codes"], dev)
    assert dev <= 1.0 + 1e-9, f"codes: {dev}"


def check_tiles():
    """Warps of TPW tiles (the launcher's ceil(V / (16 TPW)) a head): every row below V once."""
    for V in (128, 40, 16, 200):
        for tpw in (1, 2):
            seen = np.zeros(V, int)
            for block in range(-(-V // (TILE * tpw))):
                for tt in range(tpw):
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        for row in ((block * tpw + tt) * TILE + g, (block * tpw + tt) * TILE + g + 8):
                            if row < V and t == 0:
                                seen[row] += 1
            assert np.all(seen == 1), (V, tpw)


def check_exponent():
    """The vectors' power of two for every exponent a largest entry can have: 2^e and 2^-e
    normal floats, the scaled largest finite entry below f16's largest (65504) and at least 2^14
    where 2^e is not capped."""
    for eb in range(255):
        m = float(np.array([eb << 23 | 0x7FFFFF], np.uint32).view(f32)[0])
        e = scale_exponent(m)
        assert -126 <= e <= 126, eb
        top = m * 2.0 ** e
        assert top < 65504 and (e == 126 or top >= 2.0 ** 14), (eb, e, top)
        assert np.isfinite(np.float16(np.float32(top))), eb
    assert scale_exponent(float("inf")) == -114 and scale_exponent(float("nan")) == -114


def check_division(rng):
    """divide_by against x / s on the kernel's range, with all-ones mantissas and tiny x."""
    n = 2_000_000
    e = rng.integers(-35, 10, n)
    mant = rng.integers(0, 1 << 23, n, dtype=np.uint32)
    mant[::8] = (1 << 23) - 1
    amax = ((e + 127).astype(np.uint32) << 23 | mant).view(f32)
    s = (amax / f32(448)).astype(f32)
    x = (amax * rng.uniform(-1, 1, n).astype(f32)).astype(f32)
    x[::5] = amax[::5]
    x[::7] = (x[::7] * f32(2.0 ** -40)).astype(f32)
    r = (f32(1) / s).astype(f32)
    assert np.array_equal(divide_by(x, s, r).view(np.uint32), (x / s).astype(f32).view(np.uint32))
    tiny = (rng.uniform(-1, 1, n) * 2.0 ** -100).astype(f32)
    big = np.full(n, f32(2.0 ** -40))
    y = divide_by(tiny, big, (f32(1) / big).astype(f32))
    assert np.all(sa.round_e4m3(y) == 0) and np.all(np.signbit(y) == np.signbit(tiny))


def main():
    rng = np.random.default_rng(20261207)
    worst = {"dots": 0.0, "codes": 0.0}
    for fmt in ("f8", "i8"):
        for kda in (False, True):
            for K in KS:
                for V in (K, 40, 200):
                    for _ in range(2):
                        check_head(rng, fmt, kda, V, K, worst)
    check_division(rng)
    check_exponent()
    check_tiles()
    print("rounding off: dots, u and o agree with the fp64 step to 1e-12; every code stored once")
    print(f"rounding on: dots' relative error <= {worst['dots']:.2e} of |S||k| (bound 2^-20), "
          f"codes within {worst['codes']:.3f} quantum of the fp64 rows")
    print("division: divide_by equals x / s bit for bit on the kernel's range")
    return 0


if __name__ == "__main__":
    sys.exit(main())
