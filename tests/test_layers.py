"""The import graph of ``src/vertexrt`` keeps the layers of DESIGN.md: no cycle, nothing imported upward.

The graph is built with :mod:`ast` from every ``.py`` file under ``src/vertexrt``: module-level imports and
imports inside functions alike (a function-level import runs as surely as a top-level one, it only runs
later), ``from x import y`` resolved to the module ``x.y`` when that is a module. Imports under
``if TYPE_CHECKING:`` never run: they are left out of the cycle check but kept in the layer check (a type
named from a higher layer is still a dependency on it). The same graph folded to packages
(``vertexrt.<room>``: ``checkpoint``, ``distributed``, ``devices``...) has no cycle either: two rooms never
lean on each other, even through different files. Each failure lists every offending import with its file
and line.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "vertexrt"

#: Layers, lowest first: a module may import from its own layer and the layers before it. Each entry names
#: module prefixes (``vertexrt.<prefix>`` and everything under it); the longest matching prefix decides.
LAYERS: list[tuple[str, ...]] = [
    # modules that import nothing of vertexrt's: every layer may use them
    ("_lazy", "_net", "_version", "audit", "phases"),
    ("errors",),
    ("env", "uris"),
    ("paths", "retries", "clients", "emulator"),
    ("gpus",),  # which GPU a local rank takes, from counts it is given: no world, so below distributed/
    ("distributed",),  # world detection, the cluster model and its sources, CPU collectives, rendezvous
    ("devices",),  # asks distributed/ which local rank this process is
    # the framework bootstraps pick this process's device, and local-run starts them
    ("distributed.torch", "distributed.tensorflow"),
    ("distributed.local_run",),  # replica environments, output relay, supervisor
    ("distributed.chaos",),  # the fault certificate drives the supervisor
    ("distributed.local_run.cli", "distributed.launcher"),
    ("preemption",),
    ("checkpoint",),
    ("data",),
    ("hypertune",),
    ("tensorboard", "tensorboard_events"),  # tensorboard_events: the framework-free scalar writer
    ("doctor",),  # the preflight of @main and Trainer.fit: storage, cluster, devices
    ("runtime",),
    ("keras", "integrations"),  # the framework edge, over runtime/
    ("cli",),
    (".",),  # the package itself (``vertexrt/__init__.py``): re-exports every layer, lazily
]


@dataclass(frozen=True)
class Import:
    """One import statement's edge: ``source`` (a module) imports ``target`` at ``path:line``."""

    source: str
    target: str
    path: str
    line: int
    in_function: bool
    type_only: bool

    def __str__(self) -> str:
        where = "in a function" if self.in_function else "at module level"
        return f"{self.path}:{self.line}: {self.source} imports {self.target} ({where})"


def modules() -> dict[str, Path]:
    """Every module under src/vertexrt by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement with (inside a function, under ``if TYPE_CHECKING:``)."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool, bool]] = []

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                found.append((child, in_function, type_only))
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, True, type_only)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), in_function, True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), in_function, type_only)
            else:
                visit(child, in_function, type_only)

    visit(tree, False, False)
    return found


def imports() -> list[Import]:
    """Every import of a vertexrt module by a vertexrt module."""
    known = modules()
    edges = []
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        rel = str(path.relative_to(SRC.parent))
        for stmt, in_function, type_only in _statements(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(stmt, ast.Import):
                targets = [alias.name for alias in stmt.names]
            else:
                base = stmt.module or ""
                if stmt.level:
                    anchor = package.split(".")[: len(package.split(".")) - stmt.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in stmt.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in known else base)
            for target in targets:
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    while target not in known:  # `import vertexrt.x.y` with y a name: the module x
                        target = target.rpartition(".")[0]
                    if target != name:
                        edges.append(Import(name, target, rel, stmt.lineno, in_function, type_only))
    return list(dict.fromkeys(edges))  # `from x import a, b`: one edge


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module`` (its longest listed prefix)."""
    rest = module.removeprefix(PACKAGE).removeprefix(".") or "."
    best, best_length = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = rest == prefix or rest.startswith(prefix + ".")
            if matches and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{module} is in no layer of LAYERS: place it there"
    return best


def cycles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def room_of(module: str) -> str:
    """The top-level package or module of ``vertexrt`` that ``module`` lives in (``vertexrt.distributed``
    for ``vertexrt.distributed.torch``)."""
    return ".".join(module.split(".")[:2])


def rooms(edges: list[Import]) -> list[Import]:
    """``edges`` folded to :func:`room_of` both ends, imports within one room left out."""
    folded = [
        Import(room_of(e.source), room_of(e.target), e.path, e.line, e.in_function, e.type_only)
        for e in edges
    ]
    return [e for e in folded if e.source != e.target]


def upward(edges: list[Import]) -> list[Import]:
    """Imports from a module to one in a higher layer. A package's ``__init__`` may name its own members
    (it re-exports them lazily; its layer is that of the package's lowest part, which others import)."""
    return [
        e
        for e in edges
        if layer_of(e.target) > layer_of(e.source)
        and not (e.path.endswith("__init__.py") and e.target.startswith(e.source + "."))
    ]


def test_every_module_has_a_layer():
    for module in modules():
        layer_of(module)


def cycle_report(edges: list[Import], what: str) -> str:
    """Each cycle of ``edges`` and the imports that close it (empty when there is none)."""
    report = []
    for component in cycles(edges):
        members = set(component)
        report.append(f"{what}: " + ", ".join(component))
        report += [f"    {e}" for e in edges if e.source in members and e.target in members]
    return "\n".join(report)


def test_no_import_cycle():
    report = cycle_report([e for e in imports() if not e.type_only], "cycle")
    assert not report, report


def test_no_import_cycle_between_packages():
    report = cycle_report(rooms([e for e in imports() if not e.type_only]), "cycle between packages")
    assert not report, report


def test_no_import_from_a_lower_layer_to_a_higher_one():
    found = upward(imports())
    assert not found, "imports up the layers of tests/test_layers.py::LAYERS:\n" + "\n".join(
        f"    {e}  [layer {layer_of(e.source)} -> {layer_of(e.target)}]" for e in found
    )


def test_graph_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    """The checker itself: a cycle hidden in a function and an upward `from . import` are both caught."""
    package = tmp_path / PACKAGE
    (package / "runtime").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "errors.py").write_text("def f():\n    from vertexrt.runtime import entry\n")
    (package / "runtime" / "__init__.py").write_text("")
    (package / "runtime" / "entry.py").write_text("from ..errors import f\nfrom . import other\n")
    (package / "runtime" / "other.py").write_text("from vertexrt.runtime.entry import x\n")
    monkeypatch.setitem(globals(), "SRC", tmp_path)
    edges = imports()
    assert {(e.source, e.target, e.in_function) for e in edges} == {
        ("vertexrt.errors", "vertexrt.runtime.entry", True),
        ("vertexrt.runtime.entry", "vertexrt.errors", False),
        ("vertexrt.runtime.entry", "vertexrt.runtime.other", False),
        ("vertexrt.runtime.other", "vertexrt.runtime.entry", False),
    }
    assert cycles(edges) == [["vertexrt.errors", "vertexrt.runtime.entry", "vertexrt.runtime.other"]]
    assert [(e.source, e.target) for e in upward(edges)] == [("vertexrt.errors", "vertexrt.runtime.entry")]


def test_packages_fold_a_cycle_that_no_file_closes(tmp_path, monkeypatch):
    """The checker itself: ``a.low`` -> ``b`` -> ``a.high`` has no file-level cycle, but rooms a and b lean on
    each other."""
    package = tmp_path / PACKAGE
    (package / "a").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a" / "__init__.py").write_text("")
    (package / "a" / "low.py").write_text("")
    (package / "a" / "high.py").write_text("from vertexrt import b\n")
    (package / "b.py").write_text("from vertexrt.a import low\n")
    monkeypatch.setitem(globals(), "SRC", tmp_path)
    edges = imports()
    assert cycles(edges) == []
    assert cycles(rooms(edges)) == [["vertexrt.a", "vertexrt.b"]]


def private_reaches() -> list[str]:
    """Every use of another module's underscore name: ``from vertexrt.x import _y`` (relative too) and
    ``x._y`` where ``x`` is a vertexrt module bound by an import. Dunders are public."""

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    found = []
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(SRC)
        modules: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(PACKAGE)):
                for alias in node.names:
                    if private(alias.name):
                        found.append(f"{where}:{node.lineno}: from {node.module or '.'} import {alias.name}")
                    base = (node.module or "").replace(".", "/")
                    candidates = [SRC / base / f"{alias.name}.py", SRC / base / alias.name / "__init__.py"]
                    if node.level or any(c.exists() for c in candidates):
                        modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                modules.update(a.asname for a in node.names if a.asname and a.name.startswith(PACKAGE))
        for node in ast.walk(tree):
            value = node.value if isinstance(node, ast.Attribute) and private(node.attr) else None
            if isinstance(value, ast.Name) and value.id in modules:
                found.append(f"{where}:{node.lineno}: {value.id}.{node.attr}")  # type: ignore[attr-defined]
    return found


def test_no_module_uses_another_modules_underscore_names():
    found = private_reaches()
    assert not found, "underscore names used from another module (make them public or move the code):\n" + (
        "\n".join(f"    {f}" for f in found)
    )


def test_private_reaches_are_seen_in_both_forms(tmp_path, monkeypatch):
    """The checker itself: an imported underscore name and an underscore attribute of an imported module."""
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("_x = 1\ny = 2\n")
    (package / "high.py").write_text(
        "from vertexrt.low import _x\nfrom vertexrt import low\nfrom . import low as lo\n"
        "a = low._x + lo._x + low.y + low.__name__.__len__()\n"
    )
    monkeypatch.setitem(globals(), "SRC", tmp_path)
    assert private_reaches() == [
        "vertexrt/high.py:1: from vertexrt.low import _x",
        "vertexrt/high.py:4: low._x",
        "vertexrt/high.py:4: lo._x",
    ]
