"""The layer rules of ``worker/`` as data, and a checker that reads imports with ``ast``.

``tests/system/test_architecture.py`` runs the checker over the real tree; its self-tests feed it
synthetic sources. ``docs/architecture.md`` shows the same table (a test keeps them equal).

What counts as an import: every ``import``/``from ... import`` anywhere in a module: at the top,
inside functions, under ``try``, and under ``if TYPE_CHECKING:``.

- Layer rules count every one of them, ``TYPE_CHECKING`` included: a type that a layer names
  is a dependency on the layer that defines it, even if it costs nothing at run time.
- The cycle check counts every import except those only under ``TYPE_CHECKING`` (they never
  execute, so they cannot make two modules wait on each other's initialisation). An import
  inside a function does count: the two modules still depend on each other.
- ``from worker.x import y`` is an import of the module ``worker.x.y`` when that module exists,
  else of ``worker.x``. Importing ``worker.x.y`` also runs ``worker/x/__init__.py``; that
  implicit parent import is not an edge (every package's submodules would otherwise "cycle"
  with a package ``__init__`` that re-exports them).
"""

from __future__ import annotations

import ast
import itertools
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 300
TABLE_EXEMPTION = "declarative table"

KERNEL = frozenset({"errors", "modes", "request", "keys", "config", "connections"})
"""Small shared modules at the top of ``worker/`` (each is its own unit in the rules)."""

TORCH = frozenset({"torch", "transformers", "accelerate"})
"""The torch stack: a layer that must never import torch must not import these either."""

ROOT = "root"
"""The bare ``worker`` package (``worker/__init__.py``: the version); anyone may import it."""

EVERYTHING = frozenset(
    {"protocol", "client", "streams", "scorer", "executor", "daemon", "observability"}
    | {"gateway", "integrations", "tensors"}
    | {"processes", "demo", "commands", "devtools", ROOT}
    | KERNEL
)


@dataclass(frozen=True)
class Rule:
    """What one layer may import: internal units (a whitelist), third-party packages (a
    blacklist, or a whitelist when ``third_party_only`` is set; the stdlib is always fine)."""

    layer: str
    may_import: frozenset[str]
    never: frozenset[str] = frozenset()
    third_party_only: frozenset[str] | None = None
    why: str = ""


def _rule(
    layer: str,
    may: Iterable[str],
    never: Iterable[str] = (),
    *,
    third_party_only: frozenset[str] | None = None,
    why: str = "",
) -> Rule:
    return Rule(layer, frozenset(may) | {layer, ROOT}, frozenset(never), third_party_only, why)


RULES: dict[str, Rule] = {
    r.layer: r
    for r in (
        _rule("protocol", {"errors", "modes", "request"}, {"redis", "numpy", *TORCH},
              third_party_only=frozenset({"msgpack"}), why="the wire schema: msgpack only"),
        _rule("client", {"protocol", *KERNEL}, TORCH,
              why="producers never load torch nor the worker side"),
        _rule("streams", {"protocol", *KERNEL}, TORCH,
              why="Redis Streams commands serve both sides"),
        _rule("scorer", {"errors", "modes", "request"}, {"redis", "msgpack", *TORCH},
              why="the torch-free contract the daemon drives"),
        _rule("executor", {"scorer", "errors", "modes", "request"}, {"redis", "msgpack"},
              why="all torch, never the queue nor the wire"),
        _rule("daemon", {"streams", "protocol", "scorer", "observability", *KERNEL}, TORCH,
              why="drives a Scorer; never builds one"),
        _rule("observability", {"errors"}, {"redis", "msgpack", *TORCH},
              why="plain numbers in, metrics and health out"),
        _rule("gateway", {"client", "protocol", *KERNEL}, TORCH,
              why="an HTTP front over the asyncio client: a producer"),
        _rule("integrations", {"client", *KERNEL}, TORCH,
              why="drop-in reward functions imported by trainers: producers"),
        _rule("tensors", {"client", *KERNEL}, {"redis", "msgpack", "transformers", "accelerate"},
              why="a producer's results as torch tensors: torch when called, never the worker"),
        _rule("processes", {"executor", *KERNEL}, {"redis", "msgpack"},
              why="starts, watches and stops worker processes; never the queue nor the wire"),
        _rule("demo", {"processes", *KERNEL},
              why="the demo's samples, tiny models and embedded server"),
        _rule("commands", EVERYTHING, why="the command line wires everything"),
        _rule("devtools", EVERYTHING, why="developer tools, not the runtime"),
        _rule("kernel", KERNEL, third_party_only=frozenset({"redis"}),
              why="kernel modules import only each other, the stdlib and redis"),
    )
}  # fmt: skip
_ROOT_RULE = Rule(
    "root", frozenset({ROOT}), third_party_only=frozenset(), why="import worker is free"
)

SHIMS = {"worker.aio_client": "client", "worker.pooling": "executor"}
"""Re-export shims at the top, kept for documented imports; they belong to their target layer."""

_TOP_COMMANDS = {"worker.cli", "worker.__main__"}


def unit_of(module: str) -> str | None:
    """The unit of a ``worker`` module name: a layer, a kernel module name, or ``root``."""
    if module == "worker":
        return ROOT
    if module in SHIMS:
        return SHIMS[module]
    if module in _TOP_COMMANDS:
        return "commands"
    parts = module.split(".")
    if parts[0] != "worker" or len(parts) < 2:
        return None
    if parts[1] in EVERYTHING - {ROOT}:
        return parts[1]
    return None


def layer_of(unit: str) -> str:
    """The layer a unit belongs to (kernel modules share the ``kernel`` layer)."""
    return "kernel" if unit in KERNEL else unit


def rule_for(unit: str) -> Rule:
    return _ROOT_RULE if unit == ROOT else RULES[layer_of(unit)]


# ----------------------------------------------------------------------------- reading imports


@dataclass(frozen=True)
class Import:
    """One imported module name as written (resolved to absolute), where, and how guarded."""

    target: str
    line: int
    type_checking: bool


@dataclass
class Module:
    """A parsed module: its dotted name, display path, source and imports."""

    name: str
    path: str
    source: str
    is_package: bool
    imports: list[Import] = field(default_factory=list)

    @property
    def tree(self) -> ast.Module:
        return ast.parse(self.source, filename=self.path)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_imports(
    nodes: Iterable[ast.AST], guarded: bool
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement in ``nodes`` (recursively), with whether it sits under
    ``if TYPE_CHECKING:`` (its ``else`` branch is not guarded)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, guarded
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk_imports(node.body, True)
            yield from _walk_imports(node.orelse, guarded)
        else:
            yield from _walk_imports(ast.iter_child_nodes(node), guarded)


def _resolve_from(mod: Module, node: ast.ImportFrom, known: set[str]) -> list[str]:
    if node.level:
        package = mod.name if mod.is_package else mod.name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    out = []
    for alias in node.names:
        candidate = f"{base}.{alias.name}"
        out.append(candidate if candidate in known else base)
    return out


def parse_modules(sources: Mapping[str, tuple[str, str, bool]]) -> dict[str, Module]:
    """``{name: (path, source, is_package)}`` -> parsed modules with resolved imports."""
    modules = {n: Module(n, p, s, pkg) for n, (p, s, pkg) in sources.items()}
    known = set(modules)
    for mod in modules.values():
        for node, guarded in _walk_imports(mod.tree.body, False):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                targets = _resolve_from(mod, node, known)
            mod.imports.extend(Import(t, node.lineno, guarded) for t in dict.fromkeys(targets))
    return modules


def load_tree(root: Path, package: str = "worker") -> dict[str, Module]:
    """Every ``*.py`` under ``root/package``, parsed."""
    sources = {}
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root)
        parts = list(rel.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        sources[".".join(parts)] = (rel.as_posix(), path.read_text(), is_package)
    return parse_modules(sources)


# ----------------------------------------------------------------------------- the checks


def _third_party(target: str) -> str | None:
    top = target.split(".")[0]
    if top == "worker" or top == "__future__" or top in sys.stdlib_module_names:
        return None
    return top


def layer_violations(modules: Mapping[str, Module]) -> list[str]:
    """One line per import that breaks ``RULES``, naming the module, line and rule."""
    problems = []
    for mod in modules.values():
        unit = unit_of(mod.name)
        if unit is None:
            problems.append(f"{mod.path}: {mod.name} belongs to no layer (add it to RULES)")
            continue
        rule = rule_for(unit)
        for imp in mod.imports:
            where = f"{mod.path}:{imp.line}: {mod.name} imports {imp.target}"
            tc = " (under TYPE_CHECKING: still a dependency)" if imp.type_checking else ""
            package = _third_party(imp.target)
            if package is None:
                target_unit = unit_of(imp.target)
                if target_unit is None or target_unit in rule.may_import:
                    continue
                allowed = ", ".join(sorted(rule.may_import - {ROOT, rule.layer}))
                problems.append(
                    f"{where}{tc}: {rule.layer} may import only {allowed or 'itself'} "
                    f"({rule.why}), not {target_unit}"
                )
            elif package in rule.never:
                problems.append(
                    f"{where}{tc}: {rule.layer} must never import {package} ({rule.why})"
                )
            elif rule.third_party_only is not None and package not in rule.third_party_only:
                only = ", ".join(sorted(rule.third_party_only)) or "nothing"
                problems.append(
                    f"{where}{tc}: outside the stdlib {rule.layer} may import only {only} "
                    f"({rule.why}), not {package}"
                )
    return problems


def import_graph(
    modules: Mapping[str, Module], *, type_checking: bool = False
) -> dict[str, dict[str, int]]:
    """``{module: {imported worker module: first line}}``; ``TYPE_CHECKING``-only imports are
    left out unless ``type_checking`` (a type one module names from another is a dependency
    too)."""
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for mod in modules.values():
        for imp in mod.imports:
            counted = type_checking or not imp.type_checking
            if counted and imp.target in modules and imp.target != mod.name:
                graph[mod.name].setdefault(imp.target, imp.line)
    return graph


def strongly_connected(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (sorted)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _shortest_cycle(
    graph: Mapping[str, Mapping[str, int]], start: str, comp: set[str]
) -> list[str]:
    """The shortest path ``start -> ... -> start`` inside one component (breadth first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in comp:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start, start]  # unreachable for a real component


def cycle_violations(modules: Mapping[str, Module], *, type_checking: bool = False) -> list[str]:
    """One line per import cycle: the modules in it and one cycle with each import's line
    (``type_checking``: ``TYPE_CHECKING``-only imports count as edges too)."""
    graph = import_graph(modules, type_checking=type_checking)
    problems = []
    for comp in strongly_connected(graph):
        cycle = _shortest_cycle(graph, comp[0], set(comp))
        hops = " -> ".join(
            f"{a} ({modules[a].path}:{graph[a][b]})" for a, b in itertools.pairwise(cycle)
        )
        problems.append(f"import cycle among {', '.join(comp)}: {hops} -> {cycle[-1]}")
    return problems


def _class_source(lines: list[str], node: ast.ClassDef) -> str:
    """The class with its decorators and the comment block directly above it."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    while first > 1 and lines[first - 2].lstrip().startswith("#"):
        first -= 1
    return "\n".join(lines[first - 1 : node.end_lineno])


def module_size_violations(modules: Mapping[str, Module]) -> list[str]:
    """Modules over ``MAX_MODULE_LINES`` lines."""
    problems = []
    for mod in modules.values():
        count = len(mod.source.splitlines())
        if count > MAX_MODULE_LINES:
            problems.append(f"{mod.path}: {count} lines (at most {MAX_MODULE_LINES})")
    return problems


def class_size_violations(modules: Mapping[str, Module]) -> list[str]:
    """Classes over ``MAX_CLASS_LINES`` lines, unless the class (its docstring, a comment in it
    or the comment block directly above it) names itself a declarative table."""
    problems = []
    for mod in modules.values():
        lines = mod.source.splitlines()
        for node in ast.walk(mod.tree):
            if not isinstance(node, ast.ClassDef) or node.end_lineno is None:
                continue
            size = node.end_lineno - node.lineno + 1
            if size > MAX_CLASS_LINES and TABLE_EXEMPTION not in _class_source(lines, node).lower():
                problems.append(
                    f"{mod.path}:{node.lineno}: class {node.name} has {size} lines "
                    f"(at most {MAX_CLASS_LINES} unless it is a {TABLE_EXEMPTION})"
                )
    return problems
