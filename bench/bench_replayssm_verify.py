"""ReplaySSM speculative verify benchmark on the GPU, beside deltastate's intermediate-state verify.

A step is replayssm_verify (T draft tokens per sequence from the checkpoint and the ring, T ring
records appended, no state written; the fold into the checkpoint on flagged slots) followed by
replayssm_commit (the cursors moved on the device), with a fixed accept pattern: every row accepts
1, 2, ..., T drafts on consecutive steps, cycling, so the rings fill and fold as in serving. The
cursors then follow one deterministic path per rotation, which `cursor_cycle` simulates: after a
transient (run eagerly, outside the timing) the (write_pos, is_flush, accept phase) triple repeats
with period C, and one CUDA graph holds C consecutive steps of every rotation (step-major), so
each replay walks whole cycles, fold steps weighted as they occur. Cold L2 as in bench/harness.py
(rotations of disjoint slot sets and inputs over > 4x L2), median of graph replays.

Byte model per step and value head (`replay_verify_bytes`, averaged over the cycle): the
checkpoint read; written back on a fold step (m > 0 records folded); the m committed records read
(d [V] in the ring's dtype, k [K] bf16 shared by the HV/H value heads of a key head, g fp32); T
records written; plus the activations (q, k, v, g, beta in, the output) and the cursors.

Beside it, in the same run: `verify` (SGLang's convention, T intermediate states written) and
verify + update_state_after_verify (the accepted state copied into the pool), from
bench/bench_verify.py's cases. Rows {model, state_dtype, T, B, L, cycle, folds, us, bytes_per_step,
GBps, pct_copy, inter_us, inter_commit_us, speedup}. Writes bench/results/replayssm-verify-h200.json.

--dry-run: tiny shapes on the CPU backend, no timing: runs the transient and two cycles eagerly
and checks that the kernels' cursors follow `cursor_cycle` (python/tests runs this).
"""

from __future__ import annotations

import argparse
import sys

import torch

import deltastate as ds

ACT = torch.bfloat16


def cursor_cycle(L: int, T: int, max_steps: int = 10000):
    """The cursors' path under the accept pattern 1..T from (write_pos, base, is_flush) = 0: the
    list of (m, fold, accepted) per step, the transient length and the cycle length. m = records
    replayed by the step's verify, fold = the step folds them into the checkpoint (m > 0)."""
    wp, flush = 0, 0
    seen, path = {}, []
    for i in range(max_steps):
        key = (wp, flush, i % T)
        if key in seen:
            return path, seen[key], i - seen[key]
        seen[key] = i
        a = i % T + 1
        path.append((wp, bool(flush) and wp > 0, a))
        wp = a if flush else wp + a  # replayssm_commit (ops.h ReplayCommitArgs)
        flush = 1 if wp + 2 * T > L else 0
    raise RuntimeError("no cursor cycle")


def ring_record_bytes(m, dtype) -> float:
    """One ring record per value head: d [V] (ring dtype), k [K] bf16 per key head, g fp32."""
    isz = torch.tensor([], dtype=dtype).element_size()
    g = m.K * 4 if m.op == "kda" else 4
    return m.V * isz + m.K * 2 * m.H / m.HV + g


def io_bytes(m, B: int, T: int) -> int:
    """q, k, v, g, beta (bf16) in, the output (bf16), state indices and accepted counts (int32),
    three int32 cursors per row (read by verify, read and written by the commit)."""
    g_width = m.HV * m.K if m.op == "kda" else m.HV
    per_token = 2 * m.H * m.K * 2 + m.HV * m.V * 2 + g_width * 2 + m.HV * 2 + m.HV * m.V * 2
    return B * T * per_token + B * (4 + 4 + 3 * 4 + 3 * 4)


def replay_verify_bytes(m, dtype, B: int, T: int, L: int) -> float:
    """Average DRAM bytes per step over the cursor cycle (the byte model above)."""
    path, mu, lam = cursor_cycle(L, T)
    cyc = path[mu:mu + lam]
    state = m.V * m.K * torch.tensor([], dtype=dtype).element_size()  # one head
    rec = ring_record_bytes(m, dtype)
    per_head = sum(state + (state if fold else 0) + rec * mm + rec * T for mm, fold, _ in cyc)
    return B * m.HV * per_head / lam + io_bytes(m, B, T)


class ReplayVerifyCase:
    """Checkpoints, rings and cursors over a pool of `nr` rotations of B slots each."""

    def __init__(self, m, dtype, T, B, L, gen, device="cuda", nr=None):
        from harness import pool_slots_for, rotations

        self.m, self.dtype, self.T, self.B, self.L, self.dev = m, dtype, T, B, L, device
        per_launch = replay_verify_bytes(m, dtype, B, T, L)
        self.nr = nr or rotations(int(per_launch))
        isz = torch.tensor([], dtype=dtype).element_size()
        slot_bytes = m.HV * m.V * m.K * isz + int(L * m.HV * ring_record_bytes(m, dtype))
        S = pool_slots_for(B, slot_bytes, self.nr)
        self.nr = min(self.nr, S // B)  # disjoint slot sets where the pool allows
        self.pool = (0.02 * torch.randn(S, m.HV, m.V, m.K, device=device)).to(dtype)
        self.d = torch.zeros(S, m.HV, L, m.V, dtype=dtype, device=device)
        self.kc = torch.zeros(S, m.H, L, m.K, dtype=ACT, device=device)
        gshape = (S, m.HV, L, m.K) if m.op == "kda" else (S, m.HV, L)
        self.gc = torch.zeros(gshape, dtype=torch.float32, device=device)
        self.wp = torch.zeros(S, dtype=torch.int32, device=device)
        self.base = torch.zeros(S, dtype=torch.int32, device=device)
        self.flush = torch.zeros(S, dtype=torch.int32, device=device)
        # harness.gate_params's and slot_sets's draws, on any device
        self.A_log = torch.empty(m.HV).uniform_(1.0, 16.0, generator=gen).log().to(device)
        width = m.HV * m.K if m.op == "kda" else m.HV
        self.dt_bias = (0.1 * torch.randn(width, generator=gen)).to(device)
        perm = torch.randperm(S, generator=gen).to(torch.int32)
        self.idx = [perm[r * B:(r + 1) * B].to(device) for r in range(self.nr)]
        gsh = (B, T, m.HV, m.K) if m.op == "kda" else (B, T, m.HV)
        mk = lambda *s: torch.randn(*s, device=device).to(ACT)  # noqa: E731
        self.q = [mk(B, T, m.H, m.K) for _ in range(self.nr)]
        self.k = [mk(B, T, m.H, m.K) for _ in range(self.nr)]
        self.v = [mk(B, T, m.HV, m.V) for _ in range(self.nr)]
        self.g = [mk(*gsh) for _ in range(self.nr)]
        self.beta = [mk(B, T, m.HV) for _ in range(self.nr)]
        self.out = [torch.empty(B, T, m.HV, m.V, dtype=ACT, device=device)
                    for _ in range(self.nr)]
        self.acc = [torch.full((B,), a, dtype=torch.int32, device=device) for a in range(1, T + 1)]
        self.scale = m.K ** -0.5

    def step(self, r: int, i: int):
        """Step i of rotation r: verify, then the commit with accept count i % T + 1."""
        m = self.m

        def run():
            ds.replayssm_verify(self.q[r], self.k[r], self.v[r], self.g[r], self.beta[r],
                                self.out[r], self.pool, self.idx[r], self.d, self.kc, self.gc,
                                self.wp, self.base, self.flush, A_log=self.A_log,
                                dt_bias=self.dt_bias, scale=self.scale, is_kda=m.op == "kda")
            ds.replayssm_commit(self.wp, self.base, self.flush, self.acc[i % self.T],
                                self.idx[r], self.L, self.T)
        return run


def dry_run() -> int:
    """Tiny shapes on the CPU backend: the kernels' cursors follow cursor_cycle."""
    from harness import Model

    m = Model("tiny", "gdn", 2, 4, 16, 8)
    gen = torch.Generator().manual_seed(7)
    for L, T in ((8, 4), (16, 4), (6, 2)):
        path, mu, lam = cursor_cycle(L, T)
        case = ReplayVerifyCase(m, torch.float32, T, 3, L, gen, device="cpu", nr=2)
        for i in range(mu + 2 * lam):
            want_m, want_fold, _ = path[mu + (i - mu) % lam] if i >= mu else path[i]
            for r in range(case.nr):
                s = case.idx[r].long()
                assert torch.all(case.wp[s] == want_m), (L, T, i, case.wp[s], want_m)
                assert torch.all((case.flush[s] != 0) & (case.wp[s] > 0) == want_fold)
                case.step(r, i)()
                assert torch.isfinite(case.out[r].float()).all()
        print(f"dry-run L={L} T={T}: transient {mu}, cycle {lam}, "
              f"{replay_verify_bytes(m, torch.float32, 3, T, L):.0f} bytes/step: ok")
    return 0


def profile_steps(args) -> int:
    """Eager steps, nothing timed: Nsight Compute picks one launch (--launch-skip)."""
    from harness import DTYPES, MODELS

    m = MODELS[args.models.split(",")[0]]
    dtype = DTYPES[args.dtypes.split(",")[0]]
    B, L = int(args.batches.split(",")[0]), int(args.lens.split(",")[0])
    case = ReplayVerifyCase(m, dtype, args.tokens, B, L, torch.Generator().manual_seed(1), nr=1)
    for i in range(args.profile_steps):
        case.step(0, i)()
    torch.cuda.synchronize()
    ds.check_errors()
    print(f"{args.profile_steps} eager steps of {m.name} {args.dtypes.split(',')[0]} "
          f"T={args.tokens} B={B} L={L}: ok")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench/results/replayssm-verify-h200.json")
    ap.add_argument("--models", default="qwen3-next")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--lens", default="8,16")
    ap.add_argument("--batches", default="8,64,256")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--no-inter", action="store_true",
                    help="skip the intermediate-state verify beside it")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on the CPU backend, cursor logic only (no GPU, no timing)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="for Nsight Compute: that many eager steps of the first model, dtype, "
                         "B and L given, one rotation, no timing (T = 4, L = 16: step 3 appends "
                         "on 6 committed records, step 4 folds 10)")
    args = ap.parse_args()
    if args.dry_run:
        return dry_run()
    if args.profile_steps:
        return profile_steps(args)

    from bench_verify import Case
    from harness import DTYPES, MODELS, measure_copy_bandwidth, time_graph, write_results

    gen = torch.Generator().manual_seed(2468)
    copy_gbps = measure_copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    print(f"{'model':12} {'state':5} {'T':>2} {'B':>4} {'L':>3} {'cyc':>3} {'folds':>5} "
          f"{'us/step':>9} {'MB/step':>8} {'GB/s':>7} {'%copy':>6} {'inter_us':>9} "
          f"{'+commit':>9}")
    rows, T = [], args.tokens
    for name in args.models.split(","):
        m = MODELS[name]
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            for B in map(int, args.batches.split(",")):
                inter_us = inter_commit_us = None
                if not args.no_inter:
                    vc = Case(m, dtype, T, B, gen, with_scratch=True)
                    inter_us = time_graph([vc.verify(r) for r in range(vc.nr)],
                                          replays=args.replays) * 1e6
                    acc = torch.full((B,), T, dtype=torch.int32, device="cuda")

                    def verify_commit(r, vc=vc, acc=acc):
                        run = vc.verify(r)

                        def both():
                            run()
                            ds.update_state_after_verify(vc.pool, vc.scratch[r], vc.idx[r], acc)
                        return both
                    inter_commit_us = time_graph([verify_commit(r) for r in range(vc.nr)],
                                                 replays=args.replays) * 1e6
                    del vc
                    torch.cuda.empty_cache()
                for L in map(int, args.lens.split(",")):
                    path, mu, lam = cursor_cycle(L, T)
                    case = ReplayVerifyCase(m, dtype, T, B, L, gen)
                    for i in range(mu):  # the transient, outside the timing
                        for r in range(case.nr):
                            case.step(r, i)()
                    launches = [case.step(r, i) for i in range(mu, mu + lam)
                                for r in range(case.nr)]
                    t = time_graph(launches, replays=args.replays, warmup=0)
                    # Each launch was one step: verify and commit together.
                    wp = case.wp[torch.cat(case.idx).long()]
                    assert torch.all(wp == path[mu][0]), "the cursors left their cycle"
                    ds.check_errors()
                    nbytes = replay_verify_bytes(m, dtype, B, T, L)
                    folds = sum(1 for _, f, _ in path[mu:mu + lam] if f)
                    us, gbps = t * 1e6, nbytes / t / 1e9
                    rows.append(dict(op=f"replayssm-verify-{m.op}", model=m.name,
                                     state_dtype=dname, T=T, B=B, L=L, cycle=lam, folds=folds,
                                     us=round(us, 2), bytes_per_step=round(nbytes),
                                     GBps=round(gbps, 1), pct_copy=round(100 * gbps / copy_gbps, 1),
                                     inter_us=None if inter_us is None else round(inter_us, 2),
                                     inter_commit_us=(None if inter_commit_us is None
                                                      else round(inter_commit_us, 2)),
                                     speedup=(None if inter_commit_us is None
                                              else round(inter_commit_us / us, 3))))
                    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
                    print(f"{m.name:12} {dname:5} {T:>2} {B:>4} {L:>3} {lam:>3} {folds:>5} "
                          f"{us:9.2f} {nbytes / 1e6:8.2f} {gbps:7.0f} "
                          f"{100 * gbps / copy_gbps:6.1f} {fmt(inter_us):>9} "
                          f"{fmt(inter_commit_us):>9}", flush=True)
                    del case, launches
                    torch.cuda.empty_cache()
    write_results(args.json, copy_gbps,
                  "per-step time (replayssm_verify + replayssm_commit, accept 1..T cycling) "
                  "amortized over whole cursor cycles (one CUDA graph holds a cycle of every "
                  "rotation, cursors advanced on the device, the transient run before); cold L2 "
                  "by rotating slot sets and inputs; median of graph replays; GB/s from the byte "
                  "model (bench/bench_replayssm_verify.py::replay_verify_bytes); inter_us: "
                  "verify with T intermediate states, inter_commit_us: it plus "
                  "update_state_after_verify, same method", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
