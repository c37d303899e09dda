"""A small driver for Nsight Compute: a few packed-decode launches (ours, then FLA's) at one batch
size, so that `ncu --launch-skip/--launch-count` can pick one warm launch of each kernel.

  ncu --clock-control none -k regex:'recurrent|fused_recurrent' --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats python3 bench/profile_decode.py

With --replay L --sglang PATH, after ours, 2L steps of SGLang's Triton ReplaySSM (PATH: its
fused_recurrent_linear_replayssm.py, as bench_replayssm.py --peer) on its own copies of the pool
and rings, its launch i at cursor i mod L: `ncu -k regex:fused_recurrent_linear_replayssm
--launch-skip 8 --launch-count 1` picks its appending step at cursor 8, beside ours (`-k
regex:replay_` with the same skip).

With --copy it runs the copy yardstick over the bytes of the state the decode launch reads and
writes instead (harness.copy_pass: an in-place elementwise pass, the decode benchmark's copy_us),
for side-by-side memory tables.
"""

import argparse

import torch

import deltastate as ds
from bench_decode import QUANTIZED, Case, fla_gdn_launches, fla_kda_launches, state_bytes
from harness import DTYPES, MODELS, copy_buffer, copy_pass

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="qwen3-next")
ap.add_argument("--dtype", default="f32", help="f32, bf16, or a quantized name of bench_decode "
                "(f8, f8n, i8; no peer runs them)")
ap.add_argument("--B", type=int, default=256)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--no-peer", action="store_true")
ap.add_argument("--copy", action="store_true",
                help="instead of decode: the copy yardstick (harness.copy_pass) over the state "
                     "bytes the decode launch reads and writes")
ap.add_argument("--replay", type=int, default=0,
                help="ring length L: run 2L ReplaySSM steps (cursors advanced on the device) "
                     "instead of plain decode; launch i has cursor i mod L (flush at L-1)")
ap.add_argument("--sglang", metavar="PATH", default=None,
                help="with --replay: then 2L steps of SGLang's Triton ReplaySSM from PATH "
                     "(bench_replayssm.py --peer's file or folder) on its own buffers")
args = ap.parse_args()
m = MODELS[args.model]
if args.copy:
    buf = copy_buffer(state_bytes(m, args.B, DTYPES[args.dtype]), DTYPES[args.dtype])
    for _ in range(args.reps):
        copy_pass(buf)
    torch.cuda.synchronize()
    print("done")
    raise SystemExit(0)
if args.replay:
    from bench_replayssm import ReplayCase
    case = ReplayCase(m, DTYPES[args.dtype], args.B, args.replay, torch.Generator().manual_seed(0))
    for _ in range(2 * args.replay):
        case.replay(0)()
    if args.sglang:
        from bench_replayssm import PeerReplay, load_peer
        peer = PeerReplay(load_peer(args.sglang), case)  # its cursors from 0, advanced each step
        for _ in range(2 * args.replay):
            peer.replay(0)()
    args.no_peer = True
else:
    fmt = QUANTIZED.get(args.dtype)
    case = Case(m, DTYPES[args.dtype] if fmt is None else fmt[0], args.B,
                torch.Generator().manual_seed(0), fmt=fmt)
    args.no_peer = args.no_peer or fmt is not None
    for _ in range(args.reps):
        case.ours(0)()
if not args.no_peer:
    launches, keep = (fla_gdn_launches if m.op == "gdn" else fla_kda_launches)(case)
    for _ in range(args.reps):
        launches[0]()
torch.cuda.synchronize()
print("done")
