"""The decode ops, with the reference implementations' names, argument order and defaults.

Every function takes numpy arrays or torch tensors (CPU or CUDA) zero-copy, strided views included,
updates the caller's tensors in place and returns what the peer of its name returns (SGLang,
FLA, FlashInfer; README "Drop-in: peer functions"). Contract violations raise ValueError with the
core's exact text. On CUDA tensors the op launches on torch's current stream, without host
synchronization or allocation (when the caller passes the outputs and the states).

Each function's signature, conversions and call are generated from its entry in the op table
(:mod:`deltastate._surface`); ``help()`` shows its arguments with kinds and dtypes.

``check_indices`` (keyword): slot index checks. None = the backend default. CPU tensors (default
on): every index is checked before anything is written (out of range, or one live slot for two
rows: ValueError). CUDA tensors: the kernels always check the range on the device; a row whose
index is >= slots is skipped (state, rings and cursor untouched), its output is NaN and it is
recorded for :func:`deltastate.check_errors`, without host synchronization. ``check_indices=True``
on CUDA (default off) is the debug mode: the op synchronizes after its launch and raises the
ValueError itself (not while the stream is being captured into a CUDA graph). Duplicate slots are
not checked on CUDA (it would need a sort or a per-slot table on every call).

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

from . import _derive
from ._lib import lib
from ._surface import OPS

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


# ---- argument helpers (called by the generated functions) -------------------------------------
def _number(x: Any, name: str) -> float:
    if x is None or isinstance(x, (bool, str, bytes)):
        raise TypeError(f"{name} must be a number (got {type(x).__name__})")
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number (got {type(x).__name__})") from None


_rounding = _derive._rounding  # state_rounding as the binding takes it (generated code)


def _integer(x: Any, name: str) -> int:
    if x is None or isinstance(x, (bool, float, str, bytes)):
        raise TypeError(f"{name} must be an int (got {type(x).__name__})")
    try:
        return int(x.__index__())
    except (AttributeError, TypeError, ValueError):
        raise TypeError(f"{name} must be an int (got {type(x).__name__})") from None


def _number_or_none(x: Any, name: str) -> Optional[float]:
    if x is None:
        return None
    if isinstance(x, (bool, str, bytes)):
        raise TypeError(f"{name} must be a number or None (got {type(x).__name__})")
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number or None (got {type(x).__name__})") from None


def _arg_error(op: str, shown, args, exc: BaseException) -> BaseException:
    """A clearer exception for a call the binding rejected before the core saw it (error path
    only): name the argument instead of its position. `shown` holds, per binding position, the
    public argument's name and what it must be; `args` the values passed."""
    msg = str(exc)
    if isinstance(exc, TypeError):
        m = re.search(r"argument #(\d+)", msg)
        if m and int(m.group(1)) < len(shown):
            i = int(m.group(1))
            name, expected = shown[i]
            return TypeError(f"{op}: `{name}` must be {expected}; got {type(args[i]).__name__}")
        return exc
    if isinstance(exc, BufferError):
        for (name, _), a in zip(shown, args):
            flags = getattr(a, "flags", None)
            if flags is not None and getattr(flags, "writeable", True) is False:
                return ValueError(
                    f"{op}: `{name}` is a read-only numpy array, which DLPack cannot export; pass a "
                    "writable array (e.g. a copy)")
        return ValueError(f"{op}: an argument could not be exported through DLPack ({msg})")
    return exc


_spelled = _derive.spelled


def _not_implemented(op: str, name: str, value: Any, what: str) -> NotImplementedError:
    """A peer's option deltastate does not implement, given a value other than its default."""
    shown = type(value).__name__ if hasattr(value, "shape") else repr(value)
    return NotImplementedError(f"{op}: `{name}`={shown} {what}")


# ---- the public functions, from the op table ---------------------------------------------------
def _build() -> None:
    signatures = lib.op_signatures()
    for op in OPS:
        binding = _derive.binding_order(op, signatures)
        globals()[op.public] = _derive.public_function(op, getattr(lib, op.binding_name), binding,
                                                       globals())


_build()
# The peers' aliases: SGLang's GDN name of ReplaySSM, FLA's short names of its GDN functions.
fused_recurrent_gdn_replayssm_decode = fused_recurrent_linear_replayssm_decode  # noqa: F821
fused_recurrent_gdn = fused_recurrent_gated_delta_rule  # noqa: F821
chunk_gdn = chunk_gated_delta_rule  # noqa: F821


from ._lib import cuda_available, cuda_built  # noqa: E402,F401  (device and build queries)

__all__ = [op.public for op in OPS] + ["fused_recurrent_gdn_replayssm_decode",
                                       "fused_recurrent_gdn", "chunk_gdn"]
