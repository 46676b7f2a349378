"""The largest batch that fits (issue 17): exact by measurement — the batch found fits and one
more sample does not, checked here independently of the search — with and without remat; and
`auto` re-planning when a derived budget stops holding."""

import json

import pytest
import torch
import torch.nn.functional as F

import rematlab
from rematlab.core.batch import resized
from rematlab.core.recipe import Step
from rematlab.exceptions import ConfigError, InfeasibleBudgetError
from rematlab.measurement import zoo
from rematlab.planning import budget, planner
from rematlab.planning.bisect import confirmed, largest
from rematlab.planning.budget import DeviceBudget
from rematlab.planning.maxbatch import max_batch
from rematlab.planning.verify import step_peak
from rematlab.plans.fixed import none_plan
from rematlab.plans.simulate import simulate
from tests import clirun, realzoo, userzoo

MIB = 2**20


def _none_peak(model, x, optimizer="momentum"):
    """The step's measured peak without remat, as `rematlab.plan` measures plans (the
    optimizer's bytes from the meta-device profile, which equal the device's)."""
    costs = planner.prepare(model, x, optimizer=optimizer, predict=True).costs
    return step_peak(model, model, x, costs, Step())


def _shape_batch(shape, size):
    return torch.randn(size, *shape, generator=torch.Generator().manual_seed(size))


BUDGET = 48 * MIB
SHAPE = (3, 32, 32)


@pytest.fixture(scope="module")
def cnn_search():
    torch.manual_seed(0)
    net = userzoo.narrow_cnn().train()
    return net, max_batch(net, torch.randn(8, *SHAPE), BUDGET, repeats=2, warmup=1)


@pytest.mark.slow
def test_a_deep_cnn_without_remat_exact_largest_batch(cnn_search):
    net, found = cnn_search
    none = found.fit("none")
    assert none.batch > 0 and not none.at_limit
    assert _none_peak(net, _shape_batch(SHAPE, none.batch)) <= BUDGET
    assert _none_peak(net, _shape_batch(SHAPE, none.batch + 1)) > BUDGET


@pytest.mark.slow
def test_a_deep_cnn_with_the_optimal_plan_exact_and_larger(cnn_search):
    """Activations outweigh the weights (as on VGG-16 in the study): remat fits more."""
    net, found = cnn_search
    best, none = found.fit("optimal"), found.fit("none")
    chosen = rematlab.plan(net, _shape_batch(SHAPE, best.batch), BUDGET)
    assert chosen.measured_peak <= BUDGET and chosen.segments
    with pytest.raises(InfeasibleBudgetError):
        rematlab.plan(net, _shape_batch(SHAPE, best.batch + 1), BUDGET)
    assert best.batch > none.batch
    for fit in (best, none):
        assert fit.step_s > 0 and fit.repeats == 2
        assert fit.throughput == pytest.approx(fit.batch / fit.step_s)
    assert "remat fits" in found.verdict()
    assert found.evidence is not None and found.to_dict()["attempts"] >= 2  # the guard's


def test_mlp3_gains_no_batch_from_remat():
    torch.manual_seed(0)
    net = zoo.mlp(3).train()
    found = max_batch(net, torch.randn(8, 1, 28, 28), 24 * MIB, repeats=0)
    none, best = found.fit("none"), found.fit("optimal")
    assert none.batch > 0 and best.batch == none.batch  # the study: no memory benefit
    assert best.plan == "0 1 2" and best.step_s is None
    assert _none_peak(net, _shape_batch((1, 28, 28), none.batch + 1)) > 24 * MIB


def test_a_transformer_batch_of_token_dicts_is_searched_through_its_layers():
    model, batch = realzoo.gpt2(batch=2, seq=16, layers=2)
    found = max_batch(model.train(), batch, 48 * MIB, repeats=0, cases=("none",))
    fit = found.fit("none")
    assert fit.batch >= 2 and fit.over > 48 * MIB >= fit.peak
    bigger = resized(batch, fit.batch + 1)
    assert bigger["input_ids"].shape[0] == fit.batch + 1
    costs = planner.prepare(model, bigger).costs
    assert step_peak(model, model, bigger, costs, Step()) > 48 * MIB


def test_resized_cycles_rows_of_every_batch_tensor():
    batch = {"input_ids": torch.arange(6).view(3, 2), "labels": torch.arange(3),
             "scale": torch.tensor(2.0)}
    out = resized(batch, 5)
    assert out["input_ids"].tolist() == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3]]
    assert out["labels"].tolist() == [0, 1, 2, 0, 1] and out["scale"].item() == 2.0


@pytest.mark.parametrize("answer", [0, 1, 7, 100, 1023, 4096])
@pytest.mark.parametrize("estimate", [1, 50, 99, 5000])
def test_the_searches_find_the_boundary(answer, estimate):
    calls = []

    def fits(b):
        calls.append(b)
        return b <= answer

    assert largest(fits, 8, 4096) == answer
    assert confirmed(fits, estimate, 4096) == answer


def test_confirmation_stops_at_a_local_boundary_of_a_non_monotone_measurement():
    # measured peaks are not monotone in the batch (kernels pick scratch by shape)
    fitting = {1, 2, 3, 4, 5, 7}
    got = confirmed(lambda b: b in fitting, 6, 100)
    assert got in fitting and got + 1 not in fitting


def test_bad_arguments_are_config_errors():
    net = zoo.mlp(3)
    x = torch.randn(4, 1, 28, 28)
    with pytest.raises(ConfigError, match="unknown case"):
        max_batch(net, x, "1GiB", cases=("sometimes",))
    with pytest.raises(ConfigError, match="limit"):
        max_batch(net, x, "1GiB", limit=0)
    with pytest.raises(ConfigError):
        max_batch(net, x, "lots")
    with pytest.raises(ConfigError, match=r"nn\.Module"):
        max_batch(lambda t: t, x, "1GiB")


def test_auto_replans_when_the_derived_budget_stops_holding(monkeypatch):
    torch.manual_seed(0)
    model = zoo.mlp(5, width=128).train()
    x = torch.randn(2048, 1, 28, 28)
    planning = planner.prepare(model, x, optimizer=None)
    full = simulate(none_plan(planning.costs.n), planning.costs)[0]
    device_has = {"bytes": 4 * full}

    def fake_resolve(budget, device, resident=0):
        return DeviceBudget(device_has["bytes"], "auto (test)")

    monkeypatch.setattr(budget, "resolve_budget", fake_resolve)
    wrapped = rematlab.auto(model, "auto", optimizer=None, recheck_s=0.0)

    def train_step():
        F.cross_entropy(wrapped(x), torch.randint(0, 10, (2048,))).backward()

    train_step()
    train_step()  # the budget holds: no re-plan
    assert [e.reason for e in wrapped.events] == ["new input shapes"]
    assert "[" not in wrapped.events[0].plan
    middle = (planning.floor + wrapped.events[0].peak) // 2
    device_has["bytes"] = middle  # another process took memory
    train_step()
    assert len(wrapped.events) == 2 and "fell" in wrapped.events[1].reason
    assert "[" in wrapped.events[1].plan and wrapped.events[1].peak <= middle
    device_has["bytes"] = 4 * full  # and gave it back
    train_step()
    assert len(wrapped.events) == 3 and "grew" in wrapped.events[2].reason
    assert "[" not in wrapped.events[2].plan


def test_the_cli_reports_both_cases_as_json_and_rejects_bad_input():
    ok = clirun.run(["max-batch", "--model", "mlp3", "--budget", "24MiB", "--repeats", "2",
                     "--json"])
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert [f["case"] for f in data["fits"]] == ["none", "optimal"]
    assert all(f["throughput"] > 0 and f["peak"] <= 24 * MIB < f["over"] for f in data["fits"])
    bad = clirun.run(["max-batch", "--model", "mlp3", "--budget", "24MiB", "--batch", "1"])
    assert bad.returncode == 2 and bad.stderr.startswith("error:")
    assert "Traceback" not in bad.stderr


def test_running_out_of_memory_while_searching_is_a_result_not_a_crash(monkeypatch):
    from rematlab.planning import maxbatch

    real = maxbatch.prepare

    def small_device(model, batch, *args, **kw):
        if batch.shape[0] >= 100:
            raise MemoryError("out of memory (emulated)")
        return real(model, batch, *args, **kw)

    monkeypatch.setattr(maxbatch, "prepare", small_device)
    torch.manual_seed(0)
    found = max_batch(zoo.mlp(3).train(), torch.randn(8, 1, 28, 28), 24 * MIB, repeats=0,
                      cases=("optimal",))
    fit = found.fit("optimal")
    assert fit.batch == 99 and fit.over is None  # 100 could not run: the largest that can


def test_interpolated_costs_keep_the_op_level_options_both_batches_offer():
    from dataclasses import replace

    from rematlab.planning.bisect import scaled
    from tests.test_solver import random_costs, with_menus

    low = with_menus(random_costs(4, 3), 3)
    high = replace(low, saved=[2 * v for v in low.saved],
                   options=[[replace(o, saved=2 * o.saved, fwd_time=2 * o.fwd_time)
                             for o in menu[:1]] for menu in low.options])
    mid = scaled(low, 8, high, 16, 12)
    for i in range(low.n):
        assert [o.name for o in mid.menu(i)] == [low.menu(i)[0].name]
        assert mid.menu(i)[0].saved == round(1.5 * low.menu(i)[0].saved)
        assert mid.menu(i)[0].fwd_time == pytest.approx(1.5 * low.menu(i)[0].fwd_time)
        assert mid.menu(i)[0].saves == low.menu(i)[0].saves
