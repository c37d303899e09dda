"""The main job with a real model: a small random-weight Qwen3-Next (or Kimi-Linear) generating
through HF transformers with deltastate underneath, beside transformers' own torch path.

    python -m deltastate.integrations.demo                 # Qwen3-Next, CPU, batch 4, 64 tokens
    python -m deltastate.integrations.demo --model kimi_linear --device cuda
    scripts/demo.sh --hf [same options]                    # builds and installs, then this

Prints a progress bar per run, tokens/s, and whether the tokens agree with the torch path (exit
status 1 when they do not).
"""

from __future__ import annotations

import argparse
import sys
import time


def _bar(label: str, total: int, stream):
    """A one-line progress bar; returns a callback taking the number of tokens generated."""
    start = time.perf_counter()
    width = 30
    live = getattr(stream, "isatty", lambda: False)()  # a log gets the finished bar only

    def update(done: int):
        if not live and done < total:
            return
        frac = done / total
        fill = int(width * frac)
        rate = done / max(time.perf_counter() - start, 1e-9)
        stream.write(f"\r  {label:<11} [{'#' * fill}{'.' * (width - fill)}] {done:>4}/{total}"
                     f"  {rate:7.1f} steps/s")
        if done >= total:
            stream.write("\n")
        stream.flush()

    return update


def _run(model, ids, mask, new_tokens, label, stream):
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    prompt = ids.shape[1]
    bar = _bar(label, new_tokens, stream)

    class Progress(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            bar(input_ids.shape[1] - prompt)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    bar(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        r = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                           output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                           stopping_criteria=StoppingCriteriaList([Progress()]))
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return r.sequences[:, prompt:], torch.stack(r.logits), seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="deltastate demo --hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("qwen3_next", "kimi_linear", "qwen3-next", "kimi-linear"),
                   default="qwen3_next")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--batch", type=int, default=4, help="requests (default 4)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--no-compare", action="store_true", help="skip the torch-path run")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    model_name = a.model.replace("-", "_")
    out = sys.stdout

    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"demo --hf needs torch and transformers (pip install torch transformers): {e}",
              file=sys.stderr)
        return 2
    import deltastate
    from deltastate.integrations import transformers as dst

    if a.device.startswith("cuda") and not deltastate.cuda_available():
        why = ("no CUDA device found" if deltastate.cuda_built() else
               "this deltastate is built without the CUDA backend (scripts/demo.sh --hf "
               "--device cuda installs one where nvcc is)")
        print(f"demo --hf: --device cuda: {why}", file=sys.stderr)
        return 2
    cfg = dst.small_config(model_name, a.layers)
    lin = sum(t == "linear_attention" for t in cfg.layer_types)
    heads = (f"{cfg.linear_num_key_heads} key / {cfg.linear_num_value_heads} value heads of "
             f"{cfg.linear_key_head_dim}" if model_name == "qwen3_next" else
             f"{cfg.linear_num_heads} heads of {cfg.linear_head_dim}")
    print(f"deltastate {deltastate.__version__} under transformers {transformers.__version__}: "
          f"random-weight {model_name} ({a.layers} layers, {lin} linear-attention: {heads}; "
          f"hidden {cfg.hidden_size}; no download), device {a.device}", file=out)
    model = dst.small_model(model_name, a.layers, seed=a.seed, device=a.device)

    g = torch.Generator().manual_seed(a.seed + 1)
    lens = [8 + (11 * i) % 17 for i in range(a.batch)]
    L = max(lens)
    ids = torch.randint(2, cfg.vocab_size, (a.batch, L), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, :L - n] = 0
        mask[i, L - n:] = 1
    ids, mask = ids.to(a.device), mask.to(a.device)
    print(f"batch {a.batch}, prompt lengths {lens}, greedy, {a.new_tokens} new tokens, "
          "cache on", file=out)

    runs = {}
    order = ["deltastate"] + ([] if a.no_compare else ["torch"])
    for name in order:  # warm-up: first-call costs (allocator, threads) out of the timing
        with dst.backend(name, models=(model_name,)), torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                           pad_token_id=0)
    for name in order:
        with dst.backend(name, models=(model_name,)):
            label = "deltastate" if name == "deltastate" else "torch path"
            runs[name] = _run(model, ids, mask, a.new_tokens, label, out)
    total = a.batch * a.new_tokens
    for name in order:
        tokens, _, s = runs[name]
        label = "deltastate" if name == "deltastate" else "torch path"
        print(f"  {label:<11} {total} tokens in {s:6.2f} s: {total / s:8.1f} tokens/s", file=out)
    if a.no_compare:
        return 0
    ours, ref = runs["deltastate"], runs["torch"]
    same = int((ours[0] == ref[0]).sum())
    diff = (ours[1] - ref[1]).abs().max().item()
    agree = same == ours[0].numel()
    print(f"tokens agree with transformers' torch path: {'yes' if agree else 'NO'} "
          f"({same}/{ours[0].numel()}); max |logit difference| {diff:.2e}; "
          f"deltastate {ref[2] / ours[2]:.2f}x the torch path's speed", file=out)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
