"""The CPU benchmark: `deltastate bench` (decode and prefill rows, each with its in-place pass over
the same state bytes measured in the same run) plus numpy's fp32 matrix product GFLOP/s measured
before and after it, written to one JSON.

    python bench/bench_cpu.py --cli build/tools/deltastate --json bench/results/cpu-<machine>.json

The machine is shared or not: the load average before and after is recorded with the numbers,
and each row carries min / median / max over its iterations.
"""
import argparse
import json
import os
import platform
import subprocess
import tempfile
import time

import numpy as np


def matmul_gflops(n=2048, reps=7):
    """Median GFLOP/s of an n x n x n fp32 numpy matmul (numpy's BLAS, its default threads)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    times.sort()
    return {"n": n, "min_gflops": 2 * n**3 / times[-1] / 1e9,
            "median_gflops": 2 * n**3 / times[len(times) // 2] / 1e9,
            "max_gflops": 2 * n**3 / times[0] / 1e9}


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_cli(cli, args):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.json")
        subprocess.run([cli, "bench", *args, "--json", path], check=True)
        with open(path) as f:
            return json.load(f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cli", default="build/tools/deltastate")
    p.add_argument("--json", required=True)
    p.add_argument("--iters", default="20")
    p.add_argument("--prefill-iters", default="5")
    a = p.parse_args()

    result = {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(), "cpu": cpu_model(),
              "cores": os.cpu_count(), "numpy": np.__version__,
              "loadavg_before": os.getloadavg(), "matmul_before": matmul_gflops(), "runs": []}
    for model, ops, batches, iters in [
        ("qwen3-next", "gdn_packed,gdn_recurrent_multi,gdn_replay", "1,8,32", a.iters),
        ("kimi-linear", "kda_packed,kda_replay", "1,8,32", a.iters),
        ("qwen3-next", "gdn_prefill,gdn_prefill_recurrent", "1", a.prefill_iters),
        ("kimi-linear", "kda_prefill,kda_prefill_recurrent", "1", a.prefill_iters),
    ]:
        args = ["--model", model, "--ops", ops, "--batch", batches, "--iters", iters]
        run = run_cli(a.cli, args)
        run["command"] = "deltastate bench " + " ".join(args)
        result["runs"].append(run)
    result["matmul_after"] = matmul_gflops()
    result["loadavg_after"] = os.getloadavg()
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"numpy matmul {result['matmul_before']['median_gflops']:.1f} / "
          f"{result['matmul_after']['median_gflops']:.1f} GFLOP/s (before / after); wrote {a.json}")


if __name__ == "__main__":
    main()
