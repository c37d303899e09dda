"""The ops as torch custom ops (``torch.ops.deltastate.*``), for torch.compile.

Registered the way vLLM's ``direct_register_custom_op`` and SGLang register theirs: a
``torch.library.Library("deltastate", "DEF")`` with one ``define`` per op whose schema marks every
tensor the op writes as mutated (``Tensor(a!)``), an ``impl`` for the CPU and CUDA dispatch keys
that calls the tvm-ffi function directly, and a fake (meta) implementation so that torch.compile
traces the op without running it. The ops return nothing: like the kernels, they write into the
caller's tensors (outputs and state pools) in place.

This module is imported by :mod:`deltastate.ops` only when torch is installed; the public functions
(``fused_recurrent_gated_delta_rule_packed_decode`` & co) route through these ops only while
torch.compile is tracing (``torch.compiler.is_compiling()``), so eager calls keep the direct,
low-overhead tvm-ffi path. Models may also call ``torch.ops.deltastate.<op>`` themselves.
"""

from __future__ import annotations

import torch

from ._lib import lib as _ffi

NAMESPACE = "deltastate"

_PACKED = (
    "Tensor mixed_qkv, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, float scale, "
    "Tensor(a!) initial_state, Tensor(b!) out, Tensor ssm_state_indices, "
    "bool use_qk_l2norm_in_kernel=True, float? lower_bound=None, bool round_beta=False, "
    "int check_indices=-1, bool pdl=False"
)
# `initial_state` is only read (a [N, HV, V, K] start state); `state_pool` is the pool that
# `ssm_state_indices` index and that the op updates in place. At most one of them is given.
_RECURRENT = (
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) output, Tensor? A_log, "
    "Tensor? dt_bias, bool use_gate_in_kernel, float? lower_bound, bool beta_is_logit, "
    "float? scale, Tensor? initial_state, Tensor(b!)? state_pool, Tensor? ssm_state_indices, "
    "Tensor? cu_seqlens, Tensor(c!)? final_state, bool use_qk_l2norm_in_kernel, "
    "int check_indices=-1, bool pdl=False"
)
_REPLAY = (
    "Tensor mixed_qkv, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, float scale, "
    "Tensor(a!) initial_state, Tensor(b!) d_cache, Tensor(c!) k_cache, Tensor(d!) g_cache, "
    "Tensor(e!) out, Tensor ssm_state_indices, Tensor(f!) write_pos, Tensor? force_flush, "
    "bool is_kda=False, bool use_qk_l2norm_in_kernel=True, float? lower_bound=None, "
    "bool advance_write_pos=False, int check_indices=-1, bool pdl=False"
)

SCHEMAS = {
    "gdn_packed_decode": f"gdn_packed_decode({_PACKED}) -> ()",
    "kda_packed_decode": f"kda_packed_decode({_PACKED}) -> ()",
    "recurrent_gated_delta_rule": f"recurrent_gated_delta_rule({_RECURRENT}) -> ()",
    "recurrent_kda": f"recurrent_kda({_RECURRENT}) -> ()",
    "replayssm_decode": f"replayssm_decode({_REPLAY}) -> ()",
}


# ---- real implementations (CPU and CUDA dispatch keys) ----------------------------------------
def _packed(is_kda):
    def impl(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices,
             use_qk_l2norm_in_kernel=True, lower_bound=None, round_beta=False, check_indices=-1,
             pdl=False):
        _ffi.packed_decode(is_kda, mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                           ssm_state_indices, use_qk_l2norm_in_kernel,
                           lower_bound if is_kda else None, round_beta, check_indices, pdl)

    return impl


def _recurrent(is_kda):
    def impl(q, k, v, g, beta, output, A_log, dt_bias, use_gate_in_kernel, lower_bound,
             beta_is_logit, scale, initial_state, state_pool, ssm_state_indices, cu_seqlens,
             final_state, use_qk_l2norm_in_kernel, check_indices=-1, pdl=False):
        pooled = state_pool is not None
        _ffi.recurrent(is_kda, q, k, v, g, beta, output, A_log, dt_bias, use_gate_in_kernel,
                       lower_bound, beta_is_logit, scale,
                       state_pool if pooled else initial_state, ssm_state_indices, cu_seqlens,
                       final_state, pooled, use_qk_l2norm_in_kernel, check_indices, pdl)

    return impl


def _replay(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache, out,
            ssm_state_indices, write_pos, force_flush, is_kda=False, use_qk_l2norm_in_kernel=True,
            lower_bound=None, advance_write_pos=False, check_indices=-1, pdl=False):
    _ffi.replayssm_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache,
                          g_cache, out, ssm_state_indices, write_pos, force_flush, is_kda,
                          use_qk_l2norm_in_kernel, lower_bound, advance_write_pos, check_indices,
                          pdl)


IMPLS = {
    "gdn_packed_decode": _packed(False),
    "kda_packed_decode": _packed(True),
    "recurrent_gated_delta_rule": _recurrent(False),
    "recurrent_kda": _recurrent(True),
    "replayssm_decode": _replay,
}


# ---- fake (meta) implementations ---------------------------------------------------------------
# Every op only writes tensors it was given, so under FakeTensor tracing there is nothing to
# produce: the schema's (a!) annotations tell the compiler which inputs change.
def _fake(*args, **kwargs):
    return None


def _register():
    lib = torch.library.Library(NAMESPACE, "DEF")
    for name, schema in SCHEMAS.items():
        lib.define(schema)
        for key in ("CPU", "CUDA"):
            lib.impl(name, IMPLS[name], key)
        qualname = f"{NAMESPACE}::{name}"
        if hasattr(torch.library, "register_fake"):  # torch >= 2.4
            torch.library.register_fake(qualname, _fake, lib=lib)
        else:  # pragma: no cover - older torch
            torch.library.impl_abstract(qualname, _fake, lib=lib)
    return lib


_LIB = _register()  # kept alive for the process: dropping a Library deregisters its ops
ops = getattr(torch.ops, NAMESPACE)


# ---- the public functions' traced path ----------------------------------------------------------
def recurrent(is_kda, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
              use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, cu_seqlens,
              ssm_state_indices, output, beta_is_logit, check_indices, pdl=False):
    """What :func:`deltastate.recurrent_kda` / ``recurrent_gated_delta_rule`` do while torch.compile
    traces them: allocate the outputs with torch, then call the custom op."""
    if output is None:
        output = torch.empty_like(v)
    pooled = ssm_state_indices is not None
    final_state = None
    if not pooled and output_final_state:
        n = (cu_seqlens.shape[0] - 1) if cu_seqlens is not None else q.shape[0]
        final_state = torch.empty((n, v.shape[2], v.shape[3], q.shape[3]), dtype=torch.float32,
                                  device=q.device)
    op = ops.recurrent_kda if is_kda else ops.recurrent_gated_delta_rule
    op(q, k, v, g, beta, output, A_log, dt_bias, use_gate_in_kernel, lower_bound, beta_is_logit,
       scale, None if pooled else initial_state, initial_state if pooled else None,
       ssm_state_indices, cu_seqlens, final_state, use_qk_l2norm_in_kernel, check_indices, pdl)
    if pooled:
        return output, initial_state
    return output, final_state
