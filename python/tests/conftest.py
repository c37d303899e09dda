"""pytest fixtures: a fresh, reproducible random generator per test, and the frameworks."""

import os
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # reference.py, helpers.py

from helpers import Fw, torch  # noqa: E402

FRAMEWORKS = ["numpy"] + (["torch"] if torch is not None else [])


@pytest.fixture
def rng(request):
    """Fresh random inputs for every test (and every parametrization), seeded from the test id so
    a failure reproduces. DELTASTATE_TEST_SEED shifts every seed."""
    base = int(os.environ.get("DELTASTATE_TEST_SEED", "0"))
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()) + base)


@pytest.fixture(params=FRAMEWORKS)
def fw(request):
    return Fw(request.param)


@pytest.fixture
def tfw():
    """torch on the CPU (tests of bfloat16 and torch-only behaviour)."""
    if torch is None:
        pytest.skip("torch is not installed")
    return Fw("torch")


# ---- integrations: which deltastate ops an adapter called ----------------------------------
@pytest.fixture
def ds_op_calls(monkeypatch):
    """Counts calls of deltastate's FLA-named ops by name (the integration adapters look
    ``deltastate.<name>`` up per call), so a test can assert that deltastate ran."""
    import deltastate

    counts = {}
    for name in ("chunk_gated_delta_rule", "chunk_kda", "fused_recurrent_gated_delta_rule",
                 "fused_recurrent_kda", "causal_conv1d_update"):
        original = getattr(deltastate, name)

        def spy(*a, _original=original, _name=name, **kw):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*a, **kw)

        monkeypatch.setattr(deltastate, name, spy)
    return counts
