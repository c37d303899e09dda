"""Chunked prefill benchmark on the GPU: deltastate chunk_prefill (GDN, KDA) beside FLA.

Cases (equal-length sequences, N x T tokens, bf16 q/k/v, K = V = 128):
  GDN (Qwen3-Next, H=16 HV=32): 1x8192, 1x32768, 4x2048, 8x1024, 8x4096; TP4 (H=4 HV=8) 1x8192
  KDA (Kimi-Linear, H=HV=32):   1x8192, 8x1024, 4x2048
For everyone the same inputs: q/k L2-normalized inside the op (use_qk_l2norm_in_kernel=True),
log-space gates g (fp32) and beta (bf16) computed once beforehand from raw logits, an fp32
initial state in and the fp32 final state out (ours [N, HV, V, K]; FLA's [N, HV, K, V] is the
transpose of the same values). KDA also runs with the gate in the kernel (A_log, dt_bias,
lower_bound -5, the safe gate) where both sides take those arguments.

  ours : deltastate.chunk_gated_delta_rule / deltastate.chunk_kda, FLA's argument names (q, k, v,
         g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel;
         initial_state_indices for the pool path, not used here). When the package has no such
         function yet (the Python binding of chunk_prefill is a separate piece of work), ours is
         skipped with a message and FLA's numbers are still recorded.
  FLA  : fla.ops.gated_delta_rule.chunk_gated_delta_rule, fla.ops.kda.chunk_kda (fla-core), in
         their batched [N, T] form (no cu_seqlens, whose host-side chunk indexing would stop a
         CUDA-graph capture); q/k repeated to HV heads if FLA refuses GVA.
  FlashInfer (--flashinfer, GDN only: its SM90 prefill has no KDA): flashinfer.gdn_prefill.
         chunk_gated_delta_rule on the packed [N*T, H, D] tensors with cu_seqlens and
         max_seqlen = T (its context-parallel path chosen by its own "auto" rule), the decay as
         alpha = e^g and beta in fp32 (its dtypes), the fp32 [N, HV, V, K] state in and out (its
         layout is ours). Loaded through ../shared/peers/flashinfer's fi_import on the GPU
         machine (FI_OK=1).

Two times per call and side:
  eager_ms: launched from Python as an engine would without graphs, L2 flushed (a 2x L2 write)
            before each of --reps calls, CUDA-event time of the call, median. Includes the host's
            launch overhead wherever it leaves the GPU idle (FLA's many small kernels).
  graph_ms: GPU time under CUDA-graph replay (bench/harness.py time_graph: input sets rotated so
            that every call reads cold memory, median over replays / calls per replay).

FLOPs (written once, `flops` below): the matmul FLOPs of the chunked algorithm (FLA's form), per
chunk of C = 64 tokens and value head, K = V = D:
  A = K K^T                2 C^2 K      W = T (beta K e^g)     2 C^2 K
  U = T (beta V)           2 C^2 V      v' = U - W S^T         2 C K V
  Q K^T (masked)           2 C^2 K      o = Q S^T e^g + P v'   2 C K V + 2 C^2 V
  S <- S e^{g_L} + v'^T K  2 C K V
  total = 2 C^2 (3K + 2V) + 6 C K V = 11.5 MFLOP per chunk and head at K = V = 128 (the
  triangular solve, ~C^3/3, and the elementwise work are not counted). The same nominal count is
  used for both sides (deltastate computes an equivalent set: K S^T instead of W, no W), so
  TFLOP/s compares times. Rows report TFLOP/s from the graph time.

Correctness per case: relative norm errors ||ours - FLA|| / ||FLA|| of the outputs and of the
final states (both bf16-operand tensor-core implementations; each is ~2-4e-3 from an fp32
recurrence, so their difference is of that order); and each side's errors against an fp32 token
recurrence on the same inputs (`recurrence_fp32`, on the GPU; `--no-accuracy` skips it), the
accuracy the sides are held to: ours no larger than the peers'.

Writes --json (default bench/results/prefill-h200.json) with one row per (case, gate variant).
"""

from __future__ import annotations

import argparse
import inspect
import math
import statistics
import sys

import torch
import torch.nn.functional as F

from harness import (L2_BYTES, Model, gate_params, measure_copy_bandwidth, rotations, time_graph,
                     write_results)

C = 64  # tokens per chunk


def flops(N: int, T: int, HV: int, K: int, V: int) -> float:
    """Matmul FLOPs of the chunked algorithm (module docstring) for N sequences of T tokens."""
    chunks = N * math.ceil(T / C)
    per_chunk = 2 * C * C * (3 * K + 2 * V) + 6 * C * K * V
    return float(chunks * HV * per_chunk)


GDN_CASES = [  # (label, H, HV, N, T)
    ("qwen3-next", 16, 32, 1, 8192),
    ("qwen3-next", 16, 32, 1, 32768),
    ("qwen3-next", 16, 32, 4, 2048),
    ("qwen3-next", 16, 32, 8, 1024),
    ("qwen3-next", 16, 32, 8, 4096),
    ("qwen3-next-tp4", 4, 8, 1, 8192),
]
KDA_CASES = [
    ("kimi-linear", 32, 32, 1, 8192),
    ("kimi-linear", 32, 32, 8, 1024),
    ("kimi-linear", 32, 32, 4, 2048),
]
D = 128
ACT = torch.bfloat16
LOWER_BOUND = -5.0


def accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def recurrence_fp32(x: "Inputs"):
    """The fp32 token recurrence on x's inputs (q, k L2-normalized as in the ops, scale D^-0.5,
    log-space gates, q/k heads shared by HV / H value heads): -> (o [N, T, HV, D], S [N, HV, V, K])."""
    N, T, H, _ = x.q.shape
    HV = x.v.shape[2]

    def norm(t):
        t = t.float()
        return t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)
    q = (norm(x.q) * D ** -0.5).repeat_interleave(HV // H, dim=2)
    k = norm(x.k).repeat_interleave(HV // H, dim=2)
    v, g, beta = x.v.float(), x.g.float(), x.beta.float()
    S = x.h0.clone()
    o = torch.empty(N, T, HV, D, device=x.q.device)
    for t in range(T):
        decay = torch.exp(g[:, t])
        S = S * (decay[..., None, :] if decay.dim() == 3 else decay[..., None, None])
        kt = k[:, t]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("nhvk,nhk->nhv", S, kt))
        S = S + u[..., :, None] * kt[..., None, :]
        o[:, t] = torch.einsum("nhvk,nhk->nhv", S, q[:, t])
    return o, S


def flush_l2(buf: torch.Tensor) -> None:
    buf.zero_()


def time_eager(fn, reps: int) -> float:
    """Median milliseconds of fn() with L2 flushed before each call (CUDA events)."""
    buf = torch.empty(2 * L2_BYTES // 4, dtype=torch.float32, device="cuda")
    fn()  # warm-up (compilation, autotuning)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush_l2(buf)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del buf
    return statistics.median(times)


class Inputs:
    """One set of a case's inputs: q, k, v, raw gate logits and their log-space gates, beta, h0."""

    def __init__(self, op: str, H: int, HV: int, N: int, T: int, A_log, dt_bias, gen):
        dev = "cuda"
        self.q = torch.randn(N, T, H, D, generator=gen).to(dev, ACT)
        self.k = torch.randn(N, T, H, D, generator=gen).to(dev, ACT)
        self.v = torch.randn(N, T, HV, D, generator=gen).to(dev, ACT)
        gw = (HV, D) if op == "kda" else (HV,)
        self.a = torch.randn(N, T, *gw, generator=gen).to(dev, ACT)  # raw gate input
        self.b = torch.randn(N, T, HV, generator=gen).to(dev, ACT)   # raw beta logits
        a = self.a.float()
        if op == "kda":
            dt = dt_bias.view(HV, D)
            self.g = -torch.exp(A_log).view(HV, 1) * F.softplus(a + dt)
        else:
            self.g = -torch.exp(A_log) * F.softplus(a + dt_bias)
        self.beta = torch.sigmoid(self.b.float()).to(ACT)
        self.h0 = 0.02 * torch.randn(N, HV, D, D, generator=gen).to(dev)  # [N, HV, V, K] fp32
        self.h0_kv = self.h0.transpose(-1, -2).contiguous()               # FLA's [N, HV, K, V]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v, self.g, self.beta,
                                                            self.h0)) * 2  # + outputs


def ours_fn(op: str):
    try:
        import deltastate as ds
    except Exception as e:  # noqa: BLE001
        return None, f"import deltastate failed: {e}"
    name = "chunk_kda" if op == "kda" else "chunk_gated_delta_rule"
    fn = getattr(ds, name, None)
    if fn is None:
        return None, (f"deltastate has no `{name}` yet (the Python binding of chunk_prefill is not "
                      "built); ours skipped")
    return fn, None


def fla_fn(op: str):
    try:
        if op == "kda":
            from fla.ops.kda import chunk_kda as fn
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    except Exception as e:  # noqa: BLE001
        return None, f"FLA not importable: {e}"
    return fn, None


def call_ours(fn, x: Inputs, gate_in_kernel: bool, A_log, dt_bias):
    # Our states are V-first ([N, HV, V, K], the pool's layout): say so (FLA's default is K-first).
    kw = dict(scale=D ** -0.5, initial_state=x.h0, output_final_state=True,
              use_qk_l2norm_in_kernel=True, state_v_first=True)
    if gate_in_kernel:
        kw.update(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, lower_bound=LOWER_BOUND)
        return fn(x.q, x.k, x.v, x.a, x.beta, **kw)
    return fn(x.q, x.k, x.v, x.g, x.beta, **kw)


def flashinfer_fn():
    import os
    if os.environ.get("FI_OK") != "1":
        return None, "FlashInfer not staged (FI_OK != 1)"
    try:
        import fi_import
        mods, info = fi_import.load(modules=["flashinfer.gdn_prefill"])
        mod = mods.get("flashinfer.gdn_prefill")
        if mod is None:
            return None, f"flashinfer.gdn_prefill not importable: {info.get('errors')}"
        return mod.chunk_gated_delta_rule, None
    except Exception as e:  # noqa: BLE001
        return None, f"FlashInfer not importable: {type(e).__name__}: {e}"


class FlashInferCall:
    """FlashInfer's GDN prefill on one input set (packed tokens, alpha = e^g, fp32 beta)."""

    def __init__(self, fn):
        self.fn, self.cache = fn, {}

    def packed(self, x: Inputs):
        key = id(x)
        if key not in self.cache:
            N, T, H, _ = x.q.shape
            HV = x.v.shape[2]
            self.cache[key] = dict(
                q=x.q.reshape(N * T, H, D), k=x.k.reshape(N * T, H, D),
                v=x.v.reshape(N * T, HV, D), g=torch.exp(x.g).reshape(N * T, HV).float(),
                beta=x.beta.reshape(N * T, HV).float(),
                cu=torch.arange(0, N + 1, device=x.q.device, dtype=torch.int32) * T, T=T)
        return self.cache[key]

    def __call__(self, x: Inputs):
        p = self.packed(x)
        o, s = self.fn(p["q"], p["k"], p["v"], g=p["g"], beta=p["beta"], scale=D ** -0.5,
                       initial_state=x.h0, output_final_state=True, cu_seqlens=p["cu"],
                       use_qk_l2norm_in_kernel=True, use_cp="auto", max_seqlen=p["T"])
        return o.view_as(x.v), s


class FlaCall:
    """FLA's call on one input set; q/k repeated to HV heads when FLA refuses GVA."""

    def __init__(self, fn, op: str, gate_in_kernel: bool, A_log, dt_bias):
        self.fn, self.op, self.gate, self.A_log, self.dt_bias = fn, op, gate_in_kernel, A_log, dt_bias
        self.repeat = False

    def __call__(self, x: Inputs):
        q, k = x.q, x.k
        if self.repeat:
            r = x.v.shape[2] // q.shape[2]
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        kw = dict(scale=D ** -0.5, initial_state=x.h0_kv, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
        if self.gate:
            kw.update(A_log=self.A_log, dt_bias=self.dt_bias, use_gate_in_kernel=True,
                      safe_gate=True, lower_bound=LOWER_BOUND)
            return self.fn(q, k, x.v, x.a, x.beta, **kw)
        return self.fn(q, k, x.v, x.g, x.beta, **kw)

    def probe(self, x: Inputs):
        try:
            return self(x)
        except Exception:  # noqa: BLE001
            if x.q.shape[2] == x.v.shape[2]:
                raise
            self.repeat = True
            return self(x)


def run_side(name, call, sets, reps, replays, fl):
    """Eager and graph times of one side, or the reason it could not run."""
    out = dict()
    try:
        out["eager_ms"] = round(time_eager(lambda: call(sets[0]), reps), 4)
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{name} eager: {type(e).__name__}: {e}"
        return out
    try:
        t = time_graph([lambda x=x: call(x) for x in sets], replays=replays)
        out["graph_ms"] = round(t * 1e3, 4)
        out["tflops"] = round(fl / t / 1e12, 1)
    except Exception as e:  # noqa: BLE001
        out["graph_error"] = f"{name} graph: {type(e).__name__}: {e}"
        torch.cuda.synchronize()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench/results/prefill-h200.json")
    ap.add_argument("--ops", default="gdn,kda")
    ap.add_argument("--reps", type=int, default=20, help="eager calls per side and case")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--flashinfer", action="store_true",
                    help="also FlashInfer's SM90 GDN prefill (staged: FI_OK=1)")
    ap.add_argument("--cases", default="", help="only cases whose 'NxT' label is listed (1x8192,...)")
    ap.add_argument("--no-accuracy", action="store_true",
                    help="skip the errors against the fp32 token recurrence")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(1234)
    copy_gbps = measure_copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    only = set(filter(None, args.cases.split(",")))

    def save():  # after every row, so that a run stopped by a time limit keeps what it measured
        write_results(args.json, copy_gbps,
                      "equal-length sequences, bf16 q/k/v, q/k L2 norm in the op, log-space g (fp32) and "
                      "beta (bf16) precomputed (KDA also gate in kernel, lower_bound -5), fp32 initial "
                      "state in and final state out; eager_ms: median of CUDA-event times of single "
                      "calls from Python with L2 flushed before each; graph_ms: CUDA-graph replay over "
                      "rotated input sets (cold L2), median of replays / calls; tflops = flops / "
                      "graph time, flops = 2 C^2 (3K + 2V) + 6 C K V per 64-token chunk and value head",
                      rows)

    rows = []
    hdr = (f"{'op':4} {'model':15} {'NxT':>8} {'gate':6} {'ours eager':>10} {'graph':>8} {'TF/s':>6} "
           f"{'FLA eager':>10} {'graph':>8} {'TF/s':>6} {'x(graph)':>8} {'err o':>8} {'err S':>8}")
    print(hdr, flush=True)
    for op in args.ops.split(","):
        ours, why_not_ours = ours_fn(op)
        if ours is None:
            print(f"# {why_not_ours}", flush=True)
        peer, why_not_peer = (None, "--no-peer") if args.no_peer else fla_fn(op)
        if peer is None and not args.no_peer:
            print(f"# {why_not_peer}", flush=True)
        fi, why_not_fi = (None, None)
        if args.flashinfer and op == "gdn":
            fi, why_not_fi = flashinfer_fn()
            if fi is None:
                print(f"# {why_not_fi}", flush=True)
        for label, H, HV, N, T in (KDA_CASES if op == "kda" else GDN_CASES):
            shape = f"{N}x{T}"
            if only and shape not in only:
                continue
            A_log, dt_bias = gate_params(Model(label, op, H, HV, D, D), gen)
            probe = Inputs(op, H, HV, N, T, A_log, dt_bias, gen)
            nr = rotations(probe.nbytes(), at_most=16)
            sets = [probe] + [Inputs(op, H, HV, N, T, A_log, dt_bias, gen) for _ in range(nr - 1)]
            fl = flops(N, T, HV, D, D)
            for gate_in_kernel in ([False, True] if op == "kda" else [False]):
                gate = "kernel" if gate_in_kernel else "log-g"
                row = dict(op=op, model=label, H=H, HV=HV, K=D, V=D, N=N, T=T, gate=gate,
                           lower_bound=LOWER_BOUND if gate_in_kernel else None, flops=fl)
                o_ours = s_ours = o_peer = s_peer = None
                ref = None if args.no_accuracy or gate_in_kernel else recurrence_fp32(sets[0])

                def vs_ref(side, o, s_, kv=False):  # errors against the fp32 recurrence
                    if ref is not None and o is not None:
                        row[f"{side}_err_out_vs_fp32"] = rel(o.float(), ref[0])
                        if s_ is not None:
                            st = s_.float().transpose(-1, -2) if kv else s_.float()
                            row[f"{side}_err_state_vs_fp32"] = rel(st, ref[1])
                if ours is not None:
                    if gate_in_kernel and not accepts(ours, "A_log"):
                        row["ours_error"] = "deltastate's function takes no in-kernel gate"
                    else:
                        c = lambda x: call_ours(ours, x, gate_in_kernel, A_log, dt_bias)  # noqa: E731
                        try:
                            o_ours, s_ours = c(sets[0])
                            vs_ref("ours", o_ours, s_ours)
                            row.update({f"ours_{k}": v for k, v in run_side("ours", c, sets, args.reps,
                                                                           args.replays, fl).items()})
                        except Exception as e:  # noqa: BLE001
                            row["ours_error"] = f"{type(e).__name__}: {e}"
                else:
                    row["ours_error"] = why_not_ours
                if peer is not None:
                    call = FlaCall(peer, op, gate_in_kernel, A_log, dt_bias)
                    if gate_in_kernel and not accepts(peer, "lower_bound"):
                        row["peer_error"] = "this FLA takes no in-kernel gate"
                    else:
                        try:
                            o_peer, s_peer = call.probe(sets[0])
                            vs_ref("peer", o_peer, s_peer, kv=True)
                            row["peer"] = f"{peer.__module__}.{peer.__name__}"
                            row["peer_qk_repeated"] = call.repeat
                            row.update({f"peer_{k}": v for k, v in run_side("FLA", call, sets, args.reps,
                                                                           args.replays, fl).items()})
                        except Exception as e:  # noqa: BLE001
                            row["peer_error"] = f"{type(e).__name__}: {e}"
                if fi is not None and not gate_in_kernel:
                    fcall = FlashInferCall(fi)
                    try:
                        o_fi, s_fi = fcall(sets[0])
                        vs_ref("flashinfer", o_fi, s_fi)
                        row.update({f"flashinfer_{k}": v for k, v in run_side(
                            "FlashInfer", fcall, sets, args.reps, args.replays, fl).items()})
                        if o_ours is not None:
                            row["rel_err_out_vs_flashinfer"] = rel(o_ours.float(), o_fi.float())
                            row["rel_err_state_vs_flashinfer"] = rel(s_ours.float(), s_fi.float())
                        print(f"#   FlashInfer: eager {row.get('flashinfer_eager_ms')} ms, graph "
                              f"{row.get('flashinfer_graph_ms')} ms, "
                              f"{row.get('flashinfer_tflops')} TF/s; ours vs FlashInfer: o "
                              f"{row.get('rel_err_out_vs_flashinfer', float('nan')):.2e}, S "
                              f"{row.get('rel_err_state_vs_flashinfer', float('nan')):.2e}",
                              flush=True)
                    except Exception as e:  # noqa: BLE001
                        row["flashinfer_error"] = f"{type(e).__name__}: {e}"
                        print(f"#   flashinfer_error: {row['flashinfer_error']}", flush=True)
                if o_ours is not None and o_peer is not None:
                    row["rel_err_out_vs_peer"] = rel(o_ours.float(), o_peer.float())
                    if s_ours is not None and s_peer is not None:
                        row["rel_err_state_vs_peer"] = rel(s_ours.float(),
                                                           s_peer.float().transpose(-1, -2))
                og, pg = row.get("ours_graph_ms"), row.get("peer_graph_ms")
                ratio = f"{pg / og:.2f}" if og and pg else "-"

                def fmt(v, f="{:.3f}"):
                    return f.format(v) if isinstance(v, (int, float)) else "-"
                print(f"{op:4} {label:15} {shape:>8} {gate:6} {fmt(row.get('ours_eager_ms')):>10} "
                      f"{fmt(og):>8} {fmt(row.get('ours_tflops'), '{:.1f}'):>6} "
                      f"{fmt(row.get('peer_eager_ms')):>10} {fmt(pg):>8} "
                      f"{fmt(row.get('peer_tflops'), '{:.1f}'):>6} {ratio:>8} "
                      f"{fmt(row.get('rel_err_out_vs_peer'), '{:.2e}'):>8} "
                      f"{fmt(row.get('rel_err_state_vs_peer'), '{:.2e}'):>8}", flush=True)
                if ref is not None:
                    print("#   vs fp32 recurrence (o, S): " + ", ".join(
                        f"{side} {row[f'{side}_err_out_vs_fp32']:.2e} "
                        f"{row.get(f'{side}_err_state_vs_fp32', float('nan')):.2e}"
                        for side in ("ours", "peer", "flashinfer")
                        if f"{side}_err_out_vs_fp32" in row), flush=True)
                    del ref
                for k in ("ours_error", "peer_error", "ours_graph_error", "peer_graph_error"):
                    if k in row:
                        print(f"#   {k}: {row[k]}", flush=True)
                rows.append(row)
                save()
            del sets, probe
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
