"""The per-job weights keys of a job (protocol v1, additive): ``adapter`` and ``version``.

``adapter``: nil (the worker's base) or the name of a LoRA adapter directory under the
worker's ``--adapter-root``; ``version``: nil (the served ``--reference-model`` /
``--reward-model``) or a checkpoint directory under ``--model-root``. The wire only checks the
type and size; the worker refuses names that are not plain relative names (``bad_request``) or
match no directory (``model_not_found``) when it validates the job.
"""

from __future__ import annotations

from typing import Any

from worker.errors import ProtocolError

#: Longest adapter / version name.
MAX_WEIGHTS_NAME_CHARS = 256


def _name(value: Any, key: str) -> str | None:
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= MAX_WEIGHTS_NAME_CHARS
        or "\x00" in value
    ):
        raise ProtocolError(
            f"{key} must be nil or a non-empty string of at most {MAX_WEIGHTS_NAME_CHARS} chars"
        )
    return value


def encode_weights(adapter: str | None, version: str | None) -> dict[str, str]:
    """The job body keys for ``adapter``/``version`` (only the set ones)."""
    out = {"adapter": _name(adapter, "adapter"), "version": _name(version, "version")}
    return {k: v for k, v in out.items() if v is not None}


def decode_weights(body: dict[Any, Any]) -> tuple[str | None, str | None]:
    """``(adapter, version)`` of a decoded job body (``ProtocolError`` on a bad value)."""
    return _name(body.get("adapter"), "adapter"), _name(body.get("version"), "version")
