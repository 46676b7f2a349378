"""Rank workers for the distributed tests: real `torch.distributed` over gloo on this CPU,
loopback only, one process per rank (`spawn`). Each writes what it found to `out/rank{r}.json`.

The user's side is written with torch's own APIs, as a user would: the plan applied with
`rematlab.apply` to the unsharded model, then `fully_shard` on each layer and on the root (or
DDP), AdamW, one warm-up step, and the next step metered by torch's `FSDPMemTracker` (or
`MemTracker` plus the bucket bytes DDP reports, which no dispatch mode sees)."""

import copy
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import rematlab
from rematlab import DDP, FSDP, Plan, Step
from rematlab.core.batch import call, tensors
from rematlab.core.steps import default_loss
from rematlab.plans.plan import Selective
from rematlab.remat.layers import offloader_of
from tests.realzoo import gpt2, llama

MODELS = {"gpt2": (gpt2, "transformer.h"), "llama": (llama, "model.layers")}


def made(name: str):
    """The model and batch every rank and the predicting process build alike."""
    torch.manual_seed(0)
    factory, _ = MODELS[name]
    return factory(batch=4, seq=64, layers=4, width=128)


def layers_of(model, name: str) -> list:
    return list(model.get_submodule(MODELS[name][1]))


def free_port() -> int:
    """A free loopback port for a job's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, world: int, out: Path, *args, backend: str = "gloo") -> list[dict]:
    """Run `worker(rank, world, out, *args)` on `world` ranks (gloo on the CPU; nccl with
    one GPU per rank); their JSON results."""
    mp.spawn(_entry, args=(world, free_port(), worker, out, args, backend), nprocs=world)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _entry(rank: int, world: int, port: int, worker, out: Path, args: tuple,
           backend: str = "gloo") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        result = worker(rank, world, *args)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _user_step(model, opt, batch) -> None:
    opt.zero_grad(set_to_none=True)
    out = call(model, batch)
    default_loss(out, batch).backward()
    opt.step()
    del out


def user_fsdp_peak(model, name: str, plan: Plan, batch) -> int:
    """The user's own FSDP2 loop under `plan`, metered by FSDPMemTracker."""
    twin = copy.deepcopy(model)
    planned = rematlab.apply(twin, plan)
    for layer in layers_of(twin, name):
        fully_shard(layer)
    fully_shard(planned)
    opt = torch.optim.AdamW(planned.parameters(), lr=1e-3)
    _user_step(planned, opt, batch)
    tracker = FSDPMemTracker(planned, opt)
    tracker.track_inputs((batch,))
    with tracker:
        _user_step(planned, opt, batch)
    return max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())


def sharded_grads(model, name: str, plan: Plan, batch) -> dict[str, torch.Tensor]:
    """Float64 gradients of one step of the planned, sharded model, gathered."""
    twin = copy.deepcopy(model).double()
    planned = rematlab.apply(twin, plan)
    for layer in layers_of(twin, name):
        fully_shard(layer)
    fully_shard(planned)
    torch.manual_seed(1)  # the same dropout masks as the plain run's
    default_loss(call(planned, batch), batch).backward()
    return {n: p.grad.full_tensor() for n, p in planned.named_parameters()}


def plain_grads(model, batch) -> dict[str, torch.Tensor]:
    twin = copy.deepcopy(model).double()
    torch.manual_seed(1)
    default_loss(call(twin, batch), batch).backward()
    return {n: p.grad for n, p in twin.named_parameters()}


def fsdp_worker(rank: int, world: int, names: list[str]) -> dict:
    """For each model: plans at the per-rank floor, midway and unconstrained, each metered
    in the user's own loop; the floor plan's gathered gradients against the plain model's."""
    found = {}
    for name in names:
        model, batch = made(name)
        planning = rematlab.prepare(model, batch,
                                    step=Step(optimizer=torch.optim.AdamW, layout=FSDP()))
        floor = planning.floor_budget()
        full = planning.measure(planning.unconstrained)
        rows = []
        for budget in (floor, (floor + full) // 2, full):
            plan = planning.choose(budget)
            rows.append({"budget": budget, "plan": plan.to_json(),
                         "measured": plan.measured_peak,
                         "user": user_fsdp_peak(model, name, plan, batch)})
        floor_plan = Plan.from_json(rows[0]["plan"])
        got, want = sharded_grads(model, name, floor_plan, batch), plain_grads(model, batch)
        error = max(float((got[k] - want[k]).abs().max()) for k in want)
        found[name] = {"rows": rows, "grad_error": error, "grads": len(got),
                       "plain_grads": len(want)}
    return found


def offload_worker(rank: int, world: int) -> dict:
    """An offloading plan applied to the unsharded model, then sharded by FSDP2 as a user
    does: the gathered float64 gradients against the plain model's, and what moved (the
    hidden states are 4 MiB, above the offloader's 1 MiB floor)."""
    torch.manual_seed(0)
    model, batch = gpt2(batch=4, seq=512, layers=4, width=256)
    plan = Plan(6, (0, Selective(1, "offload"), Selective(2, "offload input"), 3, 4, 5))
    twin = copy.deepcopy(model).double()
    planned = rematlab.apply(twin, plan)
    for layer in layers_of(twin, "gpt2"):
        fully_shard(layer)
    fully_shard(planned)
    torch.manual_seed(1)  # the same dropout masks as the plain run's
    default_loss(call(planned, batch), batch).backward()
    got = {n: p.grad.full_tensor() for n, p in planned.named_parameters()}
    want = plain_grads(model, batch)
    return {"grad_error": max(float((got[k] - want[k]).abs().max()) for k in want),
            "grads": len(got), "moved": offloader_of(planned).stats.tensors}


def nccl_worker(rank: int, world: int) -> dict:
    """A measured FSDP plan on this rank's GPU over NCCL: the floor and the unconstrained
    plan, each within its budget on the card."""
    model, batch = made("gpt2")
    device = torch.device("cuda", rank)
    model = model.to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    planning = rematlab.prepare(model, batch,
                                step=Step(optimizer=torch.optim.AdamW, layout=FSDP()))
    floor = planning.floor_budget()
    full = planning.measure(planning.unconstrained)
    return {"rows": [[budget, planning.choose(budget).measured_peak]
                     for budget in (floor, full)]}


def ddp_worker(rank: int, world: int) -> dict:
    """A DDP plan at the single-process unconstrained plan's peak, metered in the user's DDP
    loop by MemTracker, with the bucket buffers DDP's C++ reducer allocates (which no
    dispatch mode sees) registered as external tensors: torch's default all-reduce hook,
    wrapped to keep them (the same bytes as the reducer's own path)."""
    model, batch = made("gpt2")
    alone = rematlab.prepare(model, batch, step=Step(optimizer=torch.optim.AdamW))
    budget = alone.measure(alone.unconstrained)
    planning = rematlab.prepare(model, batch,
                                step=Step(optimizer=torch.optim.AdamW, layout=DDP()))
    plan = planning.choose(budget)
    planned = rematlab.apply(copy.deepcopy(model), plan)
    ddp = DistributedDataParallel(planned)
    kept = {}

    def hook(state, bucket):
        kept[bucket.index()] = bucket.buffer()
        return allreduce_hook(state, bucket)
    ddp.register_comm_hook(None, hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    _user_step(ddp, opt, batch)
    _user_step(ddp, opt, batch)  # DDP rebuilds its buckets at the second step
    buckets = list(kept.values())
    tracker = MemTracker()
    tracker.track_external(ddp, opt, *tensors(batch), *buckets)
    with tracker:
        _user_step(ddp, opt, batch)
    step_peak = max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    read_back = rematlab.prepare(DistributedDataParallel(copy.deepcopy(model)), batch,
                                 step=Step(optimizer=torch.optim.AdamW))
    return {"read_back": [read_back.step.layout.kind, read_back.rank(plan).peak],
            "budget": budget, "plan": plan.describe(), "plan_json": plan.to_json(),
            "alone": alone.measure(plan),
            "measured": plan.measured_peak,
            "buckets": sum(b.untyped_storage().nbytes() for b in buckets),
            "grads": sum(p.numel() * p.element_size() for p in model.parameters()),
            "user": step_peak}


def sharded_worker(rank: int, world: int) -> dict:
    """The same plans' per-rank peaks when the model is given three ways: unsharded (with a
    layout), already under `fully_shard` (its layout read back), and built on the meta device
    (torchtitan's way); then a plan for the sharded model, run in the user's own loop."""
    model, batch = made("gpt2")
    step = Step(optimizer=torch.optim.AdamW)
    plain = rematlab.prepare(model, batch, step=Step(optimizer=torch.optim.AdamW,
                                                     layout=FSDP()))
    sharded = copy.deepcopy(model)
    for layer in layers_of(sharded, "gpt2"):
        fully_shard(layer)
    fully_shard(sharded)
    read_back = rematlab.prepare(sharded, batch, step=step)
    with torch.device("meta"):
        meta, _ = made("gpt2")
    built = rematlab.prepare(meta, batch, step=Step(optimizer=torch.optim.AdamW,
                                                    layout=FSDP()))
    plans = [plain.solution.frontier[0], plain.unconstrained]
    budget = (plain.floor_budget() + plain.measure(plain.unconstrained)) // 2
    chosen = read_back.choose(budget)
    layout = read_back.step.layout
    return {"peaks": [[p.rank(c).peak for c in plans] for p in (plain, read_back, built)],
            "layout": [layout.kind, layout.world_size, list(layout.units)],
            "budget": budget, "measured": chosen.measured_peak,
            "user": user_fsdp_peak(model, "gpt2", chosen, batch)}


def auto_worker(rank: int, world: int, budget: int) -> dict:
    """`rematlab.auto` inside the user's FSDP2 job: the wrapper sharded as the root, the
    layers as units, each rank padding its batches to its own lengths."""
    torch.manual_seed(0)
    model, _ = gpt2(batch=4, seq=64, layers=4, width=128)
    wrapped = rematlab.auto(model, budget, step=Step(optimizer=torch.optim.AdamW))
    for layer in layers_of(model, "gpt2"):
        fully_shard(layer)
    fully_shard(wrapped)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    losses = []
    for length in (20 + 3 * rank, 28 - 3 * rank, 50 + 5 * rank, 60 - 5 * rank):
        ids = torch.randint(0, 97, (4, length), generator=torch.Generator().manual_seed(length))
        loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"events": [[e.plan, list(map(list, e.profiled)), e.peak, e.budget]
                       for e in wrapped.events], "losses": losses}


def replanned_worker(rank: int, world: int) -> dict:
    """The README's order: a plan applied, then the model sharded (each layer, then the
    root); that sharded, planned model planned again for a tighter budget, and the new plan
    run in the user's own loop."""
    model, batch = made("gpt2")
    step = Step(optimizer=torch.optim.AdamW, layout=FSDP())
    first = rematlab.prepare(model, batch, step=step)
    top = first.measure(first.unconstrained)
    planned = rematlab.apply(copy.deepcopy(model), first.unconstrained)
    for layer in layers_of(planned, "gpt2"):
        fully_shard(layer)
    fully_shard(planned)
    again = rematlab.prepare(planned, batch, step=Step(optimizer=torch.optim.AdamW))
    budget = (again.floor_budget() + top) // 2
    chosen = again.choose(budget)
    return {"budget": budget, "measured": chosen.measured_peak, "top": top,
            "layout": again.step.layout.kind,
            "user": user_fsdp_peak(model, "gpt2", chosen, batch)}
