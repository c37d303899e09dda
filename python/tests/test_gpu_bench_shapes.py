"""The benchmark shapes on CUDA against the CPU backend (runs on a device machine; skipped without
CUDA): Qwen3-Next, Kimi-Linear and two odd shapes (GVA 3/6 heads with K=96 V=48, K=64 V=128),
fp32 and bf16 states, packed decode over 3 steps and ReplaySSM with L=4 over 9 steps (two
flushes, random forced flushes), a padded row in every batch. `scripts/device.sh check` runs this
file alone as a quick gate before timing; the full GPU suites are tests/gpu and test_gpu.py.

Tolerances: the CPU and CUDA backends run the same math in fp32 and round on store, so outputs
agree to 1e-4 (fp32 state) / 1e-2 relative (bf16 state, one bf16 ulp of the output), states to
1e-5 / 2e-3 absolute; ReplaySSM checkpoints after a flush to 1.5e-3.
"""

import pytest

torch = pytest.importorskip("torch")

import deltastate as ds  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and ds.cuda_available()),
    reason="needs a CUDA device and deltastate built with its CUDA backend")

TOL = {torch.float32: (1e-4, 1e-4, 1e-5), torch.bfloat16: (1e-3, 1e-2, 2e-3)}  # out atol, rtol, state atol


def packed_case(op, H, HV, K, V, B, sdt, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = 2 * B + 3
    act = torch.bfloat16
    pool = (0.05 * torch.randn(S, HV, V, K, generator=g)).to(sdt)
    A_log = torch.empty(HV).uniform_(1, 16, generator=g).log()
    dt = 0.1 * torch.randn(HV * K if op == "kda" else HV, generator=g)
    idx = torch.randperm(S, generator=g)[:B].to(torch.int32)
    idx[B // 2] = -1
    cpu_pool, gpu_pool = pool.clone(), pool.cuda()
    for step in range(steps):
        x = torch.randn(B, 2 * H * K + HV * V, generator=g).to(act)
        a = torch.randn(B, HV * K if op == "kda" else HV, generator=g).to(act)
        b = torch.randn(B, HV, generator=g).to(act)
        outs = []
        for dev, p in (("cpu", cpu_pool), ("cuda", gpu_pool)):
            out = torch.full((B, 1, HV, V), float("nan"), dtype=act, device=dev)
            fn = (ds.fused_recurrent_kda_packed_decode if op == "kda"
                  else ds.fused_recurrent_gated_delta_rule_packed_decode)
            fn(x.to(dev), a.to(dev), b.to(dev), A_log.to(dev), dt.to(dev), K ** -0.5, p, out,
               idx.to(dev))
            outs.append(out.float().cpu())
        torch.cuda.synchronize()
        atol, rtol, satol = TOL[sdt]
        torch.testing.assert_close(outs[1], outs[0], atol=atol, rtol=rtol)
        torch.testing.assert_close(gpu_pool.float().cpu(), cpu_pool.float(), atol=satol, rtol=1e-4)


def replay_case(op, H, HV, K, V, B, sdt, L, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = 2 * B + 3
    act = torch.bfloat16
    pool = (0.05 * torch.randn(S, HV, V, K, generator=g)).to(sdt)
    A_log = torch.empty(HV).uniform_(1, 16, generator=g).log()
    dt = 0.1 * torch.randn(HV, K, generator=g) if op == "kda" else 0.1 * torch.randn(HV, generator=g)
    idx = torch.randperm(S, generator=g)[:B].to(torch.int32)
    idx[B // 2] = -1
    gshape = (S, HV, L, K) if op == "kda" else (S, HV, L)
    bufs = {}
    for dev in ("cpu", "cuda"):
        bufs[dev] = dict(pool=pool.clone().to(dev), d=torch.zeros(S, HV, L, V, dtype=sdt, device=dev),
                         k=torch.zeros(S, H, L, K, dtype=act, device=dev),
                         g=torch.zeros(gshape, dtype=torch.float32, device=dev),
                         wp=(torch.arange(B, dtype=torch.int32) % L).to(dev))
    for step in range(steps):
        x = torch.randn(B, 2 * H * K + HV * V, generator=g).to(act)
        a = torch.randn((B, HV, K) if op == "kda" else (B, HV), generator=g).to(act)
        b = torch.randn(B, HV, generator=g).to(act)
        ff = (torch.rand(B, generator=g) < 0.1).to(torch.int32)
        outs = []
        for dev in ("cpu", "cuda"):
            bf = bufs[dev]
            out = torch.full((B, 1, HV, V), float("nan"), dtype=act, device=dev)
            ds.fused_recurrent_linear_replayssm_decode(
                x.to(dev), a.to(dev), b.to(dev), A_log.to(dev), dt.to(dev), K ** -0.5, bf["pool"],
                bf["d"], bf["k"], bf["g"], out, idx.to(dev), bf["wp"], ff.to(dev),
                is_kda=op == "kda", advance_write_pos=True)
            outs.append(out.float().cpu())
        torch.cuda.synchronize()
        atol, rtol, satol = TOL[sdt]
        torch.testing.assert_close(outs[1], outs[0], atol=atol, rtol=rtol)
        c, d = bufs["cpu"], bufs["cuda"]
        assert torch.equal(c["wp"], d["wp"].cpu()), f"cursors differ at step {step}"
        # Checkpoints after flushes: the ReplaySSM state tolerance (1.5e-3 abs / 1e-3 rel, fp32).
        torch.testing.assert_close(d["pool"].float().cpu(), c["pool"].float(), atol=max(satol, 1.5e-3),
                                   rtol=1e-3 if sdt == torch.float32 else 1e-2)
        torch.testing.assert_close(d["d"].float().cpu(), c["d"].float(), atol=2e-3, rtol=1e-2)
        torch.testing.assert_close(d["g"].cpu(), c["g"], atol=1e-5, rtol=1e-4)


SHAPES = [("gdn", 16, 32, 128, 128), ("kda", 32, 32, 128, 128), ("gdn", 3, 6, 96, 48),
          ("kda", 4, 8, 64, 128)]
SHAPE_IDS = [f"{op}-H{H}-HV{HV}-K{K}-V{V}" for op, H, HV, K, V in SHAPES]


@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("op,H,HV,K,V", SHAPES, ids=SHAPE_IDS)
def test_packed_decode_matches_cpu(op, H, HV, K, V, sdt):
    packed_case(op, H, HV, K, V, 6, sdt)


@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("op,H,HV,K,V", SHAPES, ids=SHAPE_IDS)
def test_replayssm_matches_cpu(op, H, HV, K, V, sdt):
    replay_case(op, H, HV, K, V, 6, sdt, 4, 9)
