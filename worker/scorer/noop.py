"""A no-op scorer with the executor's interface, for measuring queue capacity without a model.

Selected only explicitly (``serve --scorer noop``); never a default. Its values are deterministic
functions of the tokens (so duplicates and ordering can be checked end to end) and are not model
scores: ``logps[i] = -log(vocab_size) - (token_i % 7) / 100 / temperature`` for each scored token,
``reward = (sum(tokens) % 1000) / 1000`` (``messages``: over the bytes of their contents, ``text``
over its bytes; a
process-reward ``step`` job: ``(token % 10) / 10`` at each step). ``delay_ms`` sleeps per
``score`` call (tests use it to make a batch deterministically slow) and ``us_per_token`` adds that
many microseconds per token of the batch (every token of every sequence), so a batch costs
``delay_ms / 1000 + us_per_token * tokens / 1e6`` seconds: a worker with a fixed per-token cost,
which the autoscaling simulation's check replays traces through
(``worker/devtools/autoscale/check.py``). Implements
``worker.scorer.Scorer``; a call without a mode scores ``reference``, without a temperature 1.0.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from worker.errors import BadRequest, TooLong, UnsupportedMode
from worker.modes import LOGPROB_MODES, MODES, REWARD_MODES, Mode
from worker.request import DEFAULT_OPTIONS, ScoreOptions, ScoreRequest
from worker.scorer.inputs import SequenceInput
from worker.scorer.outputs import BatchMetrics, FallbackEvent, ScoreOutput, SequenceScore
from worker.scorer.plan import DirectScoring, Prepared
from worker.scorer.steps import step_positions
from worker.scorer.teacher import LOGPS_ONLY, TokenOutputs, check_call, gather_rows

if TYPE_CHECKING:
    from worker.scorer import Scorer

__all__ = ["NoopScorer", "ScoreOutput", "SequenceInput", "SequenceScore"]


class NoopScorer(DirectScoring):
    """Scores nothing: returns deterministic values computed from the tokens."""

    def __init__(
        self,
        *,
        vocab_size: int = 32000,
        max_positions: int = 1 << 20,
        delay_ms: float = 0.0,
        us_per_token: float = 0.0,
    ) -> None:
        if delay_ms < 0 or us_per_token < 0:
            raise ValueError(
                f"delay_ms and us_per_token must be >= 0, got {delay_ms}, {us_per_token}"
            )
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.delay_ms = delay_ms
        self.us_per_token = us_per_token
        self._listeners: list[Callable[[FallbackEvent], None]] = []
        #: Every mode (tests may narrow it).
        self.modes: tuple[Mode, ...] = MODES
        #: Empty: no model, nothing to fall back from (tests may stage some).
        self.load_fallbacks: list[FallbackEvent] = []

    @property
    def info(self) -> dict[str, Any]:
        """What a result's ``info`` reports about the scorer."""
        return {
            "model": "noop",
            "reward_model": "noop",
            "dtype": "none",
            "device": "cpu",
            "attention_backend": "none",
            "requested_backend": "none",
            "fallback": None,
            "packing": "none",
            "modes": list(self.modes),
        }

    def resident(self) -> dict[str, Any]:
        """Nothing: the noop scorer holds no per-job weights."""
        return {}

    def add_fallback_listener(self, callback: Callable[[FallbackEvent], None]) -> None:
        """Accepted for interface parity; the noop scorer never falls back."""
        self._listeners.append(callback)

    def prepare(self, request: ScoreRequest) -> Prepared:
        """Check ``request`` like the executor does (``UnsupportedMode`` / ``BadRequest`` /
        ``TooLong``); nothing to plan or tokenise (``messages`` and ``text`` are scored from their
        bytes)."""
        mode: Mode = "reference" if request.mode is None else request.mode
        temperature = 1.0 if request.temperature is None else request.temperature
        if mode not in self.modes:
            raise UnsupportedMode(f"mode {mode!r} not served (serving {self.modes})")
        options = request.options
        check_call(options.outputs, mode, self.vocab_size)  # teacher outputs
        for i, s in enumerate(request.seqs):
            tokens = np.asarray(s.tokens)
            if len(tokens) > self.max_positions:
                raise TooLong(f"seqs[{i}] has {len(tokens)} tokens > {self.max_positions}")
            if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
                raise BadRequest(f"seqs[{i}] has token ids outside [0, {self.vocab_size})")
            if options.step is not None and s.messages is None and s.text is None:
                options.step.check(self.vocab_size)
                try:
                    step_positions(tokens, s.step_positions, options.step)
                except BadRequest as exc:
                    raise BadRequest(f"seqs[{i}]: {exc.message}") from None
        return Prepared(request, mode, temperature)

    def run(self, batch: Sequence[Prepared]) -> ScoreOutput:
        """The pseudo-scores of the batch's sequences (``score`` over them, in order)."""
        mode, temperature, options = batch[0].key
        seqs = [s for p in batch for s in p.inputs]
        return self.score(seqs, mode=mode, temperature=temperature, options=options)

    def score(
        self,
        seqs: Sequence[SequenceInput],
        *,
        mode: Mode | None = None,
        temperature: float | None = None,
        options: ScoreOptions = DEFAULT_OPTIONS,
    ) -> ScoreOutput:
        """Deterministic pseudo-scores (see the module docstring), without checks (``prepare``
        checks); a subclass may override it to watch or break what the daemon runs."""
        mode = "reference" if mode is None else mode
        temperature = 1.0 if temperature is None else temperature
        start = time.perf_counter()
        cost_s = self.delay_ms / 1000.0
        if self.us_per_token > 0:
            cost_s += self.us_per_token * sum(len(s.tokens) for s in seqs) / 1e6
        if cost_s > 0:
            time.sleep(cost_s)
        base = -math.log(self.vocab_size)
        out: list[SequenceScore] = []
        real = scored = 0
        for s in seqs:
            tokens = np.asarray(s.tokens, dtype=np.int64)
            real += len(tokens)
            if s.mask is not None:
                sel = np.frombuffer(bytes(s.mask), dtype=np.uint8).astype(bool)
            else:
                sel = np.arange(len(tokens)) >= int(s.prompt_len or 0)
            logps = None
            if mode in LOGPROB_MODES:
                picked = tokens[sel]
                logps = (base - (picked % 7) / 100.0 / temperature).astype(np.float32)
                scored += len(picked)
            score = SequenceScore(logps=logps)
            if mode in REWARD_MODES:
                _noop_reward(score, s, tokens, options)
            out.append(score)
        if options.outputs != LOGPS_ONLY:
            for i, (s, score) in enumerate(zip(seqs, out, strict=True)):
                if score.logps is not None:
                    score.arrays, score.logps = teacher_arrays(
                        score.logps, s.gather_ids, options.outputs, self.vocab_size, i
                    )
        elapsed = time.perf_counter() - start
        metrics = BatchMetrics(
            batch_size=len(seqs),
            real_tokens=real,
            padded_tokens=0,
            scored_tokens=scored,
            elapsed_s=elapsed,
            forward_s=elapsed,
            backend="none",
            requested_backend="none",
            fallbacks=[],
            kv_output_tensors=0,
            kv_output_bytes=0,
            kv_rejected=False,
            peak_allocated_bytes=0,
            peak_reserved_bytes=0,
            device_total_bytes=0,
            oom_splits=0,
            packed=True,
        )
        return ScoreOutput(scores=out, metrics=metrics)


def _noop_reward(
    score: SequenceScore, seq: SequenceInput, tokens: np.ndarray, options: ScoreOptions
) -> None:
    """The reward half: ``(sum(tokens) % 1000) / 1000``; for ``messages`` (the contents) and
    ``text``, the UTF-8 bytes stand in for tokens (``rm_tokens`` = their count); a step job
    scores each step ``(token % 10) / 10``."""
    if seq.messages is not None or seq.text is not None:
        text = seq.text if seq.text is not None else ""
        if seq.messages is not None:
            text = "".join(str(m.get("content", "")) for m in seq.messages if isinstance(m, dict))
        tokens = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64)
        score.rm_tokens = len(tokens)
    if options.step is not None:
        pos = step_positions(tokens, seq.step_positions, options.step)
        score.step_positions = pos.astype(np.int32)
        score.step_scores = ((tokens[pos] % 10) / 10.0).astype(np.float32)
        return
    score.reward = float(int(tokens.sum()) % 1000) / 1000.0


def teacher_arrays(
    logps: np.ndarray, gather_ids: Any, spec: TokenOutputs, vocab: int, index: int = 0
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """Teacher arrays of the right shapes and dtypes from a sequence's no-op ``logps`` ``[n]``:
    ``entropy`` log(V), ``topk_ids`` 0..k-1 with every ``topk_logps`` -log(V) and the tail the
    rest, ``gather_logps`` -log(V), ``processed_logps`` = ``logps``, ``rank`` 1. Returns the arrays
    and the
    ``logps`` to keep (None when not asked for)."""
    n, base = len(logps), -math.log(vocab)
    out: dict[str, np.ndarray] = {}
    if "entropy" in spec.outputs:
        out["entropy"] = np.full(n, -base, np.float32)
    if "topk" in spec.outputs:
        out["topk_ids"] = np.tile(np.arange(spec.topk, dtype=np.int32), (n, 1))
        out["topk_logps"] = np.full((n, spec.topk), base, np.float32)
        tail = math.log1p(-spec.topk / vocab) if spec.topk < vocab else -math.inf
        out["topk_tail_logp"] = np.full(n, tail, np.float32)
    if "gather" in spec.outputs:
        try:
            gather_rows(gather_ids, n, spec, vocab)
        except BadRequest as exc:
            raise BadRequest(f"seqs[{index}]: {exc.message}") from None
        out["gather_logps"] = np.full((n, spec.gather_k), base, np.float32)
    if "processed_logps" in spec.outputs:
        out["processed_logps"] = logps.copy()
    if "rank" in spec.outputs:
        out["rank"] = np.ones(n, np.int32)
    return out, (logps if "logps" in spec.outputs else None)


if TYPE_CHECKING:

    def _implements_scorer(scorer: NoopScorer) -> Scorer:
        """Checked by mypy: ``NoopScorer`` implements the protocol the daemon drives."""
        return scorer
