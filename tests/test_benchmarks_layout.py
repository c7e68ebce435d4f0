"""The benchmarks stay one concern a module (issue 30): no module over 400 lines, no import circle,
no module named as one of the library's."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = {p.stem: p for p in (ROOT / "benchmarks").glob("*.py")}


def _imports(path: Path) -> set[str]:
    """The benchmarks modules ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("benchmarks."):
                found.add(node.module.split(".")[1])
            elif node.module == "benchmarks":
                found |= {a.name for a in node.names if a.name in BENCH}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
    return found


def test_no_benchmark_module_over_400_lines() -> None:
    long = {name: n for name, p in BENCH.items() if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these by concern: {long}"


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports in ``edges`` (module -> the modules it imports), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for nxt in sorted(edges[module]):
            if state.get(nxt) == 1:
                return [*path, module, nxt]
            if nxt not in state and (circle := walk(nxt, [*path, module])):
                return circle
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (circle := walk(module, [])):
            return circle
    return None


def test_no_import_circle_between_benchmark_modules() -> None:
    edges = {name: _imports(p) & set(BENCH) for name, p in BENCH.items()}
    assert "_variants" in edges["_speed_tables"]  # a real edge: the parse sees the package's imports
    circle = find_circle(edges)
    assert circle is None, f"import circle: {' -> '.join(circle)}"


def test_a_planted_circle_is_found() -> None:
    edges = {name: _imports(p) & set(BENCH) for name, p in BENCH.items()}
    edges["_variants"] = {*edges["_variants"], "speed"}  # speed -> _speed_tables -> _variants -> speed
    assert find_circle(edges) is not None


def test_no_benchmark_module_named_as_a_library_module() -> None:
    library = {p.stem for folder in ("mixlabels", "strategies", "backbones") for p in (ROOT / folder).rglob("*.py")}
    clash = sorted((set(BENCH) & library) - {"__init__"})
    assert not clash, f"benchmarks modules named as library modules: {clash}"
