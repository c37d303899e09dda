"""Per-kernel device times of chunked prefill (bench_prefill.py's inputs) under torch.profiler.

For each --cases entry (NxT of Qwen3-Next GDN, or tp4:NxT for H=4, HV=8), runs ours (the
dispatch's kernels, or those DELTASTATE_CUDA_PREFILL forces) and with --peer FLA's, --reps times
eagerly on rotating inputs, and prints every kernel's mean device time (µs) and count per call:
which launch carries the time that the graph-replay benchmark shows as a whole. Also the target
of `ncu` in scripts/device.sh's profile-prefill (--reps 1 --rotate 1).

    python bench/profile_prefill.py --cases 8x1024,1x8192,tp4:1x8192 --peer
"""

from __future__ import annotations

import argparse

import torch

from bench_prefill import (D, FlaCall, FlashInferCall, Inputs, call_ours, fla_fn,
                           flashinfer_fn, ours_fn)
from harness import Model, gate_params, kernel_times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="8x1024,1x8192")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rotate", type=int, default=4, help="input sets cycled through")
    ap.add_argument("--peer", action="store_true", help="also FLA's chunk_gated_delta_rule")
    ap.add_argument("--flashinfer", action="store_true",
                    help="also FlashInfer's SM90 GDN prefill (staged: FI_OK=1)")
    ap.add_argument("--no-ours", action="store_true", help="only the peers (ncu on a peer)")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(1234)
    ours, why = ours_fn("gdn")
    if ours is None:
        raise SystemExit(why)
    peer = fla_fn("gdn")[0] if args.peer else None
    fi = None
    if args.flashinfer:
        fi, why_not = flashinfer_fn()
        if fi is None:
            raise SystemExit(why_not)
    for spec in args.cases.split(","):
        tp4 = spec.startswith("tp4:")
        N, T = (int(x) for x in spec.removeprefix("tp4:").split("x"))
        H, HV = (4, 8) if tp4 else (16, 32)
        A_log, dt_bias = gate_params(Model("qwen3-next", "gdn", H, HV, D, D), gen)
        sets = [Inputs("gdn", H, HV, N, T, A_log, dt_bias, gen) for _ in range(args.rotate)]
        sides = {}
        if not args.no_ours:
            sides["ours"] = [lambda x=x: call_ours(ours, x, False, A_log, dt_bias) for x in sets]
        if peer is not None:
            fla = FlaCall(peer, "gdn", False, A_log, dt_bias)
            fla.probe(sets[0])
            sides["FLA"] = [lambda x=x: fla(x) for x in sets]
        if fi is not None:
            fic = FlashInferCall(fi)
            fic(sets[0])  # compiles its kernels outside the timed calls
            sides["FlashInfer"] = [lambda x=x: fic(x) for x in sets]
        for side, calls in sides.items():
            rows = kernel_times(calls, args.reps)
            print(f"# {spec} (H={H}, HV={HV}) {side}: {sum(r[1] for r in rows):.1f} µs per call")
            for name, us, n in rows:
                print(f"  {us:9.1f} µs  x{n:4.1f}  {name[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
