"""One meaning of a step's peak on every device (issue 49): the step's own tensors and what
it allocates, never the rest of the process (another model on the card); `budget="auto"`
leaves the other tensors and the CUDA context out and names them. Checked on this CPU with a
fake card (`FakeCard`, the `torch.cuda` statistics `StepMemory` and `device_budget` read)."""

import torch

from rematlab.core.probes import StepMemory, one_phase, peak_of
from rematlab.planning.budget import device_budget
from rematlab.preflight.cards import CUBLAS_DEFAULT, CUBLAS_HOPPER, CUBLASLT, blas_workspace

MIB = 2**20
CUDA = torch.device("cuda", 0)


class FakeCard:
    """The caching allocator's statistics of one card, driven by the test."""

    def __init__(self, total: int = 8 << 30, context: int = 700 * MIB) -> None:
        self.total, self.context = total, context
        self.allocated = self.peak = self.reserved = self.peak_reserved = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, n: int) -> None:
        self.allocated -= n

    def synchronize(self, device) -> None:
        pass

    def memory_allocated(self, device) -> int:
        return self.allocated

    def max_memory_allocated(self, device) -> int:
        return self.peak

    def memory_reserved(self, device) -> int:
        return self.reserved

    def max_memory_reserved(self, device) -> int:
        return self.peak_reserved

    def reset_peak_memory_stats(self, device) -> None:
        self.peak, self.peak_reserved = self.allocated, self.reserved

    def mem_get_info(self, device) -> tuple[int, int]:
        return self.total - self.context - self.reserved, self.total


def _step_peak(card: FakeCard, neighbour: int) -> StepMemory:
    """A step whose model and batch (40 MiB, tracked) are on the card beside `neighbour`
    bytes of another model's, and which allocates 100 MiB then 30 MiB more at its peak."""
    own = [torch.empty(10 * MIB, dtype=torch.float32)]  # 40 MiB: the step's parameters
    card.alloc(neighbour)
    card.alloc(40 * MIB)

    def step() -> None:
        card.alloc(100 * MIB)
        card.alloc(30 * MIB)
        card.free(130 * MIB)

    return peak_of(StepMemory(CUDA, stats=card), own, one_phase(step))


def test_a_second_model_on_the_card_changes_no_step_peak():
    alone = _step_peak(FakeCard(), neighbour=0)
    beside = _step_peak(FakeCard(), neighbour=3 << 30)
    assert alone.peak == beside.peak == 170 * MIB
    assert alone.other == 0 and beside.other == 3 << 30  # reported beside the peak
    assert beside.reserved == alone.reserved == 170 * MIB


def test_budget_auto_on_a_card_leaves_out_other_tensors_and_the_context():
    card = FakeCard(total=8 << 30, context=700 * MIB)
    card.alloc(40 * MIB)  # the step's model
    alone = device_budget(CUDA, resident=40 * MIB, cuda=card)
    card.alloc(1 << 30)  # another model in the process
    beside = device_budget(CUDA, resident=40 * MIB, cuda=card)
    margin = max(int(0.05 * (8 << 30)), 256 * MIB)
    assert alone.nbytes == (8 << 30) - 700 * MIB - margin
    assert beside.nbytes == alone.nbytes - (1 << 30)
    assert "1.0 GiB of other tensors" in beside.how and "CUDA context" in beside.how


def test_blas_workspaces_follow_the_card_and_torchs_settings():
    assert blas_workspace((9, 0)) == CUBLAS_HOPPER + CUBLASLT == 33 * MIB
    assert blas_workspace((8, 0)) == CUBLAS_DEFAULT + CUBLASLT
    config = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "CUBLASLT_WORKSPACE_SIZE": "4096"}
    assert blas_workspace((8, 0), env=config) == 32 * MIB + 4 * MIB
    assert blas_workspace(None, "gfx942") == (128 + 76) * MIB
