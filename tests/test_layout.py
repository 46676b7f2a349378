"""Files written before the package moved into subpackages (issue 26) still load: a predictor
saved by the flat layout predicts what it predicted then, and a plan's JSON applies."""

from pathlib import Path

import pandas as pd
import torch

import rematlab
from rematlab.measurement import zoo
from rematlab.plans.plan import Plan
from rematlab.study import predictor as P
from tests.test_predictor import _frame

DATA = Path(__file__).parent / "data"


def test_a_predictor_file_of_the_flat_layout_loads_and_predicts_as_it_did():
    """The file names its classes `rematlab.predictor.*`, a module that no longer exists."""
    back = P.Predictor.load(DATA / "predictor-flat-layout.skops")
    expected = pd.read_csv(DATA / "predictor-flat-layout.csv", index_col=0)
    pd.testing.assert_frame_equal(back.predict(_frame(12)), expected, rtol=1e-9)


def test_a_plan_file_of_the_flat_layout_applies_with_its_gradients():
    plan = Plan.from_json((DATA / "plan-flat-layout.json").read_text())
    assert plan.describe() == "[0-1]{0,1} 2 3 4"
    torch.manual_seed(0)
    net, sample, _ = zoo.resolve("mlp5", None, None)
    net = net.double()
    x = torch.randn(8, *sample, dtype=torch.float64)
    remat = rematlab.apply(net, plan)
    remat(x).sum().backward()
    ours = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    net(x).sum().backward()
    for a, b in zip(ours, [p.grad for p in net.parameters()], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
