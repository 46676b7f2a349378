"""What the predictors learn from: a configuration's analytic features (its plan's simulated
costs on the meta device, FLOPs, the device's rates) beside its measured figures."""

from __future__ import annotations

import logging
import math
from functools import cache

import pandas as pd
import torch

from rematlab.core import flops as flop_count
from rematlab.core.batch import DTYPES
from rematlab.exceptions import ConfigError
from rematlab.measurement import zoo
from rematlab.measurement.hardware import device_peaks
from rematlab.measurement.spec import PRECISIONS, Spec
from rematlab.preflight.allocator import MIN_BLOCK
from rematlab.remat import strategies
from rematlab.study.store import trusted_only

_log = logging.getLogger("rematlab")
CONFIG_NUMERIC = ["batch", "n_segments", "strategy_arg"]
CONFIG_CATEGORICAL = ["model", "strategy_kind", "dtype", "device", "optimizer", "precision"]
ANALYTIC = ["log_param_bytes", "log_state_bytes", "log_saved_bytes", "log_largest_segment",
            "log_fwd_flops", "log_recompute_flops", "log_analytic_peak", "log_batch",
            "recompute_ratio", "n_conv", "n_linear", "n_pool", "n_norm", "n_blocks",
            "log_peak_flops", "log_bandwidth", "log_input_bytes"]
MIN_FIT = 10  # configurations: five folds of two


@cache  # one per shape a dataset holds: a few hundred at the study's scale
def _chain_costs(model: str, scale: str | None, shape: tuple[int, ...] | None, batch: int,
           dtype: str, optimizer: str, unit: int):
    from rematlab.core.recipe import Step
    from rematlab.remat.chain import profile_chain
    from rematlab.remat.profiling import Profiling
    from rematlab.remat.tracing import find_chain

    with torch.device("meta"):
        net, sample, _ = zoo.resolve(model, scale, shape)
        net = net.to(DTYPES[dtype])
        x = torch.empty(batch, *sample, dtype=DTYPES[dtype])
    blocks = find_chain(net).blocks
    costs = profile_chain(blocks, x, Profiling(Step(optimizer=optimizer), unit=unit),
                          device=torch.device("meta"))
    kinds = {"conv": 0, "linear": 0, "pool": 0, "norm": 0}
    for m in net.modules():
        name = type(m).__name__.lower()
        for kind in kinds:
            if kind in name:
                kinds[kind] += 1
    kinds["leaf"] = sum(1 for m in net.modules() if not list(m.children()))
    counter = flop_count.counter()
    with counter, torch.no_grad():
        net(x)
    by_op = counter.get_flop_counts().get("Global", {})
    total = sum(by_op.values()) or 1
    kinds["conv_share"] = sum(v for op, v in by_op.items() if "convolution" in str(op)) / total
    return costs, kinds, x.numel() * x.element_size()


def features(spec: Spec, device_name: str | None = None, threads: int | None = None) -> dict:
    """Analytic and configuration features of one configuration (meta device, < 1 s)."""
    from rematlab.plans.plan import Segment
    from rematlab.plans.simulate import held_bytes, simulate

    spec = spec.validate()
    unit = MIN_BLOCK if spec.device.startswith("cuda") else 1  # the allocator's blocks
    costs, kinds, input_bytes = _chain_costs(spec.model, spec.input, spec.input_shape, spec.batch,
                                       spec.dtype, spec.optimizer, unit)
    strat = strategies.parse(spec.strategy)
    plan = strat.build(costs.n, costs)
    peak, _ = simulate(plan, costs)

    def recomputed(items) -> float:
        total = 0.0
        for it in items:
            if isinstance(it, Segment):
                total += sum(costs.fwd_flops[it.start:it.end]) + recomputed(it.inner)
        return total

    segments = [it for it in plan.items if isinstance(it, Segment)]
    largest = max((sum(costs.saved[s.start:s.end]) + sum(costs.x[s.start:s.end])
                   for s in segments), default=0)
    fwd = sum(costs.fwd_flops)
    rec = recomputed(plan.items)
    matmul = {"bf16": "bfloat16", "fp16": "float16"}.get(spec.precision or "", spec.dtype)
    peak_flops, bandwidth = device_peaks(device_name or spec.device, threads or spec.threads,
                                         matmul)
    param_bytes = costs.base - costs.state - input_bytes
    return {
        "model": spec.model, "strategy_kind": strat.kind, "dtype": spec.dtype,
        "device": device_name or spec.device, "optimizer": spec.optimizer,
        "precision": spec.precision or "fp32", "batch": spec.batch, "n_segments": len(segments),
        "strategy_arg": float(strat.arg or 0.0),
        "log_param_bytes": math.log1p(max(param_bytes, 0)),
        "log_state_bytes": math.log1p(costs.state),
        "log_saved_bytes": math.log1p(held_bytes(plan, costs)),
        "log_largest_segment": math.log1p(largest),
        "log_fwd_flops": math.log1p(fwd), "log_recompute_flops": math.log1p(rec),
        "log_analytic_peak": math.log(peak), "log_batch": math.log(spec.batch),
        "recompute_ratio": rec / fwd if fwd else 0.0,
        "n_conv": kinds["conv"], "n_linear": kinds["linear"], "n_pool": kinds["pool"],
        "n_norm": kinds["norm"], "n_blocks": costs.n,
        "log_peak_flops": math.log(peak_flops), "log_bandwidth": math.log(bandwidth),
        "log_input_bytes": math.log(input_bytes), "analytic_peak": float(peak),
        # roofline terms, in seconds at the device's peak rates
        "flops_s": (3.0 * fwd + rec) / peak_flops,
        "conv_flops_s": (3.0 * fwd + rec) * kinds["conv_share"] / peak_flops,
        "mm_flops_s": (3.0 * fwd + rec) * (1 - kinds["conv_share"]) / peak_flops,
        "bytes_s": (3.0 * (sum(costs.x) + sum(costs.saved)) * (1 + rec / fwd if fwd else 1)
                    + 4.0 * max(param_bytes, 0)) / bandwidth,
        "ops": kinds["leaf"] * (3.0 + (rec / fwd if fwd else 0.0)),
    }


def dataset(summary: pd.DataFrame, untrusted: bool = False) -> pd.DataFrame:
    """Features and targets of every `ok` configuration of a `config_summary` frame whose
    timings the interference guard trusted (all of them with `untrusted`); how many were left
    out is in the frame's `attrs["untrusted_left_out"]`.

    When fewer than `MIN_FIT` are trusted but enough were measured (a busy machine), the
    untrusted ones are used too rather than failing: `attrs["untrusted_used"]` counts them,
    and a warning says so on the `rematlab` logger."""
    dropped, used = 0, 0
    if not untrusted:
        trusted, dropped = trusted_only(summary)
        if (trusted["outcome"] == "ok").sum() >= MIN_FIT:
            summary = trusted
        else:
            used, dropped = dropped, 0
            if used:
                _log.warning("only %d trusted ok configurations, fewer than the %d a fit needs: "
                             "using %d the guard did not trust (timed on a busy machine)",
                             (trusted["outcome"] == "ok").sum(), MIN_FIT, used)
    ok = summary[summary["outcome"] == "ok"].reset_index(drop=True)
    if len(ok) < MIN_FIT:
        raise ConfigError(f"need at least {MIN_FIT} ok configurations to fit predictors, the "
                          f"dataset has {len(ok)}")
    rows = []
    for _, r in ok.iterrows():
        shape = tuple(int(v) for v in str(r["cfg_input_shape"]).split(",")) if isinstance(
            r.get("cfg_input_shape"), str) and r["cfg_input_shape"] else None
        spec = Spec(model=r["cfg_model"], batch=int(r["cfg_batch"]), strategy=r["cfg_strategy"],
                    input=r["cfg_input"] if isinstance(r["cfg_input"], str) else None,
                    input_shape=shape, device=r["cfg_device"], dtype=r["cfg_dtype"],
                    optimizer=r["cfg_optimizer"],
                    precision=r["cfg_precision"] if r.get("cfg_precision") in PRECISIONS
                    else None)
        f = features(spec, device_name=r.get("device_name"))
        f.update({"time": float(r["step_s_median"]), "memory": float(r["peak_bytes_median"]),
                  "device_key": f"{r.get('vendor')}:{r.get('device_name')}"})
        rows.append(f)
    data = pd.DataFrame(rows)
    data.attrs["untrusted_left_out"] = dropped
    data.attrs["untrusted_used"] = used
    return data


