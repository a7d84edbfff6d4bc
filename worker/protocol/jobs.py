"""Job payloads: the :class:`Job` schema, :func:`encode_job` (producers) and :func:`decode_job`
(workers; strict, bounded by ``Limits``, raises ``ProtocolError``)."""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from worker.errors import BadRequest, ProtocolError
from worker.modes import MODES
from worker.protocol.images import (
    decode_images,
    decode_seq_images,
    encode_images,
    encode_seq_images,
)
from worker.protocol.limits import (
    DEFAULT_LIMITS,
    MAX_ID_CHARS,
    MAX_KEY_CHARS,
    PROTOCOL_VERSION,
    Limits,
    unpack,
)
from worker.protocol.outputs import (
    decode_output_request,
    encode_output_request,
    gather_width,
)
from worker.protocol.prefix import after_prefix, check_prefix, decode_prefix
from worker.protocol.rewards import (
    check_reward_job,
    decode_step,
    encode_step,
    messages_only,
    reward_entry,
    reward_seq,
    untokenized,
    with_reward_inputs,
)
from worker.protocol.seqs import (
    SeqSpec,
    as_int32_array,
    as_mask_bytes,
    le_bytes,
    seq_spec,
    validate_seq,
    with_gather_ids,
)
from worker.protocol.student import student_entry, student_only, student_seq
from worker.protocol.weights import decode_weights, encode_weights
from worker.request import (
    DEFAULT_OPTIONS,
    LOGPS_ONLY,
    Images,
    ScoreOptions,
    StepOptions,
    TokenOutputs,
    check_image_refs,
)


@dataclass(frozen=True)
class Job:
    """A decoded, schema-valid job."""

    id: str
    mode: str
    reply_to: str
    seqs: tuple[SeqSpec, ...]
    temperature: float = 1.0
    deadline_ms: int | None = None
    meta: Any = None
    # what the job asks for beyond mode and temperature: per-job weights, teacher outputs (with
    # K of the per-sequence gather ids), the process-reward step map (worker.request)
    options: ScoreOptions = DEFAULT_OPTIONS
    # the job's images (encoded files) and image-processor options (worker.protocol.images)
    images: Images | None = None

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter the job names (``None``: the worker's base weights)."""
        return self.options.adapter

    @property
    def version(self) -> str | None:
        """The checkpoint version the job names (``None``: the served model)."""
        return self.options.version

    @property
    def step(self) -> StepOptions | None:
        """The job's ``step`` map (process rewards)."""
        return self.options.step

    @property
    def outputs(self) -> TokenOutputs:
        """The teacher outputs the job asks for (``LOGPS_ONLY``: a plain job)."""
        return self.options.outputs

    @property
    def gather_width(self) -> int:
        """K of the per-sequence gather ids (0: none)."""
        return self.options.outputs.gather_width

    @property
    def num_tokens(self) -> int:
        """Total tokens over all sequences."""
        return sum(len(s.tokens) for s in self.seqs)


def encode_job(
    job_id: str,
    mode: str,
    reply_to: str,
    seqs: Iterable[Mapping[str, Any] | SeqSpec],
    *,
    temperature: float = 1.0,
    deadline_ms: int | None = None,
    meta: Any = None,
    outputs: TokenOutputs | None = None,
    adapter: str | None = None,
    version: str | None = None,
    step: StepOptions | Mapping[str, Any] | None = None,
    options: ScoreOptions | None = None,
    prefix: Any = None,
    images: Images | None = None,
) -> bytes:
    """Encode a job payload; each seq is a ``SeqSpec`` or a map with ``tokens`` and
    ``prompt_len`` or ``mask`` (and per-position ``gather_ids``). ``outputs``: the teacher
    outputs to ask for. ``adapter``/``version``: the weights to score with (None: the worker's
    base). ``step``: the process-reward step map. ``options``: all of these as one
    ``ScoreOptions`` (then none of them separately). ``prefix``: token ids every sequence
    starts with (a GRPO group's prompt), sent once: ``seqs`` hold the whole sequences, and
    the wire carries each one's tokens after the prefix. ``images``: the job's image files and
    processor options (a sequence names its images by index, ``images`` of its map or
    ``SeqSpec``). Validates structure so producers fail fast."""
    if options is not None:
        if (outputs, adapter, version, step) != (None, None, None, None):
            raise ProtocolError("give options, or outputs/adapter/version/step: not both")
        outputs = None if options.outputs == LOGPS_ONLY else options.outputs
        adapter, version, step = options.adapter, options.version, options.step
    if not isinstance(job_id, str) or not 0 < len(job_id) <= MAX_ID_CHARS:
        raise ProtocolError(f"job id must be a non-empty string of at most {MAX_ID_CHARS} chars")
    if mode not in MODES:
        raise ProtocolError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(reply_to, str) or not 0 < len(reply_to) <= MAX_KEY_CHARS:
        raise ProtocolError("reply_to must be a non-empty stream key")
    if not (
        isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0
    ):
        raise ProtocolError(f"temperature must be a finite number > 0, got {temperature!r}")
    head = None if prefix is None else check_prefix(as_int32_array(prefix))
    wire_seqs = []
    specs: list[SeqSpec] = []
    for i, s in enumerate(seqs):
        if not isinstance(s, SeqSpec):
            if student_only(s):
                s = student_seq(s, i)
            elif messages_only(s):
                s = reward_seq(s, i)
            else:
                s = with_reward_inputs(seq_spec(s, i), s, i)
        elif s.student is not None:
            pass  # checked where its StudentView was built
        elif not untokenized(s) or len(s.tokens):
            validate_seq(s.tokens, s.prompt_len, s.mask, i)
        specs.append(s)
        tokens = s.tokens if head is None else after_prefix(s, head, i)
        entry: dict[str, Any] = {"tokens": le_bytes(tokens)} if len(s.tokens) else {}
        if s.prompt_len is not None:
            entry["prompt_len"] = int(s.prompt_len)
        elif s.mask is not None:
            entry["mask"] = s.mask
        entry.update(reward_entry(s))
        entry.update(student_entry(s))
        if s.gather_ids is not None:
            entry["gather_ids"] = le_bytes(s.gather_ids)
        entry.update(encode_seq_images(s.images))
        wire_seqs.append(entry)
    if not wire_seqs:
        raise ProtocolError("a job needs at least one sequence")
    body: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "id": job_id,
        "mode": mode,
        "reply_to": reply_to,
        "seqs": wire_seqs,
        "temperature": float(temperature),
    }
    if deadline_ms is not None:
        body["deadline_ms"] = int(deadline_ms)
    if meta is not None:
        body["meta"] = meta
    if head is not None:
        body["prefix"] = le_bytes(head)
    if outputs is not None:
        if mode == "reward":
            raise ProtocolError("teacher outputs need mode reference or both, not 'reward'")
        body.update(encode_output_request(outputs))
    body.update(encode_weights(adapter, version))
    body.update(encode_step(step))
    body.update(encode_images(images))
    check_reward_job(mode, specs, decode_step(body.get("step")))
    try:
        check_image_refs(specs, images)
    except BadRequest as exc:
        raise ProtocolError(exc.message) from None
    check_student_job(mode, specs, head)
    return msgpack.packb(body, use_bin_type=True)


def decode_job(payload: bytes, limits: Limits = DEFAULT_LIMITS) -> Job:
    """Decode and validate a job payload. Raises ``ProtocolError`` (code ``bad_request``)."""
    body = unpack(payload, limits)
    raw = bytes(payload[:256])
    if not isinstance(body, dict):
        raise ProtocolError("payload must be a msgpack map", raw=raw)
    v = body.get("v")
    if isinstance(v, bool) or not isinstance(v, int) or v != PROTOCOL_VERSION:  # 1.0, true: no
        raise ProtocolError(f"unsupported protocol version {v!r} (this worker speaks v1)", raw=raw)
    job_id = body.get("id")
    if not isinstance(job_id, str) or not 0 < len(job_id) <= MAX_ID_CHARS:
        raise ProtocolError(
            f"id must be a non-empty string of at most {MAX_ID_CHARS} chars", raw=raw
        )
    reply_to = body.get("reply_to")
    if not isinstance(reply_to, str) or not 0 < len(reply_to) <= MAX_KEY_CHARS:
        raise ProtocolError("reply_to must be a non-empty string", raw=raw)
    mode = body.get("mode")
    if not isinstance(mode, str):
        raise ProtocolError("mode must be a string", raw=raw)
    temperature = body.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ProtocolError("temperature must be a number", raw=raw)
    if not (math.isfinite(temperature) and temperature > 0):
        raise ProtocolError(f"temperature must be finite and > 0, got {temperature}", raw=raw)
    deadline_ms = body.get("deadline_ms")
    if deadline_ms is not None and (
        isinstance(deadline_ms, bool) or not isinstance(deadline_ms, int)
    ):
        raise ProtocolError("deadline_ms must be an integer (unix milliseconds)", raw=raw)
    meta = body.get("meta")
    if meta is not None and len(msgpack.packb(meta, use_bin_type=True)) > limits.max_meta_bytes:
        raise ProtocolError(f"meta is larger than {limits.max_meta_bytes} bytes", raw=raw)
    head = _raw(decode_prefix, body.get("prefix"), raw)
    seqs = _decode_seqs(body.get("seqs"), limits, raw, head)
    try:
        width = gather_width(
            [(s.num_scored, None if s.gather_ids is None else len(s.gather_ids)) for s in seqs]
        )
        outputs = decode_output_request(body, mode, width)
        adapter, version = decode_weights(body)
    except ProtocolError as exc:
        raise ProtocolError(exc.message, raw=raw) from exc
    step = _raw(decode_step, body.get("step"), raw)
    _raw(check_reward_job, mode, seqs, step, raw)
    images = _raw(decode_images, body, raw)
    _raw(check_student_job, mode, seqs, head, raw)
    if width and outputs is None:
        raise ProtocolError(
            "gather ids given per sequence but the job asks for no 'gather'", raw=raw
        )
    options = ScoreOptions(
        adapter=adapter, version=version, outputs=outputs or LOGPS_ONLY, step=step
    )
    return Job(
        id=job_id,
        mode=mode,
        reply_to=reply_to,
        seqs=seqs,
        temperature=float(temperature),
        deadline_ms=deadline_ms,
        meta=meta,
        options=options,
        images=images,
    )


def check_student_job(mode: str, seqs: Sequence[SeqSpec], head: Any) -> None:
    """A job's student sequences: all of its sequences or none, mode ``reference``, no
    ``prefix`` (the worker tokenizes the whole prompt)."""
    given = [s.student is not None for s in seqs]
    if not any(given):
        return
    if not all(given):
        raise ProtocolError(
            f"seqs[{given.index(False)}] has no student view: a job's sequences are all "
            "student text or all token ids"
        )
    if mode != "reference":
        raise ProtocolError(f"student sequences are scored in mode reference, not {mode!r}")
    if head is not None:
        raise ProtocolError("a job of student sequences carries no prefix")


def _raw(fn: Any, *args: Any) -> Any:
    """``fn(*args[:-1])`` with its ``ProtocolError`` carrying the payload head ``args[-1]``."""
    try:
        return fn(*args[:-1])
    except ProtocolError as exc:
        raise ProtocolError(exc.message, raw=args[-1]) from None


def _decode_seqs(
    raw_seqs: Any, limits: Limits, raw: bytes, head: array | None = None
) -> tuple[SeqSpec, ...]:
    """The ``seqs`` of a decoded job body, checked against ``limits`` and validated; with the
    job's ``prefix`` (``head``), each sequence is the prefix then its ``tokens``, and its
    ``prompt_len`` is the prefix's length unless it gives a ``prompt_len`` or ``mask``."""
    if not isinstance(raw_seqs, list) or not raw_seqs:
        raise ProtocolError("seqs must be a non-empty array", raw=raw)
    if len(raw_seqs) > limits.max_seqs:
        raise ProtocolError(
            f"{len(raw_seqs)} sequences, over the limit of {limits.max_seqs}", raw=raw
        )
    seqs: list[SeqSpec] = []
    total = 0
    for i, s in enumerate(raw_seqs):
        if not isinstance(s, dict):
            raise ProtocolError(f"seqs[{i}] must be a map", raw=raw)
        if student_only(s):  # a teacher with its own tokenizer: the student's text
            seqs.append(_raw(student_seq, s, i, raw))
            total += len(s["student"].get("completion") or "")  # bounded by the payload too
            continue
        if messages_only(s):  # reward inputs: a conversation or text the worker tokenizes
            if head is not None:
                raise ProtocolError(f"seqs[{i}]: a job with a prefix needs tokens", raw=raw)
            spec = _raw(reward_seq, s, i, raw)
            refs = _raw(decode_seq_images, s.get("images"), i, raw)  # refused by the worker
            seqs.append(spec if refs is None else replace(spec, images=refs))
            continue
        raw_tokens = s.get("tokens")
        n = len(raw_tokens) // 4 if isinstance(raw_tokens, bytes) else None
        if isinstance(raw_tokens, list):
            n = len(raw_tokens)
        if n is None:
            hint = ""
            if isinstance(raw_tokens, str):
                hint = " (got str: pack bytes as bin, e.g. use_bin_type=True)"
            raise ProtocolError(
                f"seqs[{i}].tokens must be int32 bin or an array of ints{hint}", raw=raw
            )
        total += n + (len(head) if head is not None else 0)  # what the worker holds
        if total > limits.max_tokens:
            raise ProtocolError(f"job has more than {limits.max_tokens} tokens", raw=raw)
        try:
            tokens = as_int32_array(raw_tokens)
        except ProtocolError as exc:
            raise ProtocolError(f"seqs[{i}].tokens: {exc.message}", raw=raw) from exc
        prompt_len = s.get("prompt_len")
        mask = s.get("mask")
        if head is not None:
            tokens = head + tokens
            if prompt_len is None and mask is None:
                prompt_len = len(head)
        if mask is not None and not isinstance(mask, bytes):
            if isinstance(mask, list) and all(isinstance(m, int) for m in mask):
                mask = as_mask_bytes(mask)
            else:
                raise ProtocolError(f"seqs[{i}].mask must be bin (one uint8 per token)", raw=raw)
        validate_seq(tokens, prompt_len, mask, i)
        spec = _raw(with_reward_inputs, SeqSpec(tokens, prompt_len, mask), s, i, raw)
        ids = s.get("gather_ids")  # teacher outputs: int32 LE bin [n_scored, K]
        if ids is not None:
            if not isinstance(ids, bytes) or len(ids) % 4:
                raise ProtocolError(f"seqs[{i}].gather_ids must be int32 LE bin", raw=raw)
            spec = with_gather_ids(spec, ids, i)
        refs = _raw(decode_seq_images, s.get("images"), i, raw)
        seqs.append(spec if refs is None else replace(spec, images=refs))
    return tuple(seqs)
