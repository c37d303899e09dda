"""Tensor-parallel decode step of one layer (deltastate.tp): time per step at TP = WORLD_SIZE and
the share of it spent in the out_proj all-reduce.

Run under torchrun, once per TP size (scripts/tp.sh bench N sets the NVLink-multicast switches
off and starts N ranks):

    scripts/tp.sh bench 1 --json bench/results/tp-h200.json
    scripts/tp.sh bench 2 --json bench/results/tp-h200.json
    scripts/tp.sh bench 4 --json bench/results/tp-h200.json    # rows are appended per TP size

For each layer (Qwen3-Next GDN: HV = 32 over TP; Kimi-Linear KDA: H = 32 over TP) and B in
--batches, every rank holds B requests in its StatePool (fp32 state, bf16 activations and
weights) and times one decode step (projections, conv window, deltastate packed decode, gated
norm, out_proj, all-reduce), replayed from a CUDA graph (eager with --eager, or when capture
fails; the row says which), median over --reps timings of --iters steps each. Three times per
case, each the slowest rank's median:
  step_us      the whole step;
  noreduce_us  the same step with the all-reduce left out;
  allreduce_us the all-reduce of the [B, hidden] bf16 output alone;
allreduce_share = (step_us - noreduce_us) / step_us (what the reduction adds to the step) and
allreduce_alone_share = allreduce_us / step_us. Rank 0 prints a table and appends rows {layer,
tp, B, mode, step_us, noreduce_us, allreduce_us, allreduce_share, allreduce_alone_share, device,
world} to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from deltastate import tp


def _timed(fn, iters: int, reps: int, graph: bool):
    """Median microseconds per call of fn over reps timings of iters calls (CUDA events)."""
    mode = "eager"
    run = fn
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(iters):
                    fn()
            run, mode = g.replay, "graph"
        except Exception as e:  # noqa: BLE001 - measured eagerly instead; the row says so
            print(f"CUDA graph capture failed ({type(e).__name__}: {e}); timing eagerly",
                  flush=True)
            torch.cuda.synchronize()
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if mode == "graph":
            run()
        else:
            for _ in range(iters):
                run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / iters)
    med = torch.tensor([statistics.median(times[1:])], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the step is as slow as its slowest rank
    return float(med), mode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="gdn,kda")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--json", default="")
    args = p.parse_args()
    rank, world, dev = tp.init_distributed("cuda")
    rows = []
    for kind in args.layers.split(","):
        cfg = tp.GDNConfig.qwen3_next() if kind == "gdn" else tp.KDAConfig.kimi_linear()
        for B in (int(b) for b in args.batches.split(",")):
            layer = tp.build_layer(cfg, rank, world, group=dist.group.WORLD, slots=B, device=dev,
                                   dtype=torch.bfloat16)
            slots = torch.tensor([layer.allocate() for _ in range(B)], dtype=torch.int32,
                                 device=dev)
            slots = slots[torch.randperm(B, device=dev)]
            x = torch.randn(B, cfg.hidden, device=dev, dtype=torch.bfloat16)
            y = torch.empty(B, cfg.hidden, device=dev, dtype=torch.bfloat16)

            def step():
                y.copy_(layer.decode(x, slots))

            def reduce_only():
                dist.all_reduce(y)

            layer.reduce = True
            step_us, mode = _timed(step, args.iters, args.reps, not args.eager)
            layer.reduce = False
            noreduce_us, _ = _timed(step, args.iters, args.reps, not args.eager)
            layer.reduce = True
            ar_us, _ = _timed(reduce_only, args.iters, args.reps, not args.eager)
            rows.append({"layer": kind, "tp": world, "B": B, "mode": mode,
                         "step_us": round(step_us, 2), "noreduce_us": round(noreduce_us, 2),
                         "allreduce_us": round(ar_us, 2),
                         "allreduce_share": round(max(step_us - noreduce_us, 0.0) / step_us, 3),
                         "allreduce_alone_share": round(ar_us / step_us, 3),
                         "device": torch.cuda.get_device_name(dev), "world": world,
                         "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")})
            del layer
            torch.cuda.empty_cache()
    if rank == 0:
        print(f"{'layer':5} {'tp':>2} {'B':>4} {'mode':5} {'step us':>9} {'no-AR us':>9} "
              f"{'AR us':>7} {'AR share':>8} {'AR alone':>8}")
        for r in rows:
            print(f"{r['layer']:5} {r['tp']:>2} {r['B']:>4} {r['mode']:5} {r['step_us']:>9} "
                  f"{r['noreduce_us']:>9} {r['allreduce_us']:>7} {r['allreduce_share']:>8} "
                  f"{r['allreduce_alone_share']:>8}")
        if args.json:
            old = []
            if os.path.exists(args.json):
                with open(args.json) as f:
                    old = json.load(f)
            with open(args.json, "w") as f:
                json.dump(old + rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
