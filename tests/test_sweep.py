import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import duckdb
import pandas as pd
import pytest

from rematlab.core import hostmem
from rematlab.exceptions import ConfigError, StoreLockedError
from rematlab.measurement.spec import Spec
from rematlab.study.grid import load_grid
from rematlab.study.store import (
    MIGRATIONS,
    SCHEMA_VERSION,
    Store,
    config_id,
    load,
    trusted_only,
)
from rematlab.study.sweep import sweep
from tests import clirun

TINY = """
name = "tiny"
batches = [4, 8]
strategies = ["none", "uniform:2", "sqrt"]
repeats = 2
{extra}
[[models]]
name = "mlp3"
[[models]]
name = "lenet5"
"""


def _grid(tmp_path: Path, extra: str = "", body: str | None = None) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(body if body is not None else TINY.format(extra=extra))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return clirun.run(list(args), timeout=600)


def test_shipped_grids_expand_as_documented():
    assert len(load_grid("quick").expand()) == 120
    demo = load_grid("demo")
    assert len(demo.expand()) == 40 and demo.study.about.startswith("The demo grid")
    assert {s.model for s in demo.expand()} == {"mlp3", "mlp5", "lenet5", "alexnet", "vgg16"}
    seed = load_grid("seed-study").expand()
    assert len(seed) >= 2064
    quick = load_grid("quick").expand()
    assert {s.model for s in quick} == {"mlp3", "mlp5", "mlp7", "lenet5", "alexnet", "vgg16"}
    assert {s.strategy.split(":")[0] for s in quick} == {"none", "uniform", "every", "sqrt",
                                                        "selective"}


def test_dry_run_prints_count_and_estimate_and_writes_nothing(tmp_path):
    db = tmp_path / "r.duckdb"
    proc = _cli("sweep", str(_grid(tmp_path)), "--db", str(db), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "12 configurations" in proc.stdout and "estimated duration" in proc.stdout
    assert not db.exists()


def test_the_estimate_on_a_cpu_runs_at_the_rate_this_machine_measures(tmp_path, monkeypatch):
    from rematlab.measurement import hardware

    assert hardware.cpu_flops(1) > 1e8  # a real kernel, timed: no machine is slower
    specs = load_grid(_grid(tmp_path)).expand()
    estimates = {}
    for rate in (1e9, 1e12):
        calls: list[int] = []
        monkeypatch.setattr(hardware, "cpu_flops",
                            lambda threads, r=rate, c=calls: c.append(threads) or r)
        estimates[rate] = hardware.estimate_seconds(specs)
        assert len(calls) == 1  # measured once per device and thread count
    assert estimates[1e9] > estimates[1e12] > 0


@pytest.mark.parametrize(
    ("body", "needle"),
    [("models = [", "malformed TOML"),
     (TINY.replace('name = "lenet5"', 'name = "resnet9"'), "models.1.name"),
     (TINY.replace("batches = [4, 8]", "batches = [-4]"), "batches.0"),
     (TINY.replace('"sqrt"', '"zigzag"'), "strategies"),
     (TINY.replace("repeats = 2", "repeats = 0"), "repeats"),
     (TINY.replace("repeats = 2", "colour = 2"), "colour")],
)
def test_bad_grid_files_are_one_line_errors_naming_the_field(tmp_path, body, needle):
    grid = _grid(tmp_path, body=body.format(extra="") if "{extra}" in body else body)
    db = tmp_path / "r.duckdb"
    proc = _cli("sweep", str(grid), "--db", str(db))
    assert proc.returncode == 2
    assert len(clirun.said(proc.stderr)) == 1 and needle in proc.stderr, proc.stderr
    assert not db.exists()


def test_unwritable_database_path_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = _cli("sweep", str(_grid(tmp_path)), "--db", str(blocker / "sub" / "r.duckdb"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: ")


def test_sweep_stores_rows_and_resumes_without_duplicates(small_db):
    grid_path, db, first = small_db
    grid = load_grid(grid_path)
    assert first.outcomes["ok"] == 6 and first.skipped == 0
    assert first.errors.empty and len(first.frame()) == 6
    fastest = first.best("step_s_median")
    assert fastest["step_s_median"] == first.frame()["step_s_median"].min()
    # the guard's verdict per configuration, as the first sweep left it (the next sweep
    # gives an untrusted configuration another try, which may change it)
    assert load(db, "config_summary")["trusted"].sum() == 6 - first.untrusted
    again = sweep(grid, db)
    assert again.skipped == 6 and len(again) == 0
    runs = load(db)
    assert len(runs) == 12 and not runs.duplicated(["config_id", "repeat"]).any()
    summary = load(db, "config_summary")
    assert len(summary) == 6 and (summary["n"] == 2).all()
    assert (summary["peak_bytes_median"] > 0).all()
    assert set(runs["vendor"]) == {"CPU"} and runs["method_peak"].notna().all()
    # the workers are rematlab's own processes: freed host memory retained, and recorded
    assert set(runs["host_allocator"]) == {hostmem.RETAINED}
    # the guard's evidence on every row, a verdict per configuration
    assert runs["trusted"].notna().all() and (runs["attempts"] >= 2).all()
    assert runs["calibration_s"].notna().all() and runs["method_guard"].notna().all()
    sweeps = load(db, "sweeps")
    assert (sweeps["harness_overhead"] == 1 - sweeps["measured_s"] / sweeps["wall_s"]).all()


def test_memory_cap_gives_oom_rows_and_the_sweep_goes_on(tmp_path):
    grid = load_grid(_grid(tmp_path, extra='max_memory = "4MiB"'))
    db = tmp_path / "r.duckdb"
    result = sweep(grid, db)
    assert result.outcomes["oom"] == 6 and result.outcomes["ok"] == 6  # mlp3 > 4 MiB
    runs = load(db)
    assert set(runs[runs["cfg_model"] == "mlp3"]["outcome"]) == {"oom"}
    assert runs[runs["outcome"] == "oom"]["error"].str.contains("cap").all()


def _sweep_until(tmp_path: Path, progress: str):
    """A 12-configuration sweep in a subprocess, returned once it logged `progress`."""
    grid_path = _grid(tmp_path, body=TINY.format(extra=""))
    db = tmp_path / "r.duckdb"
    proc = subprocess.Popen([sys.executable, "-m", "rematlab.cli", "sweep", str(grid_path),
                             "--db", str(db)], stderr=subprocess.PIPE, text=True,
                            preexec_fn=clirun.foreground)
    for line in proc.stderr:
        if line.startswith(progress):
            break
    return proc, grid_path, db


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc's parent links."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_sigkill_mid_sweep_loses_at_most_the_configuration_in_flight(tmp_path):
    proc, grid_path, db = _sweep_until(tmp_path, "[3/12]")
    workers = _descendants(proc.pid)
    assert workers  # the forkserver and the warm worker
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if _alive(p)], "workers outlived the killed sweep"
    with Store(db) as store:
        done = len(store.done())
        counts = store.con.execute("SELECT config_id, count(*) FROM runs GROUP BY 1").fetchall()
    assert 3 <= done < 12
    assert len(counts) == done and all(n == 2 for _, n in counts)
    result = sweep(load_grid(grid_path), db)
    assert result.skipped == done and result.skipped + len(result) == 12
    runs = load(db)
    assert len(runs) == 24 and not runs.duplicated(["config_id", "repeat"]).any()


@pytest.mark.slow
def test_sigint_keeps_results_and_says_how_to_resume(tmp_path):
    proc, grid_path, db = _sweep_until(tmp_path, "[2/12]")
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 130
    assert f"resume with: rematlab sweep {grid_path} --db {db}" in rest
    with Store(db) as store:
        assert len(store.done()) >= 2
        status = store.con.execute("SELECT status FROM sweeps").fetchall()
    assert status == [("interrupted",)]


@pytest.mark.parametrize("during, kept", [("mark_stale_sweeps", 0), ("write_config", 1)])
def test_ctrl_c_during_a_database_write_is_held_until_it_ends(tmp_path, monkeypatch, during,
                                                               kept):
    """A Ctrl-C that lands while the store is opened or a finished configuration's rows are
    written (DuckDB would turn it into `Query interrupted`, drop the rows and end with a
    traceback; CI hit it a second into a sweep) waits for the write: what was written is
    kept, then the sweep stops as interrupted, its record closed."""
    grid = load_grid(_grid(tmp_path, body='name = "one"\nbatches = [4]\nrepeats = 2\n'
                           'strategies = ["none", "uniform:2"]\n[[models]]\nname = "mlp3"\n'))
    db = tmp_path / "r.duckdb"
    write = getattr(Store, during)

    def ctrl_c_then_write(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(Store, during, ctrl_c_then_write)
    before = signal.getsignal(signal.SIGINT)
    result = sweep(grid, db, remeasure=False)
    assert result.interrupted and len(result) == kept
    with Store(db) as store:
        assert len(store.done()) == kept
        status = store.con.execute("SELECT status FROM sweeps").fetchall()
    assert status == [("interrupted",)] and len(load(db)) == 2 * kept
    assert signal.getsignal(signal.SIGINT) is before  # the runner's own handler again


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.3, 1.0])
def test_sigint_in_the_first_seconds_exits_130_with_the_resume_command(tmp_path, delay):
    """Ctrl-C as the sweep starts its first configuration (before or while its first worker
    starts, issue 64): exit 130, no traceback, the command that resumes; the resumed sweep
    has every row once."""
    grid_path = _grid(tmp_path, body=TINY.format(extra=""))
    db = tmp_path / "r.duckdb"
    proc = subprocess.Popen([sys.executable, "-m", "rematlab.cli", "sweep", str(grid_path),
                             "--db", str(db)], stderr=subprocess.PIPE, text=True,
                            preexec_fn=clirun.foreground)
    first = proc.stderr.readline()  # the sweep has opened its store and begun
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    rest = first + proc.stderr.read()
    assert proc.wait(timeout=120) == 130, rest
    assert "Traceback" not in rest and f"resume with: rematlab sweep {grid_path}" in rest
    result = sweep(load_grid(grid_path), db)
    assert result.skipped + len(result) == 12
    runs = load(db)
    assert len(runs) == 24 and not runs.duplicated(["config_id", "repeat"]).any()


def test_a_second_writer_gets_a_clear_error(tmp_path):
    db = tmp_path / "r.duckdb"
    with Store(db):
        proc = _cli("sweep", str(_grid(tmp_path)), "--db", str(db))
    assert proc.returncode == 2 and "in use by another process" in proc.stderr
    assert len(clirun.said(proc.stderr)) == 1


def _open_store(path: str) -> None:
    """In another process: open the store, exit 7 on the typed lock error."""
    try:
        Store(path)
    except StoreLockedError:
        sys.exit(7)


def test_store_lock_error_is_a_typed_exception(tmp_path):
    db = tmp_path / "r.duckdb"
    with Store(db):
        proc = clirun.process(_open_store, str(db))
    assert proc.exitcode == 7


def test_export_and_load_round_trip(small_db, tmp_path):
    _, db, _ = small_db
    for fmt in ("parquet", "csv"):
        out = tmp_path / f"runs.{fmt}"
        proc = _cli("export", "--db", str(db), "--out", str(out), "--format", fmt)
        assert proc.returncode == 0, proc.stderr
        frame = pd.read_parquet(out) if fmt == "parquet" else pd.read_csv(out)
        assert len(frame) == len(load(db)) == 12
    proc = _cli("export", "--db", str(db), "--out", str(tmp_path / "x"), "--format", "xlsx")
    assert proc.returncode == 2


def test_old_schema_is_migrated_forward_without_losing_rows(tmp_path):
    db = tmp_path / "old.duckdb"
    con = duckdb.connect(str(db))
    for statement in MIGRATIONS[0]:
        con.execute(statement)
    con.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    con.execute("INSERT INTO runs (config_id, repeat, outcome) VALUES ('abc', 0, 'ok')")
    con.execute("INSERT INTO sweeps (sweep_id, wall_s, measured_s, status) VALUES "
                "('s1', 10.0, 8.0, 'complete')")
    con.close()
    with Store(db) as store:
        assert store.schema_version() == SCHEMA_VERSION
        rows = store.con.execute("SELECT config_id, reserved_bytes, trusted, host_allocator "
                                 "FROM runs").fetchall()
        overhead = store.con.execute("SELECT harness_overhead FROM sweeps").fetchone()[0]
    assert rows == [("abc", None, None, None)]
    assert overhead == pytest.approx(0.2)  # filled in for sweeps from before the column
    summary = load(db, "config_summary")
    kept, dropped = trusted_only(summary)  # rows from before the guard carry no evidence
    assert len(kept) == 1 and dropped == 0


def test_load_of_a_missing_database_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError):
        load(tmp_path / "nope.duckdb")


@pytest.mark.slow
@pytest.mark.ray
def test_ray_backend_on_a_local_instance(tmp_path):
    """One real local Ray instance: a configuration measured in a task (its own worker
    process), stored by the driver, and skipped when the sweep runs again."""
    pytest.importorskip("ray")
    grid = load_grid(_grid(tmp_path, body='name = "ray"\nbatches = [4]\nrepeats = 2\n'
                                            'strategies = ["sqrt"]\n'
                                            '[[models]]\nname = "mlp3"\n'))
    db = tmp_path / "r.duckdb"
    result = sweep(grid, db, backend="ray")
    assert result.outcomes["ok"] == 1, result.outcomes
    assert len(load(db)) == 2
    assert sweep(grid, db, backend="ray").skipped == 1


def test_resume_retries_error_configurations_not_oom_ones_and_marks_stale_sweeps(tmp_path):
    from rematlab.measurement.measure import failed_row
    from rematlab.study.store import config_id

    grid = load_grid(_grid(tmp_path, body='name = "one"\nbatches = [4]\nrepeats = 1\n'
                                            '[[models]]\nname = "mlp3"\n'))
    (spec,) = grid.expand()
    db = tmp_path / "r.duckdb"
    with Store(db) as store:  # a killed earlier sweep that stored an error for the config
        store.start_sweep("killed", "one", "local", 1)
        store.write_config(config_id(spec.to_dict()), "killed", spec.to_dict(),
                           [failed_row(spec, "error", "worker crashed")], 0.0)
    result = sweep(grid, db)
    assert (result.retried, result.stale, result.skipped) == (1, 1, 0)
    assert result.outcomes["ok"] == 1
    runs = load(db, "runs")
    assert list(runs["outcome"]) == ["ok"]  # the error row is replaced, not kept beside it
    with Store(db) as store:
        statuses = dict(store.con.execute("SELECT sweep_id, status FROM sweeps").fetchall())
        assert statuses["killed"] == "interrupted"
        # an oom is a result: a resumed sweep does not run it again
        store.write_config(config_id(spec.to_dict()), "killed", spec.to_dict(),
                           [failed_row(spec, "oom", "cap")], 0.0)
    again = sweep(grid, db)
    assert (again.skipped, again.retried, len(again)) == (1, 0, 0)


@pytest.mark.parametrize(("model", "outcome", "needle"), [
    ("tests.userzoo:killed_by_the_kernel", "oom", "worker died"),
    ("tests.userzoo:slow", "error", "timeout after 3 s"),
    ("tests.userzoo:exits", "error", "SystemExit"),
    ("tests.userzoo:tiny", "ok", None),
])
def test_isolated_runs_classify_a_sigkill_as_oom_and_a_hang_as_a_timeout(model, outcome, needle):
    from rematlab.measurement.spec import Spec
    from rematlab.study.sweep import Worker

    spec = Spec(model=model, batch=4, input_shape=(4,), repeats=1)
    worker = Worker()  # a worker of its own, stopped afterwards
    try:
        out = worker.run(spec, timeout=3 if "slow" in model else 120)
    finally:
        worker.close()
    (row, *_) = out["rows"]
    assert row["outcome"] == outcome, row["error"]
    if needle:
        assert needle in row["error"] and out["measured_s"] == 0.0


def test_a_warm_worker_measures_configurations_in_turn_and_is_replaced_after_a_death():
    from rematlab.measurement.spec import Spec
    from rematlab.study.sweep import Worker

    tiny = Spec(model="tests.userzoo:tiny", batch=4, input_shape=(4,), repeats=1)
    killed = Spec(model="tests.userzoo:killed_by_the_kernel", batch=4, input_shape=(4,),
                  repeats=1)
    worker = Worker()
    try:
        assert worker.run(tiny, 120)["rows"][0]["outcome"] == "ok"
        pid = worker.proc.pid
        assert worker.run(tiny, 120)["rows"][0]["outcome"] == "ok"
        assert worker.proc.pid == pid  # the same warm process
        assert worker.run(killed, 120)["rows"][0]["outcome"] == "oom"
        assert worker.proc is None  # gone with the configuration that killed it
        assert worker.run(tiny, 120)["rows"][0]["outcome"] == "ok"
        assert worker.proc.pid != pid
    finally:
        worker.close()


TWO = """
name = "two"
batches = [4]
strategies = ["none", "sqrt"]
repeats = 2
[[models]]
name = "mlp3"
"""


def _attempts(monkeypatch, trusted: dict[tuple[str, bool], bool], waits: list | None = None,
              waited: float = 0.0) -> list:
    """Make the warm worker's results come out trusted or not, by strategy and by whether
    the attempt is a second one (settle_s > 0), each having waited `waited` seconds for
    quiet; returns the log of (strategy, settle_s), and logs each run's wait bound in
    `waits`."""
    from rematlab.measurement.measure import run_config
    from rematlab.study.sweep import Worker

    calls = []
    waits = [] if waits is None else waits

    def run(self, spec, timeout, reference=None, settle_s=0.0, max_wait_s=30.0):
        calls.append((spec.strategy, settle_s))
        waits.append(max_wait_s)
        out = run_config(spec.to_dict())
        verdict = trusted[(spec.strategy, settle_s > 0)]
        for row in out["rows"]:
            row["trusted"], row["attempts"] = verdict, len(calls)
            row["waited_s"] = waited
        return out

    monkeypatch.setattr(Worker, "run", run)
    return calls


def test_untrusted_configurations_are_measured_again_at_the_end_and_replaced_if_trusted(
        tmp_path, monkeypatch):
    from rematlab.study.sweep import SETTLE_S

    grid = load_grid(_grid(tmp_path, body=TWO))
    db = tmp_path / "r.duckdb"
    calls = _attempts(monkeypatch, {("none", False): True, ("sqrt", False): False,
                                    ("sqrt", True): True})
    result = sweep(grid, db)
    # the busy configuration once more, last, after waiting for a quiet host
    assert calls == [("none", 0.0), ("sqrt", 0.0), ("sqrt", SETTLE_S)]
    assert result.remeasured == 1 and result.settled == 1 and result.untrusted == 0
    runs = load(db)
    assert len(runs) == 4 and runs["trusted"].all()  # the first attempt's rows are replaced
    assert set(runs.loc[runs["cfg_strategy"] == "sqrt", "attempts"]) == {3}
    assert result.outcomes["ok"] == 2


@pytest.mark.slow
def test_a_second_attempt_still_untrusted_keeps_the_first_and_a_rerun_tries_again(
        tmp_path, monkeypatch):
    grid = load_grid(_grid(tmp_path, body=TWO))
    db = tmp_path / "r.duckdb"
    calls = _attempts(monkeypatch, {("none", False): True, ("sqrt", False): False,
                                    ("sqrt", True): False})
    result = sweep(grid, db)
    assert result.remeasured == 1 and result.settled == 0 and result.untrusted == 1
    runs = load(db)
    sqrt = runs[runs["cfg_strategy"] == "sqrt"]
    assert len(sqrt) == 2 and set(sqrt["attempts"]) == {2} and not sqrt["trusted"].any()
    again = sweep(grid, db)  # nothing left to run, but the untrusted one gets another try
    assert again.skipped == 2 and len(again) == 0
    assert again.remeasured == 1 and calls[-1][0] == "sqrt" and len(calls) == 4
    off = sweep(grid, db, remeasure=False)
    assert off.remeasured == 0 and len(calls) == 4 and off.untrusted == 1


def test_waiting_for_quiet_is_bounded_per_configuration_and_per_sweep(tmp_path, monkeypatch):
    body = TWO.replace('strategies = ["none", "sqrt"]',
                       'strategies = ["none", "uniform:2", "sqrt"]\nmax_wait_s = 8\n'
                       "max_wait_total_s = 12")
    grid = load_grid(_grid(tmp_path, body=body))
    db = tmp_path / "r.duckdb"
    waits: list[float] = []
    calls = _attempts(monkeypatch, {(s, again): False for s in ("none", "uniform:2", "sqrt")
                                    for again in (False, True)}, waits, waited=8.0)
    result = sweep(grid, db)
    # each may wait its own 8 s, within what is left of the sweep's 12 s; then none at all,
    # and no second attempts: every configuration is stored, untrusted, with its evidence
    assert waits == [8.0, 4.0, 0.0] and len(calls) == 3
    assert result.wait_spent and result.waited_s == pytest.approx(24.0)
    assert result.untrusted == 3 and result.remeasured == 0 and result.outcomes["ok"] == 3
    assert load(db, "sweeps")["waited_s"].iloc[-1] == pytest.approx(24.0)
    assert set(load(db)["waited_s"]) == {8.0}


@pytest.mark.slow
def test_a_precision_axis_measures_the_autocast_step_and_keeps_old_identities(tmp_path):
    """`precisions` in a grid: each configuration's step runs under its autocast (`Spec.
    precision`); a fp32 configuration keeps the identity it had before the field existed;
    rows from before it read as fp32."""
    from rematlab.measurement.spec import Spec
    from rematlab.study.store import config_id

    grid = load_grid(_grid(tmp_path, body='name = "p"\nbatches = [16]\nrepeats = 2\n'
                                            'precisions = ["fp32", "bf16"]\n'
                                            '[[models]]\nname = "mlp3"\n'))
    fp32, bf16 = grid.expand()
    assert (fp32.precision, bf16.precision) == (None, "bf16")
    assert "precision" not in fp32.to_dict()
    assert config_id(fp32.to_dict()) == config_id(Spec(model="mlp3", batch=16, repeats=2,
                                                       input="mnist").to_dict())
    db = tmp_path / "p.duckdb"
    result = sweep(grid, db)
    assert result.outcomes["ok"] == 2
    summary = load(db, "config_summary").set_index("cfg_precision")
    assert sorted(summary.index) == ["bf16", "fp32"]
    # mlp3's weights dominate: under autocast their bf16 copies add to the step's peak
    assert summary.loc["bf16", "peak_bytes_median"] != summary.loc["fp32", "peak_bytes_median"]
    assert load(db)["cfg_precision"].isna().sum() == 2  # fp32 rows store no precision


def test_a_bad_precision_in_a_grid_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="precision"):
        load_grid(_grid(tmp_path, body='batches = [4]\nprecisions = ["int8"]\n'
                                        '[[models]]\nname = "mlp3"\n'))


def test_a_grid_sets_how_long_a_repeat_averages_without_changing_old_identities(tmp_path):
    """`min_repeat_s` (issue 51): a GPU grid's millisecond steps average over a few
    milliseconds, not 0.2 s; a configuration without it keeps its identity."""
    from rematlab.measurement.measure import measure

    plain = Spec(model="mlp3", batch=8)
    assert "min_repeat_s" not in plain.to_dict()
    grid = tmp_path / "g.toml"
    grid.write_text('batches = [8]\nmin_repeat_s = 0\n[[models]]\nname = "mlp3"\n')
    (spec,) = load_grid(grid).expand()
    assert spec.min_repeat_s == 0 and config_id(spec.to_dict()) != config_id(plain.to_dict())
    obs = measure(replace(spec, repeats=2))
    assert obs.steps == [1, 1]  # one step per repeat: no minimum to fill
    with pytest.raises(ConfigError, match="min_repeat_s"):
        replace(plain, min_repeat_s=-1.0).validate()
    assert load_grid("seed-study-gpu").size() >= 2064
