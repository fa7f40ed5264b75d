"""The layers go one way: no import cycles, and no product module imports pytest or a test file.

Product code is `compiler/`, `verify/` and `suites/` minus the test files (`test_*.py`) and the pytest
plugin (`verify/pytest_plugin.py`, which exists to import pytest). Imports form a DAG, function-level
(lazy) ones included; `compiler` never imports `verify` or `suites` at any level.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("compiler", "verify", "suites")
PYTEST_ONLY = {"fuseguard.verify.pytest_plugin"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = ["fuseguard", *rel.parts]          # installed as fuseguard.compiler, fuseguard.verify, ...
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _product_modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = _module_name(path)
            if path.name.startswith("test_") or name in PYTEST_ONLY:
                continue
            out[name] = path
    return out


def _resolve(module: str, node: ast.ImportFrom | ast.Import, alias: ast.alias, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name]
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        parts = parts if is_package else parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    return [base, f"{base}.{alias.name}"]


def _imports(name: str, path: Path, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(body: list[ast.stmt], nested: bool) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                if nested and top_level_only:
                    continue
                for alias in stmt.names:
                    found.update(_resolve(name, stmt, alias, is_package))
            elif isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                continue
            for child in ast.iter_child_nodes(stmt):
                if isinstance(child, ast.stmt):
                    visit([child], nested or isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)))
                elif isinstance(child, (ast.excepthandler,)):
                    visit(child.body, nested)

    visit(tree.body, False)
    return found


def _graph(*, top_level_only: bool) -> dict[str, set[str]]:
    modules = _product_modules()
    graph = {}
    for name, path in modules.items():
        targets = _imports(name, path, top_level_only=top_level_only)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in state:
            found = dfs(node)
            if found:
                return found
    return None


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module-level", "all-imports"])
def test_no_import_cycles(top_level_only: bool) -> None:
    graph = _graph(top_level_only=top_level_only)
    assert len(graph) > 30, "the product module scan found too few modules"
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", sorted(_product_modules()))
def test_product_module_imports_no_test_code(name: str) -> None:
    path = _product_modules()[name]
    imported = _imports(name, path, top_level_only=False)
    bad = sorted(m for m in imported if m.split(".")[0] in ("pytest", "_pytest", "tests")
                 or m.rsplit(".", 1)[-1].startswith("test_"))
    assert not bad, f"{name} imports test code: {', '.join(bad)}"


def test_compiler_knows_nothing_of_verify_or_suites() -> None:
    for name, path in _product_modules().items():
        if name.split(".")[1] != "compiler":
            continue
        imported = _imports(name, path, top_level_only=False)
        bad = sorted(m for m in imported if m.split(".")[0] in ("verify", "suites")
                     or m.split(".")[:2] in (["fuseguard", "verify"], ["fuseguard", "suites"]))
        assert not bad, f"{name} imports {', '.join(bad)}"


def _environment_reads(path: Path) -> list[str]:
    """Reads of the environment in a module: `os.environ.get`, `os.getenv`, `os.environ[...]` loads,
    `... in os.environ`, and iterating it. Writes (`os.environ[k] = v`) and copies handed to a child
    (`dict(os.environ)`) are not reads of a setting."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        text = ast.unparse(node) if isinstance(node, (ast.Call, ast.Subscript, ast.Compare)) else ""
        if isinstance(node, ast.Call) and text.startswith(("os.environ.get(", "os.getenv(", "os.environ.items(",
                                                                  "os.environ.keys(", "os.environ.values(")):
            found.append(f"line {node.lineno}: {text[:60]}")
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and text.startswith("os.environ["):
            found.append(f"line {node.lineno}: {text[:60]}")
        elif isinstance(node, ast.Compare) and any(ast.unparse(c) == "os.environ" for c in node.comparators):
            found.append(f"line {node.lineno}: {text[:60]}")
    return found


def test_only_the_settings_module_reads_the_environment() -> None:
    """Every switch is declared once, in compiler/settings.py, and read through it (the cache key and
    `fuseguard env` then know every variable that exists)."""
    offenders = {}
    for name, path in _product_modules().items():
        if name != "fuseguard.compiler.settings":
            reads = _environment_reads(path)
            if reads:
                offenders[name] = reads
    assert not offenders, f"environment read outside compiler/settings.py: {offenders}"


def test_the_environment_read_finder_finds_reads(tmp_path: Path) -> None:
    code = tmp_path / "m.py"
    code.write_text("import os\na = os.environ.get('X')\nb = os.environ['Y']\nc = 'Z' in os.environ\n"
                    "os.environ['W'] = '1'\nd = dict(os.environ)\n")
    assert [r.split(":")[0] for r in _environment_reads(code)] == ["line 2", "line 3", "line 4"]


def test_settings_are_declared_and_code_settings_join_the_cache_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from fuseguard.compiler import settings

    with pytest.raises(KeyError, match="not a fuseguard setting"):
        settings.get("FUSEGUARD_NO_SUCH_SWITCH")
    monkeypatch.setenv("FUSEGUARD_CPU_SCHEDULE_OFF", "fast_math")
    monkeypatch.setenv("FUSEGUARD_CACHE_MAX_MB", "12")
    env = settings.code_environment()
    assert env.get("FUSEGUARD_CPU_SCHEDULE_OFF") == "fast_math"
    assert "FUSEGUARD_CACHE_MAX_MB" not in env            # where the cache lives does not change code
    monkeypatch.setenv("TVM_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="TVM_NUM_THREADS='two': expected an integer"):
        settings.integer("TVM_NUM_THREADS")


def test_the_compiler_imports_itself_only_relatively() -> None:
    """A base revision's compiler is loaded from its own tree by its folder name (the A/B gate): an
    absolute `fuseguard.compiler` (or `compiler`) import inside it would load this tree's code instead."""
    bad = []
    for name, path in _product_modules().items():
        if name.split(".")[1] != "compiler":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{name}: {m}" for m in mods if m.split(".")[0] == "compiler" or m.startswith("fuseguard.")]
    assert not bad, bad
