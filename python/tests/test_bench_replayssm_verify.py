"""The ReplaySSM verify benchmark's logic on the CPU backend: its cursor-cycle model (which sets
the graph's length and the byte model's average) against the kernels' own cursor updates, via the
script's --dry-run (tiny shapes, no timing)."""

import importlib.util
import pathlib
import sys

import pytest

pytest.importorskip("torch")

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def _load():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_replayssm_verify",
                                                      BENCH / "bench_replayssm_verify.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def test_cursor_cycle_folds_and_repeats():
    mod = _load()
    path, mu, lam = mod.cursor_cycle(8, 4)
    # L = 8, T = 4: every step after the first folds the previous step's accepted records.
    assert (mu, lam) == (1, 4)
    assert [p[:2] for p in path[mu:]] == [(1, True), (2, True), (3, True), (4, True)]
    path, mu, lam = mod.cursor_cycle(16, 4)
    assert lam == 4 and sum(f for _, f, _ in path[mu:]) == 1
    assert all(m + 4 <= 16 for m, _, _ in path)  # every verify's records fit the ring


def test_dry_run_kernels_follow_the_model():
    sys.path.insert(0, str(BENCH))
    try:
        assert _load().dry_run() == 0
    finally:
        sys.path.remove(str(BENCH))
