"""Read-only DRAM bandwidth of this GPU (a sum over a 2 GiB buffer, median of many runs): the
ceiling for ReplaySSM's appending steps, which read the checkpoint and write almost nothing."""

import torch

x = torch.empty(2 * 1024**3 // 4, device="cuda", dtype=torch.float32).uniform_()
out = torch.empty((), device="cuda")
for _ in range(3):
    torch.sum(x, out=out)
times = []
for _ in range(20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.sum(x, out=out)
    b.record()
    b.synchronize()
    times.append(a.elapsed_time(b) * 1e-3)
t = sorted(times)[len(times) // 2]
print(f"read bandwidth (torch.sum over 2 GiB fp32, median of 20): {x.numel() * 4 / t / 1e9:.0f} GB/s")
