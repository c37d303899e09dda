"""The `deltastate` CLI that `pip install .` installs into the environment's bin/ (on PATH where
the environment is active), beside the interpreter."""
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

import deltastate as ds


def test_pip_install_puts_the_cli_beside_python():
    try:
        version = importlib.metadata.version("deltastate")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("deltastate is imported from the source tree here, not pip-installed")
    cli = Path(sys.executable).parent / "deltastate"
    assert cli.is_file(), f"`pip install .` installed no `deltastate` at {cli}"
    r = subprocess.run([str(cli), "--version"], capture_output=True, text=True, check=True)
    backend = "built" if ds.cuda_built() else "not built"
    assert r.stdout == f"deltastate {version} (CUDA backend: {backend})\n"
    assert version == ds.__version__
