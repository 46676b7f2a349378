import json

import pandas as pd
import pytest

from rematlab import load
from rematlab.study import reproduce as study_mod
from rematlab.study.reproduce import StudySettings, run_study
from tests import clirun


@pytest.mark.slow
def test_study_end_to_end_and_rerun_reuses_every_stage(tiny_db, tmp_path, monkeypatch):
    """Over the session's tiny sweep (the sweep stage itself is tested in test_sweep)."""
    grid, db, _ = tiny_db
    settings = StudySettings(grid=str(grid), db=db, out=tmp_path / "out",
                             gradient_models=("mlp3",), gradient_budgets=(1,),
                             gradient_seeds=1, gradient_steps=10, plan_fractions=(0.5,))
    said: list[str] = []
    html, md = run_study(settings, say=said.append)
    assert html.exists() and md.exists() and (tmp_path / "out" / "predictor.skops").exists()
    assert [s[:5] for s in said if s.startswith("[")] == [f"[{i}/7]" for i in range(1, 8)]
    text = html.read_text()
    assert text.count("data:image/png;base64,") == 7
    assert "mlp3" in text and "lenet5" in text
    # every architecture gets a cap between none's two largest peaks and its largest batch
    # under it, without and with remat
    caps = study_mod.grid_caps(load(settings.db, "config_summary"))
    assert set(caps) == {"mlp3", "lenet5"}
    guidelines = md.read_text().split("### Guidelines")[1].split("###")[0]
    assert "largest batch under cap (none -> remat)" in guidelines
    assert all(f"| {m} |" in guidelines for m in caps)
    assert guidelines.count(" -> ") >= 1 + len(caps)
    for line in guidelines.splitlines():  # filled for every architecture: a batch or "none"
        if line.startswith(("| mlp3 |", "| lenet5 |")):
            cells = [c.strip() for c in line.split("|")]
            header = [c.strip() for c in guidelines.splitlines()[1].split("|")]
            value = cells[header.index("enables batch under cap")]
            assert value == "none" or value.isdigit(), line

    # the plan stage plans with op-level menus (the default), and every plan was measured
    # within its budget
    plans = json.loads((tmp_path / "out" / "cache" / "plans.json").read_text())["value"]["rows"]
    assert plans and all(row["within_budget"] for row in plans)

    import rematlab.gradients.comparison
    import rematlab.study.predictor

    def fail(*args, **kwargs):
        raise AssertionError("a cached stage ran again")

    monkeypatch.setattr(rematlab.gradients.comparison, "compare", fail)
    monkeypatch.setattr(rematlab.study.predictor, "evaluate", fail)
    monkeypatch.setattr(study_mod, "_plan_stage", fail)
    monkeypatch.setattr(study_mod, "_batch_stage", fail)
    first = md.read_text().splitlines()
    run_study(settings, say=said.append)
    # the rerun measured nothing: the report gives the sweep that did, and says so
    line = next(ln for ln in md.read_text().splitlines() if ln.startswith("Sweep wall time"))
    assert line.split(";")[0] in first[next(i for i, ln in enumerate(first)
                                            if ln.startswith("Sweep wall time"))]
    assert "reused every stored configuration" in line and "overhead 100%" not in line


def test_study_cli_rejects_a_bad_grid_with_exit_status_2(tmp_path):
    proc = clirun.run(["study", "--grid", "nope", "--out", str(tmp_path)])
    assert proc.returncode == 2 and proc.stderr.startswith("error: grid file 'nope' not found")


@pytest.mark.parametrize("args", [["gradients", "--budgets", "a,b"],
                                  ["gradients", "--models", "resnet", "--budgets", "1",
                                   "--seeds", "1", "--steps", "1"],
                                  ["predict", "--predictor", "missing.skops", "--model", "mlp3"]])
def test_other_commands_fail_cleanly(args):
    proc = clirun.run(args)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ")
    assert "Traceback" not in proc.stderr


def test_a_sweep_stored_before_waits_were_recorded_reports_no_wait():
    sweeps = pd.DataFrame([{"sweep_id": "a", "status": "complete", "started_at": "2026-12-01",
                            "configs": 12, "wall_s": 10.0, "measured_s": 8.0,
                            "harness_overhead": 0.2, "waited_s": float("nan")}])
    info = study_mod._sweep_info(sweeps)
    assert info["waited_s"] == 0.0 and info["wall_s"] == 10.0 and not info["reused"]


def test_a_grids_study_table_sizes_the_stages_and_explicit_settings_win(tmp_path):
    from rematlab.study.grid import load_grid
    from rematlab.study.reproduce import DEFAULTS

    grid = tmp_path / "g.toml"
    grid.write_text('batches = [4]\n[[models]]\nname = "mlp3"\n'
                    '[study]\nabout = "a sketch"\ngradient_steps = 7\nplan_ops = false\n')
    settings = StudySettings(grid=str(grid), gradient_seeds=2).for_grid(load_grid(grid))
    assert (settings.gradient_steps, settings.plan_ops, settings.gradient_seeds) == (7, False, 2)
    assert settings.gradient_models == DEFAULTS["gradient_models"]
    assert StudySettings().for_grid(load_grid("quick")).plan_ops is True


@pytest.mark.parametrize(("body", "needle"), [
    ("[study]\ngradient_steps = 0\n", "study.gradient_steps"),
    ("[study]\nplan_fractions = [1.5]\n", "study.plan_fractions"),
    ("[study]\nspeed = 'fast'\n", "study.speed"),
])
def test_a_bad_study_table_names_the_field(tmp_path, body, needle):
    from rematlab.exceptions import ConfigError
    from rematlab.study.grid import load_grid

    grid = tmp_path / "g.toml"
    grid.write_text('batches = [4]\n[[models]]\nname = "mlp3"\n' + body)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_grid(grid)
