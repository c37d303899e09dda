"""deltastate: the recurrent state of gated delta-rule linear attention (GDN, KDA) for serving.

Ops take numpy arrays or torch tensors (CPU or CUDA) zero-copy and update the caller's state pools
in place; see :mod:`deltastate.ops` and :class:`deltastate.StatePool`.
"""

from ._lib import cuda_available, cuda_built
from .ops import (
    fused_recurrent_gated_delta_rule_packed_decode,
    fused_recurrent_gdn_replayssm_decode,
    fused_recurrent_kda_packed_decode,
    fused_recurrent_linear_replayssm_decode,
    recurrent_gated_delta_rule,
    recurrent_kda,
)
from .pool import StatePool

__all__ = [
    "StatePool",
    "cuda_available",
    "cuda_built",
    "fused_recurrent_gated_delta_rule_packed_decode",
    "fused_recurrent_gdn_replayssm_decode",
    "fused_recurrent_kda_packed_decode",
    "fused_recurrent_linear_replayssm_decode",
    "recurrent_gated_delta_rule",
    "recurrent_kda",
]
__version__ = "0.1.0"
