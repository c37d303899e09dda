"""Loads the compiled tvm-ffi module (``_deltastate.so``) that sits next to this file."""

from __future__ import annotations

import os
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
