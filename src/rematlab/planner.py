"""Plan the fastest checkpointing of a model for a memory budget in bytes, and check it.

`plan` finds the model's chain, profiles its blocks (measured on the target device, or
predicted on the meta device), solves the dynamic programme once for every memory level and
picks the fastest plan whose simulated step peak fits the budget. On a real device it then
*measures* the plan's forward+backward peak (optimizer state allocated, parameters and
buffers left untouched) and, if the measurement exceeds the budget, tightens the budget by the
overshoot and picks again: the budget is honoured on measurement, not only in the model.

With `compile=True` the plan is made for `torch.compile(apply(model, plan))`: blocks are
profiled compiled and the plan is verified on the compiled step, whose fused kernels and
partitioner make a different trade-off than eager execution (see docs/design.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from rematlab.chain import compiled, compiling, find_chain, preserved, profile_chain
from rematlab.exceptions import ConfigError, InfeasibleBudgetError, parse_bytes
from rematlab.plans import ChainCosts, Plan, simulate
from rematlab.probes import LiveTensorTracker, allocator_trace
from rematlab.solver import Solution, solve
from rematlab.strategies import RematChain

_MAX_CORRECTIONS = 6


def plan(
    model: nn.Module,
    example_inputs: torch.Tensor,
    budget: str | int,
    *,
    device: str | torch.device | None = None,
    optimizer: str | None = "momentum",
    blocks: list[nn.Module] | None = None,
    predict: bool = False,
    verify: bool = True,
    compile: bool = False,
) -> Plan:
    """The fastest plan whose whole-step peak fits `budget` (bytes or '6GiB').

    `optimizer` (sgd, momentum, adam or None) adds its state and step to the peak. `predict`
    plans from meta-device costs (FLOPs stand in for time) without running the model.
    `compile` plans for running the plan under `torch.compile` (`torch.compile(apply(model,
    plan))`): blocks are profiled compiled and the peak is verified on the compiled step.
    Raises `InfeasibleBudgetError` carrying the smallest achievable peak.
    """
    chain = blocks if blocks is not None else find_chain(model, example_inputs).blocks
    dev = torch.device(device) if device is not None else example_inputs.device
    x = example_inputs.to(dev)
    costs = profile(chain, x, optimizer, predict=predict, compile=compile)
    return choose(chain, x, costs, parse_bytes(budget), verify=verify and not predict,
                  compile=compile)


def choose(chain: list[nn.Module], x: torch.Tensor, costs: ChainCosts, limit: int,
           verify: bool = True, compile: bool = False) -> Plan:
    """Solve over `costs` and pick the fastest plan under `limit`, checked by measurement
    on `x`'s device when `verify` (compiled when `compile`)."""
    solution = solve(costs)
    chosen = replace(solution.plan_for(limit), compiled=compile)
    if not verify:
        return chosen
    return _verified(chain, x, solution, chosen, limit, costs)


def profile(chain: list[nn.Module], x: torch.Tensor, optimizer: str | None,
            predict: bool = False, compile: bool = False) -> ChainCosts:
    device = torch.device("meta") if predict else x.device
    return profile_chain(chain, x, device=device, optimizer=optimizer, repeats=1 if
                         x.device.type == "cpu" else 3, compile=compile)


def _verified(chain: list[nn.Module], x: torch.Tensor, solution: Solution, chosen: Plan,
              limit: int, costs: ChainCosts) -> Plan:
    """Measure the chosen plan. Over the limit: tighten the target by the overshoot and pick
    again. Under it by a margin the model did not predict (compiled graphs save less than
    their blocks compiled alone): loosen the target by that margin and try the faster plan
    it allows. The fastest plan measured within the limit wins."""
    target, best = limit, None
    seen: set[str] = set()
    for _ in range(_MAX_CORRECTIONS):
        seen.add(chosen.describe())
        measured = measure_peak(chain, chosen, x, costs)
        if measured <= limit:
            if best is None or (chosen.predicted_time or 0) < (best.predicted_time or 0):
                best = replace(chosen, budget=limit, measured_peak=measured)
            target += (chosen.predicted_peak or measured) - measured
        else:
            target -= measured - limit
        try:
            chosen = replace(solution.plan_for(target), compiled=chosen.compiled)
        except InfeasibleBudgetError:
            break
        if chosen.describe() in seen or (best is not None and (chosen.predicted_time or 0)
                                         >= (best.predicted_time or 0)):
            break
    if best is not None:
        return best
    floor_plan = replace(solution.plan_for(solution.min_peak), compiled=chosen.compiled)
    raise InfeasibleBudgetError(limit, max(solution.min_peak,
                                           measure_peak(chain, floor_plan, x, costs)))


def measure_peak(chain: list[nn.Module], chosen: Plan, x: torch.Tensor,
                 costs: ChainCosts) -> int:
    """Measured peak of a training step under `chosen` (compiled if `chosen.compiled`):
    forward, loss and backward with the optimizer state's bytes allocated, then the optimizer
    step's peak from `costs` (which was measured on tensors shaped like the parameters).
    Parameters, buffers and RNG are restored."""
    remat = RematChain(chain, chosen)
    run = compiled(remat) if chosen.compiled else remat
    state = torch.empty(costs.state, dtype=torch.uint8, device=x.device)
    with preserved(remat), compiling():
        classes = max(1, costs.x[-1] // (x.shape[0] * x.element_size()))  # (B, classes) out
        labels = torch.randint(0, classes, (x.shape[0],), device=x.device)
        if chosen.compiled:  # compile forward and backward outside the measurement
            F.cross_entropy(run(x), labels).backward()
            for p in remat.parameters():
                p.grad = None
        # tensors (eager only: the tracker cannot see inside compiled code), and the allocator
        # for what kernels and compiled code allocate
        tracker = LiveTensorTracker()
        tracker.track([*remat.parameters(), *remat.buffers(), x, labels, state])
        base = tracker.live
        counting = contextlib.nullcontext() if chosen.compiled or x.device.type != "cpu" \
            else tracker
        with allocator_trace(x.device) as allocator, counting:
            F.cross_entropy(run(x), labels).backward()
        peak = max(tracker.peak, base + allocator.peak)
    del state
    return max(peak, costs.optimizer_peak)


def compare(costs: ChainCosts, budget: int | None = None) -> list[dict]:
    """Simulated peak and time of the fixed strategies (and the best uniform count that fits
    `budget`) on one chain: the rows of `rematlab plan`'s comparison table."""
    from rematlab.plans import none_plan, selective_plan, sqrt_plan, uniform_plan

    n = costs.n
    rows = []
    none_peak, none_time = simulate(none_plan(n), costs)
    uniform = [uniform_plan(n, k) for k in range(2, n + 1)]
    fitting = [p for p in uniform if budget is None or simulate(p, costs)[0] <= budget]
    best_uniform = min(fitting or uniform, key=lambda p: simulate(p, costs)[1] if fitting
                       else simulate(p, costs)[0])
    for p in (none_plan(n), best_uniform, sqrt_plan(n), selective_plan(costs)):
        peak, time = simulate(p, costs)
        rows.append({"strategy": p.name, "peak": peak, "time": time,
                     "overhead": time / none_time - 1.0, "peak_ratio": peak / none_peak,
                     "fits": budget is None or peak <= budget, "plan": p.describe()})
    return rows


class AutoRemat(nn.Module):
    """Plans on the first training batch and re-plans, cached per input shape, when the
    shape changes. Evaluation and no-grad calls run the model plainly."""

    def __init__(self, model: nn.Module, budget: str | int, *, optimizer: str | None = "momentum",
                 blocks: list[nn.Module] | None = None, predict: bool = False) -> None:
        super().__init__()
        self.model = model
        self.budget = parse_bytes(budget)
        self.optimizer = optimizer
        self.predict = predict
        self._blocks = blocks
        self.plans: dict[tuple, RematChain] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return self.model(x)
        key = (tuple(x.shape), x.dtype, x.device)
        if key not in self.plans:
            blocks = self._blocks or find_chain(self.model, x).blocks
            chosen = plan(self.model, x.detach(), self.budget, optimizer=self.optimizer,
                          blocks=blocks, predict=self.predict)
            self.plans[key] = RematChain(blocks, chosen)
        return self.plans[key](x)


def auto(model: nn.Module, budget: str | int, **kwargs) -> AutoRemat:
    """`model` wrapped so that every new input shape gets its own optimal plan."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"auto() needs an nn.Module, got {type(model).__name__}")
    return AutoRemat(model, budget, **kwargs)
