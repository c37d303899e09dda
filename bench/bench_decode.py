"""Decode benchmark on the GPU: deltastate packed decode (GDN, KDA) vs FLA, side by side.

For each model (Qwen3-Next GDN, Kimi-Linear KDA), state dtype (fp32, bf16) and batch B, it times
  ours : fused_recurrent_{gated_delta_rule,kda}_packed_decode, in place on a pool larger than B
         with random slot indices (bf16 activations, gates/l2norm/beta-sigmoid in the kernel);
  FLA  : GDN fused_recurrent_gated_delta_rule_fwd (its best case: no slot indices, a fresh
         final-state buffer, state_v_first) and KDA fused_recurrent_kda_fwd (in place with
         ssm_state_indices), the same math surface, on the same inputs;
cold L2 and CUDA-graph replay (bench/harness.py). Bytes are counted explicitly: state read + write,
every input read once, every output written once. Writes bench/results/decode-h200.json rows
{op, model, state_dtype, B, us, GBps, pct_copy, peer, peer_us} and prints a table; each row also
has copy_us, an in-place pass over the case's state bytes (read and written back, harness.copy_time)
timed the same way (cold L2, graph replay: the ramp and tail of a copy of that size), and
pct_size_copy = 100 * copy_us / us. --slots sequential gives each launch B consecutive slots in
order instead of a random set (the pattern of a peer without indices). --dtypes f8,i8 time
quantized pools (a StatePool's codes and per-row fp32 scales, its default rounding); no peer runs
them, so their rows carry our bf16 row of the same case as the comparison (list bf16 first).
"""

from __future__ import annotations

import argparse
import sys

import torch

import deltastate as ds
from harness import (DTYPES, MODELS, copy_time, gate_params, launch_floor, measure_copy_bandwidth,
                     pool_slots_for, rotations, slot_sets, time_graph, write_results)

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
ACT = torch.bfloat16


def io_bytes(m, B: int) -> int:
    """Activation bytes per packed-decode call: mixed_qkv, a, b, indices, out, A_log, dt_bias."""
    width = 2 * m.H * m.K + m.HV * m.V
    a_width = m.HV * m.K if m.op == "kda" else m.HV
    return (B * width * 2 + B * a_width * 2 + B * m.HV * 2 + B * 4 + B * m.HV * m.V * 2
            + m.HV * 4 + a_width * 4)


# Quantized pools (docs/STATE_FORMATS.md): 1-byte codes and one fp32 scale per state row, in a
# ds.StatePool's slot envelope; their rows have no peer, and are compared with our bf16 rows.
# Their names: f8 and i8 with the format's default rounding (stochastic for float8_e4m3fn, nearest
# for int8), f8n float8 rounded to nearest.
QUANTIZED = {"f8": ("float8_e4m3fn", None), "f8n": ("float8_e4m3fn", "nearest"),
             "i8": ("int8", None)}
QUANTIZED_DTYPES = ("float8_e4m3fn", "int8")


def state_bytes(m, B: int, dtype) -> int:
    """The state bytes one call reads (and writes back): codes and their scales when quantized."""
    if dtype in QUANTIZED_DTYPES:
        return B * m.HV * m.V * (m.K + 4)
    return B * m.HV * m.V * m.K * torch.tensor([], dtype=dtype).element_size()


def quantized_pool(m, slots: int, fmt: tuple, gen: torch.Generator):
    """A one-layer quantized pool on the GPU with random codes and scales of a ~0.02 state;
    fmt = (state_dtype, state_rounding)."""
    state_dtype, rounding = fmt
    pool = ds.StatePool(layers=1, slots=slots, HV=m.HV, V=m.V, K=m.K, state_dtype=state_dtype,
                        state_rounding=rounding, device="cuda", framework="torch")
    codes = torch.randn(slots, m.HV, m.V, m.K, generator=gen)
    if state_dtype == "int8":
        pool.layer_state(0).copy_((codes * 40).clamp(-127, 127).round().to(torch.int8))
        pool.layer_scales(0).fill_(0.02 * 3 / 127)
    else:
        pool.layer_state(0).copy_((codes * 120).clamp(-448, 448).to(torch.float8_e4m3fn))
        pool.layer_scales(0).fill_(0.02 * 3 / 448)
    return pool


class Case:
    """The inputs of one (model, dtype, B) case: NR rotations of activations and slot sets over
    one pool of random states."""

    def __init__(self, m, dtype, B: int, gen: torch.Generator, pdl: bool = False,
                 sequential: bool = False, fmt: tuple = None):
        self.m, self.dtype, self.B, self.pdl = m, dtype, B, pdl
        per_launch = 2 * state_bytes(m, B, dtype) + io_bytes(m, B)
        self.nr = rotations(per_launch)
        slot_bytes = state_bytes(m, 1, dtype)
        self.slots = pool_slots_for(B, slot_bytes, self.nr)
        self.fmt = {}
        if fmt is not None:
            self.qpool = quantized_pool(m, self.slots, fmt, gen)
            self.pool, self.fmt = self.qpool.layer_state(0), self.qpool.state_format(0)
        else:
            self.pool = (0.02 * torch.randn(self.slots, m.HV, m.V, m.K, device="cuda")).to(dtype)
        self.A_log, self.dt_bias = gate_params(m, gen)
        width = 2 * m.H * m.K + m.HV * m.V
        a_width = m.HV * m.K if m.op == "kda" else m.HV
        self.x = [torch.randn(B, width, device="cuda", dtype=ACT) for _ in range(self.nr)]
        self.a = [torch.randn(B, a_width, device="cuda", dtype=ACT) for _ in range(self.nr)]
        self.b = [torch.randn(B, m.HV, device="cuda", dtype=ACT) for _ in range(self.nr)]
        self.out = [torch.empty(B, 1, m.HV, m.V, device="cuda", dtype=ACT) for _ in range(self.nr)]
        self.idx = slot_sets(self.slots, B, self.nr, gen, sequential)
        self.scale = m.K ** -0.5

    def ours(self, r: int):
        m = self.m
        if m.op == "gdn":
            fn = ds.fused_recurrent_gated_delta_rule_packed_decode
        else:
            fn = ds.fused_recurrent_kda_packed_decode
        return lambda: fn(self.x[r], self.a[r], self.b[r], self.A_log, self.dt_bias, self.scale,
                          self.pool, self.out[r], self.idx[r], True, pdl=self.pdl, **self.fmt)

    def split_qkv(self, r: int):
        m, B = self.m, self.B
        q, k, v = torch.split(self.x[r], [m.H * m.K, m.H * m.K, m.HV * m.V], dim=1)
        return (q.reshape(B, m.H, m.K).contiguous(), k.reshape(B, m.H, m.K).contiguous(),
                v.reshape(B, m.HV, m.V).contiguous())


def fla_gdn_launches(case: Case):
    from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd

    m, B = case.m, case.B
    launches, keep = [], []
    for r in range(case.nr):
        q, k, v = case.split_qkv(r)
        q, k, v = q[:, None], k[:, None], v[:, None]  # [B, 1, H, K]
        g = case.a[r][:, None].contiguous()           # [B, 1, HV] raw gate input
        beta = case.b[r][:, None].contiguous()        # [B, 1, HV] logits
        h0 = case.pool[case.idx[r].long()].contiguous()  # [B, HV, V, K] its own buffer
        keep.append((q, k, v, g, beta, h0))

        def run(q=q, k=k, v=v, g=g, beta=beta, h0=h0):
            return fused_recurrent_gated_delta_rule_fwd(
                q=q, k=k, v=v, g=g, beta=beta, A_log=case.A_log, dt_bias=case.dt_bias,
                scale=case.scale, initial_state=h0, output_final_state=True,
                use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                state_v_first=True)
        launches.append(run)
    return launches, keep


def fla_kda_launches(case: Case):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    m, B = case.m, case.B
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int64)
    launches, keep = [], []
    for r in range(case.nr):
        q, k, v = case.split_qkv(r)
        q, k, v = q[None], k[None], v[None]              # [1, B, H, K] varlen
        g = case.a[r].reshape(1, B, m.HV, m.K).contiguous()
        beta = case.b[r][None].contiguous()              # [1, B, HV]
        out = torch.empty_like(v)
        keep.append((q, k, v, g, beta, out))

        def run(q=q, k=k, v=v, g=g, beta=beta, out=out, idx=case.idx[r]):
            return fused_recurrent_kda_fwd(
                q=q, k=k, v=v, g=g, beta=beta, A_log=case.A_log, dt_bias=case.dt_bias,
                initial_state=case.pool, scale=case.scale, inplace_final_state=True,
                state_v_first=True, cu_seqlens=cu, ssm_state_indices=idx,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, out=out)
        launches.append(run)
    return launches, keep


def check_against_fla(case: Case) -> float:
    """Max |ours - FLA| on the outputs of one step from the same states and inputs."""
    m = case.m
    saved = case.pool.clone()
    case.ours(0)()
    ours = case.out[0].float().clone()
    case.pool.copy_(saved)
    if m.op == "gdn":
        launches, _ = fla_gdn_launches(case)
        o, _ = launches[0]()
        peer = o[:, 0].float()
    else:
        launches, keep = fla_kda_launches(case)
        launches[0]()
        peer = keep[0][5][0].float()
    case.pool.copy_(saved)
    return (ours[:, 0] - peer).abs().max().item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench/results/decode-h200.json")
    ap.add_argument("--models", default="qwen3-next,kimi-linear")
    ap.add_argument("--dtypes", default="f32,bf16",
                    help="f32, bf16, f8 (float8_e4m3fn codes, stochastic rounding), f8n "
                         "(rounded to nearest), i8 (int8 codes, nearest)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--pdl", action="store_true",
                    help="launch ours with programmatic dependent launch (pdl=True)")
    ap.add_argument("--slots", choices=["random", "sequential"], default="random",
                    help="each launch's slot set: random (default) or B consecutive slots")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(1234)
    copy_gbps = measure_copy_bandwidth()
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu}, copy bandwidth {copy_gbps:.0f} GB/s (read + write)", flush=True)
    floor_us = launch_floor() * 1e6
    print(f"# graph-launch floor (a one-element kernel, same graph replay): {floor_us:.2f} us",
          flush=True)
    rows = []
    header = (f"{'op':5} {'model':12} {'state':5} {'B':>4} {'us':>9} {'GB/s':>7} {'%copy':>6} "
              f"{'copy_us':>8} {'%szcp':>6} {'peer':>28} {'peer_us':>9} {'x':>5}")
    print(header)
    for name in args.models.split(","):
        m = MODELS[name]
        for dname in args.dtypes.split(","):
            fmt = QUANTIZED.get(dname)
            dtype = DTYPES[dname] if fmt is None else fmt[0]
            for B in map(int, args.batches.split(",")):
                case = Case(m, dtype, B, gen, pdl=args.pdl, sequential=args.slots == "sequential",
                            fmt=fmt)
                launches = [case.ours(r) for r in range(case.nr)]
                t = time_graph(launches, replays=args.replays)
                nbytes = 2 * state_bytes(m, B, dtype) + io_bytes(m, B)
                gbps = nbytes / t / 1e9
                copy_us = copy_time(state_bytes(m, B, dtype),
                                    torch.float32 if dname in QUANTIZED else dtype,
                                    replays=args.replays) * 1e6
                peer, peer_us, err = None, None, None
                if dname in QUANTIZED:
                    bf16 = [r["us"] for r in rows
                            if (r["model"], r["state_dtype"], r["B"]) == (m.name, "bf16", B)]
                    if bf16:
                        peer, peer_us = "ours, bf16 state", bf16[0]
                elif not args.no_peer:
                    if m.op == "gdn":
                        peer = "fla.fused_recurrent_gated_delta_rule_fwd"
                        pl, keep = fla_gdn_launches(case)
                    else:
                        peer = "fla.fused_recurrent_kda_fwd"
                        pl, keep = fla_kda_launches(case)
                    peer_us = time_graph(pl, replays=args.replays) * 1e6
                    if B == 8:
                        err = check_against_fla(case)
                    del pl, keep
                row = dict(op=m.op, model=m.name, state_dtype=dname, B=B, us=round(t * 1e6, 2),
                           GBps=round(gbps, 1), pct_copy=round(100 * gbps / copy_gbps, 1),
                           bytes=nbytes, copy_us=round(copy_us, 2),
                           pct_size_copy=round(100 * copy_us / (t * 1e6), 1), pdl=args.pdl, peer=peer,
                           peer_us=None if peer_us is None else round(peer_us, 2))
                if err is not None:
                    row["max_abs_diff_vs_peer"] = err
                rows.append(row)
                x = f"{peer_us / (t * 1e6):.2f}" if peer_us else "-"
                print(f"{m.op:5} {m.name:12} {dname:5} {B:>4} {t * 1e6:9.2f} {gbps:7.0f} "
                      f"{100 * gbps / copy_gbps:6.1f} {copy_us:8.2f} {100 * copy_us / (t * 1e6):6.1f} "
                      f"{str(peer):>28.28} "
                      f"{peer_us if peer_us is None else round(peer_us, 2)!s:>9} {x:>5}"
                      + (f"  (|ours-FLA| max {err:.2e})" if err is not None else ""), flush=True)
                del case
                torch.cuda.empty_cache()
    write_results(args.json, copy_gbps,
                  "cold L2 (rotating slot sets and inputs over > 4x L2), CUDA-graph replay at "
                  "every B, median of graph replays / launches per replay; bytes = state read + "
                  "write + inputs + outputs"
                  + ("; ours launched with programmatic dependent launch (pdl=True)" if args.pdl
                     else "")
                  + ("; slots: B consecutive per launch" if args.slots == "sequential" else "")
                  + "; copy_us: an in-place elementwise pass over the state bytes, same method",
                  rows, launch_floor_us=round(floor_us, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
