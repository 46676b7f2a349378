"""The package's layers (issues 14 and 26): each subpackage imports only the ones below it, no
module imports the facade, there is no import cycle, `plans` is pure (no torch), and no
module is longer than a newcomer can read in one go; no function body longer than a screen, no
signature over eight parameters outside the CLI's flags (issue 52)."""

import ast
from pathlib import Path

import pytest

import rematlab

PACKAGE = Path(rematlab.__file__).parent
# Bottom to top; a module may import its own layer and the ones before it.
LAYERS = ("exceptions", "version", "core", "plans", "preflight", "remat", "measurement",
          "distributed", "planning", "integrations", "gradients", "study", "cli", "__init__",
          "__main__")
MAX_LINES = 400
MAX_BODY = 60  # lines of a function's body (issue 52): one screen
MAX_PARAMS = 8  # a function's parameters; the CLI's commands list their flags instead


def _name(path: Path) -> str:
    """'core.steps' for src/rematlab/core/steps.py, 'cli' for cli.py, 'cli' for cli/__init__."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(dotted: str) -> str:
    """The rematlab module `rematlab.<dotted>` names (its package when it names an object)."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted


def _imports(path: Path) -> set[str]:
    """rematlab modules imported anywhere in `path` (functions included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "rematlab":
                out |= {a.name if a.name in MODULES else "__init__" for a in node.names}
            elif node.module.startswith("rematlab."):
                base = node.module.removeprefix("rematlab.")
                out |= {_resolve(f"{base}.{a.name}") for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {_resolve(a.name.removeprefix("rematlab.")) for a in node.names
                    if a.name.startswith("rematlab.")}
        assert not (isinstance(node, ast.ImportFrom) and node.level), f"relative import in {path}"
    return out


def _graph() -> dict[str, set[str]]:
    return {m: _imports(p) - {m} for m, p in MODULES.items()}


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def test_every_module_belongs_to_a_layer():
    assert sorted(m for m in MODULES if m.split(".")[0] not in LAYERS) == []


def test_no_layer_imports_one_above_it():
    upward = sorted(f"{m} -> {d}" for m, deps in _graph().items() for d in deps
                    if _layer(d) > _layer(m))
    assert upward == []


def test_no_module_imports_the_package_facade():
    graph = _graph()
    offenders = sorted(m for m, deps in graph.items() if "__init__" in deps and m != "__init__")
    assert offenders == []


def test_there_is_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d == "__init__":
                continue
            if state.get(d) == 1:
                cycles.append([*stack[stack.index(d):], d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state and m != "__init__":
            visit(m)
    assert cycles == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("plans")))
def test_plans_are_pure_data_without_torch(module):
    tree = ast.parse(MODULES[module].read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module}
    assert "torch" not in imported


def test_no_module_is_longer_than_the_limit():
    long = sorted(f"{m}: {n}" for m, p in MODULES.items()
                  if (n := len(p.read_text().splitlines())) > MAX_LINES)
    assert long == []


def _functions() -> list[tuple[str, ast.FunctionDef]]:
    return [(m, node) for m, p in MODULES.items() for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _is_command(node: ast.FunctionDef) -> bool:
    """A typer command: its parameters are the command line's flags."""
    return any(isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
               and d.func.attr == "command" for d in node.decorator_list)


def test_no_function_body_is_longer_than_a_screen():
    long = sorted(f"{m}.{f.name}: {n}" for m, f in _functions()
                  if (n := f.end_lineno - f.body[0].lineno + 1) > MAX_BODY)
    assert long == []


def test_no_signature_takes_more_than_eight_parameters_outside_the_cli_flags():
    def count(f: ast.FunctionDef) -> int:
        a = f.args
        named = [x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
        return len(named) + (a.vararg is not None) + (a.kwarg is not None)

    wide = sorted(f"{m}.{f.name}: {n}" for m, f in _functions()
                  if not _is_command(f) and (n := count(f)) > MAX_PARAMS)
    assert wide == []


def test_every_subpackage_is_a_package_a_wheel_ships():
    """setuptools' `packages.find` (pyproject) skips folders without `__init__.py`: a
    namespace-only subpackage would be missing from a built wheel."""
    from setuptools import find_packages

    found = set(find_packages(str(PACKAGE.parent)))
    code = {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("*.py")}
    assert code <= found, sorted(code - found)


def test_the_tests_never_write_the_users_cache():
    from rematlab.core.files import cache_dir

    assert Path.home() / ".cache" / "rematlab" not in [cache_dir(), *cache_dir().parents]


def test_import_rematlab_leaves_the_study_and_the_compiler_alone():
    """`import rematlab` plans and applies: it loads neither the study's libraries (an extra,
    `rematlab[study]`) nor torch's compiler until asked (issue 52)."""
    import subprocess
    import sys

    from rematlab.cli.app import STUDY_EXTRA

    code = ("import sys, rematlab; print(sorted(m for m in sys.modules "
            f"if m.split('.')[0] in {sorted(STUDY_EXTRA)!r} or m == 'torch._dynamo'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.slow
def test_without_the_study_extra_plans_run_and_study_commands_say_what_to_install(tmp_path):
    import subprocess
    import sys

    from rematlab.cli.app import STUDY_EXTRA

    script = (f"import sys\nfor m in {sorted(STUDY_EXTRA)!r}:\n    sys.modules[m] = None\n"
              "from rematlab.cli import main\nsys.argv = ['rematlab', *sys.argv[1:]]\nmain()\n")
    (tmp_path / "bare.py").write_text(script)

    def run(*args):
        return subprocess.run([sys.executable, str(tmp_path / "bare.py"), *args],
                              capture_output=True, text=True, cwd=tmp_path, timeout=300)
    planned = run("plan", "--model", "mlp3", "--batch", "8", "--budget", "1GiB", "--json")
    assert planned.returncode == 0, planned.stderr[-2000:]
    refused = run("stats", "--db", str(tmp_path / "x.duckdb"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "pip install 'rematlab[study]'" in refused.stderr
