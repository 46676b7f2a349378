"""The host allocator setting (issue 39): rematlab's own processes keep the memory they free
(glibc maps no block and never trims), record it in every row, and leave a user's process
alone."""

import ctypes
import json
import os
import subprocess
import sys

import pytest
import torch

import rematlab
from rematlab.core import hostmem
from rematlab.measurement import zoo
from tests import clirun


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mapped_bytes() -> int:
    """Bytes glibc holds in mmapped blocks now (`mallinfo2().hblkhd`)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().hblkhd


def _a_large_tensor_is_mapped(retain: bool) -> None:
    """In a fresh process: with glibc's defaults a 64 MiB tensor is an mmapped block (handed
    back to the kernel when freed); retained, it comes from the heap."""
    if retain:
        assert hostmem.retain_freed_memory()
    before = _mapped_bytes()
    big = torch.empty(64 << 20, dtype=torch.uint8)
    mapped = _mapped_bytes() - before >= 64 << 20
    del big
    os._exit(0 if mapped != retain else 1)


def test_retaining_maps_no_block_and_the_default_maps_large_ones():
    assert clirun.process(_a_large_tensor_is_mapped, False).exitcode == 0
    assert clirun.process(_a_large_tensor_is_mapped, True).exitcode == 0


def test_the_command_measures_under_it_and_records_it():
    proc = clirun.run(["measure", "--model", "mlp3", "--batch", "8", "--repeats", "2",
                       "--warmup", "2", "--json"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["env"]["host_allocator"] == hostmem.RETAINED


def _command(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rematlab.cli", "measure", "--model", "mlp3",
                           "--batch", "8", "--repeats", "2", "--warmup", "2", "--json"],
                          capture_output=True, text=True, env={**os.environ, **env},
                          timeout=300)


@pytest.mark.slow  # two interpreters started cold
def test_the_environment_variable_turns_it_off_and_a_bad_value_is_one_error_line():
    off = _command({hostmem.ENV: "default"})
    assert off.returncode == 0, off.stderr
    assert json.loads(off.stdout)["env"]["host_allocator"] == hostmem.DEFAULT
    bad = _command({hostmem.ENV: "sometimes"})
    assert bad.returncode == 2 and clirun.said(bad.stderr) == [
        f"error: {hostmem.ENV}='sometimes': choose retain or default"]


def test_a_users_process_is_left_alone():
    model = zoo.mlp(3, width=64)
    rematlab.plan(model, torch.randn(16, 1, 28, 28), "64MiB")
    rematlab.measure(rematlab.Spec(model="mlp3", batch=8, repeats=2, warmup=2))
    assert hostmem.host_allocator() == hostmem.DEFAULT
