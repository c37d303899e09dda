"""Tensor-parallel layers (deltastate.tp): TP = 2 and TP = 3 over 2 / 3 gloo processes on the CPU
started by torchrun (the launcher itself), against the TP = 1 layer in this process; the TP = 1
layer against HF transformers' own modules; the head-split rules and their error texts; a 1-rank
NCCL run on CUDA (skipped without a GPU)."""

import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import deltastate as ds  # noqa: E402
from deltastate import tp  # noqa: E402

PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ds.__file__)))
CONFIGS = {"gdn": tp.GDNConfig.small(), "kda": tp.KDAConfig.small()}


def _env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [PKG_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.setdefault("DELTASTATE_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _torchrun(nproc, out, *args, timeout=240):
    """`torchrun --nproc-per-node nproc -m deltastate.tp` (the module's own launcher path)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "deltastate.tp", "--out", str(out), *args]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stdout}\n{p.stderr[-4000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def reference():
    """The TP = 1 outputs of both layers over the default schedule, in this process."""
    events = tp.schedule(64, 0)
    return {k: tp.run_schedule(tp.build_layer(c, 0, 1), events) for k, c in CONFIGS.items()}


def _check(got, ref):
    err, mag = tp.max_error(got, ref)
    assert err <= tp.TOLERANCE * max(mag, 1.0), (err, mag)
    return err, mag


def test_schedule_is_continuous_batching():
    events = tp.schedule(64, 0)
    assert len(events) == 64
    assert sum(len(e.leave) for e in events) >= 10  # requests leave ...
    assert sum(len(e.join) for e in events[1:]) >= 10  # ... and join mid-run
    assert max(n for e in events for _, n in e.join) > 64  # prompts cross the 64-token chunk
    assert len({len(e.batch) for e in events}) >= 4  # the batch size changes


@pytest.mark.parametrize("world", [2, 3], ids=["tp2", "tp3"])
def test_tp_equals_tp1(tmp_path, reference, world):
    """TP = 2 (even) and TP = 3 (H = 4 key heads split 2, 1, 1) equal TP = 1 within
    tp.TOLERANCE, on gloo with one process per rank."""
    out = tmp_path / "out.pt"
    log = _torchrun(world, out, "--device", "cpu")
    got = torch.load(out)
    for kind in CONFIGS:
        _check(got[kind], reference[kind])
        assert f"{kind}: tp={world} backend=gloo" in log and "OK" in log


def test_shards_sum_to_the_layer(reference):
    """Every rank's partial output (before the all-reduce) summed in one process equals TP = 1:
    the sharding alone, without torch.distributed."""
    events = tp.schedule(64, 0)
    for kind, cfg in CONFIGS.items():
        parts = [tp.run_schedule(tp.build_layer(cfg, r, 3), events) for r in range(3)]
        summed = {"prefill": {k: sum(p["prefill"][k] for p in parts) for k in parts[0]["prefill"]},
                  "decode": [(b, sum(p["decode"][i][1] for p in parts))
                             for i, (b, _) in enumerate(parts[0]["decode"])]}
        _check(summed, reference[kind])


def test_head_shards():
    assert [(s.h0, s.h, s.v0, s.hv) for s in tp.head_shards(16, 32, 3)] == [
        (0, 6, 0, 12), (6, 5, 12, 10), (11, 5, 22, 10)]  # Qwen3-Next at TP = 3
    assert [(s.h, s.hv) for s in tp.head_shards(32, 32, 4)] == [(8, 8)] * 4  # Kimi-Linear
    layer = tp.build_layer(CONFIGS["gdn"], 1, 3, slots=4)
    assert (layer.pool.HV, layer.state.shape[1], layer.window.shape[1]) == (2, 2, 2 * 16 + 2 * 16)


@pytest.mark.parametrize("args, text", [
    ((4, 8, 5, True), "cannot shard H=4 key heads (HV=8 value heads) over tp=5 ranks: every rank "
                      "needs at least one key head; use tp <= 4"),
    ((16, 32, 3, False), "H=16 key heads (HV=32 value heads) do not divide by tp=3; pass "
                         "uneven=True to give the first 1 rank(s) one key head more"),
    ((4, 6, 2, True), "value heads HV=6 must be a positive multiple of key heads H=4"),
    ((4, 8, 0, True), "tensor-parallel size must be >= 1; got tp=0"),
])
def test_head_shard_errors(args, text):
    H, HV, world, uneven = args
    with pytest.raises(ValueError) as e:
        tp.head_shards(H, HV, world, uneven=uneven)
    assert str(e.value) == text


def test_uneven_reject_in_the_launcher():
    with pytest.raises(ValueError, match=r"H=4 key heads \(HV=4 value heads\) do not divide by "
                                         r"tp=3"):
        tp.build_layer(CONFIGS["kda"], 0, 3, uneven=False)


def test_multicast_switches(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    tp.multicast_off()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"


_HF_CHECK = r"""
import sys
sys.modules["fla"] = None  # HF's pure-torch paths (FLA's Triton kernels need a GPU)
sys.modules["causal_conv1d"] = None
import torch
from deltastate import tp
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

def ours(cfg, x, L):  # prefill L tokens, then decode the rest one by one
    layer = tp.build_layer(cfg, 0, 1, slots=4)
    layer.allocate()
    s = layer.allocate()  # slot 1: a nonzero slot index
    y = [layer.prefill(x[:L], [0, L], [s])]
    idx = torch.tensor([s], dtype=torch.int32)
    for t in range(L, x.shape[0]):
        y.append(layer.decode(x[t:t + 1], idx))
    return torch.cat(y)

torch.manual_seed(0)
c = tp.GDNConfig.small()
m = Qwen3NextGatedDeltaNet(Qwen3NextConfig(
    hidden_size=c.hidden, linear_num_key_heads=c.H, linear_num_value_heads=c.HV,
    linear_key_head_dim=c.K, linear_value_head_dim=c.V, linear_conv_kernel_dim=c.conv_kernel,
    rms_norm_eps=c.eps, num_hidden_layers=1, layer_types=["linear_attention"],
    hidden_act="silu"), 0)
w = tp.gdn_weights(c)
with torch.no_grad():
    m.in_proj_qkvz.weight.copy_(w["in_proj_qkvz"]); m.in_proj_ba.weight.copy_(w["in_proj_ba"])
    m.conv1d.weight.copy_(w["conv1d"].unsqueeze(1)); m.A_log.copy_(w["A_log"])
    m.dt_bias.copy_(w["dt_bias"]); m.norm.weight.copy_(w["norm"])
    m.out_proj.weight.copy_(w["out_proj"])
    x = torch.randn(90, c.hidden)
    ref = m(x[None])[0]
    got = ours(c, x, 70)
print("gdn", float((got - ref).abs().max()), float(ref.abs().max()))

c = tp.KDAConfig.small()
m = KimiLinearDeltaAttention(KimiLinearConfig(
    hidden_size=c.hidden, linear_num_heads=c.H, linear_head_dim=c.K,
    linear_conv_kernel_dim=c.conv_kernel, rms_norm_eps=c.eps, num_hidden_layers=1,
    hidden_act="silu"), 0)
w = tp.kda_weights(c)
with torch.no_grad():
    for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
        getattr(m, n).weight.copy_(w[n])
    m.conv1d.weight.copy_(torch.cat([w["q_conv1d"], w["k_conv1d"], w["v_conv1d"]]).unsqueeze(1))
    m.forget_gate.f_a_proj.weight.copy_(w["f_a_proj"])
    m.forget_gate.f_b_proj.weight.copy_(w["f_b_proj"])
    m.forget_gate.dt_bias.copy_(w["dt_bias"])
    m.forget_gate.A_log.copy_(w["A_log"].view(1, 1, -1, 1))
    m.o_norm.weight.copy_(w["o_norm"])
    ref = m(x[None])[0]
    got = ours(c, x, 70)
print("kda", float((got - ref).abs().max()), float(ref.abs().max()))
"""


def test_tp1_matches_transformers():
    """The TP = 1 layers are HF's Qwen3NextGatedDeltaNet and KimiLinearDeltaAttention: the same
    weights, 70 tokens prefilled, 20 decoded, against HF's forward over all 90 (its pure-torch
    chunked path, fp32). Tolerance: 1e-4 of the largest output, as tp.TOLERANCE."""
    try:
        import transformers.models.kimi_linear  # noqa: F401
        import transformers.models.qwen3_next  # noqa: F401
    except ImportError:
        pytest.skip("transformers with Qwen3-Next and Kimi-Linear is not installed")
    p = subprocess.run([sys.executable, "-c", _HF_CHECK], env=_env(), capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    for line in p.stdout.split("\n"):
        if line.startswith(("gdn", "kda")):
            _, err, mag = line.split()
            assert float(err) <= tp.TOLERANCE * max(float(mag), 1.0), line


def test_cuda_one_rank(tmp_path, reference):
    """One rank on CUDA through NCCL (the launcher's GPU path) against the CPU TP = 1 run.
    Tolerance 1e-3 of the largest output: the CUDA kernels sum in other orders than the CPU
    ones (chunked prefill within 2e-4 of fp64 in test_chunk_prefill)."""
    if not torch.cuda.is_available() or not ds.cuda_available():
        pytest.skip("no CUDA device")
    if shutil.which("nvidia-smi") is None and not torch.cuda.device_count():
        pytest.skip("no CUDA device")
    out = tmp_path / "out.pt"
    log = _torchrun(1, out, "--device", "cuda")
    got = torch.load(out)
    for kind in CONFIGS:
        err, mag = tp.max_error(got[kind], reference[kind])
        assert err <= 1e-3 * max(mag, 1.0), (kind, err, mag)
        assert f"{kind}: tp=1 backend=nccl" in log
