"""The step, layout and trainer surfaces under a hostile but realistic user (issue 53): every
bad value refused where it is given, in one line (exit 2 from the CLI); the user's step
function priced wherever a step is, chains and pre-flight included; nothing it does escapes
as a traceback; and the floor plan's budget kept in loops that differ from rematlab's own
within what the `Step` describes."""

import functools
import json
import random
import sys

import pytest
import torch
from torch import nn

import rematlab
from rematlab import DDP, FSDP, ConfigError, Step
from rematlab.exceptions import OutOfMemory
from rematlab.remat.strategies import RematChain
from tests import clirun
from tests.meters import user_loop_peak
from tests.realzoo import _causal_lm, gpt2

STEP_FNS = '''
import sys
import torch
import torch.nn.functional as F

def ok(model, batch):
    return model(batch).square().mean()

def detached(model, batch):
    return model(batch).square().mean().detach()

def constant(model, batch):
    model(batch)
    return torch.tensor(1.0)

def integer(model, batch):
    return model(batch).sum().long()

def complex_loss(model, batch):
    return model(batch).sum() * (1 + 1j)

def skips(model, batch):
    return torch.zeros((), requires_grad=True)

def nothing(model, batch):
    model(batch)

def exits(model, batch):
    sys.exit(0)

def oom(model, batch):
    if torch.is_grad_enabled():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return model(batch).square().mean()

def oom_unless_checkpointed(model, batch):  # a plan that keeps everything is too big
    if torch.is_grad_enabled() and not getattr(getattr(model, "plan", None), "segments", 1):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return model(batch).square().mean()

def oom_planned(model, batch):  # only the planned step (a chain run by rematlab) is too big
    if torch.is_grad_enabled() and type(model).__name__ == "RematChain":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return model(batch).square().mean()
'''


@pytest.fixture(scope="module")
def fns(tmp_path_factory):
    d = tmp_path_factory.mktemp("fns")
    (d / "stepfns.py").write_text(STEP_FNS)
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))


def _chain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 4)), torch.randn(8, 32)


# -- Step: every value that would change the plan's meaning is refused when it is built --

@pytest.mark.parametrize(("kwargs", "match"), [
    ({"set_to_none": "no"}, "set_to_none must be True or False"),
    ({"output_alive": "false"}, "output_alive must be True .*, False .* or 'forward'"),
    ({"precision": "fp16", "scaler": "yes"}, "scaler must be"),
    ({"clip": True}, "max gradient norm"),
    ({"optimizer": torch.optim.AdamW, "optimizer_kwargs": None}, "mapping of keyword"),
    ({"optimizer": torch.optim.AdamW, "optimizer_kwargs": "lr"}, "mapping of keyword"),
    ({"optimizer": torch.optim.AdamW, "optimizer_kwargs": {"lr": -1.0}}, "AdamW"),
    ({"optimizer": torch.optim.AdamW, "optimizer_kwargs": {"nope": 1}}, "nope"),
    ({"optimizer": torch.optim.LBFGS}, "closure"),
])
def test_a_step_refuses_what_it_would_misread(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Step(**kwargs)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: DDP(2, bucket_cap_mb=1e-9), "bucket_cap_mb"),
    (lambda: DDP(2, bucket_cap_mb=float("inf")), "bucket_cap_mb"),
    (lambda: FSDP(2, units=("0", "0")), "listed twice"),
])
def test_a_layout_refuses_what_torch_would_fail_on_later(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_nested_fsdp_units_are_sharded_innermost_first():
    model, batch = gpt2(batch=2, seq=16, layers=2)
    step = Step(layout=FSDP(2, units=("transformer.h.0", "transformer.h.0.mlp")))
    found = rematlab.plan(model, batch, "1GiB", predict=True, target="cpu", step=step)
    assert found.measured_peak is None and found.predicted_peak <= 2**30  # nothing ran
    split = Step(layout=FSDP(2, units=("transformer",)))  # wte, tied to the root's lm_head
    with pytest.raises(ConfigError, match="tied parameter in two FSDP units"):
        rematlab.plan(model, batch, "1GiB", predict=True, target="cpu", step=split)


def test_a_predicted_fsdp_plan_is_refused_beyond_a_fake_groups_reach():
    from rematlab.distributed.group import MAX_PREDICTED_SHARDS

    model, x = _chain()
    with pytest.raises(ConfigError, match="at most"):
        rematlab.plan(model, x, "1GiB", predict=True, target="cpu",
                      step=Step(layout=FSDP(MAX_PREDICTED_SHARDS + 1)))
    found = rematlab.plan(model, x, "1GiB", predict=True, target="cpu",
                          step=Step(layout=DDP(1_000_000)))  # a DDP rank: any world size
    assert found.predicted_peak > 0 and found.measured_peak is None


@pytest.mark.parametrize("env", [
    {"RANK": "0"},
    {"RANK": "0", "WORLD_SIZE": "abc", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
    {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
    {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"},
])
def test_a_half_set_torchrun_environment_is_one_error(monkeypatch, env):
    from rematlab.distributed.group import join_job

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError):
        join_job("cpu")


# -- the loss and the user's step function --

@pytest.mark.parametrize(("name", "match"), [
    ("detached", "does not require grad"), ("constant", "does not require grad"),
    ("skips", "never ran the model"),
    ("integer", "int64 loss"), ("complex_loss", "complex64 loss"),
    ("nothing", "scalar tensor, got NoneType"), ("exits", "SystemExit"),
])
@pytest.mark.parametrize("predict", [False, True])
def test_a_step_function_without_a_loss_is_the_users_error(fns, name, match, predict):
    import stepfns

    model, x = _chain()
    kw = {"predict": True, "target": "cpu"} if predict else {}
    with pytest.raises(ConfigError, match=match):
        rematlab.plan(model, x, "1GiB", step=Step(fn=getattr(stepfns, name)), **kw)


@pytest.mark.parametrize(("loss_fn", "match"), [
    (lambda out, batch: out.sum().detach(), "does not require grad"),
    (lambda out, batch: None, "scalar tensor"),
    (lambda out, batch: out.square(), "shape"),
])
def test_a_loss_function_without_a_loss_is_the_users_error(loss_fn, match):
    model, x = _chain()
    with pytest.raises(ConfigError, match=match):
        rematlab.plan(model, x, "1GiB", step=Step(loss_fn=loss_fn))
    with pytest.raises(ConfigError, match=match):
        rematlab.max_batch(model, x, "1GiB", step=Step(loss_fn=loss_fn), repeats=0, limit=16)


def test_pre_flight_of_a_chain_prices_the_users_step_function():
    """The issue's case: a step function that holds a 64 MiB tensor beside a small chain,
    its batch an (x, y) pair; pre-flight is within 1 % of the measured step."""
    model, x = _chain()
    y = torch.randint(0, 4, (8,))

    def heavy(m, batch):
        inputs, labels = batch
        big = torch.randn(4096, 4096, requires_grad=True)
        return nn.functional.cross_entropy(m(inputs), labels) + (big * 2).sum() * 0

    step = Step(fn=heavy)
    predicted = rematlab.plan(model, (x, y), "1GiB", predict=True, target="cpu", step=step)
    measured = rematlab.plan(model, (x, y), "1GiB", step=step)
    assert measured.measured_peak > 2 * 2**26  # the big tensor and its gradient
    assert abs(predicted.predicted_peak - measured.measured_peak) \
        <= 0.01 * measured.measured_peak
    plain = rematlab.plan(model, x, "1GiB", predict=True, target="cpu")
    assert plain.predicted_peak < predicted.predicted_peak / 100


def test_running_out_of_memory_is_a_result_not_a_traceback(fns):
    import stepfns

    model, x = _chain()
    with pytest.raises(OutOfMemory, match="smallest plan"):
        rematlab.plan(model, x, "1GiB", step=Step(fn=stepfns.oom_planned))
    with pytest.raises(OutOfMemory, match="the profile"):
        rematlab.plan(model, x, "1GiB", step=Step(fn=stepfns.oom))
    with pytest.raises(MemoryError):  # what a search over batch sizes reads as "too big"
        rematlab.plan(model, x, "1GiB", step=Step(fn=stepfns.oom))
    torch.manual_seed(0)
    deep = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(6)])
    wide = torch.randn(256, 128)
    kept = rematlab.plan(deep, wide, "1GiB", step=Step(fn=stepfns.ok))
    assert not kept.segments  # the fastest plan keeps everything, unless that runs out
    found = rematlab.plan(deep, wide, "1GiB", step=Step(fn=stepfns.oom_unless_checkpointed))
    assert found.segments and found.measured_peak <= 2**30


# -- apply, LoRA, precisions --

def test_apply_takes_a_plan_read_back_as_json():
    model, x = _chain()
    chosen = rematlab.plan(model, x, "1GiB")
    planned = rematlab.apply(model, json.loads(chosen.to_json()))
    assert torch.equal(planned(x), model(x))
    with pytest.raises(ConfigError, match="not a rematlab plan"):
        rematlab.apply(model, {"n_blocks": 5})
    with pytest.raises(ConfigError, match="a strategy is"):
        rematlab.apply(model, 3)


def test_lora_adapts_gpt2s_conv1d_projections():
    from transformers.pytorch_utils import Conv1D

    from rematlab.core.lora import LoRALinear

    model, _ = gpt2(batch=2, seq=16, layers=2)
    adapted = rematlab.add_lora(model, rank=4)
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    assert any("c_attn" in n for n in trainable)
    conv = Conv1D(24, 16)  # rematlab's own adapter, where peft is not installed
    lora = LoRALinear(conv, rank=2)
    x = torch.randn(3, 16)
    assert torch.equal(lora(x), conv(x))  # B starts at zero: the base model's output
    lora.b.data.normal_()
    lora(x).sum().backward()
    assert lora.a.grad is not None and conv.weight.grad is None


def test_lightning_true_precisions_plan_the_weights_in_their_dtype():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)])
    x = torch.randn(64, 256)
    fp32 = rematlab.plan(model, x, "1GiB")
    true = rematlab.plan(model, x, "1GiB", step=Step(precision="bf16-true"))
    assert true.step["weights"] == "bfloat16" and true.step["precision"] == "bfloat16"
    assert true.measured_peak < 0.6 * fp32.measured_peak  # half the bytes, nearly
    assert next(model.parameters()).dtype == torch.float32  # the user's model as it was
    assert Step(precision="16-true").weights == torch.float16
    assert Step(precision="16-true").autocast is None


# -- the trainers' bridges, checked when made --

def test_lightning_callback_checks_what_it_is_given():
    from rematlab.integrations.lightning import RematCallback

    for bad, match in [({"attr": 123}, "attr names"), ({"budget": "lots"}, "size"),
                       ({"blockz": "h"}, "blockz"), ({"loss_fn": 3}, "callable")]:
        with pytest.raises(ConfigError, match=match):
            RematCallback(**bad)


def _lightning(callback):
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[callback])


def test_lightning_plans_a_module_whose_training_step_unpacks_the_batch():
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from rematlab.integrations.lightning import RematCallback

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, _ = _chain()
            self.lr = 0.1

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    data = TensorDataset(torch.randn(32, 32), torch.randint(0, 4, (32,)))
    remat = RematCallback("1GiB", attr="net")
    module = Classifier()
    trainer = _lightning(remat)
    trainer.fit(module, DataLoader(data, batch_size=8))
    assert remat.plan is not None and remat.plan.measured_peak <= 2**30
    assert trainer.global_step == 2
    assert isinstance(module.net, RematChain) and module.net.plan == remat.plan  # installed
    with pytest.raises(ConfigError, match="not the network"):
        _lightning(RematCallback("1GiB", attr="lr")).fit(Classifier(),
                                                         DataLoader(data, batch_size=8))


def test_hf_trainer_with_an_empty_dataset_is_one_error():
    from transformers import Trainer, TrainingArguments

    from rematlab.integrations.transformers import plan_trainer

    model, _ = gpt2(batch=2, seq=16, layers=2)
    args = TrainingArguments(output_dir="/tmp/rematlab-hf-empty", use_cpu=True, report_to=[],
                             save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=[])
    with pytest.raises(ConfigError, match="no training data"):
        plan_trainer(trainer, "1GiB")
    with pytest.raises(ConfigError, match="blockz"):
        plan_trainer(trainer, "1GiB", blockz="transformer.h")


# -- the floor budget in loops that differ from rematlab's own within the Step --

@pytest.mark.parametrize(("family", "precision"), [
    ("qwen2", "bf16"), pytest.param("mistral", "fp16", marks=pytest.mark.slow)])
def test_the_floor_budget_holds_in_a_held_back_user_loop(family, precision):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM)}[family]
    torch.manual_seed(0)
    model, batch = _causal_lm(*classes, batch=4, seq=64, layers=4, width=128)
    model.train()
    gen = torch.Generator().manual_seed(1)
    micro = [{"input_ids": (ids := torch.randint(0, 97, (4, 64), generator=gen)),
              "labels": ids} for _ in range(4)]
    step = Step(precision=precision, micro_batches=4, clip=1.0, optimizer=torch.optim.AdamW,
                optimizer_kwargs={"lr": 1e-4, "foreach": True})
    planning = rematlab.prepare(model, batch, step=step)
    floor = planning.floor_budget()
    chosen = planning.choose(floor)
    assert chosen.segments
    # a loop written apart from rematlab's: each micro-batch its own tensors, the loss divided
    # inside autocast, `del out` after backward, a real GradScaler under fp16, clipping,
    # foreach AdamW; metered by the live-storage tracker
    peak = user_loop_peak(rematlab.apply(model, chosen), micro, precision=precision, clip=1.0,
                          optimizer=functools.partial(torch.optim.AdamW, lr=1e-4,
                                                      foreach=True), meter="live")
    assert peak <= floor, (chosen.describe(), peak, floor)


# -- the CLI: one line and exit 2 for each, and a fuzz over the new flags --

CLI_CASES = [
    (["--step-fn", "stepfns:detached"], "does not require grad"),
    (["--step-fn", "stepfns:exits", "--json"], "SystemExit"),
    (["--step-fn", "stepfns:nothing"], "NoneType"),
    (["--step-fn", "stepfns:oom"], "out of memory"),
    (["--step-fn", "stepfns:oom_planned"], "smallest plan"),
    (["--predict", "--target", "h100-80gb", "--fsdp", "1000000"], "at most"),
    (["--precision", "bf16-false"], "unknown precision"),
]


@pytest.mark.parametrize(("args", "needle"), CLI_CASES)
def test_cli_refuses_in_one_line(fns, args, needle):
    proc = clirun.run(["plan", "--model", "mlp3", "--batch", "8", "--budget", "1GiB", *args],
                      cwd=fns)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = clirun.said(proc.stderr)
    assert len(lines) == 1 and needle in lines[0], lines
    assert proc.stdout == ""


def test_cli_predicts_ddp_and_reports_no_measured_peak(fns):
    proc = clirun.run(["plan", "--model", "mlp3", "--batch", "8", "--budget", "1GiB",
                       "--predict", "--target", "h100-80gb", "--ddp", "2", "--json"], cwd=fns)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["measured_peak"] is None and found["predicted_peak"] > 0
    assert found["per_rank"]["world_size"] == 2


FUZZ = {
    "--precision": ["fp32", "bf16", "fp16", "bf16-true", "16-true", "bf16-mixed", "int4", ""],
    "--micro-batches": ["1", "4", "0", "-3", "x", "1000001"],
    "--clip": ["1.0", "0", "-1", "nan", "inf", "abc"],
    "--step-fn": ["stepfns:ok", "stepfns:detached", "stepfns:nothing", "stepfns:missing",
                  "nomodule:fn", "stepfns"],
    "--fsdp": ["2", "0", "-1", "two", "5000"],
    "--ddp": ["2", "0", "abc"],
}


def test_fuzz_the_step_and_layout_flags(fns):
    """Random combinations of the step's and the layouts' flags, valid and not: each run is
    a plan (exit 0) or one error line (exit 2); never a traceback, a hang or a silent exit."""
    rng = random.Random(53)
    for _ in range(24):
        flags = rng.sample(sorted(FUZZ), rng.randint(1, 3))
        args = [a for f in flags for a in (f, rng.choice(FUZZ[f]))]
        proc = clirun.run(["plan", "--model", "mlp3", "--batch", "4", "--budget", "1GiB",
                           "--predict", "--target", "h100-80gb", "--json", *args], cwd=fns,
                          timeout=120)
        assert "Traceback" not in proc.stderr, (args, proc.stderr[-2000:])
        assert proc.returncode in (0, 2), (args, proc.returncode, proc.stderr[-2000:])
        if proc.returncode == 0:
            assert json.loads(proc.stdout)["measured_peak"] is None, args
        else:
            lines = clirun.said(proc.stderr)
            assert len(lines) == 1 and lines[0].startswith("error: "), (args, lines)



def test_measure_help_lists_every_optimizer_it_takes():
    from rematlab.core.optimizers import OPTIMIZERS

    proc = clirun.run(["measure", "--help"])
    assert proc.returncode == 0
    assert ", ".join(OPTIMIZERS) in " ".join(proc.stdout.split())


@pytest.mark.slow
def test_the_shared_floor_repro_keeps_its_budget_as_written():
    """`../shared/repro/user_step_floor.py` (issue 64), its three cases: Qwen2 and Mistral
    (4 layers, width 192, GQA 6/2, vocab 2048), bf16 or fp16 with a GradScaler, 4 fresh
    micro-batches of 4 x 128 tokens, loss divided inside autocast, clip 1.0, foreach AdamW,
    its Step saying `output_alive=False`. Its loop deletes `out` after backward, so the
    logits live through backward: False read as "dropped before backward" priced the floor
    without them, 1.1 % under the loop's peak. False is now priced through backward
    (`Step.output_alive`), and the floor plan keeps its budget."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = {"num_hidden_layers": 4, "hidden_size": 192, "intermediate_size": 512,
             "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 2048,
             "max_position_embeddings": 128}
    made = {"qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**shape)),
            "mistral": lambda: MistralForCausalLM(MistralConfig(**shape, sliding_window=64))}

    def model(name: str) -> torch.nn.Module:
        torch.manual_seed(0)
        return made[name]().train()

    gen = torch.Generator().manual_seed(10)
    micro = [{"input_ids": (ids := torch.randint(0, 2048, (4, 128), generator=gen)),
              "labels": ids} for _ in range(4)]
    adamw = functools.partial(torch.optim.AdamW, lr=1e-4, foreach=True)
    for name, precision in [("qwen2", "bf16"), ("mistral", "bf16"), ("qwen2", "fp16")]:
        step = Step(precision=precision, micro_batches=4, clip=1.0, optimizer=torch.optim.AdamW,
                    optimizer_kwargs={"lr": 1e-4, "foreach": True}, output_alive=False)
        planning = rematlab.prepare(model(name), micro[0], step=step)
        floor = planning.floor_budget()
        peak = user_loop_peak(rematlab.apply(model(name), planning.choose(floor)), micro,
                              precision=precision, clip=1.0, optimizer=adamw, meter="live")
        assert peak <= floor, (name, precision, peak, floor)
