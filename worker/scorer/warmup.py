"""The warm-up before ready: one forward at the token budget, so the first real batch does not
pay for the device allocator's growth, kernel selection and lazy initialisation.

``serve --warmup`` (on by default on CUDA, off on CPU) calls :func:`run_warmup` after the model
loaded and before the worker turns ready: :func:`warmup_inputs` fills ``max_batch_tokens`` with
sequences as long as the model accepts, every position after the first scored (the LM head's
largest case), and the scorer scores them once in its widest mode; the result is dropped.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from worker.modes import Mode
from worker.request import ScoreRequest, SequenceInput
from worker.scorer import Scorer

log = logging.getLogger(__name__)


def warmup_inputs(
    max_batch_tokens: int, *, vocab_size: int, max_positions: int | None, mode: Mode
) -> list[SequenceInput]:
    """Sequences filling ``max_batch_tokens``, each at most ``max_positions`` long, with
    deterministic ids in ``[0, vocab_size)``; scored from position 1 unless ``mode`` is
    ``reward`` (which takes no prompt length)."""
    longest = min(max_batch_tokens, max_positions or max_batch_tokens)
    lengths = [longest] * (max_batch_tokens // longest)
    if max_batch_tokens % longest >= 2:
        lengths.append(max_batch_tokens % longest)
    out = []
    for i, n in enumerate(lengths):
        ids = (np.arange(n, dtype=np.int64) * 7919 + 31 * i + 3) % vocab_size
        out.append(SequenceInput(ids, prompt_len=None if mode == "reward" else 1))
    return out


def run_warmup(scorer: Scorer, *, max_batch_tokens: int) -> float:
    """Score one batch of ``max_batch_tokens`` in the scorer's widest mode (``both`` when it
    serves it), results dropped; the seconds it took. A failure is logged, not raised."""
    modes = scorer.modes
    mode: Mode = "both" if "both" in modes else modes[0]
    seqs = warmup_inputs(
        max_batch_tokens,
        vocab_size=int(getattr(scorer, "vocab_size", 32000)),
        max_positions=getattr(scorer, "max_positions", None),
        mode=mode,
    )
    started = time.perf_counter()
    try:
        scorer.run([scorer.prepare(ScoreRequest(tuple(seqs), mode, 1.0))])
    except Exception as exc:  # an optimisation only: the worker serves without it
        log.warning("warm-up forward failed (%s: %s); serving without it",
                    type(exc).__name__, exc)  # fmt: skip
        return time.perf_counter() - started
    seconds = time.perf_counter() - started
    log.info("warm-up: one %s forward of %d tokens (%d sequences) in %.3f s", mode,
             sum(len(s.tokens) for s in seqs), len(seqs), seconds)  # fmt: skip
    return seconds


__all__ = ["run_warmup", "warmup_inputs"]
