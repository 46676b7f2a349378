"""Which card to rent, how many, with which plan, and what the job costs (issue 60).

The question a user pays for is the one the study's second source asks: rent a card with more
memory, or train smarter on a cheaper one? `rent` answers it for the user's own model and
step by pre-flight alone (`rematlab.preflight`), nothing run: for every candidate card and
count, the step as that many data-parallel ranks would run it (FSDP2 or DDP, one rank's
step, `rematlab.distributed`), planned for the card as `plan(..., predict=True,
target=card)` plans it:

- whether the plain step fits (its band's upper end within the card, `Planning.band`);
- the fastest plan that fits, its predicted peak and band (`Planning.choose("auto")`);
- its predicted step time (the roofline's, `simulate`) and the job's tokens or samples per
  second (every rank runs its own batch);
- the largest batch per rank with the optimal plan (`max_batch(..., predict=True)`) and its
  throughput;
- the hours the work takes at the given batch, and their cost at the card's price
  (`rematlab.planning.prices`): count x hours x price per GPU-hour.

There is no second formula: every figure is pre-flight's, and where pre-flight is wrong it is
fixed there. Pre-flight is checked against published runs (`benchmarks/published.py`), so the
time figures of a row here are those a published row's replay shows.

The result is a set, as Ray Tune's `ResultGrid` is: `best("cost")`, `frame()`, `pareto()`,
`misfits` (what did not fit, and why).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from torch import nn

from rematlab.core.batch import Batch, tensors
from rematlab.core.checks import bounded, one_line
from rematlab.core.layout import FSDP
from rematlab.core.recipe import Step
from rematlab.exceptions import ConfigError, InfeasibleBudgetError
from rematlab.planning.maxbatch import max_batch
from rematlab.planning.planner import prepare
from rematlab.planning.predicted import with_margin
from rematlab.planning.prices import PRICES, Price, card_name
from rematlab.plans.fixed import none_plan
from rematlab.plans.simulate import overhead, simulate
from rematlab.preflight.shared import shared_runs
from rematlab.preflight.targets import PROFILES, Target

COUNTS = (1, 2, 4, 8)
BY = ("cost", "hours")
MAX_COUNT = 1 << 16


@dataclass(frozen=True)
class Work:
    """How much training the job does: `tokens`, or `samples` (epochs x dataset size)."""

    tokens: int | None = None
    samples: int | None = None

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.samples is None):
            raise ConfigError("give the work as tokens or as samples (epochs x dataset size), "
                              "one of them")
        for name in ("tokens", "samples"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise ConfigError(f"the work's {name} must be a whole number above 0, got "
                                  f"{value!r}"[:200])

    @property
    def unit(self) -> str:
        return "tokens" if self.tokens is not None else "samples"

    @property
    def amount(self) -> int:
        return self.tokens if self.tokens is not None else self.samples  # type: ignore[return-value]


@dataclass(frozen=True)
class Rental:
    """One card x count: whether and how the step fits, how fast it runs and what the work
    costs. Sizes are bytes per rank; `step_s` one rank's optimizer step at the given batch;
    `per_s` the job's tokens or samples per second; `hours` and `cost` (US dollars) for the
    whole work. `fits` False: `why` says what did not fit."""

    card: str
    count: int
    layout: str
    fits: bool
    fits_plain: bool = False
    plan: str | None = None
    remat: bool = False
    recomputed: int = 0  # of the `blocks` (a model's layers) the plan recomputes
    blocks: int | None = None
    peak: int | None = None
    upper: int | None = None
    budget: int | None = None
    step_s: float | None = None
    overhead: float | None = None
    per_s: float | None = None
    largest_batch: int | None = None
    largest_per_s: float | None = None
    hours: float | None = None
    usd_per_hour: float | None = None
    cost: float | None = None
    price_source: str | None = None
    why: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RentResult:
    """Every configuration `rent` priced (module docstring), ranked by cost."""

    rows: tuple[Rental, ...]
    work: Work
    seconds: float

    @property
    def fitting(self) -> list[Rental]:
        return [r for r in self.rows if r.fits]

    @property
    def misfits(self) -> list[Rental]:
        """The configurations that do not fit, each with why."""
        return [r for r in self.rows if not r.fits]

    def best(self, by: str = "cost") -> Rental:
        """The cheapest (`by="cost"`) or fastest (`"hours"`) configuration that fits and has
        a price; a run whose work fits nowhere is refused."""
        if by not in BY:
            raise ConfigError(f"best() ranks by one of {', '.join(BY)}, got {by!r}")
        pool = [r for r in self.fitting if getattr(r, by) is not None]
        if not pool:
            raise ConfigError("no configuration fits" + ("" if self.fitting else
                              ": every one is listed in misfits with why"))
        other = "hours" if by == "cost" else "cost"  # ties: the faster, or the cheaper
        return min(pool, key=lambda r: (getattr(r, by), getattr(r, other) or 0.0))

    def pareto(self) -> list[Rental]:
        """The configurations no other beats on both cost and hours, cheapest first: the
        front from the cheapest to the fastest."""
        priced = sorted((r for r in self.fitting if r.cost is not None),
                        key=lambda r: (r.cost, r.hours))
        front: list[Rental] = []
        for r in priced:
            if not front or r.hours < front[-1].hours:  # type: ignore[operator]
                front.append(r)
        return front

    def cheapest_plain(self) -> Rental | None:
        """The cheapest configuration whose plain step fits (no remat): what a plan on a
        cheaper card is set against."""
        plain = [r for r in self.fitting if r.fits_plain and r.cost is not None]
        return min(plain, key=lambda r: r.cost) if plain else None  # type: ignore[arg-type]

    def frame(self) -> Any:
        """The rows as a pandas DataFrame, ranked by cost (those that do not fit last)."""
        import pandas as pd

        return pd.DataFrame([r.to_dict() for r in self.ranked()])

    def ranked(self) -> list[Rental]:
        return sorted(self.rows, key=lambda r: (not r.fits, r.cost is None,
                                                r.cost if r.cost is not None else 0.0,
                                                r.hours if r.hours is not None else 0.0))

    def to_dict(self) -> dict:
        plain = self.cheapest_plain()
        pick = {by: self._best_or_none(by) for by in BY}
        return {"work": asdict(self.work), "seconds": self.seconds,
                "rows": [r.to_dict() for r in self.ranked()],
                "cheapest": pick["cost"], "fastest": pick["hours"],
                "pareto": [(r.card, r.count) for r in self.pareto()],
                "cheapest_plain": None if plain is None else (plain.card, plain.count)}

    def _best_or_none(self, by: str) -> tuple[str, int] | None:
        try:
            r = self.best(by)
        except ConfigError:
            return None
        return (r.card, r.count)


def rent(model: nn.Module, example: Batch, *, work: Work, step: Step | None = None,
         cards: Iterable[str | Target] | None = None, counts: Iterable[int] = COUNTS,
         prices: Mapping[str, Price | float] | None = None, **how: Any) -> RentResult:
    """Every card x count priced for `model`'s `step` on `example` (a batch, per rank; shapes
    only will do) doing `work` (module docstring). `cards`: profile names (default: every
    profile, `rematlab.PROFILES`), or `Target`s of cards with no profile (a PCIe or 96 GB
    variant: `rematlab.preflight.targets.resolve_target`); `counts`: data-parallel ranks,
    each its own card, spread by `step.layout` (its kind and settings, FSDP2 when it has
    none) at that world size; `prices`: per card, over the shipped table
    (`rematlab.planning.prices.PRICES`); a card with no price is priced in hours only.
    `how`: `largest` (default True) also finds the largest batch per rank and its throughput
    (more fake profiles per configuration); `verify` (default False) runs each rank's plan
    on a fake group of ranks, as `plan(..., predict=True)` checks it (about 10 s per
    candidate plan for an 8B model on this CPU), instead of taking the per-rank simulation,
    whose band covers its error; `progress(text)` is told each configuration as it starts."""
    unknown = set(how) - {"largest", "verify", "progress"}
    if unknown:
        raise ConfigError(f"rent() got unknown keyword(s) {sorted(unknown)}; it takes work, "
                          "step, cards, counts, prices, largest, verify and progress")
    largest, verify = how.get("largest", True), how.get("verify", False)
    progress: Callable[[str], None] | None = how.get("progress")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"rent() needs an nn.Module, got {type(model).__name__}")
    if not isinstance(work, Work):
        raise ConfigError(f"work must be a rematlab.planning.rent.Work, got {work!r}"[:200])
    step = step if step is not None else Step()
    if not isinstance(step, Step):
        raise ConfigError(f"step must be a rematlab.Step, got {type(step).__name__}")
    chosen = _cards(cards)
    wanted = _counts(counts)
    table = _prices(prices, {n for n, c in chosen.items() if isinstance(c, Target)})
    per_step = _work_per_step(example, step, work)
    job = _Job(model, example, work, per_step, largest, verify)
    started = time.perf_counter()
    rows = []
    with shared_runs():  # one fake run per batch and kind of card, reused for each card
        for count in wanted:
            for name, card in chosen.items():
                if progress is not None:
                    progress(f"{name} x {count}")
                rows.append(_priced(job, _step_for(step, count), name, card, count,
                                    table.get(name)))
    return RentResult(tuple(rows), work, time.perf_counter() - started)


def _cards(cards: Iterable[str | Target] | None) -> dict[str, str | Target]:
    """The cards by name: a profile's name, or a given target's own."""
    if cards is None:
        return {name: name for name in PROFILES}
    if isinstance(cards, str):
        cards = [c.strip() for c in cards.split(",")]
    out: dict[str, str | Target] = {}
    for card in cards:
        if isinstance(card, Target):
            if card.kind != "cuda":
                raise ConfigError(f"card {card.name!r} is a {card.kind} target; rent prices "
                                  "GPU cards")
            out[card.name] = card
        elif isinstance(card, str):
            out[card_name(card)] = card_name(card)
        else:
            raise ConfigError(f"a card is a profile name or a Target, got {card!r}"[:200])
    if not out:
        raise ConfigError("give at least one card")
    return out


def _counts(counts: Iterable[int]) -> list[int]:
    if isinstance(counts, (str, bytes)):
        raise ConfigError(f"counts must be whole numbers, got {counts!r}"[:200])
    out = [bounded("a card count", c, MAX_COUNT) for c in counts]
    if not out:
        raise ConfigError("give at least one card count")
    return sorted(set(out))


def _prices(prices: Mapping[str, Price | float] | None, custom: set[str]) -> dict[str, Price]:
    """The shipped table with `prices` over it; `custom`: the given targets' names, priced
    by name."""
    table = dict(PRICES)
    for name, value in (prices or {}).items():
        card = name if name in custom else card_name(name)
        table[card] = (value if isinstance(value, Price)
                       else Price(card, value, "given by the caller", ""))
    return table


def _step_for(step: Step, count: int) -> Step:
    """`step` over `count` ranks: no layout on one card; else the step's own layout (its
    dtypes and buckets; FSDP2's defaults when it has none) at that world size."""
    if count == 1:
        return replace(step, layout=None)
    base = step.layout if step.layout is not None else FSDP()
    return replace(step, layout=replace(base, world_size=count))


@dataclass(frozen=True)
class _Job:
    """What every configuration of one `rent` call shares."""

    model: nn.Module
    batch: Batch
    work: Work
    per_step: int  # tokens or samples of one rank's optimizer step
    largest: bool
    verify: bool


def _work_per_step(batch: Batch, step: Step, work: Work) -> int:
    """Tokens or samples one rank's optimizer step consumes: its batch (every micro-batch),
    times the sequence for tokens (the batch's first tensor is batch x sequence ids)."""
    first = next(tensors(batch), None)
    if first is None or first.dim() == 0:
        raise ConfigError("the example batch needs a tensor with a batch dimension")
    samples = first.shape[0] * step.micro_batches
    if work.unit == "samples":
        return samples
    if first.dim() != 2 or first.is_floating_point():
        raise ConfigError("work in tokens needs a batch of token ids (batch x sequence); "
                          "give the work in samples instead")
    return samples * first.shape[1]


def _priced(job: _Job, step: Step, name: str, card: str | Target, count: int,
            price: Price | None) -> Rental:
    """One configuration: planned for one rank on `card` (named `name`), timed, priced."""
    model, batch, work, per_step = job.model, job.batch, job.work, job.per_step
    kind = "one card" if count == 1 else step.layout.kind  # type: ignore[union-attr]
    cost_of = {"usd_per_hour": None if price is None else price.usd_per_hour,
               "price_source": None if price is None else price.source}
    try:
        planning = prepare(model, batch, predict=True, target=card, step=step,
                           verify=job.verify)
    except InfeasibleBudgetError as exc:
        return Rental(name, count, kind, fits=False, why=one_line(exc), **cost_of)
    limit = planning.budget("auto").nbytes
    least = with_margin(planning.floor)  # unverified, `floor_budget` is at least this
    if not job.verify and least > limit:  # so no replay is needed to refuse the card
        return Rental(name, count, kind, fits=False, budget=limit,
                      why=f"even the smallest plan's step needs at least {_gib(least)} GiB "
                          f"on a rank, the card offers {_gib(limit)} GiB", **cost_of)
    plain = planning.band(none_plan(planning.costs.n))
    try:
        chosen = planning.choose(limit)
    except InfeasibleBudgetError:
        return Rental(name, count, kind, fits=False, budget=limit,
                      why=f"even the smallest plan's step needs "
                          f"{_gib(planning.floor_budget())} GiB on a rank, the card "
                          f"offers {_gib(limit)} GiB", **cost_of)
    held = planning.band(chosen)
    seconds = simulate(chosen, planning.costs)[1]
    plain_s = simulate(none_plan(planning.costs.n), planning.costs)[1]
    per_s = per_step * count / seconds if seconds > 0 else None
    hours = work.amount / per_s / 3600 if per_s else None
    cost = (hours * count * price.usd_per_hour if hours is not None and price is not None
            else None)
    big, big_per_s = (_largest(job, step, card, count) if job.largest else (None, None))
    return Rental(name, count, kind, fits=True, fits_plain=plain.upper <= limit,
                  plan=chosen.describe(),
                  remat=chosen.recomputed > 0, recomputed=chosen.recomputed,
                  blocks=len(planning.structure.blocks),
                  peak=held.point, upper=held.upper, budget=limit, step_s=seconds,
                  overhead=overhead(seconds, plain_s), per_s=per_s, largest_batch=big,
                  largest_per_s=big_per_s, hours=hours, cost=cost, **cost_of)


def _largest(job: _Job, step: Step, card: str | Target, count: int
             ) -> tuple[int | None, float | None]:
    """The largest batch per rank whose optimal plan fits the card, and the job's tokens or
    samples per second at it (`max_batch`, predicted)."""
    found = max_batch(job.model, job.batch, "auto", predict=True, target=card, step=step,
                      cases=("optimal",), repeats=0, verify=job.verify)
    fit = found.fit("optimal")
    if not fit.batch or not fit.step_s:
        return fit.batch or None, None
    first = next(tensors(job.batch))
    scale = job.per_step / first.shape[0]  # tokens or samples per sample of the batch
    return fit.batch, fit.batch * scale * count / fit.step_s


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f}"


def cost_against_plain(result: RentResult, row: Rental) -> float | None:
    """`row`'s cost against the cheapest configuration that fits without remat (-0.4: 40 %
    cheaper); None when nothing fits plain or either has no price."""
    plain = result.cheapest_plain()
    if plain is None or row.cost is None or plain.cost in (None, 0):
        return None
    return row.cost / plain.cost - 1  # type: ignore[operator]
