"""Files rematlab writes: always whole or not at all.

Every output goes to a temporary file in the target's own folder and is renamed into place
(`os.replace` is atomic on POSIX and Windows), so a kill, a full disk or a file-size limit
during the write leaves the previous file as it was, never a truncated one. An output path
that is also one of the command's inputs is refused before anything runs.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from rematlab.exceptions import ConfigError


def refuse_overwriting_inputs(out: str | Path, inputs: Iterable[str | Path]) -> None:
    """A `ConfigError` when `out` names the same file as one of `inputs`."""
    target = Path(out).resolve()
    for src in inputs:
        if Path(src).resolve() == target:
            raise ConfigError(f"output {out} is also an input: choose another output path")


@contextlib.contextmanager
def atomic_path(out: str | Path) -> Iterator[Path]:
    """A temporary path beside `out` to write to; renamed onto `out` when the block succeeds,
    removed when it fails. Missing folders are created. A named pipe or a character device
    (`/dev/stdout`, a terminal) is written through once the output is whole (a reader gets
    all of it or nothing), never replaced by a file; any other kind of file is refused. A
    path the system refuses (too long, not writable, a full device) is one `ConfigError`."""
    target = Path(out)
    with _system_refuses(out):
        kind = os.stat(target).st_mode if target.exists() else None
        if kind is not None and stat.S_ISDIR(kind):
            raise ConfigError(f"output {out} is a directory")
        through = kind is not None and (stat.S_ISFIFO(kind) or stat.S_ISCHR(kind))
        if kind is not None and not (through or stat.S_ISREG(kind)):
            raise ConfigError(f"output {out} is neither a file, a pipe nor a terminal")
        parent = target.parent
        if not through:
            if parent.exists() and not parent.is_dir():
                raise ConfigError(f"cannot write {out}: {parent} is not a directory")
            parent.mkdir(parents=True, exist_ok=True)
            _remove_orphans(target)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.stem[:64]}.{os.getpid()}.",
                                   suffix=f".tmp{target.suffix[:16]}",
                                   dir=None if through else parent)
        os.close(fd)
    try:
        yield Path(tmp)
        with _system_refuses(out):
            if through:
                with open(tmp, "rb") as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            else:
                os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def _system_refuses(out: str | Path) -> Iterator[None]:
    """An `OSError` of writing `out` as one line naming it."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(f"cannot write {str(out)[:120]}: {exc.strerror or exc}") from None


def _remove_orphans(target: Path) -> None:
    """Remove temporary files beside `target` left by a writer that was killed (its process
    id, in the name, is gone); a live writer's are left alone."""
    for tmp in target.parent.glob(f".{glob.escape(target.stem)}.*.tmp{target.suffix}"):
        pid = tmp.name[len(target.stem) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_atomic(out: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_path)`, then move the finished file onto `out`."""
    with atomic_path(out) as tmp:
        write(tmp)
    return Path(out)


def cache_dir() -> Path:
    """Where rematlab keeps what it computed once for this machine (a trained backbone, the
    roofline's calibration): `REMATLAB_CACHE`, default `~/.cache/rematlab`."""
    return Path(os.environ.get("REMATLAB_CACHE", Path.home() / ".cache" / "rematlab"))


def write_text(out: str | Path, text: str) -> Path:
    return write_atomic(out, lambda p: p.write_text(text, encoding="utf-8"))


def write_bytes(out: str | Path, data: bytes) -> Path:
    return write_atomic(out, lambda p: p.write_bytes(data))


def jsonable(value: object) -> object:
    """`json.dumps`'s fallback for what rematlab writes: numpy and torch scalars and arrays as
    numbers and lists, anything else as its text."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
