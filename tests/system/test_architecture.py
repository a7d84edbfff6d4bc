"""The layers of ``worker/`` hold: imports point downward only (``docs/architecture.md``), no
import cycle, no oversized module or class. The rules and the checker live in
``tests/support/architecture.py``; the second half of this file shows that the checker fails
on each kind of violation."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import architecture as arch

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


@pytest.fixture(scope="module")
def tree() -> dict[str, arch.Module]:
    return arch.load_tree(ROOT)


# ----------------------------------------------------------------------------- the real tree


def test_tree_is_read(tree: dict[str, arch.Module]) -> None:
    for name in ("worker", "worker.protocol", "worker.daemon", "worker.executor", "worker.cli"):
        assert name in tree
    assert len(tree) > 30


@pytest.mark.parametrize(
    "check, title",
    [
        (arch.layer_violations, "imports that break the layer rules"),
        (arch.cycle_violations, "import cycles"),
        (arch.module_size_violations, "oversized modules"),
        (arch.class_size_violations, "oversized classes"),
    ],
    ids=["layer-rules", "no-import-cycles", "module-sizes", "class-sizes"],
)
def test_the_tree_keeps_the_rule(
    tree: dict[str, arch.Module], check: Callable[[dict[str, arch.Module]], list[str]], title: str
) -> None:
    problems = check(tree)
    assert not problems, f"{title} ({len(problems)}):\n  " + "\n  ".join(problems)


def test_the_executor_has_no_import_cycle_even_through_type_names(
    tree: dict[str, arch.Module],
) -> None:
    """Inside ``worker.executor`` imports point one way even counting ``TYPE_CHECKING`` ones:
    a batch layout, the prefix trees and the vision intake never name each other's types in a
    loop (the tree row's structure lives in ``tree.rows``, below ``packing`` and
    ``tree.layout``)."""
    executor = {n: m for n, m in tree.items() if n.startswith("worker.executor")}
    assert "worker.executor.tree.rows" in executor
    problems = arch.cycle_violations(executor, type_checking=True)
    assert not problems, "\n  ".join(problems)


def test_a_type_checking_cycle_is_reported_when_type_names_count() -> None:
    mods = _modules(
        {
            "worker/executor/packing.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from worker.executor.tree.layout import TreeLayout\n",
            "worker/executor/tree/layout.py": "from worker.executor.packing import ForwardBatch\n",
        }
    )
    assert arch.cycle_violations(mods) == []
    (problem,) = arch.cycle_violations(mods, type_checking=True)
    assert problem.startswith("import cycle among worker.executor.packing, worker.executor.tree")


def _doc_table() -> dict[str, tuple[set[str], set[str]]]:
    """``{layer: (may import, must never import)}`` from the import table of the doc."""
    text = DOC.read_text()
    start = text.index("| layer | may import | must never import |")
    rows: dict[str, tuple[set[str], set[str]]] = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        layer = cells[0].strip("`")
        rows[layer] = tuple(set(re.findall(r"`([\w-]+)`", c)) for c in cells[1:3])  # type: ignore[assignment]
    return rows


def test_the_documented_table_is_the_checked_one() -> None:
    """``docs/architecture.md`` shows exactly ``RULES`` (internal units and third-party)."""
    rows = _doc_table()
    assert set(rows) == set(arch.RULES)
    for layer, rule in arch.RULES.items():
        may, never = rows[layer]
        internal = set(rule.may_import - {arch.ROOT, layer})
        if rule.may_import >= arch.EVERYTHING:
            internal = {"everything"}
        third = set(rule.third_party_only or ())
        assert may == internal | third, f"{layer}: doc says {sorted(may)}"
        assert never == set(rule.never), f"{layer}: doc says never {sorted(never)}"


def _doc_modules() -> dict[str, list[str]]:
    """``{package: [module names]}`` from the sub-package table of ``docs/architecture.md``
    (``worker`` for the top-level row)."""
    text = DOC.read_text()
    table = text[text.index("| package | responsibility | modules |") :].split("\n\n")[0]
    rows: dict[str, list[str]] = {}
    for line in table.splitlines()[2:]:
        package_cell, _, modules_cell = (c.strip() for c in line.strip("|").split("|"))
        match = re.fullmatch(r"`worker/([\w/]+)/`", package_cell)
        prefix = "worker." + match.group(1).replace("/", ".") if match else "worker"
        names = re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", modules_cell))
        assert names, line
        rows[prefix] = names
    return rows


def test_the_documented_modules_exist(tree: dict[str, arch.Module]) -> None:
    """Every module the sub-package table of ``docs/architecture.md`` names is there (a moved or
    renamed module fails this until the doc follows)."""
    missing = [
        f"{prefix}.{n}"
        for prefix, names in _doc_modules().items()
        for n in names
        if n != "__init__" and f"{prefix}.{n}" not in tree
    ]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_module_is_documented(tree: dict[str, arch.Module]) -> None:
    """Every module and sub-package of ``worker/`` is named in the sub-package table, in the row
    of the package that holds it (a new module fails this until the doc names it)."""
    rows = _doc_modules()
    unnamed = []
    for name, module in tree.items():
        if name == "worker" or (module.is_package and name in rows):
            continue
        parent, _, leaf = name.rpartition(".")
        if leaf not in rows.get(parent, ()):
            unnamed.append(f"{name} (row `{parent}`)")
    assert not unnamed, f"docs/architecture.md does not name these modules: {unnamed}"


# ----------------------------------------------------------------------------- the checker fails


def _modules(files: dict[str, str]) -> dict[str, arch.Module]:
    """Synthetic modules from ``{path: source}`` (paths like ``worker/daemon/jobs.py``)."""
    sources = {}
    for path, source in files.items():
        parts = path.removesuffix(".py").split("/")
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        sources[name] = (path, textwrap.dedent(source), is_package)
    return arch.parse_modules(sources)


LAYERED = {
    "worker/__init__.py": '__version__ = "0"\n',
    "worker/errors.py": "class ScoringError(Exception): ...\n",
    "worker/config.py": "from worker.errors import ScoringError\n",
    "worker/protocol/__init__.py": "import msgpack\nfrom worker.errors import ScoringError\n",
    "worker/streams/__init__.py": "import redis\nfrom worker import protocol\n",
    "worker/scorer/__init__.py": "import numpy\nfrom worker.modes import Mode\n",
    "worker/modes.py": "MODES = ()\n",
    "worker/observability/metrics.py": "import prometheus_client\n",
    "worker/daemon/__init__.py": "from worker.daemon import jobs\n",
    "worker/daemon/jobs.py": """\
        from typing import TYPE_CHECKING
        import redis
        from .. import streams
        from ..scorer import Mode
        from worker.observability.metrics import x
        from worker.config import y
        if TYPE_CHECKING:
            from worker.daemon import Worker
        """,
    "worker/executor/__init__.py": "import torch, transformers\nfrom worker.scorer import S\n",
    "worker/commands/serve.py": "from worker.executor import E\nfrom worker.daemon import W\n",
}


def test_a_tree_that_follows_the_rules_passes() -> None:
    mods = _modules(LAYERED)
    assert arch.layer_violations(mods) == []
    assert arch.cycle_violations(mods) == []
    jobs = {i.target: i for i in mods["worker.daemon.jobs"].imports}
    assert "worker.streams" in jobs and "worker.scorer" in jobs  # relative imports resolved
    assert jobs["worker.daemon"].type_checking
    assert [i.target for i in mods["worker.daemon"].imports] == ["worker.daemon.jobs"]


@pytest.mark.parametrize(
    "path, source, expected",
    [
        (
            "worker/executor/loop.py",
            "import os\n\nfrom worker.streams import read\n",
            "worker/executor/loop.py:3: worker.executor.loop imports worker.streams: executor "
            "may import only errors, modes, request, scorer",
        ),
        (
            "worker/scorer/noop.py",
            "def f():\n    import torch\n",
            "worker/scorer/noop.py:2: worker.scorer.noop imports torch: scorer must never import "
            "torch",
        ),
        (
            "worker/daemon/jobs.py",
            "import typing\nif typing.TYPE_CHECKING:\n    from worker.executor import E\n",
            "worker/daemon/jobs.py:3: worker.daemon.jobs imports worker.executor (under "
            "TYPE_CHECKING: still a dependency): daemon may import only",
        ),
        (
            "worker/protocol/__init__.py",
            "try:\n    from numpy import ndarray\nexcept ImportError:\n    pass\n",
            "worker/protocol/__init__.py:2: worker.protocol imports numpy: protocol must never "
            "import numpy",
        ),
        (
            "worker/protocol/__init__.py",
            "import yaml\n",
            "worker/protocol/__init__.py:1: worker.protocol imports yaml: outside the stdlib "
            "protocol may import only msgpack",
        ),
        (
            "worker/keys.py",
            "from worker.protocol import Limits\n",
            "worker/keys.py:1: worker.keys imports worker.protocol: kernel may import only config, "
            "connections, errors, keys, modes, request",
        ),
        (
            "worker/client/__init__.py",
            "from worker.daemon import Worker\n",
            "worker/client/__init__.py:1: worker.client imports worker.daemon: client may import",
        ),
        (
            "worker/aio_client.py",
            "import transformers\n",
            "worker/aio_client.py:1: worker.aio_client imports transformers: client must never "
            "import transformers",
        ),
        (
            "worker/observability/health.py",
            "from worker.daemon import Worker\n",
            "worker.observability.health imports worker.daemon: observability may import only "
            "errors",
        ),
        ("worker/utils.py", "", "worker/utils.py: worker.utils belongs to no layer"),
    ],
)
def test_each_kind_of_forbidden_import_is_reported(path: str, source: str, expected: str) -> None:
    mods = _modules({**LAYERED, path: source})
    problems = arch.layer_violations(mods)
    assert len(problems) == 1 and expected in problems[0], problems


def test_a_violating_import_in_the_real_tree_fails(tree: dict[str, arch.Module]) -> None:
    """What the rule test reports when someone adds ``import torch`` to the protocol."""
    files = {m.path: m.source for m in tree.values()}
    files["worker/protocol/__init__.py"] += "\nimport torch  # a temporary violation\n"
    problems = arch.layer_violations(_modules(files))
    line = len(files["worker/protocol/__init__.py"].splitlines())
    assert (
        f"worker/protocol/__init__.py:{line}: worker.protocol imports torch: protocol must never "
        "import torch (the wire schema: msgpack only)"
    ) in problems


def test_a_cycle_through_a_function_level_import_is_reported() -> None:
    mods = _modules(
        {
            **LAYERED,
            "worker/daemon/jobs.py": "def f():\n    from worker.daemon import Worker\n",
        }
    )
    assert arch.cycle_violations(mods) == [
        "import cycle among worker.daemon, worker.daemon.jobs: worker.daemon "
        "(worker/daemon/__init__.py:1) -> worker.daemon.jobs (worker/daemon/jobs.py:2) "
        "-> worker.daemon"
    ]


def test_a_longer_cycle_is_reported_once_and_type_checking_cycles_are_not() -> None:
    mods = _modules(
        {
            "worker/errors.py": "import worker.keys\n",
            "worker/keys.py": "import worker.config\n",
            "worker/config.py": "from worker import errors\n",
            "worker/modes.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    import worker.connections\n",
            "worker/connections.py": "import worker.modes\n",
        }
    )
    (problem,) = arch.cycle_violations(mods)
    assert problem.startswith("import cycle among worker.config, worker.errors, worker.keys: ")
    assert "worker.config (worker/config.py:1) -> worker.errors (worker/errors.py:1)" in problem
    assert arch.strongly_connected({"a": {"b": 1}, "b": {"a": 1}, "c": {"c": 1}}) == [["a", "b"]]


def test_sizes_are_checked_and_a_named_table_is_exempt() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(arch.MAX_CLASS_LINES))
    big = f"class Big:\n{body}"
    table = f"# The metric definitions: a declarative table.\nclass Table:\n{body}"
    long_module = "x = 1\n" * (arch.MAX_MODULE_LINES + 1)
    mods = _modules(
        {
            "worker/observability/big.py": big,
            "worker/observability/metrics.py": table,
            "worker/observability/long.py": long_module,
            "worker/observability/ok.py": "x = 1\n" * arch.MAX_MODULE_LINES,
        }
    )
    assert arch.class_size_violations(mods) == [
        "worker/observability/big.py:1: class Big has 301 lines (at most 300 unless it is a "
        "declarative table)"
    ]
    assert arch.module_size_violations(mods) == [
        "worker/observability/long.py: 451 lines (at most 450)"
    ]
