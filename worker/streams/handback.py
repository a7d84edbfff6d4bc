"""Hand-back: a draining worker gives the entries it read but never started back to its group.

Redis Streams cannot un-deliver an entry, so a hand-back leaves it in the draining consumer's
pending list made to look long idle; the other workers' next reclaim takes it at once instead of
after ``claim_idle_ms``. Their reclaim runs every ``claim_idle_ms / 2``, so the hand-back also
bumps a counter they poll cheaply, and they reclaim as soon as it moves.

* :func:`hand_back` - script :data:`~worker.streams.scripts.HANDBACK` (``XPENDING`` ownership
  check, ``XCLAIM ... IDLE ... RETRYCOUNT ... JUSTID``, ``HINCRBY`` + ``PEXPIRE`` of the
  hand-back hash);
* :func:`handback_marks` - ``HGETALL`` of each stream's hand-back hash (one pipeline);
* :func:`forget_givers` - ``XGROUP DELCONSUMER`` (script ``FORGET``) of each consumer that
  handed entries back and now holds nothing, then ``HDEL`` of its field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.keys import handback_key
from worker.streams.groups import forget_consumer
from worker.streams.reading import as_text
from worker.streams.scripts import HANDBACK

#: The idle time a handed-back entry is given: past any ``claim_idle_ms`` a worker uses (a
#: year, in ms; Redis caps an idle time to the time since the epoch, far above this).
HANDBACK_IDLE_MS = 365 * 24 * 3600 * 1000
#: How long a stream's hand-back hash lives after its last hand-back (a day, in ms).
HANDBACK_TTL_MS = 24 * 3600 * 1000


def hand_back(
    client: Any, stream: str, group: str, consumer: str, entry_ids: Sequence[str]
) -> list[str]:
    """Make ``entry_ids`` (read by ``consumer``, never started) claimable by another consumer at
    once, without counting the delivery that never ran; entries another consumer took over are
    left alone. Returns the ids handed back."""
    if not entry_ids:
        return []
    reply = client.eval(
        HANDBACK, 2, stream, handback_key(stream), group, consumer, HANDBACK_IDLE_MS,
        HANDBACK_TTL_MS, *entry_ids,
    )  # fmt: skip
    return [as_text(i) for i in reply or []]


def handback_marks(client: Any, streams: Sequence[str]) -> dict[str, dict[str, int]]:
    """Per stream, each giver consumer's hand-back counter (empty when none handed back)."""
    pipe = client.pipeline(transaction=False)
    for stream in streams:
        pipe.hgetall(handback_key(stream))
    out: dict[str, dict[str, int]] = {}
    for stream, raw in zip(streams, pipe.execute(), strict=True):
        out[stream] = {as_text(k): int(v) for k, v in (raw or {}).items()}
    return out


def forget_givers(client: Any, stream: str, group: str, givers: Sequence[str]) -> list[str]:
    """Delete from ``group`` each giver consumer that holds nothing any more (its handed-back
    entries were claimed and its last batch answered) and drop it from the hand-back hash, so
    drained pods do not pile up as consumers. Returns the consumers deleted."""
    gone = []
    for giver in givers:
        if forget_consumer(client, stream, group, giver):
            client.hdel(handback_key(stream), giver)
            gone.append(giver)
    return gone


__all__ = ["HANDBACK_IDLE_MS", "forget_givers", "hand_back", "handback_marks"]
