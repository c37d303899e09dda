"""The decode ops, with the reference implementations' names and argument order.

Every function takes numpy arrays or torch tensors (CPU or CUDA) zero-copy, strided views included,
updates the caller's tensors in place and returns them as the reference does. Contract violations
raise ValueError with the core's exact text. On CUDA tensors the op launches on torch's current
stream, without host synchronization or allocation (when the caller passes the outputs).

``check_indices`` (keyword): bounds-check slot indices. None = the backend default (on for CPU
tensors, checked before anything is written; off for CUDA tensors, where it is a debug option that
traps the kernel on an out-of-range index).
"""

from __future__ import annotations

from typing import Any, Optional

from ._lib import lib

_pd = lib.packed_decode
_rec = lib.recurrent
_replay = lib.replayssm_decode


def _check(flag: Optional[bool]) -> int:
    return -1 if flag is None else int(bool(flag))


def _scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a number (got {type(scale).__name__})")
    return float(scale)


def fused_recurrent_gated_delta_rule_packed_decode(
    mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices,
    use_qk_l2norm_in_kernel: bool = True, *, round_beta: bool = False,
    check_indices: Optional[bool] = None,
):
    """GDN packed decode (T=1). Returns ``(out, initial_state)``, both updated in place.

    mixed_qkv [B, 2*H*K + HV*V]; a, b [B, HV]; A_log, dt_bias [HV]; initial_state: the pool
    [slots, HV, V, K] (any slot stride); out [B, 1, HV, V]; ssm_state_indices [B] (< 0: padded row).
    """
    _pd(False, mixed_qkv, a, b, A_log, dt_bias, _scale(scale), initial_state, out,
        ssm_state_indices, bool(use_qk_l2norm_in_kernel), None, bool(round_beta),
        _check(check_indices))
    return out, initial_state


def fused_recurrent_kda_packed_decode(
    mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices,
    use_qk_l2norm_in_kernel: bool = True, lower_bound: Optional[float] = None, *,
    round_beta: bool = False, check_indices: Optional[bool] = None,
):
    """KDA packed decode (T=1). As the GDN op, with a [B, HV*K] and dt_bias [HV*K];
    ``lower_bound`` selects the safe gate. Returns ``(out, initial_state)``."""
    _pd(True, mixed_qkv, a, b, A_log, dt_bias, _scale(scale), initial_state, out,
        ssm_state_indices, bool(use_qk_l2norm_in_kernel),
        None if lower_bound is None else float(lower_bound), bool(round_beta),
        _check(check_indices))
    return out, initial_state


def _like(ref, shape, dtype_of):
    """A new tensor of `ref`'s framework and device (torch or numpy)."""
    mod = type(ref).__module__
    if mod.startswith("torch"):
        import torch

        return torch.empty(shape, dtype=dtype_of, device=ref.device)
    import numpy as np

    return np.empty(shape, dtype=dtype_of)


def _float32_of(ref):
    if type(ref).__module__.startswith("torch"):
        import torch

        return torch.float32
    import numpy as np

    return np.float32


def _recurrent(is_kda, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
               use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, cu_seqlens,
               ssm_state_indices, output, beta_is_logit, check_indices):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t is None:
            raise TypeError(f"`{name}` is required")
    if output is None:
        output = _like(v, tuple(v.shape), v.dtype)
    pooled = ssm_state_indices is not None
    if pooled and initial_state is None:
        raise ValueError("`ssm_state_indices` index a state pool, but no `initial_state` pool was given")
    final_state = None
    if not pooled and output_final_state:
        n = (len(cu_seqlens) - 1) if cu_seqlens is not None else q.shape[0]
        final_state = _like(q, (n, v.shape[2], v.shape[3], q.shape[3]), _float32_of(q))
    _rec(bool(is_kda), q, k, v, g, beta, output, A_log, dt_bias, bool(use_gate_in_kernel),
         None if lower_bound is None else float(lower_bound), bool(beta_is_logit),
         None if scale is None else _scale(scale), initial_state, ssm_state_indices, cu_seqlens,
         final_state, pooled, bool(use_qk_l2norm_in_kernel), _check(check_indices))
    if pooled:
        return output, initial_state
    return output, final_state


def recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                  output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
                  lower_bound=None, cu_seqlens=None, ssm_state_indices=None, output=None,
                  beta_is_logit=False, *, check_indices: Optional[bool] = None):
    """Recurrent KDA over a pool: q, k [B,T,H,K] (or [1,T_total,H,K] with cu_seqlens [N+1]),
    v [B,T,HV,V], g [B,T,HV,K] (log decay; the raw gate input with use_gate_in_kernel), beta
    [B,T,HV]. With ssm_state_indices the pool initial_state [slots,HV,V,K] is updated in place and
    returned; without them initial_state [N,HV,V,K] is only read, and output_final_state returns a
    new float32 [N,HV,V,K]. The pool must meet the compiled stride contract (slot stride a multiple
    of 16 elements, base 32-byte aligned). Returns ``(o, final_state)``."""
    return _recurrent(True, q, k, v, g, beta, A_log, dt_bias, scale, initial_state,
                      output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound,
                      cu_seqlens, ssm_state_indices, output, beta_is_logit, check_indices)


def recurrent_gated_delta_rule(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None,
                               initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
                               lower_bound=None, cu_seqlens=None, ssm_state_indices=None,
                               output=None, beta_is_logit=False, *,
                               check_indices: Optional[bool] = None):
    """Recurrent GDN: as :func:`recurrent_kda` with g [B,T,HV] (one decay per value head)."""
    return _recurrent(False, q, k, v, g, beta, A_log, dt_bias, scale, initial_state,
                      output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound,
                      cu_seqlens, ssm_state_indices, output, beta_is_logit, check_indices)


def fused_recurrent_linear_replayssm_decode(
    mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache, out,
    ssm_state_indices, write_pos, force_flush=None, *, is_kda: bool = False,
    use_qk_l2norm_in_kernel: bool = True, lower_bound: Optional[float] = None,
    advance_write_pos: bool = False, check_indices: Optional[bool] = None,
):
    """ReplaySSM buffered decode (T=1), GDN or KDA (``is_kda``). The checkpoint pool
    initial_state is written only on a flush (write_pos == L-1 or force_flush != 0); otherwise the
    record (d, k, g) is appended to the rings at write_pos. With ``advance_write_pos`` each live
    row's cursor advances on the device (``wp = flushed ? 0 : wp + 1``). Returns ``out``."""
    _replay(mixed_qkv, a, b, A_log, dt_bias, _scale(scale), initial_state, d_cache, k_cache,
            g_cache, out, ssm_state_indices, write_pos, force_flush, bool(is_kda),
            bool(use_qk_l2norm_in_kernel), None if lower_bound is None else float(lower_bound),
            bool(advance_write_pos), _check(check_indices))
    return out


fused_recurrent_gdn_replayssm_decode = fused_recurrent_linear_replayssm_decode


def cuda_available() -> bool:
    """Whether this build of deltastate contains the CUDA backend."""
    return bool(lib.cuda_available())
