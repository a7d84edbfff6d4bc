"""The docs run: every ``python`` and ``bash`` block of README.md and docs/*.md is executed, in
order, against a real worker (Sybil parses the Markdown; the blocks of one page share one
namespace, so a page reads like one script).

The world the pages assume, set up here once:

* a folder holding ``./models/tiny-llama`` and ``./models/tiny-reward``, as written by
  ``scoring-worker demo --save-models ./models``, and ``./docs`` (this repository's, so
  ``python docs/examples/distill.py`` runs as from a clone) is the working directory of every
  block;
* ``redis://127.0.0.1:6379/0`` in a block means this run's Redis (the machine's server on a
  database of its own, or the embedded one), and ``127.0.0.1:9400`` the worker's metrics port;
* a worker serves queue ``default`` with both tiny models, as
  ``scoring-worker serve --reference-model ./models/tiny-llama --reward-model ./models/tiny-reward``
  would, and a gateway in front of it answers at ``localhost:8000`` (replaced by its port) with
  the key in ``SCORING_GATEWAY_API_KEY``.

A block that cannot run here is preceded by ``<!-- skip: next "why" -->`` (the reason is
required: ``test_every_skip_says_why``). ``bash`` (and ``sh``) blocks run with
``bash -euo pipefail``, the venv's ``scoring-worker`` and ``python`` first on ``PATH``,
``SCORING_REDIS_URL`` set to this run's Redis (a command that relies on the default URL means it
too) and ``SCORING_METRICS_PORT=0`` (a worker a block starts takes a free port, never the
docs' worker's). A command a reader types is never in a block that does not run: not after
``$ `` in a ``console``, ``text`` or untagged block, nor as the first line of an untagged one.

Two runs at once (two worktrees, one machine) never share a database: each takes the first of
``DOC_DBS`` whose lock it can set.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import SkipTest

import pytest
import redis
from sybil import Example, Sybil
from sybil.parsers.markdown import CodeBlockParser, SkipParser

from tests.support.daemon import WorkerProc
from worker.demo.tiny import save_tiny_models
from worker.processes.local import free_port

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
DOC_URL = "redis://127.0.0.1:6379/0"
DOC_METRICS = "127.0.0.1:9400"
DOC_GATEWAYS = ("localhost:8000", "127.0.0.1:8000")
"""How the pages address the gateway (``scoring-worker gateway --port 8000``)."""
DOC_GATEWAY_KEY = "tml-doc-gateway-key"  # the Tinker SDK sends only tml- keys
DOC_DBS = (14, 15, 13)
"""Databases of the machine's Redis the doc blocks may use: a run takes the first one whose lock
it sets, and flushes it before and after."""
DOC_LOCK = "scoring-docs:lock"
SHELL_LANGUAGES = ("bash", "sh")
COMMAND_WORDS = (
    "scoring-worker", "python", "pip", "make", "redis-cli", "redis-server", "docker", "kubectl",
    "curl", "helm",
)  # fmt: skip
"""How a shell command starts: such a first line in an untagged block is a command to type."""

pytestmark = [pytest.mark.slow, pytest.mark.redis]


@dataclass
class DocWorld:
    """Where the blocks run: the working directory, the URL and metrics port they mean."""

    workdir: Path
    redis_url: str
    metrics: str
    env: dict[str, str]
    gateway: str = ""

    def substitute(self, source: str) -> str:
        """A block's source with the documented addresses replaced by this run's."""
        out = source.replace(DOC_URL, self.redis_url).replace(DOC_METRICS, self.metrics)
        for address in DOC_GATEWAYS:
            out = out.replace(address, self.gateway)
        return out


WORLD: DocWorld | None = None


def _run_python(example: Example) -> None:
    assert WORLD is not None
    # as sybil's own evaluator pads: a traceback names the block's lines of the page
    source = "\n" * (example.line + example.parsed.line_offset) + WORLD.substitute(example.parsed)
    code = compile(source, str(example.path), "exec")
    exec(code, example.namespace)


def _run_bash(example: Example) -> None:
    assert WORLD is not None
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", WORLD.substitute(example.parsed)],
        cwd=WORLD.workdir,
        env=WORLD.env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{example.path}:{example.line}: bash exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
        )


SYBIL = Sybil(
    parsers=[
        CodeBlockParser(language="python", evaluator=_run_python),
        *(CodeBlockParser(language=lang, evaluator=_run_bash) for lang in SHELL_LANGUAGES),
        SkipParser(),
    ],
    path=str(ROOT),
)


def _claim_doc_redis_url(base: str, token: str) -> str:
    """The test server's URL on a database of the doc blocks' own, locked for this run (the lock
    expires after an hour should a run die without releasing it)."""
    root = re.sub(r"/\d+$", "", base.rstrip("/"))
    for db in DOC_DBS:
        url = f"{root}/{db}"
        server = redis.Redis.from_url(url)
        if server.set(DOC_LOCK, token, nx=True, ex=3600):
            for key in server.scan_iter(count=1000):
                if key != DOC_LOCK.encode():
                    server.delete(key)
            return url
    raise AssertionError(f"databases {DOC_DBS} of {root} are all taken by other doc runs")


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60) -> None:
    """Wait until ``url`` answers 200 (fails early, with the log, if ``proc`` exits)."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the gateway exited ({proc.returncode}):\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer within {timeout_s:.0f} s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def world(machine_redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocWorld]:
    """The tiny models, a clean database and a worker serving both models on ``default``."""
    global WORLD
    workdir = tmp_path_factory.mktemp("docs")
    save_tiny_models(workdir / "models")
    # the worker loads a copy: a block that writes ./models again (``demo --save-models``) must
    # not rewrite files the worker may have memory-mapped
    served = shutil.copytree(workdir / "models", tmp_path_factory.mktemp("served") / "models")
    (workdir / "docs").symlink_to(ROOT / "docs", target_is_directory=True)
    url = _claim_doc_redis_url(machine_redis_url, f"{os.getpid()}-{workdir.name}")
    port = free_port()
    bin_dir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCORING_")}
    env.update(
        PATH=f"{bin_dir}:{env.get('PATH', '')}",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        SCORING_REDIS_URL=url,
        SCORING_METRICS_PORT="0",
    )
    worker = WorkerProc(
        ["--redis-url", url, "--metrics-port", str(port), "--block-ms", "200",
         "--reference-model", str(served / "tiny-llama"),
         "--reward-model", str(served / "tiny-reward")],
        workdir / "worker.log",
    )  # fmt: skip
    gateway_port = free_port()
    env["SCORING_GATEWAY_API_KEY"] = DOC_GATEWAY_KEY
    gateway_log = open(workdir / "gateway.log", "wb")  # noqa: SIM115 - closed below
    gateway = subprocess.Popen(
        [sys.executable, "-m", "worker", "gateway", "--redis-url", url, "--queue", "default",
         "--port", str(gateway_port)],
        env=env, stdout=gateway_log, stderr=subprocess.STDOUT, cwd=workdir,
    )  # fmt: skip
    WORLD = DocWorld(workdir, url, f"127.0.0.1:{port}", env, f"127.0.0.1:{gateway_port}")
    try:
        worker.wait_ready(120)
        _wait_http(f"http://127.0.0.1:{gateway_port}/health", gateway, workdir / "gateway.log")
        yield WORLD
    finally:
        WORLD = None
        gateway.terminate()
        gateway.wait(30)
        gateway_log.close()
        worker.signal(15)
        try:
            worker.wait_exit(30)
        finally:
            worker.stop()
        redis.Redis.from_url(url).flushdb()


@pytest.mark.parametrize("page", PAGES)
def test_the_page_runs(page: str, world: DocWorld, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block of ``page`` runs, in order; skipped blocks say why."""
    monkeypatch.chdir(world.workdir)
    document = SYBIL.parse(ROOT / page)
    for example in document.examples():
        try:
            example.evaluate()
        except SkipTest:
            continue
    client = document.namespace.get("client")
    if hasattr(client, "close"):
        client.close()


def _fences(text: str) -> Iterator[tuple[int, str, str, list[str]]]:
    """``(line, language, the line just before the fence, the block's lines)`` of each block."""
    lines = text.splitlines()
    start: int | None = None
    for i, line in enumerate(lines):
        if not line.startswith("```"):
            continue
        if start is None:
            start = i
            continue
        before = next((x for x in reversed(lines[:start]) if x.strip()), "")
        yield start + 1, lines[start][3:].strip(), before, lines[start + 1 : i]
        start = None


@pytest.mark.parametrize("page", PAGES)
def test_every_skip_says_why_and_commands_are_bash(page: str) -> None:
    """A skipped block gives its reason (``<!-- skip: next "why" -->``); a command to type
    (``$ ...``) stands in a ``bash`` block that runs, never in an untagged or ``text`` one."""
    text = (ROOT / page).read_text()
    for line, lang, before, body in _fences(text):
        if "skip:" in before:
            assert re.fullmatch(r'<!-- skip: next "[^"]{8,}" -->', before.strip()), (
                f"{page}:{line}: a skip needs a reason: {before!r}"
            )
        if lang in ("python", *SHELL_LANGUAGES):
            continue
        typed = [x for x in body if x.startswith("$ ")]
        assert not typed, f"{page}:{line}: commands in a {lang or 'plain'} block: {typed}"
        first = next((x.strip() for x in body if x.strip()), "")
        if not lang and first.split(" ", 1)[0] in COMMAND_WORDS:
            raise AssertionError(
                f"{page}:{line}: a command in an untagged block (make it bash): {first!r}"
            )
    assert "skip: start" not in text, f"{page}: skip blocks one by one, each with its reason"
