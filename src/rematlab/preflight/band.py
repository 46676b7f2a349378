"""A predicted peak as a band, not a point: what pre-flight computes, and an upper end that
covers what it cannot know of the target and that real runs have shown it to miss.

The point is the step replayed on fake tensors: on one card, through the CUDA caching
allocator (`Planning.card`: allocated and reserved); under a parallel layout, one rank's whole
sharded step (`Planning.rank`: allocated only, no reserved replay yet). Real cards hold more
than the point in ways the point does not model: cuDNN's and cuBLAS's workspaces by op class,
the allocator's rounding and fragmentation, the collectives' streams and their segments. The
upper end adds a share of the point for these, by *where* the point comes from and *what* it
is compared with (`Kind`), fitted on every recorded run: the widest shortfall of the point
under a published or recorded measurement of that kind (`fit`), never narrower than zero.

Design note — why fitted, and why per kind. A constant picked to pass would hide which part
of pre-flight is wrong; fitting per kind keeps each gap visible (a single card's allocated
peak is within a few per cent, a sharded rank's reserved peak is not) and lets a better model
of one part narrow its own band. `WIDTHS` holds the fit of the committed corpus
(`tests/data/published/runs.json` and the GPU facts of `tests/data/gpu`), written by
`python benchmarks/published.py`; `tests/test_published.py` refits it on every run and fails
when the shipped widths are not that fit, or when any recorded run lies above its band.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from torch import nn

Where = Literal["card", "rank"]  # one card's allocator replay, or one rank's sharded step
What = Literal["allocated", "reserved"]
Family = Literal["conv", "matmul"]  # cuDNN's convolutions, or BLAS and attention alone
Kind = tuple[Where, What, Family]

# The committed corpus's fit (`fit`), as shares of the point: the widest shortfall seen.
# A kind no run has measured takes the widest of all (`width`).
WIDTHS: dict[Kind, float] = {
    ("card", "allocated", "conv"): 0.070,  # ResNet on the H200: cuDNN's workspaces
    ("card", "allocated", "matmul"): 0.018,  # GPT-2 12 layers on the H200, plain step
    ("card", "reserved", "conv"): 0.267,  # ResNet: the workspaces' segments
    ("card", "reserved", "matmul"): 0.048,  # GPT-2 6 layers on the H200
    ("rank", "reserved", "matmul"): 0.135,  # torchtitan's Llama 3.1 8B on 8 H100s (no
}                                           # reserved replay under a layout yet)


def family(model: nn.Module) -> Family:
    """"conv" for a model that runs convolutions (cuDNN picks workspaces per call, which
    pre-flight does not model), else "matmul"."""
    convs = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
             nn.ConvTranspose3d)
    return "conv" if any(isinstance(m, convs) for m in model.modules()) else "matmul"


@dataclass(frozen=True)
class Band:
    """A predicted peak in bytes (`point`) and the most the step may hold on the card
    (`upper`), for a measurement of kind `kind`; `width` = upper / point - 1."""

    point: int
    upper: int
    kind: Kind

    @property
    def width(self) -> float:
        return self.upper / self.point - 1 if self.point else 0.0

    def holds(self, measured: float) -> bool:
        """A measured peak is never above the band's upper end."""
        return measured <= self.upper


def width(kind: Kind) -> float:
    """The fitted share for `kind`: a kind with no recorded run takes the widest fitted one
    (no run says it is narrower)."""
    return WIDTHS.get(kind, max(WIDTHS.values(), default=0.0))


def band(point: int, kind: Kind) -> Band:
    """`point` and its upper end for a measurement of `kind`."""
    return Band(point, -(-point * round(1e6 * (1 + width(kind))) // 1_000_000), kind)


def fit(observations: Iterable[tuple[Kind, float, float]]) -> dict[Kind, float]:
    """The widths that cover every (kind, predicted point, measured) observation: per kind,
    the largest measured / point - 1, rounded up to 0.1 %, and zero where the point was
    never under."""
    out: dict[Kind, float] = {}
    for kind, point, measured in observations:
        short = max(0.0, measured / point - 1)
        out[kind] = max(out.get(kind, 0.0), -(-short * 1000 // 1) / 1000)
    return out
