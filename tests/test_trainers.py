"""The trainers users run, with the real libraries on this CPU: HF `Trainer` (bf16, gradient
accumulation, clipping, its default column filter), Lightning (`bf16-mixed`, accumulation,
clipping) and Accelerate (`prepare`, `accumulate`). Each step's peak is metered by the
live-storage tracker around the trainer's own loop, from the second optimizer step on (the
first makes the optimizer state, and in Lightning also runs the planning)."""

import copy
import inspect

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import rematlab
from rematlab.core.probes import LiveTensorTracker
from rematlab.exceptions import ConfigError
from tests.realzoo import gpt2

BUDGET = 15 * 2**20


class Tokens(Dataset):
    """Token rows with a column the model does not take (the Trainer's filter drops it)."""

    def __init__(self, n: int = 16, seq: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 97, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i], "source": f"row {i}"}


def _model():
    torch.manual_seed(0)
    model, _ = gpt2(batch=4, seq=64, layers=8, width=64)
    return model.train()


class _Meter:
    """A live-storage tracker over a training run: the peak of each optimizer step after the
    first."""

    def __init__(self, model) -> None:
        self.tracker = LiveTensorTracker()
        self.tracker.track([*model.parameters(), *model.buffers()])
        self.peaks: list[int] = []
        self.started = False

    def step_begins(self) -> None:
        if self.started:
            self.peaks.append(self.tracker.peak)
        self.tracker.reset_peak()
        self.started = True

    def done(self) -> None:
        self.peaks.append(self.tracker.peak)


def _hf_trainer(model, meter=None):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            meter.step_begins()

    args = TrainingArguments(output_dir="/tmp/rematlab-hf", max_steps=4, use_cpu=True,
                             bf16=True, gradient_accumulation_steps=2, max_grad_norm=1.0,
                             per_device_train_batch_size=4, learning_rate=1e-3,
                             logging_steps=1, report_to=[], save_strategy="no", seed=0,
                             dataloader_num_workers=0)
    return Trainer(model=model, args=args, train_dataset=Tokens(),
                   callbacks=[Steps()] if meter else [])


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.slow  # 8 s: two trainings (make test keeps the HF Trainer's plan and refusal)
def test_hf_trainer_with_a_plan_trains_like_without_it_and_keeps_the_budget():
    from rematlab.integrations.transformers import plan_trainer, trainer_step

    plain = _hf_trainer(_model())
    plain.train()
    model = _model()
    meter = _Meter(model)
    trainer = _hf_trainer(model, meter)
    step = trainer_step(trainer)
    assert (step.autocast, step.micro_batches, step.clip) == (torch.bfloat16, 2, 1.0)
    assert step.optimizer is torch.optim.AdamW
    chosen = plan_trainer(trainer, BUDGET)
    assert chosen.segments  # the budget needs checkpointing
    assert inspect.signature(trainer.model.forward) == inspect.signature(model.forward)
    with meter.tracker:
        trainer.train()
    meter.done()
    assert _losses(trainer) == pytest.approx(_losses(plain), rel=1e-6)
    assert len(_losses(trainer)) == 4
    assert max(meter.peaks[1:]) <= BUDGET, (chosen.describe(), meter.peaks)


def test_hf_trainer_plans_within_what_this_machine_has():
    from rematlab.integrations.transformers import plan_trainer

    trainer = _hf_trainer(_model())
    chosen = plan_trainer(trainer)  # budget="auto": this CPU's memory holds the whole step
    assert chosen.budget > chosen.predicted_peak and not chosen.segments
    assert chosen.step["precision"] == "bfloat16" and chosen.step["micro_batches"] == 2


def test_hf_trainer_gradient_checkpointing_is_refused_beside_a_plan():
    from transformers import Trainer, TrainingArguments

    from rematlab.integrations.transformers import plan_trainer

    args = TrainingArguments(output_dir="/tmp/rematlab-hf", max_steps=1, use_cpu=True,
                             gradient_checkpointing=True, report_to=[], save_strategy="no")
    trainer = Trainer(model=_model(), args=args, train_dataset=Tokens())
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        plan_trainer(trainer, BUDGET)


def test_lightning_callback_plans_for_the_trainers_step_and_keeps_the_budget():
    import lightning.pytorch as pl

    from rematlab.integrations.lightning import RematCallback

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model()

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = LM()
    meter = _Meter(module)

    class Steps(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % 2 == 0:  # an optimizer step begins (2 micro-batches each)
                meter.step_begins()

    remat = RematCallback(BUDGET)
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=4,
                         accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[remat, Steps()])
    rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in Tokens()]
    with meter.tracker:
        trainer.fit(module, DataLoader(rows, batch_size=4))
    meter.done()
    assert remat.plan is not None and remat.plan.segments
    assert trainer.global_step == 4
    assert max(meter.peaks[1:]) <= BUDGET, (remat.plan.describe(), meter.peaks)


def test_accelerate_prepares_and_accumulates_a_planned_model_as_the_plain_one():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from rematlab.integrations.accelerate import accelerator_step

    rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in Tokens()]

    def train(planned: bool) -> list[float]:
        AcceleratorState._reset_state(reset_partial_state=True)  # a Trainer may have made one
        accelerator = Accelerator(cpu=True, mixed_precision="bf16",
                                  gradient_accumulation_steps=2)
        model = _model()
        if planned:
            step = accelerator_step(accelerator, optimizer=torch.optim.AdamW,
                                    optimizer_kwargs={"lr": 1e-3}, clip=1.0)
            assert (step.autocast, step.micro_batches) == (torch.bfloat16, 2)
            planning = rematlab.prepare(model, rows[0] | {k: v[None].expand(4, -1) for k, v
                                                          in rows[0].items()}, step=step)
            model = rematlab.apply(model, planning.choose(BUDGET))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt, loader = accelerator.prepare(model, opt, DataLoader(rows, batch_size=4))
        losses = []
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        return losses

    assert train(True) == pytest.approx(train(False), rel=1e-6)


def test_a_planned_model_deep_copies_for_a_second_trainer():
    model = _model()
    planned = rematlab.apply(model, "every:1")
    twin = copy.deepcopy(planned)
    assert inspect.signature(twin.forward) == inspect.signature(model.forward)


def test_peft_sees_the_same_model_before_and_after_a_plan():
    """A PEFT model plans through its layers under the user's bf16 step and keeps the
    budget; PEFT wraps a planned model as it wraps the plain one."""
    from peft import LoraConfig, get_peft_model

    lora = {"r": 4, "target_modules": ["c_attn"], "fan_in_fan_out": True}
    model, batch = gpt2(batch=4, seq=64, layers=8, width=64)
    peft_model = get_peft_model(model.train(), LoraConfig(**lora))
    planning = rematlab.prepare(peft_model, batch, step=rematlab.Step(precision="bf16"))
    budget = (planning.floor_budget() + planning.full) // 2
    chosen = planning.choose(budget)
    planned = rematlab.apply(peft_model, chosen)
    assert type(planned) is type(peft_model) and chosen.segments
    assert inspect.signature(planned.forward) == inspect.signature(peft_model.forward)
    from tests.meters import user_loop_peak

    peak = user_loop_peak(planned, batch, precision="bf16", meter="live",
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9))
    assert peak <= budget
    other, _ = gpt2(batch=4, seq=64, layers=2, width=64)
    wrapped = get_peft_model(rematlab.apply(other.train(), "every:1"), LoraConfig(**lora))
    wrapped(**batch).loss.backward()
    assert all(p.grad is not None for n, p in wrapped.named_parameters() if "lora_" in n)
