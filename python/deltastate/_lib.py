"""Loads the compiled tvm-ffi module (``_deltastate.so``) that sits next to this file."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import tvm_ffi
import tvm_ffi.error

# The core raises NotImplementedError for features a build lacks (e.g. CUDA); teach tvm-ffi the kind.
try:
    tvm_ffi.error.register_error("NotImplementedError", NotImplementedError)
except Exception:  # already registered
    pass


def _find_module() -> Path:
    override = os.environ.get("DELTASTATE_MODULE")
    if override:
        return Path(override)
    here = Path(__file__).resolve().parent
    return here / "_deltastate.so"


_path = _find_module()
if not _path.exists():
    raise ImportError(
        f"deltastate: compiled module not found at {_path}; install the package with `pip install .` "
        "from the repository root (or set DELTASTATE_MODULE to a built _deltastate.so)"
    )
lib = tvm_ffi.load_module(str(_path))


def cuda_available() -> bool:
    """Whether a CUDA device can run deltastate's CUDA backend: the build has it
    (:func:`cuda_built`) and the CUDA runtime reports at least one device. False on a machine
    without a GPU or driver; never raises."""
    return bool(lib.cuda_available())


def cuda_built() -> bool:
    """Whether this build of deltastate contains the CUDA backend (compiled with nvcc), whether
    or not a device is present."""
    return bool(lib.cuda_built())


def check_errors(stream=None) -> None:
    """Raises ValueError for a bad row a CUDA kernel skipped since the last check: an index >= the
    pool's slots (or a ReplaySSM cursor outside its ring). The kernels check every row on the
    device and never raise: such a row is skipped (its state, rings and cursor untouched), its
    output is NaN, and the first one is recorded in the device's error record. This synchronizes
    ``stream``, reads the record of its device, clears it and raises naming the op, the row, the
    bad value and the pool size. ``stream``: a ``torch.cuda.Stream``, a raw ``cudaStream_t`` as an
    int, or None for torch's current stream (the legacy default stream when torch's CUDA is not
    initialized). A no-op without CUDA or before any CUDA op ran on the stream's device. An op
    called with ``check_indices=True`` on CUDA tensors does this after its launch (debug mode)."""
    if not lib.cuda_built():
        return
    raw, device = 0, None
    if stream is None or not isinstance(stream, int):
        torch = sys.modules.get("torch")
        if stream is None and torch is not None and torch.cuda.is_initialized():
            stream = torch.cuda.current_stream()
        if stream is not None:
            raw, device = int(stream.cuda_stream), stream.device
    else:
        raw = stream
    if device is not None:
        import torch

        with torch.cuda.device(device):
            lib.check_errors(raw)
    else:
        lib.check_errors(raw)
