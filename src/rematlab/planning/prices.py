"""What a card costs to rent, per GPU-hour: the table `rematlab rent` prices configurations by.

Nothing is fetched at run time: the shipped rows are dated and each names its source. They are
one provider's on-demand list prices where one provider lists the card (RunPod's pods, as
compiled by Deploybase on 2026-03-10), so that cards are compared at one provider's margins;
the MI300X, which RunPod does not list, at Vultr's on-demand rate. Prices move and differ
between providers by 2-3x (the same H100 SXM rents for $1.99 to $5.00 an hour): a user
compares at their own provider's prices with `--prices FILE` or `--price CARD=USD`.

A price file is JSON, `{"h100-80gb": 2.49, ...}` (US dollars per GPU-hour) or
`{"h100-80gb": {"usd_per_hour": 2.49, "source": "...", "date": "2026-12-01"}, ...}`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from rematlab.exceptions import ConfigError
from rematlab.preflight.targets import ALIASES, PROFILES

_RUNPOD = ("RunPod on-demand pod price (SXM where the card has an SXM form), from "
           "Deploybase's RunPod GPU pricing table, https://deploybase.ai/articles/"
           "runpod-gpu-pricing")
_VULTR = ("Vultr on-demand, as listed by Cliff Center's AMD inference economics note, "
          "https://www.cliffcenter.com/research/amd-inference-economics")


@dataclass(frozen=True)
class Price:
    """US dollars per GPU-hour for `card` (a profile name, `rematlab.PROFILES`), with where
    and when it was read."""

    card: str
    usd_per_hour: float
    source: str
    date: str

    def __post_init__(self) -> None:
        value = self.usd_per_hour
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value < 0):
            raise ConfigError(f"the price of {self.card} must be a number of US dollars per "
                              f"GPU-hour, 0 or more, got {value!r}"[:200])


PRICES: dict[str, Price] = {p.card: p for p in (
    Price("rtx4090", 0.60, _RUNPOD, "2026-03-10"),
    Price("l40", 1.22, _RUNPOD, "2026-03-10"),
    Price("l40s", 1.40, _RUNPOD, "2026-03-10"),
    Price("a100-80gb", 2.45, _RUNPOD, "2026-03-10"),
    Price("h100-80gb", 4.76, _RUNPOD, "2026-03-10"),
    Price("h200", 6.35, _RUNPOD, "2026-03-10"),
    Price("mi300x", 1.85, _VULTR, "2026-05-18"),
)}


def card_name(name: str) -> str:
    """A card as a profile name (aliases resolved: "h100" -> "h100-80gb"); an unknown one is
    refused with the cards there are."""
    resolved = ALIASES.get(name.lower(), name.lower())
    if resolved not in PROFILES:
        raise ConfigError(f"unknown card {name!r}; choose from {', '.join(PROFILES)}"[:300])
    return resolved


def read_prices(path: Path) -> dict[str, Price]:
    """The prices in a JSON file (module docstring), each card checked."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the price file {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(f"the price file {path} is not JSON: {exc}"[:200]) from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"the price file {path} must map cards to US dollars per GPU-hour")
    out = {}
    for name, value in data.items():
        card = card_name(str(name))
        if isinstance(value, dict):
            unknown = set(value) - {"usd_per_hour", "source", "date"}
            if unknown or "usd_per_hour" not in value:
                raise ConfigError(f"{path}: {name}'s price needs usd_per_hour (and may give "
                                  f"source and date), got {sorted(value)}"[:200])
            out[card] = Price(card, value["usd_per_hour"],
                              str(value.get("source", f"the user's file {path}")),
                              str(value.get("date", "")))
        else:
            out[card] = Price(card, value, f"the user's file {path}", "")
    return out


def parse_price(text: str) -> Price:
    """`CARD=USD` (a `--price` flag) as a price."""
    name, sep, value = text.partition("=")
    if not sep:
        raise ConfigError(f"a price is CARD=USD per GPU-hour (h100-80gb=2.49), got {text!r}"
                          [:200])
    try:
        usd = float(value)
    except ValueError:
        raise ConfigError(f"the price in {text!r} is not a number"[:200]) from None
    card = card_name(name.strip())
    return Price(card, usd, "given on the command line", "")
