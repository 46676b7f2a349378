"""torch's own op-level planner as a peer (issue 50, item 3): `sac_milp`, the MILP of
`torch.distributed._tools.sac_ilp`, over the statistics of its estimators (`MemTracker`,
`RuntimeEstimator`, `SACEstimator`), turned into a rematlab plan so that it runs, and is
measured, like every other candidate.

How it runs on this CPU, and what is shimmed:
- The estimators run on a fake twin of the model (`rematlab.preflight.fake`, as torch's own
  tests run them under `FakeTensorMode`), in the benchmark's step (bf16 autocast, AdamW):
  `MemTracker` over two steps (the second, with the optimizer's state, is the one kept),
  then one forward and backward under each of `RuntimeEstimator` and `SACEstimator`.
- Op times: both estimators offer "operator-level-benchmark", which runs each op on real
  tensors of its shape and times it between two CUDA events, or a roofline of the GPU's
  data sheet. Neither runs on a CPU, so the benchmark mode runs with CUDA's events replaced
  by the host clock (`_HostEvent`: a CPU kernel has finished when its call returns, so
  `perf_counter` around the calls times it). Nothing else of torch's code is changed.
- `sac_milp(graph, budget)` gets the same byte budget as rematlab, in GiB, over the layers
  as its AC units; it returns, per layer, the share of activation memory to discard.
  `get_optimal_checkpointing_policy_per_module` turns each share into torch's per-op
  decisions (save or recompute), which become a rematlab `Selective` item saving those ops
  by name and occurrence, as torchtitan's policy is run in `op_level_autocast`. A layer
  whose share is 1 is checkpointed whole; one not chosen keeps everything.
- A module backward never reaches (Llama's rotary embedding) gets its end-of-forward memory
  as its backward snapshots, which `MemTracker` has none of (`_no_backward_shim`).
- In-place chains (dropout's mask) are recomputed even where torch saves them: selective
  checkpointing refuses a cached tensor that an in-place op mutates (`_saves`).
- `sac_milp` bounds the peak by its own memory model (parameters, gradients, optimizer
  state, activations); the benchmark measures the plan's real peak, as for every candidate.
Needs `pulp` (the MILP) and `pwlf` (the piecewise-linear trade-off fit): `requirements.txt`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from unittest import mock

import torch

from rematlab.core.recipe import Step
from rematlab.plans.plan import Plan, Segment, Selective
from rematlab.preflight.fake import FakeSession

GIB = 2 ** 30
# its MILP logs each budget it finds infeasible as an error; the budget search asks for some
logging.getLogger("torch.distributed._tools.sac_ilp").setLevel(logging.CRITICAL)


class _HostEvent:
    """A CUDA event's interface on the host clock (module docstring)."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.at = 0.0

    def record(self, stream: object = None) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA's


@contextlib.contextmanager
def _host_timed() -> Iterator[None]:
    """torch's op benchmark, timed by the host clock: its events, stream and synchronisation
    are CUDA's, which a CPU build has none of."""
    with mock.patch.object(torch.cuda, "Event", _HostEvent), \
            mock.patch.object(torch.cuda, "current_stream", lambda *_a, **_k: None), \
            mock.patch.object(torch.cuda, "synchronize", lambda *_a, **_k: None):
        yield


def _no_backward_shim(tracker) -> None:
    """A module that autograd never reaches in backward (Llama's rotary embedding, which
    computes its tables without gradients) has no backward snapshots in `MemTracker`, and
    `aggregate_stats` reads them for every module: its backward is given its state at the
    end of its forward, which is what it holds through a backward it takes no part in."""
    from torch.distributed._tools.mem_tracker import _ModState

    for stats in tracker.memory_tracking.values():
        if _ModState.PRE_BW not in stats.snapshots:
            last = stats.snapshots[_ModState.POST_FW]
            stats.snapshots[_ModState.PRE_BW] = list(last)
            stats.snapshots[_ModState.PEAK_BW] = list(last)


class SacMilp:
    """The estimators' statistics of one model and step, and `plan(budget)`: sac_milp's
    choice at a byte budget as a rematlab plan over `planning`'s layers."""

    def __init__(self, model: torch.nn.Module, batch: object, step: Step, planning) -> None:
        from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed._tools.runtime_estimator import RuntimeEstimator
        from torch.distributed._tools.sac_estimator import SACEstimator

        self.planning = planning
        names = {m: name for name, m in model.named_modules()}
        # the layers, named as torch's module tracker names them: under the model's class
        self.units = [f"{type(model).__name__}.{names[b]}" for b in planning.structure.blocks]
        session = FakeSession()
        with session.active():
            fake, fake_batch = session.model(model), session.batch(batch)
            if getattr(getattr(fake, "config", None), "use_cache", False):
                fake.config.use_cache = False  # as checkpointed layers run: no cache to cat
            opt = step.make_optimizer(fake.parameters())
            tracker = MemTracker()
            tracker.track_external(fake, opt)
            with tracker:
                for i in range(2):  # the second step runs with the optimizer's state
                    step.train_step(fake, fake_batch, optimizer=opt, readable=False)
                    if i == 0:
                        tracker.reset_mod_stats()
            runtime, self.sac = RuntimeEstimator(), SACEstimator()
            with contextlib.redirect_stdout(None), _host_timed():
                with runtime("operator-level-benchmark"):
                    step.micro_batch(fake, fake_batch)
                with self.sac("operator-level-benchmark"):
                    step.micro_batch(fake, fake_batch)
        _no_backward_shim(tracker)
        self.graph = parse_module_info(aggregate_stats(fake, tracker, runtime, self.sac,
                                                       torch.device("cpu")))

    def fitting(self, budget: int, steps: int = 8) -> tuple[Plan, int, int] | None:
        """sac_milp's plan for the largest budget of its own whose measured peak is within
        `budget`, that budget and the peak; None where none is. Its memory model is not
        the measured step's (on a 2-layer GPT-2 of width 64 it puts keeping everything 36 %
        under the measured peak), so given `budget` as it is it keeps what does not fit;
        its budget is found by bisection (`steps` plans measured at most), as a user lowers
        it until the plan fits."""
        from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline

        lo, hi = 0, max(budget, get_peak_memory_runtime_baseline(self.graph)[0])
        asked, best = hi, None
        for _ in range(steps):
            plan = self.plan(asked)
            if plan is None:  # its MILPs find nothing this low
                lo = asked
            elif (peak := self.planning.measure(plan)) <= budget:
                best, lo = (plan, asked, peak), asked
                if asked == hi:
                    break
            else:
                hi = asked
            asked = (lo + hi) // 2
        return best

    def plan(self, budget: int) -> Plan | None:
        """sac_milp's plan within `budget` bytes by its own memory model, or None where its
        MILPs find none."""
        from torch.distributed._tools.sac_ilp import sac_milp

        discard, _, peak = sac_milp(self.graph, budget / GIB, world_size=1,
                                    ac_units=self.units)
        if peak < 0:
            return None
        n = self.planning.costs.n
        items: list = [0]
        for i, unit in enumerate(self.units, start=1):
            share = discard.get(unit, 0.0)
            if share <= 0.0:
                items.append(i)
            elif share >= 1.0:
                items.append(Segment(i, i + 1, (i,)))
            else:
                saves = self._saves(unit, share)
                if saves is None:
                    return None
                items.append(Selective(i, "sac_milp", saves, ""))
        return Plan(n, (*items, n - 1))

    def _saves(self, unit: str, share: float) -> tuple | None:
        """torch's per-op decisions for `unit` at `share` discarded, as (op, occurrence)
        saves: the ops `SACStats` lists, each named by its overload as rematlab's policy
        names it; None where torch's per-module MILP fails (it then returns no decision)."""
        from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP
        from torch.distributed._tools.sac_ilp import (
            SACDecision,
            get_optimal_checkpointing_policy_per_module,
        )

        stats = self.sac.sac_mod_stats[unit]
        decisions = get_optimal_checkpointing_policy_per_module(stats,
                                                                memory_budget=1.0 - share)
        if not decisions:
            return None
        # the forward's ops, as `SACStats` was made from them when the forward ended (the
        # metadata goes on growing through backward)
        funcs = [m.func for m in self.sac._sac_mod_metadata[unit].sac_metadata
                 if m.func not in OPS_TO_ALWAYS_SKIP][:len(stats.func_names)]
        assert [f._overloadpacket.__name__ for f in funcs] == stats.func_names
        # an in-place chain (dropout's `empty_like`, `bernoulli_`, `div_`) is recomputed even
        # where torch's MILP saves it: selective checkpointing cannot cache a tensor that an
        # in-place op mutates (autograd bumps its version above the dispatch mode, after the
        # cache took it, and the recomputation refuses it as mutated); the plan then holds
        # the chain's bytes less than torch planned, and recomputes a random mask (checkpoint
        # restores the RNG, so it is the same)
        chains = {i for pair in stats.inplace_ops for i in pair}
        counts: dict[str, int] = {}
        saves = []
        for i, (func, decision) in enumerate(zip(funcs, decisions, strict=True)):
            name = str(func)
            k = counts.get(name, 0)
            counts[name] = k + 1
            if decision == SACDecision.SAVE.value and i not in chains:
                saves.append((name, k))
        return tuple(saves)
