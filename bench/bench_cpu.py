"""The CPU benchmark: `deltastate bench` (decode and prefill rows, each with its in-place pass over
the same state bytes measured in the same run) plus numpy's fp32 matrix product GFLOP/s measured
before and after it, written to one JSON.

    python bench/bench_cpu.py --cli build/tools/deltastate --json bench/results/cpu-<machine>.json

The machine is shared or not: the load average before and after is recorded with the numbers,
each row carries min / median / max over its iterations, and the whole set runs --repeats times
(matmul between the sets); `summary` has, per row, the median over the repeats of the op's median,
of the pass's median and of their ratio.
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
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()

    result = {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(), "cpu": cpu_model(),
              "cores": os.cpu_count(), "numpy": np.__version__,
              "loadavg_before": os.getloadavg(), "matmul": [], "runs": []}
    sets = [
        ("qwen3-next", "gdn_packed,gdn_recurrent_multi,gdn_replay", "1,8,32", a.iters),
        ("kimi-linear", "kda_packed,kda_replay", "1,8,32", a.iters),
        ("qwen3-next", "gdn_prefill,gdn_prefill_recurrent", "1", a.prefill_iters),
        ("kimi-linear", "kda_prefill,kda_prefill_recurrent", "1", a.prefill_iters),
    ]
    for rep in range(a.repeats):
        result["matmul"].append(matmul_gflops())
        for model, ops, batches, iters in sets:
            args = ["--model", model, "--ops", ops, "--batch", batches, "--iters", iters]
            run = run_cli(a.cli, args)
            run["command"] = "deltastate bench " + " ".join(args)
            run["repeat"] = rep
            result["runs"].append(run)
    result["matmul"].append(matmul_gflops())
    result["loadavg_after"] = os.getloadavg()

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2]

    rows = {}
    for run in result["runs"]:
        for r in run["rows"]:
            rows.setdefault((r["op"], r["B"], r["T"]), []).append(r)
    result["summary"] = {
        "matmul_median_gflops": median([m["median_gflops"] for m in result["matmul"]]),
        "rows": [{"op": op, "B": B, "T": T,
                  "median_us": median([r["median_us"] for r in rs]),
                  "inplace_median_us": median([r["inplace_median_us"] for r in rs]),
                  "op_over_pass": median([r["median_us"] / r["inplace_median_us"] for r in rs]),
                  "gflops": median([r["flops"] / (r["median_us"] * 1e3) for r in rs])}
                 for (op, B, T), rs in rows.items()]}
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    sm = result["summary"]
    print(f"numpy matmul (median of {len(result['matmul'])}): {sm['matmul_median_gflops']:.1f} GFLOP/s")
    for r in sm["rows"]:
        print(f"{r['op']:<24} B={r['B']:<3} T={r['T']:<5} median {r['median_us']:10.1f} us  "
              f"pass {r['inplace_median_us']:9.1f} us  op/pass {r['op_over_pass']:6.2f}  "
              f"{r['gflops']:6.1f} GFLOP/s")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
