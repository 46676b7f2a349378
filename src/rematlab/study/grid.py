"""Grid files: a TOML description of a sweep, validated on load, expanded to `Spec`s.

A grid names models (zoo names, or `module.path:factory` with `input_shape`), their input
scales, batch sizes, strategies, dtypes, devices and optimizers, plus measurement settings.
Every field is checked before anything runs; an error names the field and the bad value.
"""

from __future__ import annotations

import itertools
import tomllib
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from rematlab.core.batch import FLOAT_DTYPES
from rematlab.core.guard import MAX_WAIT_S
from rematlab.core.optimizers import OPTIMIZERS
from rematlab.core.units import parse_bytes
from rematlab.exceptions import ConfigError
from rematlab.measurement import zoo
from rematlab.measurement.spec import (
    INT32_MAX,
    INT64_MAX,
    MAX_REPEATS,
    MAX_THREADS,
    PRECISIONS,
    Spec,
    parse_device,
)
from rematlab.remat import strategies

BUILTIN = Path(__file__).parents[1] / "grids"  # shipped with the package (package-data)


MAX_CONFIGS = 20_000  # a grid larger than this needs `max_configs` raised in the file
MAX_TIMEOUT = 7 * 24 * 3600.0  # seconds
MAX_WAIT_TOTAL_S = 600.0  # a sweep waits at most this long for quiet in all (the default)

BatchSize = Annotated[int, Field(gt=0, le=INT32_MAX)]


def _one_of(values: list[str], allowed: list[str], what: str) -> list[str]:
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"unknown {what} {bad[0]!r}; choose from {allowed}")
    return values


def _unique(values: list, what: str) -> list:
    """Refuse a value listed twice: it would be the same configuration twice."""
    seen = set()
    for v in values:
        key = v.strip() if isinstance(v, str) else v
        if key in seen:
            raise ValueError(f"{what} lists {v!r} twice")
        seen.add(key)
    return values


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    inputs: list[str] | None = Field(default=None, min_length=1)
    input_shape: list[Annotated[int, Field(gt=0, le=INT32_MAX)]] | None = Field(
        default=None, min_length=1, max_length=8)
    batches: list[BatchSize] | None = Field(default=None, min_length=1)

    @field_validator("inputs", "batches")
    @classmethod
    def _distinct(cls, v: list | None, info: ValidationInfo) -> list | None:
        return None if v is None else _unique(v, info.field_name)

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in zoo.REGISTRY and ":" not in v:
            raise ValueError(f"unknown model {v!r}; choose one of {sorted(zoo.REGISTRY)} "
                             "or module.path:factory")
        return v


class StudyOptions(BaseModel):
    """How `rematlab study` runs its stages after the sweep on this grid (`[study]` in the
    grid file; each left out is `reproduce.StudySettings`'s default): a grid sized for a demo
    also sizes its gradient comparison and plan demonstrations, and says what it is
    (`about`, shown at the top of the report)."""

    model_config = ConfigDict(extra="forbid")

    about: str | None = Field(default=None, max_length=1000)
    gradient_models: list[str] | None = Field(default=None, min_length=1)
    gradient_budgets: list[Annotated[int, Field(ge=1, le=4096)]] | None = Field(
        default=None, min_length=1)
    gradient_seeds: int | None = Field(default=None, ge=1, le=1000)
    gradient_steps: int | None = Field(default=None, ge=1, le=1_000_000)
    gradient_batch: int | None = Field(default=None, ge=1, le=1_000_000)
    plan_fractions: list[Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]] | None = \
        Field(default=None, min_length=1)
    plan_ops: bool | None = None


class Grid(BaseModel):
    """A sweep: the cartesian product of its lists, per model."""

    model_config = ConfigDict(extra="forbid")

    name: str = "grid"
    models: list[ModelEntry] = Field(min_length=1)
    batches: list[BatchSize] = Field(default_factory=lambda: [32], min_length=1)
    strategies: list[str] = Field(default_factory=lambda: ["none"], min_length=1)
    dtypes: list[str] = Field(default_factory=lambda: ["float32"], min_length=1)
    devices: list[str] = Field(default_factory=lambda: ["cpu"], min_length=1)
    optimizers: list[str] = Field(default_factory=lambda: ["momentum"], min_length=1)
    # the step's autocast (`rematlab.Step`): fp32, bf16, fp16 (with a GradScaler)
    precisions: list[str] = Field(default_factory=lambda: ["fp32"], min_length=1)
    warmup: int = Field(default=1, ge=1, le=MAX_REPEATS)  # the tracked step is the first
    repeats: int = Field(default=5, ge=1, le=MAX_REPEATS)
    # the least seconds a timed repeat averages steps over (None: the timer's own, 0.2 s)
    min_repeat_s: float | None = Field(default=None, ge=0, le=60, allow_inf_nan=False)
    timeout: float = Field(default=600.0, gt=0, le=MAX_TIMEOUT, allow_inf_nan=False)
    max_memory: StrictStr | StrictInt | None = None
    threads: int | None = Field(default=None, ge=1, le=MAX_THREADS)
    max_configs: int = Field(default=MAX_CONFIGS, ge=1)
    # waiting for a quiet host (`rematlab.core.guard`): per configuration, and for the whole sweep
    max_wait_s: float = Field(default=MAX_WAIT_S, ge=0, le=MAX_TIMEOUT, allow_inf_nan=False)
    max_wait_total_s: float = Field(default=MAX_WAIT_TOTAL_S, ge=0, le=MAX_TIMEOUT,
                                    allow_inf_nan=False)
    study: StudyOptions = Field(default_factory=StudyOptions)

    @field_validator("batches", "strategies", "dtypes", "devices", "optimizers", "precisions")
    @classmethod
    def _distinct(cls, v: list, info: ValidationInfo) -> list:
        return _unique(v, info.field_name)

    @field_validator("models")
    @classmethod
    def _distinct_models(cls, v: list[ModelEntry]) -> list[ModelEntry]:
        _unique([(m.name, tuple(m.inputs or ()), tuple(m.input_shape or ())) for m in v],
                "models")
        return v

    @field_validator("strategies")
    @classmethod
    def _strategies(cls, v: list[str]) -> list[str]:
        for s in v:
            strategies.parse(s)
        return v

    @field_validator("dtypes")
    @classmethod
    def _dtypes(cls, v: list[str]) -> list[str]:
        return _one_of(v, sorted(FLOAT_DTYPES), "dtype")

    @field_validator("devices")
    @classmethod
    def _devices(cls, v: list[str]) -> list[str]:
        for d in v:
            parse_device(d)
        return v

    @field_validator("optimizers")
    @classmethod
    def _optimizers(cls, v: list[str]) -> list[str]:
        return _one_of(v, list(OPTIMIZERS), "optimizer")

    @field_validator("precisions")
    @classmethod
    def _precisions(cls, v: list[str]) -> list[str]:
        return _one_of(v, ["fp32", *PRECISIONS], "precision")

    @field_validator("max_memory")
    @classmethod
    def _memory(cls, v: str | int | None) -> str | int | None:
        if v is not None and parse_bytes(v) > INT64_MAX:
            raise ValueError(f"max_memory {v!r} is larger than any device")
        return v

    def size(self) -> int:
        """How many configurations the grid expands to, without expanding it."""
        per_model = len(self.strategies) * len(self.dtypes) * len(self.devices) * len(
            self.optimizers) * len(self.precisions)
        return sum(len(m.inputs or [None]) * len(m.batches or self.batches) * per_model
                   for m in self.models)

    def expand(self) -> list[Spec]:
        """Every configuration, in a stable order (models outermost, strategies innermost)."""
        if self.size() > self.max_configs:
            raise ConfigError(f"the grid expands to {self.size()} configurations, more than "
                              f"max_configs = {self.max_configs}; raise max_configs in the grid "
                              "file to run it")
        cap = parse_bytes(self.max_memory) if self.max_memory is not None else None
        specs = []
        for entry in self.models:
            info = zoo.REGISTRY.get(entry.name)
            inputs: list[str | None] = list(entry.inputs or ([info.default_scale] if info
                                                               else [None]))
            shape = tuple(entry.input_shape) if entry.input_shape else None
            for inp, batch, dtype, device, opt, prec, strat in itertools.product(
                inputs, entry.batches or self.batches, self.dtypes, self.devices,
                self.optimizers, self.precisions, self.strategies,
            ):
                specs.append(Spec(model=entry.name, batch=batch, strategy=strat, input=inp,
                                  input_shape=shape, device=device, dtype=dtype, optimizer=opt,
                                  warmup=self.warmup, repeats=self.repeats, max_memory=cap,
                                  threads=self.threads,
                                  precision=None if prec == "fp32" else prec,
                                  min_repeat_s=self.min_repeat_s))
        for spec in specs:
            spec.validate()
        return specs


def load_grid(path: str | Path, **overrides: Any) -> Grid:
    """Read and validate a grid file; `quick` and `seed-study` name the shipped grids.
    `overrides` (top-level fields, e.g. `max_wait_s`) replace the file's values, validated
    like them; `None` leaves a field as the file has it."""
    p = Path(path)
    if not p.suffix and not p.exists():
        p = BUILTIN / f"{path}.toml"
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"grid file {str(path)!r} not found (shipped grids: "
                          f"{', '.join(sorted(g.stem for g in BUILTIN.glob('*.toml')))})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"grid file {p}: malformed TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read grid file {p}: {type(exc).__name__}") from None
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        grid = Grid.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise ConfigError(f"grid file {p}: {where}: {message}") from None
    if grid.name == "grid":
        grid = grid.model_copy(update={"name": p.stem})
    try:
        grid.expand()
    except ConfigError as exc:
        raise ConfigError(f"grid file {p}: {exc}") from None
    return grid
