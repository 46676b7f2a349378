"""The `rematlab` command: thin typer commands, one library call each (`plans`: one model; `rent`:
which card to rent; `study`: datasets and the study).

Bad input prints one line, `error: ...`, and exits with status 2; `--json` prints machine-
readable output, tables are for people.
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
import warnings
from typing import NoReturn

import typer

from rematlab.cli import plans, rent, study  # noqa: F401  (registers their commands on `app`)
from rematlab.cli.app import app
from rematlab.core import hostmem
from rematlab.exceptions import RematlabError

__all__ = ["app", "main"]


def _warning_line(message: Warning | str, category: type[Warning], *_: object, **__: object
                  ) -> None:
    """A library warning (a profile timed on a busy machine) as one `warning:` line."""
    sys.stderr.write(f"warning: {str(message).splitlines()[0]}\n")


def _layout_values(args: list[str]) -> list[str]:
    """`--fsdp` / `--ddp` alone (under torchrun: the job's ranks) as `--fsdp job`: typer's
    options take a value or none, not an optional one."""
    out: list[str] = []
    for i, arg in enumerate(args):
        out.append(arg)
        if arg in ("--fsdp", "--ddp") and (i + 1 == len(args) or args[i + 1].startswith("-")):
            out.append("job")
    return out


def _exit_interrupted() -> NoReturn:
    """Exit 130 after a Ctrl-C that a command handled, with the exit functions run as at any
    exit. Not `sys.exit`: CPython marks a KeyboardInterrupt unhandled when it lands while C
    code runs Python (`PyRun_*`), although rematlab caught it, and then ends the process by
    SIGINT once finalized: its parent saw -2, not 130 (one max-batch search in three, under
    load)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def main() -> None:
    """The console entry point: typer's usage errors (a missing option, `--batch abc`) are
    one `error:` line and exit status 2, like every other bad input; warnings are one
    `warning:` line each. The process keeps the host memory it frees, as every process of
    rematlab's own does (`rematlab.core.hostmem`; `REMATLAB_HOST_ALLOCATOR=default` not)."""
    warnings.showwarning = _warning_line
    try:  # a measuring process of rematlab's own (`rematlab.core.hostmem`)
        hostmem.own_process()
    except RematlabError as exc:
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(2)
    # typer vendors its own click (typer._click) in recent releases; older ones use click
    click = getattr(typer, "_click", None) or importlib.import_module("click")
    command = typer.main.get_command(app)
    try:
        code = command.main(args=_layout_values(sys.argv[1:]), prog_name="rematlab",
                            standalone_mode=False)
    except click.exceptions.UsageError as exc:
        message = exc.format_message().strip()
        if not message and exc.ctx is not None:  # no arguments: the help, as usage
            sys.stdout.write(exc.ctx.get_help() + "\n")
        else:
            sys.stderr.write(f"error: {message.splitlines()[0] if message else 'usage'}\n")
        sys.exit(2)
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.Abort:
        sys.stderr.write("error: aborted\n")
        sys.exit(1)
    if code == 130:
        _exit_interrupted()
    sys.exit(code if isinstance(code, int) else 0)
