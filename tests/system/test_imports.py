"""A no-op worker (capacity benchmarks, queue tests) and the producer side never load torch:
starting one costs a fraction of a second, not the seconds of a torch import.

Two checks, both in a fresh interpreter: the no-op path runs and leaves torch out of
``sys.modules``; and every module of a layer that must never import torch (the layer table in
``tests/support/architecture.py``) imports with torch blocked, so the traceback of a failure
names the module that reached for it (the static layer test sees imports; this one sees what
actually runs, package ``__init__`` files included)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import architecture as arch

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys
import worker.client, worker.client.aio, worker.streams.admin
import worker.scorer.noop, worker.daemon, worker.daemon.jobs, worker.commands.serve
from worker.scorer.noop import NoopScorer
from worker.scorer.inputs import SequenceInput
out = NoopScorer().score([SequenceInput([1, 2, 3], prompt_len=1)], mode="reference")
assert out.scores[0].logps is not None
loaded = [m for m in ("torch", "transformers") if m in sys.modules]
assert not loaded, loaded
"""

BLOCKED = """
import importlib, sys

class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is blocked: this module must import without torch")
        return None

sys.meta_path.insert(0, BlockTorch())
for name in {modules!r}:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r})
assert not loaded, loaded
"""


def _run(code: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr


def test_noop_worker_and_producer_modules_do_not_import_torch() -> None:
    _run(CHECK)


def torch_free_modules() -> list[str]:
    """Every ``worker`` module whose layer must never import torch."""
    tree = arch.load_tree(ROOT)
    out = []
    for name in sorted(tree):
        unit = arch.unit_of(name)
        if unit is None:
            continue
        rule = arch.rule_for(unit)
        torch_free = rule.never >= arch.TORCH or (
            rule.third_party_only is not None and not arch.TORCH & rule.third_party_only
        )
        if torch_free:
            out.append(name)
    return out


def test_torch_free_layers_import_with_torch_blocked() -> None:
    modules = torch_free_modules()
    for name in ("worker", "worker.protocol", "worker.client", "worker.aio_client"):
        assert name in modules
    assert "worker.executor" not in modules and "worker.cli" not in modules
    _run(BLOCKED.format(blocked=sorted(arch.TORCH), modules=modules))


def test_the_blocker_catches_a_torch_import() -> None:
    """The check above can fail: importing the executor with torch blocked raises."""
    code = BLOCKED.format(blocked=sorted(arch.TORCH), modules=["worker.executor.core"])
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode != 0
    assert "torch is blocked: this module must import without torch" in proc.stderr
