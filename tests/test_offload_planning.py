"""Keep, recompute or offload (issue 61): pre-flight offers each layer's offload options
(`rematlab.plans.offload`), the solver chooses them where they pay, the device and host bytes
a plan holds are what a fake run of it meters (host buffers counted apart), an offloading
plan applied to a real model gives the plain model's gradients, and offload is refused, with
the reason, where it cannot be planned."""

import dataclasses

import pytest
import torch
import transformers

import rematlab
from rematlab.exceptions import ConfigError
from rematlab.planning.planner import RANK_TOLERANCE
from rematlab.plans.offload import (
    Link,
    host_bytes,
    is_offload,
    serialized,
    unprefetched,
    with_offload,
)
from rematlab.plans.plan import OFFLOAD_INPUT, ChainCosts, Option, Plan, Selective
from rematlab.plans.simulate import simulate
from rematlab.preflight.targets import GH200_LINK, PROFILES
from rematlab.remat.layers import offloader_of
from tests import ranks

CONFIG = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 1024, "n_positions": 512}
STEP = rematlab.Step(precision="bf16", optimizer=torch.optim.AdamW)


def _meta_gpt2():
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))


def _batch():
    ids = torch.empty(8, 512, dtype=torch.int64, device="meta")  # hidden states: 2 MiB in bf16
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def planned():
    """The same model pre-flighted for an H100 with and without offload."""
    return {offload: rematlab.prepare(_meta_gpt2(), _batch(), predict=True,
                                      target="h100-80gb", step=STEP, offload=offload)
            for offload in (False, True)}


def test_offload_lowers_the_floor_and_is_chosen_where_it_pays(planned):
    without, with_ = planned[False], planned[True]
    assert with_.floor < without.floor  # a layer's input on the host holds less than a checkpoint
    floor_plan = with_.solution.frontier[0]
    assert any(isinstance(it, Selective) and it.option == OFFLOAD_INPUT
               for it in floor_plan.items)
    # at every budget the offload planning is no slower than the planning without it
    for plan in without.solution.frontier:
        faster = [p for p in with_.solution.frontier if p.predicted_peak <= plan.predicted_peak]
        assert min(p.predicted_time for p in faster) <= plan.predicted_time * (1 + 1e-6)
    assert any(any(is_offload(it) for it in p.items) for p in with_.solution.frontier[1:])


def test_the_device_and_host_bytes_are_what_a_fake_run_meters(planned):
    """Each plan's whole step run on fake CUDA tensors (`Planning.card`, the allocator
    replay), host buffers counted apart: an offloading plan's allocated peak lies as far from
    its simulated peak as the plain plan's does (the gap is what neither models), give or
    take 3 % of the peak (measured on this model at 6 layers: every option's plan from 23 %
    over-predicted, the prefetch counted as the previous layer's largest option, to 2.5 %
    under, offloading every saved tensor: an input-sized tensor per offloaded layer that the
    model's own forward keeps and the layer metered alone does not; `choose` holds a plan to
    this replay, not to the simulation); and the host bytes it pins are the simulator's to
    the byte."""
    p = planned[True]
    n = p.costs.n
    plain = Plan(n, tuple(range(n)))
    gap = p.card(plain).allocated - simulate(plain, p.costs)[0]
    names = [o.name for o in p.costs.menu(1)]
    assert OFFLOAD_INPUT in names and "offload" in names and len(names) >= 3
    for name in names:
        items = (0, *(Selective(i, name) for i in range(1, n - 2)), n - 2, n - 1)
        plan = Plan(n, items)
        card = p.card(plan)
        peak = simulate(plan, p.costs)[0]
        assert card.allocated - peak <= gap + 0.03 * peak, name
        assert card.host == host_bytes(items, p.costs) > 0


def test_on_a_grace_hopper_link_offload_takes_the_place_of_recomputation(planned):
    pcie = planned[True]
    gh200 = dataclasses.replace(PROFILES["h100-80gb"], name="gh200-96gb",
                                host_link=GH200_LINK)
    fast = rematlab.prepare(_meta_gpt2(), _batch(), predict=True, target=gh200, step=STEP,
                            offload=True)
    budget = (pcie.floor + pcie.full) // 2
    slow_plan, fast_plan = (pcie.solution.plan_for(budget), fast.solution.plan_for(budget))
    assert fast_plan.recomputed < slow_plan.recomputed
    assert len(fast_plan.offloaded) > len(slow_plan.offloaded)


def test_an_offloading_plan_gives_the_plain_models_gradients(planned):
    """Each kind of offload option, applied to a real float64 model on this CPU (where the
    copies are synchronous): every gradient equal to the plain model's, and tensors moved."""
    n = planned[True].costs.n
    torch.manual_seed(0)
    config = transformers.GPT2Config(**CONFIG, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).double().train()
    ids = torch.randint(0, 1024, (2, 512))  # hidden states: 2 MiB in float64
    model(input_ids=ids, labels=ids).loss.backward()
    plain = {k: v.grad.clone() for k, v in model.named_parameters()}
    for name in ("offload", OFFLOAD_INPUT, f"offload {3 << 20}"):  # all; input; up to 3 MiB
        model.zero_grad(set_to_none=True)
        plan = Plan(n, (0, 1, *(Selective(i, name) for i in range(2, n - 2)), n - 2, n - 1))
        remat = rematlab.apply(model, plan)
        remat(input_ids=ids, labels=ids).loss.backward()
        assert all(torch.equal(v.grad, plain[k]) for k, v in model.named_parameters()), name
        assert offloader_of(remat).stats.tensors > 0


def test_offload_is_refused_where_it_cannot_be_planned():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
    ids = torch.randint(0, 1024, (2, 64))
    with pytest.raises(ConfigError, match="on a CPU they are one memory"):
        rematlab.plan(model, {"input_ids": ids, "labels": ids}, "1GiB", offload=True)
    with pytest.raises(ConfigError, match="on a CPU they are one memory"):
        rematlab.prepare(_meta_gpt2(), _batch(), predict=True, offload=True,
                         target={"name": "a cpu", "kind": "cpu", "memory": "64GiB",
                                 "flops": 1e12, "bandwidth": 1e11})
    with pytest.raises(ConfigError, match=r"torch\.compile"):
        rematlab.PlanOptions(offload=True, compile=True)
    with pytest.raises(ConfigError, match="offload must be True or False"):
        rematlab.PlanOptions(offload="yes")
    with pytest.raises(ConfigError, match="chain of blocks"):
        rematlab.prepare(rematlab.zoo.mlp(3), torch.empty(8, 784, device="meta"),
                         predict=True, target="h100-80gb", offload=True)


def test_an_edited_offload_option_or_one_in_a_chain_is_refused():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
    n = CONFIG["n_layer"] + 2
    with pytest.raises(ConfigError, match="not an offload option"):
        rematlab.apply(model, Plan(n, (0, Selective(1, "offload lots"), *range(2, n))))
    chain = rematlab.zoo.mlp(3)
    blocks = len(list(chain.children()))
    with pytest.raises(ConfigError, match="not in a chain of blocks"):
        rematlab.apply(chain, Plan(blocks, (0, Selective(1, "offload"), *range(2, blocks))))


def _chain(n: int = 5) -> ChainCosts:
    mib = 1 << 20
    return ChainCosts(x=[mib] * (n + 1), saved=[8 * mib] * n, keeps_input=[True] * n,
                      keeps_output=[False] * n, fwd_mem=[9 * mib] * n, bwd_mem=[2 * mib] * n,
                      grad=[0] * n, fwd_time=[1e-3] * n, bwd_time=[2e-3] * n)


def _metered(c: ChainCosts, host: int) -> list[list[Option]]:
    raw = Option("offload", (), c.saved[1] - host, True, False, c.fwd_mem[1],
                 c.bwd_mem[1] + host, c.fwd_time[1], c.bwd_time[1], host=host)
    return [[raw] if 0 < i < c.n - 2 else [] for i in range(c.n)]


def test_pricing_hides_what_the_window_can_and_pays_the_rest():
    c = _chain()
    host = 8 << 20
    fast = with_offload(c, _metered(c, host), Link(1e12, 1e12, 1 << 40))
    slow = with_offload(c, _metered(c, host), Link(1e9, 1e9, 1 << 40))
    serial = serialized(fast, Link(1e12, 1e12, 1 << 40))
    hidden, exposed = fast.option(1, "offload"), slow.option(1, "offload")
    assert (hidden.fwd_time, hidden.bwd_time) == (c.fwd_time[1], c.bwd_time[1])
    assert exposed.fwd_time == pytest.approx(c.fwd_time[1] + host / 1e9 - c.fwd_time[2])
    assert serial.option(1, "offload").fwd_time == pytest.approx(c.fwd_time[1] + host / 1e12)
    assert serial.option(1, "offload").bwd_time == pytest.approx(c.bwd_time[1] + host / 1e12)
    # the previous layer's prefetch is held in backward; the last layer is never offered
    assert exposed.bwd_mem == c.bwd_mem[1] + host and slow.option(2, "offload").bwd_mem == (
        c.bwd_mem[1] + 2 * host)
    assert not slow.menu(c.n - 2)
    # a reload is taken as prefetched; one that no next offloaded layer prefetched is paid
    assert exposed.bwd_time == pytest.approx(c.bwd_time[1] + host / 1e9 - c.bwd_time[2])
    run = (0, Selective(1, "offload"), Selective(2, "offload"), 3, 4)
    assert unprefetched(run, slow) == pytest.approx(c.bwd_time[3])


def test_no_plan_pins_more_host_memory_than_the_job_may():
    c = _chain(8)
    host = 8 << 20
    priced = with_offload(c, _metered(c, host), Link(1e12, 1e12, 2 * host))
    assert [i for i in range(c.n) if priced.menu(i)] == [1, 2]
    with pytest.raises(ConfigError, match="positive rate"):
        Link(0, 1e9, 0)
    with pytest.raises(ConfigError, match="whole number of bytes"):
        Link(1e9, 1e9, -1)


@pytest.mark.slow  # two gloo ranks, and a sharded fake step per plan (about 30 s)
def test_offload_composes_with_fsdp2(tmp_path):
    """Real FSDP2 over gloo on this CPU: an offloading plan applied, then sharded, gives the
    plain model's gradients and moves tensors. Pre-flight for one rank of FSDP(2): the
    options priced per rank (gathered parameters added as the block's), each offloading plan
    of the frontier run on a fake group within the rank tolerance of its simulated peak, and
    the plan chosen for a budget holds it there."""
    results = ranks.spawn(ranks.offload_worker, 2, tmp_path)
    for result in results:
        assert result["grad_error"] < 1e-10 and result["grads"] > 0 and result["moved"] > 0
    step = rematlab.Step(precision="bf16", optimizer=torch.optim.AdamW,
                         layout=rematlab.FSDP(2))
    planning = rematlab.prepare(_meta_gpt2(), _batch(), predict=True, target="h100-80gb",
                                step=step, offload=True)
    offloading = [p for p in planning.solution.frontier if p.offloaded]
    assert offloading
    for plan in offloading:
        assert planning.rank(plan).peak <= (1 + RANK_TOLERANCE) * plan.predicted_peak
    budget = (planning.floor_budget() + planning.full) // 2
    assert planning.rank(planning.choose(budget)).peak <= budget
