"""``scoring-worker demo`` end to end (what ``make demo`` runs): embedded Valkey, a real worker
subprocess, the sample rollouts through the client, a table of scores, clean shutdown."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.daemon import start_demo
from worker.commands.demo import packaged_gguf
from worker.demo.samples import SAMPLES

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.redis]


def _rows(out: str) -> dict[tuple[str, str], list[str]]:
    """Table rows keyed by (prompt, completion) -> the remaining cells."""
    rows = {}
    for prompt, completions in SAMPLES:
        shown = repr(prompt)[1:-1][:36]
        for c in completions:
            line = next(
                (x for x in out.splitlines() if x.startswith(shown) and repr(c)[1:-1] in x), None
            )
            assert line is not None, f"no row for {prompt!r} {c!r} in:\n{out}"
            rows[(prompt, c)] = line
    return rows


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(600)
def test_demo_default_runs_to_completion() -> None:
    """The default (the packaged SmolLM2 GGUF when installed) with an embedded Valkey."""
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "demo", "--non-interactive"],
        capture_output=True,
        text=True,
        timeout=580,
        cwd=ROOT,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "embedded Valkey at redis://127.0.0.1:" in out
    rows = _rows(out)
    assert len(rows) == sum(len(c) for _, c in SAMPLES)
    assert re.search(r"metrics:\s+http://127\.0\.0\.1:\d+/metrics", out)
    assert "scoring_sequences_total" in out
    assert "worker stopped (exit 0)" in proc.stderr
    pid = int(re.search(r"worker: pid (\d+)", out).group(1))
    assert _gone(pid)
    if packaged_gguf() is not None:  # a real model: it knows where Paris is
        assert "SmolLM2-135M" in out
        assert " Paris. *" in rows[("The capital of France is", " Paris.")]
        assert " Berlin. *" not in rows[("The capital of France is", " Berlin.")]


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("cleanup_keys")
def test_demo_tiny_model_external_redis_stops_on_ctrl_c(redis_url: str, key_prefix: str) -> None:
    """``--model tiny`` against the machine's Redis, interactive, stopped with SIGINT. The demo
    starts with SIGINT ignored, as a background job of a non-interactive shell (or ``nohup``,
    or some CI runners) starts its children: Python keeps an inherited SIG_IGN, so the demo
    must install its own handler or this SIGINT is lost and the demo runs on."""
    proc, out = start_demo(
        ["--model", "tiny", "--redis-url", redis_url, "--queue", key_prefix],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert "scores are meaningless" in out
    assert len(_rows(out)) == sum(len(c) for _, c in SAMPLES)
    proc.send_signal(signal.SIGINT)
    try:
        _rest, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.terminate()  # it ignored SIGINT: stop it (and its worker) before failing
        proc.communicate(timeout=60)
        raise
    assert proc.returncode == 0, err
    assert "worker stopped (exit 0)" in err
    pid = int(re.search(r"worker: pid (\d+)", out).group(1))
    assert _gone(pid)


def test_demo_once_does_not_point_at_a_server_it_stopped(redis_url: str) -> None:
    """``--once`` with the embedded server: no ``info`` command for a server that is gone."""
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "demo", "--model", "tiny", "--non-interactive"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "scoring-worker info" not in proc.stdout
    assert "press Ctrl-C" not in proc.stdout


def test_save_models_writes_checkpoints_a_worker_serves(tmp_path: Path) -> None:
    """``demo --save-models DIR``: two checkpoints with a tokenizer and a chat template."""
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "demo", "--save-models", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"--reference-model {tmp_path / 'tiny-llama'}" in proc.stdout
    from transformers import AutoConfig, AutoTokenizer

    for name, arch in (
        ("tiny-llama", "LlamaForCausalLM"),
        ("tiny-reward", "LlamaForSequenceClassification"),
    ):
        assert AutoConfig.from_pretrained(tmp_path / name).architectures == [arch]
        tok = AutoTokenizer.from_pretrained(tmp_path / name)
        assert tok("A", add_special_tokens=False)["input_ids"] == [ord("A") + 3]
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        assert text == "<s>user\nhi</s>\n"
