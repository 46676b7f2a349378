"""Shared fixtures: small, deterministic, CPU-only."""

import shutil

import pytest
import skops.io  # noqa: F401 - first, see below
import torch

# skops builds its trusted-type table on import by searching every loaded module for each
# numpy ufunc; once transformers' lazy modules are loaded (as they are after the first model
# test) that search takes 10 s in this process, before them under a second

# MLP-3 and LeNet-5, batches 4 and 8, three strategies, two repeats: 12 configurations, the
# smallest grid the predictors (10 configurations) and the statistics can run on
TINY_GRID = """
name = "tiny"
batches = [4, 8]
strategies = ["none", "uniform:2", "sqrt"]
repeats = 2
[[models]]
name = "mlp3"
[[models]]
name = "lenet5"
"""
# one batch of the same: 6 configurations, what the sweep's own tests need (make test)
SMALL_GRID = TINY_GRID.replace('name = "tiny"', 'name = "small"').replace("[4, 8]", "[4]")


@pytest.fixture(scope="session", autouse=True)
def _own_cache(tmp_path_factory):
    """rematlab's cache (calibrations, trained backbones) in the session's temporary folder,
    never the user's ~/.cache; commands the tests start inherit it."""
    patch = pytest.MonkeyPatch()
    patch.setenv("REMATLAB_CACHE", str(tmp_path_factory.mktemp("rematlab-cache")))
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch):
    """Seeded, two threads, and the guard's process-wide fastest calibration forgotten: a
    real calibration timed by an earlier test would otherwise be the reference a later
    test's fake clock is judged by (its outcome then hangs on this machine's speed)."""
    from rematlab.core import guard

    torch.manual_seed(0)
    torch.set_num_threads(2)
    monkeypatch.setattr(guard, "_FASTEST", {})
    yield


def _swept(where, text: str):
    """`text`'s grid swept into a database in `where`: the grid's path, the database, the
    sweep's result."""
    from rematlab.study.grid import load_grid
    from rematlab.study.sweep import sweep

    grid = where / "grid.toml"
    grid.write_text(text)
    return grid, where / "r.duckdb", sweep(load_grid(grid), where / "r.duckdb")


def _copied(swept, tmp_path):
    grid, db, result = swept
    shutil.copy(db, tmp_path / "r.duckdb")
    return grid, tmp_path / "r.duckdb", result


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory):
    """The tiny grid swept once per session: tests that fit predictors and run the study on
    a measured dataset share it through `tiny_db`."""
    return _swept(tmp_path_factory.mktemp("tiny"), TINY_GRID)


@pytest.fixture
def tiny_db(tiny_sweep, tmp_path):
    """A copy of the session's tiny sweep for one test to read or extend."""
    return _copied(tiny_sweep, tmp_path)


@pytest.fixture(scope="session")
def small_sweep(tmp_path_factory):
    """The small grid swept once per session, for the sweep's own tests (`small_db`)."""
    return _swept(tmp_path_factory.mktemp("small"), SMALL_GRID)


@pytest.fixture
def small_db(small_sweep, tmp_path):
    """A copy of the session's small sweep for one test to read or extend."""
    return _copied(small_sweep, tmp_path)
