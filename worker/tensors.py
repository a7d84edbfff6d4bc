"""A result's ``hidden`` rows as torch tensors, in the dtype the job asked for
(docs/distillation.md, *Hidden states*).

The client never imports torch (its layer rule); this module does, when called, and nothing
else of the worker side: ``hidden_tensor(seq)`` gives one ``SeqScore``'s rows ``[n, H]`` as a
tensor of its ``hidden_dtype``, bfloat16 rows bit for bit as they travelled (from
``SeqScore.hidden_bits``), float16 and float32 rows as they came. ``hidden_tensors(result)``
does it for every sequence of a ``ScoreResult``. Without torch both raise ``ImportError``
saying so; the numpy rows (``SeqScore.hidden``) need no torch.

Importing this module loads neither torch nor numpy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.client.results import SeqScore

__all__ = ["hidden_tensor", "hidden_tensors"]

_NUMPY_DTYPES = ("float32", "float16")
"""The ``hidden_dtype`` s numpy has (bfloat16 rows travel as uint16 bits)."""


def _torch() -> Any:
    """The torch module, or ``ImportError`` naming what to do without it."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            "worker.tensors needs torch (pip install torch); without it, SeqScore.hidden holds "
            "the rows as numpy (bfloat16 as its exact float32 upcast, its bits in hidden_bits)"
        ) from exc
    return torch


def hidden_tensor(seq: SeqScore, device: Any = None) -> Any:
    """``seq``'s hidden rows ``[n, H]`` as a torch tensor of ``seq.hidden_dtype`` (bfloat16:
    the bits that travelled), on ``device`` (default: the CPU). ``ValueError`` when ``seq``
    carries no hidden rows (the job did not ask ``outputs=(..., "hidden")``)."""
    if seq.hidden is None or seq.hidden_dtype is None:
        raise ValueError("this sequence carries no hidden rows: ask outputs=(..., 'hidden')")
    torch = _torch()
    import numpy as np

    if seq.hidden_dtype == "bfloat16":
        bits = np.asarray(seq.hidden_bits)
        if bits.dtype != np.uint16 or bits.ndim != 2:
            raise ValueError("bfloat16 rows need their bits as uint16 [n, H] (hidden_bits)")
        owned = np.array(bits, dtype=np.uint16, copy=True)  # writable, native order
        rows = torch.from_numpy(owned.view(np.int16)).view(torch.bfloat16)  # the same bits
    elif seq.hidden_dtype in _NUMPY_DTYPES:
        rows = torch.from_numpy(np.array(seq.hidden, dtype=seq.hidden_dtype, copy=True))
    else:
        raise ValueError(f"unknown hidden_dtype {seq.hidden_dtype!r}")
    return rows if device is None else rows.to(device)


def hidden_tensors(seqs: Iterable[SeqScore], device: Any = None) -> list[Any]:
    """``hidden_tensor`` of each sequence of a ``ScoreResult`` (or any ``SeqScore`` list)."""
    return [hidden_tensor(seq, device) for seq in seqs]
