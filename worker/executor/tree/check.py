"""The load check of prefix sharing: does a tree row give what its sequences give alone, here?

``sharing_check`` runs once at load on the real device, backend and dtype: a refusal first for
what cannot be exact (``attention.refusal``: linear-attention layers, ALiBi, attention outside
``AttentionInterface``; a forward that is not a ``BatchForward``), then three probe sequences
sharing a prefix (two of them a second level) go through one tree forward and through one
forward each (``BatchForward.compute``, masked padded layout), in the served mode. Log-probs
(and rewards, step scores) that disagree beyond the tolerance turn sharing off with the reason.
Under tensor parallelism every rank runs the check in step (its forwards vote, its head gathers
the whole vocabulary), so every rank decides alike. Naive equivalent: the sequences alone, which
is what it compares with.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from worker.executor.forward import BatchForward
from worker.executor.rewards.steps import head_kind
from worker.executor.tree.attention import refusal
from worker.executor.tree.trie import Node, SharedGroup
from worker.modes import LOGPROB_MODES, REWARD_MODES, Mode
from worker.request import DEFAULT_OPTIONS, ScoreOptions, StepOptions
from worker.scorer.inputs import PreparedSequence

_PREFIX = 7  # ids all probe sequences share (the root)
_TURN = 4  # ids the first two share after it (a second level, as agent turns)
_CONTINUATIONS = (3, 5, 1)


def probe_tree(vocab: int) -> list[PreparedSequence]:
    """Three deterministic sequences of ids in ``[0, vocab)`` sharing their first ``_PREFIX``
    ids, the first two also the next ``_TURN``; every position after the first scored."""
    prefix = (np.arange(_PREFIX + _TURN) * 7919 + 3) % vocab
    seqs = []
    for k, n in enumerate(_CONTINUATIONS):
        shared = prefix if k < 2 else prefix[:_PREFIX]
        ids = np.concatenate([shared, (np.arange(n) * 104729 + 31 * n + 5) % vocab])
        seqs.append(PreparedSequence(ids=ids, scored=np.arange(1, len(ids), dtype=np.int64)))
    return seqs


def probe_rows() -> list[SharedGroup]:
    """The probe's tree: the root (``_PREFIX`` ids), a node below it for the first two
    sequences (``_TURN`` ids), the third attached to the root."""
    nodes = (Node(0, _PREFIX, -1), Node(_PREFIX, _PREFIX + _TURN, 0))
    return [SharedGroup(nodes, (0, 1, 2), (1, 1, 0))]


def configured_window(model: torch.nn.Module) -> int | None:
    """The sliding window ``model``'s config applies to some layers (``None``: none). A window
    longer than the probe is invisible in its numbers: the check asks that the attention
    function was told it."""
    config: Any = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    kinds = getattr(config, "layer_types", None)
    return int(window) if kinds is None or "sliding_attention" in kinds else None


def probe_step(forward: BatchForward, mode: Mode) -> StepOptions | None:
    """The step map the probe scores with when the reward model is read as a process-reward
    head (its tree forward runs only for step scores), else ``None``."""
    if mode not in REWARD_MODES or forward.reward_model is None:
        return None
    kind = head_kind(forward.reward_model, forward.reward_adapter)
    if kind == "token-classification":
        return StepOptions()
    if kind == "lm-label":
        return StepOptions(label_token_ids=(0, 1))
    return None


def kernel_for(backend: str) -> str:
    """The math the tree attention runs on ``backend``: eager math for ``eager``, a flex
    ``BlockMask`` for ``flex_attention``, else SDPA."""
    if backend == "eager":
        return "eager"
    return "flex" if backend == "flex_attention" else "sdpa"


def sharing_check(forward: BatchForward, *, modes: tuple[Mode, ...], backend: str) -> str | None:
    """``None`` when tree rows may run on ``forward`` (module docstring), else why not."""
    if forward.config.prefix_sharing == "off":
        return "disabled (prefix_sharing=off)"
    if not isinstance(forward, BatchForward):
        return f"{type(forward).__name__} is not checked for tree rows"
    for model in forward.models:
        reason = refusal(model)
        if reason is not None:
            return reason
    seqs = probe_tree(forward.vocab_size)
    mode: Mode = "both" if "both" in modes else modes[0]
    options = DEFAULT_OPTIONS
    step = probe_step(forward, mode)
    if step is not None:  # a process-reward head: step scores at every position
        seqs = [replace(s, steps=np.arange(len(s.ids), dtype=np.int64)) for s in seqs]
        options = ScoreOptions(step=step)
    group = list(range(len(seqs)))
    row = probe_rows()
    windows: list[int | None] = []
    try:
        tree = forward.compute_tree(
            seqs, group, row, mode, 1.0, kernel=kernel_for(backend), options=options,
            windows=windows,
        )  # fmt: skip
    except Exception as exc:  # any failure of the tree path: serve per sequence
        return f"tree forward failed: {type(exc).__name__}: {exc}"[:300]
    if not windows:
        return "no attention layer read the tree layout"
    for model in forward.models:
        window = configured_window(model)
        if window is not None and window not in windows:
            return f"sliding window {window} is not passed to the attention function"
    row_tokens = forward.config.row_tokens(backend)
    dtype = next(forward.models[0].parameters()).dtype
    tol = 1e-4 if dtype == torch.float32 else 0.25
    for i, seq in enumerate(seqs):
        alone = forward.compute(
            [seq], [i], mode, 1.0, layout="padded", row_tokens=row_tokens, options=options
        )
        want, got = alone.scores[0], tree.scores[i]
        if want.step_scores is not None:
            assert got.step_scores is not None
            diff = float(np.abs(want.step_scores - got.step_scores).max())
            if not diff <= tol * 10:
                return f"tree step scores differ from per-sequence by {diff:.3g}"
        if mode in LOGPROB_MODES:
            assert want.logps is not None and got.logps is not None
            diff = float(np.abs(want.logps - got.logps).max())
            if not diff <= tol:
                return f"tree log-probs differ from per-sequence by {diff:.3g} (tolerance {tol})"
        if want.reward is not None:
            got_reward = np.nan if got.reward is None else float(got.reward)
            diff = abs(float(want.reward) - got_reward)
            if not diff <= tol * 10:
                return f"tree rewards differ from per-sequence by {diff:.3g}"
    return None
