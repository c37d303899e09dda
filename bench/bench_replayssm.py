"""ReplaySSM decode benchmark on the GPU, beside deltastate's own plain packed decode.

Time per step is amortized over whole ring cycles: one CUDA graph holds L consecutive steps of
every rotation (advance_write_pos=True, so each rotation walks its cursors 0..L-1 and flushes at
L-1 — the L-1 appending steps and the flush step weighted as they occur, never only the cheapest
phase). Cold L2 as in bench/harness.py. A byte model is printed beside the timing:
  per step and value head: read the checkpoint, write it on 1 step in L, read the m live ring
  records (m = 0..L-1, (L-1)/2 on average: d [V] state dtype, k [K] bf16 per key head, g [1 or K]
  fp32), append one record on L-1 steps in L, plus the activations.
Writes bench/results/replayssm-h200.json rows {op, model, state_dtype, B, L, us, GBps, pct_copy,
bytes_per_step, plain_us, speedup, peer, peer_us}.

--peer PATH times SGLang's Triton ReplaySSM decode beside ours in the same run (PATH: its file
fused_recurrent_linear_replayssm.py, or a folder holding it; reference code kept out of the
repository, e.g. build-peers/sglang/). It runs on its own copies of the pool, rings and cursors,
on our activations and slot sets, over the same whole ring cycles in the same kind of graph:
  peer_us        its kernel plus, per step, the cursor advance SGLang leaves to its caller
                 ((wp + 1) % L, two torch ops in the same graph);
  peer_kernel_us its kernel alone, each step at a precomputed cursor tensor (SGLang hands the
                 kernel a snapshot and advances once per forward, for all layers together);
  peer_max_abs_diff (_round_beta) max |ours - peer| over one step's outputs from identical pools,
                 rings and cursors at a mid-ring cursor (ours as timed, fp32 beta; and ours with
                 round_beta=True, the rule of SGLang 03a70bf);
  peer_note      why the peer has no time for a row (it raised), when so.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

import deltastate as ds
from bench_decode import Case, io_bytes, state_bytes
from harness import DTYPES, MODELS, measure_copy_bandwidth, time_graph, write_results

BATCHES = [1, 8, 32, 64, 128, 256, 512]
PEER_FILE = "fused_recurrent_linear_replayssm.py"
PEER_NAME = "sglang fused_recurrent_linear_replayssm_decode (Triton)"


def ring_record_bytes(m, dtype) -> float:
    """Bytes of one ring record per value head: d [V] (state dtype), k [K] bf16 shared by the
    HV/H value heads of a key head, g [K] (KDA) or [1] (GDN) fp32."""
    isz = torch.tensor([], dtype=dtype).element_size()
    g = m.K * 4 if m.op == "kda" else 4
    return m.V * isz + m.K * 2 * m.H / m.HV + g


def replay_step_bytes(m, dtype, B: int, L: int) -> float:
    """Average DRAM bytes per step (the byte model above)."""
    heads = B * m.HV
    state = state_bytes(m, 1, dtype) / m.HV  # one head
    rec = ring_record_bytes(m, dtype)
    per_head = state + state / L + rec * (L - 1) / 2 + rec * (L - 1) / L
    return heads * per_head + io_bytes(m, B)


class ReplayCase(Case):
    """A decode case plus rings and per-rotation cursors over the same pool."""

    def __init__(self, m, dtype, B, L, gen, pdl=False):
        super().__init__(m, dtype, B, gen, pdl)
        self.L = L
        S = self.slots
        self.d = torch.zeros(S, m.HV, L, m.V, device="cuda", dtype=dtype)
        self.k = torch.zeros(S, m.H, L, m.K, device="cuda", dtype=torch.bfloat16)
        gshape = (S, m.HV, L, m.K) if m.op == "kda" else (S, m.HV, L)
        self.g = torch.zeros(gshape, device="cuda", dtype=torch.float32)
        self.wp = [torch.zeros(B, device="cuda", dtype=torch.int32) for _ in range(self.nr)]
        a_shape = (B, m.HV, m.K) if m.op == "kda" else (B, m.HV)
        self.a3 = [a.reshape(a_shape) for a in self.a]
        self.dt3 = self.dt_bias.reshape(m.HV, m.K) if m.op == "kda" else self.dt_bias

    def replay(self, r: int, cursors=None):
        """One step of rotation r: on its own cursors, advanced on the device; or, given
        `cursors`, at those fixed cursors (no advance: the same phase on every launch)."""
        m = self.m
        wp = self.wp[r] if cursors is None else cursors
        return lambda: ds.fused_recurrent_linear_replayssm_decode(
            self.x[r], self.a3[r], self.b[r], self.A_log, self.dt3, self.scale, self.pool, self.d,
            self.k, self.g, self.out[r], self.idx[r], wp, None, is_kda=m.op == "kda",
            use_qk_l2norm_in_kernel=True, advance_write_pos=cursors is None, pdl=self.pdl)


def load_peer(path: str):
    """SGLang's fused_recurrent_linear_replayssm_decode from `path` (the file, or a folder holding
    it). The file imports only math, torch and triton, so it loads alone, without sglang."""
    if os.path.isdir(path):
        path = os.path.join(path, PEER_FILE)
    spec = importlib.util.spec_from_file_location("sglang_peer_replayssm", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.fused_recurrent_linear_replayssm_decode


class PeerReplay:
    """SGLang's Triton ReplaySSM on its own copies of a ReplayCase's pool, rings and cursors. Its
    layouts are ours (its docstring and shape checks): pool [slots, HV, V, K], d [slots, HV, L, V],
    k [slots, H, L, K], g [slots, HV, L] (GDN) or [slots, HV, L, K] (KDA) fp32; the activations,
    gate parameters and slot sets are the case's, read by both."""

    def __init__(self, fn, case: ReplayCase):
        self.fn, self.case = fn, case
        self.pool, self.d, self.k, self.g = (t.clone() for t in (case.pool, case.d, case.k, case.g))
        self.out = [torch.empty_like(o) for o in case.out]
        self.wp = [torch.zeros_like(w) for w in case.wp]

    def launch(self, r: int, wp) -> None:
        """One kernel launch of rotation r at cursors `wp`. deltastate takes SGLang's name and
        order, so the 14 positional arguments are ours (force_flush None, as our timed call).
        SGLang differs only in what it lacks: no advance_write_pos (the caller moves write_pos),
        no pdl (a plain Triton launch, also under --pdl), and beta rounded to b's dtype (bf16) at
        03a70bf (ours: fp32). Its tuning keywords (block_v, num_warps 1, num_stages 3, nk 2) stay
        at their defaults, as SGLang's backend calls it; its backend also passes an int32
        force_flush [B] for GDN (the radix track boundary), one 4-byte load per program, left
        out here as in our call."""
        c = self.case
        self.fn(c.x[r], c.a3[r], c.b[r], c.A_log, c.dt3, c.scale, self.pool, self.d, self.k,
                self.g, self.out[r], c.idx[r], wp, None, is_kda=c.m.op == "kda",
                use_qk_l2norm_in_kernel=True)

    def replay(self, r: int, cursors=None):
        """One step of rotation r, as ReplayCase.replay: on its own cursors, advanced after the
        kernel by torch ops in the same graph; or, given `cursors`, the kernel alone there."""
        if cursors is not None:
            return lambda: self.launch(r, cursors)
        wp, L = self.wp[r], self.case.L

        def run():
            self.launch(r, wp)
            # SGLang's backend (hybrid_linear_attn_backend.py) advances the per-slot cursor once
            # per forward, outside its graph: next = flushed ? 0 : (wp + 1) % L, through a
            # gather, where, torch.unique and a scatter (host syncs). Without forced flushes
            # that is (wp + 1) % L: here its smallest form, two elementwise ops in this graph
            # (a lower bound of that work; ours advances inside its kernel).
            wp.add_(1).remainder_(L)
        return run


def check_peer(case: ReplayCase, peer: PeerReplay) -> tuple[float, float]:
    """Max |ours - peer| over one step's outputs (rotation 0) from identical pools, rings and
    cursors: ours first appends n = (L-1)//2 records to rotation 0's slots (inputs of other
    rotations; mid-ring, no flush for L >= 3), the peer gets copies of everything, then each
    steps once at cursor n. Returns (ours as timed, ours with round_beta=True). The peer's
    replay dots run on bf16 tensor cores: ~1e-3 relative differences are expected."""
    B, kda = case.B, case.m.op == "kda"
    wp = torch.zeros(B, device="cuda", dtype=torch.int32)
    for j in range((case.L - 1) // 2):
        r = (1 + j) % case.nr
        ds.fused_recurrent_linear_replayssm_decode(
            case.x[r], case.a3[r], case.b[r], case.A_log, case.dt3, case.scale, case.pool, case.d,
            case.k, case.g, case.out[r], case.idx[0], wp, None, is_kda=kda,
            use_qk_l2norm_in_kernel=True, advance_write_pos=True)
    for src, dst in zip((case.pool, case.d, case.k, case.g), (peer.pool, peer.d, peer.k, peer.g),
                        strict=True):
        dst.copy_(src)
    peer.launch(0, wp.clone())
    theirs = peer.out[0].float()
    slots = case.idx[0].long()
    saved = case.pool[slots]  # a copy; a flush (L = 1) writes the checkpoint: restore between
    diffs = []
    for round_beta in (False, True):
        ds.fused_recurrent_linear_replayssm_decode(
            case.x[0], case.a3[0], case.b[0], case.A_log, case.dt3, case.scale, case.pool,
            case.d, case.k, case.g, case.out[0], case.idx[0], wp.clone(), None, is_kda=kda,
            use_qk_l2norm_in_kernel=True, round_beta=round_beta)
        diffs.append((case.out[0].float() - theirs).abs().max().item())
        case.pool[slots] = saved
    return diffs[0], diffs[1]


def time_peer(fn, case: ReplayCase, replays: int) -> dict:
    """The peer's row fields for one case (its own buffers live only here); on an exception
    (an unsupported dtype or shape) peer None and the reason in peer_note."""
    try:
        peer = PeerReplay(fn, case)
        diff, diff_rb = check_peer(case, peer)
        L, nr = case.L, case.nr
        for w in peer.wp:
            w.zero_()
        # As ours: L steps of every rotation, step-major, cursors walking a whole cycle.
        t = time_graph([peer.replay(r) for _ in range(L) for r in range(nr)], replays=replays,
                       warmup=0)
        assert all(int(w.max()) == 0 for w in peer.wp), "peer cursors did not complete a cycle"
        cursors = [torch.full((case.B,), s, device="cuda", dtype=torch.int32) for s in range(L)]
        tk = time_graph([peer.replay(r, cursors[s]) for s in range(L) for r in range(nr)],
                        replays=replays)
        return {"peer": PEER_NAME, "peer_us": round(t * 1e6, 2),
                "peer_kernel_us": round(tk * 1e6, 2), "peer_max_abs_diff": diff,
                "peer_max_abs_diff_round_beta": diff_rb}
    except Exception as e:  # noqa: BLE001 - any failure of the peer is recorded, not fatal
        return {"peer": None, "peer_us": None, "peer_note": f"{type(e).__name__}: {e}"[:300]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench/results/replayssm-h200.json")
    ap.add_argument("--models", default="qwen3-next,kimi-linear")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--lens", default="8,16")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--pdl", action="store_true",
                    help="launch ReplaySSM and plain decode with programmatic dependent launch")
    ap.add_argument("--phases", action="store_true",
                    help="also time an appending step (cursor L/2) and a flush step (cursor L-1) "
                         "alone, each repeated at fixed cursors")
    ap.add_argument("--peer", default=None, metavar="PATH",
                    help="time SGLang's Triton ReplaySSM beside ours: its file "
                         f"{PEER_FILE} or a folder holding it (e.g. build-peers/sglang)")
    args = ap.parse_args()
    peer_fn = load_peer(args.peer) if args.peer else None

    gen = torch.Generator().manual_seed(4321)
    copy_gbps = measure_copy_bandwidth()
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu}, copy bandwidth {copy_gbps:.0f} GB/s (read + write)", flush=True)
    print(f"{'op':5} {'model':12} {'state':5} {'B':>4} {'L':>3} {'us/step':>9} {'MB/step':>8} "
          f"{'GB/s':>7} {'%copy':>6} {'plain_us':>9} {'speedup':>7}"
          + (f" {'peer_us':>9} {'peer_k_us':>9} {'x':>5}" if peer_fn else ""))
    rows = []
    for name in args.models.split(","):
        m = MODELS[name]
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            for B in map(int, args.batches.split(",")):
                plain_us = None
                for L in map(int, args.lens.split(",")):
                    case = ReplayCase(m, dtype, B, L, gen, pdl=args.pdl)
                    if plain_us is None:
                        plain_us = time_graph([case.ours(r) for r in range(case.nr)],
                                              replays=args.replays) * 1e6
                    # L steps of every rotation, step-major: consecutive launches use other slots.
                    launches = [case.replay(r) for _ in range(L) for r in range(case.nr)]
                    for w in case.wp:
                        w.zero_()
                    t = time_graph(launches, replays=args.replays, warmup=0)
                    # Graph replays restart each rotation's cycle only if the cursors came back.
                    assert all(int(w.max()) == 0 for w in case.wp), "cursors did not complete a cycle"
                    phase_us = {}
                    if args.phases:
                        for phase, c in (("app_us", L // 2), ("flush_us", L - 1)):
                            wp = torch.full((B,), c, device="cuda", dtype=torch.int32)
                            phase_us[phase] = round(time_graph(
                                [case.replay(r, wp) for r in range(case.nr)],
                                replays=args.replays) * 1e6, 2)
                    peer = {"peer": None, "peer_us": None}
                    if peer_fn is not None:
                        peer = time_peer(peer_fn, case, args.replays)
                    nbytes = replay_step_bytes(m, dtype, B, L)
                    gbps = nbytes / t / 1e9
                    us = t * 1e6
                    rows.append(dict(op=f"replayssm-{m.op}", model=m.name, state_dtype=dname, B=B,
                                     L=L, us=round(us, 2), GBps=round(gbps, 1),
                                     pct_copy=round(100 * gbps / copy_gbps, 1),
                                     bytes_per_step=round(nbytes), plain_us=round(plain_us, 2),
                                     speedup=round(plain_us / us, 3), pdl=args.pdl, **phase_us,
                                     **peer))
                    cols = ""
                    if peer_fn is not None and peer["peer_us"] is not None:
                        # x: ours' speed over the peer's (peer_us / us), its cursor ops included
                        cols = (f" {peer['peer_us']:9.2f} {peer['peer_kernel_us']:9.2f} "
                                f"{peer['peer_us'] / us:5.2f}")
                    elif peer_fn is not None:
                        cols = f" {'-':>9} {'-':>9} {'-':>5}"
                    print(f"{m.op:5} {m.name:12} {dname:5} {B:>4} {L:>3} {us:9.2f} "
                          f"{nbytes / 1e6:8.2f} {gbps:7.0f} {100 * gbps / copy_gbps:6.1f} "
                          f"{plain_us:9.2f} {plain_us / us:7.2f}" + cols
                          + "".join(f"  {k} {v:.2f}" for k, v in phase_us.items())
                          + (f"  (|ours-peer| max {peer['peer_max_abs_diff']:.2e}, round_beta "
                             f"{peer['peer_max_abs_diff_round_beta']:.2e})"
                             if "peer_max_abs_diff" in peer else "")
                          + (f"  peer: {peer['peer_note']}" if "peer_note" in peer else ""),
                          flush=True)
                    del case
                    torch.cuda.empty_cache()
    write_results(args.json, copy_gbps,
                  "per-step time amortized over whole ring cycles (L steps per rotation in one "
                  "CUDA graph, cursors advanced on the device); cold L2 by rotating slot sets; "
                  "median of graph replays; GB/s from the byte model "
                  "(bench/bench_replayssm.py::replay_step_bytes)"
                  + ("; both launched with programmatic dependent launch (pdl=True)" if args.pdl
                     else "")
                  + ("; peer: SGLang's Triton fused_recurrent_linear_replayssm_decode on its own "
                     "copies of the buffers, same cycles and graphs (peer_us: its kernel plus "
                     "(wp + 1) % L as two torch ops per step; peer_kernel_us: its kernel at "
                     "precomputed cursors; never launched with PDL)" if peer_fn else ""),
                  rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
