"""Run the `rematlab` command as a user would, without paying an interpreter start per call.

Each call is a real process: forked from a server that imported rematlab and torch but never
ran them (multiprocessing's forkserver, as the sweep's workers are), with its own working
directory, argv, stdout, stderr and exit status. Only the interpreter start-up and imports
(~3 s a call on two cores) are shared; everything the command does runs in the child.
"""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

_CTX = mp.get_context("forkserver")
# transformers too: the tests' user models import it, and it takes seconds to import; skops
# (predict, fit) first, as in conftest: imported after transformers it takes seconds more
_CTX.set_forkserver_preload(["skops.io", "rematlab.study.predictor", "rematlab.cli",
                             "rematlab.study.sweep",
                             "rematlab.measurement.measure",
                             "transformers.models.gpt2.modeling_gpt2"])


def _child(args: list[str], cwd: str | None, out: str, err: str) -> None:
    os.dup2(os.open(out, os.O_WRONLY), 1)
    os.dup2(os.open(err, os.O_WRONLY), 2)
    if cwd is not None:
        os.chdir(cwd)
        sys.path.insert(0, cwd)
    sys.argv = ["rematlab", *args]
    code = 1
    try:
        from rematlab.cli import main

        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            sys.stderr.write(exc.code + "\n")
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(args: list[str], cwd: str | Path | None = None, timeout: float = 300
        ) -> subprocess.CompletedProcess:
    """`rematlab *args` in `cwd`: its exit status (124 on a timeout, 128 + N when signal N
    killed it), stdout and stderr."""
    with tempfile.TemporaryDirectory() as d:
        out, err = Path(d) / "out", Path(d) / "err"
        out.touch()
        err.touch()
        proc = _CTX.Process(target=_child, args=(list(args), str(cwd) if cwd else None,
                                                 str(out), str(err)))
        proc.start()
        proc.join(timeout)
        hung = proc.is_alive()
        if hung:
            proc.kill()
            proc.join()
        code = 124 if hung else proc.exitcode
        code = 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says
        return subprocess.CompletedProcess(["rematlab", *args], code, out.read_text(),
                                           err.read_text())


def said(stderr: str) -> list[str]:
    """The lines a command wrote to stderr besides warnings (a busy machine's `warning:`
    line, transformers' own notes): what a test of its one-line errors looks at."""
    return [line for line in stderr.splitlines()
            if line.strip() and not line.startswith(("warning: ", "[transformers]"))]


def process(target, *args) -> mp.process.BaseProcess:
    """`target(*args)` in a process from the same server (a test needing a second process,
    not a command), joined."""
    proc = _CTX.Process(target=target, args=args)
    proc.start()
    proc.join(120)
    return proc


def foreground() -> None:
    """`preexec_fn` for a command a test will Ctrl-C: SIGINT at its default, as in a
    terminal's foreground job, whatever the test runner inherited (a shell starts background
    jobs with SIGINT ignored, and Python then never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
