"""The layers go one way: no import cycles, and no product module imports pytest or a test file.

Product code is `compiler/`, `verify/` and `suites/` minus the test files (`test_*.py`) and the pytest
plugin (`verify/pytest_plugin.py`, which exists to import pytest). Imports form a DAG, function-level
(lazy) ones and those under `TYPE_CHECKING` included; `compiler` never imports `verify` or `suites` at any
level; no module imports another's private name; one module computes where the project's root is.
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


def _imports(name: str, path: Path, *, top_level_only: bool, type_checking: bool = True) -> set[str]:
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
            elif isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test) and not type_checking:
                continue
            for child in ast.iter_child_nodes(stmt):
                if isinstance(child, ast.stmt):
                    visit([child], nested or isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)))
                elif isinstance(child, (ast.excepthandler,)):
                    visit(child.body, nested)

    visit(tree.body, False)
    return found


def _graph(*, top_level_only: bool, type_checking: bool = True) -> dict[str, set[str]]:
    modules = _product_modules()
    graph = {}
    for name, path in modules.items():
        targets = _imports(name, path, top_level_only=top_level_only, type_checking=type_checking)
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
    """`TYPE_CHECKING` imports count: a cycle only a type checker follows is still two modules that each need
    the other's vocabulary (the old cost <-> patterns pair: the vocabulary now lives in fusion/rules.py)."""
    graph = _graph(top_level_only=top_level_only)
    assert len(graph) > 30, "the product module scan found too few modules"
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_type_checking_import_is_an_edge(tmp_path: Path) -> None:
    code = tmp_path / "m.py"
    code.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .other import Thing\n")
    assert "fuseguard.compiler.other" in _imports("fuseguard.compiler.m", code, top_level_only=True)
    assert "fuseguard.compiler.other" not in _imports("fuseguard.compiler.m", code, top_level_only=True,
                                                      type_checking=False)


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


def _private_imports(name: str, path: Path) -> list[str]:
    """`from X import _name` where X is another module: a private name used across modules (a package's
    `__init__` importing its own private submodule, `from . import _aliases`, is the package's own business)."""
    is_package = path.name == "__init__.py"
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            if not alias.name.startswith("_") or alias.name.startswith("__"):
                continue
            base, full = _resolve(name, node, alias, is_package)
            if is_package and node.level == 1 and not node.module and full.rsplit(".", 1)[0] == name:
                continue
            bad.append(f"line {node.lineno}: {alias.name} from {base or '.'}")
    return bad


def test_no_private_name_is_imported_across_modules() -> None:
    offenders = {name: found for name, path in _product_modules().items() if (found := _private_imports(name, path))}
    assert not offenders, f"private names imported from another module: {offenders}"


def test_the_private_import_finder_finds_them(tmp_path: Path) -> None:
    code = tmp_path / "m.py"
    code.write_text("from .helpers import _np, public\nfrom . import _own\nfrom fuseguard.verify.bench import _ort\n")
    assert [b.split(":")[0] for b in _private_imports("fuseguard.compiler.m", code)] == ["line 1", "line 2", "line 3"]
    package = tmp_path / "__init__.py"
    package.write_text("from . import _aliases\n")
    assert _private_imports("fuseguard.compiler", package) == []


def test_one_module_says_where_the_project_root_is() -> None:
    """`compiler/paths.py: PROJECT_ROOT` only: a module that climbs from its own `__file__` to the checkout
    points the decision database or the baselines at the wrong folder once it moves to another depth."""
    from fuseguard.compiler.paths import PROJECT_ROOT

    assert all((PROJECT_ROOT / top).is_dir() for top in (*PACKAGES, "baselines")), PROJECT_ROOT
    climbing = {}
    for name, path in _product_modules().items():
        if name == "fuseguard.compiler.paths":
            continue
        hits = [f"line {n.lineno}" for n in ast.walk(ast.parse(path.read_text()))
                if isinstance(n, ast.Attribute) and n.attr == "parent" and "__file__" in ast.unparse(n)
                and ast.unparse(n).count(".parent") >= 2]
        if hits:
            climbing[name] = hits
    assert not climbing, f"modules computing a project root of their own (use compiler.paths.PROJECT_ROOT): {climbing}"


def test_every_package_folder_is_in_pyproject() -> None:
    """pyproject lists packages one by one (the folders install under `fuseguard.`): a folder left out works in
    a checkout and is missing from the wheel."""
    tomllib = pytest.importorskip("tomllib")         # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {_module_name(p) for package in PACKAGES for p in (ROOT / package).rglob("__init__.py")}
    assert folders == listed, f"missing from pyproject: {sorted(folders - listed)}; not folders: {sorted(listed - folders)}"
