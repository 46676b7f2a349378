"""Bad input, said once: counts within bounds, and the user's own code (imports, factories)
whose failures are the user's, reported in one line."""

from __future__ import annotations

import contextlib
import importlib
import numbers
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from rematlab.exceptions import ConfigError

MAX_BATCH_SIZE = 2**31 - 1  # samples: torch indexes a batch dimension in 32 bits on GPUs
MAX_VOCAB = 2**63 - 1  # token ids are int64


def bounded(name: str, value: int, high: int, low: int = 1) -> int:
    """`value` of the count `name` if it is a whole number and `low <= value <= high`; else
    bad input, said once (a float or a string never reaches a comparison or an index)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ConfigError(f"{name} must be a whole number, got {value!r}"[:200])
    if not low <= value <= high:
        raise ConfigError(f"{name} must be between {low} and {high}, got {value}")
    return value


@contextlib.contextmanager
def user_code(failed: str, passes: Callable[[BaseException], bool] = lambda _: False
              ) -> Iterator[None]:
    """Runs the user's code (an import, a factory, a step function). Any failure of it is
    bad input reported as `failed: <error>`, including `sys.exit` and other
    `BaseException`s: a factory that exits must not end rematlab silently with its status.
    Ctrl-C stays Ctrl-C, and what `passes` accepts goes on as it is (an out-of-memory error
    inside a step function is a result, not the user's mistake)."""
    try:
        yield
    except (KeyboardInterrupt, ConfigError):
        raise
    except BaseException as exc:
        if passes(exc):
            raise
        detail = (f"exit({exc.code})" if isinstance(exc, SystemExit)
                  else str(exc).splitlines()[0] if str(exc) else "")
        raise ConfigError(f"{failed}: {type(exc).__name__}: {detail}") from None


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:300]


def load_object(path: str, what: str) -> Any:
    """`module.path:name` -> the object, importing from the current directory too (as
    `python -m` does); any failure to import is a `ConfigError` naming `what` it was for."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} {path!r} must look like module.path:name")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    with user_code(f"cannot load {what} {path!r}"):
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{what} {path!r} is not callable")
    return obj


DEVICE_TYPES = ("cpu", "cuda", "mps", "meta")  # what rematlab plans on (meta: shapes only)


def device_here(value: object, name: str = "device") -> Any:
    """`value` as a `torch.device` this machine has: a name torch knows ("cpu", "cuda:1"),
    of a kind rematlab plans on, and present here (a CUDA/ROCm GPU of that index, Apple's
    MPS); anything else is bad input that names the value and what is allowed."""
    import torch

    allowed = "cpu, cuda or cuda:N (a GPU here), mps (Apple), or a torch.device"
    if not isinstance(value, (str, torch.device)) or (isinstance(value, str) and not value):
        raise ConfigError(f"{name} must be {allowed}, got {value!r}"[:200])
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise ConfigError(f"unknown {name} {str(value)[:80]!r}: choose {allowed}") from None
    if device.type not in DEVICE_TYPES:
        raise ConfigError(f"{name} {device} is not one rematlab plans on: choose {allowed}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{name} {device} requested but this machine has no CUDA/ROCm GPU")
    if device.type == "cuda" and device.index is not None \
            and device.index >= torch.cuda.device_count():
        raise ConfigError(f"{name} {device}: this machine has {torch.cuda.device_count()} GPU(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{name} {device} requested but this machine has no MPS device")
    return device
