"""What a producer gets back: ``JobHandle`` from ``submit``, ``ScoreResult`` (one ``SeqScore`` per
sequence) from ``result``; ``unwrap`` turns a wire result into one or raises its ``JobFailed``."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from worker.client.errors import job_failed
from worker.protocol import Result
from worker.protocol.seqs import from_le

try:  # numpy is optional on the producer side
    import numpy as _np
except ImportError:  # pragma: no cover - depends on the environment
    _np = None  # type: ignore[assignment]


def _float_array(values: array | None) -> Any:
    """A numpy float32 array when numpy is installed, else the ``array('f')`` itself."""
    if values is None:
        return None
    if _np is not None:
        return _np.frombuffer(values.tobytes(), dtype=_np.float32)
    return values


#: The teacher-output arrays a ``SeqScore`` may carry (``docs/protocol.md``).
TEACHER_ARRAYS = (
    "entropy",
    "topk_ids",
    "topk_logps",
    "topk_tail_logp",
    "gather_logps",
    "processed_logps",
    "rank",
    "hidden",
    "teacher_ids",
    "teacher_spans",
    "span_logps",
    "span_student",
    "span_teacher",
)


def _bf16_rows(data: bytes, width: int) -> Any:
    """bfloat16 bits (LE uint16) as float32 ``[n, width]``, exactly (each value is the float32
    whose upper half the bits are); without numpy a flat ``array('f')``."""
    if _np is not None:
        bits = _np.frombuffer(data, dtype="<u2").astype("<u4") << 16
        return bits.view("<f4").reshape(-1, width)
    wide = array("I", (b << 16 for b in memoryview(data).cast("H")))
    return array("f", wide.tobytes())


def _bf16_bits(data: bytes, width: int) -> Any:
    """bfloat16 rows as they travelled: numpy uint16 ``[n, width]`` over the received bytes
    (no copy); without numpy a flat ``array('H')``."""
    if _np is not None:
        return _np.frombuffer(data, dtype="<u2").reshape(-1, width)
    return from_le("H", data)


def _teacher_arrays(
    arrays: dict[str, bytes] | None, layout: dict[str, tuple[str, int]] | None
) -> dict[str, Any]:
    """Decode a result entry's teacher arrays by the result's ``layout``: numpy ``[n]`` for
    width 1 and ``[n, width]`` otherwise (without numpy: flat ``array``/lists)."""
    out: dict[str, Any] = {}
    for name, (dtype, width) in (layout or {}).items():
        if name not in TEACHER_ARRAYS or arrays is None or name not in arrays:
            continue
        data = arrays[name]
        if dtype == "bf16":  # no numpy bfloat16: the exact float32 upcast (bits << 16)
            out[name] = _bf16_rows(data, width)
            out["hidden_dtype"] = "bfloat16"
            out["hidden_bits"] = _bf16_bits(data, width)
            continue
        if name == "hidden":
            out["hidden_dtype"] = "float32" if dtype == "<f4" else "float16"
        if _np is not None:
            value = _np.frombuffer(data, dtype=dtype)
            out[name] = value if width == 1 else value.reshape(-1, width)
        elif dtype == "<f2":
            out[name] = list(memoryview(data).cast("e"))
        else:
            out[name] = from_le("f" if dtype == "<f4" else "i", data)
    return out


#: Reward-head arrays of a ``SeqScore`` (besides ``reward``).
REWARD_ARRAYS = ("rewards", "step_positions", "step_scores")


def _int_array(values: array | None) -> Any:
    """A numpy int32 array when numpy is installed, else the ``array('i')`` itself."""
    if values is None or _np is None:
        return values
    return _np.frombuffer(values.tobytes(), dtype=_np.int32)


@dataclass(frozen=True)
class SeqScore:
    """Scores of one sequence: completion-token log-probs (float32 array) and/or a reward."""

    logps: Any = None  # numpy float32 array when numpy is installed, else array('f')
    reward: float | None = None
    token_scores: Any = None
    # reward inputs and heads (docs/rewards.md): reward-model token count of `messages`, every
    # objective of a multi-objective head, process-reward step positions (int32) and scores
    rm_tokens: int | None = None
    rewards: Any = None
    step_positions: Any = None
    step_scores: Any = None
    # teacher outputs (docs/distillation.md): numpy arrays, row i = the i-th scored token;
    # [n] float32, or [n, k] / [n, K] (int32 ids; float16 log-probs when the job asked)
    entropy: Any = None
    topk_ids: Any = None
    topk_logps: Any = None
    topk_tail_logp: Any = None
    gather_logps: Any = None
    processed_logps: Any = None
    rank: Any = None  # [n] int32, 1-based (vLLM's prompt-token rank)
    # [n, H]: the vector the LM head reads at each scored position (docs/distillation.md,
    # *Hidden states*): numpy float32 / float16 as asked; bfloat16 rows (numpy has none) come
    # as their exact float32 upcast, and as the bits that travelled in ``hidden_bits``;
    # ``worker.tensors.hidden_tensor`` gives a torch tensor in ``hidden_dtype``
    hidden: Any = None
    hidden_dtype: str | None = None  # the dtype the rows travelled in
    hidden_bits: Any = None  # bfloat16 rows only: their bits, uint16 [n, H] (little-endian)
    # a teacher with its own tokenizer (docs/distillation.md): the rows above are the teacher's
    # tokens, with their ids [n_t] and [start, end) UTF-8 bytes in the completion [n_t, 2]; per
    # span of whole student and teacher tokens: its log-prob [n_r] (the sum over its teacher
    # tokens), student token range [a, b) [n_r, 2] and teacher token range [c, d) [n_r, 2]
    teacher_ids: Any = None
    teacher_spans: Any = None
    span_logps: Any = None
    span_student: Any = None
    span_teacher: Any = None

    @property
    def num_tokens(self) -> int:
        """How many completion tokens were scored (0 without log-probs)."""
        return 0 if self.logps is None else len(self.logps)

    @property
    def sum_logp(self) -> float | None:
        """Sum of the completion log-probs (the sequence log-likelihood)."""
        return None if self.logps is None else float(sum(float(x) for x in self.logps))

    @property
    def mean_logp(self) -> float | None:
        """Mean log-prob per scored token."""
        n = self.num_tokens
        return None if not n else (self.sum_logp or 0.0) / n

    def to_json(self) -> dict[str, Any]:
        """A JSON-friendly dict (log-probs as a list of floats)."""
        out: dict[str, Any] = {}
        if self.logps is not None:
            out["logps"] = [float(x) for x in self.logps]
        if self.reward is not None:
            out["reward"] = float(self.reward)
        if self.token_scores is not None:
            out["token_scores"] = [float(x) for x in self.token_scores]
        for name in TEACHER_ARRAYS + REWARD_ARRAYS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value.tolist() if hasattr(value, "tolist") else list(value)
        if self.rm_tokens is not None:
            out["rm_tokens"] = self.rm_tokens
        if self.hidden_dtype is not None:
            out["hidden_dtype"] = self.hidden_dtype
        return out


@dataclass(frozen=True)
class ScoreResult:
    """The successful result of one job: one ``SeqScore`` per submitted sequence, in order."""

    job_id: str
    seqs: list[SeqScore]
    info: dict[str, Any] = field(default_factory=dict)
    meta: Any = None

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self) -> Iterator[SeqScore]:
        return iter(self.seqs)

    def __getitem__(self, index: int) -> SeqScore:
        return self.seqs[index]

    @classmethod
    def from_wire(cls, result: Result) -> ScoreResult:
        """Build from a decoded ``ok`` wire result."""
        return cls(
            job_id=result.id,
            seqs=[
                SeqScore(
                    logps=_float_array(s.logps),
                    reward=s.reward,
                    token_scores=_float_array(s.token_scores),
                    **_teacher_arrays(s.arrays, result.layout),
                    rm_tokens=s.rm_tokens,  # reward inputs and heads (docs/rewards.md)
                    rewards=_float_array(s.rewards),
                    step_positions=_int_array(s.step_positions),
                    step_scores=_float_array(s.step_scores),
                )
                for s in result.seqs
            ],
            info=dict(result.info or {}),
            meta=result.meta,
        )


@dataclass(frozen=True)
class JobHandle:
    """What ``submit`` returns: the job id, where it went, and when."""

    job_id: str
    stream: str
    entry_id: str
    submitted_at: float  # time.monotonic()
    num_seqs: int


def unwrap(result: Result) -> ScoreResult:
    """A ``ScoreResult`` for an ok result; raises the typed ``JobFailed`` otherwise."""
    if not result.ok:
        raise job_failed(result)
    return ScoreResult.from_wire(result)


def job_id_of(handle_or_id: JobHandle | str) -> str:
    """The job id of a handle, or the id itself."""
    return handle_or_id.job_id if isinstance(handle_or_id, JobHandle) else str(handle_or_id)
