"""The user's training step: any batch form, the model's own loss, the output alive until
backward.

A batch is what the user's loop passes to the model: a tensor (`model(x)`), a tuple or list
(`model(*batch)`) or a dict (`model(**batch)`, as Hugging Face loops do with `input_ids`,
`attention_mask`, `labels`, `pixel_values`). The loss is, in this order, the `loss_fn(output,
batch)` the user passes; the model's own loss (`output.loss` or `output["loss"]`, what
transformers returns when the batch has `labels`); cross-entropy against fixed random labels
for a `(B, classes)` output (the zoo's classifiers); the mean square of the first floating
output tensor otherwise (any shape: images, sequences, embeddings).

Budget semantics: the step whose peak a plan bounds is `out = model(batch); loss =
loss_fn(out, batch); loss.backward(); optimizer.step()`, with `out` alive until the step ends,
as in a real loop (a logits tensor that outlives backward is part of the peak), and the
optimizer's state and step included.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rematlab.exceptions import ConfigError, SimulatedOOM

Batch = Any  # torch.Tensor | tuple | list | dict[str, torch.Tensor]
LossFn = Callable[[Any, Batch], torch.Tensor]


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a batch or an output (dicts, tuples, lists, ModelOutputs), in
    order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):  # transformers' ModelOutput is an OrderedDict
        for v in value.values():
            yield from tensors(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors(v)


def check_batch(batch: Batch) -> None:
    """A `ConfigError` unless `batch` is a tensor, a tuple/list or a str-keyed dict holding
    at least one tensor."""
    if isinstance(batch, dict) and not all(isinstance(k, str) for k in batch):
        raise ConfigError("a dict batch needs string keys (the model's argument names)")
    if not isinstance(batch, (torch.Tensor, tuple, list, dict)):
        raise ConfigError(f"a batch is a tensor, a tuple or a dict of tensors, got "
                          f"{type(batch).__name__}")
    if next(tensors(batch), None) is None:
        raise ConfigError("the example batch holds no tensor")


def call(model: Callable, batch: Batch) -> Any:
    """`model(**batch)`, `model(*batch)` or `model(batch)`, by the batch's form."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def detached(value: Any) -> Any:
    """A batch (or arguments) with every tensor detached, the structure kept."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {k: detached(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(detached(v) for v in value)
    return value


def to_device(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batch_bytes(batch: Batch) -> int:
    seen = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors(batch)}
    return sum(seen.values())


def first_float(out: Any) -> torch.Tensor:
    """The first floating tensor of an output (logits, last hidden state, an image)."""
    if isinstance(out, dict):
        out = {k: v for k, v in out.items() if k != "loss"}
    for t in tensors(out):
        if t.is_floating_point():
            return t
    raise ConfigError(f"the model's output ({type(out).__name__}) holds no floating tensor "
                      "to take a loss of: pass loss_fn")


def model_loss(out: Any) -> torch.Tensor | None:
    """The loss a model computed itself (transformers with `labels`), if any."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def labels_for(logits: torch.Tensor) -> torch.Tensor:
    """Fixed random class labels for a `(B, classes)` output, the same on every call."""
    gen = torch.Generator().manual_seed(0)
    b, classes = logits.shape
    return torch.randint(0, classes, (b,), generator=gen).to(logits.device)


def default_loss(out: Any, batch: Batch) -> torch.Tensor:
    """See the module docstring: the model's own loss, cross-entropy for classifiers, else
    the mean square of the output."""
    del batch  # the default never looks at the batch: its labels are inside `out.loss`
    loss = model_loss(out)
    if loss is not None:
        return loss
    y = first_float(out)
    if y.dim() == 2:
        return F.cross_entropy(y, labels_for(y))
    return y.square().mean()


def step(model: Callable, batch: Batch, loss_fn: LossFn | None = None) -> Any:
    """Forward, loss and backward of one step; returns the output, alive until the caller
    drops it (as a real loop keeps `out` until the step ends)."""
    out = call(model, batch)
    (loss_fn or default_loss)(out, batch).backward()
    return out


OPTIMIZERS = ("sgd", "momentum", "adam")


def make_optimizer(name: str, params, lr: float = 0.01) -> torch.optim.Optimizer:
    """`sgd` (plain), `momentum` (SGD, momentum 0.9: the default) or `adam`."""
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr * 0.1)
    raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


INPUT_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "int64": torch.int64, "int32": torch.int32}


MAX_BATCH_SIZE = 2**31 - 1  # samples: torch indexes a batch dimension in 32 bits on GPUs
MAX_VOCAB = 2**63 - 1  # token ids are int64


def bounded(name: str, value: int, high: int, low: int = 1) -> int:
    """`value` of the count `name` if `low <= value <= high`; else bad input, said once."""
    if not low <= value <= high:
        raise ConfigError(f"{name} must be between {low} and {high}, got {value}")
    return value


@contextlib.contextmanager
def user_code(failed: str) -> Iterator[None]:
    """Runs the user's code (an import, a factory). Any failure of it is bad input reported
    as `failed: <error>`, including `sys.exit` and other `BaseException`s: a factory that
    exits must not end rematlab silently with its status. Ctrl-C stays Ctrl-C."""
    try:
        yield
    except (KeyboardInterrupt, ConfigError):
        raise
    except BaseException as exc:
        detail = (f"exit({exc.code})" if isinstance(exc, SystemExit)
                  else str(exc).splitlines()[0] if str(exc) else "")
        raise ConfigError(f"{failed}: {type(exc).__name__}: {detail}") from None


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


def make_example(batch: int, shape: tuple[int, ...] | None = None, *,
                 input_dtype: str = "float32", vocab: int | None = None,
                 example: str | None = None, device: torch.device | None = None,
                 seed: int = 0) -> Batch:
    """A synthetic batch: `example(batch)` from a user's factory (any batch form), or a tensor
    of `(batch, *shape)` — normal floats, or token ids below `vocab` for an integer dtype."""
    bounded("batch", batch, MAX_BATCH_SIZE)
    if vocab is not None:
        bounded("vocab", vocab, MAX_VOCAB)
    gen = torch.Generator().manual_seed(seed)
    if example is not None:
        factory = load_object(example, "example factory")
        with user_code(f"example factory {example!r} failed"):
            made = factory(batch)
        check_batch(made)
        return to_device(made, device) if device is not None else made
    if shape is None:
        raise ConfigError("give an input shape (--input-shape) or a batch factory (--example)")
    if input_dtype not in INPUT_DTYPES:
        raise ConfigError(f"unknown input dtype {input_dtype!r}; choose one of "
                          f"{sorted(INPUT_DTYPES)}")
    dtype = INPUT_DTYPES[input_dtype]
    if not dtype.is_floating_point and (not vocab or vocab <= 0):
        raise ConfigError(f"integer inputs ({input_dtype}) need a vocabulary size, e.g. "
                          "--vocab 50257")
    try:
        if dtype.is_floating_point:
            x = torch.randn(batch, *shape, generator=gen).to(dtype)
        else:
            x = torch.randint(0, vocab, (batch, *shape), generator=gen, dtype=dtype)
        return x.to(device) if device is not None else x
    except (RuntimeError, MemoryError, OverflowError) as exc:
        raise ConfigError(f"cannot make a batch of shape {(batch, *shape)}: "
                          f"{str(exc).splitlines()[0]}") from None


def cast(batch: Batch, dtype: torch.dtype) -> Batch:
    """Floating tensors of a batch in the model's dtype; token ids and masks as they are."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: cast(v, dtype) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(cast(v, dtype) for v in batch)
    return batch


@contextlib.contextmanager
def preserved(module: nn.Module) -> Iterator[None]:
    """Run a throw-away step: gradients, buffers and the RNG are as before afterwards."""
    grads = [p.grad for p in module.parameters()]
    buffers = [b.detach().clone() for b in module.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    for p in module.parameters():
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(module.parameters(), grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, saved in zip(module.buffers(), buffers, strict=True):
                b.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def is_oom(exc: BaseException) -> bool:
    """Whether an exception means the device ran out of memory (a result, not a failure)."""
    if isinstance(exc, (SimulatedOOM, MemoryError)):
        return True
    if torch.cuda.is_available() and isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return "out of memory" in text.lower() or "can't allocate memory" in text


def runs_on(model: nn.Module, run: Callable, batch: Batch, name: str) -> None:
    """One no-grad forward of `run` on `batch`, `model`'s state restored: a model that cannot
    take the batch (wrong shape, dtype, vocabulary, device) is bad input, said in one line,
    before anything is profiled or measured. Running out of memory is passed on as it is."""
    try:
        with torch.no_grad(), preserved(model):
            call(run, batch)
    except Exception as exc:
        if is_oom(exc):
            raise
        message = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(f"{name} fails on the batch: {type(exc).__name__}: "
                          f"{message}"[:300]) from exc
