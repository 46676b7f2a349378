"""What the profilers (`remat.chain.profile_chain`, `remat.layer_costs.profile_layers`) are
asked to measure: one resolved object, made from the user's `planning.options.PlanOptions`
and the device (`Profiling`), so that each profiler takes one argument instead of a copy of
the planning keywords."""

from __future__ import annotations

from dataclasses import dataclass, field

from rematlab.core.recipe import Step
from rematlab.preflight.targets import Target

# refused wherever it is asked (`planning.options.PlanOptions`, the profilers), in these words
COMPILED_NOT_PREDICTED = ("compiled costs must be measured: compile=True (--compile) cannot "
                          "be combined with predict=True (--predict)")
# refused in these words: offload's hooks and streams run eagerly, which dynamo would trace
# through or break at (pytorch #116221: saved-tensor hooks silently wrong under compile)
COMPILED_NOT_OFFLOADED = ("offload=True (--offload) plans an eager step: its saved-tensor "
                          "hooks and copy streams are not traced by torch.compile; plan "
                          "with compile=False, or compile without offload")


@dataclass(frozen=True)
class Profiling:
    """How a model is profiled: for which step (`rematlab.core.recipe.Step`; rematlab's own
    by default), with how many timed repeats (0: not timed), compiled or not, with op-level
    menus or not, with offload options or not (`rematlab.plans.offload`), and for which
    pre-flight target (None: measured here). `unit`: the
    allocator's block size every byte count is rounded to (a target's own: 512 on CUDA)."""

    step: Step = field(default_factory=Step)
    repeats: int = 1
    compile: bool = False
    ops: bool = False
    offload: bool = False
    target: Target | None = None
    unit: int = 1

    def __post_init__(self) -> None:
        if self.target is not None:
            object.__setattr__(self, "unit", self.target.unit)
