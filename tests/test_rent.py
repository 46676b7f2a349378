"""`rematlab rent` (issue 60): every card x count priced by pre-flight, the result set ranked,
the work turned into hours and cost, bad input refused in one line."""

import json
from dataclasses import asdict, replace

import pytest
import torch
import transformers

import rematlab
from rematlab.exceptions import ConfigError
from rematlab.planning.prices import PRICES, Price, read_prices
from rematlab.planning.rent import Work, rent
from rematlab.plans.fixed import none_plan
from rematlab.plans.simulate import simulate
from rematlab.preflight.shared import shared_runs
from rematlab.preflight.targets import PROFILES, resolve_target
from tests import clirun

CONFIG = {"model_type": "gpt2", "n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192,
          "n_positions": 512}


def _model():
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))


def _ids(batch=8, seq=512):
    ids = torch.empty(batch, seq, dtype=torch.int64, device="meta")
    return {"input_ids": ids, "labels": ids}


STEP = rematlab.Step(precision="bf16", optimizer=torch.optim.AdamW)


@pytest.fixture(scope="module")
def result():
    # at 32 x 4096 tokens the 4090 holds the step with a plan only (plain ~27 GiB)
    return rent(_model(), _ids(32, 4096), work=Work(tokens=10**9), step=STEP,
                cards=["h100-80gb", "rtx4090"], counts=[1, 2],
                prices={"rtx4090": 0.5})


def test_every_row_is_pre_flights_own_plan_and_prices_the_work(result):
    assert {(r.card, r.count) for r in result.rows} == {
        ("h100-80gb", 1), ("h100-80gb", 2), ("rtx4090", 1), ("rtx4090", 2)}
    h100 = next(r for r in result.rows if r.card == "h100-80gb" and r.count == 1)
    planning = rematlab.prepare(_model(), _ids(32, 4096), predict=True, target="h100-80gb",
                                step=STEP, verify=False)
    chosen = planning.choose("auto")
    assert h100.plan == chosen.describe()
    assert h100.upper == planning.band(chosen).upper <= h100.budget
    assert h100.fits_plain == (planning.band(none_plan(planning.costs.n)).upper
                               <= h100.budget)
    for r in result.fitting:
        tokens_per_step = 32 * 4096 * r.count
        assert r.per_s == pytest.approx(tokens_per_step / r.step_s)
        assert r.hours == pytest.approx(10**9 / r.per_s / 3600)
        assert r.cost == pytest.approx(r.hours * r.count * r.usd_per_hour)
        assert r.largest_batch is not None and r.largest_batch >= 32
    four = [r for r in result.rows if r.card == "rtx4090"]
    assert all(r.usd_per_hour == 0.5 and r.price_source == "given by the caller" for r in four)


def test_a_card_priced_from_another_cards_fake_runs_is_priced_as_alone(result):
    """rent prices the 4090 from the H100's fake profile and allocator trace (one fake run
    per kind of card, `shared_runs`): its row is what pre-flight gives the 4090 alone."""
    four = next(r for r in result.rows if r.card == "rtx4090" and r.count == 1)
    planning = rematlab.prepare(_model(), _ids(32, 4096), predict=True, target="rtx4090",
                                step=STEP, verify=False)
    chosen = planning.choose("auto")
    assert four.plan == chosen.describe()
    assert four.step_s == simulate(chosen, planning.costs)[1]
    assert four.recomputed == chosen.recomputed and 0 < four.recomputed <= four.blocks == 4
    held = planning.band(chosen)
    assert (four.peak, four.upper) == (held.point, held.upper)


def test_an_allocator_trace_replayed_for_another_card_is_that_cards_replay():
    h100 = rematlab.prepare(_model(), _ids(8, 512), predict=True, target="h100-80gb",
                            step=STEP, verify=False)
    plan = h100.choose("auto")
    alone = h100.card(plan)
    with shared_runs():
        rematlab.prepare(_model(), _ids(8, 512), predict=True, target="rtx4090", step=STEP,
                         verify=False).card(plan)
        again = rematlab.prepare(_model(), _ids(8, 512), predict=True, target="h100-80gb",
                                 step=STEP, verify=False).card(plan)
    assert again == alone and alone.allocated > 0 and alone.reserved >= alone.allocated


def test_a_card_with_no_profile_is_given_as_a_target():
    pcie = resolve_target({**asdict(PROFILES["h100-80gb"]), "name": "h100-pcie",
                           "bandwidth": 2.0e12, "flops": {"float32": 51e12,
                                                          "bfloat16": 756e12}})
    got = rent(_model(), _ids(8, 512), work=Work(tokens=10**8), step=STEP,
               cards=[pcie, "h100-80gb"], counts=[1], prices={"h100-pcie": 2.0},
               largest=False)
    rows = {r.card: r for r in got.rows}
    assert rows["h100-pcie"].usd_per_hour == 2.0 and rows["h100-pcie"].fits
    assert rows["h100-pcie"].step_s > rows["h100-80gb"].step_s  # slower card, same plan room
    with pytest.raises(ConfigError, match="cpu target"):
        rent(_model(), _ids(8, 512), work=Work(tokens=10**8),
             cards=[replace(PROFILES["h100-80gb"], name="host", kind="cpu")])


def test_a_plan_fits_the_small_card_where_the_plain_step_does_not(result):
    one = next(r for r in result.rows if r.card == "rtx4090" and r.count == 1)
    assert one.fits and not one.fits_plain and one.remat
    assert one.upper <= one.budget


def test_the_result_set_ranks_picks_and_frames(result):
    cheapest, fastest = result.best("cost"), result.best("hours")
    assert cheapest.cost == min(r.cost for r in result.fitting)
    assert fastest.hours == min(r.hours for r in result.fitting)
    front = result.pareto()
    assert front[0] is cheapest and front[-1].hours == fastest.hours
    for r in result.fitting:  # nothing off the front beats a front member on both
        assert not any(f.cost > r.cost and f.hours > r.hours for f in front)
    frame = result.frame()
    assert len(frame) == 4 and list(frame["cost"].dropna()) == sorted(frame["cost"].dropna())
    assert json.loads(json.dumps(result.to_dict()))["cheapest"] == [cheapest.card,
                                                                  cheapest.count]
    with pytest.raises(ConfigError, match="ranks by one of"):
        result.best("speed")


def test_a_card_too_small_for_any_plan_is_a_misfit_with_why():
    got = rent(_model(), _ids(64, 4096), work=Work(samples=1000), step=STEP,
               cards=["rtx4090"], counts=[1], largest=False)
    (row,) = got.misfits
    assert not row.fits and "smallest plan" in row.why
    with pytest.raises(ConfigError, match="no configuration fits"):
        got.best()


@pytest.mark.parametrize("kwargs, message", [
    ({"cards": ["h900"]}, "unknown card 'h900'"),
    ({"counts": [0]}, "card count must be between 1"),
    ({"counts": []}, "at least one card count"),
    ({"layouts": "tp"}, "unknown keyword"),
    ({"prices": {"h100-80gb": -1.0}}, "0 or more"),
    ({"prices": {"h100-80gb": float("nan")}}, "0 or more"),
    ({"work": Work(samples=5), "step": "adamw"}, "step must be a rematlab.Step"),
])
def test_bad_arguments_are_refused_before_any_work(kwargs, message):
    call = {"work": Work(tokens=10), **kwargs}
    with pytest.raises(ConfigError, match=message):
        rent(_model(), _ids(), **call)


def test_work_is_tokens_or_samples_and_above_zero():
    for bad in ({}, {"tokens": 1, "samples": 1}, {"tokens": 0}, {"samples": -3},
                {"tokens": 1.5}):
        with pytest.raises(ConfigError):
            Work(**bad)
    with pytest.raises(ConfigError, match="batch of token ids"):
        rent(_model(), torch.empty(8, 3, 32, 32, device="meta"), work=Work(tokens=10))


def test_the_shipped_prices_are_dated_and_sourced_and_a_file_overrides_them(tmp_path):
    assert all(p.date and p.source.startswith(("RunPod", "Vultr")) for p in PRICES.values())
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"h100": 2.0, "a100-80gb": {"usd_per_hour": 1.1,
                                                          "source": "my provider"}}))
    got = read_prices(path)
    assert got["h100-80gb"] == Price("h100-80gb", 2.0, f"the user's file {path}", "")
    assert got["a100-80gb"].source == "my provider"
    path.write_text(json.dumps({"a100-80gb": "cheap"}))
    with pytest.raises(ConfigError, match="0 or more"):
        read_prices(path)


@pytest.mark.slow  # 6 s: a fresh process prices the cards (make test keeps the CLI's errors)
def test_the_cli_prints_the_ranked_table_and_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    args = ["rent", "--model", "hf:config.json", "--input-shape", "512", "--batch", "8",
            "--tokens", "1e9", "--cards", "h100-80gb,rtx4090", "--counts", "1,2",
            "--price", "rtx4090=0.5", "--no-largest"]
    proc = clirun.run([*args, "--figure", "cost.png"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ranked by cost" in proc.stdout and "cheapest:" in proc.stdout
    assert (tmp_path / "cost.png").read_bytes()[:4] == b"\x89PNG"
    proc = clirun.run([*args, "--json"], cwd=tmp_path)
    data = json.loads(proc.stdout)
    assert len(data["rows"]) == 4 and data["work"] == {"tokens": 10**9, "samples": None}


@pytest.mark.parametrize("extra, message", [
    (["--tokens", "0"], "must be above 0"),
    (["--tokens", "-5"], "must be above 0"),
    (["--tokens", "1e9", "--samples", "5"], "give the work once"),
    (["--epochs", "2"], "go together"),
    (["--tokens", "1e9", "--cards", "h900"], "unknown card"),
    (["--tokens", "1e9", "--price", "h100-80gb=-2"], "0 or more"),
    (["--tokens", "1e9", "--price", "h100-80gb"], "CARD=USD"),
    (["--tokens", "1e9", "--counts", "2,x"], "whole numbers"),
    (["--tokens", "1e9", "--layout", "tp"], "--layout must be fsdp or ddp"),
    (["--tokens", "1e9", "--prices", "missing.json"], "cannot read the price file"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, extra, message):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    proc = clirun.run(["rent", "--model", "hf:config.json", "--input-shape", "512", *extra],
                      cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
