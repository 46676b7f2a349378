"""Grid files: a TOML description of a sweep, validated on load, expanded to `Spec`s.

A grid names models (zoo names, or `module.path:factory` with `input_shape`), their input
scales, batch sizes, strategies, dtypes, devices and optimizers, plus measurement settings.
Every field is checked before anything runs; an error names the field and the bad value.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import tomllib
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator

from rematlab import strategies, zoo
from rematlab.exceptions import ConfigError, parse_bytes
from rematlab.measure import DTYPES, Spec, parse_device
from rematlab.steps import OPTIMIZERS

BUILTIN = Path(__file__).parent / "grids"


def _one_of(values: list[str], allowed: list[str], what: str) -> list[str]:
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"unknown {what} {bad[0]!r}; choose from {allowed}")
    return values


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    inputs: list[str] | None = None
    input_shape: list[PositiveInt] | None = None
    batches: list[PositiveInt] | None = None

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in zoo.REGISTRY and ":" not in v:
            raise ValueError(f"unknown model {v!r}; choose one of {sorted(zoo.REGISTRY)} "
                             "or module.path:factory")
        return v


class Grid(BaseModel):
    """A sweep: the cartesian product of its lists, per model."""

    model_config = ConfigDict(extra="forbid")

    name: str = "grid"
    models: list[ModelEntry] = Field(min_length=1)
    batches: list[PositiveInt] = Field(default_factory=lambda: [32])
    strategies: list[str] = Field(default_factory=lambda: ["none"], min_length=1)
    dtypes: list[str] = Field(default_factory=lambda: ["float32"])
    devices: list[str] = Field(default_factory=lambda: ["cpu"])
    optimizers: list[str] = Field(default_factory=lambda: ["momentum"])
    warmup: int = Field(default=2, ge=2)
    repeats: int = Field(default=5, ge=1)
    timeout: float = Field(default=600.0, gt=0)
    max_memory: str | int | None = None
    threads: PositiveInt | None = None

    @field_validator("strategies")
    @classmethod
    def _strategies(cls, v: list[str]) -> list[str]:
        for s in v:
            strategies.parse(s)
        return v

    @field_validator("dtypes")
    @classmethod
    def _dtypes(cls, v: list[str]) -> list[str]:
        return _one_of(v, sorted(DTYPES), "dtype")

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

    @field_validator("max_memory")
    @classmethod
    def _memory(cls, v: str | int | None) -> str | int | None:
        if v is not None:
            parse_bytes(v)
        return v

    def expand(self) -> list[Spec]:
        """Every configuration, in a stable order (models outermost, strategies innermost)."""
        cap = parse_bytes(self.max_memory) if self.max_memory is not None else None
        specs = []
        for entry in self.models:
            info = zoo.REGISTRY.get(entry.name)
            inputs: list[str | None] = list(entry.inputs or ([info.default_scale] if info
                                                               else [None]))
            shape = tuple(entry.input_shape) if entry.input_shape else None
            for inp, batch, dtype, device, opt, strat in itertools.product(
                inputs, entry.batches or self.batches, self.dtypes, self.devices,
                self.optimizers, self.strategies,
            ):
                specs.append(Spec(model=entry.name, batch=batch, strategy=strat, input=inp,
                                  input_shape=shape, device=device, dtype=dtype, optimizer=opt,
                                  warmup=self.warmup, repeats=self.repeats, max_memory=cap,
                                  threads=self.threads))
        for spec in specs:
            spec.validate()
        return specs


def load_grid(path: str | Path) -> Grid:
    """Read and validate a grid file; `quick` and `seed-study` name the shipped grids."""
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
