"""deltastate.cuda_built() / cuda_available() (issue #19, point 12): the build has the CUDA backend,
versus a device can run it. cuda_available() was True on a CUDA build without a GPU."""

import os
import subprocess
import sys

import deltastate as ds
from helpers import torch


def test_available_implies_built():
    built, available = ds.cuda_built(), ds.cuda_available()
    assert type(built) is bool and type(available) is bool
    assert built or not available
    assert ds.ops.cuda_available is ds.cuda_available


def test_available_matches_the_cuda_runtime():
    """torch built with CUDA counts the devices independently (cudaGetDeviceCount)."""
    if torch is None or torch.version.cuda is None or not ds.cuda_built():
        import pytest

        pytest.skip("needs deltastate built with CUDA and a CUDA build of torch")
    assert ds.cuda_available() == (torch.cuda.device_count() > 0)


def test_no_visible_device_means_not_available():
    """With every device hidden (CUDA_VISIBLE_DEVICES empty), on any machine: no device can run,
    and the build is what it is."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    package = os.path.dirname(os.path.dirname(os.path.abspath(ds.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-c", "import deltastate as ds; "
                        "print(ds.cuda_built(), ds.cuda_available())"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(ds.cuda_built()), "False"]


def test_check_errors_without_a_cuda_op_is_a_no_op():
    """ds.check_errors() before any CUDA op ran (and on a build without CUDA) touches nothing and
    raises nothing (a fresh process: no op has run there); it takes None or a raw stream."""
    env = dict(os.environ)
    package = os.path.dirname(os.path.dirname(os.path.abspath(ds.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package] + [p for p in [env.get("PYTHONPATH")] if p])
    code = ("import deltastate as ds; ds.check_errors(); ds.check_errors(None); ds.check_errors(0); "
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
    assert "check_errors" in ds.__all__
