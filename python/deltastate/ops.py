"""The decode ops, with the reference implementations' names and argument order.

Every function takes numpy arrays or torch tensors (CPU or CUDA) zero-copy, strided views included,
updates the caller's tensors in place and returns them as the reference does. Contract violations
raise ValueError with the core's exact text. On CUDA tensors the op launches on torch's current
stream, without host synchronization or allocation (when the caller passes the outputs).

``check_indices`` (keyword): bounds-check slot indices. None = the backend default (on for CPU
tensors, checked before anything is written; off for CUDA tensors, where it is a debug option that
traps the kernel on an out-of-range index).

``pdl`` (keyword, default False): programmatic dependent launch on CUDA. The kernel is launched
with the programmatic-stream-serialization attribute, so it may be scheduled while the stream's
previous kernel is still running and waits on the device (``griddepcontrol.wait``) before it touches
global memory: it hides the launch gap between back-to-back dependent kernels, in CUDA graphs too
(decode loops on Hopper). Results are bit-identical to ``pdl=False``; ignored on the CPU.

Under torch.compile (``torch.compiler.is_compiling()``) the functions call the torch custom ops of
:mod:`deltastate.torch_ops` instead, so a compiled model does not graph-break on them; eager calls go
straight to the tvm-ffi module.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Optional

from ._lib import lib

_pd = lib.packed_decode
_rec = lib.recurrent
_replay = lib.replayssm_decode

# Argument names of the tvm-ffi functions, position by position (for TypeError messages).
_PD_ARGS = ("is_kda", "mixed_qkv", "a", "b", "A_log", "dt_bias", "scale", "initial_state", "out",
            "ssm_state_indices", "use_qk_l2norm_in_kernel", "lower_bound", "round_beta",
            "check_indices", "pdl")
_REC_ARGS = ("is_kda", "q", "k", "v", "g", "beta", "output", "A_log", "dt_bias",
             "use_gate_in_kernel", "lower_bound", "beta_is_logit", "scale", "initial_state",
             "ssm_state_indices", "cu_seqlens", "final_state", "update_state",
             "use_qk_l2norm_in_kernel", "check_indices", "pdl")
_REPLAY_ARGS = ("mixed_qkv", "a", "b", "A_log", "dt_bias", "scale", "initial_state", "d_cache",
                "k_cache", "g_cache", "out", "ssm_state_indices", "write_pos", "force_flush",
                "is_kda", "use_qk_l2norm_in_kernel", "lower_bound", "advance_write_pos",
                "check_indices", "pdl")


# ---- torch.compile routing --------------------------------------------------------------------
# `_is_compiling` is torch.compiler.is_compiling once torch is loaded (tvm_ffi imports torch when it
# is installed, so normally at import time), else a probe that binds it when torch appears.
_tops = None  # deltastate.torch_ops, once registered


def _never_compiling() -> bool:
    return False


def _bind_torch() -> bool:
    global _is_compiling, _tops
    try:
        import torch
    except ImportError:  # no torch: the eager path is all there is
        _is_compiling = _never_compiling
        return False
    try:
        from . import torch_ops
    except Exception as e:  # e.g. the namespace already registered by another copy of deltastate
        import warnings

        warnings.warn(f"deltastate: torch custom ops unavailable ({e}); torch.compile will not be "
                      "able to trace deltastate ops", RuntimeWarning, stacklevel=2)
        _is_compiling = _never_compiling
        return False
    _tops = torch_ops
    _is_compiling = torch.compiler.is_compiling
    return True


def _probe_compiling() -> bool:
    if "torch" in sys.modules and _bind_torch():
        return _is_compiling()
    return False


_is_compiling = _probe_compiling
if "torch" in sys.modules:
    _bind_torch()


# ---- argument helpers -------------------------------------------------------------------------
def _check(flag: Optional[bool]) -> int:
    return -1 if flag is None else int(bool(flag))


def _scale(scale: Any) -> float:
    if type(scale) is float:
        return scale
    if scale is None or isinstance(scale, (bool, str, bytes)):
        raise TypeError(f"scale must be a number (got {type(scale).__name__})")
    try:
        return float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a number (got {type(scale).__name__})") from None


def _opt_float(x: Any, name: str) -> Optional[float]:
    if x is None:
        return None
    if isinstance(x, (bool, str, bytes)):
        raise TypeError(f"{name} must be a number or None (got {type(x).__name__})")
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number or None (got {type(x).__name__})") from None


_EXPECTED = {
    "DLTensor*": "a tensor (a numpy array or a torch tensor)",
    "Optional<DLTensor*>": "a tensor (a numpy array or a torch tensor) or None",
    "float": "a number",
    "Optional<float>": "a number or None",
    "bool": "a bool",
    "int": "an int",
}


def _arg_error(op: str, names, args, exc: BaseException) -> BaseException:
    """A clearer exception for a call the tvm-ffi layer rejected before the core saw it (error path
    only): name the argument instead of its position in the internal signature."""
    msg = str(exc)
    if isinstance(exc, TypeError):
        m = re.search(r"argument #(\d+)", msg)
        if m and int(m.group(1)) < len(names):
            i = int(m.group(1))
            want = re.search(r"Expected `([^`]*)`", msg)
            want_s = _EXPECTED.get(want.group(1), f"`{want.group(1)}`") if want else "of another type"
            return TypeError(f"{op}: `{names[i]}` must be {want_s}; got {type(args[i]).__name__}")
        return exc
    if isinstance(exc, BufferError):
        for name, a in zip(names, args):
            flags = getattr(a, "flags", None)
            if flags is not None and getattr(flags, "writeable", True) is False:
                return ValueError(
                    f"{op}: `{name}` is a read-only numpy array, which DLPack cannot export; pass a "
                    "writable array (e.g. a copy)")
        return ValueError(f"{op}: an argument could not be exported through DLPack ({msg})")
    return exc


# ---- packed decode ----------------------------------------------------------------------------
def _packed_decode(is_kda, op_name, mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                   ssm_state_indices, use_qk_l2norm_in_kernel, lb, round_beta, check_indices, pdl):
    if _is_compiling():
        top = _tops.ops.kda_packed_decode if is_kda else _tops.ops.gdn_packed_decode
        top(mixed_qkv, a, b, A_log, dt_bias, _scale(scale), initial_state, out, ssm_state_indices,
            bool(use_qk_l2norm_in_kernel), lb, bool(round_beta), _check(check_indices), bool(pdl))
        return out, initial_state
    # The hot path: arguments normalized inline (identity checks for the common values).
    try:
        _pd(is_kda, mixed_qkv, a, b, A_log, dt_bias,
            scale if type(scale) is float else _scale(scale), initial_state, out,
            ssm_state_indices,
            use_qk_l2norm_in_kernel if use_qk_l2norm_in_kernel is True
            else bool(use_qk_l2norm_in_kernel),
            lb, round_beta if round_beta is False else bool(round_beta),
            -1 if check_indices is None else _check(check_indices),
            pdl if pdl is False else bool(pdl))
    except (TypeError, BufferError) as e:
        args = (is_kda, mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                ssm_state_indices, use_qk_l2norm_in_kernel, lb, round_beta, check_indices, pdl)
        raise _arg_error(op_name, _PD_ARGS, args, e) from None
    return out, initial_state


def fused_recurrent_gated_delta_rule_packed_decode(
    mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices,
    use_qk_l2norm_in_kernel: bool = True, *, round_beta: bool = False,
    check_indices: Optional[bool] = None, pdl: bool = False,
):
    """GDN packed decode (T=1). Returns ``(out, initial_state)``, both updated in place.

    mixed_qkv [B, 2*H*K + HV*V]; a, b [B, HV]; A_log, dt_bias [HV]; initial_state: the pool
    [slots, HV, V, K] (any slot stride); out [B, 1, HV, V]; ssm_state_indices [B] (< 0: padded row).
    """
    return _packed_decode(False, "fused_recurrent_gated_delta_rule_packed_decode", mixed_qkv, a, b,
                          A_log, dt_bias, scale, initial_state, out, ssm_state_indices,
                          use_qk_l2norm_in_kernel, None, round_beta, check_indices, pdl)


def fused_recurrent_kda_packed_decode(
    mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices,
    use_qk_l2norm_in_kernel: bool = True, lower_bound: Optional[float] = None, *,
    round_beta: bool = False, check_indices: Optional[bool] = None, pdl: bool = False,
):
    """KDA packed decode (T=1). As the GDN op, with a [B, HV*K] and dt_bias [HV*K];
    ``lower_bound`` selects the safe gate. Returns ``(out, initial_state)``."""
    lb = None if lower_bound is None else _opt_float(lower_bound, "lower_bound")
    return _packed_decode(True, "fused_recurrent_kda_packed_decode", mixed_qkv, a, b, A_log,
                          dt_bias, scale, initial_state, out, ssm_state_indices,
                          use_qk_l2norm_in_kernel, lb, round_beta, check_indices, pdl)


# ---- recurrent (B,T and varlen) ---------------------------------------------------------------
def _new_like(op, ref, name, shape=None, float32=False):
    """A new array of `ref`'s framework and device (torch or numpy); `ref`'s shape by default."""
    if type(ref).__module__.startswith("torch"):
        if shape is None:
            shape = tuple(ref.shape)
        import torch

        return torch.empty(shape, dtype=torch.float32 if float32 else ref.dtype, device=ref.device)
    import numpy as np

    if not isinstance(ref, np.ndarray):
        raise TypeError(f"{op}: `{name}` must be a tensor (a numpy array or a torch tensor); got "
                        f"{type(ref).__name__}")
    if shape is None:
        shape = ref.shape
    return np.empty(shape, dtype=np.float32 if float32 else ref.dtype)


def _recurrent(is_kda, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
               use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, cu_seqlens,
               ssm_state_indices, output, beta_is_logit, check_indices, pdl):
    op = "recurrent_kda" if is_kda else "recurrent_gated_delta_rule"
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t is None:
            raise TypeError(f"{op}: `{name}` is required (got None)")
    pooled = ssm_state_indices is not None
    if pooled and initial_state is None:
        raise ValueError("`ssm_state_indices` index a state pool, but no `initial_state` pool was given")
    lb = _opt_float(lower_bound, "lower_bound")
    sc = None if scale is None else _scale(scale)
    if _is_compiling():
        return _tops.recurrent(bool(is_kda), q, k, v, g, beta, A_log, dt_bias, sc, initial_state,
                               bool(output_final_state), bool(use_qk_l2norm_in_kernel),
                               bool(use_gate_in_kernel), lb, cu_seqlens, ssm_state_indices, output,
                               bool(beta_is_logit), _check(check_indices), bool(pdl))
    if output is None:
        output = _new_like(op, v, "v")
    final_state = None
    if not pooled and output_final_state:
        qs, vs = getattr(q, "shape", ()), getattr(v, "shape", ())
        if len(qs) == 4 and len(vs) == 4:  # otherwise the core rejects q / v first
            n = (len(cu_seqlens) - 1) if cu_seqlens is not None else qs[0]
            final_state = _new_like(op, q, "q", (n, vs[2], vs[3], qs[3]), float32=True)
    args = (bool(is_kda), q, k, v, g, beta, output, A_log, dt_bias, bool(use_gate_in_kernel), lb,
            bool(beta_is_logit), sc, initial_state, ssm_state_indices, cu_seqlens, final_state,
            pooled, bool(use_qk_l2norm_in_kernel), _check(check_indices),
            pdl if pdl is False else bool(pdl))
    try:
        _rec(*args)
    except (TypeError, BufferError) as e:
        raise _arg_error(op, _REC_ARGS, args, e) from None
    if pooled:
        return output, initial_state
    return output, final_state


def recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                  output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
                  lower_bound=None, cu_seqlens=None, ssm_state_indices=None, output=None,
                  beta_is_logit=False, *, check_indices: Optional[bool] = None,
                  pdl: bool = False):
    """Recurrent KDA over a pool: q, k [B,T,H,K] (or [1,T_total,H,K] with cu_seqlens [N+1]),
    v [B,T,HV,V], g [B,T,HV,K] (log decay; the raw gate input with use_gate_in_kernel), beta
    [B,T,HV]. With ssm_state_indices the pool initial_state [slots,HV,V,K] is updated in place and
    returned; without them initial_state [N,HV,V,K] is only read, and output_final_state returns a
    new float32 [N,HV,V,K]. The pool must meet the compiled stride contract (slot stride a multiple
    of 16 elements, base 32-byte aligned). Returns ``(o, final_state)``."""
    return _recurrent(True, q, k, v, g, beta, A_log, dt_bias, scale, initial_state,
                      output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound,
                      cu_seqlens, ssm_state_indices, output, beta_is_logit, check_indices, pdl)


def recurrent_gated_delta_rule(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None,
                               initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
                               lower_bound=None, cu_seqlens=None, ssm_state_indices=None,
                               output=None, beta_is_logit=False, *,
                               check_indices: Optional[bool] = None, pdl: bool = False):
    """Recurrent GDN: as :func:`recurrent_kda` with g [B,T,HV] (one decay per value head)."""
    return _recurrent(False, q, k, v, g, beta, A_log, dt_bias, scale, initial_state,
                      output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound,
                      cu_seqlens, ssm_state_indices, output, beta_is_logit, check_indices, pdl)


# ---- ReplaySSM --------------------------------------------------------------------------------
def fused_recurrent_linear_replayssm_decode(
    mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache, out,
    ssm_state_indices, write_pos, force_flush=None, *, is_kda: bool = False,
    use_qk_l2norm_in_kernel: bool = True, lower_bound: Optional[float] = None,
    advance_write_pos: bool = False, check_indices: Optional[bool] = None, pdl: bool = False,
):
    """ReplaySSM buffered decode (T=1), GDN or KDA (``is_kda``). The checkpoint pool
    initial_state is written only on a flush (write_pos == L-1 or force_flush != 0); otherwise the
    record (d, k, g) is appended to the rings at write_pos. With ``advance_write_pos`` each live
    row's cursor advances on the device (``wp = flushed ? 0 : wp + 1``). Returns ``out``."""
    lb = None if lower_bound is None else _opt_float(lower_bound, "lower_bound")
    if _is_compiling():
        _tops.ops.replayssm_decode(mixed_qkv, a, b, A_log, dt_bias, _scale(scale), initial_state,
                                   d_cache, k_cache, g_cache, out, ssm_state_indices, write_pos,
                                   force_flush, bool(is_kda), bool(use_qk_l2norm_in_kernel), lb,
                                   bool(advance_write_pos), _check(check_indices), bool(pdl))
        return out
    try:
        _replay(mixed_qkv, a, b, A_log, dt_bias, scale if type(scale) is float else _scale(scale),
                initial_state, d_cache, k_cache, g_cache, out, ssm_state_indices, write_pos,
                force_flush, is_kda if type(is_kda) is bool else bool(is_kda),
                use_qk_l2norm_in_kernel if use_qk_l2norm_in_kernel is True
                else bool(use_qk_l2norm_in_kernel),
                lb, advance_write_pos if type(advance_write_pos) is bool else bool(advance_write_pos),
                -1 if check_indices is None else _check(check_indices),
                pdl if pdl is False else bool(pdl))
    except (TypeError, BufferError) as e:
        args = (mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache,
                out, ssm_state_indices, write_pos, force_flush, is_kda, use_qk_l2norm_in_kernel, lb,
                advance_write_pos, check_indices, pdl)
        raise _arg_error("fused_recurrent_linear_replayssm_decode", _REPLAY_ARGS, args, e) from None
    return out


fused_recurrent_gdn_replayssm_decode = fused_recurrent_linear_replayssm_decode


from ._lib import cuda_available, cuda_built  # noqa: E402,F401  (device and build queries)
