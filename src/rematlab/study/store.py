"""The only module that talks to DuckDB: the results dataset.

Tables: `runs` (one row per repeat, or one row for an `oom`/`error` configuration),
`configs` (one row per finished configuration: what makes a sweep resumable), `sweeps`
(one row per sweep invocation: wall time, measured time, status), `meta` (schema version).
View `config_summary`: one row per configuration with median, IQR and n of each figure.

A configuration's rows and its `configs` row are written in one transaction, so a sweep
killed at any moment (even SIGKILL) leaves either all of a configuration or none of it.
DuckDB holds an exclusive file lock for a writer: a second writer gets `StoreLockedError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd

from rematlab.core.files import atomic_path, refuse_overwriting_inputs
from rematlab.exceptions import ConfigError, StoreLockedError

SCHEMA_VERSION = 7

# Column name -> DuckDB type. Order is the table's column order.
RUN_COLUMNS: dict[str, str] = {
    "config_id": "VARCHAR", "sweep_id": "VARCHAR", "repeat": "INTEGER",
    "cfg_model": "VARCHAR", "cfg_input": "VARCHAR", "cfg_input_shape": "VARCHAR",
    "cfg_batch": "INTEGER", "cfg_strategy": "VARCHAR", "cfg_device": "VARCHAR",
    "cfg_dtype": "VARCHAR", "cfg_optimizer": "VARCHAR", "cfg_warmup": "INTEGER",
    "cfg_repeats": "INTEGER", "cfg_max_memory": "BIGINT", "cfg_threads": "INTEGER",
    "cfg_seed": "INTEGER",
    "outcome": "VARCHAR", "error": "VARCHAR",
    "step_s": "DOUBLE", "forward_s": "DOUBLE", "backward_s": "DOUBLE", "recompute_s": "DOUBLE",
    "optimizer_s": "DOUBLE", "peak_bytes": "BIGINT", "reserved_bytes": "BIGINT",
    "params": "BIGINT", "param_bytes": "BIGINT", "grad_bytes": "BIGINT",
    "optimizer_state_bytes": "BIGINT", "saved_activation_bytes": "BIGINT",
    "forward_flops": "DOUBLE", "backward_flops": "DOUBLE", "recompute_flops": "DOUBLE",
    "optimizer_flops": "DOUBLE", "n_blocks": "INTEGER", "n_segments": "INTEGER",
    "steps_per_repeat": "INTEGER",
    "plan": "VARCHAR",
    "method_time": "VARCHAR", "method_peak": "VARCHAR", "method_flops": "VARCHAR",
    "method_saved": "VARCHAR", "method_guard": "VARCHAR",
    "calibration_s": "DOUBLE", "attempts": "INTEGER", "calibration_drift": "DOUBLE",
    "step_spread": "DOUBLE", "foreign_load": "DOUBLE", "trusted": "BOOLEAN",
    "calibration_reference_s": "DOUBLE", "waited_s": "DOUBLE",
    "device_name": "VARCHAR", "vendor": "VARCHAR", "cuda_version": "VARCHAR",
    "rocm_version": "VARCHAR", "torch_version": "VARCHAR", "cpu_model": "VARCHAR",
    "threads": "INTEGER", "host": "VARCHAR", "timestamp": "VARCHAR",
    "rematlab_version": "VARCHAR",
    "cfg_precision": "VARCHAR",
    "host_allocator": "VARCHAR",
    "guard_reason": "VARCHAR",
}

# the guard's evidence (schema v3): one value per configuration, on each of its rows
GUARD_COLUMNS = ("method_guard", "calibration_s", "attempts", "calibration_drift",
                 "step_spread", "foreign_load", "trusted", "calibration_reference_s")
_V1_COLUMNS = [k for k in RUN_COLUMNS
               if k not in ("reserved_bytes", "steps_per_repeat", "waited_s", "cfg_precision",
                            "host_allocator", "guard_reason", *GUARD_COLUMNS)]

_SUMMARY_FIGURES = ("step_s", "forward_s", "backward_s", "recompute_s", "optimizer_s",
                    "peak_bytes")

# MIGRATIONS[v] takes a database from schema version v to v + 1.
MIGRATIONS: dict[int, list[str]] = {
    0: [
        "CREATE TABLE meta (key VARCHAR PRIMARY KEY, value VARCHAR)",
        "CREATE TABLE runs ({})".format(", ".join(f"{k} {t}" for k, t in
                                                   RUN_COLUMNS.items()
                                                   if k in _V1_COLUMNS)),
        "CREATE TABLE configs (config_id VARCHAR PRIMARY KEY, sweep_id VARCHAR, "
        "spec VARCHAR, outcome VARCHAR, measured_s DOUBLE, finished_at TIMESTAMP)",
        "CREATE TABLE sweeps (sweep_id VARCHAR PRIMARY KEY, grid VARCHAR, backend VARCHAR, "
        "started_at TIMESTAMP, finished_at TIMESTAMP, wall_s DOUBLE, measured_s DOUBLE, "
        "configs INTEGER, status VARCHAR)",
    ],
    # v2: allocator-reserved bytes (CUDA) next to allocated peak bytes; steps averaged per
    # timed repeat
    1: ["ALTER TABLE runs ADD COLUMN reserved_bytes BIGINT",
        "ALTER TABLE runs ADD COLUMN steps_per_repeat INTEGER"],
    # v3: the interference guard's evidence per row; the harness overhead of each sweep.
    # Rows from before it keep NULL evidence: analyses keep them (`trusted_only`, below).
    2: [*(f"ALTER TABLE runs ADD COLUMN {k} {RUN_COLUMNS[k]}" for k in GUARD_COLUMNS),
        "ALTER TABLE sweeps ADD COLUMN harness_overhead DOUBLE",
        "UPDATE sweeps SET harness_overhead = 1 - measured_s / wall_s WHERE wall_s > 0"],
    # v4: seconds the guard waited for a quiet host, per configuration and per sweep (the
    # cost of a busy machine, bounded by the grid's max_wait_s and max_wait_total_s)
    3: ["ALTER TABLE runs ADD COLUMN waited_s DOUBLE",
        "ALTER TABLE sweeps ADD COLUMN waited_s DOUBLE"],
    # v5: the step's autocast (`Spec.precision`); rows from before it are fp32 (NULL)
    4: ["ALTER TABLE runs ADD COLUMN cfg_precision VARCHAR"],
    # v6: the host allocator a row was measured under (`rematlab.core.hostmem`); rows from
    # before it ran under the C library's defaults, unless a benchmark changed them (NULL)
    5: ["ALTER TABLE runs ADD COLUMN host_allocator VARCHAR"],
    # v7: why the guard did not trust a configuration, under which rule (`method_guard`,
    # filled from now on: the CPU's or the GPU's); rows from before it say nothing (NULL)
    6: ["ALTER TABLE runs ADD COLUMN guard_reason VARCHAR"],
}


def harness_overhead(measured_s: float, wall_s: float) -> float | None:
    """The share of a sweep's wall time spent outside measured steps (`None` before any
    wall time has passed)."""
    return 1.0 - measured_s / wall_s if wall_s > 0 else None


def config_id(spec_dict: dict[str, Any]) -> str:
    """Stable identity of a configuration: a hash of its spec (not of its repeats)."""
    text = json.dumps(spec_dict, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Store:
    """A results database opened for writing (exclusive) or reading."""

    def __init__(self, path: str | Path, read_only: bool = False) -> None:
        self.path = Path(path)
        if read_only and not self.path.exists():
            raise ConfigError(f"database {self.path} does not exist")
        if not read_only:
            parent = self.path.parent
            if not parent.exists():
                try:
                    parent.mkdir(parents=True)
                except OSError as exc:
                    raise ConfigError(f"cannot create {parent}: {exc.strerror}") from None
        try:
            self.con = duckdb.connect(str(self.path), read_only=read_only)
        except duckdb.IOException as exc:
            if "lock" in str(exc).lower():
                raise StoreLockedError(f"database {self.path} is in use by another process "
                                       "(one sweep per database at a time)") from None
            raise ConfigError(f"cannot open database {self.path}: {exc}") from None
        except duckdb.Error as exc:
            raise ConfigError(f"cannot open database {self.path}: "
                              f"{str(exc).splitlines()[0]}") from None
        try:
            self._check_ours(read_only)
            if not read_only:
                self._migrate()
        except duckdb.Error as exc:  # a damaged file that still opened
            self.con.close()
            raise ConfigError(f"database {self.path} is damaged: "
                              f"{str(exc).splitlines()[0]}") from None
        except ConfigError:
            self.con.close()
            raise

    def _check_ours(self, read_only: bool) -> None:
        """Refuse another application's database (never write our tables into it), one
        written by a newer rematlab, and, for reading, an empty one."""
        tables = self._tables()
        version = self.schema_version()
        if tables and "meta" not in tables:
            raise ConfigError(f"{self.path} is not a rematlab database (it holds other "
                              f"tables: {', '.join(sorted(tables)[:5])})")
        if version > SCHEMA_VERSION:
            raise ConfigError(f"database {self.path} has schema version {version}, newer than "
                              f"this rematlab's {SCHEMA_VERSION}: upgrade rematlab to read it")
        if read_only and "runs" not in tables:
            raise ConfigError(f"database {self.path} holds no results yet")

    def _tables(self) -> set[str]:
        return {r[0] for r in self.con.execute("SELECT table_name FROM information_schema"
                                               ".tables").fetchall()}

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def schema_version(self) -> int:
        if "meta" not in self._tables():
            return 0
        row = self.con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        try:
            return int(row[0]) if row else 0
        except ValueError:
            raise ConfigError(f"database {self.path} has a damaged schema version") from None

    def _migrate(self) -> None:
        version = self.schema_version()
        while version < SCHEMA_VERSION:
            self.con.execute("BEGIN TRANSACTION")
            for statement in MIGRATIONS[version]:
                self.con.execute(statement)
            version += 1
            self.con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)",
                             [str(version)])
            self.con.execute("COMMIT")
        self._views()

    def _views(self) -> None:
        figures = ", ".join(
            f"median({f}) AS {f}_median, quantile_cont({f}, 0.75) - quantile_cont({f}, 0.25) "
            f"AS {f}_iqr" for f in _SUMMARY_FIGURES)
        keys = ", ".join(k for k in RUN_COLUMNS if k.startswith("cfg_"))
        # a configuration without a precision (every row before schema v5) is fp32
        shown = keys.replace("cfg_precision", "coalesce(cfg_precision, 'fp32') AS cfg_precision")
        self.con.execute(
            f"CREATE OR REPLACE VIEW config_summary AS SELECT config_id, {shown}, "
            f"any_value(outcome) AS outcome, any_value(error) AS error, "
            f"any_value(vendor) AS vendor, any_value(device_name) AS device_name, "
            f"any_value(saved_activation_bytes) AS saved_activation_bytes, "
            f"any_value(forward_flops) AS forward_flops, "
            f"any_value(backward_flops) AS backward_flops, "
            f"any_value(recompute_flops) AS recompute_flops, any_value(params) AS params, "
            f"any_value(param_bytes) AS param_bytes, "
            f"any_value(optimizer_state_bytes) AS optimizer_state_bytes, "
            f"any_value(trusted) AS trusted, any_value(attempts) AS attempts, "
            f"any_value(foreign_load) AS foreign_load, "
            f"any_value(calibration_drift) AS calibration_drift, "
            f"any_value(step_spread) AS step_spread, any_value(waited_s) AS waited_s, "
            f"{figures}, count(step_s) AS n FROM runs GROUP BY config_id, {keys}")

    def done(self) -> set[str]:
        """Configurations with a result: `ok` or `oom` (a result), not `error` (a failure
        to measure, retried when the sweep resumes)."""
        return {r[0] for r in self.con.execute(
            "SELECT config_id FROM configs WHERE outcome <> 'error'").fetchall()}

    def untrusted(self) -> set[str]:
        """Configurations measured `ok` whose timings the guard did not trust."""
        return {r[0] for r in self.con.execute(
            "SELECT DISTINCT config_id FROM runs WHERE outcome = 'ok' AND trusted = false"
        ).fetchall()}

    def failed(self) -> set[str]:
        """Configurations whose stored outcome is `error`."""
        return {r[0] for r in self.con.execute(
            "SELECT config_id FROM configs WHERE outcome = 'error'").fetchall()}

    def mark_stale_sweeps(self) -> int:
        """Sweeps left `running` by a killed driver (this process holds the write lock, so
        none is running now) become `interrupted`; how many."""
        stale = self.con.execute("SELECT count(*) FROM sweeps WHERE status = 'running'"
                                 ).fetchone()[0]
        self.con.execute("UPDATE sweeps SET status = 'interrupted' WHERE status = 'running'")
        return int(stale)

    def write_config(self, cid: str, sweep_id: str, spec: dict, rows: list[dict],
                     measured_s: float) -> None:
        """All rows of one configuration and its completion mark, atomically."""
        cols = list(RUN_COLUMNS)
        values = [[{**r, "config_id": cid, "sweep_id": sweep_id}.get(c) for c in cols]
                  for r in rows]
        self.con.execute("BEGIN TRANSACTION")
        try:
            self.con.execute("DELETE FROM runs WHERE config_id = ?", [cid])  # a retried error
            self.con.execute("DELETE FROM configs WHERE config_id = ?", [cid])
            self.con.executemany(
                f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                values)
            self.con.execute("INSERT INTO configs VALUES (?, ?, ?, ?, ?, now())",
                             [cid, sweep_id, json.dumps(spec, sort_keys=True),
                              rows[0]["outcome"], measured_s])
            self.con.execute("COMMIT")
        except Exception:
            # a failed COMMIT (a full disk) may have ended the transaction already: the
            # original error is the one to report, not "no transaction is active"
            with contextlib.suppress(duckdb.Error):
                self.con.execute("ROLLBACK")
            raise

    def start_sweep(self, sweep_id: str, grid: str, backend: str, configs: int) -> None:
        self.con.execute("INSERT INTO sweeps (sweep_id, grid, backend, started_at, configs, "
                         "status) VALUES (?, ?, ?, now(), ?, 'running')",
                         [sweep_id, grid, backend, configs])

    def finish_sweep(self, sweep_id: str, wall_s: float, measured_s: float, status: str,
                     waited_s: float = 0.0) -> None:
        """Close a sweep's row: its wall time, the time inside measured steps, the harness
        overhead (the share of wall time outside them) and the time spent waiting for a
        quiet host."""
        overhead = harness_overhead(measured_s, wall_s)
        self.con.execute("UPDATE sweeps SET finished_at = now(), wall_s = ?, measured_s = ?, "
                         "status = ?, harness_overhead = ?, waited_s = ? WHERE sweep_id = ?",
                         [wall_s, measured_s, status, overhead, waited_s, sweep_id])

    def calibration_references(self, host: str) -> dict[tuple[str, int], float]:
        """The fastest calibration stored per (device, threads) on `host`: where a resumed
        sweep's guard starts from."""
        rows = self.con.execute(
            "SELECT cfg_device, threads, min(calibration_s) FROM runs WHERE calibration_s "
            "IS NOT NULL AND host = ? GROUP BY cfg_device, threads", [host]).fetchall()
        return {(str(d), int(t)): float(v) for d, t, v in rows if t is not None}

    def frame(self, table: str = "runs") -> pd.DataFrame:
        """A table as a DataFrame, in a stable order (a view's row order is otherwise
        arbitrary, and evaluation splits depend on it)."""
        if table not in ("runs", "configs", "sweeps", "config_summary"):
            raise ConfigError(f"unknown table {table!r}")
        order = {"runs": "config_id, repeat", "configs": "config_id",
                 "sweeps": "started_at", "config_summary": "config_id"}[table]
        try:
            return self.con.execute(f"SELECT * FROM {table} ORDER BY {order}").df()
        except duckdb.Error as exc:  # blocks that no longer read back
            raise ConfigError(f"database {self.path} is damaged: "
                              f"{str(exc).splitlines()[0]}") from None

    def export(self, out: str | Path, fmt: str, table: str = "runs") -> Path:
        if fmt not in ("parquet", "csv"):
            raise ConfigError(f"unknown export format {fmt!r}; choose parquet or csv")
        if table not in ("runs", "configs", "sweeps", "config_summary"):
            raise ConfigError(f"unknown table {table!r}")
        target = Path(out)
        refuse_overwriting_inputs(target, [self.path])
        option = "(FORMAT parquet)" if fmt == "parquet" else "(HEADER, DELIMITER ',')"
        with atomic_path(target) as tmp:
            quoted = str(tmp).replace("'", "''")
            try:
                self.con.execute(f"COPY (SELECT * FROM {table}) TO '{quoted}' {option}")
            except duckdb.Error as exc:
                raise ConfigError(f"cannot write {target}: {str(exc).splitlines()[0]}") from None
        return target


def load(db: str | Path, table: str = "runs") -> pd.DataFrame:
    """The dataset as a pandas DataFrame (`runs`: one row per repeat; `config_summary`: one
    row per configuration)."""
    with Store(db, read_only=True) as store:
        return store.frame(table)


def trusted_mask(frame: pd.DataFrame) -> pd.Series:
    """Which rows the guard trusted; rows without a verdict (measured before the guard, with
    no evidence) count as trusted."""
    if "trusted" not in frame.columns:
        return pd.Series(True, index=frame.index)
    return frame["trusted"].astype("boolean").fillna(True).astype(bool)


def trusted_only(summary: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """The configurations an analysis may use, and how many it left out: `ok` rows the
    guard did not trust are dropped (rows from before the guard, with no evidence, stay)."""
    if "trusted" not in summary.columns:
        return summary, 0
    untrusted = (summary["outcome"] == "ok") & ~trusted_mask(summary)
    return summary[~untrusted].reset_index(drop=True), int(untrusted.sum())


def remeasured(summary: pd.DataFrame) -> int:
    """How many timed repeats the guard measured again over the `ok` configurations of a
    summary: attempts beyond the repeats kept."""
    ok = summary[summary["outcome"] == "ok"]
    return int((ok["attempts"] - ok["n"]).clip(lower=0).sum())
