"""Inside a block: the aten ops of its forward, and which of their outputs to save.

A block kept whole saves every tensor autograd needs; a block checkpointed whole saves only
its input. Between the two, torch's selective activation checkpointing
(`create_selective_checkpoint_contexts`) saves the outputs of chosen ops and recomputes the
rest during backward. What is worth saving differs by orders of magnitude: a matmul is costly
to run again, the pointwise ops around it are not, and their outputs are as large.

`profile_ops` records a block's forward op by op under a dispatch mode: each op's name and
occurrence, output bytes, whether autograd saves the output, whether it is a view, in place
or random, its FLOPs and its time. `save_sets` turns that into a small menu of save sets: the
named policies users know ("save matmuls", in the spirit of torchtitan's op-level SAC, which
saves `aten.mm` and the attention kernels' outputs but recomputes every second `mm`;
"recompute the attention core", as Megatron's selective recompute) and greedy ones that
recompute the ops cheapest per byte first. `SavePolicy` applies one, counting occurrences in
forward and in recompute alike, and refuses a plan made for another op sequence
(`fingerprint`) or one that saves ops the block never runs.

Random ops are never saved: the recomputation replays the RNG from the region's start, and
every random op must run again for the replayed stream to line up.
"""

from __future__ import annotations

import contextlib
import statistics
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rematlab.core.dispatch import OpCall, OpRecorder
from rematlab.core.probes import LiveTensorTracker, rounded, storage_key
from rematlab.core.steps import Phases, block_step, preserved
from rematlab.core.timer import time_block
from rematlab.exceptions import ConfigError
from rematlab.plans.fixed import TORCHTITAN_OP
from rematlab.plans.plan import Option, Selective
from rematlab.preflight.pricing import backward_interval, interval, selective_seconds
from rematlab.preflight.roofline import OpLog, logged
from rematlab.preflight.targets import Target
from rematlab.remat.activations import activations, run_modules, short_module, submodule_seconds
from rematlab.remat.block import BlockCost
from rematlab.remat.policy import SavePolicy, compiled_context_fn, fingerprint, metadata
from rematlab.remat.recompute import RecomputeStats, selective_contexts

SDPA = ("aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default")
MATMULS = frozenset(("aten.mm.default", "aten.addmm.default", "aten.bmm.default",
                     "aten.baddbmm.default", "aten.convolution.default", *SDPA))
# Megatron's "attention core": scores, softmax, dropout and the product with the values
ATTENTION_CORE = frozenset(("aten.bmm.default", "aten.baddbmm.default", "aten._softmax.default",
                            "aten._safe_softmax.default", *SDPA))
# torchtitan's op-level selective AC (`_save_list` of `torchtitan/parallelisms/
# parallelize_llama.py` at 9dec370, the commit of its 2024-12 H100 benchmarks): the option
# named `TORCHTITAN_OP` saves these ops' outputs, except every second `aten.mm` (2nd, 4th, ...)
TORCHTITAN_SAVE_LIST = frozenset(("aten.mm.default",
                                  "aten._scaled_dot_product_efficient_attention.default",
                                  "aten._scaled_dot_product_flash_attention.default",
                                  "_c10d_functional.reduce_scatter_tensor.default",
                                  "aten.abs.default", "aten.max.default"))
OPTION_REPEATS = 3  # an option's times decide against whole-block checkpointing: not one run
GREEDY_FRACTIONS = (0.5, 0.8)  # of the kept non-matmul bytes given back, cheapest first


@dataclass(frozen=True)
class OpCost:
    """One aten op of a block's forward, in call order (`index`: its occurrence by name).
    `inplace`: its output is written in place, by this op or a later one (a saved copy
    would be stale: selective checkpointing refuses to cache it)."""

    name: str
    index: int
    out_bytes: int
    autograd_saves: bool  # autograd keeps this output for backward (Option.saved is bytes)
    view: bool
    inplace: bool
    random: bool
    flops: float
    seconds: float


class _Rows:
    """An `OpRecorder` listener that keeps every aten op a forward runs: name, outputs,
    flags, FLOPs and the call (its seconds; with a `target`, the op priced on its roofline
    instead). On CUDA the recorder times each op's kernels between two events, read once
    the forward ends (`OpRecorder.finish`)."""

    def __init__(self, target: Target | None = None) -> None:
        self.target = target
        self.rows: list[tuple] = []
        self.calls: list[OpCall] = []

    def on_op(self, call: OpCall) -> None:
        func = call.func
        if metadata(func):
            return
        if self.target is not None:
            op = logged(call)
            call.seconds = interval([op], self.target)[1] if op is not None else 0.0
        self.calls.append(call)
        self.rows.append((str(func), call.outs, func.is_view, func._schema.is_mutable,
                          torch.Tag.nondeterministic_seeded in func.tags, call.flops))


def profile_ops(module: nn.Module, run: Callable[[torch.Tensor], torch.Tensor],
                x_in: torch.Tensor, others: list[torch.Tensor] | None = None,
                repeats: int = 3, target: Target | None = None) -> list[OpCost]:
    """`module`'s forward (`run(x_in)`) op by op (see module docstring). Saved outputs are
    those autograd's saved-tensor hooks see, parameters, buffers and inputs excluded; times
    are the median over `repeats` forwards (the module's state and RNG restored), or with a
    `target` (a fake twin, `rematlab.preflight`) each op's roofline time from one forward."""
    if target is not None:
        repeats = 1
    mine = {storage_key(t) for t in [*module.parameters(), *module.buffers(), x_in,
                                     *(others or ())]}
    saved: set[tuple[str, int]] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(storage_key(t))
        return t

    timings: list[list[float]] = []
    rows: list[tuple] = []
    for r in range(max(1, repeats)):
        rows_of = _Rows(target)
        recorder = OpRecorder(rows_of, timing=None if target is not None else
                              "events" if x_in.device.type == "cuda" else "host")
        # saved storages are read in the first run only: storage keys are addresses, which a
        # later run may reuse for tensors the first run did not save
        hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if r == 0
                 else contextlib.nullcontext())
        with preserved(module), hooks:
            with recorder:
                out = run(x_in)
            recorder.finish()
            del out
        if r == 0:
            rows = [(*row[:1], [(storage_key(t), rounded(t.untyped_storage().nbytes(), 1))
                                for t in row[1]], *row[2:]) for row in rows_of.rows]
        timings.append([call.seconds for call in rows_of.calls])
    written = written_in_place([row[3] for row in rows], [[k for k, _ in row[1]] for row in rows])
    counts: Counter[str] = Counter()
    ops = []
    for i, (name, outs, view, _, random, flops) in enumerate(rows):
        ops.append(OpCost(
            name=name, index=counts[name],
            out_bytes=sum(b for key, b in outs if key not in mine),
            autograd_saves=any(key in saved and key not in mine for key, _ in outs),
            view=view, inplace=written[i],
            random=random, flops=flops,
            seconds=statistics.median(t[i] for t in timings if len(t) == len(rows))))
        counts[name] += 1
    return ops


def written_in_place(mutable: list[bool], outputs: list[list[Hashable]]) -> list[bool]:
    """Per op of a forward (`mutable`: the op writes in place; `outputs`: its outputs'
    storage keys), whether its output is written in place, by the op itself or by a later
    one: a saved copy would be stale, and selective checkpointing refuses to cache it."""
    written = {key for m, keys in zip(mutable, outputs, strict=True) if m for key in keys}
    return [m or any(key in written for key in keys)
            for m, keys in zip(mutable, outputs, strict=True)]


def short(name: str) -> str:
    """A readable op name: `aten.mm.default` -> `mm`, any fused attention -> `sdpa`."""
    return "sdpa" if name in SDPA else name.split(".")[1].lstrip("_")


def describe_saves(saves: tuple[tuple[str, int], ...]) -> str:
    """`save mm×4, sdpa`: what an option keeps, counted by op (the four most frequent ops,
    then how many more kinds)."""
    counts = Counter(short(name) for name, _ in saves).most_common()
    shown = ", ".join(f"{op}×{k}" if k > 1 else op for op, k in counts[:4])
    return "save " + shown + (f" +{len(counts) - 4} more" if len(counts) > 4 else "")


def save_sets(ops: list[OpCost], compiled: bool = False) -> list[tuple[tuple[str, int], ...]]:
    """The menu's save sets, distinct, none empty (the block checkpointed whole) nor, eager,
    equal to keeping what autograd keeps (the block kept plainly; compiled, the partitioner
    keeps other tensors, and saving exactly those outputs is an option of its own):
    - save matmuls: every matmul's output is kept, even one autograd does not keep (a
      recomputed op then starts from it instead of running the matmul again), the rest is
      recomputed (torchtitan's op-level SAC saves `aten.mm` only, and recomputes every second
      one: a cheaper cousin, not this set);
    - recompute the attention core: keep what autograd keeps and the matmuls, except the
      scores, softmax and attention products (Megatron's selective recompute);
    - between the two, greedy: the matmuls and the outputs autograd keeps that are dearest
      to recompute per byte, until a fraction of those outputs' bytes is given back."""
    cacheable = [o for o in ops if o.out_bytes > 0 and not (o.view or o.inplace or o.random)]
    matmuls = {(o.name, o.index) for o in cacheable if o.name in MATMULS}
    kept = [o for o in cacheable if o.autograd_saves and o.name not in MATMULS]
    autograd = {(o.name, o.index) for o in cacheable if o.autograd_saves}
    sets = [matmuls]
    if any(o.name in ATTENTION_CORE for o in cacheable):
        sets.append({(o.name, o.index) for o in cacheable if o.name not in ATTENTION_CORE
                     and ((o.name, o.index) in matmuls or o.autograd_saves)})
    dearest = sorted(kept, key=lambda o: o.seconds / o.out_bytes, reverse=True)
    total = sum(o.out_bytes for o in kept)
    for fraction in GREEDY_FRACTIONS:
        chosen, held = set(matmuls), 0
        for o in dearest:
            if held + o.out_bytes > (1 - fraction) * total:
                break
            held += o.out_bytes
            chosen.add((o.name, o.index))
        sets.append(chosen)
    order = {(o.name, o.index): i for i, o in enumerate(ops)}
    out: list[tuple[tuple[str, int], ...]] = []
    for chosen in sets:
        ordered = tuple(sorted(chosen, key=order.__getitem__))
        if chosen and (compiled or chosen != autograd) and ordered not in out:
            out.append(ordered)
    return out


def torchtitan_saves(ops: list[OpCost]) -> tuple[tuple[str, int], ...]:
    """The outputs torchtitan's op-level selective AC saves in a forward of `ops`: every op
    of its save list, but only the odd-numbered `aten.mm` calls (its policy counts each mm
    and recomputes those whose count is even); empty when the block runs none of them."""
    return tuple((o.name, o.index) for o in ops
                 if o.name in TORCHTITAN_SAVE_LIST and o.out_bytes > 0
                 and not (o.name == "aten.mm.default" and o.index % 2 == 1))


def block_options(module: nn.Module, run: Callable[[torch.Tensor], torch.Tensor],
                  x_in: torch.Tensor, plain: BlockCost, others: list[torch.Tensor] | None = None,
                  repeats: int = 3, unit: int = 1, target: Target | None = None
                  ) -> list[Option]:
    """The menu of `module`: each save set of `save_sets`, run under selective checkpointing
    and measured like a plain block (`option_costs`); options that hold no less than the
    block kept plainly (`plain`: its `profile_block` row) are dropped. With a `target`, the
    block is a fake twin: bytes as measured, times the target's roofline."""
    ops = profile_ops(module, run, x_in, others, repeats, target)
    key = fingerprint([o.name for o in ops])
    sets = save_sets(ops)
    titan = torchtitan_saves(ops)  # the peer's own policy, priced like the others
    items = [Selective(-1, TORCHTITAN_OP if saves == titan else describe_saves(saves),
                       saves, key) for saves in sets]
    if titan and titan not in sets:
        items.append(Selective(-1, TORCHTITAN_OP, titan, key))
    acts = activations(module)
    if acts:  # the block kept, its activation functions recomputed (no dispatch mode)
        items.append(Selective(-1, "recompute " + ", ".join(short_module(n) for n in acts),
                               (), key, acts))
    menu = [option_costs(module, run, x_in, item, others, max(repeats, OPTION_REPEATS), unit,
                         target) for item in items]
    # an op-level option runs the same forward, and in backward the block's backward plus
    # the ops it recomputes: never less than that, whatever a short timing says (noise would
    # otherwise buy memory for nothing); a module-level one keeps the block's input as the
    # block kept plainly does
    again = (submodule_seconds(module, acts, run, x_in, max(repeats, OPTION_REPEATS))
             if acts and target is None else 0.0)
    return smaller([replace(o, bwd_time=max(o.bwd_time, plain.bwd_time
                                            + _recomputed(ops, o.saves))) if o.saves
                    else replace(o, keeps_input=plain.keeps_input,
                                 bwd_time=max(o.bwd_time, plain.bwd_time + again))
                    for o in menu], plain, unit)


def smaller(menu: list[Option], plain: BlockCost, unit: int) -> list[Option]:
    """`menu` named apart (plans name options: two summaries alike get a number), each no
    faster than the block kept plainly (`plain`: its `profile_block` row), and without the
    options that hold no less than that block."""
    x, out = plain.x, rounded(plain.out.untyped_storage().nbytes(), unit)

    def held(saved: int, keeps_input: bool, keeps_output: bool) -> int:
        return saved + x * keeps_input + out * keeps_output

    limit = held(plain.saved, plain.keeps_input, plain.keeps_output)
    seen: Counter[str] = Counter()
    named = []
    for o in menu:
        seen[o.name] += 1
        named.append(replace(o, name=o.name if seen[o.name] == 1 else f"{o.name} #{seen[o.name]}",
                             fwd_time=max(o.fwd_time, plain.fwd_time),
                             bwd_time=max(o.bwd_time, plain.bwd_time)))
    return [o for o in named if held(o.saved, o.keeps_input, o.keeps_output) < limit]


def _recomputed(ops: list[OpCost], saves: tuple[tuple[str, int], ...]) -> float:
    """Seconds of the forward ops an option runs again in backward (those not saved)."""
    kept = set(saves)
    return sum(o.seconds for o in ops if (o.name, o.index) not in kept)


def option_costs(module: nn.Module, run: Callable[[torch.Tensor], torch.Tensor],
                 x_in: torch.Tensor, item: Selective, others: list[torch.Tensor] | None = None,
                 repeats: int = 3, unit: int = 1, target: Target | None = None) -> Option:
    """One option's (`item`'s) costs, measured: held bytes (besides the input, which the
    checkpoint keeps, and the output, unless it is among the saved), the forward and
    backward peaks under the live-tensor tracker, and median times by the one timer (with a
    `target`, the roofline's for the ops the forward and the backward ran)."""
    def selective(x: torch.Tensor) -> torch.Tensor:
        return run_option(item, module, run, RecomputeStats(), "profiling", x)

    tracked = OptionRun(unit, target is not None)
    tracked.tracker.track([x_in, *module.parameters(), *module.buffers(), *(others or ())])
    with preserved(module):
        block_step(selective, x_in, tracked)
    if tracked.logs is not None:  # an option's forward and replay pay the dispatch mode
        logs = tracked.logs
        host = selective_seconds(logs[0].ops, target) if item.saves else 0.0
        fwd_time = interval(logs[0].ops, target)[1] + host
        bwd_time = backward_interval(logs[1].ops, tracked.like, target)[1] + host
    else:
        # the tracked run above was the warm-up
        fwd_time, bwd_time = (time_block(selective, x_in, repeats) if repeats
                              else (0.0, 0.0))
    out_bytes, keeps_output = tracked.out_bytes, tracked.keeps_output
    return Option(name=item.option, saves=item.saves,
                  saved=max(0, tracked.held - (out_bytes if keeps_output else 0)),
                  keeps_input=True, keeps_output=keeps_output, fwd_mem=tracked.fwd_mem,
                  bwd_mem=max(0, tracked.bwd_mem), fwd_time=fwd_time, bwd_time=bwd_time,
                  sequence=item.sequence, modules=item.modules)


class OptionRun(Phases):
    """An option's tracked forward and backward (`block_step`'s phases): the live-storage
    tracker around both, the roofline's logs with a target; what the option holds once the
    forward ends (the output dropped: autograd keeps it only if the option saves it)."""

    def __init__(self, unit: int, logged: bool) -> None:
        self.tracker = LiveTensorTracker(unit=unit)
        self.logs = (OpLog(), OpLog()) if logged else None
        self.fwd_mem = self.bwd_mem = self.held = self.out_bytes = 0
        self.keeps_output = False

    def _watched(self, i: int) -> OpRecorder:
        return OpRecorder(self.tracker, *([self.logs[i]] if self.logs else []))

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self._before = self.tracker.live
        with self._watched(0):
            yield

    def forwarded(self, out: torch.Tensor) -> None:
        self.fwd_mem = self.tracker.peak - self._before
        self.out_bytes = rounded(out.untyped_storage().nbytes(), self.tracker.unit)
        self.like = torch.empty_like(out, device="meta")  # its shape (`backward_interval`)
        self._alive = weakref.ref(out.untyped_storage())

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        tracker = self.tracker  # the loss is made and the output dropped by now
        self.held = tracker.live - self._before
        self.keeps_output = self._alive() is not None
        tracker.reset_peak()
        before_bwd = tracker.live
        with self._watched(1):
            yield
        self.bwd_mem = tracker.peak - before_bwd - self.out_bytes


def run_option(item: Selective, module: nn.Module, fn: Callable, stats: RecomputeStats,
               where: str, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` — `module`'s forward — under `item`'s option: selective
    checkpointing with rematlab's recompute context, the op sequence checked against the
    plan's. The one way options run (chains, models' own loops, profiling). Under
    torch.compile the region is traced with a fresh policy per trace, checked as the traced
    forward ends (`rematlab.remat.policy`); recomputation is then the partitioner's, in the
    compiled backward, which rematlab's recompute clock does not see."""
    if item.modules:
        if torch.compiler.is_compiling():
            raise ConfigError(f"{where}: a module-level option ({item.option}) runs eager; "
                              "plan with compile=True for a compiled step")
        return run_modules(item, module, fn, stats, where, *args, **kwargs)
    if torch.compiler.is_compiling():
        return checkpoint(fn, *args, use_reentrant=False, **kwargs,
                          context_fn=compiled_context_fn(item.saves, item.sequence, where))
    policy = SavePolicy(item.saves, item.sequence, where)
    out = checkpoint(fn, *args, use_reentrant=False, **kwargs,
                     context_fn=selective_contexts(stats, [module], policy))
    policy.check()
    return out
