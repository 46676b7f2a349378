"""Plans for the step users really run (`rematlab.Step`): bf16 autocast, fp16 with a
GradScaler, gradient accumulation with clipping and AdamW, the user's own step function. Each
plan is held against the user's own loop written with torch's APIs and measured by torch's
MemTracker (the live-storage tracker where several forwards run per step), and its
gradients against the plain model's under the same step."""

import functools
import inspect

import pytest
import torch

import rematlab
from rematlab.core.recipe import Step
from rematlab.exceptions import ConfigError
from tests.grads import assert_grads_match, step_grads
from tests.meters import loss_loop_peak, user_loop_peak
from tests.realzoo import gpt2, llama

MODELS = {"gpt2": functools.partial(gpt2, batch=4, seq=64, layers=8, width=64),
          "llama": functools.partial(llama, batch=4, seq=64, layers=8, width=64)}
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)
CASES = {
    "bf16": ({"precision": "bf16"}, {"precision": "bf16"}),
    "fp16-scaler": ({"precision": "fp16"}, {"precision": "fp16"}),
    "accumulate-clip-adamw": ({"micro_batches": 4, "clip": 1.0},
                              {"micro_batches": 4, "clip": 1.0, "meter": "live"}),
}


# GPT-2 under two of the cases in `make test`, every other pair in `make test-slow`
@pytest.mark.parametrize(("name", "case"), [
    ("gpt2", "accumulate-clip-adamw"),  # bf16 in a user's loop: test_surfaces' qwen2-bf16
    *(pytest.param(name, case, marks=pytest.mark.slow) for name, case in
      [("gpt2", "bf16"), ("gpt2", "fp16-scaler"), ("llama", "fp16-scaler"), ("llama", "bf16"),
       ("llama", "accumulate-clip-adamw")])])
def test_a_plan_for_the_users_step_keeps_its_budget_uses_it_and_keeps_gradients(name, case):
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    model.train()
    step_kw, loop_kw = CASES[case]
    step = rematlab.Step(optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-4},
                         **step_kw)
    planning = rematlab.prepare(model, batch, step=step)
    floor, full = planning.floor_budget(), planning.full
    assert floor < full
    plain = user_loop_peak(model, batch, optimizer=ADAMW, **loop_kw)
    budgets = [floor, (floor + full) // 2, max(full, plain)]
    for budget in budgets:
        chosen = planning.choose(budget)
        planned = rematlab.apply(model, chosen)
        peak = user_loop_peak(planned, batch, optimizer=ADAMW, **loop_kw)
        assert peak <= budget, (budget, chosen.describe(), peak)
        if budget == budgets[1]:
            assert peak >= 0.9 * budget, (budget, chosen.describe(), peak)
    # gradients under the floor plan equal the plain model's under the same step
    planned = rematlab.apply(model, planning.choose(floor))
    model.eval()  # no dropout: two runs of the plain model agree
    precision, k = step_kw.get("precision"), step_kw.get("micro_batches", 1)
    expected = step_grads(model, batch, precision, k)
    got = step_grads(planned, batch, precision, k, params=model.parameters())
    model.train()
    assert_grads_match(got, expected, precision)


def test_a_plan_made_for_fp32_wastes_budget_in_an_autocast_loop():
    """The issue's case: the autocast-aware plan checkpoints fewer layers at the same budget
    than a plan made for fp32, and still fits the user's autocast loop."""
    torch.manual_seed(0)
    model, batch = MODELS["gpt2"]()
    model.train()
    bf16 = rematlab.prepare(model, batch, step=rematlab.Step(precision="bf16"))
    fp32 = rematlab.prepare(model, batch)
    budget = (bf16.floor_budget() + bf16.full) // 2
    aware = bf16.choose(budget)
    unaware = fp32.choose(max(budget, fp32.floor_budget()))
    assert len(aware.segments) < len(unaware.segments)
    assert user_loop_peak(rematlab.apply(model, aware), batch, precision="bf16",
                          optimizer=functools.partial(torch.optim.SGD, lr=0.01,
                                                      momentum=0.9)) <= budget


def test_the_users_own_step_function_is_what_the_budget_holds():
    torch.manual_seed(0)
    model, batch = MODELS["gpt2"]()
    model.train()

    def my_step(m, b):  # a loss with an auxiliary term, on the logits
        out = m(**b)
        return out.loss + 1e-3 * out.logits.float().square().mean()

    step = rematlab.Step(fn=my_step, precision="bf16")
    planning = rematlab.prepare(model, batch, step=step)
    budget = (planning.floor_budget() + planning.full) // 2
    chosen = planning.choose(budget)
    planned = rematlab.apply(model, chosen)
    assert loss_loop_peak(model, batch, lambda: my_step(planned, batch)) <= budget
    assert chosen.measured_peak <= budget


def test_accumulation_is_priced_with_every_gradient_alive():
    """With several micro-batches the floor rises by about the gradients' bytes."""
    torch.manual_seed(0)
    model, batch = MODELS["gpt2"]()
    one = rematlab.prepare(model, batch, step=rematlab.Step(optimizer=None))
    four = rematlab.prepare(model, batch, step=rematlab.Step(optimizer=None, micro_batches=4))
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert four.costs.grads_resident and not one.costs.grads_resident
    assert four.costs.base - one.costs.base == grads
    assert four.floor > one.floor


def test_apply_keeps_the_forward_signature_and_refuses_double_checkpointing():
    model, batch = MODELS["gpt2"]()
    planned = rematlab.apply(model, "every:1")
    assert inspect.signature(planned.forward) == inspect.signature(model.forward)
    layer = planned.transformer.h[0]
    assert inspect.signature(layer.forward) == inspect.signature(
        type(layer).forward.__get__(layer))
    model.gradient_checkpointing_enable()
    with pytest.raises(ConfigError, match="gradient_checkpointing_disable"):
        planned(**batch)
    with pytest.raises(ConfigError, match="gradient_checkpointing_disable"):
        rematlab.apply(model, "every:1")
    model.gradient_checkpointing_disable()
    planned(**batch).loss.backward()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"precision": "int8"}, "unknown precision"),
    ({"micro_batches": 0}, "micro_batches"),
    ({"clip": -1.0}, "clip"),
    ({"optimizer": "lion"}, "unknown optimizer"),
    ({"optimizer": dict}, "torch.optim.Optimizer class"),
    ({"optimizer": "adamw", "optimizer_kwargs": {"lr": 1.0}}, "optimizer class"),
    ({"precision": "bf16", "scaler": True}, "GradScaler goes with fp16"),
    ({"fn": lambda m, b: 0, "loss_fn": lambda o, b: 0}, "give the loss once"),
])
def test_a_bad_step_is_one_clear_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        rematlab.Step(**kwargs)


def test_the_step_is_said_once():
    model, batch = MODELS["gpt2"]()
    with pytest.raises(ConfigError, match="say the step once"):
        rematlab.prepare(model, batch, optimizer="adam", step=rematlab.Step())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_pre_flight_prices_the_users_step_as_a_real_run_does(precision):
    """Fake-tensor costs of the autocast step (a GradScaler's optimizer phase included) have
    the bytes of the measured profile, its cast weights among them."""
    from rematlab.preflight.targets import resolve_target
    from rematlab.remat.layer_costs import profile_layers
    from rematlab.remat.profiling import Profiling
    from rematlab.remat.structure import structure
    from tests.test_preflight import BYTES, PLAIN_CPU

    model, batch = gpt2(batch=2, seq=16, layers=2)
    model.train()
    layers = structure(model, batch).blocks
    step = rematlab.Step(precision=precision, micro_batches=2, clip=1.0,
                         optimizer=torch.optim.AdamW)
    real = profile_layers(model, batch, layers, Profiling(step, repeats=1))
    fake = profile_layers(model, batch, layers,
                          Profiling(step, target=resolve_target(PLAIN_CPU)))
    for key in BYTES:  # equal bytes; transient peaks: the real run's kernels' scratch on top
        if key not in ("fwd_mem", "bwd_mem"):
            assert getattr(fake, key) == getattr(real, key), key
    for key in ("fwd_mem", "bwd_mem"):  # low-precision CPU matmuls allocate scratch (oneDNN)
        for r, f in zip(getattr(real, key), getattr(fake, key), strict=True):
            assert r >= f - 256, key  # which only the allocator sees
    assert real.cast == fake.cast and all(c > 0 for c in real.cast[1:-1])
    assert fake.grads_resident
    fp32 = profile_layers(model, batch, layers, Profiling(Step(optimizer="adamw"), repeats=1))
    assert sum(real.saved) < sum(fp32.saved)  # autocast saves low-precision tensors
    assert not fp32.cast


@pytest.mark.slow
def test_max_batch_and_auto_take_the_users_step():
    torch.manual_seed(0)
    model, batch = MODELS["gpt2"]()
    model.train()
    step = rematlab.Step(precision="bf16", micro_batches=2)
    budget = 12 * 2**20
    found = rematlab.max_batch(model, batch, budget, step=step, repeats=1, limit=16)
    for fit in found.fits:
        assert fit.peak <= budget and fit.batch >= 1
    remat = rematlab.auto(model, budget, step=step)
    for _ in range(2):
        for _ in range(step.micro_batches):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = remat(**batch).loss / step.micro_batches
            loss.backward()
        model.zero_grad(set_to_none=True)
    assert len(remat.events) == 1 and remat.events[0].peak <= budget


def test_the_optimizers_implementation_and_the_zero_grad_are_priced():
    """foreach AdamW's temporaries are larger than the single-tensor loop's, fused has none;
    gradients the loop zeroes rather than frees are resident like accumulated ones."""
    from rematlab.remat.chain import optimizer_memory

    params = [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(8)]

    def transient(**kw):
        step = rematlab.Step(optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-3, **kw})
        return optimizer_memory(params, step)

    (state, foreach), (_, single), (_, fused) = (transient(foreach=True),
                                                 transient(foreach=False), transient(fused=True))
    assert state == 2 * sum(p.numel() * 4 for p in params) + 8 * 4  # moments and steps
    assert foreach > single > fused
    model, batch = MODELS["gpt2"]()
    zeroed = rematlab.prepare(model, batch, step=rematlab.Step(set_to_none=False))
    freed = rematlab.prepare(model, batch)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert zeroed.costs.grads_resident and zeroed.costs.base - freed.costs.base == grads
    assert zeroed.floor_budget() > freed.floor_budget()  # the zeros were measured


def test_how_long_the_loop_holds_the_output_is_priced_as_it_runs():
    """`Step.output_alive`: True holds the logits to the step's end, False through their
    backward (a loop with `del out` after `loss.backward()`, as `../shared/repro` runs),
    "forward" drops them before backward (HF Trainer's and Lightning's loss functions return
    the loss alone). With a large vocabulary each reading prices what its loop holds, and the
    plan keeps its budget in that loop; reading False as "forward" would not."""
    torch.manual_seed(0)
    model, batch = gpt2(batch=4, seq=64, layers=6, width=64)
    model.resize_token_embeddings(4096)
    model.train()
    adamw = {"optimizer": torch.optim.AdamW, "optimizer_kwargs": {"lr": 1e-4}}
    kept, after = (rematlab.prepare(model, batch, step=rematlab.Step(
        precision="bf16", output_alive=alive, **adamw)) for alive in (True, False))
    dropped = rematlab.prepare(model, batch, step=rematlab.Step(precision="bf16",
                                                                output_alive="forward"))
    logits = 4 * 64 * 4096 * 2  # bf16, what the loss's upcast leaves unsaved
    assert kept.full >= after.full
    assert after.full - dropped.full >= 0.9 * logits
    budget = (dropped.floor_budget() + dropped.full) // 2
    planned = rematlab.apply(model, dropped.choose(budget))
    peak = loss_loop_peak(model, batch, lambda: planned(**batch).loss)  # Trainer-like
    assert 0.9 * budget <= peak <= budget
    floor = after.floor_budget()
    peak = user_loop_peak(rematlab.apply(model, after.choose(floor)), batch, precision="bf16",
                          optimizer=ADAMW, meter="live")  # `del out` after backward
    assert peak <= floor
    assert peak > floor - logits  # the logits are in this loop's peak
