"""Per-kernel device times of one layer step (bench_layer_step.py's cases) under torch.profiler.

For each --cases entry (model:dtype:B), runs the fused step (the dispatch's plan, or the one
DELTASTATE_CUDA_FUSED forces), our unfused chain, with --replay L both in ReplaySSM mode, and with
--peer the peer chain of bench_layer_step.py, each --reps times eagerly on rotating inputs, and
prints every kernel's mean device time (µs) and count per step. What it answers: which launch of a chain carries the time that the graph-replay
benchmark shows as a whole.

    python bench/profile_layer_step.py --cases qwen3-next:f32:1,qwen3-next:f32:256 --replay 16
"""

from __future__ import annotations

import argparse

import torch

from bench_layer_step import Case, peer_launches
from harness import DTYPES, MODELS, kernel_times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="qwen3-next:f32:1,qwen3-next:f32:256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--replay", type=int, default=0, help="also the ReplaySSM mode, ring length L")
    ap.add_argument("--peer", action="store_true", help="also the peer chain (bench_layer_step's)")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(1234)
    for spec in args.cases.split(","):
        name, dname, b = spec.split(":")
        case = Case(MODELS[name], DTYPES[dname], int(b), gen, False)
        variants = {"fused": case.fused, "unfused": case.unfused}
        if args.replay:
            case.add_rings(args.replay)
            variants.update(replay_fused=case.fused_replay, replay_unfused=case.unfused_replay)
        if args.peer:
            peer_name, peer = peer_launches(case)
            if peer is not None:
                variants[f"peer ({peer_name})"] = lambda r, peer=peer: peer[r]
        for label, make in variants.items():
            rows = kernel_times([make(r) for r in range(case.nr)], args.reps)
            step = sum(t for _, t, _ in rows)
            print(f"== {spec} {label}: {step:.2f} µs of kernels per step")
            for k, t, c in rows:
                print(f"   {t:8.2f} µs  x{c:4.2f}  {k[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
