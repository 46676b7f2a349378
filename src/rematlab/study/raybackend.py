"""The only module that talks to Ray: a sweep's configurations as Ray tasks.

Each task reserves a whole device — one GPU (`num_gpus=1`) for CUDA configurations, or the
configuration's CPU threads (default: all CPUs of the node) for CPU ones — so measurements
never share a device. `max_calls=1` gives every task a fresh worker process, the same
isolation as the local backend. Results come back to the driver, which alone writes the
database. `address=None` starts a local Ray; otherwise it joins the given cluster.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from rematlab.core import hostmem
from rematlab.core.guard import MAX_WAIT_S
from rematlab.exceptions import ConfigError
from rematlab.measurement.measure import failed_row, run_config
from rematlab.measurement.spec import Spec


def _run_config(*args: object) -> dict:
    """`run_config` in a Ray worker, a process of rematlab's own: under its host allocator
    setting (`rematlab.core.hostmem`), as the local sweep's workers are."""
    hostmem.own_process()
    return run_config(*args)


def run_on_ray(specs: list[Spec], timeout: float, record: Callable[[Spec, dict], None],
               address: str | None = None, settle_s: float = 0.0,
               max_wait_s: float = MAX_WAIT_S) -> None:
    try:
        import ray
    except ImportError:
        raise ConfigError("the Ray backend needs the optional extra: pip install "
                          "'rematlab[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        kwargs = {"address": address} if address else {"num_cpus": os.cpu_count() or 1}
        ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR", **kwargs)
    try:
        node_cpus = int(ray.cluster_resources().get("CPU", 1))
        hostmem.asked()  # checked here, applied in each task's process
        remote = ray.remote(max_calls=1)(_run_config)
        pending = {}
        for spec in specs:
            if spec.device.startswith("cuda"):
                options = {"num_gpus": 1, "num_cpus": 1}
            else:
                options = {"num_cpus": min(spec.threads or node_cpus, node_cpus)}
            pending[remote.options(**options).remote(spec.to_dict(), None, settle_s,
                                                             max_wait_s)] = spec
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:  # nothing finished within a timeout: cancel the oldest
                ref = next(iter(pending))
                ray.cancel(ref, force=True)
                spec = pending.pop(ref)
                record(spec, {"rows": [failed_row(spec, "error", f"timeout after "
                                                   f"{timeout:g} s")], "measured_s": 0.0})
                continue
            ref = ready[0]
            spec = pending.pop(ref)
            try:
                out = ray.get(ref)
            except Exception as exc:  # a crashed worker is a recorded result
                out = {"rows": [failed_row(spec, "error", f"ray task failed: {exc}"[:500])],
                       "measured_s": 0.0}
            record(spec, out)
    finally:
        if started_here:
            ray.shutdown()
