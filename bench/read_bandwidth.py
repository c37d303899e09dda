"""Read-only DRAM bandwidth of this GPU (a sum over a 2 GiB buffer, median of many runs): the
ceiling for ReplaySSM's appending steps, which read the checkpoint and write almost nothing.

  python3 bench/read_bandwidth.py [--device cuda] [--gib 2]
"""

import argparse
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda")
ap.add_argument("--gib", type=float, default=2.0)
ap.add_argument("--reps", type=int, default=20)
args = ap.parse_args()

x = torch.empty(int(args.gib * 1024**3) // 4, device=args.device, dtype=torch.float32).uniform_()


def sync():
    if x.is_cuda:
        torch.cuda.synchronize()


for _ in range(3):
    x.sum()
sync()
times = []
for _ in range(args.reps):
    t0 = time.perf_counter()
    x.sum()
    sync()
    times.append(time.perf_counter() - t0)
t = sorted(times)[len(times) // 2]
print(f"read bandwidth ({args.device}, sum over {args.gib:g} GiB fp32, median of {args.reps}): "
      f"{x.numel() * 4 / t / 1e9:.0f} GB/s")
