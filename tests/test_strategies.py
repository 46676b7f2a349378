import functools

import pytest
import torch
from torch import nn

import rematlab
from rematlab.exceptions import ConfigError
from rematlab.measurement import zoo
from rematlab.plans.plan import Plan, Segment
from rematlab.remat.strategies import RematChain, parse

STRATEGIES = ["uniform:2", "uniform:3", "every:2", "selective", "sqrt", "nested"]
MODELS = ["mlp3", "mlp5", "mlp7", "lenet5", "alexnet", "vgg16"]


def _nested_plan(n: int) -> Plan:
    """Two levels: the first half is a segment whose own first half is checkpointed again."""
    half, quarter = n // 2, max(1, n // 4)
    inner = (Segment(0, quarter, tuple(range(quarter))), *range(quarter, half))
    return Plan(n, (Segment(0, half, inner), *range(half, n)), name="nested")


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks for both runs
    nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _setup(name: str, dtype: torch.dtype, batch: int = 4):
    model, shape, _ = zoo.resolve(name, "cifar" if name in ("alexnet", "vgg16") else None)
    model = model.to(dtype).train()
    x = torch.randn(batch, *shape, dtype=dtype)
    y = torch.randint(0, 10, (batch,))
    return model, x, y


@functools.cache
def _plain(name: str, dtype: torch.dtype, seed: int):
    """The model, its batch and its plain gradients, made once for every strategy (`apply`
    wraps the model and shares its parameters; each `_grads` starts from none)."""
    model, x, y = _setup(name, dtype)
    return model, x, y, _grads(model, x, y, seed)


def _apply(model, strategy, x):
    if strategy == "nested":
        return rematlab.apply(model, _nested_plan(len(model)))
    return rematlab.apply(model, strategy, example_input=x)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", MODELS)
def test_gradients_equal_without_remat_in_float64(name, strategy):
    model, x, y, want = _plain(name, torch.float64, 1)
    remat = _apply(model, strategy, x)
    assert remat.plan.segments, "the strategy must checkpoint something on this chain"
    got = _grads(remat, x, y, seed=1)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() <= 1e-12


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", MODELS)
def test_gradients_equal_without_remat_in_float32(name, strategy):
    model, x, y, want = _plain(name, torch.float32, 2)
    got = _grads(_apply(model, strategy, x), x, y, seed=2)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-7)


def test_remat_module_shares_parameters():
    model = zoo.mlp(3, width=8)
    remat = rematlab.apply(model, "uniform:2")
    assert [id(p) for p in remat.parameters()] == [id(p) for p in model.parameters()]


def test_dropout_masks_are_replayed_in_recomputation():
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5)),
                          nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5)),
                          nn.Sequential(nn.Linear(16, 2))).double()
    x = torch.randn(8, 16, dtype=torch.float64)
    y = torch.randint(0, 2, (8,))
    want = _grads(model, x, y, seed=3)
    got = _grads(rematlab.apply(model, "every:1"), x, y, seed=3)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def _bn_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
        nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
        nn.Sequential(nn.Flatten(), nn.Linear(4 * 8 * 8, 3)),
    ).double()


def test_batchnorm_running_stats_are_updated_once():
    plain, remat_src = _bn_model(), _bn_model()
    remat_src.load_state_dict(plain.state_dict())
    remat = rematlab.apply(remat_src, "every:1")
    x = torch.randn(5, 3, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    want = _grads(plain, x, y, seed=0)
    got = _grads(remat, x, y, seed=0)
    assert remat.recompute.segments >= 2  # recomputation really happened
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() <= 1e-12
    for name, buf in plain.named_buffers():
        assert torch.equal(dict(remat_src.named_buffers())[name], buf), name
    assert all(int(m.num_batches_tracked) == 1 for m in remat_src.modules()
               if isinstance(m, nn.BatchNorm2d))
    assert all(m.momentum == 0.1 for m in remat_src.modules()
               if isinstance(m, nn.BatchNorm2d))


def test_plan_strategies_build_the_documented_segments():
    n = 9
    assert [(s.start, s.end) for s in parse("uniform:3").build(n).segments] == [(0, 3), (3, 6)]
    assert [(s.start, s.end) for s in parse("every:4").build(n).segments] == [(0, 4), (4, 8)]
    assert [(s.start, s.end) for s in parse("sqrt").build(n).segments] == [(0, 3), (3, 6)]
    assert parse("none").build(n).segments == []


@pytest.mark.parametrize("bad", ["", "uniform", "uniform:0", "every:-2", "sqrt:3", "foo",
                                 "uniform:x", "plan", "selective:-1"])
def test_bad_strategy_strings_raise_config_errors(bad):
    with pytest.raises(ConfigError):
        parse(bad)


def test_explicit_plan_file_round_trips(tmp_path):
    plan = _nested_plan(7)
    path = tmp_path / "p.json"
    path.write_text(plan.to_json())
    assert Plan.from_json(path.read_text()) == plan
    remat = rematlab.apply(zoo.mlp(7, width=8), f"plan:{path}")
    assert isinstance(remat, RematChain) and remat.plan.items == plan.items
    with pytest.raises(ConfigError, match="blocks"):
        rematlab.apply(zoo.mlp(3, width=8), f"plan:{path}")


def test_invalid_plans_are_rejected():
    with pytest.raises(ConfigError):
        Plan(3, (0, 2))
    with pytest.raises(ConfigError):
        Plan(3, (Segment(0, 2, (0,)), 2))


def _saved_bytes(fn, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes autograd saves for backward (compiled graphs save through the same hooks)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = nn.functional.cross_entropy(fn(x), y)
    loss.backward()
    return total


def test_plans_run_under_torch_compile_with_equal_gradients_and_less_saved():
    plain, src = _bn_model(), _bn_model()
    src.load_state_dict(plain.state_dict())
    x = torch.randn(5, 3, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    want = _grads(plain, x, y, seed=0)
    compiled = torch.compile(rematlab.apply(src, "every:1"))
    got = _grads(compiled, x, y, seed=0)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-9, atol=1e-12)
    for name, buf in plain.named_buffers():  # running stats updated once, not per recompute
        assert torch.allclose(dict(src.named_buffers())[name], buf), name
    # the segments are recompute regions of the compiled graph: it saves less than compiled none
    assert _saved_bytes(compiled, x, y) < _saved_bytes(torch.compile(plain), x, y)
