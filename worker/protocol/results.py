"""Result payloads: the :class:`Result` schema, :func:`encode_result` (workers) and
:func:`decode_result` (producers)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import msgpack

from worker.errors import ERROR_CODES, ProtocolError
from worker.protocol.limits import DEFAULT_LIMITS, PROTOCOL_VERSION, Limits, unpack
from worker.protocol.outputs import ARRAY_DTYPES, array_bin, decode_layout
from worker.protocol.seqs import float_bin, from_le, le_bytes


@dataclass
class SeqResult:
    """The scores of one sequence: log-probs (float32, one per scored token) and/or a reward."""

    logps: array | None = None  # typecode "f"
    reward: float | None = None
    token_scores: array | None = None  # typecode "f", optional per-token reward-head scores
    # teacher outputs: name -> values (numpy or LE bytes, as the result's ``layout`` says)
    arrays: dict[str, Any] | None = None
    # reward inputs and heads: reward-model token count (messages), every objective of a
    # multi-objective head (f32), process-reward step positions (i32) and scores (f32)
    rm_tokens: int | None = None
    rewards: Any = None
    step_positions: Any = None
    step_scores: Any = None


@dataclass
class Result:
    """One result entry: ``ok`` with ``seqs``, or not ok with ``error`` ``{code, message}``."""

    id: str
    ok: bool
    seqs: list[SeqResult] = field(default_factory=list)
    error: dict[str, str] | None = None
    meta: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    # teacher outputs: name -> (dtype, width) of every array in ``SeqResult.arrays``
    layout: dict[str, tuple[str, int]] | None = None

    @property
    def code(self) -> str | None:
        """The error code, or ``None`` for a successful result."""
        return self.error["code"] if self.error else None


def encode_result(result: Result) -> bytes:
    """Encode a result payload."""
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": result.id, "ok": bool(result.ok)}
    if result.ok:
        seqs = []
        for s in result.seqs:
            entry: dict[str, Any] = {}
            if s.logps is not None:
                entry["logps"] = float_bin(s.logps)
            if s.reward is not None:
                entry["reward"] = float(s.reward)
            if s.token_scores is not None:
                entry["token_scores"] = float_bin(s.token_scores)
            entry.update(_reward_fields(s))
            for name, (dtype, _) in (result.layout or {}).items():
                entry[name] = array_bin((s.arrays or {})[name], dtype)
            seqs.append(entry)
        body["seqs"] = seqs
        if result.layout:
            body["layout"] = {name: [d, w] for name, (d, w) in result.layout.items()}
    else:
        if not result.error or result.error.get("code") not in ERROR_CODES:
            raise ValueError(f"an error result needs error.code in {ERROR_CODES}")
        body["error"] = {
            "code": result.error["code"],
            "message": str(result.error.get("message", "")),
        }
    if result.meta is not None:
        body["meta"] = result.meta
    if result.info:
        body["info"] = result.info
    return msgpack.packb(body, use_bin_type=True)


def error_result(
    job_id: str, code: str, message: str, *, meta: Any = None, info: Any = None
) -> Result:
    """Build an error result."""
    return Result(
        id=job_id,
        ok=False,
        error={"code": code, "message": message},
        meta=meta,
        info=dict(info or {}),
    )


def decode_result(payload: bytes, limits: Limits = DEFAULT_LIMITS) -> Result:
    """Decode a result payload (used by producers)."""
    body = unpack(payload, limits)
    if not isinstance(body, dict) or body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("result payload is not a v1 map", raw=bytes(payload[:256]))
    job_id = body.get("id")
    if not isinstance(job_id, str):
        raise ProtocolError("result has no id", raw=bytes(payload[:256]))
    ok = bool(body.get("ok"))
    raw_seqs = body.get("seqs") or []
    if not isinstance(raw_seqs, list) or not all(isinstance(s, dict) for s in raw_seqs):
        raise ProtocolError("result seqs must be an array of maps", raw=bytes(payload[:256]))
    raw_error = body.get("error")
    error = {"code": "internal", "message": "error result without an error map"}
    if isinstance(raw_error, dict) and isinstance(raw_error.get("code"), str):
        error = {"code": raw_error["code"], "message": str(raw_error.get("message", ""))}
    info = body.get("info")
    layout = decode_layout(body["layout"]) if "layout" in body else None
    seqs = [_decode_seq_result(s) for s in raw_seqs]
    for k, (s, raw_seq) in enumerate(zip(seqs, raw_seqs, strict=True)):
        if layout:
            s.arrays = _decode_arrays(raw_seq, layout, k)
    return Result(
        id=job_id,
        ok=ok,
        seqs=seqs,
        error=error if not ok else None,
        meta=body.get("meta"),
        info=info if isinstance(info, dict) else {},
        layout=layout,
    )


def _decode_arrays(s: dict[str, Any], layout: dict[str, tuple[str, int]], k: int) -> dict[str, Any]:
    """The teacher arrays of one ``seqs`` entry as LE bytes, sizes checked against ``layout``."""
    out: dict[str, Any] = {}
    for name, (dtype, width) in layout.items():
        data = s.get(name)
        if not isinstance(data, bytes) or len(data) % (ARRAY_DTYPES[dtype] * width):
            raise ProtocolError(
                f"result seqs[{k}].{name} must be bin of n x {width} {dtype} values"
            )
        out[name] = data
    return out


def _decode_seq_result(s: dict[str, Any]) -> SeqResult:
    """One ``seqs`` entry of a result."""
    logps = s.get("logps")
    token_scores = s.get("token_scores")
    reward = s.get("reward")
    for value in (logps, token_scores):
        if isinstance(value, bytes) and len(value) % 4:
            raise ProtocolError("result float32 bin length is not a multiple of 4")
    if isinstance(reward, bool) or not isinstance(reward, (int, float, type(None))):
        raise ProtocolError("result reward must be a number")
    out = SeqResult(
        logps=from_le("f", logps) if isinstance(logps, bytes) else None,
        reward=reward,
        token_scores=from_le("f", token_scores) if isinstance(token_scores, bytes) else None,
    )
    rm_tokens = s.get("rm_tokens")
    out.rm_tokens = rm_tokens if isinstance(rm_tokens, int) else None
    for name, code in (("rewards", "f"), ("step_positions", "i"), ("step_scores", "f")):
        value = s.get(name)
        if isinstance(value, bytes):
            if len(value) % 4:
                raise ProtocolError(f"result {name} bin length is not a multiple of 4")
            setattr(out, name, from_le(code, value))
    return out


def _reward_fields(s: SeqResult) -> dict[str, Any]:
    """The reward-input and reward-head keys of one result entry (only those set)."""
    entry: dict[str, Any] = {}
    if s.rm_tokens is not None:
        entry["rm_tokens"] = int(s.rm_tokens)
    if s.rewards is not None:
        entry["rewards"] = float_bin(s.rewards)
    if s.step_positions is not None:
        pos = s.step_positions
        entry["step_positions"] = (
            pos.astype("<i4").tobytes() if hasattr(pos, "astype") else le_bytes(array("i", pos))
        )
    if s.step_scores is not None:
        entry["step_scores"] = float_bin(s.step_scores)
    return entry
