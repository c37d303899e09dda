"""deltastate under HF transformers' Qwen3-Next and Kimi-Linear linear-attention layers.

transformers (5.x) routes the delta-rule math and the conv of these layers through module-level
functions, each built by its kernel-function mapping (``use_kernel_func_from_hub_with_fallback``)
and listed on the layer by ``use_kernelized_func``:

=============================  ===========================================  =====================
model (module)                 function the layer calls                     deltastate op
=============================  ===========================================  =====================
qwen3_next                     ``torch_chunk_gated_delta_rule`` (prefill)   chunk_gated_delta_rule
qwen3_next                     ``torch_recurrent_gated_delta_rule`` (T=1)   fused_recurrent_gated_delta_rule
kimi_linear                    ``chunk_kimi_delta_attention`` (prefill)     chunk_kda
kimi_linear                    ``recurrent_kimi_delta_attention`` (T=1)     fused_recurrent_kda
both                           ``causal_conv1d_update`` (cached decode)     causal_conv1d_update
=============================  ===========================================  =====================

:func:`set_backend` ("deltastate", "torch", "default") rebinds those names in the two modeling
modules: the local form of that mapping, without network access, without the ``kernels`` package
and without fla-core. The layers look the names up at call time, so models already built switch
too. ``causal_conv1d_fn`` (the prefill conv; deltastate has none) and the gated RMSNorm (deltastate
has it inside its fused decode step only) stay on transformers' path.

With deltastate the recurrent state in transformers' cache is V-first ``[B, HV, V, K]`` (the
cache is layout-agnostic: it copies whatever state the layer returns), so neither CPU nor CUDA
transposes a state; switch backends between ``generate()`` calls, not inside one.
``"torch"`` is transformers' own torch functions (also when fla-core is installed, where
``"default"``, transformers' choice, would be FLA's Triton kernels).

Why not only the FLA backend (:mod:`deltastate.integrations.fla`): through FLA, transformers
passes FLA's default K-first states, which deltastate runs on the CPU only, so on CUDA every call
would go back to FLA's Triton; and transformers binds FLA's functions when the modeling module is
first imported, so the registration order would matter.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Dict, Iterable, Tuple

_MODULES = {
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
    "kimi_linear": "transformers.models.kimi_linear.modeling_kimi_linear",
}
BACKENDS = ("deltastate", "torch", "default")

_saved: Dict[Tuple[str, str], object] = {}
_current: Dict[str, str] = {}


def _rows(*xs):
    """The layers hand q/k/v as views of the conv output's transpose (last-dim stride T);
    deltastate reads rows with unit stride in the last dim, as FLA's input guard makes them."""
    return [x if x is None or x.stride(-1) == 1 else x.contiguous() for x in xs]


def _run(op, query, key, value, g, beta, initial_state, output_final_state,
         use_qk_l2norm_in_kernel, cu_seqlens):
    import deltastate as ds

    query, key, value, g, beta = _rows(query, key, value, g, beta)
    return getattr(ds, op)(query, key, value, g=g, beta=beta, initial_state=initial_state,
                           output_final_state=output_final_state,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=True,
                           cu_seqlens=cu_seqlens)


def gdn_chunk(query, key, value, g, beta, chunk_size=64, initial_state=None,
              output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
              **kwargs):
    """Qwen3-Next's ``torch_chunk_gated_delta_rule`` on deltastate (V-first states)."""
    return _run("chunk_gated_delta_rule", query, key, value, g, beta, initial_state,
                output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def gdn_recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """Qwen3-Next's ``torch_recurrent_gated_delta_rule`` on deltastate (V-first states)."""
    return _run("fused_recurrent_gated_delta_rule", query, key, value, g, beta, initial_state,
                output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def kda_chunk(query, key, value, g, beta, chunk_size=64, initial_state=None,
              output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """Kimi-Linear's ``chunk_kimi_delta_attention`` on deltastate (V-first states)."""
    return _run("chunk_kda", query, key, value, g, beta, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens)


def kda_recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """Kimi-Linear's ``recurrent_kimi_delta_attention`` on deltastate (V-first states)."""
    return _run("fused_recurrent_kda", query, key, value, g, beta, initial_state,
                output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def conv_update(hidden_states, conv_state, weight, bias=None, activation=None):
    """The layers' ``causal_conv1d_update`` (the cached single-token decode's conv, in place on
    the cache's window [B, dim, state_len]) on deltastate's op of that name: the same
    semantics (the last state_len values of [window, x]), accumulated in fp32 and rounded once
    to x's dtype (transformers' torch function convolves in the weight's dtype)."""
    import deltastate as ds

    return ds.causal_conv1d_update(hidden_states, conv_state, weight, bias, activation)


_TABLE = {
    "qwen3_next": {"torch_chunk_gated_delta_rule": gdn_chunk,
                   "torch_recurrent_gated_delta_rule": gdn_recurrent,
                   "causal_conv1d_update": conv_update},
    "kimi_linear": {"chunk_kimi_delta_attention": kda_chunk,
                    "recurrent_kimi_delta_attention": kda_recurrent,
                    "causal_conv1d_update": conv_update},
}


def set_backend(backend: str = "deltastate", models: Iterable[str] = tuple(_MODULES)) -> None:
    """Routes the delta-rule functions of ``models`` (``"qwen3_next"``, ``"kimi_linear"``) to
    ``backend``: ``"deltastate"``, ``"torch"`` (transformers' torch functions) or ``"default"``
    (what transformers chose at import)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for model in models:
        if model not in _MODULES:
            raise ValueError(f"model must be one of {tuple(_MODULES)}, got {model!r}")
        module = importlib.import_module(_MODULES[model])
        for name, ours in _TABLE[model].items():
            original = _saved.setdefault((model, name), getattr(module, name))
            fn = {"deltastate": ours, "torch": inspect.unwrap(original),
                  "default": original}[backend]
            setattr(module, name, fn)
        _current[model] = backend


def current_backend(model: str = "qwen3_next") -> str:
    """The backend :func:`set_backend` last chose for ``model`` ("default" before any)."""
    return _current.get(model, "default")


@contextlib.contextmanager
def backend(name: str, models: Iterable[str] = tuple(_MODULES)):
    """``with backend("deltastate"): model.generate(...)``; restores the previous choice."""
    models = tuple(models)
    before = {m: current_backend(m) for m in models}
    set_backend(name, models)
    try:
        yield
    finally:
        for m, b in before.items():
            set_backend(b, (m,))


def small_config(model: str = "qwen3_next", layers: int = 4, vocab_size: int = 512):
    """A small random-weight configuration of ``model`` (hidden 256; the real head geometry
    scaled down: Qwen3-Next 2 key / 4 value heads of 64 (GVA 2, as 16 / 32 of 128), Kimi-Linear 4
    heads of 64; every fourth layer, and at least the last, full attention, as both models
    interleave them)."""
    types = ["linear_attention" if (i % 4) != 3 else "full_attention" for i in range(layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    if model == "qwen3_next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(
            vocab_size=vocab_size, hidden_size=256, intermediate_size=512,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=128,
            shared_expert_intermediate_size=128, layer_types=types,
            max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    if model == "kimi_linear":
        from transformers import KimiLinearConfig

        return KimiLinearConfig(
            vocab_size=vocab_size, hidden_size=256, intermediate_size=512,
            moe_intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16,
            qk_nope_head_dim=32, v_head_dim=32, num_experts=4, num_experts_per_token=2,
            num_shared_experts=1, linear_num_heads=4, linear_head_dim=64,
            linear_conv_kernel_dim=4, layer_types=types,
            mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), model_max_length=1024,
            pad_token_id=0, bos_token_id=1, eos_token_id=None)
    raise ValueError(f"model must be one of {tuple(_MODULES)}, got {model!r}")


def small_model(model: str = "qwen3_next", layers: int = 4, seed: int = 0, device="cpu",
                dtype=None):
    """A random-weight causal LM from :func:`small_config` (no download), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(small_config(model, layers))
    if dtype is not None:
        m = m.to(dtype)
    return m.to(device).eval()
