"""The load-time probe: does the fast path reproduce the model, and do unmasked buckets and
packed rows isolate their sequences on this backend?

First the quick probe (``_quick_check``, reference mode): the reference model's own logits of
three short sequences in one masked forward, and the layouts that may run (the unmasked bucket,
the packed row) compared with them directly: two or three forwards in all. Only when one of them
disagrees (or a reward is served) does the full probe run, which says what differs: three short
sequences go through ``BatchForward.compute`` one by one and are compared with the
reference model's own logits (``naive_token_logps``): a mismatch means a logit post-processing
the executor does not reproduce, a ``ConfigError``. Then the three go together into one unmasked
bucket (right pads, no attention mask) and packed into one row, each compared with the
one-by-one results: a mismatch turns that layout off (a load ``FallbackEvent`` naming the layout
that runs instead), or is a ``ConfigError`` when that layout was asked for (``packing``). The
probe runs outside any KV scope, so a model that leaks a cache still loads; rejection happens on
the first real batch.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.errors import ConfigError
from worker.executor import backends
from worker.executor.config import Layout
from worker.executor.forward import BatchForward
from worker.executor.head.logprobs import naive_token_logps
from worker.modes import Mode
from worker.scorer.inputs import PreparedSequence
from worker.scorer.outputs import FallbackEvent, SequenceScore

_LENGTHS = (5, 9, 3)


def probe_sequences(vocab: int) -> list[PreparedSequence]:
    """Three deterministic sequences of ids in ``[0, vocab)``, every position after the first
    scored."""
    return [
        PreparedSequence(ids=ids, scored=np.arange(1, len(ids), dtype=np.int64))
        for ids in ((np.arange(n) * 7919 + 17 * n + 3) % vocab for n in _LENGTHS)
    ]


def allowed_layouts(
    forward: BatchForward, *, modes: tuple[Mode, ...], backend: str
) -> tuple[bool, bool, list[FallbackEvent]]:
    """Whether packed rows and unmasked buckets may run, and the load fallbacks taken:
    ``forward.config.packing`` asks, the probe (``self_check``, when enabled) confirms."""
    packing = forward.config.packing
    if forward.config.self_check:
        return self_check(forward, modes=modes, backend=backend, packing=packing)
    return packing in ("auto", "packed"), packing in ("auto", "unmasked"), []


def self_check(
    forward: BatchForward,
    *,
    modes: tuple[Mode, ...],
    backend: str,
    packing: str,
) -> tuple[bool, bool, list[FallbackEvent]]:
    """Run the probe (module docstring). Returns whether packed rows and unmasked buckets may run
    and the load fallbacks taken (a layout turned off); raises ``ConfigError`` when the model
    cannot be served as asked."""
    model = forward.models[0]
    seqs = probe_sequences(forward.vocab_size)
    mode: Mode = "both" if "both" in modes else modes[0]
    row = forward.config.row_tokens(backend)
    tol = 1e-3 if next(model.parameters()).dtype == torch.float32 else 0.25
    quick = _quick_check(
        forward, seqs, mode=mode, backend=backend, packing=packing, row=row, tol=tol
    )
    if quick is not None:
        return quick
    alone = [
        forward.compute([s], [0], mode, 1.0, layout="unmasked", row_tokens=row).scores[0]
        for s in seqs
    ]
    if forward.reference_model is not None:
        _check_logits(forward, seqs, alone, tol)
    allowed = {"packed": packing in ("auto", "packed"), "unmasked": packing in ("auto", "unmasked")}
    events: list[FallbackEvent] = []

    def refuse(layout: Layout, reason: str, message: str) -> None:
        """``layout`` failed: ``ConfigError`` when it was required, else turn it off and record
        a fallback naming the layout that runs instead."""
        if packing == layout:
            raise ConfigError(f"packing={layout!r} requested but {message}")
        allowed[layout] = False
        used = backends.layout_for(backend, packed=allowed["packed"], unmasked=allowed["unmasked"])
        events.append(FallbackEvent(layout, used, reason, message, "load"))

    group = list(range(len(seqs)))
    if allowed["unmasked"]:
        bucket = forward.compute(seqs, group, mode, 1.0, layout="unmasked", row_tokens=row).scores
        if not all(_close(a, b, tol) for a, b in zip(alone, bucket, strict=True)):
            refuse(
                "unmasked",
                "no_unmasked",
                "right pads without a mask change the scores (attention not causal)",
            )
    if allowed["packed"]:
        if backend in backends.PACKABLE:
            rows = forward.compute(seqs, group, mode, 1.0, layout="packed", row_tokens=row).scores
            if not all(_close(a, b, tol) for a, b in zip(alone, rows, strict=True)):
                refuse("packed", "no_packing", "packed rows disagree with one-by-one forwards")
        else:
            refuse(
                "packed",
                "no_packing",
                f"backend {backend} is not known to isolate packed sequences",
            )
    return allowed["packed"], allowed["unmasked"], events


def _quick_check(
    forward: BatchForward,
    seqs: list[PreparedSequence],
    *,
    mode: Mode,
    backend: str,
    packing: str,
    row: int,
    tol: float,
) -> tuple[bool, bool, list[FallbackEvent]] | None:
    """The probe in two or three forwards, where every layout agrees with the model's own
    logits: ``(packed, unmasked, [])``; ``None`` (run the full probe, which says what differs)
    on any disagreement, and for modes with a reward (pooling has no reference to compare to).

    The reference model's own logits of the three sequences come from one right-padded forward
    with an attention mask; the unmasked bucket and the packed row (each when allowed; a padded
    batch when neither is) are compared with them directly. The full probe adds the three
    one-by-one forwards and three one-by-one reference forwards (eight in all), needed only to
    tell which part disagrees."""
    if mode != "reference" or forward.reference_model is None:
        return None
    want = _reference_logps(forward, seqs)
    group = list(range(len(seqs)))
    unmasked = packing in ("auto", "unmasked")
    packed = packing in ("auto", "packed") and backend in backends.PACKABLE
    if packing in ("auto", "packed") and not packed:
        return None  # the full probe records why packing is off
    candidates: tuple[tuple[Layout, bool], ...] = (("unmasked", unmasked), ("packed", packed))
    layouts: list[Layout] = [name for name, on in candidates if on]
    for layout in layouts or ["padded"]:
        got = forward.compute(seqs, group, mode, 1.0, layout=layout, row_tokens=row).scores
        for score, w in zip(got, want, strict=True):
            if score.logps is None or not np.allclose(score.logps, w, atol=tol, rtol=0):
                return None
    return packed, unmasked, []


def _reference_logps(forward: BatchForward, seqs: list[PreparedSequence]) -> list[np.ndarray]:
    """The reference model's own log-probs of ``seqs`` (``naive_token_logps``), in one
    right-padded forward with an attention mask."""
    model = forward.reference_model
    longest = max(len(s.ids) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s.ids)] = torch.from_numpy(s.ids)
        mask[i, : len(s.ids)] = 1
    ids, mask = ids.to(forward.device), mask.to(forward.device)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [B, L, V]
    out = []
    for i, s in enumerate(seqs):
        n = len(s.ids)
        out.append(naive_token_logps(logits[i, : n - 1], ids[i, 1:n]).float().cpu().numpy())
    return out


def _check_logits(
    forward: BatchForward, seqs: list[PreparedSequence], got: list[SequenceScore], tol: float
) -> None:
    """The fast path's log-probs against the reference model's own logits, per sequence."""
    model = forward.reference_model
    for s, score in zip(seqs, got, strict=True):
        ids = torch.from_numpy(s.ids)[None].to(forward.device)
        with torch.inference_mode():
            logits = model(input_ids=ids, use_cache=False).logits[0]
        want = naive_token_logps(logits[:-1], ids[0, 1:]).cpu().numpy()
        assert score.logps is not None
        if not np.allclose(score.logps, want, atol=tol, rtol=0):
            raise ConfigError(
                f"{type(model).__name__}: backbone + LM head does not reproduce the model's own "
                "logits (unsupported logit post-processing); "
                f"max |diff| {np.abs(score.logps - want).max():.3g}"
            )


def _close(a: SequenceScore, b: SequenceScore, tol: float) -> bool:
    """Same log-probs within ``tol`` and same reward within ``10 * tol``."""
    if (
        a.logps is not None
        and b.logps is not None
        and not np.allclose(a.logps, b.logps, atol=tol, rtol=0)
    ):
        return False
    both = a.reward is not None and b.reward is not None
    return not (both and abs(a.reward - b.reward) > tol * 10)  # type: ignore[operator]
