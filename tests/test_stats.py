import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from rematlab.study.inference import Settings, hodges_lehmann, holm
from rematlab.study.stats import analyze
from tests import synthetic

FAST = Settings(bootstrap=300)


def _claim(report, prefix):
    rows = report.claims[report.claims["claim"].str.startswith(prefix)]
    assert len(rows), prefix
    return rows


def test_planted_effects_are_confirmed():
    frame = synthetic.summary({"mlp3": (0.7, 1.3), "vgg16": (0.6, 1.2)})
    report = analyze(frame, settings=FAST)
    assert report.blocks == 12
    claim1 = _claim(report, "(1)")
    assert set(claim1["verdict"]) == {"confirmed"}
    effects = report.effects.set_index(["architecture", "strategy"])
    assert effects.loc[("vgg16", "sqrt"), "memory_change"] == pytest.approx(-0.4, abs=1e-6)
    assert effects.loc[("vgg16", "sqrt"), "time_change"] == pytest.approx(0.2, abs=0.02)


def test_no_effect_is_not_confirmed():
    frame = synthetic.summary({"mlp3": (1.0, 1.0), "vgg16": (1.0, 1.0)}, noise=0.02)
    report = analyze(frame, settings=FAST)
    claim1 = _claim(report, "(1)")
    assert set(claim1["verdict"]) == {"not confirmed"}


def test_partial_ties_in_memory_go_through_zsplit_not_the_all_zero_shortcut():
    frame = synthetic.summary({"vgg16": (0.6, 1.2), "alexnet": (0.6, 1.2)})
    none = frame[frame["cfg_strategy"] == "none"].set_index(["cfg_model", "cfg_batch"])
    tie = (frame["cfg_strategy"] == "sqrt") & frame["cfg_batch"].isin([16, 64, 256])
    frame.loc[tie, "peak_bytes_median"] = [
        none.loc[(m, b), "peak_bytes_median"]
        for m, b in zip(frame.loc[tie, "cfg_model"], frame.loc[tie, "cfg_batch"], strict=True)]
    report = analyze(frame, settings=FAST)
    row = report.pairwise.query("response == 'memory' and a == 'none' and b == 'sqrt'").iloc[0]
    d = [0.0] * 6 + [float(np.log(0.6))] * 6  # six tied blocks, six with 40 % less memory
    assert row["blocks"] == 12
    assert row["p"] == pytest.approx(sps.wilcoxon(d, zero_method="zsplit").pvalue)
    assert 0.0 < row["p"] < 1.0


def test_ties_in_memory_are_handled():
    frame = synthetic.summary({"mlp3": (1.0, 1.1), "lenet5": (1.0, 1.1)})
    report = analyze(frame, settings=FAST)
    memory = report.pairwise[report.pairwise["response"] == "memory"]
    assert (memory["p"] == 1.0).all() and not memory["significant"].any()
    verdicts = report.claims.set_index("claim")["verdict"]
    assert verdicts["(3) mlp3: no memory benefit"] == "confirmed"


@pytest.mark.slow
def test_selective_equal_to_uniform_is_confirmed_and_a_difference_is_not():
    same = analyze(synthetic.summary({"vgg16": (0.7, 1.2), "alexnet": (0.8, 1.1)}),
                   settings=FAST)
    assert set(_claim(same, "(2)")["verdict"]) <= {"confirmed"}
    apart = analyze(synthetic.summary({"vgg16": (0.7, 1.2), "alexnet": (0.8, 1.1)},
                                      selective_extra=-0.3), settings=FAST)
    memory = _claim(apart, "(2)")
    assert "not confirmed" in set(memory["verdict"])


def test_too_few_blocks_are_inconclusive():
    frame = synthetic.summary({"vgg16": (0.6, 1.2)}, batches=(16, 32))
    report = analyze(frame, settings=FAST)
    assert set(report.claims["verdict"]) == {"inconclusive"}
    assert report.notes and "inconclusive" in report.notes[0]


def test_architecture_claims_follow_the_data():
    frame = synthetic.summary({"mlp3": (1.0, 1.05), "vgg16": (0.6, 1.15),
                               "alexnet": (0.85, 1.1), "lenet5": (0.5, 1.1)})
    verdicts = analyze(frame, settings=FAST).claims.set_index("claim")["verdict"]
    assert verdicts["(3) mlp3: no memory benefit"] == "confirmed"
    assert verdicts["(3) lenet5: no memory benefit"] == "not confirmed"
    assert verdicts["(3) alexnet: moderate memory gains"] == "confirmed"
    assert verdicts["(3) vgg16: memory reduction with bounded time overhead"] == "confirmed"
    assert verdicts["(3) mlp5: no memory benefit"] == "inconclusive"  # no data


def test_guidelines_recommend_and_find_the_payoff_batch():
    frame = synthetic.summary({"vgg16": (0.6, 1.15), "mlp3": (1.0, 1.05)})
    report = analyze(frame, settings=FAST, memory_cap=int(100e6))
    g = report.guidelines.set_index(["architecture", "batch band"])
    assert (g.loc["mlp3", "recommended"] == "none").all()
    assert (g.loc["vgg16", "recommended"] != "none").all()
    assert (g.loc["vgg16", "pays off from batch"] == 16).all()
    # none's peak crosses 100 MB between batch 64 and 128; 0.6x still fits at 128
    enables = g.loc["vgg16", "enables batch under cap"].iloc[0]
    assert enables in (128, 256)


def test_noisy_cells_are_flagged_and_markdown_renders():
    frame = synthetic.summary({"vgg16": (0.6, 1.2), "mlp3": (0.9, 1.1)})
    report = analyze(frame, runs=synthetic.runs(frame, cv=0.3), settings=FAST)
    assert len(report.noise) > 0 and (report.noise["cv"] > 0.1).all()
    text = report.to_markdown()
    for section in ("### claims", "### guidelines", "### effects", "### friedman",
                    "### pairwise", "### mixed model"):
        assert section in text
    assert report.to_dict()["blocks"] == 12


def test_hodges_lehmann_matches_its_definition():
    x = np.array([1.0, 2.0, 10.0])
    walsh = [1.0, 1.5, 5.5, 2.0, 6.0, 10.0]
    assert hodges_lehmann(x) == np.median(walsh)


@pytest.mark.slow
def test_configurations_the_guard_did_not_trust_are_left_out_and_counted():
    frame = synthetic.summary({"mlp3": (0.7, 1.3), "vgg16": (0.6, 1.2)})
    frame["trusted"] = True
    disturbed = (frame["cfg_strategy"] == "sqrt") & (frame["cfg_batch"] >= 128)
    frame.loc[disturbed, "step_s_median"] *= 3  # timed beside another job
    frame.loc[disturbed, "trusted"] = False
    runs = synthetic.runs(frame)
    report = analyze(frame, runs, settings=FAST)
    assert f"{int(disturbed.sum())} configurations left out" in " ".join(report.notes)
    effects = report.effects.set_index(["architecture", "strategy"])
    assert effects.loc[("vgg16", "sqrt"), "blocks"] == 3  # the disturbed blocks are gone
    assert effects.loc[("vgg16", "sqrt"), "time_change"] == pytest.approx(0.2, abs=0.02)
    everything = analyze(frame, runs, settings=FAST, untrusted=True)
    polluted = everything.effects.set_index(["architecture", "strategy"])
    assert polluted.loc[("vgg16", "sqrt"), "time_change"] > 0.5
    assert not any("left out" in n for n in everything.notes)


def test_the_claims_are_checked_on_each_device_apart():
    """Issue 51: a remat effect on one card, none on another, their runs in one database with
    the same factors: each device's claims say what holds there."""
    gpu = synthetic.summary({"mlp3": (0.7, 1.3), "vgg16": (0.6, 1.2)}).assign(
        device_name="NVIDIA H200", vendor="nvidia")
    other = synthetic.summary({"mlp3": (1.0, 1.0), "vgg16": (1.0, 1.0)}, noise=0.02).assign(
        device_name="AMD Instinct MI300X", vendor="amd")  # the same factors, "cuda" both
    other["config_id"] = other["config_id"] + "-mi300x"
    report = analyze(pd.concat([gpu, other], ignore_index=True), settings=FAST)
    first = report.claims[report.claims["claim"].str.startswith("(1)")]
    verdicts = first.groupby("device")["verdict"].agg(set).to_dict()
    assert verdicts == {"NVIDIA H200": {"confirmed"}, "AMD Instinct MI300X": {"not confirmed"}}
    assert report.blocks == 24  # paired within each card, never across


def test_holm_is_statsmodels_holm():
    """`holm` against statsmodels' own, on p-values with ties, NaN, ones and a single test."""
    from statsmodels.stats.multitest import multipletests

    rng = np.random.default_rng(0)
    cases = [rng.uniform(size=n) for n in (1, 2, 7, 30)]
    cases += [np.array([0.01, 0.2, np.nan, 0.01, 1.0, 0.04]), np.array([0.5, 0.5, 0.5])]
    for p in cases:
        np.testing.assert_array_equal(holm(p), multipletests(p, method="holm")[1])
