"""What a plan predicted for a GPU target holds on the card: its step replayed through the
caching allocator (allocated and reserved peaks, `rematlab.planning.reserve`), and the band
those peaks lie in (`rematlab.preflight.band`), whose upper end budgets and "auto" meet.
A part of `Planning` (`rematlab.planning.planner`), kept apart so that each file stays short;
it reads the planning's model, step, target and ranks and keeps each replay once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rematlab.exceptions import ConfigError
from rematlab.planning import predicted as pred
from rematlab.planning.reserve import CardMemory, card_memory
from rematlab.plans.plan import Plan
from rematlab.plans.simulate import simulate
from rematlab.preflight.band import Band, What, band, family


class OnCard:
    """`Planning`'s card-side methods (module docstring)."""

    target: Any
    ranks: Any
    model: Any
    structure: Any
    batch: Any
    step: Any
    verify: bool
    costs: Any
    _cards: dict[str, CardMemory]
    _measure_cached: Callable[[Plan], int]  # `Planning`'s: a rank's step, run once

    def band(self, chosen: Plan, what: What = "reserved") -> Band:
        """`chosen`'s predicted peak for a GPU target as a band (`rematlab.preflight.band`):
        the point (one card's step replayed through the caching allocator, its `what` peak;
        or one rank's sharded step, run on a fake group, or simulated when the planning
        does not verify) and the most the card may hold, which budgets meet."""
        if self.target is None or self.target.kind != "cuda":
            raise ConfigError("a band is predicted for a GPU target: "
                              "prepare(..., predict=True, target='h100-80gb', ...)")
        where = "card" if self.ranks is None else "rank"
        point = (getattr(self.card(chosen), what) if self.ranks is None
                 else self._measure_cached(chosen) if self.verify
                 else simulate(chosen, self.costs)[0])  # a rank not run: its simulation
        return band(point, (where, what, family(self.model)))

    def _upper(self, peak: int, where: str) -> int:
        return pred.upper_end(self.target, family(self.model), peak, where)

    @property
    def _on_card(self) -> bool:
        """Predicted for a GPU target on one device: plans have a reserved peak (`card`)."""
        return self.target is not None and self.target.kind == "cuda" and self.ranks is None

    def _reserved(self, chosen: Plan) -> int | None:
        """A predicted GPU plan's reserved peak (`card`, replayed once per plan); None for
        any other planning."""
        if not self._on_card:
            return None
        return self.card(chosen).reserved

    def card(self, chosen: Plan) -> CardMemory:
        """`chosen`'s allocated and reserved peaks on a predicted GPU target's card: its whole
        step replayed through the caching allocator (`rematlab.planning.reserve`)."""
        if not self._on_card:
            raise ConfigError("reserved memory is predicted for a GPU target on one device: "
                              "prepare(..., predict=True, target='h100-80gb', ...)")
        key = chosen.describe()
        if key not in self._cards:  # replayed once per plan
            self._cards[key] = card_memory(self.model, self.structure, self.batch, self.step,
                                           chosen, self.target)
        return self._cards[key]

