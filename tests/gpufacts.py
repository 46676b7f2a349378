"""GPU facts as data (issue 49): what a GPU measured, kept as versioned JSON under
`tests/data/gpu/<card>-torch<version>/facts.json`, and replayed by every CPU test run
(`tests/test_gpu_facts.py`), so that GPU truth outlives the rare GPU session.

`scripts/gpu_record.py` writes a fact file on a GPU (or, in its CPU dry run, on this CPU in
the same format); `scripts/gpu_preflight.py` builds the same models. A fact file holds:

- `card`: name, data-sheet profile, compute capability, driver and CUDA versions, total memory;
  `torch`, `transformers`, when and how it was recorded;
- `context`: the CUDA context measured per model process (bytes);
- `models`: name -> the builder (`MODELS`) and its keyword arguments, and the step (`STEP`);
- `plans`: per model, each plan measured (`Plan.describe`), its allocated and reserved peak;
- `layers` (optional): per model and precision, per layer, the aten ops dispatched in its
  forward (names, in order) and the bytes autograd saved for backward;
- `options` (optional): per model, its first layer's op-level menu as the planner measured it
  under the step (`option_facts`): the plain layer's saved bytes and times, and each option's
  saves or recomputed submodules, saved bytes and times (issue 50).

A new fact file from any GPU tightens the tests with no code change.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from rematlab.core.recipe import Step
from rematlab.measurement import zoo
from rematlab.planning.planner import Planning, prepare
from rematlab.preflight.targets import Target
from tests import realzoo

FORMAT = 1
ROOT = Path(__file__).parent / "data" / "gpu"


def _vgg16(batch: int) -> tuple[torch.nn.Module, torch.Tensor]:
    model, shape, _ = zoo.resolve("vgg16", "cifar")
    return model, torch.randn(batch, *shape)


# the models the facts were measured on: builders of the tests' zoo at the sizes given
MODELS: dict[str, Callable[..., tuple[torch.nn.Module, object]]] = {
    "gpt2": realzoo.gpt2, "bert": realzoo.bert, "llama": realzoo.llama,
    "resnet": realzoo.resnet, "vgg16": _vgg16}
# the sizes `gpu_preflight` measures on a GPU, and at the smallest sizes (its dry run)
SIZES = {"gpt2": dict(batch=8, seq=512, layers=6, width=1024),
         "bert": dict(batch=8, seq=512, layers=6, width=2048),
         "llama": dict(batch=8, seq=512, layers=4, width=4096),
         "vgg16": dict(batch=64), "resnet": dict(batch=64, size=64)}
SMALL = {"gpt2": dict(batch=4, seq=32, layers=2, width=64),
         "bert": dict(batch=4, seq=32, layers=2, width=64),
         "llama": dict(batch=4, seq=32, layers=2, width=64),
         "vgg16": dict(batch=4), "resnet": dict(batch=8, size=16)}


def step() -> Step:
    """The step every fact is of: the user's bf16 autocast step with AdamW."""
    return Step(precision="bf16", optimizer=torch.optim.AdamW)


def build(name: str, kwargs: dict) -> tuple[torch.nn.Module, object]:
    """The model `name` at `kwargs`, seeded, in training mode."""
    torch.manual_seed(0)
    model, batch = MODELS[name](**kwargs)
    return model.train(), batch


_PLANNED: dict[tuple, Planning] = {}


def planned(name: str, kwargs: dict, target: Target) -> Planning:
    """Pre-flight of the fact model `name` at `kwargs` for `target` under the facts' step,
    made once per session: the replay of the facts and their bands read the same one."""
    key = (name, json.dumps(kwargs, sort_keys=True), repr(target))
    if key not in _PLANNED:
        built, batch = build(name, kwargs)
        _PLANNED[key] = prepare(built, batch, predict=True, target=target, step=step())
    return _PLANNED[key]


def load(path: Path) -> dict:
    """A fact file, refused when its format is not this code's."""
    facts = json.loads(path.read_text())
    if facts.get("format") != FORMAT:
        raise ValueError(f"{path}: fact format {facts.get('format')!r}, this code reads "
                         f"{FORMAT}")
    return facts


def fact_files() -> list[Path]:
    """The committed fact files, or the folder `REMATLAB_FACTS` names (`gpu_check.sh` replays
    the facts it has just recorded)."""
    folder = os.environ.get("REMATLAB_FACTS")
    return [Path(folder) / "facts.json"] if folder else sorted(ROOT.glob("*/facts.json"))


def layer_facts(model: torch.nn.Module, batch: object, step: Step, device_type: str
                ) -> list[dict]:
    """Per layer of `model` (its `rematlab` structure's blocks), the aten ops its forward
    dispatches, in order (views left out), and the bytes autograd saves for backward, in
    one forward of `step`'s autocast region on `device_type`. What a GPU records, and what
    pre-flight predicts when run inside a fake CUDA session (`predicted_layer_facts`)."""
    from rematlab.core.batch import call
    from rematlab.core.dispatch import OpCall, OpRecorder
    from rematlab.remat.structure import structure

    blocks = structure(model, batch).blocks
    facts = [{"ops": [], "saved": 0} for _ in blocks]
    current: list[int] = []

    class Ops:
        def on_op(self, op: OpCall) -> None:
            if current and not op.func.is_view and op.func.namespace == "aten":
                facts[current[-1]]["ops"].append(op.name)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current:
            facts[current[-1]]["saved"] += t.untyped_storage().nbytes()
        return t

    def enter(i: int) -> Callable:
        def hook(*_: object) -> None:
            current.append(i)
        return hook

    def leave(*_: object) -> None:
        current.pop()

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(enter(i)))
        handles.append(block.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), OpRecorder(Ops()), \
                step.autocast_region(torch.device(device_type)):
            call(model, batch)
    finally:
        for h in handles:
            h.remove()
    return facts


def predicted_layer_facts(model: torch.nn.Module, batch: object, step: Step, cuda: bool
                          ) -> list[dict]:
    """`layer_facts` as pre-flight sees them: on fake twins, through CUDA's dispatch when
    the facts are a GPU's (`rematlab.preflight.fake.FakeSession`)."""
    from rematlab.preflight.fake import FakeSession

    session = FakeSession(cuda=cuda)
    fake_model, fake_batch = session.model(model), session.batch(batch)
    with session.active():
        return layer_facts(fake_model, fake_batch, step, "cpu")


OPTION_MODELS = ("gpt2",)  # the models whose op-level menu is recorded (`option_facts`)


def option_facts(planning: object) -> dict:
    """The first layer's op-level menu of a `prepare(..., ops=True)` planning (measured on
    the card, or predicted for it): the plain layer's saved bytes and forward and backward
    seconds, and per option its name, saves, recomputed submodules, saved bytes and times."""
    costs = planning.costs
    first = 1 if planning.structure.kind == "layers" else 0
    return {"plain": {"saved": costs.saved[first], "fwd_time": costs.fwd_time[first],
                      "bwd_time": costs.bwd_time[first]},
            "options": [{"name": o.name, "saves": [list(s) for s in o.saves],
                         "modules": list(o.modules), "saved": o.saved,
                         "fwd_time": o.fwd_time, "bwd_time": o.bwd_time}
                        for o in costs.menu(first)]}
