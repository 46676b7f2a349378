import re
from html.parser import HTMLParser

import pandas as pd
import pytest

from rematlab.gradients.comparison import summarize, verdict
from rematlab.gradients.training import train
from rematlab.study.inference import Settings
from rematlab.study.report import StudyResults, render
from rematlab.study.stats import analyze
from tests import synthetic


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids, self.hrefs, self.srcs, self.h2 = set(), [], [], []
        self._in_h2 = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "a" and "href" in a:
            self.hrefs.append(a["href"])
        if tag == "img":
            self.srcs.append(a.get("src", ""))
        self._in_h2 = tag == "h2"

    def handle_data(self, data):
        if self._in_h2:
            self.h2.append(data.strip())
            self._in_h2 = False


def _results() -> StudyResults:
    summary = synthetic.summary({"mlp3": (1.0, 1.1), "vgg16": (0.7, 1.2)})
    runs = synthetic.runs(summary)
    runs["method_time"] = "perf_counter"
    runs["method_peak"] = "dispatch_live_storages"
    runs["torch_version"] = "2.13.0"
    runs["timestamp"] = "2026-11-30T00:00:00"
    stats = analyze(summary, runs, settings=Settings(bootstrap=200)).to_dict()
    evaluation = pd.DataFrame([{"target": t, "model": "gbr", "protocol": "random 80/20",
                                "r2": 0.99, "mape": 0.01, "p90_ape": 0.02, "n": 10}
                               for t in ("time", "memory")])
    predictions = pd.DataFrame([{"target": t, "measured": v, "predicted": v * 1.01}
                                for t in ("time", "memory") for v in (1.0, 2.0, 3.0)])
    plans = pd.DataFrame([{"model": "vgg16", "batch": 64, "budget": 1e8, "plan": "0 [1-1]{1}",
                           "predicted_peak": 9e7, "measured_peak": 9e7, "within_budget": True,
                           "predicted_overhead": 0.1, "step_s": 0.5, "uniform": "uniform:4",
                           "uniform_fits": True, "uniform_overhead": 0.33}])
    batches = pd.DataFrame([{"model": m, "cap_MiB": 300.0, "batch_none": 91, "batch_remat": b,
                             "samples_s_none": 198.0, "samples_s_remat": 188.1,
                             "throughput_ratio": 0.95, "plan": "0 [1-1]{1}", "search_s": 12.6}
                            for m, b in (("vgg16", 99), ("mlp3", 91))])
    grad_runs = [train("mlp3", m, steps=10, eval_every=5, lr=lr)
                 for m, lr in (("bp", 0.05), ("bp+ckpt", 0.05), ("zo:1", 1e-3))]
    table = summarize(grad_runs)
    gradients = {"table": table, "verdict": verdict(table),
                 "runs": [r.to_dict() for r in grad_runs]}
    return StudyResults(grid="synthetic", summary=summary, runs=runs, evaluation=evaluation,
                        predictions=predictions, predictor_models={"time": "gbr",
                                                                   "memory": "analytic"},
                        stats=stats, plans=plans, gradients=gradients, batches=batches,
                        sweep={"wall_s": 10.0, "measured_s": 4.0, "harness_overhead": 0.6})


@pytest.mark.slow
def test_report_has_every_section_and_embeds_every_figure(tmp_path):
    res = _results()
    html, md = render(res, tmp_path)
    text = html.read_text()
    parser = _Links()
    parser.feed(text)
    for section in ("setup", "pareto", "prediction", "statistics", "batches", "plans",
                    "gradients", "limitations"):
        assert section in parser.ids, section
    # pareto, ratios to none, largest batch, planner, scatter, accuracy vs FLOPs and vs time
    assert len(parser.srcs) == 7
    assert all(src.startswith("data:image/png;base64,") and len(src) > 1000
               for src in parser.srcs)
    assert all(h[1:] in parser.ids for h in parser.hrefs if h.startswith("#"))
    assert not [h for h in parser.hrefs if not h.startswith("#")]  # opens offline
    assert "0.8594" in text and "0.833" in text  # the study's R² beside ours
    assert "bp+ckpt:sqrt reaches" in text  # the gradient verdict, stated
    assert "samples_s_remat" in text and "vgg16" in md.read_text()
    evaluation = [line for line in md.read_text().splitlines() if "| random 80/20 |" in line]
    assert evaluation and all("| 1.0 % | 2.0 % |" in line for line in evaluation)  # percent
    claim_lines = {line.split("|")[1].strip(): line for line in md.read_text().splitlines()
                   if line.startswith("| (")}
    for claim in res.stats["claims"]:  # each claim's own verdict, in its own row
        cells = [c.strip() for c in claim_lines[claim["claim"]].split("|")]
        assert claim["verdict"] in cells, (claim, cells)
    assert "All measurements ran on CPU" in text
    mdtext = md.read_text()
    for fig in re.findall(r"\((figures/[a-z_]+\.png)\)", mdtext):
        assert (tmp_path / fig).exists(), fig
    assert "## Limitations" in mdtext


def test_report_renders_with_missing_stages(tmp_path):
    summary = synthetic.summary({"mlp3": (1.0, 1.1)}, batches=(16, 32))
    res = StudyResults(grid="g", summary=summary, runs=synthetic.runs(summary))
    html, _ = render(res, tmp_path)
    text = html.read_text()
    assert "The gradient comparison did not run" in text
    assert text.count("data:image/png;base64,") == 2  # the sweep's own: pareto, ratios


def test_table_cells_show_intervals_as_brackets():
    from rematlab.core.units import format_number

    assert format_number((0.86647, 0.92753)) == "[0.866, 0.928]"
    assert format_number([1, 2]) == "[1, 2]"
    assert format_number(float("nan")) == "" and format_number(None) == ""


def test_report_says_what_its_grid_is_for(tmp_path):
    summary = synthetic.summary({"mlp3": (1.0, 1.1)}, batches=(16, 32))
    res = StudyResults(grid="demo", summary=summary, runs=synthetic.runs(summary),
                       about="The demo grid: a sketch")
    html, md = render(res, tmp_path)
    assert "The demo grid: a sketch" in html.read_text()
    assert "**The demo grid: a sketch**" in md.read_text()
    plain, _ = render(StudyResults(grid="g", summary=summary, runs=synthetic.runs(summary)),
                      tmp_path / "plain")
    assert "demo grid" not in plain.read_text()
