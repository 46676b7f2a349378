"""Plan the fastest checkpointing of a model for a memory budget in bytes, and check it.

`plan` finds the model's chain, profiles its blocks (measured on the device, or predicted
without running for a target device: `rematlab.preflight`), solves the dynamic programme once
for every memory level and picks the fastest plan whose simulated step peak fits the budget.
On a real device it then *measures* the plan's forward+backward peak (optimizer state
allocated, parameters and buffers left untouched) and, if the measurement exceeds the
budget, tightens the budget by the overshoot and picks again: the budget is honoured on
measurement, not only in the model. A predicted plan is not measured: it says so, for which
target, and gives its time as an interval (`Planning.interval`).

With `compile=True` the plan is made for `torch.compile(apply(model, plan))`: blocks are
profiled compiled and the plan is verified on the compiled step, whose fused kernels and
partitioner make a different trade-off than eager execution (see docs/design.md).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from rematlab.core.batch import check_batch, tensors, to_device
from rematlab.core.checks import one_line
from rematlab.core.precision import as_trained
from rematlab.core.recipe import Step
from rematlab.core.steps import is_oom, out_of_memory, runs_on
from rematlab.core.units import infeasible
from rematlab.distributed.engine import RankEngine, RankPeak
from rematlab.distributed.group import world_size
from rematlab.exceptions import ConfigError, OutOfMemory
from rematlab.planning import predicted as pred
from rematlab.planning.budget import DeviceBudget, checked, derive
from rematlab.planning.compiled import CompiledCandidates, choose_compiled
from rematlab.planning.oncard import OnCard
from rematlab.planning.options import PlanOptions, request
from rematlab.planning.ranks import adopt_sharded, for_rank, on_meta, profiled_model
from rematlab.planning.reserve import CardMemory
from rematlab.planning.verify import Baseline, measure_planned, planned_step, strategy_table
from rematlab.plans.fixed import none_plan
from rematlab.plans.plan import ChainCosts, Plan
from rematlab.plans.simulate import overhead, simulate
from rematlab.plans.solver import Solution, solve
from rematlab.preflight.cards import blas_resident, device_blas_workspace
from rematlab.preflight.targets import Target
from rematlab.remat.block import compiling
from rematlab.remat.chain import profile_chain
from rematlab.remat.compiled_budget import fresh_graphs, settings
from rematlab.remat.layer_costs import profile_layers
from rematlab.remat.profiling import Profiling
from rematlab.remat.structure import Structure, block_shapes, structure

_MAX_CORRECTIONS = 6  # measured misses before a choice jumps by the overshoot
COMPILED_TOLERANCE = 0.25  # compiled graphs save less than their blocks compiled alone
OOM = 1 << 62  # the measured peak of a step that ran out of memory: it fits no budget
RANK_TOLERANCE = 0.10  # a sharded rank's simulated peaks, within 10 % of its runs (ranks.py)


@dataclass
class Planning(OnCard):
    """One model at one batch, profiled and solved once; a plan for any budget from it.

    `prepare` finds the structure, moves the batch, profiles and solves; `choose(budget)`
    picks and (unless predicting) verifies by measurement; `baselines(budget)` simulates the
    fixed strategies side by side. `rematlab.plan`, `rematlab plan` and the study's planner
    stage all go through it."""

    model: nn.Module
    structure: Structure
    batch: Any
    costs: ChainCosts
    solution: Solution
    _: KW_ONLY  # how it was made, by name: no row of positional booleans
    verify: bool
    compile: bool
    step: Step  # the user's training step every cost and measurement is of
    target: Target | None = None  # predicted for this device (`rematlab.preflight`)
    ranks: RankEngine | None = None  # one rank of the step's layout (`planning.ranks`)
    compiled: CompiledCandidates | None = None  # compiled: measured candidates (`compiled`)
    _measured: dict[str, int] = field(default_factory=dict, repr=False)
    _cards: dict[str, CardMemory] = field(default_factory=dict, repr=False)

    @property
    def floor(self) -> int:
        """The model's smallest step peak (the measured floor can be higher)."""
        return self.solution.min_peak

    def floor_budget(self) -> int:
        """The smallest budget `choose` accepts: the floor plan's measured peak when
        verifying (the simulated floor can be below it; compiled, the smallest measured
        candidate's, torch.compile's fractions included), the simulated floor and its margin
        when predicted for a target (on a GPU target, at least the floor plan's reserved
        peak), else the simulated floor; what `InfeasibleBudgetError.min_peak` reports."""
        if not self.verify:
            if self.target is None:
                return self.floor
            upper = self._unverified_upper(self.solution.frontier[0])
            return max(pred.with_margin(self.floor), upper or 0)
        if self.ranks is not None:  # a rank's simulated costs are approximate; its run is not
            floor = self._measure_cached(self.solution.frontier[0])
            return floor if self.target is None else self._upper(floor, "rank")  # fake group
        floor = max(self.floor, self._measure_cached(self.solution.frontier[0]))
        lowest = self.compiled.floor() if self.compiled is not None else None
        return floor if lowest is None else min(floor, lowest)

    @property
    def full(self) -> int:
        """The simulated step peak with every activation kept."""
        return simulate(none_plan(self.costs.n), self.costs)[0]

    def budget(self, budget: str | int) -> DeviceBudget:
        """`budget` in bytes, with how it was derived (`derive`; for a predicted GPU
        target, what the target has: `target_budget`)."""
        return (pred.card_budget(budget, self.target)
                or derive(budget, self.model, self.batch))

    def interval(self, chosen: Plan) -> tuple[float, float]:
        """A predicted plan's step time at the fast and the slow end of the target's
        efficiencies (`ChainCosts.bound`); the point itself when the times were measured."""
        return (simulate(chosen, self.costs.bound(0))[1],
                simulate(chosen, self.costs.bound(1))[1])

    def overhead_interval(self, chosen: Plan) -> tuple[float, float]:
        """The plan's time over keeping everything, at either end of the interval (a ratio
        of two predictions at the same efficiency, so tighter than the times')."""
        plain = none_plan(self.costs.n)
        ends = [overhead(simulate(chosen, c)[1], simulate(plain, c)[1])
                for c in (self.costs.bound(0), self.costs.bound(1))]
        return (min(ends), max(ends))

    def choose(self, budget: str | int) -> Plan:
        """The fastest plan within `budget` (a size or 'auto'), measured unless predicting.

        Monotone in the budget: the plans considered for a budget are the floor plan and the
        frontier's plans whose simulated peak is within it (compiled: within `COMPILED_TOLERANCE`
        above it, since compiled graphs save less than their blocks compiled alone; one rank
        of a layout: within `RANK_TOLERANCE`, the per-rank simulation's error), tried
        fastest first, and the first whose *measured* peak fits wins. Measurements are cached
        on this object, so a larger budget only adds candidates: its plan is never slower.
        When the simulation underestimates a plan, the next-best plan is taken, not the
        floor. Compiled, the choice is the fastest measured candidate that fits, torch.compile's
        own memory budgets among them (`rematlab.planning.compiled`); predicted for a GPU
        target, the plan's reserved peak on the card fits too (`card`)."""
        limit = self.budget(budget).nbytes
        name = "per-layer optimal" if self.structure.kind == "layers" else "optimal"
        tolerance = (COMPILED_TOLERANCE if self.compile else
                     RANK_TOLERANCE if self.ranks is not None else 0.0)
        frontier = self.solution.frontier
        pool = [frontier[0], *(p for p in frontier[1:]
                               if (p.predicted_peak or 0) <= limit * (1 + tolerance))]
        if not self.verify:
            return self._predicted(limit, name)
        chosen = self._verified(pool, limit, name)
        if self.compiled is not None:  # the fastest measured compiled candidate
            picked = choose_compiled(self.compiled, chosen, limit)
            if picked is not None:
                return replace(self._named(picked[0], name, limit), measured_peak=picked[1])
        elif chosen is not None:
            return chosen
        raise infeasible(limit, self.floor_budget())

    def _predicted(self, limit: int, name: str) -> Plan:
        """A predicted plan keeps a margin free, since it is not measured; on a GPU target
        its reserved peak on the card fits too (stepping down by the overshoot)."""
        top = pred.room(limit) if self.target is not None else limit
        frontier = self.solution.frontier
        skip_above = None
        for candidate in reversed([p for p in frontier if (p.predicted_peak or 0) <= top]):
            if (skip_above is not None and (candidate.predicted_peak or 0) > skip_above
                    and candidate is not frontier[0]):
                continue
            reserved = self._reserved(candidate)
            upper = self._unverified_upper(candidate)
            if upper is None or upper <= limit:
                return replace(self._named(candidate, name, limit), reserved_peak=reserved)
            skip_above = (candidate.predicted_peak or 0) - (upper - limit)
        raise infeasible(limit, self.floor_budget())

    def _unverified_upper(self, chosen: Plan) -> int | None:
        """The upper end of an unverified plan's band on a GPU target: its reserved peak's
        on one card, its simulated peak's for one rank of a layout (no rank run); None
        for a CPU target."""
        if self.target is None or self.target.kind != "cuda":
            return None
        reserved = self._reserved(chosen)
        if reserved is not None:
            return self._upper(reserved, "card")
        if self.ranks is None:
            return None
        return self._upper(simulate(chosen, self.costs)[0], "rank")

    def _verified(self, pool: list[Plan], limit: int, name: str) -> Plan | None:
        """The first of `pool` (fastest first) whose measured peak fits; None if none."""
        skip_above = None  # after many misses, jump down by the overshoot (never past the floor)
        tried = 0
        for candidate in reversed(pool):
            if (skip_above is not None and (candidate.predicted_peak or 0) > skip_above
                    and candidate is not pool[0]):
                continue
            known = candidate.describe() in self._measured
            measured = self._measure_cached(candidate, limit)
            if self.target is not None:  # one rank run on a fake group: its band's upper end
                if self._upper(measured, "rank") <= limit:
                    return replace(self._named(candidate, name, limit),
                                   predicted_peak=measured)
            elif measured <= limit:
                return replace(self._named(candidate, name, limit), measured_peak=measured)
            tried += 0 if known else 1
            if tried >= _MAX_CORRECTIONS:
                skip_above = (candidate.predicted_peak or 0) - (measured - limit)
        return None

    @property
    def unconstrained(self) -> Plan:
        """The fastest plan with no budget (every activation kept where that is fastest)."""
        return self._named(self.solution.frontier[-1], "unconstrained", None)

    def curve(self) -> list[dict]:
        """The Pareto curve of budget against time: every frontier plan's simulated peak,
        time and overhead against keeping everything, fastest last (plus its measured peak
        where a `choose` already measured it). One solve serves every budget."""
        none_time = simulate(none_plan(self.costs.n), self.costs)[1]
        return [{"peak": p.predicted_peak, "time": p.predicted_time,
                 "overhead": overhead(p.predicted_time or 0.0, none_time),
                 "measured_peak": self._measured.get(p.describe()), "plan": p.describe()}
                for p in self.solution.frontier]

    def _named(self, chosen: Plan, name: str, limit: int | None) -> Plan:
        return replace(chosen, name=name, budget=limit, compiled=self.compile,
                       step=self.step.to_dict(),
                       shapes=tuple(block_shapes(b) for b in self.structure.blocks),
                       compile_settings=settings(chosen.fraction) if self.compile else None)

    def _measure_cached(self, chosen: Plan, limit: int | None = None) -> int:
        """`chosen`'s measured peak, once; a step that runs out of memory fits no budget
        (`OOM`), and when that step is the floor plan's, nothing does (`OutOfMemory`)."""
        key = chosen.describe()
        if key not in self._measured:
            try:
                if self.compiled is not None:  # a candidate too, timed when it fits `limit`
                    peak = self.compiled.peak(chosen, limit)
                    self._measured[key] = peak if peak is not None else OOM
                else:
                    self._measured[key] = self.measure(replace(chosen, compiled=self.compile))
            except Exception as exc:
                if not is_oom(exc):
                    raise
                self._measured[key] = OOM
                if key == self.solution.frontier[0].describe():
                    raise OutOfMemory(f"even the smallest plan's step ({key}) runs out of "
                                      f"memory on this device ({one_line(exc)})") from exc
        return self._measured[key]

    def rank(self, chosen: Plan) -> RankPeak:
        """`chosen`'s per-rank step peak under the step's layout and what held it at that
        moment (parameter shards, gathered parameters, optimizer state, ...): run on the
        job's ranks when measured, on a fake group of N ranks when predicted."""
        if self.ranks is None:
            raise ConfigError("a per-rank breakdown needs a parallel layout: "
                              "step=Step(layout=FSDP(...) or DDP(...))")
        return self.ranks.peak(chosen)

    def measure(self, chosen: Plan) -> int:
        """The measured step peak of `chosen` (see `step_peak`); under a layout, one rank's
        whole step, sharded (`RankEngine`: measured, or on a fake group when predicted)."""
        if self.ranks is not None:
            return self.ranks.peak(chosen).peak
        if chosen.compiled:  # its own graphs, as each candidate was measured (`compiled`)
            fresh_graphs()
        planned = planned_step(self.structure, self.model, chosen, self.batch)
        return measure_planned(planned, self.costs, self.step)

    def baselines(self, budget: int | None = None) -> list[Baseline]:
        """Simulated peak and time of the fixed strategies this model can run."""
        return strategy_table(self.costs, budget, per_layer=self.structure.kind == "layers")


def prepare(model: nn.Module, example_inputs: object, options: PlanOptions | None = None, *,
            step: Step | None = None, **keywords: Any) -> Planning:
    """Profile and solve once: `options` (`PlanOptions`) say how, `step` which training step
    (see `plan`); the options' names as keywords change them (`prepare(m, b, ops=True)`)."""
    check_batch(example_inputs)
    opts, user_step = request(options, step, keywords)
    model, user_step, source = adopt_sharded(model, user_step)  # fully_shard / DDP: read back
    model, example_inputs = as_trained(model, example_inputs, user_step.weights)  # "-true"
    if user_step.layout is not None:  # before any profiling: the ranks it is for
        if opts.compile:
            raise ConfigError("compiled plans under a parallel layout are not supported: "
                              "plan eager (compile=False)")
        world_size(user_step.layout, opts.predict)
    profiled = profiled_model(model, user_step)  # under a layout: in its param_dtype
    st = structure(profiled, example_inputs, opts.blocks)
    # a predicted plan, or one rank of a model too large for one (built on the meta device,
    # or sharded already): fake-tensor costs; under a layout, each candidate run on the ranks
    if opts.predict or (user_step.layout is not None and on_meta(model)):
        return _predicted(model, profiled, example_inputs, st, opts, user_step, source)
    return _measured(model, profiled, example_inputs, st, opts, user_step, source)


def _predicted(model: nn.Module, profiled: nn.Module, batch: object, st: Structure,
               opts: PlanOptions, step: Step, source: Any) -> Planning:
    """`prepare` from fake-tensor costs: a predicted plan, or one rank of a model too large
    for one device, each candidate then run on the ranks."""
    costs, tgt = pred.predicted_costs(profiled, batch, st, opts.device, step, opts.target,
                                      opts.ops, opts.offload)
    layers = st.kind == "layers"
    if step.layout is None:
        return Planning(model, st, batch, costs, solve(costs, layers=layers), verify=False,
                        compile=False, step=step, target=tgt)
    if not opts.predict and any(t.is_meta for t in tensors(batch)):
        raise ConfigError("a measured rank runs the batch: give real tensors (a batch of "
                          "shapes only is for predict=True)")
    tgt = tgt if opts.predict else None
    costs, engine = for_rank(model, profiled, batch, st, step, costs, tgt, source)
    return Planning(model, st, batch, costs, solve(costs, layers=layers), verify=opts.verify,
                    compile=False, step=step, target=tgt, ranks=engine)


def _measured(model: nn.Module, profiled: nn.Module, example_inputs: object, st: Structure,
              opts: PlanOptions, step: Step, source: Any) -> Planning:
    """`prepare` from costs measured on the device: each block profiled, the plan verified
    by measurement when chosen."""
    dev = (torch.device(opts.device) if opts.device is not None
           else next(tensors(example_inputs)).device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {dev} requested but CUDA/ROCm is not available")
    if dev.type == "meta":
        raise ConfigError("a model or batch on the meta device has no data: plan it with "
                          "predict=True (and a target)")
    batch = to_device(example_inputs, dev)
    how = Profiling(step, repeats=opts.repeats_on(dev), compile=opts.compile, ops=opts.ops,
                    offload=opts.offload)
    if opts.offload:
        pred.offloadable(st, step, dev, None)
    if st.kind == "layers":  # its first forward (`capture`) checks the batch
        with compiling(), out_of_memory("the profile (every activation kept, one layer "
                                        "at a time)"):
            costs = profile_layers(profiled, batch, st.blocks, how)
    else:
        with out_of_memory("the profile (every activation kept, one block at a time)"):
            if step.fn is None:  # a step function is tried on it by `profile_chain`
                runs_on(profiled, profiled, batch, type(model).__name__)
            costs = profile_chain(st.blocks, batch, how, device=dev)
    engine = None
    if step.layout is not None:
        costs, engine = for_rank(model, profiled, batch, st, step, costs, None, source)
    elif dev.type == "cuda":  # the BLAS workspaces the measured step holds (`StepMemory`)
        costs = pred.with_resident(costs, blas_resident(device_blas_workspace(dev)))
    solution = solve(costs, layers=st.kind == "layers")
    planning = Planning(model, st, batch, costs, solution, verify=opts.verify,
                        compile=opts.compile, step=step, ranks=engine)
    if opts.compile:  # torch.compile's own budget as candidates, each measured (`compiled`)
        planning.compiled = CompiledCandidates(planning, opts.fractions)
    return planning


def plan(
    model: nn.Module,
    example_inputs: object,
    budget: str | int,
    options: PlanOptions | None = None,
    **kwargs: Any,
) -> Plan:
    """The fastest plan whose whole-step peak fits `budget` (bytes, '6GiB', or 'auto': what
    this device has, `rematlab.planning.budget`).

    The step is the user's (`rematlab.core.steps`): `example_inputs` is a batch (tensor, tuple or
    dict; one micro-batch), the loss is `loss_fn(out, batch)`, the model's own `out.loss`, or a
    default, and the output stays alive until the step ends. `step=rematlab.Step(...)` says
    how the user's loop runs it (`rematlab.core.recipe`: bf16/fp16 autocast with a
    GradScaler, micro-batches per optimizer step, clipping, any `torch.optim` optimizer,
    `zero_grad(set_to_none=...)`, their own `fn(model, batch) -> loss`), and every cost and
    measured peak is then of that step. `options=PlanOptions(...)` (`planning.options`), or
    its fields as keywords: `optimizer` (a name from `core.optimizers.OPTIMIZERS`, or None)
    adds its state and step, rematlab's own step's shorthand for
    `step=Step(optimizer=...)`; `blocks` names the layers of a model that runs
    its own loop (see `rematlab.remat.structure`); `device`; `loss_fn`; `predict` plans
    without running anything, from fake-tensor costs and the roofline of `target` (a name such as
    "h100-80gb", "cpu" for this machine, a profile: `rematlab.preflight.targets`), for a
    model and batch that may live on the meta device; `verify=False` skips the
    measurement; `compile` plans for `torch.compile(apply(model, plan))` (chains and
    models that run their own layer loop), with torch.compile's `activation_memory_budget`
    at each of `fractions` as candidates too, each measured (`rematlab.planning.compiled`;
    dynamo's caches are reset while they are); `ops` also offers each block op-level options
    (save some ops' outputs, recompute the rest: `rematlab.remat.ops`), one per kept block.
    Raises `InfeasibleBudgetError` carrying the smallest achievable peak, which is itself a
    feasible budget for the same profile: keep `prepare(...)`'s `Planning` to choose again
    (a new profile on a busy machine can break a tie between equally small plans, which
    measure a few KiB apart, the other way).
    """
    budget = checked(budget)  # a bad budget fails before any profiling
    return prepare(model, example_inputs, options, **kwargs).choose(budget)
