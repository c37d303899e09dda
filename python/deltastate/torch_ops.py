"""The ops as torch custom ops (``torch.ops.deltastate.*``), for torch.compile.

Registered the way vLLM's ``direct_register_custom_op`` and SGLang register theirs: a
``torch.library.Library("deltastate", "DEF")`` with one ``define`` per op whose schema marks every
tensor the op writes as mutated (``Tensor(a!)``), an ``impl`` for the CPU and CUDA dispatch keys
that calls the tvm-ffi function directly, and a fake (meta) implementation so that torch.compile
traces the op without running it. The ops return nothing: like the kernels, they write into the
caller's tensors (outputs and state pools) in place. Schemas, implementations and fakes are
derived from the op table (:mod:`deltastate._surface`).

This module is imported by :mod:`deltastate.ops` only when torch is installed; the public functions
(``fused_recurrent_gated_delta_rule_packed_decode`` & co) route through these ops only while
torch.compile is tracing (``torch.compiler.is_compiling()``), so eager calls keep the direct,
low-overhead tvm-ffi path. Models may also call ``torch.ops.deltastate.<op>`` themselves.
"""

from __future__ import annotations

import torch

from . import _derive
from ._lib import lib as _ffi
from ._surface import OPS

NAMESPACE = "deltastate"

SCHEMAS = {op.name: _derive.schema(op) for op in OPS}


def _register():
    lib = torch.library.Library(NAMESPACE, "DEF")
    signatures = _ffi.op_signatures()
    for op in OPS:
        lib.define(SCHEMAS[op.name])
        impl = _derive.torch_impl(op, getattr(_ffi, op.name), _derive.binding_order(op, signatures))
        for key in ("CPU", "CUDA"):
            lib.impl(op.name, impl, key)
        qualname = f"{NAMESPACE}::{op.name}"
        if hasattr(torch.library, "register_fake"):  # torch >= 2.4
            torch.library.register_fake(qualname, _derive.torch_fake, lib=lib)
        else:  # pragma: no cover - older torch
            torch.library.impl_abstract(qualname, _derive.torch_fake, lib=lib)
    return lib


_LIB = _register()  # kept alive for the process: dropping a Library deregisters its ops
ops = getattr(torch.ops, NAMESPACE)
