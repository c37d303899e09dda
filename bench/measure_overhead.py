#!/usr/bin/env python
"""Host-side call overhead of the decode ops (a benchmark script, not a test).

Measures the host time (µs) one call takes at a small batch (B=1 by default): the Python wrapper,
the tvm-ffi argument conversion (DLPack C exchange API for torch tensors), the core's validation
and the kernel launch. On CUDA (the default, Qwen3-Next per-rank shape) there is no
synchronization inside the timed loops: calls are timed one by one in chunks of `--chunk` (small
enough that the launch queue never fills, so a call never waits for the GPU), with a device sync
between chunks, outside the timing. With `--device cpu` the CPU kernel runs inside the call, so
the default shape there is tiny (H=1, HV=2, K=V=16) and DELTASTATE_NUM_THREADS defaults to 1: what
is left is the wrapper, the conversion and the validation. Reported: the median (and p10/p90)
over all calls of

  public     deltastate.fused_recurrent_gated_delta_rule_packed_decode (the eager path)
  ffi        the tvm-ffi function itself (deltastate._lib.lib.gdn_packed_decode), no wrapper
  torch_ops  torch.ops.deltastate.gdn_packed_decode (the custom op torch.compile calls), eager
  recurrent_public  deltastate.recurrent_gated_delta_rule at T=1 into the pool (out given)
  replay_public     deltastate.fused_recurrent_linear_replayssm_decode (an appending step)
  public_numpy      the public packed decode on numpy arrays (CPU only)
  torch_op_baseline  one small torch op launch (out.zero_()), for scale

and prints one line of JSON. Usage: python bench/measure_overhead.py [--device cpu] [--B 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

CPU_SHAPE = {"H": 1, "HV": 2, "K": 16, "V": 16}
CUDA_SHAPE = {"H": 16, "HV": 32, "K": 128, "V": 128}


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
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--B", type=int, default=1)
    for dim in ("H", "HV", "K", "V"):
        ap.add_argument(f"--{dim}", type=int, default=None,
                        help=f"default {CUDA_SHAPE[dim]} on CUDA, {CPU_SHAPE[dim]} on the CPU")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--L", type=int, default=4, help="ReplaySSM ring length")
    ap.add_argument("--dtype", default="bfloat16", help="activation dtype (state is float32)")
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--chunk", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--target-us", type=float, default=5.0)
    args = ap.parse_args(argv)
    on_cpu = args.device == "cpu"
    if on_cpu:
        os.environ.setdefault("DELTASTATE_NUM_THREADS", "1")  # read when the first CPU op runs
    shape = CPU_SHAPE if on_cpu else CUDA_SHAPE
    for dim in shape:
        if getattr(args, dim) is None:
            setattr(args, dim, shape[dim])

    import torch

    import deltastate as ds
    from deltastate._lib import lib
    from deltastate import torch_ops  # noqa: F401 - registers torch.ops.deltastate

    if not on_cpu and not (torch.cuda.is_available() and ds.cuda_available()):
        print(json.dumps({"metric": "gdn_packed_decode_host_overhead_us", "skipped":
                          "needs a CUDA device and deltastate built with CUDA (or --device cpu)"}))
        return 0

    dev = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    act = getattr(torch, args.dtype)
    B, H, HV, K, V, L = args.B, args.H, args.HV, args.K, args.V, args.L
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
    # recurrent at T=1 (q, k, v views of the packed row; g, beta in log / probability space)
    q = mixed_qkv[:, : H * K].reshape(B, 1, H, K)
    k = mixed_qkv[:, H * K: 2 * H * K].reshape(B, 1, H, K)
    v = mixed_qkv[:, 2 * H * K:].reshape(B, 1, HV, V)
    g_log = -torch.rand(B, 1, HV, device=dev, generator=g)
    beta = torch.rand(B, 1, HV, device=dev, generator=g)
    o = torch.empty(B, 1, HV, V, device=dev, dtype=act)
    # ReplaySSM: rings of L records, cursors that never reach L-1 (write_pos reset each call is
    # not needed: without advance_write_pos the op appends at the same position)
    d_cache = torch.zeros(args.slots, HV, L, V, device=dev)
    k_cache = torch.zeros(args.slots, H, L, K, device=dev, dtype=act)
    g_cache = torch.zeros(args.slots, HV, L, device=dev)
    write_pos = torch.zeros(B, device=dev, dtype=torch.int32)

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
        "recurrent_public": lambda: ds.recurrent_gated_delta_rule(
            q, k, v, g_log, beta, scale=scale, initial_state=state, ssm_state_indices=idx,
            output=o),
        "replay_public": lambda: ds.fused_recurrent_linear_replayssm_decode(
            mixed_qkv, a, b, A_log, dt_bias, scale, state, d_cache, k_cache, g_cache, out, idx,
            write_pos),
        "torch_op_baseline": lambda: out.zero_(),
    }
    if on_cpu:
        import numpy as np

        npf = lambda t: t.float().numpy().copy()  # noqa: E731 - numpy has no bfloat16
        n_x, n_a, n_b, n_A, n_dt = (npf(t) for t in (mixed_qkv, a, b, A_log, dt_bias))
        n_state, n_out, n_idx = state.numpy().copy(), npf(out), idx.numpy().copy()
        variants["public_numpy"] = lambda: op(n_x, n_a, n_b, n_A, n_dt, scale, n_state, n_out,
                                              n_idx)
    sync = (lambda: None) if on_cpu else torch.cuda.synchronize

    for fn in variants.values():
        for _ in range(args.warmup // len(variants) + 1):
            fn()
    sync()
    gpu_us = None
    if not on_cpu:  # GPU time per call, for context (CUDA events around a chunk of calls)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.chunk):
            variants["public"]()
        end.record()
        sync()
        gpu_us = round(start.elapsed_time(end) * 1000.0 / args.chunk, 3)

    result = {
        "metric": "gdn_packed_decode_host_overhead_us",
        "device": "cpu" if on_cpu else torch.cuda.get_device_name(dev),
        "shape": {"B": B, "H": H, "HV": HV, "K": K, "V": V, "slots": args.slots, "L": L},
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
    if gpu_us is not None:
        result["gpu_us_per_call"] = gpu_us
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
