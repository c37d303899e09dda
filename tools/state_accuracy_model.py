#!/usr/bin/env python3
"""Model-level check of the recurrent-state formats (issue #36, section 1): HF transformers'
Qwen3-Next and Kimi-Linear, small random-weight models (small_config of
deltastate.integrations.transformers: hidden 256, 4 layers of which 3 linear attention, K = V =
64), greedy decoding of 512 tokens with the state in fp32 against the state in each format of
tools/state_accuracy.py.

A format is emulated in the cache: after the prompt's prefill and after every decode step, each
linear-attention layer's recurrent state (transformers' K-first [B, HV, K, V], fp32) is rounded
to the format and back (state_accuracy.quantize over its [V, K] rows, stochastic rounding keyed
by (prompt, layer, step)), so every step loads the rounded state, computes in fp32 and its
state is rounded again when stored, as a quantized pool would. The layers run on transformers'
own torch functions (no deltastate build needed); the full-attention layers' KV cache stays fp32.

Random initialization gives these layers almost no memory (Qwen3-Next: dt_bias = 1, decays
e^-1.3 A per token), so by default (``--gates spectrum``) every linear-attention layer's A_log and
dt_bias are set to state_accuracy's spectrum: value head h of HV decays from ~0.999 (h = 0) to
~0.1 per token, as trained layers' heads do. ``--gates init`` keeps transformers' initialization.

Every format decodes the same prompts in two ways, all in one batch:
  free    greedy from its own tokens: token agreement with the fp32 run (fraction of the 512
          positions with the same token) and the first position that differs;
  forced  fed the fp32 run's tokens: per-step KL(p_fp32 || p_format) of the next-token
          distributions (mean and max over steps and prompts) and top-1 agreement.
The fp32 format's forced rows are a control (KL 0 up to batch-position effects of the matmuls).

    python tools/state_accuracy_model.py                      # both models, 512 tokens, all formats
    python tools/state_accuracy_model.py --tokens 64 --formats 'fp32,bf16/*' --json out.json

Needs torch and transformers (5.23.0, as scripts/demo.sh --hf installs); runs on the CPU.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import time

import numpy as np

TOOLS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
import state_accuracy as sa  # noqa: E402

MODEL_NAMES = {"qwen3-next": "qwen3_next", "kimi-linear": "kimi_linear"}


def _integration():
    """deltastate.integrations.transformers loaded from its file, so that the compiled package
    is not imported (small_config and small_model need only transformers)."""
    path = TOOLS.parent / "python" / "deltastate" / "integrations" / "transformers.py"
    spec = importlib.util.spec_from_file_location("_ds_hf_integration", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def set_gate_spectrum(model, seed: int = 0) -> list:
    """Sets every linear-attention layer's A_log and dt_bias to state_accuracy.gate_params (per
    value head; Kimi-Linear's dt_bias per channel). Returns the geometric-mean decay per head of
    the first layer at a = 0, for the report."""
    import torch

    decays = []
    for name, mod in model.named_modules():
        if not (hasattr(mod, "A_log") and hasattr(mod, "dt_bias")):
            continue
        HV = mod.A_log.numel()
        K = mod.dt_bias.numel() // HV
        kind = "kda" if K > 1 else "gdn"
        A_log, dt_bias = sa.gate_params(kind, HV, K, np.arange(HV), seed)
        with torch.no_grad():
            mod.A_log.copy_(torch.tensor(A_log, dtype=torch.float32).view(mod.A_log.shape))
            mod.dt_bias.copy_(torch.tensor(dt_bias, dtype=torch.float32).reshape(-1))
        g = -np.exp(A_log).reshape(HV, -1) * np.log1p(np.exp(np.reshape(dt_bias, (HV, -1))))
        decays.append(np.exp(g.mean(axis=-1)).tolist())
    if not decays:
        raise RuntimeError("no linear-attention layer with A_log and dt_bias found")
    return decays[0]


class StateRounder:
    """Rounds the rows of each linear-attention layer's cached recurrent state to their format."""

    def __init__(self, formats, row_format: np.ndarray, row_prompt: np.ndarray, seed: int):
        self.formats = formats
        self.groups = [np.flatnonzero(row_format == f) for f in range(len(formats))]
        self.row_prompt = row_prompt
        self.seed = seed

    def __call__(self, cache, step: int) -> None:
        import torch

        layer_ids = [i for i, layer in enumerate(cache.layers)
                     if getattr(layer, "is_recurrent_states_initialized", {}).get(0)]
        if not layer_ids:
            raise RuntimeError("no recurrent state in the cache (transformers' cache layout "
                               "changed?): nothing would be rounded")
        for layer_id in layer_ids:
            state = cache.layers[layer_id].recurrent_states[0]  # [B, HV, K, V] fp32
            x = state.detach().to("cpu", torch.float32).transpose(-1, -2).contiguous().numpy()
            B, HV, V, K = x.shape
            bits = None
            if any(f.stochastic for f in self.formats):
                index = np.arange(HV * V * K, dtype=np.uint64).reshape(HV, V, K)
                key = sa.sr_key(self.seed, self.row_prompt, layer_id, step)
                bits = sa.sr_bits(key[:, None, None, None], index)
            for fmt, rows in zip(self.formats, self.groups):
                if fmt.kind != "fp32" and len(rows):
                    x[rows] = sa.quantize(x[rows], fmt, bits[rows] if fmt.stochastic else None)
            state.copy_(torch.from_numpy(x).transpose(-1, -2).to(state))


def run(model_name: str, formats, tokens: int, prompts: int, prompt_len: int, seed: int,
        gates: str, progress=None) -> dict:
    import torch

    hf = _integration()
    model = hf.small_model(MODEL_NAMES[model_name], seed=seed)
    decay = set_gate_spectrum(model, seed) if gates == "spectrum" else None
    F = len(formats)
    ref = next(i for i, f in enumerate(formats) if f.name == "fp32")
    # rows: (prompt, format, mode) with mode 0 = free, 1 = forced
    P = prompts
    row_prompt = np.repeat(np.arange(P), 2 * F)
    row_format = np.tile(np.repeat(np.arange(F), 2), P)
    row_forced = np.tile([False, True], P * F)
    ref_rows = np.flatnonzero((row_format == ref) & ~row_forced)  # one per prompt
    rounder = StateRounder(formats, row_format, row_prompt, seed)
    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(2, model.config.vocab_size, (P, prompt_len), generator=g)
    ids = prompt[torch.from_numpy(row_prompt)]
    picks = np.zeros((len(row_prompt), tokens), np.int64)
    kl = np.zeros((P, F, tokens))
    forced_top1 = np.zeros((P, F, tokens), bool)
    entropy = np.zeros((P, tokens))
    margin = np.zeros((P, tokens))
    t0 = time.time()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache = out.past_key_values
        for t in range(tokens):
            logp = torch.log_softmax(out.logits[:, -1].double(), dim=-1).numpy()
            pick = logp.argmax(axis=-1)
            picks[:, t] = pick
            lp_ref = logp[ref_rows]  # [P, vocab]
            p_ref = np.exp(lp_ref)
            entropy[:, t] = -(p_ref * lp_ref).sum(-1)
            top2 = np.sort(lp_ref, axis=-1)[:, -2:]
            margin[:, t] = top2[:, 1] - top2[:, 0]
            forced_rows = np.flatnonzero(row_forced)
            fp, ff = row_prompt[forced_rows], row_format[forced_rows]
            kl[fp, ff, t] = (p_ref[fp] * (lp_ref[fp] - logp[forced_rows])).sum(-1)
            forced_top1[fp, ff, t] = pick[forced_rows] == pick[ref_rows][fp]
            if t + 1 == tokens:
                break
            rounder(cache, t)  # the state the step just stored (t = 0: the prefill's)
            nxt = np.where(row_forced, pick[ref_rows][row_prompt], pick)
            out = model(input_ids=torch.from_numpy(nxt)[:, None], past_key_values=cache,
                        use_cache=True)
            if progress and (t + 1) % 64 == 0:
                progress(f"{model_name}: token {t + 1}/{tokens}, {time.time() - t0:.0f} s")
    ref_tokens = picks[ref_rows]  # [P, tokens]
    summary = {}
    for f, fmt in enumerate(formats):
        free = picks[np.flatnonzero((row_format == f) & ~row_forced)]  # [P, tokens]
        same = free == ref_tokens
        first = [int(np.argmin(s)) if not s.all() else tokens for s in same]
        summary[fmt.name] = {
            "token_agreement": float(same.mean()), "first_divergence_min": min(first),
            "first_divergence_mean": float(np.mean(first)),
            "kl_mean": float(kl[:, f].mean()), "kl_max": float(kl[:, f].max()),
            "kl_mean_last_half": float(kl[:, f, tokens // 2:].mean()),
            "forced_top1": float(forced_top1[:, f].mean()),
        }
    return {"model": model_name, "tokens": tokens, "prompts": P, "prompt_len": prompt_len,
            "seed": seed, "gates": gates, "decay_per_head_first_layer": decay,
            "reference_entropy_mean": float(entropy.mean()),
            "reference_top1_margin_median": float(np.median(margin)),
            "formats": summary, "seconds": time.time() - t0}


def table(result: dict) -> str:
    cols = ["token agreement", "first divergence (min / mean)", "forced top-1", "KL mean",
            "KL mean, 2nd half", "KL max"]
    lines = ["| format | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, r in result["formats"].items():
        lines.append(
            f"| {name} | {r['token_agreement']:.3f} | {r['first_divergence_min']} / "
            f"{r['first_divergence_mean']:.0f} | {r['forced_top1']:.3f} | {r['kl_mean']:.2e} | "
            f"{r['kl_mean_last_half']:.2e} | {r['kl_max']:.2e} |")
    return "\n".join(lines)


def header(result: dict) -> str:
    decay = result["decay_per_head_first_layer"]
    gates = ("transformers' initialization" if decay is None else
             "decay per head " + ", ".join(f"{d:.3f}" for d in decay))
    return (f"{result['model']} (small random-weight, gates: {gates}), {result['prompts']} prompts "
            f"of {result['prompt_len']} tokens, {result['tokens']} greedy tokens, seed "
            f"{result['seed']}; fp32 run's next-token entropy "
            f"{result['reference_entropy_mean']:.2f} nats, median top-1 margin "
            f"{result['reference_top1_margin_median']:.3f}; "
            f"{result['seconds']:.0f} s")


def main(argv=None) -> int:
    p = sa.parser(__doc__, MODEL_NAMES)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--gates", default="spectrum", choices=("spectrum", "init"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    formats = sa.select_formats(args.formats)
    if "fp32" not in [f.name for f in formats]:
        formats = sa.select_formats("fp32") + formats
    results = []
    for model in sa.listed(p, args.models, MODEL_NAMES, "model"):
        r = run(model, formats, args.tokens, args.prompts, args.prompt_len, args.seed,
                args.gates, sa.progress_printer(args.quiet))
        results.append(r)
        print(header(r) + "\n")
        print(table(r) + "\n")
    if args.json:
        sa.write_json(args.json, "tools/state_accuracy_model.py", argv, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
