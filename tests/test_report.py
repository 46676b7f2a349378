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
    claim_lines = {(cells[1], cells[2]): cells for line in md.read_text().splitlines()
                   if (cells := [c.strip() for c in line.split("|")])[2:3]
                   and cells[2].startswith("(")}  # | device | claim | ... |
    for claim in res.stats["claims"]:  # each claim's own verdict, in its own row
        cells = claim_lines[(claim["device"], claim["claim"])]
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


def _figures(monkeypatch, fn, *args, tidy: bool = True) -> list:
    """The matplotlib figures `fn` draws, as `_png` receives them (after its tidying, or,
    with `tidy=False`, as drawn)."""
    from rematlab.study import figures as report

    seen, encode = [], report._png
    if not tidy:
        monkeypatch.setattr(report, "_no_overlapping_ticks", lambda fig: fig.canvas.draw())

    def keep(fig):
        seen.append(fig)
        return encode(fig)

    monkeypatch.setattr(report, "_png", keep)
    fn(*args)
    return seen


def _hollow(ax) -> int:
    return sum(len(c.get_offsets()) for c in ax.collections
               if len(c.get_facecolors()) == 0 and len(c.get_offsets()))


@pytest.mark.slow
def test_untrusted_points_are_hollow_and_named_in_the_legend(monkeypatch):
    from rematlab.study.figures import UNTRUSTED, pareto_figure, ratio_figure

    summary = synthetic.summary({"lenet5": (0.6, 1.3)}, batches=(16, 32, 64))
    summary["trusted"] = True
    summary.loc[summary["cfg_batch"] == 32, "trusted"] = False  # a busy spell: 4 strategies
    plans = pd.DataFrame([{"model": "lenet5", "step_s": s, "measured_peak": 3e7,
                           "trusted": t} for s, t in ((0.5, True), (1.7, False))])
    fig, = _figures(monkeypatch, pareto_figure, summary, plans)
    assert _hollow(fig.axes[0]) == 4 + 1  # the 4 configurations and the planner's point
    assert UNTRUSTED in [t.get_text() for t in fig.legends[0].get_texts()]
    fig, = _figures(monkeypatch, ratio_figure, summary)
    # 3 strategies against none at batch 32, on the memory and the time panel
    assert [_hollow(ax) for ax in fig.axes] == [3, 3]
    summary["trusted"] = True
    fig, = _figures(monkeypatch, ratio_figure, summary)
    assert [_hollow(ax) for ax in fig.axes] == [0, 0]


def _overlaps(fig) -> int:
    """Pairs of tick labels that meet, the figure drawn again as a PNG is (`_png` closed it)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    count = 0
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            boxes = [t.label1.get_window_extent(renderer)
                     for t in [*axis.get_major_ticks(), *axis.get_minor_ticks()]
                     if t.label1.get_visible() and t.label1.get_text()
                     and lo <= t.get_loc() <= hi]
            count += sum(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    return count


@pytest.mark.slow
def test_tick_labels_never_overlap(monkeypatch):
    from rematlab.study.figures import pareto_figure

    # step times over about a decade (a log axis then labels minor ticks too), six panels
    summary = synthetic.summary({f"m{i}": (0.7, 1.05) for i in range(6)}, batches=(15, 140))
    drawn, = _figures(monkeypatch, pareto_figure, summary, pd.DataFrame(), tidy=False)
    assert _overlaps(drawn) > 0  # the case the tidying is for
    monkeypatch.undo()
    tidy, = _figures(monkeypatch, pareto_figure, summary, pd.DataFrame())
    assert _overlaps(tidy) == 0
    assert all(sum(t.label1.get_visible() and bool(t.label1.get_text())
                   for t in ax.xaxis.get_major_ticks() + ax.xaxis.get_minor_ticks()) >= 2
               for ax in tidy.axes if ax.get_visible() and ax.has_data())


def test_figures_read_at_a_glance():
    """Issue 52: no offset notation where values barely vary (the planner figure read
    `1e-6+5.2461e1` on MLP-3), a flat line widened to a readable range, and point labels
    that would collide (a Pareto figure's batch sizes) shown once."""
    import matplotlib.pyplot as plt

    from rematlab.study.figures import _no_overlapping_ticks, plain_axes

    fig, ax = plt.subplots()
    ax.plot([1.0, 2.0], [52.4611, 52.4611 + 1e-6])
    for _ in range(3):
        ax.annotate("64", (1.5, 52.4611))  # three labels at one point
    plain_axes(ax)
    _no_overlapping_ticks(fig)
    assert ax.yaxis.get_offset_text().get_text() == ""
    lo, hi = ax.get_ylim()
    assert hi - lo > 5  # ±5 % around 52.46 MiB
    assert sum(t.get_visible() for t in ax.texts) == 1
    plt.close(fig)
