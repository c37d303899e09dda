"""README.md's Python examples, executed verbatim, and what each promises checked afterwards
(the transformers example runs in integrations/test_transformers.py)."""
import contextlib
import io
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def run_example(name, prints):
    """Runs the example; it must print `prints` (its closing line, which a reader can check
    against the comment beside it)."""
    m = re.search(rf"<!-- example: {name} -->\s*```python\n(.*?)```", README, re.S)
    assert m, f"README.md lost its {name} example"
    ns = {}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(m.group(1), f"README.md ({name})", "exec"), ns)
    assert stdout.getvalue() == prints + "\n"
    assert f"# {prints}" in m.group(1).splitlines()[-1]  # the comment shows what it prints
    return ns


def test_decode_example():
    ns = run_example("decode", "(4, 1, 32, 128) True")
    out, state, pool, slots = ns["out"], ns["state"], ns["pool"], ns["slots"]
    assert out.shape == (ns["B"], 1, ns["HV"], ns["V"]) and torch.isfinite(out.float()).all()
    assert state.data_ptr() == pool.layer_state(1).data_ptr()  # in place, the pool's own memory
    live = set(slots.tolist())
    for s in range(state.shape[0]):
        if s not in live:  # untouched slots stay as allocated
            assert not state[s].any()
    assert all(state[s].abs().sum() > 0 for s in live)


def test_quantized_example():
    ns = run_example("quantized", "torch.float8_e4m3fn 3")
    pool, slots, state = ns["pool"], ns["slots"], ns["state"]
    assert pool.layer_state(1).dtype == torch.float8_e4m3fn
    assert int(pool.rounding_step(1)[0]) == 3  # one step per call
    live = slots.tolist()
    assert all(state[s].abs().sum() > 0 for s in live) and torch.isfinite(state).all()
    others = [s for s in range(state.shape[0]) if s not in live]
    assert not pool.layer_state(1)[others].view(torch.uint8).any()  # untouched slots stay zero
    assert not pool.layer_scales(1)[others].any()
    assert torch.isfinite(ns["out"]).all()


def test_verify_example():
    ns = run_example("verify", "True True")
    pool, scratch, slots, accepted = ns["pool"], ns["scratch"], ns["slots"], ns["accepted"]
    for n, (slot, acc) in enumerate(zip(slots.tolist(), accepted.tolist())):
        assert torch.equal(pool[slot], scratch[n, acc - 1])  # the state after the accepted tokens
    others = [s for s in range(pool.shape[0]) if s not in slots.tolist()]
    assert not pool[others].any()
    # the verify's outputs equal plain decode steps from the same initial state (zeros)
    ds = ns["ds"]
    B, T, HV, V = ns["B"], ns["T"], ns["HV"], ns["V"]
    pool2 = torch.zeros_like(pool)
    out2 = torch.empty(B, T, HV, V, dtype=torch.bfloat16)
    ds.verify(ns["q"], ns["k"], ns["v"], ns["a"], ns["b"], out2, pool2, slots, ns["A_log"],
              ns["dt_bias"])
    np.testing.assert_array_equal(out2.float().numpy(), ns["out"].float().numpy())
    for n, slot in enumerate(slots.tolist()):
        assert torch.equal(pool2[slot], scratch[n, T - 1])  # update_state: the last state


def test_layer_verify_example():
    ns = run_example("layer-verify", "True")
    pool, slots, accepted, rows = ns["pool"], ns["slots"], ns["accepted"], ns["rows"]
    inter, win = pool.intermediate_states(), pool.intermediate_conv_window()
    for layer in range(2):
        for n, (slot, acc) in enumerate(zip(slots.tolist(), accepted.tolist())):
            assert torch.equal(pool.layer_state(layer)[slot], inter[layer, n, acc - 1])
            assert torch.equal(pool.conv_state(layer)[slot], win[layer, n, acc - 1])
    # the last layer's windows hold the accepted drafts' inputs: the window after draft a - 1 is
    # the last W - 1 inputs up to it, all drafts of x here (T >= W - 1)
    mixed, W = ns["mixed"], ns["W"]
    for n, (slot, acc) in enumerate(zip(slots.tolist(), accepted.tolist())):
        if acc >= W - 1:
            assert torch.equal(pool.conv_state(1)[slot], mixed[n, acc - (W - 1):acc].T)
    assert ns["y"].is_contiguous()  # out follows x's layout, so the transpose back is dense
    assert torch.isfinite(ns["out"]).all()
