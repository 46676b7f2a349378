"""The regime Panchal et al. measured ("The Cost of Avoiding Backpropagation", arXiv
2506.21833), scaled to a 2-core CPU: a pretrained transformer fine-tuned with LoRA rank 1.

FmAD and ZO are fine-tuning methods: their gradient estimates have a variance that grows with
the number of trainable parameters, so from scratch on a full model they stay near chance
(the old default of `rematlab gradients` showed it), while on a few hundred adapter weights
over a backbone that already represents the task they learn. So this module makes that
setting without downloads:

- *Data with structure*: topic documents. Each of 8 topics owns 16 of 256 tokens; a document
  of 32 tokens draws each token from its topic with probability `signal`, otherwise from 128
  background tokens (a bag-of-words classification like AGNews, generated).
- *Pretraining*: a BERT-style classifier from a transformers config (2 layers, width 32)
  trained by backpropagation to tell the 8 topics apart, once, cached on disk
  (`REMATLAB_CACHE`, default `~/.cache/rematlab`) as a weights-only file.
- *Downstream*: a related, harder task — which half of the topics a document belongs to,
  at a weaker signal — learned through LoRA rank 1 (α = 1) on every attention query and
  value projection and a new classification head; the backbone stays frozen (PEFT's
  default for sequence classification: adapters plus the head).

`matched` makes the paper's "comparable memory" exact: rematlab's plan for a budget equal to
another method's measured peak, with the batch split into the fewest micro-batches
(gradients accumulated, identical to the full batch's) that let a plan fit.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rematlab.core.files import cache_dir, write_bytes
from rematlab.core.lora import LoRALinear
from rematlab.exceptions import ConfigError, InfeasibleBudgetError
from rematlab.gradients.tasks import Task
from rematlab.plans.plan import Plan

MODEL = "bert-topics"
BLOCKS = "bert.encoder.layer"  # the layers transformers' loop runs
VOCAB, SEQ, TOPICS, TOPIC_TOKENS = 256, 32, 8, 16
CONFIG = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": SEQ,
          "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
PRETRAIN = {"signal": 0.25, "steps": 300, "batch": 32, "lr": 1e-3, "seed": 0}
DOWNSTREAM_SIGNAL = 0.05
HALVES = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])  # downstream label of each topic


def documents(n: int, labels_of_topic: torch.Tensor, signal: float, seed: int) -> Task:
    """`n` topic documents (80 % train, 20 % test) labelled by `labels_of_topic`."""
    g = torch.Generator().manual_seed(seed)
    topic = torch.randint(0, TOPICS, (n,), generator=g)
    background = torch.randint(TOPICS * TOPIC_TOKENS, VOCAB, (n, SEQ), generator=g)
    own = topic[:, None] * TOPIC_TOKENS + torch.randint(0, TOPIC_TOKENS, (n, SEQ), generator=g)
    ids = torch.where(torch.rand(n, SEQ, generator=g) < signal, own, background)
    y = labels_of_topic[topic]
    cut = int(0.8 * n)
    return Task("topics", ids[:cut], y[:cut], ids[cut:], y[cut:],
                int(labels_of_topic.max()) + 1)


def downstream() -> Task:
    return documents(5000, HALVES, DOWNSTREAM_SIGNAL, seed=2)


def _backbone(classes: int) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(**CONFIG, num_labels=classes, attn_implementation="eager")
    return BertForSequenceClassification(cfg)


def pretrained(progress: Callable[[str], None] | None = None) -> nn.Module:
    """The backbone trained on the 8-topic task, from the cache when it was made before
    with the same recipe (the file name hashes the recipe)."""
    import transformers

    recipe = json.dumps({"config": CONFIG, "pretrain": PRETRAIN,
                         "transformers": transformers.__version__,
                         "torch": torch.__version__.split("+")[0]}, sort_keys=True)
    path = cache_dir() / f"{MODEL}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}.pt"
    model = _backbone(TOPICS)
    if path.exists():
        try:
            model.load_state_dict(torch.load(path, weights_only=True))
            return model
        except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError):
            pass  # a damaged cache entry is made again
    if progress:
        progress(f"pretraining {MODEL} on the 8-topic task (cached in {path.parent})")
    torch.manual_seed(PRETRAIN["seed"])
    task = documents(20000, torch.arange(TOPICS), PRETRAIN["signal"], seed=PRETRAIN["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=PRETRAIN["lr"])
    gen = torch.Generator().manual_seed(PRETRAIN["seed"])
    model.train()
    for _ in range(PRETRAIN["steps"]):
        idx = torch.randint(0, len(task.x_train), (PRETRAIN["batch"],), generator=gen)
        loss = F.cross_entropy(model(task.x_train[idx]).logits, task.y_train[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    write_bytes(path, buf.getvalue())
    return model


def with_lora(backbone: nn.Module, classes: int, rank: int = 1, alpha: float = 1.0,
              seed: int = 0) -> nn.Module:
    """A copy of `backbone`, frozen, with LoRA adapters (rank, alpha) on every attention
    query and value projection and a new trainable head for `classes`."""
    model = copy.deepcopy(backbone)
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(seed)
    for layer in model.bert.encoder.layer:
        attention = layer.attention.self
        attention.query = LoRALinear(attention.query, rank, alpha)
        attention.value = LoRALinear(attention.value, rank, alpha)
    model.classifier = nn.Linear(model.classifier.in_features, classes)
    model.config.num_labels = classes
    return model


def finetune_model(seed: int, progress: Callable[[str], None] | None = None
                   ) -> tuple[nn.Module, Task]:
    """The model to fine-tune (pretrained backbone, adapters, head) and the downstream task."""
    task = downstream()
    return with_lora(pretrained(progress), task.classes, seed=seed), task


def layer_checkpointing(model: nn.Module) -> nn.Module:
    """The paper's baseline: transformers' own gradient checkpointing of every layer."""
    model.activation_checkpointing_enable()
    return model


@dataclass(frozen=True)
class Matched:
    """BP with rematlab's plan within a budget: the plan for micro-batches of `batch /
    accumulate` samples, gradients accumulated over `accumulate` of them."""

    plan: Plan
    accumulate: int
    budget: int


def matched(model: nn.Module, x: torch.Tensor, y: torch.Tensor, budget: int,
            optimizer: str = "momentum") -> Matched:
    """rematlab's fastest plan whose measured step peak fits `budget`, at the fewest
    micro-batches (a divisor of the batch) for which one fits. Gradients accumulate across
    micro-batches, so the `budget` a plan gets is less the trainable gradients' bytes, which
    stay alive between them."""
    from rematlab.planning.planner import plan

    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    n = len(x)
    for parts in [d for d in range(1, n + 1) if n % d == 0]:
        size = n // parts
        micro_y = y[:size]

        def loss_fn(out: object, _batch: object, labels: torch.Tensor = micro_y
                    ) -> torch.Tensor:
            return F.cross_entropy(out.logits, labels)

        limit = budget - (grads if parts > 1 else 0)
        try:
            chosen = plan(model, x[:size], limit, optimizer=optimizer, loss_fn=loss_fn,
                          blocks=BLOCKS)
        except InfeasibleBudgetError:
            continue
        return Matched(chosen, parts, limit)
    raise ConfigError(f"no plan fits {budget} bytes even one sample at a time")
