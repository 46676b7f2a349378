"""One command reproduces the study: sweep -> predictors -> statistics -> the largest batch
under a cap -> planner demonstrations -> gradient-estimator comparison -> report.

Every stage reports progress and stores what it produced under `out/cache/`, keyed by what
it depends on (the dataset's content, the settings); running the study again reuses each
stage whose inputs did not change, and the sweep itself resumes.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from rematlab.core.files import jsonable, write_text
from rematlab.measurement.spec import Spec
from rematlab.planning.planner import Planning
from rematlab.study.grid import Grid, load_grid
from rematlab.study.store import Store, load, trusted_only

Say = Callable[[str], None]


@dataclass(frozen=True)
class StudySettings:
    """Where the study runs and how its stages are sized. A stage setting left None is the
    grid's (`[study]` in its file, `grid.StudyOptions`), else `DEFAULTS`."""

    grid: str = "quick"
    db: Path = Path("results/quick.duckdb")
    out: Path = Path("results/study")
    backend: str = "local"
    device: str | None = None
    gradient_models: tuple[str, ...] | None = None
    gradient_budgets: tuple[int, ...] | None = None
    gradient_seeds: int | None = None
    gradient_steps: int | None = None
    gradient_batch: int | None = None
    plan_fractions: tuple[float, ...] | None = None
    plan_ops: bool | None = None  # op-level options in the plan stage (`rematlab.remat.ops`)

    def for_grid(self, grid: Grid) -> StudySettings:
        """Every stage setting filled in: this object's, else the grid's, else `DEFAULTS`."""
        given = grid.study.model_dump()

        def pick(name: str) -> object:
            mine = getattr(self, name)
            if mine is not None:
                return mine
            value = given.get(name)
            value = DEFAULTS[name] if value is None else value
            return tuple(value) if isinstance(value, list) else value

        return replace(self, **{name: pick(name) for name in DEFAULTS})


DEFAULTS = {"gradient_models": ("bert-topics",),  # the paper's regime (gradients.peft)
            "gradient_budgets": (1,), "gradient_seeds": 3, "gradient_steps": 600,
            "gradient_batch": 32, "plan_fractions": (0.1, 0.5, 0.9), "plan_ops": True}


class _Cache:
    def __init__(self, root: Path) -> None:
        self.root = root / "cache"
        self.root.mkdir(parents=True, exist_ok=True)

    def get(self, stage: str, key: str) -> dict | None:
        path = self.root / f"{stage}.json"
        if path.exists():
            data = json.loads(path.read_text())
            if data.get("key") == key:
                return data["value"]
        return None

    def put(self, stage: str, key: str, value: dict) -> None:
        write_text(self.root / f"{stage}.json",
                   json.dumps({"key": key, "value": value}, default=jsonable))

    def made(self, stage: str, key: str, make: Callable[[], dict]) -> dict:
        """The stage's stored value for `key`, or `make()`'s, stored: a rerun resumes."""
        value = self.get(stage, key)
        if value is None:
            value = make()
            self.put(stage, key, value)
        return value


def _fingerprint(db: Path) -> str:
    with Store(db, read_only=True) as store:
        ids = sorted(store.done())
    return hashlib.sha256("".join(ids).encode()).hexdigest()[:16]


def _sweep_info(sweeps: pd.DataFrame) -> dict:
    """Wall time and overhead of the latest completed sweep that measured configurations.
    A rerun that found every configuration stored measured nothing: its own figures (0 s,
    100 % overhead) say nothing, so the report gives the sweep that did the work and says
    that this run reused it."""
    completed = sweeps[sweeps["status"] == "complete"].sort_values("started_at")
    worked = completed[completed["configs"] > 0]
    if not len(worked):
        return {}
    last = worked.iloc[-1]
    return {"wall_s": float(last["wall_s"] or 0), "measured_s": float(last["measured_s"] or 0),
            "harness_overhead": float(last["harness_overhead"] or 0),
            # NULL in sweeps stored before schema v4: no wait was recorded, not NaN seconds
            "waited_s": float(last["waited_s"]) if pd.notna(last.get("waited_s")) else 0.0,
            "started_at": str(last["started_at"])[:19],
            "reused": bool(completed.iloc[-1]["sweep_id"] != last["sweep_id"])}


def run_study(settings: StudySettings, say: Say = print,
              sweep_runner: Callable[[Grid, Path], object] | None = None) -> tuple[Path, Path]:
    """The whole study; returns the paths of report.html and report.md. Each stage after
    the sweep is cached under the sweep's fingerprint, so a rerun resumes."""
    from rematlab.study.report import StudyResults, render

    grid = load_grid(settings.grid)
    if settings.device:
        grid = grid.model_copy(update={"devices": [settings.device]})
    settings = settings.for_grid(grid)
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    cache = _Cache(out)
    summary, runs, sweep_info = _sweep_stage(grid, settings, say, sweep_runner)
    key = _fingerprint(settings.db)

    say("[2/7] predictors: features, evaluation, fit")
    pred = cache.made("predict", key, lambda: _predict_stage(summary, out))
    caps = grid_caps(summary)
    say("[3/7] statistics and guidelines")
    stats = cache.made("stats", key, lambda: _stats_stage(summary, runs, caps))
    say("[4/7] the largest batch under each architecture's cap, without and with remat")
    batches = cache.made("batches", f"{key}|{grid.devices[0]}|{sorted(caps.items())}",
                         lambda: {"rows": _batch_stage(grid, caps, say)})
    stats["guidelines"] = with_batches(stats.get("guidelines", []), batches["rows"])
    say("[5/7] planner demonstrations")
    plans = cache.made(
        "plans", f"{key}|{settings.plan_fractions}|{settings.plan_ops}|{grid.devices[0]}",
        lambda: {"rows": _plan_stage(grid, settings, out, say)})
    say("[6/7] gradient estimators: BP+checkpointing vs forward-mode AD vs zeroth-order")
    grad_key = json.dumps([settings.gradient_models, settings.gradient_budgets,
                           settings.gradient_seeds, settings.gradient_steps,
                           settings.gradient_batch])
    grads = cache.made("gradients", grad_key, lambda: _gradient_stage(settings, say))
    say("[7/7] report")
    res = StudyResults(
        grid=grid.name, about=grid.study.about or "", summary=summary, runs=runs,
        evaluation=pd.DataFrame(pred["evaluation"]),
        predictions=pd.DataFrame(pred["predictions"]),
        predictor_models=pred["models"], stats=stats, plans=pd.DataFrame(plans["rows"]),
        batches=pd.DataFrame(batches["rows"]),
        gradients=grads, sweep=sweep_info)
    return render(res, out)


def _sweep_stage(grid: Grid, settings: StudySettings, say: Say,
                 sweep_runner: Callable[[Grid, Path], object] | None
                 ) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """Stage 1: the grid swept into the study's database (resumed where it stopped); the
    per-configuration summary, the runs, and what the sweep took."""
    say(f"[1/7] sweep: {len(grid.expand())} configurations of grid {grid.name} -> "
        f"{settings.db}")
    if sweep_runner is not None:
        result = sweep_runner(grid, settings.db)
    else:
        from rematlab.study.sweep import sweep

        result = sweep(grid, settings.db, backend=settings.backend)
    if getattr(result, "interrupted", False):
        raise KeyboardInterrupt
    with Store(settings.db, read_only=True) as store:
        sweeps = store.frame("sweeps")
    sweep_info = _sweep_info(sweeps)
    summary, runs = load(settings.db, "config_summary"), load(settings.db)
    sweep_info["untrusted"] = trusted_only(summary)[1]
    return summary, runs, sweep_info


def _stats_stage(summary: pd.DataFrame, runs: pd.DataFrame, caps: dict) -> dict:
    from rematlab.study.stats import analyze

    return analyze(summary, runs, memory_cap=caps).to_dict()


def _gradient_stage(settings: StudySettings, say: Say) -> dict:
    from rematlab.gradients.comparison import compare

    return compare(list(settings.gradient_models), list(settings.gradient_budgets),
                   settings.gradient_seeds, steps=settings.gradient_steps,
                   batch=settings.gradient_batch, progress=lambda m: say(f"      {m}")
                   ).to_dict()


def _predict_stage(summary: pd.DataFrame, out: Path) -> dict:
    from rematlab.study.predictor import fit_and_evaluate

    predictor, evaluation, data = fit_and_evaluate(summary, out / "predictor.skops")
    predictions = [{"target": t, "measured": float(m), "predicted": float(p)}
                   for t in ("time", "memory")
                   for m, p in zip(data[t], predictor.oof_[t], strict=True)]
    return {"evaluation": evaluation.to_dict(orient="records"), "predictions": predictions,
            "models": dict(predictor.names_)}


def grid_caps(summary: pd.DataFrame) -> dict[str, int]:
    """Each architecture's memory cap, derived from the grid: between the measured peaks of
    `none` at its two largest batch sizes (their geometric mean), so that without remat the
    second-largest fits and the largest does not — the boundary where remat can matter."""
    ok = summary[(summary["outcome"] == "ok") & (summary["cfg_strategy"] == "none")]
    caps = {}
    for model, g in ok.groupby("cfg_model"):
        peaks = g.groupby("cfg_batch")["peak_bytes_median"].median().sort_index()
        if len(peaks) >= 2:
            caps[str(model)] = int(math.sqrt(float(peaks.iloc[-1]) * float(peaks.iloc[-2])))
    return caps


def _batch_stage(grid: Grid, caps: dict[str, int], say: Say) -> list[dict]:
    """`max_batch` for each zoo architecture of the grid at its cap: the largest batch and
    its throughput without remat and with the optimal plan."""
    from rematlab.measurement import zoo
    from rematlab.planning.maxbatch import max_batch

    device = torch.device(grid.devices[0])
    rows, seen = [], set()
    for spec in grid.expand():
        if spec.model not in zoo.REGISTRY or spec.model in seen or spec.model not in caps:
            continue
        seen.add(spec.model)
        net, shape, _ = zoo.resolve(spec.model, spec.input)
        torch.manual_seed(spec.seed)
        net = net.to(device).train()
        found = max_batch(net, torch.randn(8, *shape, device=device), caps[spec.model],
                          optimizer=spec.optimizer, repeats=3)
        none, best = found.fit("none"), found.fit("optimal")
        say(f"      {spec.model} cap {caps[spec.model] / 2**20:.1f} MiB: batch {none.batch} "
            f"-> {best.batch} with remat ({found.search_s:.1f} s search)")
        rows.append({
            "model": spec.model, "cap_MiB": round(caps[spec.model] / 2**20, 1),
            "batch_none": none.batch, "batch_remat": best.batch, "samples_s_none": none.throughput,
            "samples_s_remat": best.throughput,
            "throughput_ratio": (best.throughput / none.throughput
                                 if best.throughput and none.throughput else None),
            "plan": best.plan, "search_s": found.search_s})
    return rows


def with_batches(guidelines: list[dict], batches: list[dict]) -> list[dict]:
    """The guidelines with each architecture's cap, the largest batch without and with remat
    under it ('none -> remat', measured by `max_batch`), and 'enables batch under cap': the
    smallest batch that only remat fits — the grid's own answer when one of its batch sizes
    is that batch, else the one `max_batch` measured (none's largest plus one), or 'none'."""
    by_model = {r["model"]: r for r in batches}
    out = []
    for row in guidelines:
        found = by_model.get(row["architecture"])
        if found is not None:
            none, remat = found["batch_none"], found["batch_remat"]
            enables = row.get("enables batch under cap")
            if enables is None or (isinstance(enables, float) and math.isnan(enables)):
                enables = none + 1 if remat > none else "none"
            row = {**row, "enables batch under cap": enables, "cap (MiB)": found["cap_MiB"],
                   "largest batch under cap (none -> remat)": f"{none} -> {remat}"}
        out.append(row)
    return out


def _plan_stage(grid: Grid, settings: StudySettings, out: Path, say: Say) -> list[dict]:
    """For each zoo model of the grid at its largest batch: plans at a few budgets between
    the floor and the unconstrained peak (with op-level options where `plan_ops`, as
    `prepare(ops=True)`), verified, then measured as a training step; beside each, the best
    uniform count that fits the same budget (simulated)."""
    from rematlab.core.recipe import Step
    from rematlab.measurement import zoo
    from rematlab.planning.planner import prepare
    from rematlab.plans.fixed import none_plan
    from rematlab.plans.simulate import simulate

    device = torch.device(grid.devices[0])
    rows = []
    (out / "plans").mkdir(exist_ok=True)
    specs = grid.expand()
    largest: dict[tuple[str, str | None], int] = {}
    for s in specs:
        key = (s.model, s.input)
        largest[key] = max(largest.get(key, 0), s.batch)
    seen = set()
    for spec in specs:
        if spec.model not in zoo.REGISTRY or (spec.model, spec.input, spec.precision) in seen:
            continue
        seen.add((spec.model, spec.input, spec.precision))
        batch = largest[(spec.model, spec.input)]
        net, shape, _ = zoo.resolve(spec.model, spec.input)
        net = net.to(device).train()
        x = torch.randn(batch, *shape, device=device)
        # the configuration's own step: its optimizer, its autocast
        step = Step(precision=spec.precision, optimizer=spec.optimizer)
        planning = prepare(net, x, step=step, ops=settings.plan_ops)
        floor = planning.floor_budget()  # what choose accepts
        full, full_time = simulate(none_plan(planning.costs.n), planning.costs)
        full = max(full, floor)
        budgets = {int(floor + f * (full - floor)): f
                   for f in settings.plan_fractions}  # one budget when floor == full
        for budget, frac in budgets.items():
            rows.append(_plan_row(planning, replace(spec, device=grid.devices[0], batch=batch),
                                  budget, frac, full_time, out, say))
    return rows


def _plan_row(planning: Planning, spec: Spec, budget: int, frac: float, full_time: float,
              out: Path, say: Say) -> dict:
    """One planner demonstration: the plan for `budget`, written to the study's folder,
    measured as the configuration's training step (`spec`: its model, input, precision and
    optimizer at the planned batch, on the planned device), beside the best uniform count
    that fits the same budget (simulated)."""
    from rematlab.measurement.measure import measure
    from rematlab.plans.simulate import overhead

    chosen, batch = planning.choose(budget), spec.batch
    precision = f"-{spec.precision}" if spec.precision else ""
    path = out / "plans" / f"{spec.model}-{spec.input}{precision}-b{batch}-{frac:g}.json"
    write_text(path, chosen.to_json())
    obs = measure(Spec(model=spec.model, input=spec.input, batch=batch,
                       strategy=f"plan:{path}", device=spec.device, repeats=3,
                       optimizer=spec.optimizer, precision=spec.precision))
    say(f"      {spec.model} b{batch} budget {budget / 2**20:.1f} MiB: {chosen.describe()}")
    uniform = next((r for r in planning.baselines(budget)
                    if r.strategy.startswith("uniform")), None)
    ok = obs.outcome == "ok"
    return {"model": spec.model, "input": spec.input, "batch": batch,
            "precision": spec.precision or "fp32",
            "budget": budget, "floor": planning.floor_budget(), "plan": chosen.describe(),
            "predicted_peak": chosen.predicted_peak,
            "measured_peak": obs.peak if ok else None,
            "within_budget": bool(obs.peak is not None and obs.peak <= budget),
            "predicted_overhead": overhead(chosen.predicted_time or 0.0, full_time),
            "step_s": obs.median() if ok else None,
            "trusted": obs.evidence.trusted if obs.evidence else None,
            "uniform": uniform.strategy if uniform else None,
            "uniform_fits": bool(uniform and uniform.fits),
            "uniform_overhead": uniform.overhead if uniform else None}
