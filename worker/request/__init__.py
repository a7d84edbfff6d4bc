"""The request vocabulary: what a job may ask for, in frozen types every layer reads.

The protocol decodes a job into these types and the client encodes from them; the daemon batches
on them and the scorers read them. Each type validates itself once, where it is built, and raises
``BadRequest`` with the reason (the protocol re-raises it as a ``ProtocolError`` carrying the
payload's head). Nothing here imports torch, numpy or redis: producers build them too.

- ``SequenceInput``: one sequence to score (tokens and which of them are scored, reward inputs,
  per-position gather ids).
- ``TokenOutputs`` (with ``Sampling``): the per-position arrays a job wants beyond log-probs
  (teacher outputs, ``docs/distillation.md``); their sizes and wire layout are in
  ``worker.scorer.teacher``.
- ``StudentView`` (``student``): a sequence as text, for a teacher with its own tokenizer.
- ``StepOptions``: the ``step`` map of a process-reward job (``docs/rewards.md``).
- ``ScoreOptions``: everything of a job beyond its mode and temperature (weights, outputs, step);
  jobs with equal options share one scorer call.
- ``Images`` (``images``): a job's images (encoded files, sent once per job) and its
  image-processor options (``docs/protocol.md``, "Images"); a sequence names the ones its tokens
  show by index.
- ``ScoreRequest``: one scorer request: sequences, mode, temperature, options and images.

The sub-modules ``checks``, ``student`` and ``images`` hold the shared bounded-integer check and
the two types above; every name is imported from here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.errors import BadRequest
from worker.modes import MODES, Mode
from worker.request.checks import integer as _integer
from worker.request.images import IMAGE_OPTION_NAMES, Images, check_image_refs
from worker.request.student import StudentView

__all__ = [
    "DEFAULT_OPTIONS",
    "HIDDEN_DTYPES",
    "HIDDEN_WIRE_DTYPES",
    "IMAGE_OPTION_NAMES",
    "LOGPS_ONLY",
    "MAX_GATHER_IDS",
    "MAX_TOPK",
    "OUTPUT_NAMES",
    "SORT_FREE_TOP_K",
    "Images",
    "Sampling",
    "ScoreOptions",
    "ScoreRequest",
    "SequenceInput",
    "StepOptions",
    "StudentView",
    "TokenOutputs",
    "check_temperature",
]


@dataclass(frozen=True)
class SequenceInput:
    """One sequence to score: token ids and which of them are scored.

    ``tokens``: 1-D ids (list, numpy array, torch tensor, ``array.array``). Exactly one of
    ``prompt_len`` (tokens ``[prompt_len:]`` are scored; valid range ``[1, len)``) or ``mask``
    (one 0/1 per token, 1 = scored, ``mask[0] == 0``, at least one 1) is required when log-probs
    are requested; reward-only scoring accepts neither. ``gather_ids``: per-position ids
    ``[n_scored, K]`` for a job asking for ``gather`` with per-position ids (teacher outputs).
    The scorer checks the values (``worker.scorer.inputs.prepare_sequence``): they may be
    arrays of any kind, so this type takes them as given.
    """

    tokens: Any = ()
    prompt_len: int | None = None
    mask: Sequence[int] | bytes | None = None
    # reward inputs (chat templates, process rewards): ``messages`` (a list of {role, content}
    # maps) is rendered with the reward model's own chat template and scored instead of
    # ``tokens`` (``both`` mode still takes its log-probs from ``tokens``); ``step_positions``:
    # where a process-reward job reads step scores (in the ids the reward model sees);
    # ``rm_ids``: the rendered ids, filled by ``Scorer.prepare`` so scoring does not re-tokenise
    messages: Sequence[Any] | None = None
    step_positions: Any = None
    # text in: an already-templated string, tokenized by the reward model's own tokenizer as
    # given (``add_special_tokens=False``) and scored instead of ``tokens``, like ``messages``
    text: str | None = None
    rm_ids: Any = None
    # teacher outputs: per-position gather ids [n_scored, K] (see worker.scorer.teacher)
    gather_ids: Any = None
    # vision-language models: the job's images this sequence's tokens show, one index into the
    # request's ``Images.files`` per run of the model's image token, in order (may repeat)
    images: tuple[int, ...] | None = None
    # student text: ``Scorer.prepare`` fills ``tokens`` and ``aligned`` (StudentView below)
    student: StudentView | None = None
    aligned: Any = None


OUTPUT_NAMES: tuple[str, ...] = (
    "logps",
    "entropy",
    "topk",
    "gather",
    "processed_logps",
    "rank",
    "hidden",
)
# the dtypes of ``hidden`` rows (the first is the default) and their wire dtypes (protocol.md)
HIDDEN_WIRE_DTYPES: dict[str, str] = {"bfloat16": "bf16", "float32": "<f4", "float16": "<f2"}
HIDDEN_DTYPES: tuple[str, ...] = tuple(HIDDEN_WIRE_DTYPES)
MAX_TOPK = 256
"""The largest k a job may ask for (a worker may lower it: ``serve --max-topk``)."""
MAX_GATHER_IDS = 4096
SORT_FREE_TOP_K = 256
"""Without top-p, a top-k up to this k is found with ``torch.topk``; a larger one with a sort."""


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise BadRequest(f"sampling.{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Sampling:
    """Sampler parameters; ``top_k`` 0/None, ``top_p`` 1.0 and ``min_p`` 0.0 switch a filter off.

    Raises ``BadRequest`` unless ``top_k`` is an int >= 0, ``0 < top_p <= 1``, ``0 <= min_p <= 1``.
    """

    top_k: int | None = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        top_k = 0 if self.top_k is None else self.top_k
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
            raise BadRequest(f"sampling.top_k must be an integer >= 0 (0 = off), got {top_k!r}")
        top_p = _real("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise BadRequest(f"sampling.top_p must be in (0, 1] (1 = off), got {top_p!r}")
        min_p = _real("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise BadRequest(f"sampling.min_p must be in [0, 1] (0 = off), got {min_p!r}")
        object.__setattr__(self, "top_k", int(top_k))
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "min_p", min_p)

    def top_k_for(self, vocab: int) -> int:
        """The effective k: 0 when top-k is off or keeps the whole vocabulary."""
        k = int(self.top_k or 0)
        return k if 0 < k < vocab else 0

    def needs_sort(self, vocab: int) -> bool:
        """Whether the support needs a full ``[c, V]`` sort (top-p, or a top-k above 256)."""
        return self.top_p < 1.0 or self.top_k_for(vocab) > SORT_FREE_TOP_K


@dataclass(frozen=True)
class TokenOutputs:
    """Which per-position arrays a job wants, and their parameters. Validated on construction.

    ``outputs``: names from ``OUTPUT_NAMES``. ``topk``: k in 1..256, required with (and only
    with) ``"topk"``. ``"gather"`` takes either shared ``gather_ids`` (K ids used at every
    position) or ``gather_width`` K > 0, the width of the per-position ids each sequence carries
    (``[n_scored, K]``); K <= 4096. ``sampling`` is required with (and only with)
    ``"processed_logps"``. ``float16``: ``topk_logps`` and ``gather_logps`` travel as float16
    (the math stays float32). ``temperature`` is the call's (the executor sets it).
    ``hidden_dtype``: of the ``"hidden"`` rows (the vector the LM head reads at each scored
    position). ``max_result_bytes``: the job's own limit on its result's arrays (0: only the
    worker's). Raises ``BadRequest`` with the reason.
    """

    outputs: frozenset[str] = frozenset({"logps"})
    topk: int = 0
    gather_ids: tuple[int, ...] = ()
    gather_width: int = 0
    sampling: Sampling | None = None
    temperature: float = 1.0
    float16: bool = False
    hidden_dtype: str = HIDDEN_DTYPES[0]
    max_result_bytes: int = 0

    def __post_init__(self) -> None:
        names = (self.outputs,) if isinstance(self.outputs, str) else self.outputs
        if not isinstance(names, Iterable) or not all(isinstance(n, str) for n in names):
            raise BadRequest(f"outputs must be a list of names, got {self.outputs!r}")
        outputs = frozenset(names)
        unknown = sorted(outputs - set(OUTPUT_NAMES))
        if unknown or not outputs:
            raise BadRequest(f"unknown or no outputs {unknown}; expected some of {OUTPUT_NAMES}")
        object.__setattr__(self, "outputs", outputs)
        if "topk" in outputs:
            object.__setattr__(self, "topk", _integer("topk k", self.topk, 1, MAX_TOPK))
        elif self.topk:
            raise BadRequest(f"topk k={self.topk!r} given but 'topk' is not a requested output")
        else:
            object.__setattr__(self, "topk", 0)
        self._check_gather()
        if isinstance(self.sampling, dict):
            try:
                object.__setattr__(self, "sampling", Sampling(**self.sampling))
            except TypeError:
                known = ("top_k", "top_p", "min_p")
                raise BadRequest(
                    f"sampling keys {sorted(self.sampling)} not all in {known}"
                ) from None
        if ("processed_logps" in outputs) != (self.sampling is not None):
            raise BadRequest("'processed_logps' and sampling go together: give both or neither")
        if self.sampling is not None and not isinstance(self.sampling, Sampling):
            raise BadRequest(f"sampling must be a Sampling, got {type(self.sampling).__name__}")
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise BadRequest(f"temperature must be a number, got {temperature!r}")
        if not (temperature > 0 and math.isfinite(temperature)):
            raise BadRequest(f"temperature must be a finite number > 0, got {temperature!r}")
        object.__setattr__(self, "temperature", float(temperature))
        if not isinstance(self.float16, bool):
            raise BadRequest(f"float16 must be true or false, got {self.float16!r}")
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise BadRequest(f"hidden_dtype must be one of {HIDDEN_DTYPES}: {self.hidden_dtype!r}")
        if self.hidden_dtype != HIDDEN_DTYPES[0] and "hidden" not in outputs:
            raise BadRequest("hidden_dtype given but 'hidden' is not a requested output")
        _integer("max_result_bytes", self.max_result_bytes, 0, 2**62)

    def _check_gather(self) -> None:
        ids = () if self.gather_ids is None else self.gather_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise BadRequest(f"gather_ids must be a list of token ids, got {ids!r}")
        ids = tuple(ids)
        for i in ids:
            _integer("gather_ids entries", i, 0, 2**31 - 1)
        object.__setattr__(self, "gather_ids", tuple(int(i) for i in ids))
        width = self.gather_width
        if "gather" not in self.outputs:
            if ids or width:
                raise BadRequest("gather ids given but 'gather' is not a requested output")
            return
        if bool(ids) == bool(width):
            raise BadRequest("'gather' needs exactly one of gather_ids (shared) or gather_width")
        if ids:
            _integer("number of gather_ids", len(ids), 1, MAX_GATHER_IDS)
        else:
            _integer("gather_width", width, 1, MAX_GATHER_IDS)

    @property
    def gather_k(self) -> int:
        """K, the number of gathered ids per position (0 without ``"gather"``)."""
        return len(self.gather_ids) or self.gather_width

    @property
    def extra(self) -> bool:
        """Whether anything beyond plain ``logps`` is asked for."""
        return self.outputs != LOGPS_ONLY.outputs or self.float16 or bool(self.max_result_bytes)

    def check_vocab(self, vocab: int) -> None:
        """Raise ``BadRequest`` when k or a shared gather id does not fit ``vocab`` tokens."""
        if "topk" in self.outputs and self.topk > vocab:
            raise BadRequest(f"topk k={self.topk} exceeds the model's vocabulary of {vocab}")
        bad = [i for i in self.gather_ids if i >= vocab]
        if bad:
            raise BadRequest(f"gather_ids {bad[:8]} are outside the vocabulary 0..{vocab - 1}")


LOGPS_ONLY = TokenOutputs()
"""Today's request: the log-prob of each scored token, nothing more."""


# -- process rewards


@dataclass(frozen=True)
class StepOptions:
    """The ``step`` map of a process-reward job.

    ``tag_id``: the step-separator token id (every position holding it is a step), or ``None``
    when each sequence gives its ``step_positions``. ``label_token_ids``: ``(good, bad)`` token
    ids for an LM-label head (a ``*ForCausalLM`` PRM: the step score is ``softmax([logit_good,
    logit_bad])[0]``). ``positive_index``: the class of a 2-label token-classification head whose
    probability is the step score (default 1). The ids are checked against the reward model's
    vocabulary by ``check``.
    """

    tag_id: int | None = None
    label_token_ids: tuple[int, int] | None = None
    positive_index: int = 1

    def __post_init__(self) -> None:
        tag = self.tag_id
        if tag is not None and (not _is_int(tag) or tag < 0):
            raise BadRequest("step.tag_id must be a token id (int >= 0)")
        labels = self.label_token_ids
        if labels is not None:
            if not isinstance(labels, (list, tuple)) or len(labels) != 2:
                raise BadRequest("step.label_token_ids must be [good, bad] token ids")
            if not all(_is_int(t) and t >= 0 for t in labels) or labels[0] == labels[1]:
                raise BadRequest("step.label_token_ids must be two distinct token ids >= 0")
            object.__setattr__(self, "label_token_ids", (int(labels[0]), int(labels[1])))
        if not _is_int(self.positive_index) or self.positive_index not in (0, 1):
            raise BadRequest(f"step.positive_index must be 0 or 1, got {self.positive_index!r}")
        if tag is not None:
            object.__setattr__(self, "tag_id", int(tag))

    def check(self, vocab: int) -> None:
        """``BadRequest`` when a token id is outside ``[0, vocab)``."""
        if self.tag_id is not None and not 0 <= self.tag_id < vocab:
            raise BadRequest(
                f"step tag_id {self.tag_id} is outside the reward model's vocabulary [0, {vocab})"
            )
        for t in self.label_token_ids or ():
            if not 0 <= t < vocab:
                raise BadRequest(
                    f"step label token id {t} is outside the reward model's vocabulary [0, {vocab})"
                )


def _is_int(value: Any) -> bool:
    """An integer (Python or numpy-like scalar), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# -- a job's options and a scorer request


@dataclass(frozen=True)
class ScoreOptions:
    """Everything of a job beyond its mode and temperature; the defaults are a plain log-prob /
    reward job. Frozen and hashable: jobs with equal options share one scorer call."""

    # per-job weights (docs/models.md): a LoRA adapter directory under the worker's
    # --adapter-root and/or a full checkpoint under --model-root; None = the served base. The
    # worker refuses names that match no directory or are not plain relative names (its roots
    # decide, so the check is the worker's: worker.executor.weights.residency).
    adapter: str | None = None
    version: str | None = None
    # teacher outputs (distillation): the per-position arrays a job wants beyond logps
    outputs: TokenOutputs = field(default_factory=lambda: LOGPS_ONLY)
    # process rewards: the job's ``step`` map (None: a plain sequence reward)
    step: StepOptions | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.outputs, TokenOutputs):
            raise BadRequest(f"outputs must be a TokenOutputs, got {type(self.outputs).__name__}")
        if self.step is not None and not isinstance(self.step, StepOptions):
            raise BadRequest(f"step must be a StepOptions, got {type(self.step).__name__}")

    def describe(self) -> dict[str, object]:
        """The options that differ from the defaults (for logs and result ``info``)."""
        out: dict[str, object] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value != getattr(DEFAULT_OPTIONS, name):
                out[name] = value
        return out


DEFAULT_OPTIONS = ScoreOptions()


def check_temperature(value: Any) -> float:
    """``value`` as a float when it is a finite number > 0 (not a bool); else ``BadRequest``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (math.isfinite(float(value)) and float(value) > 0)
    ):
        raise BadRequest(f"temperature must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ScoreRequest:
    """One scorer request: the sequences, the mode and temperature (``None``: the scorer's
    configured ones), the options and the images. Checks its own fields (a known mode, a
    temperature > 0, at least one sequence, image indices in range and every image used); what
    the values of the sequences may be is the scorer's check."""

    seqs: Sequence[SequenceInput]  # kept as a tuple
    mode: Mode | None = None
    temperature: float | None = None
    options: ScoreOptions = field(default_factory=lambda: DEFAULT_OPTIONS)
    images: Images | None = None

    def __post_init__(self) -> None:
        seqs = self.seqs
        if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence):
            raise BadRequest(f"expected a list of SequenceInput, got {type(seqs).__name__}")
        object.__setattr__(self, "seqs", tuple(seqs))
        if not self.seqs:
            raise BadRequest("no sequences to score")
        if self.mode is not None and self.mode not in MODES:
            raise BadRequest(f"unknown mode {self.mode!r}; expected one of {MODES}")
        if self.temperature is not None:
            object.__setattr__(self, "temperature", check_temperature(self.temperature))
        if not isinstance(self.options, ScoreOptions):
            raise BadRequest(f"options must be ScoreOptions, got {type(self.options).__name__}")
        if self.images is not None and not isinstance(self.images, Images):
            raise BadRequest(f"images must be Images, got {type(self.images).__name__}")
        check_image_refs(self.seqs, self.images)
