"""deltastate underneath the frameworks people already use.

* :mod:`deltastate.integrations.fla`: a backend of FLA's op registry (fla-core 0.6), so code
  written for FLA runs on deltastate unchanged, CPU tensors included.
* :mod:`deltastate.integrations.transformers`: deltastate under HF transformers' Qwen3-Next and
  Kimi-Linear linear-attention layers.
* :mod:`deltastate.integrations.sglang`: a kernel object with the surface of SGLang's
  ``LinearAttnKernelBase``.

Each module imports its framework only when used; none is imported by ``import deltastate``.
"""
