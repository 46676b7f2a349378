"""The model and batches a command plans for, from its flags (`plan`, `max-batch`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from rematlab.cli.app import _shape
from rematlab.exceptions import ConfigError


@dataclass(frozen=True)
class ModelSource:
    """The flags that say which model and batches a command plans for: a zoo name or
    factory, the input's scale, shape, dtype and vocabulary or an example file, the weights'
    dtype and the LoRA rank."""

    model: str
    input: str | None
    input_shape: str | None
    input_dtype: str
    vocab: int | None
    example: str | None
    dtype: str
    lora: int | None


def model_and_batches(source: ModelSource, device: str, predict: bool
                       ) -> tuple[Any, Callable[[int], Any]]:
    """The model (in `source.dtype`, with LoRA adapters of rank `source.lora`) and a factory
    of its example batches by size, on `device`; when predicting, the model is left where
    its factory built it (the meta device, for a model too large for this machine) and
    batches are made of shapes only (meta tensors).
    Integer inputs are token ids: a model that takes `labels` gets them (the ids), so that
    its loss — the logits' upcast to fp32 included — is in the step."""
    import inspect

    import torch

    from rematlab.core.batch import DTYPES, FLOAT_DTYPES, make_example
    from rematlab.core.lora import add_lora
    from rematlab.measurement import zoo
    from rematlab.measurement.spec import available, parse_device

    dtype, input_dtype = source.dtype, source.input_dtype
    if dtype not in FLOAT_DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {sorted(FLOAT_DTYPES)}")
    dev = torch.device("meta") if predict else available(parse_device(device))
    if source.model.startswith("hf:"):
        net, vocab = hf_model(source.model.removeprefix("hf:"), predict)
        if source.input_shape is None:
            raise ConfigError("a Hugging Face model takes token ids: give the sequence "
                              "length, --input-shape 4096")
        shape = _shape(source.input_shape)
        source = replace(source, vocab=source.vocab or vocab,
                         input_dtype=("int64" if source.input_dtype == "float32"
                                      else source.input_dtype))
        input_dtype = source.input_dtype
    else:
        net, shape, _ = zoo.resolve(source.model, source.input, _shape(source.input_shape))
    net = net.to(FLOAT_DTYPES[dtype])
    if source.lora is not None:
        net = add_lora(net, source.lora)
    if not predict:
        net = net.to(dev)
    tokens = (source.example is None and input_dtype in DTYPES
              and not DTYPES[input_dtype].is_floating_point
              and "labels" in inspect.signature(net.forward).parameters)

    def batches(size: int) -> Any:
        x = make_example(size, shape, input_dtype=input_dtype, vocab=source.vocab,
                         example=source.example, device=None if predict else dev,
                         shapes_only=predict)
        return {"input_ids": x, "labels": x} if tokens else x

    batches(2)  # bad input fails here, before any work
    return net.train(), batches


def hf_model(config: str, meta: bool) -> tuple[Any, int | None]:
    """A causal language model from a Hugging Face config (a `config.json`, or a folder
    holding one; nothing is downloaded), built on the meta device when `meta` (no weight
    allocated: an 8B model plans here), with its vocabulary size."""
    from pathlib import Path

    import torch
    import transformers

    path = Path(config)
    if not path.exists():
        raise ConfigError(f"no Hugging Face config at {config!r}: give a config.json or a "
                          "folder with one")
    try:
        cfg = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{config} is not a Hugging Face config: "
                          f"{str(exc).splitlines()[0]}"[:300]) from None
    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            net = transformers.AutoModelForCausalLM.from_config(cfg)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"{config}: no causal language model for its model_type "
                          f"{getattr(cfg, 'model_type', '?')!r}: {str(exc).splitlines()[0]}"
                          [:300]) from None
    return net, getattr(cfg, "vocab_size", None)
