"""numpy without torch (issue #19, point 11): the StatePool falls back to numpy when torch cannot be
imported, its views meet every op's alignment contract (recurrent_kda's 32-byte base: numpy's own
allocations are only 16-byte aligned, so a plain np.zeros state fails it 3 times in 4), and a
misaligned caller array still gets the contract's error.

CI installs torch, so the test runs in a subprocess where torch is made unimportable
(``sys.modules["torch"] = None`` before deltastate is imported)."""

import os
import subprocess
import sys
import textwrap

import deltastate as ds
from helpers import torch

_SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None  # import torch now raises ImportError, as if not installed
    import numpy as np
    import deltastate as ds
    import reference as ref
    from cases import gate_params, packed_data

    assert sys.modules["torch"] is None, "something imported the real torch"
    rng = np.random.default_rng(11)
    H, HV, V, K = 1, 2, 8, 16
    for kda in (True, False):
        for trial in range(8):  # fresh pools: every one must be aligned, not 1 in 4
            junk = [np.empty(int(n)) for n in rng.integers(1, 50, 3)]  # shift the heap a little
            pool = ds.StatePool(layers=2, slots=4, HV=HV, V=V, K=K)  # no framework: numpy
            assert pool.framework == "numpy", pool.framework
            view = pool.layer_state(1)
            assert isinstance(view, np.ndarray) and view.ctypes.data % 32 == 0
            slots = [pool.allocate() for _ in range(3)]
            view[slots] = rng.standard_normal((3, HV, V, K)) * 0.5
            start = view.astype(np.float64)
            idx = np.array([slots[2], -1, slots[0]], dtype=np.int32)
            q = rng.standard_normal((3, 2, H, K)).astype(np.float32)
            k = rng.standard_normal((3, 2, H, K)).astype(np.float32)
            v = rng.standard_normal((3, 2, HV, V)).astype(np.float32)
            g = -rng.uniform(0.05, 1, (3, 2, HV, K) if kda else (3, 2, HV)).astype(np.float32)
            beta = rng.uniform(0.1, 0.9, (3, 2, HV)).astype(np.float32)
            op = ds.recurrent_kda if kda else ds.recurrent_gated_delta_rule
            o, ret = op(q, k, v, g, beta, initial_state=view, ssm_state_indices=idx)
            assert ret is view
            want_o, _, want = ref.recurrent(q.astype(np.float64), k.astype(np.float64),
                                            v.astype(np.float64), g.astype(np.float64),
                                            beta.astype(np.float64), kda=kda,
                                            initial_state=start, ssm_state_indices=idx)
            np.testing.assert_allclose(o, want_o, atol=1e-4, rtol=1e-4)
            np.testing.assert_allclose(view[slots], want[slots], atol=1e-5, rtol=1e-4)
            del junk

        # Packed decode over the pool's layer 0.
        d = packed_data(rng, kda=kda, B=2, H=H, HV=HV, K=K, V=V)
        A_log, dt_bias = gate_params(rng, HV, K, kda)
        x = {n: d[n].astype(np.float32) for n in d}
        out = np.full((2, 1, HV, V), np.nan, np.float32)
        start = pool.layer_state(0).astype(np.float64)
        rows = [slots[1], slots[0]]
        pd = (ds.fused_recurrent_kda_packed_decode if kda
              else ds.fused_recurrent_gated_delta_rule_packed_decode)
        pd(x["mixed_qkv"], x["a"], x["b"], A_log.astype(np.float32), dt_bias.astype(np.float32),
           K ** -0.5, pool.layer_state(0), out, np.array(rows, dtype=np.int32))
        want_out, want = ref.packed_decode(x["mixed_qkv"].astype(np.float64),
                                           x["a"].astype(np.float64), x["b"].astype(np.float64),
                                           A_log, dt_bias, K ** -0.5, start, rows, kda=kda)
        np.testing.assert_allclose(out, want_out, atol=1e-4, rtol=1e-4)

    # A caller's misaligned numpy state still gets the contract's error.
    buf = np.zeros(4 * HV * V * K + 16, dtype=np.float32)
    off = next(i for i in range(8) if buf[i:].ctypes.data % 32)
    bad = buf[off:off + 4 * HV * V * K].reshape(4, HV, V, K)
    try:
        g4 = -rng.uniform(0.05, 1, (3, 2, HV, K)).astype(np.float32)
        ds.recurrent_kda(q, k, v, g4, beta, initial_state=bad, ssm_state_indices=idx)
    except ValueError as e:
        assert "recurrent_kda state pool breaks the compiled stride contract" in str(e), e
    else:
        raise AssertionError("a misaligned state was accepted")
    try:
        ds.StatePool(layers=1, slots=1, HV=1, V=1, K=1, device="cuda")
    except ValueError as e:
        assert "needs torch, which is not installed" in str(e), e
    else:
        raise AssertionError("a CUDA pool without torch was accepted")
    try:
        ds.StatePool(layers=1, slots=1, HV=1, V=1, K=1, framework="torch")
    except ImportError as e:
        assert "needs torch, which is not installed" in str(e), e
    else:
        raise AssertionError("framework='torch' without torch was accepted")
    assert sys.modules["torch"] is None
    print("numpy-only ok")
""")


def test_pool_and_ops_without_torch():
    package = os.path.dirname(os.path.dirname(os.path.abspath(ds.__file__)))
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([package, tests] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "numpy-only ok" in r.stdout, r.stdout + r.stderr


def test_default_framework_is_torch_when_installed():
    pool = ds.StatePool(layers=1, slots=2, HV=1, V=4, K=4)
    assert pool.framework == ("torch" if torch is not None else "numpy")
