"""Pre-flight (issue 28): plans and predictions without running, for targets that are not here
and models that do not fit here. Fake-tensor costs must be the real run's bytes; a model on the
meta device must plan without its weights; the CUDA allocator's rounding must follow its
documented rules."""

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from rematlab.core.lora import LoRALinear, add_lora
from rematlab.core.optimizers import MixedAdamW
from rematlab.core.recipe import Step
from rematlab.exceptions import ConfigError, InfeasibleBudgetError
from rematlab.planning.maxbatch import max_batch
from rematlab.planning.planner import prepare
from rematlab.planning.predicted import room, with_margin
from rematlab.preflight import allocator
from rematlab.preflight.pricing import interval
from rematlab.preflight.targets import PROFILES, Target, resolve_target
from rematlab.remat.chain import profile_chain
from rematlab.remat.layer_costs import profile_layers
from rematlab.remat.profiling import Profiling
from rematlab.remat.structure import structure
from tests import realzoo
from tests.clirun import run

# A target without calibration: these tests are about bytes, not times.
PLAIN_CPU = {"name": "test-cpu", "kind": "cpu", "memory": "24GiB", "flops": 5e10,
             "bandwidth": 1e10, "overhead": [1e-6, 2e-6, 4e-6]}
BYTES = ("x", "saved", "keeps_input", "keeps_output", "fwd_mem", "grad", "base", "state",
         "optimizer_peak")


def _cnn() -> tuple[list[nn.Module], torch.Tensor]:
    blocks = [nn.Sequential(nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1), nn.BatchNorm2d(8),
                            nn.ReLU()) for i in range(3)]
    return [*blocks, nn.Sequential(nn.Flatten(), nn.Linear(8 * 16 * 16, 10))], \
        torch.randn(4, 3, 16, 16)


def _assert_same_bytes(real, fake, scratch: float = 0.05) -> None:
    """Equal bytes; transient peaks within a few scalars (constants a fake run makes
    differently), and backward's real peak above the fake one by at most `scratch`: the
    allocator also sees kernels' scratch buffers, which no tensor holds."""
    for key in BYTES:
        if key == "fwd_mem":
            for r, f in zip(real.fwd_mem, fake.fwd_mem, strict=True):
                assert abs(r - f) <= 256
        else:
            assert getattr(fake, key) == getattr(real, key), key
    for r, f in zip(real.bwd_mem, fake.bwd_mem, strict=True):
        assert f - 256 <= r <= (1 + scratch) * f + 16384


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_fake_costs_of_a_chain_are_the_real_runs_bytes(kind):
    if kind == "mlp":
        blocks = [nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1))
                  for _ in range(4)]
        x = torch.randn(16, 32)
    else:
        blocks, x = _cnn()
    real = profile_chain(blocks, x, Profiling(Step(optimizer="adam"), repeats=1))
    fake = profile_chain(blocks, x, Profiling(Step(optimizer="adam"),
                                            target=resolve_target(PLAIN_CPU)))
    # oneDNN's convolution backward reorders whole tensors in scratch memory
    _assert_same_bytes(real, fake, scratch=0.05 if kind == "mlp" else 1.0)
    assert all(t > 0 for t in fake.fwd_time) and len(fake.fwd_range) == len(blocks)


def test_fake_costs_of_gpt2_are_the_real_runs_bytes():
    model, batch = realzoo.gpt2(batch=2, seq=16, layers=2)
    model.train()
    layers = structure(model, batch).blocks
    real = profile_layers(model, batch, layers, Profiling(repeats=1))
    fake = profile_layers(model, batch, layers, Profiling(target=resolve_target(PLAIN_CPU)))
    _assert_same_bytes(real, fake)
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_a_deep_models_profile_from_its_short_twins_equals_the_full_one(name, monkeypatch):
    from dataclasses import asdict

    from rematlab.remat import shorten

    model, batch = getattr(realzoo, name)(batch=2, seq=16, layers=6)
    model.train()
    layers = structure(model, batch).blocks
    container = shorten._container(model, layers)
    kept = dict(container._modules)
    target = resolve_target(PLAIN_CPU)
    adam = Profiling(Step(optimizer="adam"), target=target)
    short = asdict(profile_layers(model, batch, layers, adam))
    assert dict(container._modules) == kept  # the model has all its layers again
    monkeypatch.setattr(shorten, "MIN_LAYERS", 10**6)  # the whole model's step
    full = asdict(profile_layers(model, batch, layers, adam))
    assert short.keys() == full.keys()
    for key in short:
        if key in ("fwd_time", "bwd_time"):
            assert short[key] == pytest.approx(full[key], rel=1e-9), key
        elif key in ("fwd_range", "bwd_range"):
            assert [list(r) for r in short[key]] == [pytest.approx(list(r), rel=1e-9)
                                                      for r in full[key]], key
        else:
            assert short[key] == full[key], key


def test_a_measured_profile_from_short_twins_has_the_full_ones_bytes(monkeypatch):
    """Measured, the three-layer twin runs too, and every byte equals the whole model's."""
    from rematlab.remat import layer_costs, shorten

    model, batch = realzoo.gpt2(batch=2, seq=16, layers=6)
    model.train()
    layers = structure(model, batch).blocks
    grown = []
    monkeypatch.setattr(layer_costs, "stretched",
                        lambda *a: grown.append(a) or shorten.stretched(*a))
    short = profile_layers(model, batch, layers, Profiling(Step(optimizer="adam"), repeats=1))
    assert len(grown) == 1 and grown[0][2] is None  # shortened, no four-layer twin timed
    rows, _, _, n = grown[0]
    assert n == 6 and len(rows) == 3
    monkeypatch.setattr(shorten, "MIN_LAYERS", 10**6)
    full = profile_layers(model, batch, layers, Profiling(Step(optimizer="adam"), repeats=1))
    assert len(grown) == 1  # the whole model's run
    for key in (*BYTES, "rec_mem", "bwd_mem"):
        assert getattr(short, key) == getattr(full, key), key
    # (times: the pre-flight test above holds the short twin's against the whole model's)


class _Indexed(realzoo.Decoder):
    """A loop that indexes its layers by a count of its own: it cannot run shortened."""

    def forward(self, idx, shift, pad):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:, :t] + shift[:, None, None]
        causal = torch.full((t, t), float("-inf"), dtype=x.dtype).triu(1)
        for i in range(self.count):
            x = self.layers[i](x, causal)
        return self.head(x) * pad[..., None]


def test_a_loop_that_cannot_run_shortened_is_profiled_whole(monkeypatch):
    from dataclasses import asdict

    from rematlab.remat import shorten

    model = _Indexed(layers=6).train()
    model.count = 6
    batch = (torch.randint(0, 50, (2, 12)), torch.randn(2), torch.ones(2, 12))
    layers = structure(model, batch).blocks
    target = resolve_target(PLAIN_CPU)
    got = asdict(profile_layers(model, batch, layers, Profiling(target=target)))
    monkeypatch.setattr(shorten, "MIN_LAYERS", 10**6)
    assert got == asdict(profile_layers(model, batch, layers, Profiling(target=target)))


def test_layers_that_differ_in_a_plain_attribute_are_not_shortened():
    from rematlab.remat.shorten import shortened

    model, batch = realzoo.gpt2(batch=2, seq=16, layers=6)
    layers = structure(model, batch).blocks
    with shortened(model, layers) as short:
        assert short == [layers[0], layers[1], layers[-1]]
        assert list(model.transformer.h) == short
    layers[3].attn.attention_type = "sliding"  # what a repr does not show
    with shortened(model, layers) as short:
        assert short is None
    with shortened(model, layers[:4]) as short:  # too few layers to gain anything
        assert short is None
    assert list(model.transformer.h) == layers


def _hwm_reset() -> int:
    """Reset the process's resident high-water mark (VmHWM) to its current RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmHWM")


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")
def test_a_meta_model_plans_without_allocating_its_weights():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=6, hidden_size=2048, intermediate_size=8192,
                      num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights > 1.5 * 2**30
    ids = torch.empty(1, 64, dtype=torch.int64, device="meta")
    before = _hwm_reset()
    planning = prepare(model.train(), {"input_ids": ids, "labels": ids}, predict=True,
                       target="a100-80gb", optimizer="adamw")
    assert _status("VmHWM") - before < 0.25 * weights
    assert planning.floor > 3 * weights  # weights, gradients and AdamW's two moments


def test_the_allocator_model_follows_the_documented_rules():
    MiB = 1 << 20
    assert [allocator.block(n) for n in (0, 1, 512, 513, 4096)] == [0, 512, 512, 1024, 4096]
    assert allocator.segment(1) == allocator.segment(MiB) == 2 * MiB
    assert allocator.segment(MiB + 1) == allocator.segment(10 * MiB - 512) == 20 * MiB
    assert allocator.segment(10 * MiB) == 10 * MiB
    assert allocator.segment(11 * MiB + 1) == 12 * MiB


def test_a_cuda_target_rounds_blocks_and_routes_attention_as_cuda_does():
    from rematlab.preflight.fake import FakeSession
    from rematlab.preflight.roofline import OpLog

    model, batch = realzoo.llama(batch=2, seq=32, layers=2)
    model.config._attn_implementation = "sdpa"  # the attention that CUDA and the CPU route
    model = model.to(torch.bfloat16).train()
    gpu = prepare(model, batch, predict=True, target="h100-80gb")
    assert all(x % 512 == 0 for x in gpu.costs.x)
    assert gpu.budget("auto").nbytes < PROFILES["h100-80gb"].usable
    ran = {}
    for cuda in (True, False):
        session, log = FakeSession(cuda=cuda), OpLog()
        twin = session.model(model)
        with session.active():
            fake = session.batch(batch)
            with log:
                twin(**fake).loss.backward()
        ran[cuda] = {op.name for op in log.ops if "attention" in op.name}
    # bf16, no mask, head size 16: the flash kernel on CUDA, forward and backward; the CPU's
    # own kernel here
    assert ran[True] == {"_scaled_dot_product_flash_attention",
                         "_scaled_dot_product_flash_attention_backward"}, ran
    assert ran[False] and ran[False].isdisjoint(ran[True]), ran


def test_targets_by_name_alias_and_profile(tmp_path):
    assert resolve_target("H100").name == "h100-80gb"
    path = tmp_path / "card.json"
    path.write_text(json.dumps({"name": "my-card", "memory": "12GiB", "flops": 3e13,
                                "bandwidth": 5e11}))
    card = resolve_target(str(path))
    assert (card.kind, card.memory, card.unit) == ("cuda", 12 * 2**30, 512)
    with pytest.raises(ConfigError, match="unknown target"):
        resolve_target("tpu-v9")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="there is none"):
            resolve_target("cuda")
    with pytest.raises(ConfigError, match="needs"):
        resolve_target({"name": "x"})


def test_the_roofline_prices_compute_and_bytes_as_a_roofline():
    """A matmul by its FLOPs (2·n³), a ReLU by the bytes it reads and writes, on a card of
    round numbers where the figures can be worked out by hand."""
    from rematlab.preflight.roofline import OpLog

    log = OpLog()
    a = torch.randn(256, 256)
    with log:
        (a @ a).relu()
    mm, relu = log.ops
    assert (mm.kind, mm.flops, mm.nbytes) == ("matmul", 2 * 256**3, 3 * 256 * 256 * 4)
    assert (relu.kind, relu.flops, relu.nbytes) == ("vector", 0, 2 * 256 * 256 * 4)
    card = resolve_target({"name": "round", "kind": "cpu", "memory": "1GiB", "flops": 1e12,
                           "bandwidth": 1e11, "overhead": [1e-6, 1e-6, 1e-6],
                           "efficiency": [0.5, 1, 1], "bandwidth_efficiency": [0.5, 1, 1]})
    fast, typical, slow = interval(log.ops, card)
    by_hand = 2 * 256**3 / 1e12 + 2 * 256 * 256 * 4 / 1e11 + 2e-6  # compute-bound mm
    assert typical == pytest.approx(by_hand) and fast == pytest.approx(by_hand)
    assert slow == pytest.approx(2 * by_hand - 2e-6)  # half the rates, the same overheads


def test_a_gpu_overlaps_launches_with_kernels_and_a_cpu_does_not():
    """On a GPU the host launches ahead of the device: a step of many tiny ops is
    launch-bound (their count times the overhead), one of a large matmul kernel-bound; a CPU
    pays both, one after the other."""
    from rematlab.preflight.roofline import LoggedOp

    tiny = [LoggedOp("relu", "vector", "float32", 0.0, 1000)] * 100
    big = [LoggedOp("mm", "matmul", "float32", 2e12, 0)]
    card = {"name": "round", "memory": "1GiB", "flops": 1e12, "bandwidth": 1e11,
            "overhead": [1e-5, 1e-5, 1e-5], "efficiency": [1, 1, 1],
            "bandwidth_efficiency": [1, 1, 1]}
    gpu, cpu = resolve_target(card), resolve_target({**card, "kind": "cpu"})
    assert interval(tiny, gpu)[1] == pytest.approx(100 * 1e-5)  # launches, not 1e-6 of work
    assert interval(big, gpu)[1] == pytest.approx(2.0)  # the kernel hides its launch
    assert interval(tiny, cpu)[1] == pytest.approx(100 * 1e-5 + 100 * 1000 / 1e11)
    assert interval(big, cpu)[1] == pytest.approx(2.0 + 1e-5)


def test_a_blocks_priced_backward_is_its_own_ops_only():
    """The unit loss that makes the profile's output gradient is not the block's: in a step
    that gradient comes from the next block."""
    from rematlab.preflight.roofline import OpLog
    from rematlab.remat.block import profile_block

    target = resolve_target(PLAIN_CPU)
    x = torch.randn(64, 256)
    y = nn.ReLU()(x.requires_grad_())
    grad = torch.ones_like(y)
    log = OpLog()
    with log:
        y.backward(grad)  # ReLU's backward alone: one threshold_backward
    assert [op.name for op in log.ops] == ["threshold_backward"]
    row = profile_block(nn.ReLU(), torch.randn(64, 256).requires_grad_().clone(), repeats=0,
                        target=target)
    assert row.bwd_range[0] == pytest.approx(interval(log.ops, target)[0], rel=1e-9)
    assert row.bwd_time == pytest.approx(interval(log.ops, target)[1], rel=1e-9)


def test_mixed_adamw_keeps_fp32_state_and_matches_adamw_on_fp32_weights():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64, 32))
    ref = nn.Parameter(w.detach().clone())
    ours, theirs = MixedAdamW([w], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2)
    for _ in range(3):
        g = torch.randn(64, 32)
        w.grad, ref.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(w, ref)
    half = nn.Parameter(torch.randn(64, 32, dtype=torch.bfloat16))
    opt = MixedAdamW([half])
    half.grad = torch.randn_like(half)
    opt.step()
    state = opt.state[half]
    assert state["master"].dtype == state["exp_avg"].dtype == torch.float32
    assert sum(t.numel() * t.element_size() for t in state.values()
               if isinstance(t, torch.Tensor)) == 12 * half.numel()


@pytest.mark.parametrize("with_peft", [True, False])
def test_lora_trains_only_the_adapters_and_works_on_meta(with_peft, monkeypatch):
    """With peft installed (pinned) its adapters; without it, rematlab's own."""
    import importlib.util

    if not with_peft:
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == "peft" else real(name, *a))
    adapter = (".lora_A.default.weight", ".lora_B.default.weight") if with_peft \
        else (".a", ".b")
    model, batch = realzoo.llama(batch=2, seq=16, layers=2)
    adapted = add_lora(model, rank=4)
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(adapter) for n in trainable)
    adapted(**batch).loss.backward()
    assert all(p.grad is None for p in adapted.parameters() if not p.requires_grad)
    with torch.device("meta"):
        meta = add_lora(nn.Sequential(nn.Linear(8, 8)), 2, targets=("0",))
    assert all(p.device.type == "meta" for p in meta.parameters())
    if not with_peft:
        assert isinstance(meta[0], LoRALinear)
    with pytest.raises(ConfigError, match="nothing to adapt"):
        add_lora(nn.Sequential(nn.ReLU()))


def test_predicted_plans_of_gpt2_fit_when_measured():
    model, batch = realzoo.gpt2(batch=4, seq=32, layers=3)
    model.train()
    predicted = prepare(model, batch, predict=True, target=PLAIN_CPU)
    measured = prepare(model, batch)
    low, high = predicted.floor_budget(), with_margin(predicted.full)
    assert low > predicted.floor
    with pytest.raises(InfeasibleBudgetError):
        predicted.choose(predicted.floor)  # within the margin: not promised
    for fraction in (0.0, 0.5, 1.0):
        budget = int(low + fraction * (high - low))
        chosen = predicted.choose(budget)
        peak = measured.measure(chosen)
        assert abs(chosen.predicted_peak - peak) <= 0.03 * peak
        assert peak <= budget


def test_predicted_op_level_menus_apply_to_the_real_model():
    """Options made on a fake twin name ops by occurrence in the real model's forward: the
    plan applies to the real model (its fingerprint matches) and keeps its peak."""
    from rematlab.plans.plan import Selective

    model, batch = realzoo.gpt2(batch=2, seq=32, layers=2, width=64)
    model.train()
    predicted = prepare(model, batch, predict=True, target=PLAIN_CPU, ops=True)
    assert all(predicted.costs.menu(i) for i in (1, 2))
    selective = [p for p in predicted.solution.frontier
                 if any(isinstance(i, Selective) for i in p.items)]
    assert selective
    measured = prepare(model, batch)
    for chosen in selective[:2]:
        peak = measured.measure(chosen)
        assert abs(chosen.predicted_peak - peak) <= 0.03 * peak


def test_max_batch_predicts_on_a_meta_model_without_running():
    from tests.userzoo import meta_llama

    model = meta_llama().train()

    def batches(size: int) -> dict:
        ids = torch.empty(size, 32, dtype=torch.int64, device="meta")
        return {"input_ids": ids, "labels": ids}

    found = max_batch(model, batches, "64MiB", predict=True, target=PLAIN_CPU, start=2,
                      limit=4096)
    none, best = found.fit("none"), found.fit("optimal")
    assert found.target == "test-cpu" and 0 < none.batch <= best.batch
    assert best.peak <= room(found.budget.nbytes) < best.over  # a margin is kept free
    assert best.step_s > 0 and best.throughput == pytest.approx(best.batch / best.step_s)


def test_the_cli_plans_a_meta_model_for_a_gpu_target():
    res = run(["plan", "--model", "tests.userzoo:meta_llama", "--predict", "--target",
               "h100-80gb", "--batch", "2", "--input-shape", "32", "--input-dtype", "int64",
               "--vocab", "97", "--dtype", "bfloat16", "--lora", "4",
               "--optimizer", "mixed-adamw", "--budget", "auto", "--json"])
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["target"] == "h100-80gb" and out["measured_peak"] is None
    # a 3-layer model on an 80 GB card: nothing to checkpoint, nothing to pay
    assert "[" not in out["plan"] and out["predicted_overhead"] == 0.0
    every = {b["strategy"]: b for b in out["baselines"]}["every:1"]
    assert every["peak"] < out["predicted_peak"] and every["overhead"] > 0.1


def test_the_cli_refuses_a_target_without_predict_and_an_unknown_target():
    base = ["plan", "--model", "mlp3", "--batch", "4", "--budget", "1GiB"]
    for extra, message in ((["--target", "h100"], "it needs predict=True (--predict)"),
                           (["--predict", "--target", "tpu"], "unknown target")):
        res = run(base + extra)
        assert res.returncode == 2 and message in res.stderr, res.stderr
        assert "Traceback" not in res.stderr


def test_a_target_is_a_frozen_profile_with_sources():
    for target in PROFILES.values():
        assert isinstance(target, Target) and target.source and target.context > 0
        assert target.flops["float16"] > target.flops["float32"]  # tensor cores


def test_one_gpu_table_serves_the_study_and_pre_flight():
    """The predictor's roofline features read the same data-sheet profiles as pre-flight, by
    the name torch gives the device, at the step's matmul dtype (dense rates: an RTX 4090
    does 165.2 bf16 TFLOP/s, 330 only with sparsity)."""
    from rematlab.measurement.hardware import GPU_DEFAULT, device_peaks
    from rematlab.preflight.targets import DEVICE_NAMES

    assert device_peaks("NVIDIA GeForce RTX 4090", 1, "bfloat16") == (165.2e12, 1.008e12)
    assert device_peaks("NVIDIA L40S", 1, "bfloat16")[0] == 362.05e12  # not the L40's
    assert device_peaks("NVIDIA H100 80GB HBM3", 1)[0] == 67e12  # fp32 steps: fp32 matmuls
    assert device_peaks("cuda:0", 1) == GPU_DEFAULT
    for part, name in DEVICE_NAMES:
        profile = PROFILES[name]
        assert device_peaks(f"Vendor {part} card", 1, "bfloat16") == (
            profile.flops["bfloat16"], profile.bandwidth), part


def test_running_out_of_memory_in_the_short_twin_is_not_hidden_by_a_whole_run(monkeypatch):
    """Only a loop that cannot run shortened falls back to the whole model: an OOM is a
    result, passed on as it is (the whole model would not have fit either)."""
    from rematlab.remat import layer_costs

    model, batch = realzoo.gpt2(batch=2, seq=16, layers=6)
    model.train()
    layers = structure(model, batch).blocks
    runs = []

    def out_of_memory(*args, **kwargs):
        runs.append(len(args[2]))
        raise MemoryError("simulated: the twin's step does not fit")

    monkeypatch.setattr(layer_costs, "_run", out_of_memory)
    with pytest.raises(MemoryError):
        profile_layers(model, batch, layers, Profiling(target=resolve_target(PLAIN_CPU)))
    assert runs == [3]  # the three-layer twin, and no whole-model run after it


def test_a_calibration_of_another_version_is_never_read(monkeypatch, tmp_path):
    """The calibration cache is versioned: a file this rematlab wrote is read back, one of
    another calibration version is measured again."""
    from rematlab.preflight import targets

    monkeypatch.setenv("REMATLAB_CACHE", str(tmp_path))
    fields = {"name": "cpu", "kind": "cpu", "memory": 2**30, "flops": {"float32": 1e11},
              "bandwidth": 1e10, "overhead": (1e-6, 2e-6, 4e-6), "calibrated": True}
    runs = []
    monkeypatch.setattr(targets, "measure", lambda kind: runs.append(kind) or dict(fields))
    try:
        targets.calibrated.cache_clear()
        first = targets.calibrated("cpu")
        targets.calibrated.cache_clear()
        assert targets.calibrated("cpu") == first and runs == ["cpu"]  # read back
        path, = tmp_path.glob(f"roofline-v{targets.VERSION}-*.json")
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "version": targets.VERSION - 1}))
        targets.calibrated.cache_clear()
        assert targets.calibrated("cpu") == first and runs == ["cpu", "cpu"]  # measured again
    finally:
        targets.calibrated.cache_clear()  # no fake calibration for the tests after this one


def test_preflight_under_bf16_autocast_counts_the_matmuls_scratch():
    """oneDNN packs bf16 matrix products' operands in scratch no tensor holds (64 KiB per
    layer of this GPT-2's backward): measured once per op and shape, as convolutions' are,
    the prediction covers the measured peak (it was 3.9 % under without it)."""
    from rematlab.core.recipe import Step

    torch.manual_seed(0)
    model, batch = realzoo.gpt2(batch=4, seq=32, layers=2, width=64)
    step = Step(precision="bf16", optimizer=torch.optim.AdamW)
    measured = prepare(model.train(), batch, step=step)
    predicted = prepare(model, batch, step=step, predict=True, target="cpu")
    for plan in (predicted.choose(predicted.floor_budget()), predicted.unconstrained):
        peak = measured.measure(plan)
        assert peak <= plan.predicted_peak <= 1.02 * peak, (plan.describe(), peak)


@pytest.mark.parametrize(("name", "memory_mib", "profile"), [
    ("NVIDIA H100 80GB HBM3", 81082, "h100-80gb"),
    ("NVIDIA H100 PCIe", 81559, None),  # the PCIe card's rates are not the SXM profile's
    ("NVIDIA A100-SXM4-80GB", 81038, "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", 40536, None),  # an "A100" is not always the 80 GB one
    ("NVIDIA H200", 143156, "h200"),
    ("NVIDIA GeForce RTX 4090", 24563, "rtx4090"),
    ("NVIDIA B200", 183359, None),
])
def test_a_card_maps_to_its_profile_by_name_memory_and_form_factor(name, memory_mib, profile):
    from rematlab.preflight.targets import profile_of_device

    found = profile_of_device(name, memory_mib << 20)
    assert (found.name if found else None) == profile
