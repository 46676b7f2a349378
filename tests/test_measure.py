import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rematlab import Spec, apply
from rematlab.core.guard import POLL_S, Guard
from rematlab.core.optimizers import OPTIMIZERS, make_optimizer
from rematlab.core.probes import CpuAllocatorTrace, LiveTensorTracker, Span
from rematlab.exceptions import ConfigError
from rematlab.measurement import zoo
from rematlab.measurement.measure import measure


class ConstantClock:
    """Every timed region lasts exactly `seconds`."""

    method = "constant"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def start(self) -> None:
        pass

    def stop(self) -> float:
        return self.seconds


class FakeMemory:
    """A memory probe that reports fixed bytes and counts how often it was used."""

    method = "fake"
    made = 0

    def __init__(self, device, cap) -> None:
        FakeMemory.made += 1
        self.peak, self.reserved = 4096, 8192
        self.phase_peaks = {"forward": 1024, "backward": 4096, "optimizer": 2048}
        self.tracked = 0

    def track(self, tensors) -> None:
        self.tracked += len(list(tensors))

    def phase(self, name):
        return contextlib.nullcontext()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class QuietHost:
    """A host-load probe that reports a given foreign load for each attempt in turn."""

    def __init__(self, loads=(0.0,)) -> None:
        self.loads = list(loads)

    def __call__(self):
        return self

    def start(self) -> None:
        pass

    def stop(self) -> float:
        return self.loads.pop(0) if len(self.loads) > 1 else self.loads[0]


def test_measure_reports_exact_figures_from_the_injected_clock_and_memory_probe():
    FakeMemory.made = 0
    obs = measure(Spec(model="mlp3", batch=8, repeats=3), clock=ConstantClock(0.002),
                  memory=FakeMemory, guard=Guard(host=QuietHost()))
    assert obs.outcome == "ok"
    # every phase of every step takes 2 ms, a step 6 ms: each repeat averages the
    # ceil(0.2 / 0.006) = 34 steps that last MIN_REPEAT_SECONDS
    assert obs.steps == [34] * 3
    assert obs.times["forward"] == obs.times["backward"] == obs.times["optimizer"] == [0.002] * 3
    assert obs.times["step"] == [pytest.approx(0.006)] * 3
    assert obs.median("step") == pytest.approx(0.006) and obs.iqr("step") == 0.0
    assert obs.times["recompute"] == [0.0] * 3  # `none` recomputes nothing
    timed = 3 * 0.006 * 34  # and the tracked step, which measures the peak (its wall time)
    assert timed < obs.measured_seconds < timed + 1.0
    assert obs.peaks == [4096] and obs.reserved == [8192]  # byte counts: one tracked step
    assert obs.phase_peaks == {"forward": 1024, "backward": 4096, "optimizer": 2048}
    assert obs.methods["peak"].startswith("fake")
    assert FakeMemory.made == 1 + 1  # the tracked step, the method name
    assert obs.evidence.attempts == 3 and obs.evidence.trusted  # no repeat measured again
    assert obs.calibration == [0.002] * 3  # the calibration is timed with the step's clock


class BusyClock(ConstantClock):
    """Every region lasts `seconds`, `slowdown` times longer while another job runs; the job
    ends when the guard backs off (`quiet`), or never."""

    def __init__(self, seconds: float, slowdown: float) -> None:
        super().__init__(seconds)
        self.slowdown = slowdown
        self.busy = True

    def stop(self) -> float:
        return self.seconds * (self.slowdown if self.busy else 1.0)

    def quiet(self, seconds: float) -> None:
        self.busy = False


def test_guard_remeasures_timings_disturbed_by_another_job_and_keeps_the_quiet_ones():
    clock = BusyClock(0.002, slowdown=3.0)
    # the quiet calibration (0.002 s) is known from earlier configurations of the sweep
    guard = Guard(reference=0.002, sleep=clock.quiet, host=QuietHost())
    obs = measure(Spec(model="mlp3", batch=8, repeats=3), clock=clock, memory=FakeMemory,
                  guard=guard)
    # the first repeat ran beside the other job: measured again once it had gone
    assert obs.evidence.attempts == 4 and obs.evidence.trusted
    assert obs.times["step"] == [pytest.approx(0.006)] * 3  # the disturbed attempt is gone
    assert obs.evidence.drift == pytest.approx(0.0)
    rows = obs.rows()
    assert {r["attempts"] for r in rows} == {4} and all(r["trusted"] for r in rows)


def test_guard_flags_timings_that_stay_disturbed_after_its_retries():
    clock = BusyClock(0.002, slowdown=3.0)
    waits = []
    # another process holds 60 % of our CPUs throughout
    guard = Guard(reference=0.002, sleep=waits.append, host=QuietHost(loads=[0.6]))
    obs = measure(Spec(model="mlp3", batch=8, repeats=3), clock=clock, memory=FakeMemory,
                  guard=guard)
    assert obs.outcome == "ok" and not obs.evidence.trusted
    # bounded (two re-measurements per repeat), each after watching the host in POLL_S
    # windows for the back-off: 1, 2, then 4 s
    assert obs.evidence.attempts == 3 + 6
    assert set(waits) == {POLL_S} and sum(waits) == pytest.approx(1 + 2 + 4 * 4)
    assert obs.evidence.drift == pytest.approx(2.0)
    assert not any(r["trusted"] for r in obs.rows())


def test_guard_flags_cpu_time_taken_by_other_processes():
    # another process had 60 % of our CPUs while the first repeat ran and during the first
    # window the guard watched, then left
    host = QuietHost(loads=[0.6, 0.6, 0.02])
    waits = []
    obs = measure(Spec(model="mlp3", batch=8, repeats=3), clock=ConstantClock(0.002),
                  memory=FakeMemory, guard=Guard(host=host, sleep=waits.append))
    assert obs.evidence.attempts == 4 and obs.evidence.trusted
    assert obs.evidence.load == pytest.approx(0.02)
    assert waits == [POLL_S, POLL_S]  # it went on as soon as a window was quiet


def test_wait_quiet_watches_until_quiet_within_its_limit():
    waits = []
    assert Guard(host=QuietHost(loads=[0.9, 0.9, 0.0]), sleep=waits.append).wait_quiet(2.0)
    assert waits == [POLL_S] * 3
    waits.clear()
    assert not Guard(host=QuietHost(loads=[0.9]), sleep=waits.append).wait_quiet(2.0)
    assert waits == [POLL_S] * 8  # 2 s of windows, never quiet


def test_wait_quiet_waits_out_its_limit_where_the_host_cannot_be_read():
    waits = []
    assert not Guard(host=QuietHost(loads=[None]), sleep=waits.append).wait_quiet(3.0)
    assert sum(waits) == pytest.approx(3.0)


def test_a_settling_guard_waits_for_quiet_before_timing():
    waits = []
    clock = BusyClock(0.002, slowdown=3.0)  # busy until the guard first waits
    guard = Guard(reference=0.002, settle_s=30.0, host=QuietHost(loads=[0.0]),
                  sleep=lambda s: (waits.append(s), clock.quiet(s)))
    obs = measure(Spec(model="mlp3", batch=8, repeats=3), clock=clock, memory=FakeMemory,
                  guard=guard)
    assert waits == [POLL_S]  # one quiet window, then the repeats
    assert obs.evidence.attempts == 3 and obs.evidence.trusted


def test_guard_measures_the_outlier_of_a_wide_set_again():
    from rematlab.core.guard import Sample

    times = iter([1.0, 2.0, 1.0, 1.0])  # a hiccup in the second repeat that no probe saw
    samples = Guard(host=QuietHost(), sleep=lambda s: None).run(
        lambda: Sample(times={"step": next(times)}, steps=1, calibration=0.01,
                       measured_s=1.0), 3, key=("test",))
    kept, measured, evidence = samples
    assert [k.times["step"] for k in kept] == [1.0, 1.0, 1.0] and len(measured) == 4
    assert evidence.trusted and evidence.attempts == 4


def test_host_load_sees_a_busy_process_beside_this_one():
    """Whatever else the machine runs, the guard must see at least the CPU time our own
    burner took (read from its /proc entry): a lower bound no neighbour can break."""
    import os
    import subprocess
    import sys
    import time

    from rematlab.core.guard import HostLoad

    if HostLoad()._read() is None:
        pytest.skip("no /proc here")

    def ticks(pid: int) -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    burner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\n"
                               "while time.time() - t < 3: pass"])
    try:
        time.sleep(0.5)
        host = HostLoad()
        before, t0 = ticks(burner.pid), time.monotonic()
        host.start()
        time.sleep(1.0)
        busy = host.stop()
        share = (ticks(burner.pid) - before) / (
            (time.monotonic() - t0) * len(host.cpus) * os.sysconf("SC_CLK_TCK"))
    finally:
        burner.kill()
        burner.wait()
    assert share > 0.1 / len(host.cpus)  # the burner ran
    assert busy >= 0.7 * share, (busy, share)


def test_a_machine_that_never_gets_quiet_costs_at_most_the_wait_bound():
    clock = BusyClock(0.002, slowdown=3.0)
    waits = []
    guard = Guard(reference=0.002, sleep=waits.append, host=QuietHost(loads=[0.6]),
                  max_wait_s=3.0)
    obs = measure(Spec(model="mlp3", batch=8, repeats=3), clock=clock, memory=FakeMemory,
                  guard=guard)
    assert obs.outcome == "ok" and not obs.evidence.trusted  # stored, flagged, moved on
    assert sum(waits) == pytest.approx(3.0)  # back-offs of 1 and 2 s, then no more waiting
    assert obs.evidence.attempts == 3 + 2
    assert all(r["waited_s"] == pytest.approx(3.0) for r in obs.rows())


def test_recomputation_is_timed_on_its_own_copy_of_the_injected_clock():
    obs = measure(Spec(model="mlp5", batch=8, strategy="uniform:2", repeats=2),
                  clock=ConstantClock(0.002), memory=FakeMemory)
    assert obs.outcome == "ok"
    assert obs.times["recompute"] == [0.002] * 2  # one recomputed segment per step


def test_tracker_counts_known_allocations_exactly():
    t = LiveTensorTracker()
    with t:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        b = torch.empty(500, dtype=torch.float64)  # 4000 B
        view = a[:10]  # shares a's storage: no new bytes
        del a
        assert t.live == 8000
        del view
        assert t.live == 4000
        c = torch.empty(250, dtype=torch.float32)
    assert t.peak == 8000 and t.live == 5000
    del b, c
    assert t.live == 0


def test_tracker_rounds_to_the_allocator_block_size():
    t = LiveTensorTracker(unit=512)
    with t:
        a = torch.empty(3, dtype=torch.uint8)
        b = torch.empty(513, dtype=torch.uint8)
    assert t.live == 512 + 1024
    del a, b
    assert t.live == 0


@pytest.mark.parametrize("strategy", ["none", "sqrt", "uniform:2"])
def test_tracker_peak_matches_torch_memtracker(strategy):
    from torch.distributed._tools.mem_tracker import MemTracker

    model = zoo.mlp(5, width=256)
    remat = apply(model, strategy)
    opt = make_optimizer("momentum", model.parameters())
    x, y = torch.randn(512, 1, 28, 28), torch.randint(0, 10, (512,))

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(remat(x), y).backward()
        opt.step()

    step()
    step()
    mt = MemTracker()
    mt.track_external(model, opt, x, y)
    with mt:
        step()
    independent = max(v["Total"] for v in mt.get_tracker_snapshot("peak").values())
    ours = LiveTensorTracker()
    opt.zero_grad(set_to_none=True)
    ours.track([*model.parameters(), *(t for s in opt.state.values() for t in s.values()), x, y])
    with ours:
        step()
    assert ours.peak == independent


def test_measure_observes_memory_saved_by_checkpointing():
    none = measure(Spec(model="mlp7", batch=2048, repeats=1))
    sqrt = measure(Spec(model="mlp7", batch=2048, strategy="sqrt", repeats=1))
    assert none.outcome == sqrt.outcome == "ok"
    assert sqrt.figures["saved_activation_bytes"] < none.figures["saved_activation_bytes"]
    assert sqrt.figures["recompute_flops"] > 0 == none.figures["recompute_flops"]
    assert sqrt.figures["backward_flops"] > none.figures["backward_flops"]
    assert sqrt.peak < none.peak
    assert none.figures["forward_flops"] == sqrt.figures["forward_flops"]


def test_flops_are_counted_once_per_shape():
    from rematlab.measurement.measure import _COUNTED

    _COUNTED.clear()
    sgd = measure(Spec(model="mlp3", batch=4, repeats=1, optimizer="sgd"))
    adam = measure(Spec(model="mlp3", batch=4, repeats=1, optimizer="adam"))
    wider = measure(Spec(model="mlp3", batch=8, repeats=1, optimizer="adam"))
    assert len(_COUNTED) == 2  # batch 4 once for both optimizers, batch 8
    assert sgd.figures["forward_flops"] == adam.figures["forward_flops"] > 0
    assert wider.figures["forward_flops"] == 2 * sgd.figures["forward_flops"]
    assert adam.figures["optimizer_state_bytes"] == 2 * sgd.figures["param_bytes"]


@pytest.mark.parametrize("fake_count_s", [0.0, 1e9])
def test_flops_and_saved_bytes_are_counted_the_cheaper_way_after_the_tracked_step(
        monkeypatch, fake_count_s):
    """The protocol's untimed work is the tracked step and a count (issue 51): on the fake
    twin where the tracked step took `FAKE_COUNT_S` or more, which gives the figures a real
    counted step gives, to the unit; else on a real step, after the tracked one."""
    from torch._subclasses.fake_tensor import FakeTensor

    from rematlab.core.clocks import WallClock
    from rematlab.measurement import measure as protocol

    spec = Spec(model="mlp5", batch=64, strategy="sqrt", repeats=2).validate()
    real = protocol._Setup.build(spec, torch.device("cpu"), WallClock())
    on_fakes = protocol._counted(real, protocol.FAKE_COUNT_S, WallClock())
    assert not real.opt.state  # no real step ran
    assert on_fakes == protocol._counted(real, 0.0, WallClock()) and real.opt.state
    monkeypatch.setattr(protocol, "FAKE_COUNT_S", fake_count_s)
    steps: list[bool] = []
    plain = protocol._step
    monkeypatch.setattr(protocol, "_step", lambda s, *a, **k: (
        steps.append(isinstance(next(s.model.parameters()), FakeTensor)), plain(s, *a, **k))[1])
    protocol._COUNTED.clear()
    obs = measure(spec, clock=ConstantClock(0.1), guard=Guard(host=QuietHost()))
    assert obs.outcome == "ok" and obs.figures["recompute_flops"] > 0
    counted_on_fakes = fake_count_s == 0.0
    assert steps[:2] == [False, counted_on_fakes]  # the tracked step, then the count
    assert len(steps) == 2 + sum(obs.steps)  # then the timed ones


def test_a_model_fakes_cannot_run_is_counted_on_a_real_step():
    """Data-dependent code (`.item()`) has no value on a fake tensor: that model is counted
    on a real step, which leaves the optimizer state made."""
    from rematlab.core.clocks import WallClock
    from rematlab.measurement import measure as protocol

    class Gate(torch.nn.Module):
        def forward(self, x):
            return x * (2.0 if x.sum().item() > 0 else 1.0)

    model = torch.nn.Sequential(torch.nn.Flatten(), Gate(), torch.nn.Linear(784, 10))
    spec = Spec(model="mlp3", batch=8, repeats=1).validate()
    s = protocol._Setup(spec, model, torch.randn(8, 1, 28, 28), WallClock())
    counted = protocol._counted(s, protocol.FAKE_COUNT_S, WallClock())  # fakes tried first
    assert counted["forward_flops"] == 2 * 8 * 784 * 10 and s.opt.state  # momentum buffers


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_optimizer_state_is_made_without_moving_a_parameter(name):
    from rematlab.core.clocks import WallClock
    from rematlab.measurement import measure as protocol

    spec = Spec(model="mlp3", batch=4, optimizer=name, dtype="bfloat16").validate()
    made = protocol._Setup.build(spec, torch.device("cpu"), WallClock())
    before = [p.detach().clone() for p in made.model.parameters()]
    protocol._optimizer_state(made)
    assert all(torch.equal(p, b) for p, b in zip(made.model.parameters(), before, strict=True))
    assert all(p.grad is None for p in made.model.parameters())
    stepped = protocol._Setup.build(spec, torch.device("cpu"), WallClock())
    protocol._step(stepped, WallClock())
    shapes = [{k: (v.shape, v.dtype) for k, v in st.items() if isinstance(v, torch.Tensor)}
              for st in (made.opt.state[p] for p in made.model.parameters())]
    assert shapes == [{k: (v.shape, v.dtype) for k, v in st.items()
                       if isinstance(v, torch.Tensor)}
                      for st in (stepped.opt.state[p] for p in stepped.model.parameters())]
    assert [g["lr"] for g in made.opt.param_groups] == [g["lr"] for g in stepped.opt.param_groups]


def test_saved_bytes_exclude_parameters_and_input():
    obs = measure(Spec(model="mlp3", batch=4, repeats=1))
    # mlp3, width 1024: saved are the 2 hidden ReLU outputs and the logits path — far less
    # than the 3.3 MB of weights that Linear also saves for backward.
    assert obs.figures["saved_activation_bytes"] < 4 * (2 * 4 * 1024) * 4
    assert obs.figures["param_bytes"] == 4 * obs.figures["params"]
    assert obs.figures["optimizer_state_bytes"] == obs.figures["param_bytes"]  # momentum


def test_memory_cap_turns_into_an_oom_outcome():
    obs = measure(Spec(model="mlp3", batch=64, repeats=1, max_memory=1 << 20))
    assert obs.outcome == "oom" and "cap" in obs.error
    assert obs.peaks == [] and obs.rows()[0]["outcome"] == "oom"


def test_rows_are_one_per_repeat_and_carry_methods_and_environment():
    obs = measure(Spec(model="lenet5", batch=4, repeats=3, strategy="uniform:2"))
    rows = obs.rows()
    assert [r["repeat"] for r in rows] == [0, 1, 2]
    assert rows[0]["peak_bytes"] == obs.peak and rows[1]["peak_bytes"] is None
    assert [r["steps_per_repeat"] for r in rows] == obs.steps and all(obs.steps)
    assert all(r["calibration_s"] > 0 and r["attempts"] >= 1 for r in rows)
    for key in ("method_time", "method_peak", "method_guard", "vendor", "torch_version",
                "device_name", "threads", "host", "timestamp", "rematlab_version"):
        assert rows[0][key] not in (None, ""), key
    assert rows[0]["vendor"] == "CPU"


@pytest.mark.parametrize("kwargs", [{"batch": 0}, {"batch": -3}, {"strategy": "uniform:0"},
                                    {"device": "tpu"}, {"model": "resnet9"},
                                    {"optimizer": "lion"}, {"warmup": 0}, {"dtype": "int8"}])
def test_bad_specs_raise_config_errors(kwargs):
    spec = {"model": "mlp3", "batch": 4, **kwargs}
    with pytest.raises(ConfigError):
        measure(Spec(**spec))


def test_cuda_request_without_cuda_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="not available"):
        measure(Spec(model="mlp3", batch=4, device="cuda"))


def test_nested_recomputation_flops_count_each_recomputed_forward(tmp_path):
    from torch.utils.flop_counter import FlopCounterMode

    from rematlab.plans.plan import Plan, Segment

    plan = Plan(7, (Segment(0, 4, (Segment(0, 2, (0, 1)), 2, 3)), 4, 5, 6))
    path = tmp_path / "nested.json"
    path.write_text(plan.to_json())
    obs = measure(Spec(model="mlp7", batch=16, strategy=f"plan:{path}", repeats=1))
    model = zoo.mlp(7)
    x = torch.randn(16, 1, 28, 28)
    per_block = []
    for block in model:
        counter = FlopCounterMode(display=False)
        with counter:
            x = block(x)
        per_block.append(counter.get_total_flops())
    # the outer segment is recomputed once; inside it, the inner segment once more
    assert obs.figures["recompute_flops"] == sum(per_block[0:4]) + sum(per_block[0:2])


def test_allocator_trace_counts_every_allocation_and_free_per_phase():
    with CpuAllocatorTrace() as trace:
        with trace.phase("one"):
            a = torch.empty(1000, 1000)  # 4 MB, kept
            b = torch.empty(500, 1000)  # 2 MB, freed inside the phase
            del b
        with trace.phase("two"):
            c = torch.empty(2000, 1000)  # 8 MB on top of a
            del c, a
    assert trace.phases["one"] == Span(start=0, peak=6_000_000)
    assert trace.phases["two"] == Span(start=4_000_000, peak=12_000_000)
    assert trace.peak == 12_000_000


def test_allocator_trace_sees_inside_compiled_code():
    fn = torch.compile(lambda t: (t * 2).sin() + 1)
    x = torch.randn(1000, 1000)
    fn(x)
    with CpuAllocatorTrace() as trace:
        out = fn(x)
    assert trace.peak >= out.numel() * out.element_size()


def test_the_one_timer_interleaves_candidates_groups_fast_calls_and_redoes_a_busy_round():
    """Rounds time each candidate in turn (a neighbour slows them alike); a call shorter than
    `min_repeat_s` is repeated within its round and averaged; a round the host reports busy
    is timed again after waiting, and the evidence says what happened."""
    from rematlab.core.timer import Timer

    order: list[str] = []

    def work(name: str, seconds: float):
        def one(clock):
            order.append(name)
            return {"step": seconds}
        return one

    waits: list[float] = []
    host = QuietHost([0.0, 0.9, 0.0, 0.0, 0.0, 0.0])  # the second round ran beside a neighbour
    timer = Timer(torch.device("cpu"), clock=ConstantClock(0.003),
                  guard=Guard(host=host, sleep=waits.append), min_repeat_s=0.01)
    timing = timer.run({"a": work("a", 0.004), "b": work("b", 0.02)}, repeats=3, warmup=1)
    one_round = ["a", "a", "a", "b"]  # 3 x 4 ms reach 10 ms; one 20 ms call does
    assert order == ["a", "b", *one_round * 4]  # warm-up, then 3 rounds + the redone one
    assert timing.median("a") == 0.004 and timing.median("b") == 0.02
    assert timing.iqr("b") == 0.0 and len(timing.kept) == 3 and len(timing.measured) == 4
    assert timing.evidence.attempts == 4 and timing.evidence.trusted and waits
