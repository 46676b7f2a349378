"""A batch is what the user's loop passes to the model: a tensor (`model(x)`), a tuple or
list (`model(*batch)`) or a str-keyed dict (`model(**batch)`, as Hugging Face loops pass
`input_ids`, `attention_mask`, `labels`, `pixel_values`). Every walk over a batch's (or an
output's) tensors goes through `tensors` (read) or `map_tensors` (rebuild), so that all forms
are handled in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from rematlab.core.checks import MAX_BATCH_SIZE, MAX_VOCAB, bounded, load_object, user_code
from rematlab.exceptions import ConfigError

Batch = Any  # torch.Tensor | tuple | list | dict[str, torch.Tensor]
# Every dtype a batch or a model may be given in, by the name the CLI and grids use.
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "int64": torch.int64, "int32": torch.int32}
FLOAT_DTYPES = {k: v for k, v in DTYPES.items() if v.is_floating_point}


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


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """`value` rebuilt with `fn` applied to each of its tensors, the structure kept (dicts,
    including transformers' ModelOutputs, become plain dicts; tuples and lists keep their
    type)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(fn, v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(fn, v) for v in value)
    return value


def detached(value: Any) -> Any:
    """A batch (or arguments) with every tensor detached, the structure kept."""
    return map_tensors(torch.Tensor.detach, value)


def to_device(batch: Batch, device: torch.device) -> Batch:
    return map_tensors(lambda t: t.to(device), batch)


def cast(batch: Batch, dtype: torch.dtype) -> Batch:
    """Floating tensors of a batch in the model's dtype; token ids and masks as they are."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, batch)


def resized(batch: Batch, size: int) -> Batch:
    """`batch` with `size` samples: every tensor whose first dimension is the batch's is
    indexed cyclically along it (token ids, masks and labels stay consistent)."""
    n = next(tensors(batch)).shape[0]

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.dim() and t.shape[0] == n:
            return t[torch.arange(size, device=t.device) % n]
        return t

    return map_tensors(one, batch)


def first_float(value: Any) -> torch.Tensor | None:
    """The first floating tensor of a batch, arguments or output (logits, a hidden state, an
    image), a model's own `loss` entry left out; None when there is none."""
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if k != "loss"}
    return next((t for t in tensors(value) if t.is_floating_point()), None)


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


def batch_bytes(batch: Batch, unit: int = 1) -> int:
    """Bytes of the batch's storages, each counted once (labels that are the input ids), each
    rounded up to the allocator's block size `unit`."""
    seen = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors(batch)}
    return sum(-(-n // unit) * unit for n in seen.values())


def one_tensor(batch: Batch) -> torch.Tensor:
    """The batch of a chain, which takes one tensor; a clear error for any other form."""
    if not isinstance(batch, torch.Tensor):
        raise ConfigError("a chain takes one tensor; name the layers (blocks=) of a model "
                          "with several inputs")
    return batch


def make_example(batch: int, shape: tuple[int, ...] | None = None, *,
                 input_dtype: str = "float32", vocab: int | None = None,
                 example: str | None = None, device: torch.device | None = None,
                 seed: int = 0, shapes_only: bool = False) -> Batch:
    """A synthetic batch: `example(batch)` from a user's factory (any batch form), or a tensor
    of `(batch, *shape)` — normal floats, or token ids below `vocab` for an integer dtype;
    with `shapes_only`, that tensor on the meta device (a batch to plan for, not to run)."""
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
    if input_dtype not in DTYPES:
        raise ConfigError(f"unknown input dtype {input_dtype!r}; choose one of "
                          f"{sorted(DTYPES)}")
    dtype = DTYPES[input_dtype]
    if not dtype.is_floating_point and (not vocab or vocab <= 0):
        raise ConfigError(f"integer inputs ({input_dtype}) need a vocabulary size, e.g. "
                          "--vocab 50257")
    try:
        if shapes_only:
            return torch.empty(batch, *shape, dtype=dtype, device="meta")
        if dtype.is_floating_point:
            x = torch.randn(batch, *shape, generator=gen).to(dtype)
        else:
            x = torch.randint(0, vocab, (batch, *shape), generator=gen, dtype=dtype)
        return x.to(device) if device is not None else x
    except (RuntimeError, MemoryError, OverflowError) as exc:
        raise ConfigError(f"cannot make a batch of shape {(batch, *shape)}: "
                          f"{str(exc).splitlines()[0]}") from None
