"""What is measured and what was observed, kept apart (as torch.utils.benchmark keeps its
spec from its measurement): a frozen `Spec` names one configuration and is its identity in a
sweep; an `Observation` holds the raw per-repeat figures and how each was measured. Light on
purpose: the predictor, the statistics and the device model read specs without importing the
measurement engine (`rematlab.measurement.measure`).
"""

from __future__ import annotations

import math
import platform
import socket
import statistics
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime

import torch

from rematlab.core import hostmem
from rematlab.core.batch import DTYPES, FLOAT_DTYPES
from rematlab.core.checks import MAX_BATCH_SIZE, MAX_VOCAB, bounded
from rematlab.core.guard import NOISY, Evidence
from rematlab.core.optimizers import OPTIMIZERS
from rematlab.core.spread import iqr
from rematlab.exceptions import ConfigError
from rematlab.measurement import zoo
from rematlab.remat import strategies
from rematlab.version import __version__

# what the results store's columns hold (INTEGER, BIGINT), and sane bounds on run settings
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_REPEATS = 10_000
MAX_THREADS = 4096
@dataclass(frozen=True)
class Spec:
    """What is measured. Frozen, hashable, and the identity of a configuration in a sweep."""

    model: str
    batch: int
    strategy: str = "none"
    input: str | None = None
    input_shape: tuple[int, ...] | None = None
    device: str = "cpu"
    dtype: str = "float32"
    optimizer: str = "momentum"
    warmup: int = 1  # untimed steps before the repeats: the tracked step and warmup - 1 more
    repeats: int = 5
    max_memory: int | None = None
    threads: int | None = None
    seed: int = 0
    # a user's model beyond the zoo: its batches, and the layers its own loop runs
    example: str | None = None  # module:fn, fn(batch) -> tensor, tuple or dict
    input_dtype: str | None = None  # e.g. int64: token ids below `vocab`
    vocab: int | None = None
    blocks: str | None = None  # e.g. transformer.h
    # the user's step (`rematlab.Step`): autocast around forward and loss, None: fp32
    precision: str | None = None  # bf16, or fp16 with a GradScaler
    # the least seconds a timed repeat averages steps over (None: the timer's 0.2 s); a GPU
    # grid of millisecond steps takes less, its events being exact (`grids/seed-study-gpu`)
    min_repeat_s: float | None = None

    def validate(self) -> Spec:
        """Check every field; return the spec with the zoo's default input filled in."""
        bounded("batch", self.batch, MAX_BATCH_SIZE)
        bounded("warmup (the tracked step is the first)", self.warmup, MAX_REPEATS)
        bounded("repeats", self.repeats, MAX_REPEATS)
        if self.threads is not None:
            bounded("threads", self.threads, MAX_THREADS)
        bounded("seed", self.seed, INT32_MAX, low=0)
        if self.vocab is not None:
            bounded("vocab", self.vocab, MAX_VOCAB)
        if self.dtype not in FLOAT_DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose one of "
                              f"{sorted(FLOAT_DTYPES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; choose one of {OPTIMIZERS}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.precision!r}; choose one of "
                              f"{', '.join(PRECISIONS)} (or leave it out: fp32)")
        if self.min_repeat_s is not None and not (
                isinstance(self.min_repeat_s, (int, float)) and 0 <= self.min_repeat_s <= 60):
            raise ConfigError(f"min_repeat_s must be seconds in [0, 60], got "
                              f"{self.min_repeat_s!r}")
        if self.max_memory is not None and not 0 < self.max_memory <= INT64_MAX:
            raise ConfigError(f"max_memory must be positive (bytes), got {self.max_memory}")
        strat = strategies.parse(self.strategy)
        if strat.kind == "plan":
            strat.load()  # a missing or malformed plan file is bad input, not a failed run
        parse_device(self.device)
        if self.model in zoo.REGISTRY:
            return replace(self, input=zoo.scale_of(self.model, self.input))
        if ":" not in self.model:
            raise ConfigError(f"unknown model {self.model!r}; choose one of "
                              f"{sorted(zoo.REGISTRY)} or give module.path:factory")
        if self.input_shape is None and self.example is None:
            raise ConfigError(f"model {self.model!r} needs an input shape (--input-shape) or "
                              "a batch factory (--example module:fn)")
        if self.input_dtype is not None and self.input_dtype not in DTYPES:
            raise ConfigError(f"unknown input dtype {self.input_dtype!r}; choose one of "
                              f"{sorted(DTYPES)}")
        if self.vocab is not None and self.vocab <= 0:
            raise ConfigError(f"vocab must be positive, got {self.vocab}")
        return self

    def to_dict(self) -> dict:
        """Every field; the optional ones (a user model's, the step's precision) only when
        set, so that the identity (hash) of a configuration stays what it was before they
        existed."""
        d = asdict(self)
        d["input_shape"] = list(self.input_shape) if self.input_shape else None
        for key in _OPTIONAL_FIELDS:
            if d[key] is None:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Spec:
        d = dict(d)
        if d.get("input_shape"):
            d["input_shape"] = tuple(d["input_shape"])
        return cls(**d)


_OPTIONAL_FIELDS = ("example", "input_dtype", "vocab", "blocks", "precision", "min_repeat_s")
PRECISIONS = ("bf16", "fp16")  # a configuration's autocast; fp32 is the default, no field


@dataclass
class Observation:
    """What was observed: raw per-repeat figures plus the step's static figures."""

    spec: Spec
    outcome: str  # ok | oom | error
    error: str | None = None
    times: dict[str, list[float]] = field(default_factory=dict)  # phase -> seconds per repeat
    peaks: list[int] = field(default_factory=list)  # bytes per tracked step
    reserved: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # steps each timed repeat averaged
    calibration: list[float] = field(default_factory=list)  # seconds, before each repeat
    evidence: Evidence | None = None
    phase_peaks: dict[str, int] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)
    methods: dict[str, str] = field(default_factory=dict)
    env: dict[str, str | int | None] = field(default_factory=dict)
    # time spent inside measured steps: the timed repeats and the tracked step (the peak)
    measured_seconds: float = 0.0

    def median(self, phase: str = "step") -> float:
        return statistics.median(self.times[phase]) if self.times.get(phase) else math.nan

    def iqr(self, phase: str = "step") -> float:
        return iqr(self.times.get(phase) or [])

    @property
    def noisy(self) -> bool:
        """The step-time IQR exceeds `guard.NOISY` of its median."""
        med = self.median()
        return bool(med > 0 and self.iqr() / med > NOISY)

    @property
    def peak(self) -> int | None:
        return max(self.peaks) if self.peaks else None

    def summary(self) -> dict:
        """One flat dict: medians, IQRs, peak, figures, methods (what a CLI prints as JSON)."""
        out: dict = {"spec": self.spec.to_dict(), "outcome": self.outcome, "error": self.error}
        for phase in self.times:
            out[f"{phase}_s_median"] = self.median(phase)
            out[f"{phase}_s_iqr"] = self.iqr(phase)
        out["peak_bytes"] = self.peak
        out["phase_peak_bytes"] = self.phase_peaks
        out["noisy"] = self.noisy if self.times else None
        out["repeats"] = len(self.times.get("step", []))
        out.update(self.figures)
        if self.evidence:
            out.update(self.evidence.columns())
        out["methods"] = self.methods
        out["env"] = self.env
        return out

    def rows(self) -> list[dict]:
        """One dict per repeat (the dataset's grain); a failed run is one row with its outcome."""
        base = {**{f"cfg_{k}": v for k, v in self.spec.to_dict().items()},
                "outcome": self.outcome, "error": self.error, **self.figures,
                **{f"method_{k}": v for k, v in self.methods.items()}, **self.env,
                **(self.evidence.columns() if self.evidence else {})}
        base["cfg_input_shape"] = ",".join(map(str, self.spec.input_shape or ())) or None
        n = max(len(self.times.get("step", [])), 1)

        def at(values: list, r: int):
            return values[r] if r < len(values) else None

        rows = []
        for r in range(n):  # tracked figures sit on the rows of the repeats that had them
            row = dict(base, repeat=r, peak_bytes=at(self.peaks, r),
                       reserved_bytes=at(self.reserved, r), steps_per_repeat=at(self.steps, r),
                       calibration_s=at(self.calibration, r))
            for phase, values in self.times.items():
                row[f"{phase}_s"] = at(values, r)
            rows.append(row)
        return rows


def parse_device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ConfigError(f"unknown device {text!r}; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device {text!r}; use cpu, cuda or cuda:N")
    return device


def available(device: torch.device) -> torch.device:
    """`device` when this machine has it; a `ConfigError` naming it otherwise."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {str(device)!r} requested but CUDA/ROCm is not "
                              "available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {str(device)!r} does not exist: this machine has "
                              f"{torch.cuda.device_count()} GPU(s)")
    return device


def environment(device: torch.device) -> dict[str, str | int | None]:
    """Where a figure was measured (stored with every row)."""
    cuda = device.type == "cuda"
    vendor = "CPU"
    if cuda:
        vendor = "AMD" if torch.version.hip else "NVIDIA"
    return {
        "device_name": torch.cuda.get_device_name(device) if cuda else _cpu_model(),
        "vendor": vendor,
        "cuda_version": torch.version.cuda if cuda and not torch.version.hip else None,
        "rocm_version": torch.version.hip if cuda else None,
        "torch_version": torch.__version__,
        "cpu_model": _cpu_model(),
        "threads": torch.get_num_threads(),
        "host": socket.gethostname(),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "rematlab_version": __version__,
        "host_allocator": hostmem.host_allocator(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
