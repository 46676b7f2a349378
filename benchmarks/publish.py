"""A benchmark's record: written where `--out` says (a document under docs/benchmarks/), and
printed."""

from __future__ import annotations

from pathlib import Path


def publish(text: str, out: Path | None) -> None:
    if out:
        out.write_text(text)
    print(text)
