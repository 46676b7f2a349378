"""One training run of the gradient comparison (`rematlab.gradients.comparison`).

One training loop, interchangeable gradient estimators (`estimators`), all feeding the
same optimizer, on the tasks of `rematlab.gradients.tasks`:

- `bp`: backpropagation;
- `bp+ckpt[:STRATEGY]`: backpropagation through `rematlab.apply(model, STRATEGY)` (sqrt);
- `fmad:K`: forward gradient, g = mean over K random directions v of (grad f . v) v, computed
  with `torch.func.jvp` — no activations are stored;
- `zo:K`: two-point SPSA, g = mean over K directions z of (f(θ+εz) - f(θ-εz)) / 2ε · z, with
  MeZO's seed trick: z is never stored, it is regenerated from a per-direction seed when needed.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from rematlab.core import flops as flop_count
from rematlab.core.clocks import clock_for
from rematlab.core.guard import LOAD, HostLoad
from rematlab.core.optimizers import make_optimizer
from rematlab.core.probes import StepMemory, one_phase, peak_of
from rematlab.exceptions import ConfigError
from rematlab.gradients import peft
from rematlab.gradients.estimators import Method, ModelLoss, estimate, trainable
from rematlab.gradients.tasks import Task, build_model, digits, for_finetuning
from rematlab.remat.strategies import apply as apply_strategy


@dataclass
class Run:
    """One training run: curves at evaluation points and per-step costs."""

    model: str
    method: str
    seed: int
    lr: float
    finetune: bool
    steps: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    flops: list[float] = field(default_factory=list)
    cosine: list[float] = field(default_factory=list)
    flops_per_step: float = 0.0
    peak_bytes: int = 0
    param_bytes: int = 0
    diverged: bool = False
    foreign_load: float | None = None  # other processes' share of our CPUs during the run
    trusted: bool = True  # the foreign load stayed under the guard's threshold
    state: dict | None = field(default=None, repr=False)  # final weights, when asked for

    @property
    def final_accuracy(self) -> float:
        return self.accuracy[-1] if self.accuracy else 0.0

    def to_reach(self, target: float) -> dict[str, float | None]:
        for i, acc in enumerate(self.accuracy):
            if acc >= target:
                return {"steps": self.steps[i], "seconds": self.seconds[i],
                        "flops": self.flops[i]}
        return {"steps": None, "seconds": None, "flops": None}

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "state"}


def _logits(out: object) -> torch.Tensor:
    """A classifier's logits: the output itself, or a transformers output's `.logits`."""
    return out.logits if hasattr(out, "logits") else out


def _accuracy(model: nn.Module, task: Task) -> float:
    with torch.no_grad():
        return float((_logits(model(task.x_test)).argmax(1) == task.y_test).float().mean())


def _cosine(model: nn.Module, grads: list[torch.Tensor], loss_fn: ModelLoss) -> float:
    """Cosine similarity between the estimate in `.grad` and the true gradient."""
    params = [p for _, p in trainable(model)]
    est = torch.cat([g.flatten() for g in grads])
    true = torch.autograd.grad(loss_fn(model), params)
    true = torch.cat([t.flatten() for t in true])
    return float(F.cosine_similarity(est, true, dim=0))


Step = Callable[..., torch.Tensor]  # (model, optimizer, index) -> loss


def _step_costs(method: Method, model: nn.Module, loss_fn: ModelLoss, step: Step,
                lr: float, batch: list[torch.Tensor]) -> tuple[float, int]:
    """FLOPs of one gradient estimate, and the measured peak of one whole training step
    (estimate and optimizer step, with the optimizer's state, parameters, buffers and the
    batch alive), by `probes.StepMemory` as rematlab measures every step — on a copy, after
    a warm-up step that creates the optimizer's state, so training is untouched."""
    counter = flop_count.counter()
    probe = copy.deepcopy(model)
    with counter:
        estimate(method, probe, loss_fn, seed=0)
    opt = make_optimizer("momentum", [p for _, p in trainable(probe)], lr=lr)
    step(probe, opt, 0)
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    memory = peak_of(StepMemory(torch.device("cpu")),
                     [*probe.parameters(), *probe.buffers(), *state, *batch],
                     one_phase(lambda: step(probe, opt, 1)))
    return float(counter.get_total_flops()), memory.peak


def _setup(model_name: str, seed: int, finetune: bool,
           progress: Callable[[str], None] | None) -> tuple[nn.Module, Task]:
    """The network to train and its task: a pretrained transformer with LoRA adapters
    (`rematlab.gradients.peft`), or a zoo model on digits, optionally pretrained and adapted."""
    if model_name == peft.MODEL:
        return peft.finetune_model(seed, progress)
    net, task = build_model(model_name)
    if finetune:
        net = _pretrained(model_name, net, seed)
        net = for_finetuning(net, task.classes)
    return net, task


def _prepared(m: Method, net: nn.Module, model_name: str, matched: peft.Matched | None,
              example: torch.Tensor) -> nn.Module:
    """`net` as `m` trains it: plain, under a rematlab strategy, under transformers' layer
    checkpointing (`bp+ckpt:layers`), or under the matched-memory plan."""
    if m.kind != "bp+ckpt":
        return net
    blocks = peft.BLOCKS if model_name == peft.MODEL else None
    if m.strategy == "layers":
        if not hasattr(net, "activation_checkpointing_enable"):
            raise ConfigError("bp+ckpt:layers is transformers' layer checkpointing; "
                              f"{model_name} is not a transformers model")
        return peft.layer_checkpointing(net)
    if m.strategy == "matched":
        if matched is None:
            raise ConfigError("bp+ckpt:matched needs the budget of the method it matches")
        return apply_strategy(net, matched.plan, blocks=blocks,
                              example_input=example[: len(example) // matched.accumulate])
    return apply_strategy(net, m.strategy, blocks=blocks, example_input=example)


@dataclass(frozen=True)
class Training:
    """How one run trains: its seed, learning rate, steps, batch size, how often it is
    evaluated, whether it fine-tunes a pretrained model, the finite-difference step of
    zeroth-order estimates, and whether the final weights are kept."""

    seed: int = 0
    lr: float = 0.05
    steps: int = 150
    batch: int = 64
    eval_every: int = 15
    finetune: bool = False
    eps: float = 1e-3
    keep_weights: bool = False


TRAINING = frozenset(f.name for f in fields(Training))


def training_of(how: Training | None, keywords: dict[str, object],
                default: Training | None = None) -> Training:
    """`how` (else `default`, else `Training()`) with the `keywords` that name its fields
    changed; any other keyword is refused with the names known."""
    unknown = sorted(set(keywords) - TRAINING)
    if unknown:
        raise ConfigError(f"unknown training setting(s) {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(TRAINING))}")
    return replace(how or default or Training(), **keywords)


class _Estimate:
    """One training step of a method: its gradient estimate on the current batch
    (accumulated over `parts` micro-batches for a matched plan), `observe`d before the
    update, and the update."""

    def __init__(self, method: Method, parts: int, how: Training, x: torch.Tensor,
                 y: torch.Tensor) -> None:
        self.method, self.parts, self.how = method, parts, how
        self.x, self.y = x, y

    def loss_fn(self, mod: nn.Module) -> torch.Tensor:
        return _loss_on(mod, self.x, self.y)

    def __call__(self, mod: nn.Module, optimizer: torch.optim.Optimizer, index: int,
                 observe: Callable[[], None] | None = None) -> torch.Tensor:
        if self.parts == 1:
            loss = estimate(self.method, mod, self.loss_fn,
                            seed=self.how.seed * 100_003 + index * 131, eps=self.how.eps)
        else:
            for p in optimizer.param_groups[0]["params"]:
                p.grad = None
            total = torch.zeros(())
            for xs, ys in zip(self.x.chunk(self.parts), self.y.chunk(self.parts),
                              strict=True):
                part = _loss_on(mod, xs, ys) / self.parts
                part.backward()
                total += part.detach()
            loss = total
        if observe is not None:
            observe()
        optimizer.step()
        return loss


def _loss_on(mod: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_logits(mod(x)), y)


def train(model_name: str, method: str | Method, how: Training | None = None, *,
          matched: peft.Matched | None = None, progress: Callable[[str], None] | None = None,
          **keywords: object) -> Run:
    """Train one model with one gradient estimator; SGD with momentum 0.9 for every method.
    `how` (`Training`, or its fields as keywords) says how long and at which rate;
    `matched` (for `bp+ckpt:matched`): rematlab's plan and micro-batch count for a budget."""
    how = training_of(how, keywords)
    m = Method.parse(method) if isinstance(method, str) else method
    torch.manual_seed(how.seed)
    net, task = _setup(model_name, how.seed, how.finetune, progress)
    batch_x, batch_y = task.x_train[:how.batch], task.y_train[:how.batch]
    model = _prepared(m, net, model_name, matched, batch_x)
    parts = matched.accumulate if matched is not None and m.strategy == "matched" else 1
    step = _Estimate(m, parts, how, batch_x, batch_y)
    run = Run(model_name, str(m), how.seed, how.lr, how.finetune or model_name == peft.MODEL)
    run.flops_per_step, run.peak_bytes = _step_costs(m, model, step.loss_fn, step, how.lr,
                                                     [batch_x, batch_y])
    run.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    _train_loop(run, model, task, step, how)
    if how.keep_weights:
        run.state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return run


def _train_loop(run: Run, model: nn.Module, task: Task, step: _Estimate, how: Training
                ) -> None:
    """`how.steps` steps of `step` on random batches, evaluated every `how.eval_every`,
    timed by the device's clock (a training run is one long measurement, so the guard's
    evidence is the foreign load over all of it, `rematlab.core.guard.HostLoad`); a run
    whose loss is not finite or grows tenfold is stopped as diverged."""
    params = [p for _, p in trainable(model)]
    opt = make_optimizer("momentum", params, lr=how.lr)
    gen = torch.Generator().manual_seed(how.seed)
    elapsed, first_loss = 0.0, None
    clock, aside, host = clock_for(step.x.device), clock_for(step.x.device), HostLoad()
    host.start()
    for index in range(how.steps + 1):
        if index % how.eval_every == 0 or index == how.steps:
            run.steps.append(index)
            run.accuracy.append(_accuracy(model, task))
            run.seconds.append(elapsed)
            run.flops.append(index * run.flops_per_step)
        if index == how.steps:
            break
        idx = torch.randint(0, len(task.x_train), (how.batch,), generator=gen)
        step.x, step.y = task.x_train[idx], task.y_train[idx]
        untimed = 0.0

        def observe() -> None:  # the estimate against the true gradient, untimed
            nonlocal untimed
            aside.start()
            run.cosine.append(_cosine(model, [p.grad for p in params], step.loss_fn))
            untimed += aside.stop()

        clock.start()
        loss = step(model, opt, index, observe if index % how.eval_every == 0 else None)
        elapsed += clock.stop() - untimed
        value = float(loss)
        first_loss = first_loss if first_loss is not None else value
        if not math.isfinite(value) or value > 10 * max(first_loss, 1.0):
            run.diverged = True
            break
    run.foreign_load = host.stop()
    run.trusted = run.foreign_load is None or run.foreign_load <= LOAD


_PRETRAINED: dict[tuple[str, int], dict] = {}


def _pretrained(model_name: str, net: nn.Sequential, seed: int, steps: int = 200
                ) -> nn.Sequential:
    """The backbone for fine-tuning: trained by BP on digits 0-4 only (cached)."""
    key = (model_name, seed)
    if key not in _PRETRAINED:
        task = digits(image=model_name == "lenet5", classes=(0, 1, 2, 3, 4))
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            idx = torch.randint(0, len(task.x_train), (64,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(net(task.x_train[idx]), task.y_train[idx]).backward()
            opt.step()
        _PRETRAINED[key] = copy.deepcopy(net.state_dict())
    net.load_state_dict(_PRETRAINED[key])
    return net
