"""The package's layers do not loop back on themselves (issue 14): no import cycle between
rematlab's modules, at module level or inside functions, and no module but the facade's
own lazy loader imports the facade."""

import ast
from pathlib import Path

import rematlab

PACKAGE = Path(rematlab.__file__).parent


def _imports(path: Path) -> set[str]:
    """rematlab modules imported anywhere in `path` (functions included)."""
    names = {p.stem for p in PACKAGE.glob("*.py")}
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "rematlab":
                out |= {a.name if a.name in names else "__init__" for a in node.names}
            elif node.module.startswith("rematlab."):
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("rematlab.")}
    return out


def _graph() -> dict[str, set[str]]:
    return {p.stem: _imports(p) - {p.stem} for p in PACKAGE.glob("*.py")}


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
