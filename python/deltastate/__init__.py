"""deltastate: the recurrent state of gated delta-rule linear attention (GDN, KDA) for serving.

Ops take numpy arrays or torch tensors (CPU or CUDA) zero-copy and update the caller's state pools
in place; see :mod:`deltastate.ops` and :class:`deltastate.StatePool`.
"""

from . import ops
from ._lib import check_errors, cuda_available, cuda_built
from .ops import *  # noqa: F401,F403 - the public function of each op in the op table
from .pool import StatePool

__all__ = ["StatePool", "check_errors", "cuda_available", "cuda_built", *ops.__all__]
__version__ = "0.1.0"
