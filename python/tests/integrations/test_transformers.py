"""HF transformers' Qwen3-Next and Kimi-Linear generating with deltastate underneath.

Small random-weight models (deltastate.integrations.transformers.small_config: hidden 256, 2
layers — one linear-attention, one full-attention — head geometry scaled down; no download),
greedy ``generate()``, batch 4 with prompts of different lengths (left padding), 64 new tokens,
cache on: the tokens must equal those of transformers' own torch path and the logits of every
step must lie within LOGITS_ATOL of it. CPU always; CUDA too when a GPU and a CUDA build are
there (DELTASTATE_HF_DEVICES=cpu,cuda picks).
"""

import os
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers not installed: HF integration tests "
                    "SKIPPED (pip install transformers==5.23.0)")

import deltastate  # noqa: E402
from deltastate.integrations import transformers as dst  # noqa: E402

# fp32 weights and activations. Measured on CPU: max |logit difference| 7e-7 (Qwen3-Next) and
# 1e-6 (Kimi-Linear) on logits of magnitude ~1.4; the bound leaves two orders of margin. On CUDA
# deltastate's kernels and torch's matmuls round differently (FMA order, TF32 off by default):
# 1e-3 there.
LOGITS_ATOL = {"cpu": 1e-4, "cuda": 1e-3}
PROMPT_LENS = (5, 12, 20, 9)
NEW_TOKENS = 64


def _devices():
    wanted = os.environ.get("DELTASTATE_HF_DEVICES")
    if wanted:
        return wanted.split(",")
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() and deltastate.cuda_available()
                      else [])


def _prompts(device, vocab=512, seed=1):
    g = torch.Generator().manual_seed(seed)
    L = max(PROMPT_LENS)
    ids = torch.randint(2, vocab, (len(PROMPT_LENS), L), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(PROMPT_LENS):
        ids[i, :L - n] = 0  # pad_token_id of small_config
        mask[i, L - n:] = 1
    return ids.to(device), mask.to(device)


def _generate(model, ids, mask):
    with torch.no_grad():
        r = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                           do_sample=False, use_cache=True, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0)
    return r.sequences, torch.stack(r.logits)


@pytest.fixture
def calls(ds_op_calls):
    return ds_op_calls


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("model_name", ["qwen3_next", "kimi_linear"])
def test_generate_matches_torch_path(calls, model_name, device):
    model = dst.small_model(model_name, layers=2, device=device)
    ids, mask = _prompts(device)
    with dst.backend("torch"):
        ref_tokens, ref_logits = _generate(model, ids, mask)
    assert calls == {}
    with dst.backend("deltastate"):
        tokens, logits = _generate(model, ids, mask)
    assert tokens.shape == (4, max(PROMPT_LENS) + NEW_TOKENS)
    assert torch.equal(tokens, ref_tokens)
    diff = (logits - ref_logits).abs().max().item()
    assert diff <= LOGITS_ATOL[device], f"max |logit difference| {diff}"
    chunk, rec = (("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
                  if model_name == "qwen3_next" else ("chunk_kda", "fused_recurrent_kda"))
    # One linear-attention layer: one prefill call, then one call per new token after the first,
    # and as many of the cached decode's conv (both models run one packed q|k|v conv).
    assert calls == {chunk: 1, rec: NEW_TOKENS - 1, "causal_conv1d_update": NEW_TOKENS - 1}


def test_backend_restores_and_checks():
    before = dst.current_backend("qwen3_next")
    with dst.backend("deltastate", models=("qwen3_next",)):
        assert dst.current_backend("qwen3_next") == "deltastate"
        from transformers.models.qwen3_next import modeling_qwen3_next as mq

        assert mq.torch_chunk_gated_delta_rule is dst.gdn_chunk
        assert mq.torch_recurrent_gated_delta_rule is dst.gdn_recurrent
    assert dst.current_backend("qwen3_next") == before
    with dst.backend("torch", models=("kimi_linear",)):
        from transformers.models.kimi_linear import modeling_kimi_linear as mk

        assert mk.chunk_kimi_delta_attention.__name__ == "chunk_kimi_delta_attention"
        assert not hasattr(mk.chunk_kimi_delta_attention, "__wrapped__")
    with pytest.raises(ValueError, match=r"backend must be one of \('deltastate', 'torch', "
                       r"'default'\), got 'fla'"):
        dst.set_backend("fla")
    with pytest.raises(ValueError, match=r"model must be one of \('qwen3_next', 'kimi_linear'\), "
                       r"got 'llama'"):
        dst.set_backend("torch", models=("llama",))
    with pytest.raises(ValueError, match="model must be one of"):
        dst.small_config("llama")


def test_readme_example_runs_as_written(capsys):
    """The README's transformers example, executed verbatim."""
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    m = re.search(r"<!-- example: transformers -->\s*```python\n(.*?)```", readme, re.S)
    assert m, "README.md lost its transformers example"
    exec(compile(m.group(1), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip().endswith("True")
