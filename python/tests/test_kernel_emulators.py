"""The numpy emulations of the tensor-core prefill kernels and of ReplaySSM verify
(tests/gpu/emulate_*.py), run on the CPU so that CI checks what they check without a GPU: every ldmatrix / mma fragment index of the fused
kernel, the split kernels' chunk slots and fragment transcription (GDN and KDA, K = V = 128 and
64) against the fp64 chunk algebra with rounding off, and the split kernels' chunk chain against
the fp64 token recurrence; and the factored ReplaySSM verify kernel's per-row algebra against the
fp64 recurrence (GDN and KDA, every committed-record count, folds, random accept sequences), and
the tensor-core verify kernel's lanes (staged tile, tf32 fragments, quad loop) against it; and
the Hopper kernels' products (GDN, and KDA's sub-chunk factorization) against the chunk algebra,
rounded against the fp64 token recurrence within their GPU tests' bounds; and the quantized decode
kernel's lanes (its mma fragments, stores and division rule) against a plain fp64 step; and
ReplaySSM decode's tensor-core rows (bf16 fragments, the split B operand, the quad's records and
stores) against plain fp64 dots.
Each script asserts those and exits non-zero on a mismatch."""

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("numpy")

GPU_TESTS = pathlib.Path(__file__).resolve().parents[2] / "tests" / "gpu"


@pytest.mark.parametrize(
    "script", ["emulate_tc_kernel.py", "emulate_split_kernels.py", "emulate_replay_verify.py",
               "emulate_hopper_prefill.py", "emulate_hopper_kda.py", "emulate_quant_decode.py",
               "emulate_replay_decode_tc.py"])
def test_emulation_matches_the_algebra(script):
    run = subprocess.run([sys.executable, str(GPU_TESTS / script)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "rounding off" in run.stdout
