"""A block's op-level menu as torch.compile runs it.

Under torch.compile an option is a selective-checkpoint region that AOTAutograd traces and the
partitioner splits: the ops it sees are not eager's (dropout is one `native_dropout` where
eager runs `bernoulli_`, `div_` and `mul`; some views differ), and an option must name the
traced ops, counted as traced. So the menu is made from the compiled trace:

1. `compiled_ops` compiles the block once as a region that saves nothing and records, through
   the policy, every forward op traced: name, output bytes, view / in place / random, FLOPs.
   What only eager can tell (each op's seconds, whether autograd keeps its output) is carried
   over from the eager profile, matched op by op along the two sequences (`difflib`); an op
   eager does not run counts as free to recompute, not kept, and of no FLOPs.
2. `compiled_options` measures each save set of `ops.save_sets` on that sequence compiled, as
   `profile_block` measures a compiled block: saved bytes from the compiled graph's saved
   tensors, transient peaks from the allocator, median times of the compiled block. An option
   dynamo or inductor cannot compile is dropped from the menu with a warning; the plan goes on
   without it.
"""

from __future__ import annotations

import difflib
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from rematlab.core.steps import is_oom, preserved
from rematlab.plans.plan import Option, Selective
from rematlab.remat.block import BlockCost, compiled, profile_block
from rematlab.remat.ops import (
    OPTION_REPEATS,
    OpCost,
    block_options,
    describe_saves,
    profile_ops,
    run_option,
    save_sets,
    smaller,
    written_in_place,
)
from rematlab.remat.policy import fingerprint, traced_ops
from rematlab.remat.profiling import Profiling
from rematlab.remat.recompute import RecomputeStats

Run = Callable[[torch.Tensor], torch.Tensor]


def compiled_ops(module: nn.Module, run: Run, x_in: torch.Tensor, eager: list[OpCost]
                 ) -> list[OpCost]:
    """`module`'s forward ops as torch.compile traces its checkpointed region (see module
    docstring). Parameters, buffers and the input enter the traced region as its inputs,
    never as an op's output, so no output bytes are theirs."""
    traces = _traced(module, run, x_in)
    if not traces:  # dynamo reused a graph traced for a layer alike (its guards are on
        torch._dynamo.reset()  # shapes, not on which module): trace this one afresh
        traces = _traced(module, run, x_in)
    if not traces:
        raise RuntimeError("torch.compile traced no checkpointed region of the block")
    rows = traces[-1]  # every trace of one region sees the same sequence
    # traced tensors have no address; torch keeps one Python object per storage, and the
    # trace keeps every output alive: its identity tells which outputs (or views of them)
    # an op writes in place later
    written = written_in_place([func._schema.is_mutable for func, _ in rows],
                               [[id(t.untyped_storage()) for t in _tensors(out)]
                                for _, out in rows])
    eager_of = _matched([o.name for o in eager], [str(func) for func, _ in rows])
    counts: Counter[str] = Counter()
    ops = []
    for i, (func, out) in enumerate(rows):
        name = str(func)
        outs = _tensors(out)
        like = eager[eager_of[i]] if i in eager_of else None
        ops.append(OpCost(
            name=name, index=counts[name],
            out_bytes=sum(t.untyped_storage().nbytes() for t in outs),
            autograd_saves=like.autograd_saves if like is not None else False,
            view=func.is_view,
            inplace=written[i],
            random=torch.Tag.nondeterministic_seeded in func.tags,
            flops=like.flops if like is not None else 0.0,
            seconds=like.seconds if like is not None else 0.0))
        counts[name] += 1
    return ops


def _traced(module: nn.Module, run: Run, x_in: torch.Tensor) -> list[list[tuple]]:
    """The forward ops of each trace of `module`'s region compiled, saving nothing."""
    nothing = Selective(-1, "trace", (), "")
    with traced_ops() as traces, preserved(module):
        step = compiled(lambda x: run_option(nothing, module, run, RecomputeStats(),
                                             "profiling", x))
        step(x_in)  # the first call traces forward and backward together
    return traces


def _tensors(out: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def _matched(eager: list[str], traced: list[str]) -> dict[int, int]:
    """Traced op index -> the eager op it is, along the longest matching blocks of names."""
    pairs: dict[int, int] = {}
    matcher = difflib.SequenceMatcher(None, eager, traced, autojunk=False)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            pairs[block.b + k] = block.a + k
    return pairs


@dataclass(frozen=True)
class MenuBlock:
    """A block whose menu is made: the module, how it runs on one input (`run(x)`: a layer
    takes more arguments and may return a tuple), that input, the other tensors it takes
    (which are not its saved bytes), and its name in warnings."""

    module: nn.Module
    run: Run
    x_in: torch.Tensor
    others: list[torch.Tensor] | None = None
    where: str = "block"


def block_menu(block: MenuBlock, plain: BlockCost, how: Profiling) -> list[Option]:
    """`block`'s op-level menu against `plain`, its `profile_block` row: eager
    (`ops.block_options`; with `how.target`, priced on it), or as torch.compile runs it."""
    module, run, x_in, others = block.module, block.run, block.x_in, block.others
    if not how.compile:
        return block_options(module, run, x_in, plain, others, how.repeats, how.unit,
                             how.target)
    with preserved(module):
        eager = profile_ops(module, run, x_in, others, how.repeats)
    return compiled_options(block, plain, eager, how.repeats, how.unit)


def compiled_options(block: MenuBlock, plain: BlockCost, eager: list[OpCost],
                     repeats: int = 3, unit: int = 1) -> list[Option]:
    """The menu of `block` compiled (see module docstring): each save set measured under
    torch.compile against `plain`, the block's compiled `profile_block` row, from `eager`,
    its eager op profile."""
    module, run, x_in, others = block.module, block.run, block.x_in, block.others
    where = block.where
    ops = compiled_ops(module, run, x_in, eager)
    key = fingerprint([o.name for o in ops])
    menu = []
    for saves in save_sets(ops, compiled=True):
        item = Selective(-1, describe_saves(saves), saves, key)

        def selective(x: torch.Tensor, item: Selective = item) -> torch.Tensor:
            return run_option(item, module, run, RecomputeStats(), "profiling", x)

        try:
            with preserved(module):
                r = profile_block(module, x_in, max(repeats, OPTION_REPEATS), unit,
                                  run=selective, others=others, compile=True)
        except Exception as exc:  # whatever dynamo or inductor raises drops the option
            if is_oom(exc):
                raise
            why = getattr(exc, "inner_exception", None) or exc  # inductor's wrapped error
            first = str(why).strip().splitlines()[0] if str(why).strip() else ""
            warnings.warn(f"{where}: op-level option '{item.option}' dropped from the compiled "
                          f"menu: torch.compile cannot run it ({type(why).__name__}: {first})",
                          RuntimeWarning, stacklevel=2)
            continue
        menu.append(Option(name=item.option, saves=saves, saved=r.saved,
                           keeps_input=r.keeps_input, keeps_output=r.keeps_output,
                           fwd_mem=r.fwd_mem, bwd_mem=r.bwd_mem,
                           fwd_time=r.fwd_time, bwd_time=r.bwd_time, sequence=key))
    return smaller(menu, plain, unit)
