"""The CUDA paths (NVIDIA, and AMD ROCm through `torch.cuda`), on a real GPU: skipped without
one. `scripts/gpu_check.sh` runs them and records the outcome in its folder. What a GPU
measured once is replayed on every CPU run from its fact files (`tests/test_gpu_facts.py`);
these tests are what only a GPU can check."""

import copy

import pytest
import torch

import rematlab
from rematlab.core.batch import call
from rematlab.core.clocks import CudaEventClock, WallClock
from rematlab.core.steps import default_loss
from rematlab.measurement import zoo
from rematlab.measurement.measure import measure
from rematlab.measurement.spec import Spec
from rematlab.planning.planner import prepare
from tests import realzoo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")

CUDA = torch.device("cuda", 0)  # an index: set_per_process_memory_fraction insists on one
STRATEGIES = ["none", "uniform:2", "every:1", "sqrt", "selective"]


@pytest.mark.parametrize(("name", "batch"), [("mlp5", 512), ("lenet5", 256), ("alexnet", 64),
                                              ("vgg16", 64)])
def test_simulated_step_peak_is_within_a_percent_of_max_memory_allocated(name, batch):
    model, shape, _ = zoo.resolve(name, "cifar" if name in ("alexnet", "vgg16") else None)
    model = model.to(CUDA).train()
    x = torch.randn(batch, *shape, device=CUDA)
    planning = prepare(model, x)
    low = planning.floor_budget()  # the simulation counts the BLAS workspaces: its floor
    assert planning.floor >= 0.99 * low  # is the one verification finds (issue 49)
    for fraction in (0.0, 0.5, 1.0):
        budget = int(low + fraction * (max(low, planning.full) - low))
        chosen = planning.choose(budget)
        assert chosen.measured_peak <= budget
        error = (chosen.predicted_peak - chosen.measured_peak) / chosen.measured_peak
        assert -0.01 <= error <= 0.03, (name, chosen.describe(), error)


def test_cuda_event_timing_agrees_with_a_synchronised_wall_clock():
    a = torch.randn(4096, 4096, device=CUDA)
    events, wall = CudaEventClock(), WallClock(CUDA)
    for _ in range(3):  # warm up the kernels and the clocks
        a @ a
    torch.cuda.synchronize()
    wall.start()
    events.start()
    for _ in range(20):
        a @ a
    by_events = events.stop()
    by_wall = wall.stop()
    assert by_events > 0 and abs(by_events - by_wall) / by_wall < 0.10


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float64_gradients_on_the_gpu_equal_the_plain_model(strategy):
    model = zoo.vgg16("cifar").double().to(CUDA).train()
    x = torch.randn(8, 3, 32, 32, dtype=torch.float64, device=CUDA)

    def grads(run):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        default_loss(call(run, x), x).backward()
        return [p.grad.clone() for p in model.parameters()]

    want = grads(model)
    got = grads(rematlab.apply(model, strategy, example_input=x))
    for a, b in zip(want, got, strict=True):
        assert (a - b).abs().max().item() <= 1e-12


def test_a_real_model_plans_on_the_gpu_and_keeps_its_budget():
    from tests import realzoo

    model, batch = realzoo.gpt2(batch=8, seq=128)
    model = model.to(CUDA).train()
    batch = {k: v.to(CUDA) for k, v in batch.items()}
    planning = prepare(model, batch)
    budget = int(0.5 * (planning.floor_budget() + planning.full))
    chosen = planning.choose(budget)
    assert chosen.measured_peak <= budget
    assert abs(chosen.predicted_peak - chosen.measured_peak) / chosen.measured_peak < 0.03


def test_bf16_runs_and_is_measured():
    obs = measure(Spec(model="vgg16", input="cifar", batch=32, dtype="bfloat16", device="cuda",
                       strategy="sqrt", repeats=2))
    assert obs.outcome == "ok", obs.error
    assert "cuda" in obs.methods["peak"].lower()
    # the step holds at least its parameters and their gradients, and at most what the
    # process ever allocated (the allocator's own high-water mark, read independently)
    held = obs.figures["param_bytes"] + obs.figures["grad_bytes"]
    assert held <= obs.peak <= torch.cuda.max_memory_allocated(CUDA)
    assert obs.reserved[0] >= obs.peak


def test_oom_on_a_capped_device_is_an_outcome_not_a_crash():
    total = torch.cuda.get_device_properties(CUDA).total_memory
    fraction = min(1.0, 2**30 / total)  # about 1 GiB of this card
    torch.cuda.set_per_process_memory_fraction(fraction, CUDA)
    try:
        obs = measure(Spec(model="vgg16", input="imagenet", batch=256, device="cuda",
                           repeats=1))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, CUDA)
        torch.cuda.empty_cache()
    assert obs.outcome == "oom", obs.error


def test_preflight_peaks_match_the_measured_on_the_gpu_here():
    """Issue 28: planned without running for this GPU (calibrated) and for its data sheet,
    each plan's predicted peak within 5 % of its measured step peak; both targets count the
    card's BLAS workspaces, as the measured step does (issue 49)."""
    model, batch = realzoo.gpt2(batch=16, seq=256, layers=4, width=512)
    model = model.cuda().train()
    batch = {k: v.cuda() for k, v in batch.items()}
    measured = prepare(model, batch)
    for target in ("cuda", "h100-80gb"):
        predicted = prepare(model, batch, predict=True, target=target)
        low, high = predicted.floor_budget(), int(predicted.full * 1.02)
        for fraction in (0.0, 0.5, 1.0):
            chosen = predicted.choose(int(low + fraction * (high - low)))
            peak = measured.measure(chosen)
            assert abs(chosen.predicted_peak - peak) <= 0.05 * peak


def test_a_second_model_on_the_card_changes_no_step_peak():
    """Issue 49: a step's peak is the step's, not the process's: another model's tensors on
    the card are reported beside it (`StepMemory.other`), never in it."""
    model, shape, _ = zoo.resolve("mlp5", None)
    model = model.to(CUDA).train()
    x = torch.randn(256, *shape, device=CUDA)
    planning = prepare(model, x)
    chosen = planning.unconstrained
    alone = planning.measure(chosen)
    other = torch.empty(512 * 2**20, dtype=torch.uint8, device=CUDA)  # a 512 MiB neighbour
    beside = planning.measure(chosen)
    del other
    assert abs(beside - alone) <= 0.01 * alone


def test_budget_auto_on_the_card_leaves_out_other_tensors():
    model, shape, _ = zoo.resolve("mlp5", None)
    model = model.to(CUDA).train()
    x = torch.randn(256, *shape, device=CUDA)
    before = prepare(model, x).budget("auto")
    other = torch.empty(1 << 30, dtype=torch.uint8, device=CUDA)
    after = prepare(model, x).budget("auto")
    del other
    assert after.nbytes <= before.nbytes - (1 << 30) * 0.99
    assert "other tensors" in after.how
    plan = rematlab.plan(model, x, "auto")
    assert plan.measured_peak <= after.nbytes


def test_compiled_plans_on_the_gpu_keep_their_budget():
    model, batch = realzoo.gpt2(batch=4, seq=64, layers=2, width=64)
    model = model.to(CUDA).train()
    batch = {k: v.to(CUDA) for k, v in batch.items()}
    planning = prepare(model, batch, compile=True)
    budget = planning.floor_budget()
    chosen = planning.choose(budget)
    assert chosen.measured_peak is not None and chosen.measured_peak <= budget


def test_fp16_with_a_grad_scaler_plans_and_keeps_its_budget():
    model, batch = realzoo.gpt2(batch=4, seq=64, layers=2, width=64)
    model = model.to(CUDA).train()
    batch = {k: v.to(CUDA) for k, v in batch.items()}
    step = rematlab.Step(precision="fp16", optimizer=torch.optim.AdamW)
    assert step.scaled
    planning = prepare(model, batch, step=step)
    budget = int(0.5 * (planning.floor_budget() + planning.full))
    chosen = planning.choose(budget)
    assert chosen.measured_peak <= budget


def test_op_level_options_plan_on_the_gpu_with_equal_gradients():
    model, batch = realzoo.gpt2(batch=4, seq=64, layers=2, width=64)
    model = model.to(CUDA).train()
    batch = {k: v.to(CUDA) for k, v in batch.items()}
    planning = prepare(model, batch, ops=True)
    chosen = planning.choose(int(0.5 * (planning.floor_budget() + planning.full)))
    assert chosen.measured_peak <= chosen.budget

    def grads(run):
        run.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        call(run, batch).loss.backward()
        return [p.grad.clone() for p in run.parameters()]

    want = grads(model)
    got = grads(rematlab.apply(copy.deepcopy(model), chosen))
    for a, b in zip(want, got, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_two_ranks_keep_their_budgets(tmp_path):
    from tests.ranks import nccl_worker, spawn

    for result in spawn(nccl_worker, 2, tmp_path, backend="nccl"):
        for budget, measured in result["rows"]:
            assert measured <= budget
