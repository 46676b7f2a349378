"""Install into this interpreter's environment with uv, or with pip where uv cannot.

Usage (the Makefile's set-up): `.venv/bin/python scripts/install.py -r requirements.txt`, then
`... scripts/install.py --no-deps -e .`; the arguments are `pip install`'s.

Why: on a fresh clone, `make test` spent 96 s of its 6.5-minute goal in pip (two cores);
uv installs the same pins in 45 s, byte-compiled as pip leaves them. uv does not read pip's
configuration, so the index settings pip is configured with (pip.conf, `PIP_*` variables: an
offline mirror, a folder of wheels such as torch's CPU build, a constraints file) are handed to
it, and it takes the best match across all indexes as pip does. Where uv cannot be installed
or fails, pip installs exactly as before: the set-up never depends on uv.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

# pip's configuration keys uv understands, with uv's flag for each
_SETTINGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
             "find-links": "--find-links", "constraint": "--constraint"}
# pip reads environment variables over the install section over the global one
_PRECEDENCE = (":env:", "install", "global")


def pip_settings() -> dict[str, list[str]]:
    """pip's configured index settings, each key's values from the section pip obeys."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], check=True,
                            capture_output=True, text=True).stdout
    found: dict[tuple[str, str], list[str]] = {}
    for line in listed.splitlines():
        name, _, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if key in _SETTINGS:
            found[(section, key)] = shlex.split(shlex.split(value)[0])  # 'a b' -> [a, b]
    settings: dict[str, list[str]] = {}
    for section in reversed(_PRECEDENCE):  # the section pip obeys is written last
        settings |= {key: values for (where, key), values in found.items() if where == section}
    return settings


def uv_command(args: list[str], settings: dict[str, list[str]]) -> list[str]:
    uv = Path(sys.executable).parent / "uv"
    command = [str(uv), "pip", "install", "--python", sys.executable, "--compile-bytecode",
               "--index-strategy", "unsafe-best-match"]
    for key, values in settings.items():
        for value in values:
            command += [_SETTINGS[key], value]
    return command + args


def main(args: list[str]) -> int:
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    if subprocess.run([*pip, "uv"]).returncode == 0:
        if subprocess.run(uv_command(args, pip_settings())).returncode == 0:
            return 0
        sys.stderr.write("install.py: uv failed; installing with pip instead\n")
    return subprocess.run([*pip, *args]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
