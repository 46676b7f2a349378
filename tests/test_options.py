"""One options object per concern (issue 52): `PlanOptions` validated once, with one set of
messages for the API and the CLI; the keywords rematlab always took still change it, and an
unknown one is refused with the names known; max-batch's search and a gradient run's
settings alike; a plan's op-sequence hash named for what it is."""

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rematlab
from rematlab import PlanOptions, zoo
from rematlab.core.recipe import Step
from rematlab.exceptions import ConfigError
from rematlab.planning.maxbatch import SearchOptions
from rematlab.planning.options import NAMES, request
from rematlab.plans.plan import Plan, Selective
from tests import clirun


@pytest.mark.parametrize(("fields", "message"), [
    ({"compile": True, "predict": True}, "compiled costs must be measured"),
    ({"target": "h100"}, "it needs predict=True (--predict)"),
    ({"ops": "yes"}, "ops must be True or False"),
    ({"verify": 1}, "verify must be True or False"),
    ({"fractions": (0.5, 2.0)}, "fractions must be a list of numbers in [0, 1]"),
    ({"fractions": "0.5"}, "fractions must be a list"),
    ({"repeats": 0}, "repeats must be between 1 and 10000, got 0"),
    ({"repeats": True}, "repeats must be a whole number"),
    ({"device": 3}, "device must be cpu, cuda or cuda:N"),
    # issue 64: each value refused where it is given, by name
    ({"device": "banana"}, "unknown device 'banana': choose cpu, cuda"),
    ({"device": ""}, "device must be cpu, cuda or cuda:N"),
    ({"device": "xla"}, "device xla is not one rematlab plans on"),
    ({"predict": True, "target": 123}, "target must be a profile name"),
    ({"predict": True, "target": []}, "target must be a profile name"),
    ({"blocks": []}, "blocks must name at least one layer"),
    ({"blocks": ", "}, "blocks must name at least one layer"),
    ({"blocks": ["transformer.h", 3]}, "blocks must name at least one layer"),
    ({"bogus": 1}, "unknown PlanOptions field(s) bogus; it has blocks, compile, device"),
])
def test_plan_options_refuse_bad_values_when_made(fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        PlanOptions(**fields)


def test_keywords_change_the_options_and_the_step_and_unknown_ones_are_refused():
    base = PlanOptions(ops=True, fractions=[0, 1])
    assert base.fractions == (0.0, 1.0)
    opts, step = request(base, None, {"verify": False, "optimizer": "adamw"})
    assert opts == PlanOptions(ops=True, verify=False, fractions=(0.0, 1.0))
    assert step.optimizer == "adamw"
    assert request(None, None, {})[0] == PlanOptions()
    with pytest.raises(ConfigError, match=r"unknown keyword.*opps.*planning takes.*ops"):
        request(None, None, {"opps": True})
    with pytest.raises(ConfigError, match="say the step once"):
        request(None, Step(), {"optimizer": "adam"})
    with pytest.raises(ConfigError, match=r"options must be a rematlab.PlanOptions"):
        request({"ops": True}, None, {})  # type: ignore[arg-type]
    # a change made through a keyword is validated as the options are
    with pytest.raises(ConfigError, match="compiled costs must be measured"):
        request(PlanOptions(compile=True), None, {"predict": True})


def test_prepare_takes_the_options_whole_or_as_keywords_alike():
    torch.manual_seed(0)
    model, x = zoo.mlp(3).train(), torch.randn(8, 1, 28, 28)
    whole = rematlab.prepare(model, x, PlanOptions(verify=False), optimizer="adam")
    keywords = rematlab.prepare(model, x, verify=False, optimizer="adam")
    assert not whole.verify and not keywords.verify
    assert whole.step == keywords.step and whole.costs.saved == keywords.costs.saved
    with pytest.raises(ConfigError, match="unknown keyword"):
        rematlab.plan(model, x, "1GiB", budgett="2GiB")


def test_search_options_refuse_bad_values_and_max_batch_sorts_its_keywords():
    with pytest.raises(ConfigError, match="unknown case"):
        SearchOptions(cases=("sometimes",))
    with pytest.raises(ConfigError, match="cases must be a list"):
        SearchOptions(cases="none")
    with pytest.raises(ConfigError, match="limit must be between"):
        SearchOptions(limit=0)
    model, x = zoo.mlp(3).train(), torch.randn(8, 1, 28, 28)
    with pytest.raises(ConfigError, match=r"unknown keyword.*limitt"):
        rematlab.max_batch(model, x, "1GiB", limitt=3)


def test_the_cli_and_the_api_refuse_compile_with_predict_in_the_same_words():
    with pytest.raises(ConfigError) as api:
        PlanOptions(compile=True, predict=True)
    proc = clirun.run(["plan", "--model", "mlp3", "--budget", "1GiB", "--compile",
                       "--predict"])
    assert proc.returncode == 2
    assert clirun.said(proc.stderr) == [f"error: {api.value}"]


def test_a_plans_op_sequence_hash_round_trips_and_older_plans_still_load():
    plan = Plan(3, (0, Selective(1, "save mm", (("aten.mm.default", 0),), "abc123"), 2))
    data = plan.to_json()
    assert '"sequence": "abc123"' in data and '"ops"' not in data
    assert Plan.from_json(data) == plan
    older = data.replace('"sequence"', '"ops"')
    assert Plan.from_json(older) == plan


def test_a_gradient_run_refuses_an_unknown_setting():
    from rematlab.gradients.comparison import compare
    from rematlab.gradients.training import train

    with pytest.raises(ConfigError, match=r"unknown training setting.*stepz.*known"):
        train("mlp3", "bp", stepz=3)
    with pytest.raises(ConfigError, match=r"unknown training setting.*stepz"):
        compare(["mlp3"], [1], stepz=3)


def test_costs_saved_with_the_older_op_sequence_key_still_load():
    from dataclasses import asdict

    from rematlab.plans.plan import ChainCosts, Option

    option = Option("save mm", (("aten.mm.default", 0),), 10, True, False, 5, 6, 0.1, 0.2,
                    sequence="abc123")
    costs = ChainCosts(x=[1, 1], saved=[4], keeps_input=[False], keeps_output=[False],
                       fwd_mem=[0], bwd_mem=[0], grad=[0], fwd_time=[1.0], bwd_time=[2.0],
                       options=[[option]])
    assert ChainCosts.from_dict(costs.to_dict()) == costs
    older = costs.to_dict()
    older["options"] = [[{**{k: v for k, v in asdict(option).items() if k != "sequence"},
                         "ops": "abc123"}]]
    assert ChainCosts.from_dict(older) == costs


def test_a_device_this_machine_lacks_is_refused_by_name():
    missing = [d for d, here in (("cuda", torch.cuda.is_available()),
                                 ("mps", torch.backends.mps.is_available())) if not here]
    for device in missing:
        with pytest.raises(ConfigError, match=f"device {device} requested but this machine"):
            PlanOptions(device=device)


def test_plan_options_take_keywords_only_and_say_so():
    with pytest.raises(ConfigError, match="PlanOptions takes keywords only"):
        PlanOptions(True)  # type: ignore[misc]


def test_positional_options_work_alike_in_prepare_plan_max_batch_and_auto():
    """`PlanOptions` as the argument after the batch (and the budget) in every entry point."""
    torch.manual_seed(0)
    model, x = zoo.mlp(3).train(), torch.randn(8, 1, 28, 28)
    opts = PlanOptions(verify=False)
    planning = rematlab.prepare(model, x, opts)
    plan = rematlab.plan(model, x, planning.full, opts)
    assert plan.describe() == planning.choose(planning.full).describe()
    assert rematlab.auto(model, "1GiB", opts).options == opts
    compiled = PlanOptions(compile=True)  # taken whole: a keyword then changes it, checked
    for call in (lambda: rematlab.prepare(model, x, compiled, predict=True),
                 lambda: rematlab.plan(model, x, "1GiB", compiled, predict=True),
                 lambda: rematlab.max_batch(model, x, "64MiB", compiled, predict=True),
                 lambda: rematlab.auto(model, "1GiB", compiled, predict=True)):
        with pytest.raises(ConfigError, match="compiled costs must be measured"):
            call()


@pytest.mark.parametrize(("fields", "message"), [
    ({"shape_buckets": "no"}, "shape_buckets must be True or False"),
    ({"recheck_s": float("nan")}, "recheck_s must be a number of seconds"),
    ({"recheck_s": -1}, "recheck_s must be a number of seconds"),
    ({"recheck_s": "10"}, "recheck_s must be a number of seconds"),
])
def test_auto_refuses_bad_values_where_they_are_given(fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        rematlab.auto(zoo.mlp(3), "1GiB", **fields)


@pytest.mark.parametrize(("fields", "message"), [
    ({"start": "8"}, "start must be a whole number, got '8'"),
    ({"limit": 1.5}, "limit must be a whole number, got 1.5"),
    ({"start": 128, "limit": 64}, "start 128 is above the limit 64"),
])
def test_the_batch_search_refuses_bad_counts_where_they_are_given(fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        SearchOptions(**fields)


def test_the_cli_refuses_a_start_above_the_limit_and_too_many_budgets():
    proc = clirun.run(["max-batch", "--model", "mlp3", "--budget", "64MiB", "--batch", "128",
                       "--limit", "64"])
    assert proc.returncode == 2 and "start 128 is above the limit 64" in proc.stderr
    budgets = ",".join(["64MiB"] * 4097)
    proc = clirun.run(["plan", "--model", "mlp3", "--budgets", budgets])
    assert proc.returncode == 2 and "number of --budgets must be between 1 and 4096" in proc.stderr


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(sorted(NAMES)),
       value=st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6),
                       st.floats(allow_nan=True), st.text(max_size=12),
                       st.lists(st.one_of(st.integers(), st.text(max_size=4)), max_size=3)))
def test_any_value_of_any_option_builds_or_is_one_clean_error(field, value):
    """Fuzzed over the option surface: a value either makes options or a `ConfigError`,
    never another exception (predict set where a target needs it)."""
    fields = {field: value, **({"predict": True} if field == "target" else {})}
    try:
        PlanOptions(**fields)
    except ConfigError as exc:
        assert str(exc) and "\n" not in str(exc)
