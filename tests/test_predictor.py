"""The predictor: the estimator contract, skops round trips, and loading files safely."""

import json
import subprocess
import sys
import zipfile

import numpy as np
import pandas as pd
import pytest
import skops.io as sio
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.model_selection import KFold, cross_val_predict

from rematlab.core.files import write_atomic
from rematlab.core.units import parse_bytes
from rematlab.exceptions import ConfigError
from rematlab.study import predictor as P
from tests import clirun


def _frame(n: int = 40) -> pd.DataFrame:
    """Features shaped like `predictor.dataset`'s, with targets that follow them."""
    rng = np.random.default_rng(0)
    cols = {c: rng.random(n) + 1 for c in P.ANALYTIC + P.ROOFLINE + P.CONFIG_NUMERIC}
    for c in P.CONFIG_CATEGORICAL:
        if c != "precision":
            cols[c] = rng.choice(["a", "b"], n)
    # drawn apart, so that the other columns are what they were before it existed (the
    # flat layout's predictor file predicts on them: tests/test_layout.py)
    cols["precision"] = np.random.default_rng(1).choice(["fp32", "bf16"], n)
    cols["analytic_peak"] = rng.random(n) * 1e6 + 1e6
    cols["memory"] = cols["analytic_peak"] * (1.0 + 0.01 * rng.random(n))
    cols["time"] = 0.1 + np.asarray(cols["conv_flops_s"]) + 0.01 * rng.random(n)
    return pd.DataFrame(cols)


ALL = sorted((name, target) for target, names in P.MODELS.items() for name in names)


@pytest.mark.parametrize(("name", "target"), ALL)
def test_every_model_keeps_the_estimator_contract_and_survives_a_skops_round_trip(
        tmp_path, name, target):
    data = _frame()
    y = data[target].to_numpy(float)
    model = P.make_model(name)
    with pytest.raises(NotFittedError):
        model.predict(data)
    params = model.get_params()
    assert clone(model).get_params().keys() == params.keys()  # the constructor only stores
    assert model.fit(data, y) is model
    before = model.predict(data)
    assert before.shape == y.shape and np.all(np.isfinite(before)) and np.all(before > 0)
    oof = cross_val_predict(P.make_model(name), data, y, cv=KFold(5))  # model selection
    assert oof.shape == y.shape
    sio.dump({"m": model}, str(tmp_path / "m.skops"))
    untrusted = set(sio.get_untrusted_types(file=str(tmp_path / "m.skops")))
    assert untrusted <= P.SAVED_TYPES  # the exact list covers everything fit can write
    loaded = sio.load(str(tmp_path / "m.skops"), trusted=list(untrusted))["m"]
    # a forest on all cores sums its trees in whatever order they finish
    np.testing.assert_allclose(loaded.predict(data), before, rtol=1e-12)


def test_the_corrected_models_learn_a_planted_correction():
    data = _frame(80)
    data["memory"] = data["analytic_peak"] * 1.25  # the analytic model is 20 % low
    fitted = P.make_model("analytic+gbr").fit(data, data["memory"].to_numpy(float))
    np.testing.assert_allclose(fitted.predict(data), data["memory"], rtol=0.01)
    assert P.make_model("analytic").fit(data, data["memory"]).predict(data) == \
        pytest.approx(data["analytic_peak"].to_numpy())


def test_predictor_save_and_load_give_the_same_predictions(tmp_path):
    data = _frame()
    pred = P.Predictor().fit(data)
    pred.save(tmp_path / "p.skops")
    back = P.Predictor.load(tmp_path / "p.skops")
    pd.testing.assert_frame_equal(back.predict(data), pred.predict(data))
    assert back.names_ == pred.names_


def test_an_unfitted_predictor_refuses_to_predict():
    with pytest.raises(ConfigError, match="not fitted"):
        P.Predictor().predict(_frame())


def _malicious(path, marker) -> None:
    """A skops file whose 'fitted' entry calls numpy's `runstring` on load (the issue-13
    exploit: every name starts with 'numpy.', which a prefix rule trusted)."""
    sio.dump({"names": {}, "fitted": (f"open({str(marker)!r}, 'w').close()", {}),
              "half_width": {}, "coverage": 0.9}, str(path))
    with zipfile.ZipFile(path) as z:
        files = {n: z.read(n) for n in z.namelist()}
    schema = json.loads(files["schema.json"])
    schema["content"]["fitted"] = {
        "__class__": "runstring", "__module__": "numpy.testing._private.utils",
        "__loader__": "ConstructorFromReduceNode", "content": schema["content"]["fitted"],
        "__id__": 1}
    files["schema.json"] = json.dumps(schema).encode()
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)


def test_a_tampered_predictor_runs_no_code_and_the_cli_exits_2(tmp_path, monkeypatch):
    _malicious(tmp_path / "evil.skops", tmp_path / "marker")
    with pytest.raises(ConfigError, match="runstring"):
        P.Predictor.load(tmp_path / "evil.skops")
    proc = clirun.run(["predict", "--predictor", str(tmp_path / "evil.skops"), "--model",
                       "mlp3"])
    assert proc.returncode == 2, proc.stderr
    assert [line[:7] for line in clirun.said(proc.stderr)] == ["error: "]
    assert not (tmp_path / "marker").exists()
    # The exact trusted-type list is what stops it: trusting the exploit's type, rematlab's
    # own loader would run its code (the structure check refuses only afterwards).
    monkeypatch.setattr(P, "SAVED_TYPES",
                        P.SAVED_TYPES | {"numpy.testing._private.utils.runstring"})
    with pytest.raises(ConfigError):
        P.Predictor.load(tmp_path / "evil.skops")
    assert (tmp_path / "marker").exists()


@pytest.mark.parametrize("content", [b"", b"not a zip at all", b"PK\x03\x04truncated"])
def test_a_damaged_predictor_file_is_a_one_line_error(tmp_path, content):
    (tmp_path / "p.skops").write_bytes(content)
    with pytest.raises(ConfigError, match="not a rematlab predictor"):
        P.Predictor.load(tmp_path / "p.skops")


def test_a_skops_file_of_another_structure_is_refused(tmp_path):
    sio.dump({"something": [1, 2, 3]}, str(tmp_path / "p.skops"))
    with pytest.raises(ConfigError, match="not a rematlab predictor"):
        P.Predictor.load(tmp_path / "p.skops")


def test_a_failed_write_leaves_the_old_file_intact(tmp_path):
    target = tmp_path / "predictor.skops"
    target.write_bytes(b"old predictor")

    def dies_half_way(tmp):
        tmp.write_bytes(b"half a ")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, dies_half_way)
    assert target.read_bytes() == b"old predictor"
    assert list(tmp_path.iterdir()) == [target]  # no temporary file left behind


def test_fit_and_stats_refuse_to_overwrite_their_database(tmp_path):
    db = tmp_path / "r.duckdb"
    db.write_bytes(b"precious")
    for args in (["fit", "--db", str(db), "--out", str(db)],
                 ["stats", "--db", str(db), "--markdown", str(db)]):
        proc = clirun.run(args)
        assert proc.returncode == 2 and "also an input" in proc.stderr, proc.stderr
    assert db.read_bytes() == b"precious"


@pytest.mark.parametrize("text", ["1e999", "inf", "nan", "-Infinity GiB", float("inf")])
def test_non_finite_memory_sizes_are_config_errors(text):
    with pytest.raises(ConfigError):
        parse_bytes(text)


def test_a_killed_writer_leaves_the_old_file_intact(tmp_path):
    """SIGKILL in the middle of a write (what `fit --out` does through `write_atomic`)."""
    import signal
    import time

    target = tmp_path / "predictor.skops"
    target.write_bytes(b"old predictor")
    script = (
        "import time, sys\n"
        "from rematlab.core.files import write_atomic\n"
        "def slow(tmp):\n"
        "    tmp.write_bytes(b'half a new predi')\n"
        "    print('written', flush=True)\n"
        "    time.sleep(60)\n"
        f"write_atomic({str(target)!r}, slow)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "written"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    time.sleep(0.1)
    assert target.read_bytes() == b"old predictor"
    orphans = list(tmp_path.glob(".predictor.*"))
    assert len(orphans) == 1  # the killed writer's half file, hidden beside the target
    write_atomic(target, lambda tmp: tmp.write_bytes(b"new predictor"))
    assert target.read_bytes() == b"new predictor"
    assert list(tmp_path.glob(".predictor.*")) == []  # the next write cleaned it up


def test_dataset_leaves_out_what_the_guard_did_not_trust_and_says_how_many():
    rows = [{"config_id": f"{m}-{b}-{s}", "cfg_model": m, "cfg_input": "mnist",
             "cfg_input_shape": None, "cfg_batch": b, "cfg_strategy": s, "cfg_device": "cpu",
             "cfg_dtype": "float32", "cfg_optimizer": "momentum", "outcome": "ok",
             "step_s_median": 0.01 * b, "peak_bytes_median": 1e6 * b, "vendor": "CPU",
             "device_name": "synthetic", "trusted": b != 64}
            for m in ("mlp3", "mlp5") for b in (16, 32, 64, 128) for s in ("none", "sqrt")]
    summary = pd.DataFrame(rows)
    data = P.dataset(summary)
    assert len(data) == 12 and data.attrs["untrusted_left_out"] == 4
    assert 64 not in set(data["batch"])
    assert len(P.dataset(summary, untrusted=True)) == 16
    # a busy machine: too few trusted to fit, so the untrusted ones are used and counted
    summary["trusted"] = summary["cfg_batch"] == 16
    busy = P.dataset(summary)
    assert len(busy) == 16 and busy.attrs["untrusted_used"] == 12
    assert busy.attrs["untrusted_left_out"] == 0
    with pytest.raises(ConfigError, match="at least 10"):
        P.dataset(summary[summary["cfg_batch"] <= 32])  # 8 measured: too few either way


def _saved_state(tmp_path):
    """A real predictor's state, as `save` writes it, to tamper with."""
    data = _frame()
    pred = P.Predictor().fit(data)
    return {"names": dict(pred.names_), "fitted": dict(pred.fitted_),
            "half_width": dict(pred.half_width_), "coverage": pred.coverage}


def _boosted_trees(estimator):
    from sklearn.ensemble import HistGradientBoostingRegressor

    from rematlab.study.modelfile import _walk

    return [t for o in _walk(estimator) if isinstance(o, HistGradientBoostingRegressor)
            for stage in getattr(o, "_predictors", []) for t in stage]


def test_a_boosted_tree_pointing_outside_itself_is_refused_before_it_can_crash(tmp_path):
    state = _saved_state(tmp_path)
    trees = _boosted_trees(state["fitted"]["memory"])
    assert trees, state["names"]
    trees[0].nodes["left"][0] = 10**8  # what crashed predict with SIGSEGV
    sio.dump(state, str(tmp_path / "p.skops"))
    with pytest.raises(ConfigError, match="child indices point outside"):
        P.Predictor.load(tmp_path / "p.skops")


def test_fitted_entries_that_are_none_are_refused_at_load(tmp_path):
    state = _saved_state(tmp_path)
    state["fitted"] = dict.fromkeys(state["fitted"])
    sio.dump(state, str(tmp_path / "p.skops"))
    with pytest.raises(ConfigError, match="not a fitted estimator"):
        P.Predictor.load(tmp_path / "p.skops")


def test_a_zip_bomb_is_refused_without_inflating_it(tmp_path):
    state = _saved_state(tmp_path)
    sio.dump(state, str(tmp_path / "p.skops"))
    with zipfile.ZipFile(tmp_path / "p.skops", "a", zipfile.ZIP_DEFLATED) as z, \
            z.open("bomb.npy", "w") as member:
        for _ in range(32):
            member.write(bytes(1 << 20))
    with pytest.raises(ConfigError, match="zip bomb"):
        P.Predictor.load(tmp_path / "p.skops")
