import json

import pytest
from typer.testing import CliRunner

from rematlab.cli import app
from tests import clirun

runner = CliRunner()


def test_measure_json_output_has_the_documented_figures():
    result = runner.invoke(app, ["measure", "--model", "lenet5", "--batch", "8", "--strategy",
                                 "uniform:2", "--repeats", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["outcome"] == "ok"
    for key in ("step_s_median", "step_s_iqr", "forward_s_median", "backward_s_median",
                "recompute_s_median", "optimizer_s_median", "peak_bytes",
                "saved_activation_bytes", "forward_flops", "backward_flops", "recompute_flops",
                "params", "methods", "env"):
        assert key in data, key
    assert data["recompute_flops"] > 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["--model", "resnet9"], "unknown model"), (["--model", "mlp3", "--batch", "0"], "batch"),
     (["--model", "mlp3", "--strategy", "zigzag"], "unknown strategy"),
     (["--model", "mlp3", "--device", "tpu"], "device"),
     (["--model", "mlp3", "--max-memory", "lots"], "memory size")],
)
def test_bad_input_is_one_line_and_exit_status_2(args, needle):
    proc = clirun.run(["measure", *args])
    assert proc.returncode == 2
    lines = clirun.said(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in proc.stderr


def test_memory_cap_is_reported_as_oom_not_a_crash():
    result = runner.invoke(app, ["measure", "--model", "mlp3", "--batch", "64",
                                 "--max-memory", "1MiB", "--json", "--repeats", "1"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["outcome"] == "oom"


def test_plan_command_prints_plan_and_baselines(tmp_path):
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", "--model", "lenet5", "--batch", "64", "--budget",
                                 "16MiB", "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["measured_peak"] <= 16 * 2**20
    assert {r["strategy"] for r in data["baselines"]} >= {"none", "sqrt", "selective"}
    assert out.exists()
    measured = runner.invoke(app, ["measure", "--model", "lenet5", "--batch", "64",
                                   "--strategy", f"plan:{out}", "--repeats", "1", "--json"])
    assert json.loads(measured.stdout)["peak_bytes"] <= 16 * 2**20


def test_infeasible_plan_is_one_line_with_the_floor():
    proc = clirun.run(["plan", "--model", "mlp3", "--batch", "16", "--budget", "1KiB"])
    assert proc.returncode == 2
    assert len(clirun.said(proc.stderr)) == 1
    assert "is infeasible: the smallest peak for this model and batch is" in proc.stderr


def test_compile_with_predict_is_refused_in_one_line():
    proc = clirun.run(["plan", "--model", "mlp3", "--budget", "1GiB", "--compile",
                       "--predict"])
    assert proc.returncode == 2
    assert clirun.said(proc.stderr)[0].startswith("error: compiled costs must be measured")
    assert len(clirun.said(proc.stderr)) == 1


MODELS_PY = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def gpt2():
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                      n_positions=32, bos_token_id=0, eos_token_id=0))


def batch(b):
    ids = torch.randint(0, 64, (b, 16))
    return {"input_ids": ids, "labels": ids}


def broken(b):
    raise RuntimeError("no data here")
'''


def _cli(args, cwd):
    return clirun.run(args, cwd=cwd)


def test_plan_and_measure_a_transformers_model_from_the_current_directory(tmp_path):
    (tmp_path / "mymodels.py").write_text(MODELS_PY)
    proc = _cli(["plan", "--model", "mymodels:gpt2", "--example", "mymodels:batch", "--batch",
                 "4", "--budget", "1GiB", "--json", "--out", "plan.json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert "layers" in data["structure"] and data["measured_peak"] <= data["budget"]
    assert data["plan_json"]["n_blocks"] == 4  # two layers, one block before, one after
    proc = _cli(["measure", "--model", "mymodels:gpt2", "--input-shape", "16", "--input-dtype",
                 "int64", "--vocab", "64", "--batch", "4", "--strategy", "plan:plan.json",
                 "--blocks", "transformer.h", "--repeats", "1", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["outcome"] == "ok"


def test_an_op_level_plan_from_the_cli_runs_in_measure(tmp_path):
    (tmp_path / "mymodels.py").write_text(MODELS_PY)
    proc = _cli(["plan", "--model", "mymodels:gpt2", "--example", "mymodels:batch", "--batch",
                 "4", "--budget", "1GiB", "--ops", "--json", "--out", "plan.json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["measured_peak"] <= data["budget"]
    plan = json.loads((tmp_path / "plan.json").read_text())
    layer = plan["items"][1] if isinstance(plan["items"][1], int) else plan["items"][1]["block"]
    plan["items"][1] = {"block": layer, "option": "save addmm×4, bmm×2",
                        "saves": [["aten.addmm.default", 0]], "ops": "not these ops"}
    (tmp_path / "stale.json").write_text(json.dumps(plan))
    proc = _cli(["measure", "--model", "mymodels:gpt2", "--input-shape", "16", "--input-dtype",
                 "int64", "--vocab", "64", "--batch", "4", "--strategy", "plan:stale.json",
                 "--blocks", "transformer.h", "--repeats", "1", "--json"], tmp_path)
    assert "plan is stale: layer 0 ran" in proc.stdout + proc.stderr


@pytest.mark.parametrize(("args", "needle"), [
    (["--example", "mymodels:broken"], "example factory 'mymodels:broken' failed"),
    (["--example", "mymodels:nothing"], "cannot load example factory"),
    (["--input-shape", "16", "--input-dtype", "int64"], "vocabulary size"),
    (["--input-shape", "16", "--input-dtype", "int64", "--vocab", "64", "--blocks", "nope"],
     "has no submodule 'nope'"),
    (["--example", "mymodels:batch", "--budget", "1KiB"], "is infeasible"),
    (["--example", "mymodels:batch", "--budget", "1e999GiB"], "memory size"),
])
def test_bad_input_for_a_real_model_is_one_line_and_exit_2(tmp_path, args, needle):
    (tmp_path / "mymodels.py").write_text(MODELS_PY)
    if "--budget" not in args:
        args = [*args, "--budget", "1GiB"]
    proc = _cli(["plan", "--model", "mymodels:gpt2", "--batch", "4", *args], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = clirun.said(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines


def test_plan_with_several_budgets_profiles_once_and_never_gets_slower():
    result = runner.invoke(app, ["plan", "--model", "mlp5", "--batch", "2048", "--budgets",
                                 "80MiB,90MiB,200MiB", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    plans = data["plans"]
    assert [p["budget"] for p in plans] == [80 * 2**20, 90 * 2**20, 200 * 2**20]
    assert plans[0]["plan"] != plans[-1]["plan"]  # a real choice between the budgets
    assert all(p["measured_peak"] <= p["budget"] for p in plans)
    overheads = [p["predicted_overhead"] for p in plans]
    assert overheads == sorted(overheads, reverse=True)
    assert data["curve"][-1]["overhead"] == 0.0 and len(data["curve"]) >= 2


@pytest.mark.slow
def test_max_batch_predicts_for_a_card_from_the_command_line():
    """`max-batch --predict` (README): meta batches stay meta, times are the card's roofline
    (not FLOPs), and remat fits a larger batch of VGG-16 within the budget."""
    proc = clirun.run(["max-batch", "--model", "vgg16", "--input", "cifar", "--predict",
                       "--target", "rtx4090", "--budget", "2GiB", "--json"])
    assert proc.returncode == 0, proc.stderr
    fits = {f["case"]: f for f in json.loads(proc.stdout)["fits"]}
    assert fits["optimal"]["batch"] > fits["none"]["batch"] > 0
    for f in fits.values():
        assert f["peak"] <= 2 * 2**30 and not f["at_limit"]
        assert 1e-4 < f["step_s"] < 1.0  # seconds on the card, not a count of FLOPs
