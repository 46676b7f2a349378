"""What a CUDA target's step costs beyond its tensors, from the sources of torch's kernels
(issue 40): the attention backward kernels' scratch, the BLAS workspaces of two threads'
handles, and what checkpointing's own host work adds once the GPU's kernels hide what they
can."""

from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from rematlab.core.dispatch import OpRecorder
from rematlab.core.probes import LiveTensorTracker
from rematlab.core.recipe import Step
from rematlab.planning.predicted import predicted_costs
from rematlab.plans.plan import ChainCosts, Plan, Segment
from rematlab.plans.simulate import simulate
from rematlab.preflight import kernels
from rematlab.preflight.pricing import checkpoint_seconds
from rematlab.preflight.roofline import LoggedOp
from rematlab.preflight.targets import PROFILES, MiB, resolve_target
from rematlab.remat.structure import structure

B, S, D = 2, 200, 64  # a sequence that is not a multiple of flash's 128-row blocks


def _backward_peak(op, heads: int, kv_heads: int, dtype: torch.dtype) -> tuple[int, int]:
    """(the tracker's peak above what was live, the gradients' bytes) of one attention
    backward on fake tensors, with `KernelScratch` charging its scratch."""
    with FakeTensorMode():
        q = torch.empty(B, heads, S, D, dtype=dtype)
        k = torch.empty(B, kv_heads, S, D, dtype=dtype)
        v = torch.empty(B, kv_heads, S, D, dtype=dtype)
        grad = torch.empty(B, S, heads, D, dtype=dtype).transpose(1, 2)  # as HF's layout
        if op == kernels.FLASH_BACKWARD:
            out, lse, *_, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, True)
            args = (grad, q, k, v, out, lse, None, None, S, S, 0.0, True, seed, offset)
        else:
            out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, True)
            args = (grad, q, k, v, None, out, lse, seed, offset, 0.0, [True] * 3 + [False],
                    True)
        tracker = LiveTensorTracker(unit=512)
        tracker.track([q, k, v, grad, out, lse])
        before = tracker.live
        with OpRecorder(kernels.KernelScratch(), tracker):
            grads = getattr(torch.ops.aten, op)(*args)
        made = sum(g.untyped_storage().nbytes() for g in grads[:3])
    return tracker.peak - before, made


def test_flash_backward_charges_its_fp32_accumulators_as_flash_api_allocates_them():
    peak, grads = _backward_peak(kernels.FLASH_BACKWARD, 4, 4, torch.bfloat16)
    s_rounded, d_rounded = 256, 64  # round(200, 128); round(64, 32)
    softmax_d = B * 4 * s_rounded * 4
    dq_accum = B * s_rounded * 4 * d_rounded * 4
    assert peak == grads + softmax_d + dq_accum


def test_grouped_query_flash_backward_also_charges_the_expanded_key_value_gradients():
    peak, grads = _backward_peak(kernels.FLASH_BACKWARD, 8, 2, torch.bfloat16)
    expanded = 2 * B * S * 8 * D * 2  # dk and dv at the query's 8 heads, in bf16
    softmax_d, dq_accum = B * 8 * 256 * 4, B * 256 * 8 * 64 * 4
    assert peak == grads + softmax_d + dq_accum + expanded


def test_efficient_backward_charges_delta_and_the_query_gradient_workspace():
    peak, grads = _backward_peak(kernels.EFFICIENT_BACKWARD, 4, 4, torch.float32)
    delta = -(-B * 4 * S * 4 // 512) * 512  # a 512-byte block of the allocator
    product = B * S * 4 * D * 4  # fp32: torch computes delta as (grad_out * out).sum(-1)
    workspace = B * 4 * 256 * 64 * 4  # one fp32 tile per 64 queries and 64 head columns
    assert peak == grads + delta + product + workspace


def test_two_blas_workspaces_are_resident_as_torch_sizes_them_per_architecture():
    h100, a100, mi300 = PROFILES["h100-80gb"], PROFILES["a100-80gb"], PROFILES["mi300x"]
    assert h100.workspace == 33 * MiB  # cuBLAS 32 MiB on Hopper, cuBLASLt 1 MiB
    assert a100.workspace == 8 * MiB + 128 * 1024 + MiB  # :4096:2:16:8, cuBLASLt 1 MiB
    assert mi300.workspace == (128 + 76) * MiB  # hipBLAS on gfx94x, hipBLASLt
    assert h100.blas_resident == 2 * 34 * MiB  # each its own segment, handed out whole
    assert a100.blas_resident == 2 * a100.workspace  # split off a 20 MiB segment


def test_predicted_costs_count_both_threads_workspaces_as_resident():
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    x = torch.randn(8, 64)
    st = structure(model, x)
    h100 = PROFILES["h100-80gb"]
    costs, _ = predicted_costs(model, x, st, "cpu", Step(), h100)
    bare, _ = predicted_costs(model, x, st, "cpu", Step(), replace(h100, workspace=0))
    assert costs.base - bare.base == h100.blas_resident
    assert costs.optimizer_peak - bare.optimizer_peak == h100.blas_resident


def _ops(n: int, flops: float) -> list[LoggedOp]:
    return [LoggedOp("mm", "matmul", "bfloat16", flops, 0) for _ in range(n)]


def test_a_gpu_hides_checkpoints_host_work_behind_the_recomputed_kernels():
    h100 = PROFILES["h100-80gb"]
    host = h100.checkpoint_host[1]
    tiny = _ops(2, 1.0)  # launch-bound: the host work adds in full
    assert checkpoint_seconds(tiny, h100) == pytest.approx(host)
    big = _ops(2, 1e13)  # seconds of kernels: the host's work is hidden
    assert checkpoint_seconds(big, h100) == 0.0
    rate = h100.matmul_rate("bfloat16") * h100.efficiency[1]
    partly = _ops(2, rate * (2 * h100.overhead[1] + host / 2) / 2)  # half of it hidden
    assert checkpoint_seconds(partly, h100) == pytest.approx(host / 2)


def test_a_calibrated_target_uses_its_measured_checkpoint_cost():
    measured = replace(PROFILES["h100-80gb"], extra={"checkpoint": 1e-3})
    assert checkpoint_seconds(_ops(2, 1e13), measured) == 1e-3
    cpu = resolve_target({"name": "box", "kind": "cpu", "memory": "8GiB", "flops": 1e11,
                          "bandwidth": 1e10})
    assert checkpoint_seconds(_ops(2, 1e13), cpu) == cpu.checkpoint_host[1]  # no overlap


def test_the_simulator_charges_each_segment_its_first_blocks_checkpoint_cost():
    n = 4
    costs = ChainCosts(x=[10] * (n + 1), saved=[10] * n, keeps_input=[True] * n,
                       keeps_output=[False] * n, fwd_mem=[10] * n, bwd_mem=[10] * n,
                       grad=[0] * n, fwd_time=[1.0] * n, bwd_time=[2.0] * n,
                       checkpoint_time=[0.1, 0.2, 0.3, 0.4])
    plain = simulate(Plan(n, (0, 1, 2, 3)), costs)[1]
    one = simulate(Plan(n, (0, Segment(1, 3, (1, 2)), 3)), costs)[1]
    assert one == pytest.approx(plain + 2 * 1.0 + 0.2)  # blocks 1-2 again, and block 1's cost
    old = ChainCosts.from_dict({**costs.to_dict(), "checkpoint_time": 0.5})  # one figure
    assert old.checkpoint_time == [0.5] * n
