"""The set-up's installer (`scripts/install.py`): uv gets the index settings pip obeys, so a
mirror, a folder of wheels (torch's CPU build) or a constraints file that pip is configured
with holds for uv too."""

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "install", Path(__file__).parents[1] / "scripts" / "install.py")
install = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(install)


def test_uv_is_given_the_index_settings_pip_obeys(tmp_path, monkeypatch):
    """A variable beats the install section, which beats the global one; values that pip
    reads as several (separated by spaces) are several."""
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nextra-index-url = file:///one file:///two\n"
                    "find-links = /from-file\nconstraint = /global.txt\n"
                    "[install]\nconstraint = /install.txt\n")
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)  # this machine's own, if any
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_FIND_LINKS", "/from-env")
    settings = install.pip_settings()
    assert settings["extra-index-url"] == ["file:///one", "file:///two"]
    assert settings["find-links"] == ["/from-env"]
    assert settings["constraint"] == ["/install.txt"]
    command = install.uv_command(["-r", "requirements.txt"], settings)
    assert command[command.index("--find-links") + 1] == "/from-env"
    assert command[-2:] == ["-r", "requirements.txt"]
