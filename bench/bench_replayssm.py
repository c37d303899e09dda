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
"""

from __future__ import annotations

import argparse
import sys

import torch

import deltastate as ds
from bench_decode import Case, io_bytes, state_bytes
from harness import DTYPES, MODELS, measure_copy_bandwidth, time_graph, write_results

BATCHES = [1, 8, 32, 64, 128, 256, 512]


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
    args = ap.parse_args()

    gen = torch.Generator().manual_seed(4321)
    copy_gbps = measure_copy_bandwidth()
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu}, copy bandwidth {copy_gbps:.0f} GB/s (read + write)", flush=True)
    print(f"{'op':5} {'model':12} {'state':5} {'B':>4} {'L':>3} {'us/step':>9} {'MB/step':>8} "
          f"{'GB/s':>7} {'%copy':>6} {'plain_us':>9} {'speedup':>7}")
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
                    nbytes = replay_step_bytes(m, dtype, B, L)
                    gbps = nbytes / t / 1e9
                    us = t * 1e6
                    rows.append(dict(op=f"replayssm-{m.op}", model=m.name, state_dtype=dname, B=B,
                                     L=L, us=round(us, 2), GBps=round(gbps, 1),
                                     pct_copy=round(100 * gbps / copy_gbps, 1),
                                     bytes_per_step=round(nbytes), plain_us=round(plain_us, 2),
                                     speedup=round(plain_us / us, 3), pdl=args.pdl, **phase_us,
                                     peer=None, peer_us=None))
                    print(f"{m.op:5} {m.name:12} {dname:5} {B:>4} {L:>3} {us:9.2f} "
                          f"{nbytes / 1e6:8.2f} {gbps:7.0f} {100 * gbps / copy_gbps:6.1f} "
                          f"{plain_us:9.2f} {plain_us / us:7.2f}"
                          + "".join(f"  {k} {v:.2f}" for k, v in phase_us.items()), flush=True)
                    del case
                    torch.cuda.empty_cache()
    write_results(args.json, copy_gbps,
                  "per-step time amortized over whole ring cycles (L steps per rotation in one "
                  "CUDA graph, cursors advanced on the device); cold L2 by rotating slot sets; "
                  "median of graph replays; GB/s from the byte model "
                  "(bench/bench_replayssm.py::replay_step_bytes)"
                  + ("; both launched with programmatic dependent launch (pdl=True)" if args.pdl
                     else ""),
                  rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
