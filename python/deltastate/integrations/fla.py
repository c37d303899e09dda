"""deltastate as a backend of FLA's op registry (fla-core 0.6, ``fla.backends``).

After :func:`register`, FLA's own functions run on deltastate wherever deltastate supports the
call, unchanged, on CPU tensors too (FLA's Triton kernels cannot run on a CPU)::

    import deltastate.integrations.fla as dsfla
    dsfla.register()                       # before code that imports FLA's functions by name
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)   # deltastate

Entry points (each with a verifier; a call it rejects goes to the next backend or to FLA's own
kernel, and the reason is logged once by FLA at INFO):

* ``chunk_gated_delta_rule`` (FLA's operation registry ``gated_delta_rule``),
* ``chunk_kda`` (FLA's function registry of ``chunk_kda``),
* ``fused_recurrent_kda`` through FLA's dispatched ``fused_recurrent_kda_fwd`` (registry ``kda``),
* ``fused_recurrent_gated_delta_rule``: fla-core 0.6.0 does not dispatch it, so :func:`register`
  wraps it with FLA's own ``fla.backends.dispatch`` and rebinds the module attributes
  (``fla.ops.gated_delta_rule[.fused_recurrent]``, ``fla.ops``, the alias
  ``fused_recurrent_gdn``). A name imported from FLA before :func:`register` keeps FLA's
  undispatched function: call :func:`register` first.

What the verifiers hand back to FLA (:func:`unsupported` gives the reason for a call):
autograd (an input that requires grad while grad is enabled: deltastate is forward-only), a
K-first state (FLA's default layout) on CUDA tensors (deltastate runs K-first states on the CPU
only and never transposes a state on the device behind the caller's back), CUDA tensors without a
CUDA build, context parallelism (``cp_context``), ``gv``, a per-value-channel ``beta``, FLA's
``return_intermediate_states``, and KDA's pooled decode form of
``fused_recurrent_kda_fwd`` (``inplace_final_state``, ``ssm_state_indices``,
``num_accepted_tokens``; deltastate's pool ops cover it under their own names).

On CPU tensors the chunked ops take FLA's K-first states through one transposed copy in and one
out (deltastate's chunked prefill is V-first); with ``state_v_first=True`` there is no copy.
Keywords that FLA accepts and ignores are ignored here too, and so are FLA's host-side hints
(``cu_seqlens_cpu``, ``chunk_indices``, ``use_graph``, ``max_num_seqs``): deltastate's chunked
prefill reads each sequence's bounds on the device and is graph-capturable as it is.

Kill switch: ``FLA_DELTASTATE=0`` (FLA's convention ``FLA_<BACKEND>``), or FLA's global
``FLA_DISABLE_BACKEND_DISPATCH=1``. Priority 4: after FLA's vendor backends FlashQLA / FlashKDA
(3), which are faster where they apply, before FLA's Triton default.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional

BACKEND_TYPE = "deltastate"
ENV_VAR = "FLA_DELTASTATE"
PRIORITY = 4

_registered = False


def _fla_backends():
    try:
        import fla.backends as backends
    except ImportError as e:  # fla-core < 0.6 keeps its registry elsewhere, with another API
        raise ImportError("deltastate.integrations.fla needs fla-core 0.6 (module fla.backends): "
                          f"{e}") from e
    return backends


def _bind(fn, args, kwargs) -> Dict[str, Any]:
    """The call's arguments by FLA's parameter names, FLA's defaults filled in, ``**kwargs``
    flattened into the dict."""
    sig = inspect.signature(inspect.unwrap(fn))
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    out = dict(bound.arguments)
    for name, p in sig.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            out.update(out.pop(name, {}))
    return out


def _tensors(a: Dict[str, Any]):
    import torch

    return [x for x in a.values() if isinstance(x, torch.Tensor)]


def _common_reason(a: Dict[str, Any], chunked: bool) -> Optional[str]:
    import torch

    import deltastate as ds

    ts = _tensors(a)
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return "deltastate implements the forward pass only (an input requires grad)"
    devices = {t.device.type for t in ts}
    if not devices <= {"cpu", "cuda"}:
        return f"deltastate runs CPU and CUDA tensors, got {sorted(devices)}"
    cuda = "cuda" in devices
    if cuda and not ds.cuda_available():
        return "CUDA tensors, but this deltastate build has no usable CUDA backend"
    v_first = bool(a.get("state_v_first")) or bool(a.get("transpose_state_layout"))
    has_state = a.get("initial_state") is not None or bool(a.get("output_final_state"))
    if cuda and has_state and not v_first:
        return ("a K-first state [N, HV, K, V] (FLA's default) on CUDA tensors: deltastate runs "
                "it on the CPU only; pass state_v_first=True")
    if a.get("cp_context") is not None:
        return "context parallelism (cp_context) is not implemented in deltastate"
    beta, v = a.get("beta"), a.get("v")
    if beta is not None and v is not None and beta.dim() == v.dim():
        return "a per-value-channel beta [B, T, HV, V] is not supported by deltastate"
    if chunked and a.get("return_intermediate_states"):
        return "return_intermediate_states is not implemented in deltastate"
    return None


def unsupported(function_name: str, *args, **kwargs) -> Optional[str]:
    """Why deltastate hands this FLA call back to FLA, or None when it takes it.
    ``function_name``: one of ``chunk_gated_delta_rule``, ``chunk_kda``,
    ``fused_recurrent_gated_delta_rule``, ``fused_recurrent_kda_fwd``."""
    fn = _fla_function(function_name)
    a = _bind(fn, args, kwargs)
    reason = _common_reason(a, chunked=function_name.startswith("chunk"))
    if reason is not None:
        return reason
    if function_name == "fused_recurrent_gated_delta_rule":
        if a.get("gv") is not None:
            return "gv (a per-value-channel decay) is not supported by deltastate"
        if a.get("use_gate_in_kernel") and a.get("gk") is not None:
            return "gk with use_gate_in_kernel=True is not supported by deltastate"
    if function_name == "fused_recurrent_kda_fwd":
        if a.get("inplace_final_state"):
            return ("the pooled in-place form (inplace_final_state=True) is taken by deltastate's "
                    "recurrent_kda / pool ops, not through this entry point")
        if a.get("ssm_state_indices") is not None or a.get("num_accepted_tokens") is not None:
            return "ssm_state_indices / num_accepted_tokens are not taken through this entry point"
    if function_name in ("fused_recurrent_kda_fwd", "chunk_kda"):
        if a.get("use_gate_in_kernel") and a.get("A_log") is None and a.get("lower_bound") is None:
            return "use_gate_in_kernel without A_log needs lower_bound in deltastate"
    return None


def _fla_function(name: str):
    if name == "chunk_gated_delta_rule":
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule as f
    elif name == "chunk_kda":
        from fla.ops.kda.chunk import chunk_kda as f
    elif name == "fused_recurrent_gated_delta_rule":
        from fla.ops.gated_delta_rule import fused_recurrent as m

        f = m.fused_recurrent_gated_delta_rule
    elif name == "fused_recurrent_kda_fwd":
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as f
    else:
        raise ValueError(f"deltastate.integrations.fla: no FLA entry point named {name!r}")
    return f


def _kfirst_to_vfirst(a: Dict[str, Any]) -> bool:
    """For the chunked ops on CPU tensors: a K-first call becomes V-first (one transposed copy of
    initial_state); True when the final state must be transposed back."""
    if a.get("state_v_first") or a.get("transpose_state_layout"):
        return False
    h0 = a.get("initial_state")
    if h0 is not None:
        a["initial_state"] = h0.transpose(-1, -2).contiguous()
    a["state_v_first"] = True
    return True


def _finish(o, ht, back: bool):
    if back and ht is not None:
        ht = ht.transpose(-1, -2).contiguous()
    return o, ht


# The per-token inputs: FLA's entry points make every input tensor contiguous (its input_guard),
# so a call whose head vectors are strided (transformers' own layouts, for one) is valid there;
# deltastate takes any strides but a unit last one, so those get the copy FLA would make.
_TOKEN_INPUTS = ("q", "k", "v", "g", "gk", "gv", "beta")


def _pick(a: Dict[str, Any], names) -> Dict[str, Any]:
    out = {n: a[n] for n in names if n in a}
    for n in _TOKEN_INPUTS:
        t = out.get(n)
        if t is not None and t.dim() > 0 and t.stride(-1) != 1:
            out[n] = t.contiguous()
    return out


_GDN_CHUNK = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
              "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
              "state_v_first", "cu_seqlens", "use_gate_in_kernel", "A_log", "dt_bias",
              "transpose_state_layout")
_KDA_CHUNK = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
              "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
              "allow_neg_eigval", "safe_gate", "lower_bound", "state_v_first", "cu_seqlens",
              "A_log", "dt_bias", "transpose_state_layout")
_GDN_RECURRENT = ("q", "k", "v", "g", "gk", "gv", "beta", "scale", "initial_state",
                  "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log",
                  "dt_bias", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first",
                  "cu_seqlens", "transpose_state_layout")
_KDA_RECURRENT = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "scale", "initial_state",
                  "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                  "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "lower_bound",
                  "state_v_first", "cu_seqlens")


def chunk_gated_delta_rule(*args, **kwargs):
    """FLA's ``chunk_gated_delta_rule`` call, run by deltastate (what the backend registers)."""
    import deltastate as ds

    a = _bind(_fla_function("chunk_gated_delta_rule"), args, kwargs)
    back = _kfirst_to_vfirst(a)
    return _finish(*ds.chunk_gated_delta_rule(**_pick(a, _GDN_CHUNK)), back)


def chunk_kda(*args, **kwargs):
    """FLA's ``chunk_kda`` call, run by deltastate."""
    import deltastate as ds

    a = _bind(_fla_function("chunk_kda"), args, kwargs)
    back = _kfirst_to_vfirst(a)
    return _finish(*ds.chunk_kda(**_pick(a, _KDA_CHUNK)), back)


def fused_recurrent_gated_delta_rule(*args, **kwargs):
    """FLA's ``fused_recurrent_gated_delta_rule`` call, run by deltastate."""
    import deltastate as ds

    a = _bind(_fla_function("fused_recurrent_gated_delta_rule"), args, kwargs)
    return ds.fused_recurrent_gated_delta_rule(**_pick(a, _GDN_RECURRENT))


def fused_recurrent_kda_fwd(*args, **kwargs):
    """FLA's ``fused_recurrent_kda_fwd`` call (what ``fused_recurrent_kda`` runs), by deltastate;
    a given ``out`` receives the output."""
    import deltastate as ds

    a = _bind(_fla_function("fused_recurrent_kda_fwd"), args, kwargs)
    o, ht = ds.fused_recurrent_kda(**_pick(a, _KDA_RECURRENT))
    out = a.get("out")
    if out is not None:
        out.copy_(o)
        o = out
    return o, ht


def _backend_class():
    backends = _fla_backends()

    def method(name, impl):
        def run(self, *args, **kwargs):
            return impl(*args, **kwargs)

        def verify(self, *args, **kwargs):
            reason = unsupported(name, *args, **kwargs)
            return reason is None, reason

        run.__name__, verify.__name__ = name, f"{name}_verifier"
        return {name: run, f"{name}_verifier": verify}

    body = {"backend_type": BACKEND_TYPE, "env_var": ENV_VAR, "default_enable": True,
            "priority": PRIORITY, "package_name": None,
            "__doc__": "deltastate (CPU and CUDA) for FLA's GDN and KDA entry points."}
    for name, impl in (("chunk_gated_delta_rule", chunk_gated_delta_rule),
                       ("chunk_kda", chunk_kda),
                       ("fused_recurrent_gated_delta_rule", fused_recurrent_gated_delta_rule),
                       ("fused_recurrent_kda_fwd", fused_recurrent_kda_fwd)):
        body.update(method(name, impl))
    return type("DeltastateBackend", (backends.BaseBackend,), body)


def _dispatch_gdn_recurrent(backends):
    """fla-core 0.6.0 does not dispatch fused_recurrent_gated_delta_rule: wrap it with FLA's own
    ``dispatch`` and rebind the names FLA exports it under. Returns the dispatched function."""
    import fla.ops as ops
    import fla.ops.gated_delta_rule as gdr
    from fla.ops.gated_delta_rule import fused_recurrent as fr

    original = fr.fused_recurrent_gated_delta_rule
    if inspect.unwrap(original) in backends._function_registries:
        return original  # dispatched already (a later FLA, or register() called before)
    dispatched = backends.dispatch(original)
    for module in (fr, gdr, ops):
        for name in ("fused_recurrent_gated_delta_rule", "fused_recurrent_gdn"):
            if getattr(module, name, None) is original:
                setattr(module, name, dispatched)
    return dispatched


def register() -> None:
    """Registers deltastate with FLA's registry for the four entry points (idempotent)."""
    global _registered
    if _registered:
        return
    backends = _fla_backends()
    from fla.ops.kda.chunk import chunk_kda as fla_chunk_kda

    import fla.ops.gated_delta_rule  # noqa: F401 - loads the 'gated_delta_rule' registry
    import fla.ops.kda  # noqa: F401 - loads the 'kda' registry

    cls = _backend_class()
    backends.register("gated_delta_rule")(cls)  # chunk_gated_delta_rule
    backends.register("kda")(cls)  # fused_recurrent_kda_fwd
    backends.register(fla_chunk_kda)(cls)
    backends.register(_dispatch_gdn_recurrent(backends))(cls)
    _registered = True


def is_registered() -> bool:
    return _registered
