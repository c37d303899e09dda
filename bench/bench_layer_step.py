"""Layer-step benchmark on the GPU: one decode step of a GDN / KDA layer's recurrent half.

For each model (Qwen3-Next GDN with its gated RMSNorm, Kimi-Linear KDA), state dtype (fp32,
bf16) and batch B, in the same run:
  fused   : deltastate {gdn,kda}_fused_decode_step, one launch (conv update + gates + L2 norm +
            delta rule + gated RMSNorm for GDN), in place on a state pool and a conv-window pool
            (SGLang's [slots, conv_dim, W-1] layout) with random slot indices;
  unfused : deltastate's own chain: causal_conv1d_update (indexed windows) -> packed decode ->
            the gated norm (FLA's rms_norm_gated when importable, else torch ops);
  decode  : deltastate packed decode alone (the bound the fused step is measured against at large
            B);
  peer    : the closest chain the peers ship, when importable: FLA's Triton causal_conv1d_update
            (its best case: a contiguous [B, conv_dim, W] cache, no indices) -> SGLang's Triton
            packed decode (sglang.kernels.ops.attention.fla.fused_recurrent) or, without SGLang,
            FLA's fused_recurrent (GDN: fused_recurrent_gated_delta_rule_fwd on gathered states;
            KDA: fused_recurrent_kda_fwd in place) -> FLA's rms_norm_gated (GDN). Each row names
            the chain it ran (`peer`).
Cold L2 and CUDA-graph replay of whole steps (bench/harness.py): every launch set rotates over
inputs and slot sets whose total exceeds 4x L2. Writes bench/results/layer-step-h200.json rows
{model, state_dtype, B, fused_us, unfused_us, decode_us, peer, peer_us, x_peer, x_unfused,
pct_of_decode, max_err_vs_unfused (B = 8)} and prints a table. With --replay-lens L,..: also the
fused step in ReplaySSM mode and our ReplaySSM chain (conv update -> replayssm_decode -> the norm)
on rings of length L, per step over whole cursor cycles as bench_replayssm.py times them
(replay<L>_fused_us, replay<L>_unfused_us).
"""

from __future__ import annotations

import argparse
import sys

import torch

import deltastate as ds
from harness import (DTYPES, MODELS, gate_params, launch_floor, measure_copy_bandwidth,
                     pool_slots_for, rotations, slot_sets, time_graph, write_results)

BATCHES = [1, 2, 4, 8, 16, 64, 256]
ACT = torch.bfloat16
WIDTH = 4


def _fla_norm():
    try:
        from fla.modules.fused_norm_gate import rms_norm_gated
    except Exception:  # noqa: BLE001 - any import failure: no FLA norm
        return None
    return rms_norm_gated


def _fla_conv():
    try:
        from fla.modules.conv.triton.ops import causal_conv1d_update
    except Exception:  # noqa: BLE001
        return None
    return causal_conv1d_update


def _sglang_packed(kda: bool):
    try:
        from sglang.kernels.ops.attention.fla import fused_recurrent as sgl
    except Exception:  # noqa: BLE001
        return None
    name = ("fused_recurrent_kda_packed_decode" if kda
            else "fused_recurrent_gated_delta_rule_packed_decode")
    return getattr(sgl, name, None)


def torch_gated_norm(o, z, w, eps):
    """Qwen3NextRMSNormGated in torch ops (the unfused chain's norm without FLA)."""
    x = o.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (w * x.to(o.dtype)) * torch.nn.functional.silu(z.float())


class Case:
    def __init__(self, m, dtype, B: int, gen: torch.Generator, pdl: bool):
        self.m, self.dtype, self.B, self.pdl = m, dtype, B, pdl
        self.kda = m.op == "kda"
        self.norm = not self.kda  # Qwen3-Next's gated RMSNorm; Kimi-Linear's norm is not fused
        self.conv_dim = 2 * m.H * m.K + m.HV * m.V
        esz = torch.tensor([], dtype=dtype).element_size()
        slot_bytes = m.HV * m.V * m.K * esz + self.conv_dim * (WIDTH - 1) * 2
        per_launch = 2 * B * slot_bytes + B * self.conv_dim * 2 * 3
        self.nr = rotations(per_launch)
        self.slots = pool_slots_for(B, slot_bytes, self.nr)
        self.pool = (0.02 * torch.randn(self.slots, m.HV, m.V, m.K, device="cuda")).to(dtype)
        self.win = torch.randn(self.slots, self.conv_dim, WIDTH - 1, device="cuda", dtype=ACT)
        self.w = 0.3 * torch.randn(self.conv_dim, WIDTH, device="cuda", dtype=ACT)
        self.nw = (1 + 0.1 * torch.randn(m.V, device="cuda")).to(ACT)
        self.A_log, self.dt_bias = gate_params(m, gen)
        a_width = m.HV * m.K if self.kda else m.HV
        r = range(self.nr)
        self.x = [torch.randn(B, self.conv_dim, device="cuda", dtype=ACT) for _ in r]
        self.a = [torch.randn(B, a_width, device="cuda", dtype=ACT) for _ in r]
        self.b = [torch.randn(B, m.HV, device="cuda", dtype=ACT) for _ in r]
        self.z = [torch.randn(B, m.HV, m.V, device="cuda", dtype=ACT) for _ in r]
        self.out = [torch.empty(B, m.HV, m.V, device="cuda", dtype=ACT) for _ in r]
        self.out4 = [torch.empty(B, 1, m.HV, m.V, device="cuda", dtype=ACT) for _ in r]
        self.idx = slot_sets(self.slots, B, self.nr, gen)
        self.scale = m.K ** -0.5
        self.fla_norm = _fla_norm()
        self.L = 0

    def add_rings(self, L: int):
        """ReplaySSM rings over the same pool (the checkpoint) and per-rotation cursors."""
        m, S = self.m, self.slots
        self.L = L
        self.d = torch.zeros(S, m.HV, L, m.V, device="cuda", dtype=self.dtype)
        self.k = torch.zeros(S, m.H, L, m.K, device="cuda", dtype=ACT)
        gshape = (S, m.HV, L, m.K) if self.kda else (S, m.HV, L)
        self.g = torch.zeros(gshape, device="cuda", dtype=torch.float32)
        self.wp = [torch.zeros(self.B, device="cuda", dtype=torch.int32) for _ in range(self.nr)]
        a_shape = (self.B, m.HV, m.K) if self.kda else (self.B, m.HV)
        self.a3 = [a.reshape(a_shape) for a in self.a]
        self.dt3 = self.dt_bias.reshape(m.HV, m.K) if self.kda else self.dt_bias
        self.idx32 = [i.to(torch.int32) for i in self.idx]

    def fused_replay(self, r):
        """The fused step in ReplaySSM mode, cursors advanced on the device."""
        fn = ds.kda_fused_decode_step if self.kda else ds.gdn_fused_decode_step
        norm = dict(norm_weight=self.nw, z=self.z[r]) if self.norm else {}
        return lambda: fn(self.x[r], self.w, self.win, self.a[r], self.b[r], self.A_log,
                          self.dt_bias, self.pool, self.out[r], self.idx32[r], scale=self.scale,
                          **norm, pdl=self.pdl, d_cache=self.d, k_cache=self.k, g_cache=self.g,
                          write_pos=self.wp[r], advance_write_pos=True)

    def unfused_replay(self, r):
        """Our ReplaySSM chain: the conv op, replayssm_decode on its output, then the norm."""
        norm = self.norm_fn(r) if self.norm else None

        def step():
            y = ds.causal_conv1d_update(self.x[r], self.win, self.w, None, "silu", None,
                                        self.idx[r], pdl=self.pdl)
            ds.fused_recurrent_linear_replayssm_decode(
                y, self.a3[r], self.b[r], self.A_log, self.dt3, self.scale, self.pool, self.d,
                self.k, self.g, self.out4[r], self.idx32[r], self.wp[r], None, is_kda=self.kda,
                use_qk_l2norm_in_kernel=True, advance_write_pos=True, pdl=self.pdl)
            if norm is not None:
                norm()
        return step

    def fused(self, r):
        fn = ds.kda_fused_decode_step if self.kda else ds.gdn_fused_decode_step
        norm = dict(norm_weight=self.nw, z=self.z[r]) if self.norm else {}
        return lambda: fn(self.x[r], self.w, self.win, self.a[r], self.b[r], self.A_log,
                          self.dt_bias, self.pool, self.out[r], self.idx[r], scale=self.scale,
                          **norm, pdl=self.pdl)

    def decode(self, r, x=None):
        fn = (ds.fused_recurrent_kda_packed_decode if self.kda
              else ds.fused_recurrent_gated_delta_rule_packed_decode)
        x = self.x[r] if x is None else x
        return lambda: fn(x, self.a[r], self.b[r], self.A_log, self.dt_bias, self.scale,
                          self.pool, self.out4[r], self.idx[r], True, pdl=self.pdl)

    def norm_fn(self, r):
        m = self.m
        o, z = self.out4[r].view(-1, m.V), self.z[r].view(-1, m.V)
        if self.fla_norm is not None:
            return lambda: self.fla_norm(o, z, self.nw, None, "swish", eps=1e-6)
        return lambda: torch_gated_norm(o, z, self.nw, 1e-6)

    def unfused(self, r):
        """Our chain: the conv op (its output allocated by the wrapper, from the graph's pool
        under capture), packed decode on it, then the norm."""
        dec_fn = (ds.fused_recurrent_kda_packed_decode if self.kda
                  else ds.fused_recurrent_gated_delta_rule_packed_decode)
        norm = self.norm_fn(r) if self.norm else None

        def step():
            y = ds.causal_conv1d_update(self.x[r], self.win, self.w, None, "silu", None,
                                        self.idx[r], pdl=self.pdl)
            dec_fn(y, self.a[r], self.b[r], self.A_log, self.dt_bias, self.scale, self.pool,
                   self.out4[r], self.idx[r], True, pdl=self.pdl)
            if norm is not None:
                norm()
        return step


def peer_launches(case: Case):
    """The peer chain per rotation (or None): its name and callables."""
    m, B = case.m, case.B
    fla_conv, fla_norm, sgl = _fla_conv(), _fla_norm(), _sglang_packed(case.kda)
    if fla_conv is None:
        return None, None
    caches = [torch.randn(B, case.conv_dim, WIDTH, device="cuda", dtype=ACT)
              for _ in range(case.nr)]
    w = case.w.contiguous()
    launches = []
    if sgl is not None:
        name = "fla.causal_conv1d_update + sglang packed decode"
    else:
        name = ("fla.causal_conv1d_update + fla.fused_recurrent_"
                + ("kda_fwd" if case.kda else "gated_delta_rule_fwd"))
    if case.norm:
        name += " + fla.rms_norm_gated" if fla_norm else " + torch gated norm"
    for r in range(case.nr):
        def run(r=r):
            y, _ = fla_conv(case.x[r], caches[r], weight=w, bias=None, activation="silu")
            if sgl is not None:
                sgl(y, case.a[r], case.b[r], case.A_log, case.dt_bias, case.scale, case.pool,
                    case.out4[r], case.idx[r], True)
                o = case.out4[r]
            else:
                q, k, v = torch.split(y, [m.H * m.K, m.H * m.K, m.HV * m.V], dim=1)
                q = q.reshape(B, 1, m.H, m.K)
                k = k.reshape(B, 1, m.H, m.K)
                v = v.reshape(B, 1, m.HV, m.V)
                if case.kda:
                    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
                    cu = torch.arange(B + 1, device="cuda", dtype=torch.int64)
                    o = torch.empty_like(v.reshape(1, B, m.HV, m.V))
                    fused_recurrent_kda_fwd(
                        q=q.reshape(1, B, m.H, m.K), k=k.reshape(1, B, m.H, m.K),
                        v=v.reshape(1, B, m.HV, m.V),
                        g=case.a[r].reshape(1, B, m.HV, m.K), beta=case.b[r][None],
                        A_log=case.A_log, dt_bias=case.dt_bias, initial_state=case.pool,
                        scale=case.scale, inplace_final_state=True, state_v_first=True,
                        cu_seqlens=cu, ssm_state_indices=case.idx[r],
                        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                        use_beta_sigmoid_in_kernel=True, out=o)
                else:
                    from fla.ops.gated_delta_rule.fused_recurrent import (
                        fused_recurrent_gated_delta_rule_fwd)
                    o, _ = fused_recurrent_gated_delta_rule_fwd(
                        q=q, k=k, v=v, g=case.a[r][:, None], beta=case.b[r][:, None],
                        A_log=case.A_log, dt_bias=case.dt_bias, scale=case.scale,
                        initial_state=case.pool[case.idx[r].long()],
                        output_final_state=True, use_qk_l2norm_in_kernel=True,
                        use_beta_sigmoid_in_kernel=True, state_v_first=True)
            if case.norm:
                oo, zz = o.reshape(-1, m.V), case.z[r].view(-1, m.V)
                if fla_norm is not None:
                    fla_norm(oo, zz, case.nw, None, "swish", eps=1e-6)
                else:
                    torch_gated_norm(oo, zz, case.nw, 1e-6)
        launches.append(run)
    return name, launches


def check_against_unfused(case: Case) -> float:
    """Max |fused - unfused chain| on one step from the same states, windows and inputs."""
    saved_pool, saved_win = case.pool.clone(), case.win.clone()
    case.fused(0)()
    got = case.out[0].float().clone()
    case.pool.copy_(saved_pool)
    case.win.copy_(saved_win)
    y = ds.causal_conv1d_update(case.x[0], case.win, case.w, None, "silu", None, case.idx[0])
    case.decode(0, y)()
    want = case.out4[0][:, 0].float()
    if case.norm:
        m = case.m
        want = torch_gated_norm(case.out4[0][:, 0], case.z[0], case.nw, 1e-6).to(ACT).float()
    case.pool.copy_(saved_pool)
    case.win.copy_(saved_win)
    return (got - want).abs().max().item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench/results/layer-step-h200.json")
    ap.add_argument("--models", default="qwen3-next,kimi-linear")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--pdl", action="store_true", help="launch ours with pdl=True")
    ap.add_argument("--replay-lens", default="",
                    help="also time the ReplaySSM fused step and our ReplaySSM chain at these ring "
                         "lengths (per step over whole cursor cycles), e.g. 16")
    args = ap.parse_args()

    gen = torch.Generator().manual_seed(1234)
    copy_gbps = measure_copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    floor_us = launch_floor() * 1e6
    print(f"# graph-launch floor: {floor_us:.2f} us", flush=True)
    print(f"{'model':12} {'state':5} {'B':>4} {'fused':>8} {'unfused':>8} {'decode':>8} "
          f"{'peer':>8} {'x_peer':>6} {'x_unf':>6} {'%dec':>6}  peer chain")
    rows = []

    def save():  # after every row, so that a run stopped by a time limit keeps what it measured
        write_results(args.json, copy_gbps,
                      "cold L2 (rotating inputs, slot sets and caches > 4x L2), CUDA-graph replay "
                      "of whole steps, median over replays", rows,
                      launch_floor_us=round(floor_us, 2))

    for name in args.models.split(","):
        m = MODELS[name]
        for dname in args.dtypes.split(","):
            for B in map(int, args.batches.split(",")):
                case = Case(m, DTYPES[dname], B, gen, args.pdl)
                fused = time_graph([case.fused(r) for r in range(case.nr)], replays=args.replays)
                unfused = time_graph([case.unfused(r) for r in range(case.nr)],
                                     replays=args.replays)
                decode = time_graph([case.decode(r) for r in range(case.nr)],
                                    replays=args.replays)
                peer, peer_t = None, None
                if not args.no_peer:
                    peer, pl = peer_launches(case)
                    if pl is not None:
                        peer_t = time_graph(pl, replays=args.replays)
                err = check_against_unfused(case) if B == 8 else None
                replay = {}
                for L in [int(x) for x in args.replay_lens.split(",") if x]:
                    # L steps of every rotation, step-major, as bench_replayssm.py: whole cursor
                    # cycles, so every graph replay starts each rotation at cursor 0 again.
                    case.add_rings(L)
                    for key, fn in (("fused", case.fused_replay), ("unfused", case.unfused_replay)):
                        for w in case.wp:
                            w.zero_()
                        t = time_graph([fn(r) for _ in range(L) for r in range(case.nr)],
                                       replays=args.replays, warmup=0)
                        assert all(int(w.max()) == 0 for w in case.wp), "cursors left their cycle"
                        replay[f"replay{L}_{key}_us"] = round(t * 1e6, 2)
                row = dict(model=m.name, state_dtype=dname, B=B, fused_us=round(fused * 1e6, 2),
                           unfused_us=round(unfused * 1e6, 2), decode_us=round(decode * 1e6, 2),
                           peer=peer, peer_us=round(peer_t * 1e6, 2) if peer_t else None,
                           x_peer=round(peer_t / fused, 2) if peer_t else None,
                           x_unfused=round(unfused / fused, 2),
                           pct_of_decode=round(100 * decode / fused, 1),
                           max_err_vs_unfused=err, **replay)
                rows.append(row)
                print(f"{m.name:12} {dname:5} {B:4} {row['fused_us']:8.2f} "
                      f"{row['unfused_us']:8.2f} {row['decode_us']:8.2f} "
                      f"{row['peer_us'] or float('nan'):8.2f} {row['x_peer'] or float('nan'):6.2f} "
                      f"{row['x_unfused']:6.2f} {row['pct_of_decode']:6.1f}  {peer or '-'}"
                      + "".join(f"  {k} {v:.2f}" for k, v in replay.items()), flush=True)
                del case
                torch.cuda.empty_cache()
                save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
