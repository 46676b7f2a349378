"""budget="auto" (issue 17, part 1): derived from the documented sources, and accepted by the
planner, the auto-planner and the CLI."""

import json

import pytest
import torch

import rematlab
from rematlab.exceptions import ConfigError
from rematlab.measurement import zoo
from rematlab.planning import budget as B
from tests import clirun

CPU = torch.device("cpu")
GIB, MIB = 2**30, 2**20


def _meminfo(tmp_path, available_kib: int, total_kib: int = 64 * 2**20):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {total_kib} kB\nMemFree:        1 kB\n"
                    f"MemAvailable:   {available_kib} kB\n")
    return path


def test_a_cgroup_v2_limit_bounds_the_cpu_budget(tmp_path):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "memory.max").write_text(f"{8 * GIB}\n")
    (root / "memory.current").write_text(f"{3 * GIB}\n")
    got = B.device_budget(CPU, resident=100 * MIB, cgroup=root,
                          meminfo=_meminfo(tmp_path, 20 * 2**20))  # 20 GiB available
    margin = max(int(0.05 * 8 * GIB), 256 * MIB)
    assert got.nbytes == 100 * MIB + 5 * GIB - margin
    assert "container limit" in got.how and "memory.max" in got.how


def test_a_cgroup_v1_limit_and_no_limit(tmp_path):
    root = tmp_path / "cg"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{4 * GIB}\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{1 * GIB}\n")
    meminfo = _meminfo(tmp_path, 2 * 2**20, 16 * 2**20)  # 2 GiB available: the tighter
    got = B.device_budget(CPU, cgroup=root, meminfo=meminfo)
    assert got.nbytes == 2 * GIB - 256 * MIB
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    unlimited = B.device_budget(CPU, cgroup=root, meminfo=meminfo)
    assert unlimited.nbytes == 2 * GIB - int(0.05 * 16 * GIB)  # 5 % of MemTotal
    assert "no container limit" in unlimited.how


def test_no_memory_left_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no memory is left"):
        B.device_budget(CPU, cgroup=tmp_path, meminfo=_meminfo(tmp_path, 1024))


def test_plan_and_auto_accept_budget_auto(monkeypatch):
    """'auto' is what the device has (`device_budget`, replaced here by a fixed 1 GiB so that
    what else the machine runs cannot change the answer)."""
    asked = []

    def fixed(device, resident=0, **_):
        asked.append(resident)
        return B.DeviceBudget(GIB, "auto on cpu: fixed for the test")

    monkeypatch.setattr(B, "device_budget", fixed)
    model = zoo.mlp(5, width=64)
    x = torch.randn(64, 1, 28, 28)
    chosen = rematlab.plan(model, x, "auto")
    assert chosen.budget == GIB and not chosen.segments  # 1 GiB holds every activation
    assert asked and asked[0] >= x.numel() * 4  # the batch counts as resident
    wrapped = rematlab.auto(model, "auto", optimizer=None)
    torch.nn.functional.cross_entropy(wrapped(x), torch.randint(0, 10, (64,))).backward()
    assert len(wrapped.plans) == 1 and len(asked) >= 2  # auto derived its budget too


@pytest.mark.slow
def test_the_cli_says_how_an_auto_budget_was_derived():
    proc = clirun.run(["plan", "--model", "mlp3", "--batch", "16", "--budget", "auto", "--json"])
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["budget_source"].startswith("auto on cpu") and data["budget"] > 0
