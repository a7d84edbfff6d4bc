"""Wire protocol v1: the msgpack schema of jobs and results (see ``docs/protocol.md``).

This package knows msgpack and the standard library only: no torch, no redis, no numpy
requirement (numpy/torch arrays are accepted duck-typed when the caller has them).
Decoding is strict and bounded: every size is checked against :class:`Limits` before
anything proportional to it is allocated, and pickle is never involved.

Modules: ``limits`` (constants, ``Limits``, the bounded decoder), ``seqs`` (token ids, masks and
float arrays on the wire), ``jobs`` (``Job``, ``encode_job``, ``decode_job``), ``results``
(``Result``, ``encode_result``, ``decode_result``), ``outputs`` (teacher-output job keys and
result arrays), ``rewards`` (``messages``, step positions, the ``step`` map), ``weights`` (the
``adapter`` / ``version`` keys), ``prefix`` (the job's ``prefix``: a group's prompt sent once),
``envelope`` (``peek_envelope`` for payloads that break the rules). Import the names from here.
"""

from __future__ import annotations

from worker.errors import ERROR_CODES, ProtocolError
from worker.modes import MODES
from worker.protocol.envelope import peek_envelope
from worker.protocol.jobs import Job, decode_job, encode_job
from worker.protocol.limits import (
    DEFAULT_LIMITS,
    MAX_ID_CHARS,
    MAX_KEY_CHARS,
    PAYLOAD_FIELD,
    PROTOCOL_VERSION,
    Limits,
)
from worker.protocol.outputs import gather_width
from worker.protocol.results import Result, SeqResult, decode_result, encode_result, error_result
from worker.protocol.rewards import StepSpec, reward_seq, with_reward_inputs
from worker.protocol.seqs import (
    SeqSpec,
    as_int32_array,
    as_mask_bytes,
    is_bool_like,
    seq_specs,
    token_id,
    validate_seq,
    with_gather_ids,
)

__all__ = [
    "DEFAULT_LIMITS",
    "ERROR_CODES",
    "MAX_ID_CHARS",
    "MAX_KEY_CHARS",
    "MODES",
    "PAYLOAD_FIELD",
    "PROTOCOL_VERSION",
    "Job",
    "Limits",
    "ProtocolError",
    "Result",
    "SeqResult",
    "SeqSpec",
    "StepSpec",
    "as_int32_array",
    "as_mask_bytes",
    "decode_job",
    "decode_result",
    "encode_job",
    "encode_result",
    "error_result",
    "gather_width",
    "is_bool_like",
    "peek_envelope",
    "reward_seq",
    "seq_specs",
    "token_id",
    "validate_seq",
    "with_gather_ids",
    "with_reward_inputs",
]
