"""Multi-token and verify benchmark on the GPU: deltastate's multi-token recurrent op and
speculative verify beside FLA's fused_recurrent over the same T tokens (and, with --flashinfer,
FlashInfer's gated_delta_rule_mtp).

For each model (Qwen3-Next GDN, Kimi-Linear KDA), state dtype (fp32, bf16; with --dtypes also
fp8 / int8: a quantized pool with its fp32 row scales, docs/STATE_FORMATS.md), T in {2, 4, 8} and
batch B, it times
  recurrent : recurrent_gated_delta_rule / recurrent_kda over T tokens per sequence, in place on a
              pool with random slot indices (the multi-token kernel): bytes = state read + write
              + inputs + outputs;
  verify    : verify with SGLang's convention (scratch rows [B, T, HV, V, K], no state update):
              bytes = state read + T states written + inputs + outputs; a quantized pool's
              scratch is quantized too (its codes and fp32 scales [B, T, HV, V]), or float32
              with --scratch f32 (issue #36's target: verify into an fp8 scratch at B = 64 at
              >= 1.7x the fp32 verify's speed);
  FLA       : GDN fused_recurrent_gated_delta_rule_fwd and KDA fused_recurrent_kda_fwd (varlen),
              each in its best case: a gathered [B, HV, V, K] initial state, a fresh final
              state, state_v_first; the recurrent op's work;
  copy_us   : an in-place pass over the case's state bytes (harness.copy_time), the yardstick;
cold L2 and CUDA-graph replay (bench/harness.py). Rows {mode, model, state_dtype, T, B, us,
bytes, GBps, pct_copy, copy_us, peer, peer_us}; prints a table; writes
bench/results/verify-h200.json. FlashInfer (--flashinfer, GDN fp32 states only): import it as
../shared/peers/flashinfer/README.md says first (fi_import on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import sys

import torch

import deltastate as ds
from harness import (DTYPES, MODELS, copy_time, gate_params, launch_floor, measure_copy_bandwidth,
                     pool_slots_for, rotations, slot_sets, time_graph, write_results)

BATCHES = [1, 8, 64, 256]
TOKENS = [2, 4, 8]
ACT = torch.bfloat16


# The 1-byte formats: a pool of codes with one fp32 scale per (slot, head, V row).
QUANTIZED = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


def is_quantized(dtype) -> bool:
    return dtype in QUANTIZED.values()


def state_bytes(m, B: int, dtype) -> int:
    if is_quantized(dtype):  # codes and the row scales
        return B * m.HV * m.V * (m.K + 4)
    return B * m.HV * m.V * m.K * torch.tensor([], dtype=dtype).element_size()


def quantized_states(shape, dtype):
    """Codes of small states (|x| ~ 0.02) in a 1-byte format and their fp32 row scales."""
    if dtype == torch.int8:
        codes = torch.randint(-127, 128, shape, device="cuda", dtype=torch.int8)
        return codes, torch.full(shape[:-1], 0.02 / 127, device="cuda")
    codes = torch.randn(*shape, device="cuda").mul_(100.0).clamp_(-448, 448).to(dtype)
    return codes, torch.full(shape[:-1], 0.02 / 448, device="cuda")


def io_bytes(m, B: int, T: int) -> int:
    """q, k, v, g, beta (bf16), out (bf16), indices, A_log, dt_bias."""
    g_width = m.HV * m.K if m.op == "kda" else m.HV
    per_token = 2 * m.H * m.K * 2 + m.HV * m.V * 2 + g_width * 2 + m.HV * 2 + m.HV * m.V * 2
    return B * T * per_token + B * 4 + m.HV * 4 + g_width * 4


class Case:
    """One (model, dtype, T, B) case: `nr` rotations of inputs, slot sets and scratch buffers."""

    def __init__(self, m, dtype, T: int, B: int, gen: torch.Generator, with_scratch: bool,
                 scratch_dtype=None, rounding=None):
        self.m, self.dtype, self.T, self.B = m, dtype, T, B
        self.scratch_dtype = scratch_dtype or dtype
        per_launch = (state_bytes(m, B, dtype) + T * state_bytes(m, B, self.scratch_dtype)
                      + io_bytes(m, B, T))
        self.nr = rotations(per_launch)
        self.slots = pool_slots_for(B, state_bytes(m, 1, dtype), self.nr)
        self.fmt = {}  # a quantized pool's format keywords
        if is_quantized(dtype):
            self.pool, scales = quantized_states((self.slots, m.HV, m.V, m.K), dtype)
            self.fmt = {"state_scales": scales, "state_rounding": rounding}
            if rounding == "stochastic" or (rounding is None and dtype == torch.float8_e4m3fn):
                # stochastic rounding (float8's default): the step counter, advanced per call
                self.fmt["rounding_step"] = torch.zeros(1, device="cuda", dtype=torch.int64)
        else:
            self.pool = (0.02 * torch.randn(self.slots, m.HV, m.V, m.K, device="cuda")).to(dtype)
        self.A_log, self.dt_bias = gate_params(m, gen)
        self.idx = slot_sets(self.slots, B, self.nr, gen)
        gshape = (B, T, m.HV, m.K) if m.op == "kda" else (B, T, m.HV)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=ACT)  # noqa: E731
        self.q = [mk(B, T, m.H, m.K) for _ in range(self.nr)]
        self.k = [mk(B, T, m.H, m.K) for _ in range(self.nr)]
        self.v = [mk(B, T, m.HV, m.V) for _ in range(self.nr)]
        self.g = [mk(*gshape) for _ in range(self.nr)]
        self.beta = [mk(B, T, m.HV) for _ in range(self.nr)]
        self.out = [torch.empty(B, T, m.HV, m.V, device="cuda", dtype=ACT)
                    for _ in range(self.nr)]
        sd = self.scratch_dtype
        self.scratch = ([torch.empty(B, T, m.HV, m.V, m.K, device="cuda", dtype=sd)
                         for _ in range(self.nr)] if with_scratch else None)
        self.scratch_scales = ([torch.empty(B, T, m.HV, m.V, device="cuda")
                                for _ in range(self.nr)]
                               if with_scratch and is_quantized(sd) else None)
        self.scale = m.K ** -0.5

    def recurrent(self, r: int):
        op = ds.recurrent_kda if self.m.op == "kda" else ds.recurrent_gated_delta_rule

        def run():
            op(self.q[r], self.k[r], self.v[r], self.g[r], self.beta[r], A_log=self.A_log,
               dt_bias=self.dt_bias, scale=self.scale, initial_state=self.pool,
               use_gate_in_kernel=True, ssm_state_indices=self.idx[r], output=self.out[r],
               beta_is_logit=True, **self.fmt)
        return run

    def verify(self, r: int):
        kw = dict(self.fmt)
        if self.scratch_scales is not None:
            kw["intermediate_state_scales"] = self.scratch_scales[r]

        def run():
            ds.verify(self.q[r], self.k[r], self.v[r], self.g[r], self.beta[r], self.out[r],
                      self.pool, self.idx[r], A_log=self.A_log, dt_bias=self.dt_bias,
                      scale=self.scale, is_kda=self.m.op == "kda", update_state=False,
                      intermediate_states=self.scratch[r], **kw)
        return run


def fla_launches(case: Case):
    m, B, T = case.m, case.B, case.T
    launches, keep = [], []
    if m.op == "gdn":
        from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd

        for r in range(case.nr):
            h0 = case.pool[case.idx[r].long()].contiguous()
            keep.append(h0)

            def run(r=r, h0=h0):
                return fused_recurrent_gated_delta_rule_fwd(
                    q=case.q[r], k=case.k[r], v=case.v[r], g=case.g[r], beta=case.beta[r],
                    A_log=case.A_log, dt_bias=case.dt_bias, scale=case.scale, initial_state=h0,
                    output_final_state=True, use_qk_l2norm_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, state_v_first=True)
            launches.append(run)
        return launches, keep
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    # A gathered initial state and a fresh final state, as for GDN: FLA's in-place path
    # (ssm_state_indices) reads one slot index per token (vLLM's [N, T] spec slots), so a 1-D
    # index of one slot per sequence would be read past its end for T > 1.
    cu = torch.arange(0, B * T + 1, T, device="cuda", dtype=torch.int64)
    for r in range(case.nr):
        q, k, v = (x.reshape(1, B * T, *x.shape[2:]) for x in (case.q[r], case.k[r], case.v[r]))
        g = case.g[r].reshape(1, B * T, m.HV, m.K)
        beta = case.beta[r].reshape(1, B * T, m.HV)
        out = torch.empty_like(v)
        h0 = case.pool[case.idx[r].long()].contiguous()
        keep.append((q, k, v, g, beta, out, h0))

        def run(q=q, k=k, v=v, g=g, beta=beta, out=out, h0=h0):
            return fused_recurrent_kda_fwd(
                q=q, k=k, v=v, g=g, beta=beta, A_log=case.A_log, dt_bias=case.dt_bias,
                initial_state=h0, scale=case.scale, output_final_state=True,
                inplace_final_state=False, state_v_first=True, cu_seqlens=cu,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, out=out)
        launches.append(run)
    return launches, keep


def flashinfer_launches(case: Case, fi):
    mtp = fi["flashinfer.gdn_decode"].gated_delta_rule_mtp
    launches = []
    for r in range(case.nr):
        def run(r=r):
            mtp(case.q[r], case.k[r], case.v[r], initial_state=case.pool,
                initial_state_indices=case.idx[r], A_log=case.A_log, a=case.g[r],
                dt_bias=case.dt_bias, b=case.beta[r], scale=case.scale, output=case.out[r],
                intermediate_states_buffer=case.scratch[r], disable_state_update=True,
                use_qk_l2norm=True)
        launches.append(run)
    return launches


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench/results/verify-h200.json")
    ap.add_argument("--models", default="qwen3-next,kimi-linear")
    ap.add_argument("--dtypes", default="f32,bf16",
                    help="state dtypes: f32, bf16, fp8, int8 (quantized pools)")
    ap.add_argument("--rounding", default=None, choices=("nearest", "stochastic"),
                    help="a quantized pool's rounding (and its scratch's); default: the format's "
                         "(float8 stochastic, int8 nearest)")
    ap.add_argument("--scratch", default="state", choices=("state", "f32"),
                    help="verify's scratch: the state's dtype (a quantized pool's: quantized, "
                         "with fp32 row scales), or float32")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--modes", default="recurrent,verify")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--flashinfer", action="store_true",
                    help="also time FlashInfer's gated_delta_rule_mtp (GDN, fp32 states)")
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args()

    fi = None
    if args.flashinfer:
        import fi_import

        fi, _ = fi_import.load()
    gen = torch.Generator().manual_seed(1234)
    copy_gbps = measure_copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    floor_us = launch_floor() * 1e6
    print(f"# graph-launch floor: {floor_us:.2f} us", flush=True)
    print(f"{'mode':9} {'model':12} {'state':5} {'T':>2} {'B':>4} {'us':>9} {'MB':>8} "
          f"{'GB/s':>7} {'%copy':>6} {'copy_us':>8} {'peer':>24} {'peer_us':>9}")
    rows = []
    modes = args.modes.split(",")

    def save():  # after every case, so that a run stopped by a time limit keeps what it measured
        write_results(args.json, copy_gbps,
                      "cold L2 (rotating slot sets, inputs and scratch buffers over > 4x L2), "
                      "CUDA-graph replay, median of graph replays / launches per replay; bytes = "
                      "state read + states written (recurrent: 1, verify: T) + inputs + outputs; "
                      "copy_us: an in-place pass over half those state bytes (read + written), "
                      "same method", rows, launch_floor_us=round(floor_us, 2))

    for name in args.models.split(","):
        m = MODELS[name]
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname] if dname in DTYPES else QUANTIZED[dname]
            scratch_dtype = torch.float32 if args.scratch == "f32" else dtype
            quantized = is_quantized(dtype)
            for T in map(int, args.tokens.split(",")):
                for B in map(int, args.batches.split(",")):
                    case = Case(m, dtype, T, B, gen, with_scratch="verify" in modes,
                                scratch_dtype=scratch_dtype, rounding=args.rounding)
                    for mode in modes:
                        written = (state_bytes(m, B, dtype) if mode == "recurrent"
                                   else T * state_bytes(m, B, scratch_dtype))
                        state_io = state_bytes(m, B, dtype) + written
                        nbytes = state_io + io_bytes(m, B, T)
                        fn = case.recurrent if mode == "recurrent" else case.verify
                        t = time_graph([fn(r) for r in range(case.nr)], replays=args.replays)
                        copy_us = copy_time(state_io // 2, torch.float32 if quantized else dtype,
                                            replays=args.replays) * 1e6
                        peer, peer_us = None, None
                        if mode == "recurrent" and not args.no_peer and not quantized:
                            peer = f"fla.fused_recurrent_{'kda' if m.op == 'kda' else 'gdn'}"
                            pl, keep = fla_launches(case)
                            peer_us = time_graph(pl, replays=args.replays) * 1e6
                            del pl, keep
                        if mode == "verify" and fi is not None and m.op == "gdn" and dname == "f32":
                            peer = "flashinfer.gated_delta_rule_mtp"
                            peer_us = time_graph(flashinfer_launches(case, fi),
                                                 replays=args.replays) * 1e6
                        gbps = nbytes / t / 1e9
                        rows.append(dict(mode=mode, op=m.op, model=m.name, state_dtype=dname,
                                         rounding=(args.rounding or "default") if quantized
                                         else None,
                                         scratch=(None if mode != "verify" else
                                                  str(scratch_dtype).replace("torch.", "")),
                                         T=T,
                                         B=B, us=round(t * 1e6, 2), bytes=nbytes,
                                         GBps=round(gbps, 1),
                                         pct_copy=round(100 * gbps / copy_gbps, 1),
                                         copy_us=round(copy_us, 2), peer=peer,
                                         peer_us=None if peer_us is None else round(peer_us, 2)))
                        print(f"{mode:9} {m.name:12} {dname:5} {T:>2} {B:>4} {t * 1e6:9.2f} "
                              f"{nbytes / 1e6:8.1f} {gbps:7.0f} {100 * gbps / copy_gbps:6.1f} "
                              f"{copy_us:8.2f} {str(peer):>24.24} "
                              f"{'-' if peer_us is None else f'{peer_us:.2f}':>9}", flush=True)
                    del case
                    torch.cuda.empty_cache()
                    save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
