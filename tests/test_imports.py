"""Dependencies point one way: the import graph between fp8ops' packages has no cycle, and
neither has the graph between its modules.

In the package graph a node is a package under ``fp8ops`` (``fp8ops.megatron.layers`` is
``megatron``), or a top-level module (``fp8ops/errors.py`` is ``errors``). The command layer
(``fp8ops/cli.py``, ``fp8ops/__main__.py`` and every ``*/cli.py``) is one node of its own,
``cli``: it may import anything, and nothing else may import it. Every import counts: ``import
x`` and ``from x import y``, relative ones resolved, inside functions and under
``TYPE_CHECKING`` too (a deferred import is still a dependency). In the module graph a node is
a module (a package by its ``__init__.py``), and the same imports count.

``python tests/test_imports.py`` prints the package graph, each edge with the imports that make
it, then any cycle of either graph.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "fp8ops"
CLI = "cli"  # the command layer's node

# (importing module, imported module) for every import that crosses from one node to another.
Edges = dict[tuple[str, str], list[tuple[str, str]]]


def modules(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def node(module: str) -> str:
    """The graph node ``module`` belongs to."""
    parts = module.split(".")
    if parts[-1] in ("cli", "__main__"):
        return CLI
    return parts[1] if len(parts) > 1 else parts[0]


def import_lines(module: str, path: Path, known: set[str]) -> dict[str, list[int]]:
    """The fp8ops modules ``module`` imports anywhere in its source, each resolved to the
    module it loads (``from fp8ops import errors`` is ``fp8ops.errors``; ``from fp8ops.megatron
    import build_gpt`` is ``fp8ops.megatron``), with the lines that import it."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: dict[str, set[int]] = defaultdict(set)
    for statement in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                names[alias.name].add(statement.lineno)
        elif isinstance(statement, ast.ImportFrom):
            base = statement.module or ""
            if statement.level:
                anchor = package.split(".")[: len(package.split(".")) - (statement.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in statement.names:
                names[f"{base}.{alias.name}"].add(statement.lineno)
    resolved: dict[str, set[int]] = defaultdict(set)
    for name, lines in names.items():
        while name and name not in known:  # the longest prefix that is a module
            name = name.rpartition(".")[0]
        if name:
            resolved[name] |= lines
    return {name: sorted(lines) for name, lines in resolved.items()}


def imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """The fp8ops modules ``module`` imports anywhere in its source (:func:`import_lines`)."""
    return set(import_lines(module, path, known))


def package_edges(package_dir: Path = PACKAGE_DIR) -> Edges:
    """Edges between nodes, each with the module-level imports that make it."""
    found = modules(package_dir)
    edges: Edges = defaultdict(list)
    for module, path in found.items():
        for target in sorted(imported_modules(module, path, set(found))):
            if node(module) != node(target):
                edges[node(module), node(target)].append((module, target))
    return dict(sorted(edges.items()))


def module_edges(package_dir: Path = PACKAGE_DIR) -> Edges:
    """Edges between modules, each with the lines that make it (``fp8ops.a.x line 12`` imports
    ``fp8ops.b.y``)."""
    found = modules(package_dir)
    edges: Edges = {}
    for module, path in found.items():
        for target, lines in sorted(import_lines(module, path, set(found)).items()):
            if target != module:
                edges[module, target] = [(f"{module} line {line}", target) for line in lines]
    return dict(sorted(edges.items()))


def cycles(edges: Edges) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    graph = defaultdict(set)
    for source, target in edges:
        graph[source].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted({n for edge in edges for n in edge}):
        if v not in index:
            visit(v)
    return sorted(components)


def describe(edges: Edges, only: set[str] | None = None) -> str:
    """One line per edge (``a -> b: fp8ops.a.x imports fp8ops.b.y; ...``), between the nodes
    in ``only`` if given."""
    lines = []
    for (source, target), imports in edges.items():
        if only is None or {source, target} <= only:
            how = "; ".join(f"{a} imports {b}" for a, b in imports)
            lines.append(f"  {source} -> {target}: {how}")
    return "\n".join(lines)


def test_the_package_graph_has_no_cycle():
    edges = package_edges()
    print(describe(edges))  # pytest -s: the whole graph
    found = cycles(edges)
    assert not found, "\n".join(
        f"cycle between {', '.join(component)}:\n{describe(edges, set(component))}"
        for component in found
    )


def test_no_modules_import_each_other_even_in_a_function():
    """A cycle between modules, even one closed only by an import inside a function or under
    ``TYPE_CHECKING``, leaves no module to read first: each needs the other understood. A
    package's ``__init__.py`` is a module too."""
    edges = module_edges()
    found = cycles(edges)
    assert not found, "\n".join(
        f"cycle between {', '.join(component)}:\n{describe(edges, set(component))}"
        for component in found
    )


def test_only_the_command_layer_imports_a_command_module():
    edges = package_edges()
    into_cli = {edge: imports for edge, imports in edges.items() if edge[1] == CLI}
    assert not into_cli, "a module outside the command layer imports one:\n" + describe(into_cli)


@pytest.mark.parametrize(
    ("source", "target"),
    [("megatron", "checkpoint"), ("megatron", "admission"), ("precision", "manifest")],
)
def test_an_edge_that_must_not_exist_does_not(source, target):
    imports = package_edges().get((source, target), [])
    assert not imports, f"{source} must not import {target}:\n" + describe(
        {(source, target): imports}
    )


def test_the_run_package_is_at_the_bottom():
    """Every package reads and writes run directories through ``fp8ops.run``, so it may lean
    on nothing but the manifest, the errors, the file helpers and the GEMMs' names."""
    edges = package_edges()
    above = {edge: imports for edge, imports in edges.items() if edge[0] == "run"}
    allowed = {("run", "manifest"), ("run", "errors"), ("run", "files"), ("run", "gemm_roles")}
    extra = {edge: imports for edge, imports in above.items() if edge not in allowed}
    assert not extra, (
        "fp8ops.run imports more than manifest, errors, files, gemm_roles:\n" + describe(extra)
    )


# The commands that run training: the command layer, and the two packages whose commands train
# runs (dualtrack trains three tracks; preflight rehearses a shortened run).
TRAINING_COMMANDS = {CLI, "dualtrack", "preflight"}


def test_only_commands_import_the_trainer():
    edges = package_edges()
    into_train = {
        edge: imports
        for edge, imports in edges.items()
        if edge[1] == "train" and edge[0] not in TRAINING_COMMANDS
    }
    assert not into_train, "only commands may import fp8ops.train:\n" + describe(into_train)


# docs/ARCHITECTURE.md's layers, top first: a package may import only packages of lower layers.
LAYERS = [
    {CLI},
    {"compare"},
    {"dualtrack", "preflight"},
    {"train"},
    {"console"},
    {"start"},
    {"overrides"},  # the ledger's reads check the checkpoints' anchors and revisions
    {"checkpoint", "evaluate", "admission", "sinks", "notify"},
    {"hf", "te_import"},  # te_import replays alerts over what it imports
    {"alerts", "megatron"},
    {"telemetry"},
    {"precision", "data", "launch"},
    {"run"},
    {"manifest"},
    {"files", "terminal", "collective"},
    {"errors", "amax_algo", "gemm_roles"},
]


def test_every_import_points_down_the_documented_layers():
    depth = {package: level for level, layer in enumerate(LAYERS) for package in layer}
    edges = package_edges()
    unknown = sorted({n for edge in edges for n in edge} - depth.keys() - {"fp8ops"})
    assert not unknown, f"packages not in LAYERS (and docs/ARCHITECTURE.md): {unknown}"
    upward = {
        edge: imports
        for edge, imports in edges.items()
        if edge[1] in depth and depth[edge[1]] <= depth[edge[0]]
    }
    assert not upward, "imports that do not point down the layers:\n" + describe(upward)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """Relative imports resolved, ``from package import module`` as the module, imports inside
    functions, and cli modules as the command layer."""
    package = tmp_path / "fp8ops"
    for name, text in {
        "__init__.py": "",
        "errors.py": "",
        "cli.py": "from fp8ops.a import x\n",
        "a/__init__.py": "from .x import f\n",
        "a/x.py": "def f():\n    from ..b import y\n",
        "a/cli.py": "import fp8ops.b.y\n",
        "b/__init__.py": "",
        "b/y.py": "from fp8ops import errors\nfrom .. import a\n",
    }.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    edges = package_edges(package)
    assert edges == {
        ("a", "b"): [("fp8ops.a.x", "fp8ops.b.y")],
        ("b", "a"): [("fp8ops.b.y", "fp8ops.a")],
        ("b", "errors"): [("fp8ops.b.y", "fp8ops.errors")],
        ("cli", "a"): [("fp8ops.cli", "fp8ops.a.x")],
        ("cli", "b"): [("fp8ops.a.cli", "fp8ops.b.y")],
    }
    assert cycles(edges) == [["a", "b"]]


def test_the_module_graph_sees_deferred_imports(tmp_path):
    """A cycle closed by an import under ``TYPE_CHECKING`` and one inside a function, within one
    package; a module importing its own package's ``__init__`` (which imports it) is one too."""
    package = tmp_path / "fp8ops"
    for name, text in {
        "__init__.py": "",
        "a/__init__.py": "from fp8ops.a.z import g\n",
        "a/x.py": "import typing\nif typing.TYPE_CHECKING:\n    from fp8ops.a.y import Y\n",
        "a/y.py": "def f():\n    from . import x\n",
        "a/z.py": "from fp8ops.a import x\ndef g():\n    from fp8ops.a import g\n",
    }.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    edges = module_edges(package)
    assert edges == {
        ("fp8ops.a", "fp8ops.a.z"): [("fp8ops.a line 1", "fp8ops.a.z")],
        ("fp8ops.a.x", "fp8ops.a.y"): [("fp8ops.a.x line 3", "fp8ops.a.y")],
        ("fp8ops.a.y", "fp8ops.a.x"): [("fp8ops.a.y line 2", "fp8ops.a.x")],
        ("fp8ops.a.z", "fp8ops.a"): [("fp8ops.a.z line 3", "fp8ops.a")],
        ("fp8ops.a.z", "fp8ops.a.x"): [("fp8ops.a.z line 1", "fp8ops.a.x")],
    }
    assert cycles(edges) == [["fp8ops.a", "fp8ops.a.z"], ["fp8ops.a.x", "fp8ops.a.y"]]


if __name__ == "__main__":
    graph = package_edges()
    print(describe(graph))
    for component in cycles(graph):
        print("cycle:", ", ".join(component))
    for component in cycles(module_edges()):
        print("module cycle:", ", ".join(component))
