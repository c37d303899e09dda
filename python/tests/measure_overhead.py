#!/usr/bin/env python
"""Host-side call overhead of the GDN packed decode op on CUDA tensors (a script, not a test).

Measures the host time (µs) one call of `fused_recurrent_gated_delta_rule_packed_decode` takes at
a small batch (B=1 by default, Qwen3-Next per-rank shape) on CUDA tensors: the Python wrapper,
the tvm-ffi argument conversion (DLPack C exchange API for torch tensors), the core's validation
and the kernel launch. There is no synchronization inside the timed loops: calls are timed one by
one in chunks of `--chunk` (small enough that the launch queue never fills, so a call never waits
for the GPU), with a device sync between chunks, outside the timing. Reported: the median (and
p10/p90) over all calls of

  public     deltastate.fused_recurrent_gated_delta_rule_packed_decode (the eager path)
  ffi        the tvm-ffi function itself (deltastate._lib.lib.gdn_packed_decode), no wrapper
  torch_ops  torch.ops.deltastate.gdn_packed_decode (the custom op torch.compile calls), eager
  torch_op_baseline  one small torch op launch (out.zero_()), for scale

and prints one line of JSON. Usage: python python/tests/measure_overhead.py [--B 1] [--iters N]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))]


def timed(fn, iters, chunk, sync):
    """Per-call host times in µs: `iters` calls in chunks of `chunk`, synced between chunks."""
    samples = []
    clock = time.perf_counter_ns
    for _ in range(max(1, iters // chunk)):
        sync()
        for _ in range(chunk):
            t0 = clock()
            fn()
            samples.append(clock() - t0)
    sync()
    return [s / 1000.0 for s in samples]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--HV", type=int, default=32)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", help="activation dtype (state is float32)")
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--chunk", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--target-us", type=float, default=5.0)
    args = ap.parse_args(argv)

    import torch

    import deltastate as ds
    from deltastate._lib import lib
    from deltastate import torch_ops  # noqa: F401 - registers torch.ops.deltastate

    if not (torch.cuda.is_available() and ds.cuda_available()):
        print(json.dumps({"metric": "gdn_packed_decode_host_overhead_us", "skipped":
                          "needs a CUDA device and deltastate built with CUDA"}))
        return 0

    dev = torch.device("cuda", torch.cuda.current_device())
    act = getattr(torch, args.dtype)
    B, H, HV, K, V = args.B, args.H, args.HV, args.K, args.V
    g = torch.Generator(device=dev).manual_seed(0)
    mixed_qkv = torch.randn(B, 2 * H * K + HV * V, device=dev, generator=g).to(act)
    a = torch.randn(B, HV, device=dev, generator=g).to(act)
    b = torch.randn(B, HV, device=dev, generator=g).to(act)
    A_log = torch.randn(HV, device=dev, generator=g) * 0.5
    dt_bias = torch.randn(HV, device=dev, generator=g) * 0.5
    state = torch.zeros(args.slots, HV, V, K, device=dev)
    out = torch.empty(B, 1, HV, V, device=dev, dtype=act)
    idx = torch.arange(1, B + 1, device=dev, dtype=torch.int32)
    scale = K ** -0.5

    op = ds.fused_recurrent_gated_delta_rule_packed_decode
    custom = torch.ops.deltastate.gdn_packed_decode.default
    # The bare binding call, its arguments in the binding's own order.
    named = {"mixed_qkv": mixed_qkv, "a": a, "b": b, "A_log": A_log, "dt_bias": dt_bias,
             "scale": scale, "initial_state": state, "out": out, "ssm_state_indices": idx,
             "use_qk_l2norm_in_kernel": True, "lower_bound": None, "round_beta": False,
             "check_indices": -1, "pdl": False}
    ffi_args = tuple(named[n.split(":")[0]] for n in lib.op_signatures()["gdn_packed_decode"])
    ffi = lib.gdn_packed_decode
    variants = {
        "public": lambda: op(mixed_qkv, a, b, A_log, dt_bias, scale, state, out, idx),
        "ffi": lambda: ffi(*ffi_args),
        "torch_ops": lambda: custom(mixed_qkv, a, b, A_log, dt_bias, scale, state, out, idx),
        "torch_op_baseline": lambda: out.zero_(),
    }
    sync = torch.cuda.synchronize

    # GPU time per call, for context (CUDA events around a chunk of calls).
    for fn in variants.values():
        for _ in range(args.warmup // len(variants) + 1):
            fn()
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.chunk):
        variants["public"]()
    end.record()
    sync()
    gpu_us = start.elapsed_time(end) * 1000.0 / args.chunk

    result = {
        "metric": "gdn_packed_decode_host_overhead_us",
        "device": torch.cuda.get_device_name(dev),
        "shape": {"B": B, "H": H, "HV": HV, "K": K, "V": V, "slots": args.slots},
        "dtype": args.dtype,
        "iters": (args.iters // args.chunk) * args.chunk,
        "chunk": args.chunk,
    }
    for name, fn in variants.items():
        xs = timed(fn, args.iters, args.chunk, sync)
        result[f"{name}_us"] = round(statistics.median(xs), 3)
        result[f"{name}_p10_us"] = round(percentile(xs, 10), 3)
        result[f"{name}_p90_us"] = round(percentile(xs, 90), 3)
    result["wrapper_us"] = round(result["public_us"] - result["ffi_us"], 3)
    result["gpu_us_per_call"] = round(gpu_us, 3)
    result["target_us"] = args.target_us
    result["meets_target"] = result["public_us"] <= args.target_us
    result["versions"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tvm_ffi": __import__("tvm_ffi").__version__,
        "deltastate": ds.__version__,
        "torch_dlpack_c_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
