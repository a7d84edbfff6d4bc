"""A no-op worker (capacity benchmarks, queue tests) and the producer side never load torch:
starting one costs a fraction of a second, not the seconds of a torch import."""

from __future__ import annotations

import subprocess
import sys

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


def test_noop_worker_and_producer_modules_do_not_import_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
