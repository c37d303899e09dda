"""Shared benchmark harness: copy bandwidth, cold-L2 CUDA-graph timing, model shapes, inputs.

Protocol (docs/PERFORMANCE.md, "How we measure"): every timed launch touches states that are not
in L2 (launches rotate over disjoint slot sets and input buffers whose total exceeds 4x the 60 MB
L2; at small B a warm working set would fit in L2 and time faster than DRAM allows), launches are
replayed from a CUDA graph (so host launch cost is excluded at every batch size), and the
reported time is the median over many graph replays divided by the launches per replay.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

L2_BYTES = 60 * 1024 * 1024
COLD_BYTES = 4 * L2_BYTES + 16 * 1024 * 1024  # > 4x L2 touched between two uses of a buffer


@dataclass(frozen=True)
class Model:
    name: str
    op: str  # "gdn" or "kda"
    H: int
    HV: int
    K: int
    V: int


QWEN3_NEXT = Model("qwen3-next", "gdn", 16, 32, 128, 128)
KIMI_LINEAR = Model("kimi-linear", "kda", 32, 32, 128, 128)
MODELS = {m.name: m for m in (QWEN3_NEXT, KIMI_LINEAR)}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def measure_copy_bandwidth(nbytes: int = 2 * 1024**3, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written), median of reps."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times) / 1e9


def copy_buffer(nbytes: int, dtype=torch.float32) -> torch.Tensor:
    """A device buffer of `nbytes` of `dtype` for copy_pass."""
    return torch.zeros(max(1, nbytes // torch.tensor([], dtype=dtype).element_size()),
                       device="cuda", dtype=dtype)


def copy_pass(buf: torch.Tensor) -> None:
    """The copy yardstick at a case's own size: one in-place pass over `buf` (torch's vectorized
    elementwise mul_ by 1: every byte read and written back where it lies, as decode updates the
    pool). Not a memcpy node: under graph replay it runs on the copy engines, slower than the SMs
    at large sizes (docs/PERFORMANCE.md); and a same-dtype copy_ is a memcpy that Nsight Compute
    cannot profile as a kernel."""
    buf.mul_(1.0)


def copy_time(nbytes: int, dtype=torch.float32, replays: int = 30) -> float:
    """Seconds per copy_pass over `nbytes` of `dtype`, timed the way time_graph times ours: cold
    L2 (rotating buffers), CUDA-graph replay, so ramp and tail are included, beside
    measure_copy_bandwidth's 2 GiB steady state."""
    bufs = [copy_buffer(nbytes, dtype) for _ in range(rotations(2 * nbytes))]
    t = time_graph([lambda b=b: copy_pass(b) for b in bufs], replays=replays)
    del bufs
    torch.cuda.empty_cache()
    return t


def rotations(bytes_per_launch: int, at_least: int = 2, at_most: int = 256) -> int:
    """How many disjoint buffer sets to cycle through so that consecutive uses of one set are
    separated by more than 4x L2 of other traffic."""
    return max(at_least, min(at_most, math.ceil(COLD_BYTES / max(1, bytes_per_launch)) + 1))


def time_graph(launches, replays: int = 30, warmup: int = 3) -> float:
    """Captures `launches` (callables, one kernel launch each) into one CUDA graph and returns
    the median seconds per launch over `replays` graph replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in launches:  # compile / warm up outside the capture
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for fn in launches:
            fn()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del graph
    return statistics.median(times) / len(launches)


def launch_floor(launches: int = 64, replays: int = 30) -> float:
    """Seconds per launch of a one-element kernel (torch's in-place add) replayed from a CUDA
    graph the way time_graph replays ours: the graph-launch floor under any kernel's time."""
    x = torch.zeros(1, device="cuda")
    return time_graph([lambda: x.add_(1.0)] * launches, replays=replays)


def slot_sets(pool_slots: int, B: int, count: int, gen: torch.Generator,
              sequential: bool = False) -> list[torch.Tensor]:
    """`count` index vectors of B distinct slots each, consecutive sets disjoint where the pool
    allows (random permutations of the pool, cut into runs of B; sequential: runs of B
    consecutive slots in order, the access pattern of a peer without slot indices)."""
    if sequential:
        runs = max(1, pool_slots // B)
        return [((r % runs) * B + torch.arange(B)).to(torch.int32).cuda() for r in range(count)]
    sets, perm, pos = [], torch.randperm(pool_slots, generator=gen), 0
    for _ in range(count):
        if pos + B > pool_slots:
            perm, pos = torch.randperm(pool_slots, generator=gen), 0
        sets.append(perm[pos:pos + B].to(torch.int32).cuda())
        pos += B
    return sets


def pool_slots_for(B: int, slot_bytes: int, launches: int) -> int:
    """A pool larger than the batch (2B at least) and large enough that `launches` rotations of B
    slots stay disjoint where memory allows (capped at ~8 GiB of state)."""
    want = max(2 * B, B * launches)
    cap = max(2 * B, (8 * 1024**3) // slot_bytes)
    return min(want, cap)


def gate_params(model: Model, gen: torch.Generator):
    """A_log ~ log U(1, 16), dt_bias ~ N(0, 0.1^2): realistic decays (fp32, as the models keep them)."""
    A_log = torch.empty(model.HV).uniform_(1.0, 16.0, generator=gen).log().cuda()
    width = model.HV * model.K if model.op == "kda" else model.HV
    dt_bias = (0.1 * torch.randn(width, generator=gen)).cuda()
    return A_log, dt_bias


def write_results(path: str, copy_gbps: float, method: str, rows: list, **extra) -> None:
    """The results file: gpu, date, command, copy_GBps, torch, host, method, any `extra` top-level
    fields, rows."""
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                  command=" ".join(["python"] + sys.argv), copy_GBps=round(copy_gbps, 1),
                  torch=torch.__version__, host=platform.node(), method=method, **extra,
                  rows=rows)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def kernel_times(steps, reps: int) -> list[tuple[str, float, float]]:
    """(kernel name, mean µs, launches) per call of a step, under torch.profiler, over `reps`
    rounds of `steps` (callables launching one step each)."""
    for s in steps:  # warm up: first-call costs (module loads, autotuning) out of the profile
        s()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for s in steps:
                s()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time
            count[e.name] += 1
    n = reps * len(steps)
    return sorted(((k, total[k] / n, count[k] / n) for k in total), key=lambda r: -r[1])
