"""Ctrl-C and SIGTERM during a sweep, held back while the database is written.

DuckDB checks for signals while a query runs and turns one into its own `Query interrupted`
error: a Ctrl-C that lands while a finished configuration's rows are written would lose them
and end with a traceback instead of exit 130 (seen in CI, a second into a sweep). The sweep's
handler therefore only notes a signal that arrives inside `held()` and raises it once the
write is done. Outside the measuring (opening the store, closing the sweep's record) every
signal is held; while a configuration is measured, one acts at once.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class Interrupts:
    """The sweep's SIGINT and SIGTERM handler: a KeyboardInterrupt at once while released,
    noted and raised on release otherwise."""

    def __init__(self) -> None:
        self.holding, self.pending = True, False

    def __call__(self, signum: int, frame: object) -> None:
        if self.holding:
            self.pending = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Handle both signals here, holding, until the block ends; then the previous
        handlers again (a shell may have started the sweep with SIGINT ignored)."""
        previous = {sig: signal.signal(sig, self) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Interrupts act at once inside the block (a signal already noted acts now)."""
        self.holding = False
        try:
            if self.pending:
                raise KeyboardInterrupt
            yield
        finally:
            self.holding = True

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Inside a released block: a signal waits for the end of this one."""
        before, self.holding = self.holding, True
        try:
            yield
        finally:
            self.holding = before
        if self.pending and not before:
            raise KeyboardInterrupt
