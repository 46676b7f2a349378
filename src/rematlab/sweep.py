"""Run a grid into the results database: isolated, one at a time per device, resumable.

Each configuration runs in a child process of its own (a fresh allocator; a crash, a hang or
an OOM stays there) under a timeout. Configurations already in the database with a
result (`ok` or `oom`) are skipped, so re-running a grid resumes it; those stored as `error`
(a failure to measure, not a result) are run again. Only this driver process writes the
database. The Ray backend (`rematlab.raybackend`) runs the same worker function as Ray
tasks.

Design note — why one at a time: two measurements sharing a device (or the CPU's cores)
slow each other down unpredictably, so the local backend never overlaps them, and the Ray
backend reserves a whole device (or all of a node's configured CPUs) per task.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from rematlab.exceptions import ConfigError
from rematlab.grid import Grid
from rematlab.measure import Spec, available, failed_row, parse_device, run_config
from rematlab.store import Store, config_id

ProgressFn = Callable[[Spec, str, int, int], None]  # spec, outcome, done, total


@dataclass
class SweepResult:
    """A finished (or interrupted) sweep: counts, wall time, and the rows it can read back."""

    db: Path
    total: int
    skipped: int
    outcomes: Counter = field(default_factory=Counter)
    wall_s: float = 0.0
    measured_s: float = 0.0
    interrupted: bool = False
    retried: int = 0  # configurations stored as `error` before, run again
    stale: int = 0  # earlier sweeps found `running` (their driver was killed): interrupted

    @property
    def harness_overhead(self) -> float:
        """Fraction of wall time not spent inside measured steps."""
        return 1.0 - self.measured_s / self.wall_s if self.wall_s else 0.0

    def __len__(self) -> int:
        return sum(self.outcomes.values())

    def frame(self) -> pd.DataFrame:
        from rematlab.store import load

        return load(self.db, "config_summary")

    @property
    def errors(self) -> pd.DataFrame:
        df = self.frame()
        return df[df["outcome"] == "error"]

    def best(self, metric: str = "step_s_median", mode: str = "min") -> pd.Series:
        df = self.frame()
        df = df[df["outcome"] == "ok"]
        return df.loc[df[metric].idxmin() if mode == "min" else df[metric].idxmax()]


def _child(spec_dict: dict, conn) -> None:
    if sys.platform.startswith("linux"):  # die with the driver, never orphaned
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    try:
        conn.send(run_config(spec_dict))
    except BaseException as exc:  # report anything, the driver records it as an error
        conn.send({"crash": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


def _context() -> mp.context.BaseContext:
    """forkserver where available: children fork from a clean server process that imported
    torch but never ran it, which is fast (no interpreter start-up per configuration) and
    safe (forking a process whose OpenMP pool has run can deadlock the child)."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["rematlab.sweep", "rematlab.measure"])
        return ctx
    return mp.get_context("spawn")


def run_isolated(spec: Spec, timeout: float) -> dict:
    """`run_config` in a child process; a timeout or a crash becomes an `error` row."""
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(spec.to_dict(), child), daemon=True)
    proc.start()
    child.close()
    try:
        if parent.poll(timeout):
            result = parent.recv()
        else:
            result = {"crash": f"timeout after {timeout:g} s"}
    except EOFError:
        result = {"crash": "worker died (killed or crashed)"}
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
    if "crash" in result:
        code = proc.exitcode
        message = result["crash"] + (f" (exit code {code})" if code not in (0, None) else "")
        outcome = "oom" if code == -signal.SIGKILL and "timeout" not in message else "error"
        return {"rows": [failed_row(spec, outcome, message)], "measured_s": 0.0}
    return result


def resume_hint(grid_path: str, db: Path, backend: str) -> str:
    extra = f" --backend {backend}" if backend != "local" else ""
    return f"rematlab sweep {grid_path} --db {db}{extra}"


def sweep(
    grid: Grid,
    db: str | Path,
    *,
    backend: str = "local",
    ray_address: str | None = None,
    progress: ProgressFn | None = None,
    grid_label: str | None = None,
) -> SweepResult:
    """Run every configuration of `grid` not yet in `db`. Interrupting it (Ctrl-C, SIGTERM)
    keeps everything finished so far; running it again resumes."""
    if backend not in ("local", "ray"):
        raise ConfigError(f"unknown backend {backend!r}; choose local or ray")
    specs = grid.expand()
    for device in grid.devices:  # a grid may name GPUs for a dry run; a run needs them here
        available(parse_device(device))
    db = Path(db)
    store = Store(db)
    try:
        result = SweepResult(db=db, total=len(specs), skipped=0)
        result.stale = store.mark_stale_sweeps()
        done, failed = store.done(), store.failed()
        todo = [s for s in specs if config_id(s.to_dict()) not in done]
        result.skipped = len(specs) - len(todo)
        result.retried = sum(config_id(s.to_dict()) in failed for s in todo)
        sweep_id = uuid.uuid4().hex[:12]
        store.start_sweep(sweep_id, grid_label or grid.name, backend, len(todo))
        start = time.perf_counter()

        def record(spec: Spec, out: dict) -> None:
            store.write_config(config_id(spec.to_dict()), sweep_id, spec.to_dict(),
                               out["rows"], out["measured_s"])
            outcome = out["rows"][0]["outcome"]
            result.outcomes[outcome] += 1
            result.measured_s += out["measured_s"]
            if progress:
                progress(spec, outcome, result.skipped + len(result), result.total)

        # Ctrl-C and SIGTERM stop the sweep cleanly even where a shell started it with
        # SIGINT ignored (background jobs, batch schedulers).
        previous = {sig: signal.signal(sig, _raise_interrupt)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        status = "failed"
        try:
            if backend == "local":
                for spec in todo:
                    record(spec, run_isolated(spec, grid.timeout))
            else:
                from rematlab.raybackend import run_on_ray

                run_on_ray(todo, grid.timeout, record, address=ray_address)
            status = "complete"
        except KeyboardInterrupt:
            result.interrupted = True
            status = "interrupted"
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            result.wall_s = time.perf_counter() - start
            store.finish_sweep(sweep_id, result.wall_s, result.measured_s, status)
    finally:
        store.close()
    return result


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
