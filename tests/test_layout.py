"""The package's structure: every module imports alone, the import graph has no cycle,
and no module reaches into another module's private names.

The graph is read from the source (``ast``): every ``import`` of a module of the
package, at module level or inside a function alike, is an edge. A cycle through a
function-level import is still a cycle.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "asyncclcache"
PACKAGE = "asyncclcache"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module: str, is_package: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The package modules ``node`` (in ``module``) imports."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".")
            base = base[: len(base) - node.level + (1 if is_package else 0)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        # `from . import x` / `from .m import name`: x may be a module or a name in m.
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names]
    return sorted({n for n in names if n in MODULES and n != module})


class _NoTypingOnly(ast.NodeTransformer):
    def visit_If(self, node: ast.If) -> ast.AST:
        if _is_type_checking(node.test):
            node.body = [ast.Pass()]  # typing-only imports are never run
        self.generic_visit(node)
        return node


def import_graph(typing: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``typing``: also those imported only for
    type checking, which a reader follows all the same)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        if not typing:
            tree = _NoTypingOnly().visit(tree)
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_resolve(module, path.name == "__init__.py", node))
        # A module imports its parent packages when it is imported: not a dependency edge.
        graph[module] = {e for e in edges if not module.startswith(e + ".")}
    return graph


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                found.append([*stack[stack.index(n):], n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_the_graph_reader_sees_edges_and_cycles():
    # The checker itself must be able to fail.
    graph = import_graph()
    assert "asyncclcache.cache" in graph["asyncclcache.program"]
    assert "asyncclcache.pipeline" in graph["asyncclcache.cache"]
    # maintenance names the store only for type checking: an edge of the typing graph only.
    assert "asyncclcache.store" in import_graph(typing=True)["asyncclcache.maintenance"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("typing", [False, True], ids=["run-time", "with-type-only"])
def test_no_import_cycle_in_the_package(typing):
    graph = import_graph(typing)
    # The package's __init__ re-exports lazily from its submodules; it is the top, not a layer.
    graph = {m: {e for e in es if e != PACKAGE} for m, es in graph.items()}
    assert _cycles(graph) == []


def test_layers_point_down():
    graph = import_graph()
    # The cache never needs the program that uses it; drivers and the store never need the cache.
    assert "asyncclcache.program" not in graph["asyncclcache.cache"]
    for low in ("asyncclcache.store", "asyncclcache.entry", "asyncclcache.fileio", "asyncclcache.keys",
                "asyncclcache.pipeline", "asyncclcache.drivers", "asyncclcache.drivers.kcache_folders"):
        assert not graph[low] & {"asyncclcache.cache", "asyncclcache.program"}, low


def test_nothing_private_crosses_a_module_boundary():
    # `from .x import _name` and `module._name` of another package module.
    problems = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        imported_modules: dict[str, str] = {}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            for a in node.names:
                single = ast.ImportFrom(module=node.module, names=[a], level=node.level)
                target = _resolve(module, path.name == "__init__.py", single)
                if not target:
                    continue  # not the package's
                if target[0].rsplit(".", 1)[-1] == a.name:
                    imported_modules[a.asname or a.name] = target[0]  # a module
                elif a.name.startswith("_") and not a.name.startswith("__"):
                    problems.append(f"{module}: from {target[0]} import {a.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in imported_modules and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                problems.append(f"{module}: {imported_modules[node.value.id]}.{node.attr}")
    # Underscore modules (_flags, _pyopencl) are private to the package, not to a module.
    assert problems == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.endswith("__main__")))
def test_every_module_imports_alone(module):
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


#: Names on disk, and the one module that spells each (the others ask it).
DISK_NAMES = {"stats.json": "shared", "stats.lock": "shared", "prune.lock": "shared", ".acl": "shared",
              "rank-": "shared", "stats.d": "shared", "upkeep.json": "shared", "baked.mark": "shared",
              ".lock": "locks", ".tmp-": "fileio", ".copy": "nodecopies",
              ".asyncclcache-builds": "buildlock"}


def _string_constants(tree: ast.AST) -> list[tuple[int, str]]:
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_each_name_on_disk_is_spelled_by_its_owner_alone():
    spelled: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        for line, value in _string_constants(ast.parse(path.read_text(), str(path))):
            for name in DISK_NAMES:
                if value == name or (value.startswith(name) and name == "rank-" and len(value) <= 6):
                    spelled.setdefault(name, []).append(f"{module}:{line}")
    wrong = {name: [w for w in where if not w.startswith(f"{PACKAGE}.{DISK_NAMES[name]}:")]
             for name, where in spelled.items()}
    assert {n: w for n, w in wrong.items() if w} == {}
    # The checker sees them where they are spelled.
    assert all(spelled.get(name) for name in DISK_NAMES), spelled


def _implementation_names() -> tuple[tuple[str, ...], re.Pattern[str]]:
    """Every OpenCL platform name in the table, and a pattern of every driver setting's
    name: the prefixes of the settings that change code, and the variables an
    implementation reads to find its cache (as its module documents them)."""
    from asyncclcache import platforms

    names = tuple(n for p in platforms.PLATFORMS for n in p.names)
    prefixes = {pre for p in platforms.PLATFORMS if p.settings is not None for pre in p.settings.prefixes}
    spelled = "|".join(sorted(map(re.escape, prefixes | {"XDG_CACHE_HOME", "CUDA_HOME"})))
    return names, re.compile(rf"(?<![A-Za-z0-9_])(?:{spelled})")


def test_what_one_implementation_is_is_spelled_in_its_platform_module_alone():
    # Issue 27: a platform's name or a driver setting's name in a string of the code
    # outside asyncclcache/platforms/ is knowledge of one implementation kept elsewhere.
    names, setting = _implementation_names()
    inside: dict[str, list[str]] = {}
    outside: list[str] = []
    for module, path in MODULES.items():
        for line, value in _string_constants(ast.parse(path.read_text(), str(path))):
            found = [n for n in names if n in value] + setting.findall(value)
            if not found:
                continue
            if module.startswith(f"{PACKAGE}.platforms."):
                for f in found:
                    inside.setdefault(f, []).append(f"{module}:{line}")
            else:
                outside.append(f"{module}:{line}: {found}")
    assert outside == []
    # The checker sees them where they are spelled: every platform name, and pocl's,
    # NVIDIA's, Mesa's and Intel's settings.
    assert set(names) <= set(inside), sorted(inside)
    assert {"POCL_", "CUDA_", "MESA_", "CL_CONFIG_", "XDG_CACHE_HOME"} <= set(inside), sorted(inside)
