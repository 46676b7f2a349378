"""Which ops of a block an op-level option saves: the policy torch's selective checkpointing
asks op by op, eager and under torch.compile.

An option names the ops it saves by occurrence (`aten.mm.default` #2) and fingerprints the op
sequence it was made for, so that a plan made for other code is refused rather than silently
saving nothing. Eager, `SavePolicy` is asked as each op runs, and checked once the forward
returns. Under torch.compile the policy is asked while AOTAutograd traces the region (once per
trace, the recomputation never runs in Python: the partitioner duplicates the nodes tagged for
recompute), so `compiled_contexts` makes a fresh policy for every trace and checks it when the
traced forward ends. Dynamo accepts a `context_fn` only as a module-level function or a
`functools.partial` of one over constants: `compiled_context_fn` is that partial.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachingTorchDispatchMode,
    create_selective_checkpoint_contexts,
)

from rematlab.exceptions import ConfigError

Saves = tuple[tuple[str, int], ...]


def fingerprint(names: list[str]) -> str:
    """A short hash of an op sequence: a plan's options name ops by occurrence, so they are
    only valid for the sequence they were made for."""
    return hashlib.sha1("\n".join(names).encode()).hexdigest()[:16]


def metadata(func: Any) -> bool:
    """An op that reads metadata (`prim.device`, which fake tensors dispatch whenever Python
    asks for `.device`): no output to save, and how often it runs depends on the code that
    asks, so it is no part of an op sequence."""
    return func.namespace == "prim"


class SavePolicy:
    """The `policy_fn` of `create_selective_checkpoint_contexts` for one option: the ops in
    `saves` must be saved, every other op is recomputed. Occurrences are counted separately
    in the forward and in its recomputation; the forward's op sequence is kept so that
    `check` can refuse a plan made for other code. `record`, when given, is called with
    each forward op and its output (how the compiled menu learns the traced sequence): by
    the forward's mode (`_CheckedForward`), which sees the output on every torch; torch 2.11's
    policy is asked before the op runs, and its context has no `op_output`."""

    def __init__(self, saves: Saves, sequence: str, where: str,
                 record: Callable[[Any, Any], None] | None = None) -> None:
        self.saves = frozenset(saves)
        self.sequence = sequence  # `fingerprint` of the op sequence the option was made for
        self.where = where
        self.record = record
        self.seen: list[str] = []
        self._counts: dict[bool, Counter[str]] = {False: Counter(), True: Counter()}

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if metadata(func):
            return CheckpointPolicy.PREFER_RECOMPUTE
        name = str(func)
        counts = self._counts[ctx.is_recompute]
        key = (name, counts[name])
        counts[name] += 1
        if not ctx.is_recompute:
            self.seen.append(name)
        return (CheckpointPolicy.MUST_SAVE if key in self.saves
                else CheckpointPolicy.PREFER_RECOMPUTE)

    def check(self) -> None:
        """Refuse the plan when this forward ran other ops than the option was made for, or
        when the option saves an op (or an occurrence of one) the forward never ran: an
        edited plan would otherwise silently save nothing there and recompute it all."""
        if self.sequence and self.seen and fingerprint(self.seen) != self.sequence:
            raise ConfigError(
                f"the plan is stale: {self.where} ran {len(self.seen)} ops that do not match "
                "the op sequence its option was made for (the model or its input changed, "
                "or it was made for eager execution, not torch.compile, or the other way "
                "round); plan again")
        ran = self._counts[False]
        missing = sorted(f"{name}#{k}" for name, k in self.saves if k >= ran[name])
        if self.seen and missing:
            raise ConfigError(f"the plan saves ops {self.where} does not run "
                              f"({', '.join(missing[:4])}): it was edited or made for other "
                              "code; plan again")


class _CheckedForward(_CachingTorchDispatchMode):
    """Selective checkpointing's forward mode that checks its policy when the forward ends
    (under compile, the end of the traced forward: no Python runs after the compiled one),
    and hands the policy's `record` each op the policy named, with its output."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        named = len(self.policy_fn.seen)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.policy_fn.record is not None and len(self.policy_fn.seen) > named:
            self.policy_fn.record(func, out)
        return out

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if exc[0] is None:
            self.policy_fn.check()


_traces: list[list[tuple[Any, Any]]] | None = None  # set while `traced_ops` records


@contextlib.contextmanager
def traced_ops() -> Iterator[list[list[tuple[Any, Any]]]]:
    """Record the forward ops (op, output) each compiled option region traces, a list per
    trace: the compiled op sequence, which differs from eager's (dropout is one
    `native_dropout`, views are others), is what a compiled option must name."""
    global _traces
    previous, _traces = _traces, []
    try:
        yield _traces
    finally:
        _traces = previous


def compiled_contexts(saves: Saves, sequence: str, where: str) -> tuple:
    """The two dispatch modes of one traced region under `saves`, with a fresh policy (each
    AOTAutograd trace counts occurrences from the start)."""
    record = None
    if _traces is not None:
        _traces.append([])
        record = lambda func, out, into=_traces[-1]: into.append((func, out))  # noqa: E731
    policy = SavePolicy(saves, sequence, where, record)
    # torch's own pair (its storage's layout and its recompute mode vary between releases),
    # with the forward mode swapped for the checking one over the same storage
    forward, recompute = create_selective_checkpoint_contexts(policy)
    return _CheckedForward(policy, forward.storage), recompute


def compiled_context_fn(saves: Saves, sequence: str, where: str) -> Callable[[], tuple]:
    """The `context_fn` of an option's region under torch.compile: a partial dynamo keeps as
    a constant (it guards on the saves, so each option compiles its own graph)."""
    return functools.partial(compiled_contexts, saves, sequence, where)
