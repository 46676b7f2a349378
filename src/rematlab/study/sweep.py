"""Run a grid into the results database: isolated, one at a time per device, resumable.

Configurations run in a worker process under a timeout, never in the driver: a crash, a hang
or a real OOM stays there, and only this driver process writes the database. On CPU one warm
worker measures configuration after configuration (`Worker`): its byte counts (the tracker,
the allocator's events) do not depend on what ran before, and it has already paid the
interpreter, import and first-kernel costs, so the sweep's time goes into measuring. It is
replaced after anything that is not a result (a timeout, a crash, a death). Each device
has a warm worker of its own: on a GPU it keeps the CUDA context (initialising it cost ~3 s a
configuration on the H200, issue 51), and before each configuration the caching allocator
returns its cached segments and resets its peaks (`fresh_allocator`), so reserved bytes and
peak statistics owe nothing to the previous configuration. Configurations already in the
database with a result (`ok` or `oom`) are skipped, so re-running a grid resumes it; those
stored as `error` (a failure to measure, not a result) are run again. The fastest
calibration stored for this host seeds the interference guard (`rematlab.core.guard`) of a
resumed sweep. A configuration the guard did not trust (timed while the machine was busy)
is measured once more at the end of the sweep, after waiting up to `SETTLE_S` for a quiet
host, and its rows are replaced when that attempt is trusted: a busy spell in the middle of
a long sweep costs its configurations a second try, not their place in the analyses.
Running the grid again gives every configuration still untrusted one more try. The Ray
backend (`rematlab.study.raybackend`) runs the same worker function as Ray tasks.

Design note — why one at a time: two measurements sharing a device (or the CPU's cores)
slow each other down unpredictably, so the local backend never overlaps them, and the Ray
backend reserves a whole device (or all of a node's configured CPUs) per task.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from rematlab.core import hostmem
from rematlab.core.guard import MAX_WAIT_S
from rematlab.exceptions import ConfigError
from rematlab.measurement.measure import failed_row, run_config
from rematlab.measurement.spec import Spec, available, parse_device
from rematlab.study.grid import Grid
from rematlab.study.interrupts import Interrupts
from rematlab.study.store import Store, config_id, harness_overhead

ProgressFn = Callable[[Spec, str, int, int], None]  # spec, outcome, done, total
SETTLE_S = 30.0  # the second attempt at an untrusted configuration waits this long for quiet


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
    untrusted: int = 0  # ok, but timed while the machine was busy (`rematlab.core.guard`)
    remeasured: int = 0  # untrusted configurations measured a second time
    settled: int = 0  # of which the second attempt was trusted (and replaced the first)
    waited_s: float = 0.0  # waiting for a quiet host, in all (bounded by the grid)
    wait_spent: bool = False  # the sweep's bound on waiting was reached: no more waits

    @property
    def harness_overhead(self) -> float:
        """Fraction of wall time not spent inside measured steps."""
        return harness_overhead(self.measured_s, self.wall_s) or 0.0

    def __len__(self) -> int:
        return sum(self.outcomes.values())

    def frame(self) -> pd.DataFrame:
        from rematlab.study.store import load

        return load(self.db, "config_summary")

    @property
    def errors(self) -> pd.DataFrame:
        df = self.frame()
        return df[df["outcome"] == "error"]

    def best(self, metric: str = "step_s_median", mode: str = "min") -> pd.Series:
        df = self.frame()
        df = df[df["outcome"] == "ok"]
        return df.loc[df[metric].idxmin() if mode == "min" else df[metric].idxmax()]


def _serve(conn, lifeline) -> None:
    """A worker's loop: a configuration in, its result out, until the driver sends None.
    The worker dies with the driver, never orphaned: the kernel kills it when its parent
    dies (`PR_SET_PDEATHSIG`), and a thread kills it when the driver's end of `lifeline`
    closes — the driver may die while the parent, the forkserver, lives on."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    threading.Thread(target=_die_with_driver, args=(lifeline,), daemon=True).start()
    hostmem.own_process()  # checked by the driver (`sweep`) before any worker starts
    threads = torch.get_num_threads()  # a configuration without a setting gets the default
    try:
        while (job := conn.recv()) is not None:
            torch.set_num_threads(threads)
            fresh_allocator(job[0].get("device", "cpu"))
            try:
                conn.send(run_config(*job))
            except BaseException as exc:  # report anything, the driver records it as an error
                conn.send({"crash": f"{type(exc).__name__}: {exc}"})
    except EOFError:  # the driver went away
        pass
    finally:
        conn.close()


def fresh_allocator(device: str) -> None:
    """Before a CUDA configuration in a warm worker: the previous configuration's tensors
    collected, the caching allocator's cached segments returned to the card and its peak
    statistics reset, so reserved bytes and peaks owe nothing to what ran before; the CUDA
    context, cuBLAS handles and compiled kernels stay (what a fresh worker paid seconds for)."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _die_with_driver(lifeline) -> None:
    """Block until the driver's end of `lifeline` closes (it never writes), then die."""
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv()
    os.kill(os.getpid(), signal.SIGKILL)


def _context() -> mp.context.BaseContext:
    """forkserver where available: workers fork from a clean server process that imported
    torch but never ran it, which is fast (no interpreter start-up) and safe (forking a
    process whose OpenMP pool has run can deadlock the child)."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["rematlab.study.sweep", "rematlab.measurement.measure"])
        return ctx
    return mp.get_context("spawn")


class Worker:
    """A worker process that measures configurations one after another (`run`); `None`
    until started. After a result that is not a measurement — a timeout, a crash, a
    death — it is gone and the next `run` starts a new one."""

    def __init__(self) -> None:
        self.proc: mp.process.BaseProcess | None = None
        self.conn = None
        self.lifeline = None  # only this process holds it: the worker dies when it closes

    def _start(self) -> None:
        """Start the process; the worker is only this object's once it runs (Ctrl-C before
        then leaves nothing to stop: the lifeline's end closes with this frame)."""
        ctx = _context()
        conn, child = ctx.Pipe(duplex=True)
        watch, lifeline = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_serve, args=(child, watch), daemon=True)
        proc.start()
        self.proc, self.conn, self.lifeline = proc, conn, lifeline
        child.close()
        watch.close()

    def run(self, spec: Spec, timeout: float, reference: float | None = None,
            settle_s: float = 0.0, max_wait_s: float = MAX_WAIT_S) -> dict:
        """`run_config` in the worker; a timeout or a crash becomes an `error` row (a death
        by SIGKILL, the kernel's OOM killer, an `oom` row) and ends the worker."""
        if self.proc is None:
            self._start()
        hung = False
        try:
            self.conn.send((spec.to_dict(), reference, settle_s, max_wait_s))
            if self.conn.poll(timeout):
                result = self.conn.recv()
            else:
                result, hung = {"crash": f"timeout after {timeout:g} s"}, True
        except (EOFError, BrokenPipeError):
            result = {"crash": "worker died (killed or crashed)"}
        if "crash" not in result:
            return result
        code = self.close(kill=hung)  # only a hung worker is killed: its code says nothing
        message = result["crash"] + (f" (exit code {code})" if code not in (0, None) else "")
        outcome = "oom" if code == -signal.SIGKILL and "timeout" not in message else "error"
        return {"rows": [failed_row(spec, outcome, message)], "measured_s": 0.0}

    def close(self, kill: bool = False) -> int | None:
        """Stop the worker (asking it, or killing it); its exit code."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        if not kill:
            with contextlib.suppress(OSError):
                self.conn.send(None)
            proc.join(5)
        if proc.is_alive():
            proc.kill()
        proc.join()
        self.conn.close()
        self.lifeline.close()
        return proc.exitcode


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
    remeasure: bool = True,
) -> SweepResult:
    """Run every configuration of `grid` not yet in `db`, then (`remeasure`) once more
    each one the guard did not trust. Interrupting it (Ctrl-C, SIGTERM) keeps everything
    finished so far; running it again resumes."""
    if backend not in ("local", "ray"):
        raise ConfigError(f"unknown backend {backend!r}; choose local or ray")
    hostmem.asked()  # the workers' host allocator setting, checked before any starts
    specs = grid.expand()
    for device in grid.devices:  # a grid may name GPUs for a dry run; a run needs them here
        available(parse_device(device))
    db, interrupts = Path(db), Interrupts()
    with interrupts.installed():  # held from here on, but while a configuration is measured
        store = Store(db)
        try:
            result = SweepResult(db=db, total=len(specs), skipped=0)
            run = _SweepRun(grid, specs, store, result, progress, interrupts)
            run.go(grid_label or grid.name, backend, ray_address, remeasure)
        finally:
            store.close()
    result.interrupted |= interrupts.pending  # a Ctrl-C during the last bookkeeping
    return result


class _SweepRun:
    """One sweep's bookkeeping: each configuration's rows written as it ends, the
    calibration references and the guard's waiting carried from one to the next, progress
    reported."""

    def __init__(self, grid: Grid, specs: list[Spec], store: Store, result: SweepResult,
                 progress: ProgressFn | None, interrupts: Interrupts) -> None:
        self.grid, self.specs, self.store, self.result = grid, specs, store, result
        self.progress, self.interrupts = progress, interrupts
        result.stale = store.mark_stale_sweeps()
        done, failed = store.done(), store.failed()
        self.references = store.calibration_references(socket.gethostname())
        self.todo = [s for s in specs if config_id(s.to_dict()) not in done]
        result.skipped = len(specs) - len(self.todo)
        result.retried = sum(config_id(s.to_dict()) in failed for s in self.todo)
        self.sweep_id = uuid.uuid4().hex[:12]

    def go(self, label: str, backend: str, ray_address: str | None, remeasure: bool) -> None:
        """Every configuration to do, then the untrusted once more; Ctrl-C and SIGTERM stop
        cleanly even where a shell started it with SIGINT ignored (background jobs, batch
        schedulers), and the sweep's record is closed whatever happens."""
        result, grid = self.result, self.grid
        self.store.start_sweep(self.sweep_id, label, backend, len(self.todo))
        start = time.perf_counter()
        status = "failed"
        try:
            with self.interrupts.released():
                run_all(self.todo, grid.timeout, self.record, 0.0, self.references, backend,
                        ray_address, self.wait_left)
                if remeasure and not result.wait_spent:
                    run_all(self.untrusted(), grid.timeout, self.record_again, SETTLE_S,
                            self.references, backend, ray_address, self.wait_left)
            status = "complete"
        except KeyboardInterrupt:
            result.interrupted = True
            status = "interrupted"
        finally:
            result.wall_s = time.perf_counter() - start
            self.store.finish_sweep(self.sweep_id, result.wall_s, result.measured_s, status,
                                    result.waited_s)
            result.untrusted = len(self.untrusted())

    def record(self, spec: Spec, out: dict) -> None:
        with self.interrupts.held():  # the rows and the tally, whole, before a Ctrl-C acts
            self._record(spec, out)

    def _record(self, spec: Spec, out: dict) -> None:
        result = self.result
        self.store.write_config(config_id(spec.to_dict()), self.sweep_id, spec.to_dict(),
                                out["rows"], out["measured_s"])
        outcome = out["rows"][0]["outcome"]
        self._note(spec, out)
        result.outcomes[outcome] += 1
        result.measured_s += out["measured_s"]
        if self.progress:
            row = out["rows"][0]
            busy = outcome == "ok" and row.get("trusted") is False
            self.progress(spec, f"untrusted ({row.get('guard_reason') or 'busy machine'})"
                          if busy else outcome, result.skipped + len(result), result.total)

    def record_again(self, spec: Spec, out: dict) -> None:
        with self.interrupts.held():
            self._record_again(spec, out)

    def _record_again(self, spec: Spec, out: dict) -> None:
        """A second attempt replaces the first only when the guard trusted it."""
        result = self.result
        result.remeasured += 1
        result.measured_s += out["measured_s"]
        self._note(spec, out)
        trusted = out["rows"][0].get("trusted") is True
        if trusted:
            self.store.write_config(config_id(spec.to_dict()), self.sweep_id, spec.to_dict(),
                                    out["rows"], out["measured_s"])
            result.settled += 1
        if self.progress:
            self.progress(spec, "re-measured, trusted" if trusted else "still untrusted",
                          result.total, result.total)

    def _note(self, spec: Spec, out: dict) -> None:
        """The configuration's calibration reference (the fastest seen per device and
        threads) and the time it waited for quiet, carried to the next."""
        first = out["rows"][0]
        if first.get("calibration_reference_s"):
            key = (spec.device, int(first["threads"]))
            self.references[key] = min(self.references.get(key, math.inf),
                                       first["calibration_reference_s"])
        self.result.waited_s += first.get("waited_s") or 0.0
        self.result.wait_spent = self.result.waited_s >= self.grid.max_wait_total_s

    def wait_left(self) -> float:
        """What the next configuration may wait: its own bound, within the sweep's."""
        return max(0.0, min(self.grid.max_wait_s,
                            self.grid.max_wait_total_s - self.result.waited_s))

    def untrusted(self) -> list[Spec]:
        ids = self.store.untrusted()
        return [s for s in self.specs if config_id(s.to_dict()) in ids]


def run_all(specs: list[Spec], timeout: float, record: Callable[[Spec, dict], None],
            settle_s: float, references: dict[tuple[str, int], float], backend: str,
            ray_address: str | None, wait_left: Callable[[], float]) -> None:
    """Measure `specs` one at a time on `backend`, handing each result to `record`; each
    configuration may wait `wait_left()` seconds for a quiet host (Ray runs them at once:
    each gets the bound the first one had)."""
    if not specs:  # nothing to run: start no worker, no Ray instance
        return
    if backend == "ray":
        from rematlab.study.raybackend import run_on_ray

        run_on_ray(specs, timeout, record, address=ray_address, settle_s=settle_s,
                   max_wait_s=wait_left())
        return
    warm: dict[str, Worker] = {}  # one warm worker per device
    try:
        for spec in specs:
            reference = references.get((spec.device, spec.threads or torch.get_num_threads()))
            wait = wait_left()
            settle = min(settle_s, wait)
            worker = warm.setdefault(spec.device, Worker())
            record(spec, worker.run(spec, timeout, reference, settle, wait))
    finally:
        for worker in warm.values():
            worker.close()

