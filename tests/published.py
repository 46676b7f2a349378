"""Published training runs as data (issue 59): `tests/data/published/runs.json`, rows read from
torchtitan's and torchtune's own pages and this project's H200 session, each with its source,
its settings, what it leaves out and what its figures mean (the file's `about`).

`replay(row)` prices a predictable row as its project ran it: the model built on the meta
device from the row's config, its batch as shapes, its step (optimizer, clipping, precision,
layout), its cards' target, and the peer's own checkpointing as a fixed plan
(`rematlab.plans.fixed.peer_plan`); the predicted peak and its band
(`rematlab.preflight.band`) of the same kind as the published figure, and the tokens per
second per GPU. `benchmarks/published.py` writes the docs page from it;
`tests/test_published.py` replays every row on every CPU test run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch
import transformers

from rematlab.core.layout import FSDP
from rematlab.core.recipe import Step
from rematlab.planning.planner import Planning, prepare
from rematlab.plans.fixed import every_layer_plan, none_plan, peer_plan
from rematlab.plans.plan import Plan
from rematlab.plans.simulate import simulate
from rematlab.preflight.band import Band
from rematlab.preflight.targets import PROFILES, Target, resolve_target

FORMAT = 1
PATH = Path(__file__).parent / "data" / "published" / "runs.json"
UNITS = {"GiB": 1 << 30, "GB": 10**9, "MiB": 1 << 20, "B": 1}
OPTIMIZERS = {"AdamW": torch.optim.AdamW}


@cache
def corpus() -> dict:
    """The corpus, refused when its format is not this code's."""
    data = json.loads(PATH.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{PATH}: format {data.get('format')!r}, this code reads {FORMAT}")
    return data


def rows(predictable: bool | None = None) -> list[dict]:
    return [r for r in corpus()["rows"] if predictable is None or r["predictable"] == predictable]


@dataclass(frozen=True)
class Replay:
    """A row priced by pre-flight: the peer's plan, its predicted peak as a band of the
    published figure's kind (None where the row publishes no memory), its predicted step
    seconds and tokens per second per GPU, and the published figures beside them."""

    row: str
    plan: str
    band: Band | None
    measured: float | None  # bytes
    seconds: float
    tokens_per_s: float
    published_tokens_per_s: float | None

    @property
    def error(self) -> float | None:
        """The point's error against the published peak (+: over)."""
        return None if self.band is None else self.band.point / self.measured - 1

    @property
    def tokens_error(self) -> float | None:
        published = self.published_tokens_per_s
        return None if published is None else self.tokens_per_s / published - 1


def target(row: dict) -> Target:
    """The row's cards as a target: a data-sheet profile with what the source says of its
    card instead (memory, bandwidth)."""
    cards = row["cards"]
    sheet = PROFILES[cards["target"]]
    if not cards.get("overrides"):
        return sheet
    return resolve_target({**asdict(sheet), "name": cards["name"], **cards["overrides"]})


def step(row: dict) -> Step:
    """The row's training step: its optimizer and settings, clipping, precision, layout."""
    layout = row["layout"]
    fsdp = None if layout is None else FSDP(layout["world_size"], param_dtype=layout["param_dtype"],
                                            reduce_dtype=layout["reduce_dtype"])
    spec = dict(row["optimizer"])
    opt = OPTIMIZERS[spec.pop("name")]
    autocast = "autocast" in row["precision"]
    return Step(precision="bf16" if autocast else None, optimizer=opt, optimizer_kwargs=spec,
                clip=row["clip"], layout=fsdp)


def model_and_batch(row: dict) -> tuple[torch.nn.Module, dict]:
    """The row's model on the meta device (no weight allocated; in bf16 where its weights
    are trained in bf16) and its batch as meta token ids."""
    spec = corpus()["models"][row["model"]]
    cls = getattr(transformers, spec["class"])
    config = getattr(transformers, spec["class"].replace("LMHeadModel", "Config")
                     .replace("ForCausalLM", "Config"))(**spec["config"])
    with torch.device("meta"):
        model = cls(config).train()
    if row["precision"].startswith("bf16 weights"):
        model = model.to(torch.bfloat16)
    ids = torch.empty(row["batch"], row["sequence"], dtype=torch.int64, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def plan_of(row: dict, planning: Planning) -> Plan:
    """The checkpointing the row's project ran, as a plan over the planning's chain."""
    n = planning.costs.n
    name = row["checkpointing"]
    fixed = {"none": none_plan, "every:1": every_layer_plan}
    return fixed[name](n) if name in fixed else peer_plan(planning.costs, name)


# Rows that miss a goal of `tests/test_published.py`: (row, "memory"/"tokens") -> (the bound
# the error lies in now, its cause). `benchmarks/published.py` prints them on the docs page.
KNOWN_GAPS = {
    ("torchtitan-h100-t1-fsdp", "memory"): (
        (-0.12, 0.0), "a rank's allocated peak against torchtitan's reserved one: under a layout "
        "there is no allocator replay yet, and FSDP2's all-gather and reduce-scatter streams "
        "hold segments of their own; the band's rank width (13.5 %) is fitted on this row"),
    ("torchtitan-h100-t3-fsdp128", "memory"): (
        (-0.08, 0.0), "as the 8-card row: allocated against reserved under FSDP2's streams"),
}


SETTINGS = ("model", "cards", "layout", "batch", "sequence", "optimizer", "clip", "precision")


@cache
def _planning(settings: str, ops: bool) -> Planning:
    """One planning per distinct setting (rows that differ only in their checkpointing or
    their figures share it)."""
    row = json.loads(settings)
    model, batch = model_and_batch(row)
    return prepare(model, batch, predict=True, target=target(row), step=step(row), ops=ops)


def planning_of(row: dict) -> Planning:
    return _planning(json.dumps({k: row[k] for k in SETTINGS}, sort_keys=True),
                     row["checkpointing"] == "torchtitan:op")


def replay(row: dict) -> Replay:
    """Price a predictable row (module docstring)."""
    planning = planning_of(row)
    plan = plan_of(row, planning)
    seconds = simulate(plan, planning.costs)[1]
    published = row["measured"].get("memory")
    got = None if published is None else planning.band(plan, published["what"])
    measured = None if published is None else published["value"] * UNITS[published["unit"]]
    return Replay(row["id"], plan.describe(), got, measured, seconds,
                  row["batch"] * row["sequence"] / seconds,
                  row["measured"].get("tokens_per_s_per_gpu"))



@dataclass(frozen=True)
class Observation:
    """One recorded peak beside its predicted band: a published row's, or a GPU fact's."""

    label: str
    band: Band
    measured: float


def row_observations(replays: list[Replay]) -> list[Observation]:
    return [Observation(r.row, r.band, r.measured) for r in replays if r.band is not None]


def fact_observations(models: frozenset[str] | None = None) -> list[Observation]:
    """Every plan of every committed GPU fact file (`tests/gpufacts.py`), of `models` (None:
    all), predicted for its card's data-sheet profile: its allocated and its reserved peak,
    each beside its band."""
    from rematlab.plans.text import parse_plan
    from tests import gpufacts

    out = []
    for path in gpufacts.fact_files():
        facts = gpufacts.load(path)
        sheet = PROFILES.get(facts["card"]["profile"])
        for name, kwargs in facts["models"].items():
            if sheet is None or (models is not None and name not in models):
                continue
            planning = gpufacts.planned(name, kwargs, sheet)
            for fact in (r for r in facts["plans"] if r["model"] == name):
                plan = parse_plan(fact["plan"], planning.costs.n)
                out.extend(Observation(f"{path.parent.name} {name} `{fact['plan']}` {what}",
                                       planning.band(plan, what), fact[what])
                           for what in ("allocated", "reserved"))
    return out
