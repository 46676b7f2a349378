"""Ctrl-C (issue 64) at several moments of the commands that run for minutes: exit 130, no
traceback, and what to run next; a sweep's are in `test_sweep` (it stores rows as it goes
and says how to resume)."""

import os
import signal
import subprocess
import sys
import threading
import time

import duckdb
import pytest
import typer

from rematlab.cli.app import handles_errors
from tests import clirun
from tests.test_sweep import TINY


def _interrupted(args: list[str], delay: float, cwd=None) -> tuple[int, str]:
    """Run `rematlab args`, wait for its first stderr line and `delay` seconds, Ctrl-C it."""
    proc = subprocess.Popen([sys.executable, "-m", "rematlab.cli", *args], cwd=cwd,
                            preexec_fn=clirun.foreground,
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    first = proc.stderr.readline()
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, first + err + out


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.5, 2.0])
def test_ctrl_c_in_a_max_batch_search_exits_130_and_says_what_to_run(tmp_path, delay):
    out = tmp_path / "found.json"
    args = ["max-batch", "--model", "tests.userzoo:announced", "--input-shape", "256",
            "--budget", "64MiB", "--batch", "8", "--json"]
    code, said = _interrupted(args, delay)
    assert code == 130, said
    assert "Traceback" not in said
    assert "interrupted: nothing was written" in said
    assert "run it again with: rematlab max-batch --model tests.userzoo:announced" in said
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 1.0])
def test_ctrl_c_in_a_study_exits_130_and_says_how_to_resume(tmp_path, delay):
    grid = tmp_path / "grid.toml"
    grid.write_text(TINY.format(extra=""))
    db, out = tmp_path / "r.duckdb", tmp_path / "out"
    code, said = _interrupted(["study", "--grid", str(grid), "--db", str(db), "--out",
                               str(out)], delay)
    assert code == 130, said
    assert "Traceback" not in said
    assert f"rematlab study --grid {grid} --db {db} --out {out}" in said


def test_a_ctrl_c_that_duckdb_reports_as_its_own_error_is_an_interrupt(capsys):
    """DuckDB turns a Ctrl-C that lands inside a query into `RuntimeError: Query
    interrupted`: a command that reads or writes a database exits 130 all the same. (Python's
    own SIGINT handler for the test, as in a terminal: a background job ignores SIGINT.)"""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _duckdb_interrupted(capsys)
    finally:
        signal.signal(signal.SIGINT, previous)


def _duckdb_interrupted(capsys) -> None:
    @handles_errors
    def long_query() -> None:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        duckdb.connect().execute("SELECT count(*) FROM range(100000000000)").fetchall()

    with pytest.raises(typer.Exit) as stopped:
        long_query()
    assert stopped.value.exit_code == 130
    assert "interrupted" in capsys.readouterr().err

    @handles_errors
    def broken() -> None:
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):  # a bug keeps its traceback
        broken()


def test_a_ctrl_c_that_cpython_marks_unhandled_still_exits_130():
    """A Ctrl-C that lands while C code runs Python is marked unhandled by CPython even
    when the command catches it; `python -m rematlab.cli` then died by SIGINT (-2) instead
    of exiting 130 (one max-batch search in three under load)."""
    proc = subprocess.run([sys.executable, "-m", "rematlab.cli", "measure", "--model",
                           "tests.userzoo:interrupted_inside_c", "--input-shape", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr and "run it again with" in proc.stderr
