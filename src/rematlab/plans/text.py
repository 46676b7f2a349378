"""Plans from the text `Plan.describe` prints (`[0-3]{0,1,[2-3]{2,3}} 4 5{opt}`): how
recorded facts (`tests/data`) name the plans they measured."""

from __future__ import annotations

from rematlab.exceptions import ConfigError
from rematlab.plans.plan import Item, Plan, Segment, Selective, checked_fraction


def parse_plan(text: str, n_blocks: int) -> Plan:
    """The plan `Plan.describe` printed as `text` (`[0-3]{0,1,[2-3]{2,3}} 4 5{opt}`), for
    `n_blocks` blocks: how recorded facts name the plans they measured. An op-level block
    comes back with its option's name only (the saves are in the planning's menu)."""
    body, _, fraction = text.strip().partition(" @ fraction ")
    try:
        items, end = _parse_items(body, 0, " ")
        if end != len(body):
            raise ValueError(f"unexpected {body[end]!r} at {end}")
        return Plan(n_blocks, tuple(items),
                    fraction=checked_fraction(float(fraction)) if fraction else None)
    except (ValueError, IndexError) as exc:
        raise ConfigError(f"not a plan description {text[:80]!r}: {exc}") from None


def _parse_items(text: str, pos: int, sep: str) -> tuple[list[Item], int]:
    """Items from `pos` separated by `sep` until the text or a closing brace ends."""
    items: list[Item] = []
    while pos < len(text) and text[pos] != "}":
        if items:
            if text[pos] != sep:
                raise ValueError(f"expected {sep!r} at {pos}")
            pos += 1
        item, pos = _parse_item(text, pos)
        items.append(item)
    return items, pos


def _parse_item(text: str, pos: int) -> tuple[Item, int]:
    if text[pos] == "[":
        close = text.index("]", pos)
        start, end = (int(v) for v in text[pos + 1:close].split("-"))
        if text[close + 1] != "{":
            raise ValueError(f"expected '{{' at {close + 1}")
        inner, pos = _parse_items(text, close + 2, ",")
        if text[pos] != "}":
            raise ValueError(f"expected '}}' at {pos}")
        return Segment(start, end + 1, tuple(inner)), pos + 1
    digits = pos
    while digits < len(text) and text[digits].isdigit():
        digits += 1
    if digits == pos:
        raise ValueError(f"expected a block at {pos}")
    block = int(text[pos:digits])
    if digits < len(text) and text[digits] == "{":  # an op-level option: its name
        close, depth = digits, 0
        for close in range(digits, len(text)):
            depth += {"{": 1, "}": -1}.get(text[close], 0)
            if depth == 0:
                break
        return Selective(block, text[digits + 1:close]), close + 1
    return block, digits
