"""What a producer may pass as a job: sequences in a few shapes (``normalize_seqs``) and, for
``score_many``, job items with per-job settings (``JobSpec``, ``as_job_spec``).

Everything is validated here, before anything is sent (``worker.errors.BadRequest``).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from worker import errors, protocol
from worker.protocol.student import student_seq
from worker.request import Sampling, ScoreOptions, TokenOutputs


def _prompt_len(value: Any, index: int) -> int:
    """``prompt_len`` as an int (numpy/torch integer scalars accepted; booleans, floats not)."""
    if protocol.is_bool_like(value):
        raise errors.BadRequest(f"seqs[{index}]: prompt_len must be an integer, got a boolean")
    try:
        return operator.index(value)
    except TypeError as exc:
        raise errors.BadRequest(
            f"seqs[{index}]: prompt_len must be an integer, got {type(value).__name__}"
        ) from exc


_REWARD_KEYS = ("messages", "text", "step_positions")


def normalize_seq(seq: Any, index: int = 0) -> protocol.SeqSpec:
    """One sequence from a dict (``tokens`` + ``prompt_len`` or ``mask``), a ``(tokens,
    prompt_len)`` tuple or a ``SeqSpec``; tokens may be a list, numpy array or torch tensor."""
    if isinstance(seq, protocol.SeqSpec):
        return seq
    if isinstance(seq, Mapping) and seq.get("student") is not None:  # a teacher's own tokens
        return student_seq(seq, index)
    if isinstance(seq, Mapping) and any(seq.get(k) is not None for k in _REWARD_KEYS):
        # reward inputs: a conversation for the reward model's template, a templated text the
        # worker tokenizes, step positions
        if seq.get("tokens") is None:
            return _with_images(protocol.reward_seq(seq, index), seq, index)
        rest = {k: v for k, v in seq.items() if k not in _REWARD_KEYS}
        return protocol.with_reward_inputs(normalize_seq(rest, index), seq, index)
    if isinstance(seq, Mapping):
        if "tokens" not in seq:
            raise errors.BadRequest(f"seqs[{index}]: a sequence map needs 'tokens'")
        spec = {"tokens": seq["tokens"], "prompt_len": seq.get("prompt_len"), "mask": None}
        if seq.get("mask") is not None:
            spec["mask"] = seq["mask"]
        spec["gather_ids"] = seq.get("gather_ids")  # teacher outputs: [n_scored, K]
    elif isinstance(seq, tuple) and len(seq) == 2:
        tokens, second = seq
        if protocol.is_bool_like(second):  # True would pass operator.index as 1
            raise errors.BadRequest(f"seqs[{index}]: prompt_len must be an integer, got a boolean")
        try:
            spec = {"tokens": tokens, "prompt_len": operator.index(second), "mask": None}
        except TypeError:
            spec = {"tokens": tokens, "prompt_len": None, "mask": second}
    else:
        raise errors.BadRequest(
            f"seqs[{index}]: expected a dict with tokens and prompt_len/mask or a "
            f"(tokens, prompt_len) tuple, got {type(seq).__name__}"
        )
    if spec["prompt_len"] is not None:
        spec["prompt_len"] = _prompt_len(spec["prompt_len"], index)  # numpy/torch scalars too
    tokens = protocol.as_int32_array(spec["tokens"])
    mask = protocol.as_mask_bytes(spec["mask"]) if spec["mask"] is not None else None
    protocol.validate_seq(tokens, spec["prompt_len"], mask, index)
    out = protocol.SeqSpec(tokens=tokens, prompt_len=spec["prompt_len"], mask=mask)
    if spec.get("gather_ids") is not None:
        out = protocol.with_gather_ids(out, spec["gather_ids"], index)
    return _with_images(out, seq, index)


def _with_images(out: protocol.SeqSpec, seq: Any, index: int) -> protocol.SeqSpec:
    """``out`` with the image indices ``seq`` names (token ids, text or messages alike)."""
    refs = seq.get("images") if isinstance(seq, Mapping) else None  # indices into the job's
    if refs is not None:
        if isinstance(refs, (str, bytes)) or not isinstance(refs, Sequence):
            raise errors.BadRequest(f"seqs[{index}]: images must be a list of image indices")
        out = replace(out, images=tuple(refs))
    return out


def normalize_seqs(seqs: Any, prefix: Any = None) -> list[protocol.SeqSpec]:
    """A job's sequences; a single dict/tuple sequence is accepted as a one-sequence job. With
    ``prefix`` (token ids), each sequence is what follows it (a map with ``tokens``, or the ids
    alone) and comes back whole: ``prefix + tokens``, ``prompt_len`` ``len(prefix)`` unless it
    gives ``prompt_len`` or ``mask`` (counted over the whole sequence)."""
    if prefix is not None:
        seqs = with_prefix(seqs, prefix)
    elif isinstance(seqs, (Mapping, protocol.SeqSpec)) or (
        isinstance(seqs, tuple) and len(seqs) == 2 and not isinstance(seqs[1], (Mapping, tuple))
    ):
        seqs = [seqs]
    out = [normalize_seq(s, i) for i, s in enumerate(seqs)]
    if not out:
        raise errors.BadRequest("a job needs at least one sequence")
    return out


def student_seqs(students: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any]) -> list[Any]:
    """``score_cross_tokenizer``'s sequences, one ``{"student": view}`` per student view.
    Refused (``BadRequest``), since the worker tokenizes each whole prompt and completion
    itself: a ``prefix`` (token ids; a shared prompt is text in each view), a ``mode`` (student
    text is scored in ``reference``) and per-sequence ``gather_ids`` (rows are teacher tokens,
    unknown before the worker tokenizes; shared ``gather_ids=`` work)."""
    for key, why in (
        ("prefix", "a prefix is token ids: give each view its prompt text"),
        ("mode", "student text is scored in mode reference"),
    ):
        if kwargs.get(key) is not None:
            raise errors.BadRequest(f"score_cross_tokenizer takes no {key}: {why}")
    if isinstance(students, Mapping):
        students = [students]
    out: list[Any] = []
    for i, view in enumerate(students):
        if not isinstance(view, Mapping):
            raise errors.BadRequest(f"students[{i}] must be a map (prompt or messages, tokens...)")
        if view.get("gather_ids") is not None:
            raise errors.BadRequest(
                f"students[{i}]: student text takes no per-sequence gather_ids (its rows are the "
                "teacher's tokens, known only once the worker tokenizes): give shared gather_ids="
            )
        out.append({"student": dict(view)})
    return out


def group_seqs(completions: Sequence[Any], images: Any) -> list[Any]:
    """``score_groups``' completions: with the prompt's ``images``, each completion that names
    none shows them all, in order (the prompt's image runs come first in every sequence)."""
    if images is None:
        return list(completions)
    shown = list(range(len(images)))
    out: list[Any] = []
    for c in completions:
        seq = dict(c) if isinstance(c, Mapping) else {"tokens": c}
        seq.setdefault("images", shown)
        out.append(seq)
    return out


def with_prefix(seqs: Any, prefix: Any) -> list[Any]:
    """Sequence maps of ``prefix`` followed by each of ``seqs`` (maps with ``tokens`` or bare
    token ids), each scored after the prefix unless it says otherwise. A ``SeqSpec`` is a whole
    sequence already (what ``normalize_seqs`` returns) and stays as it is: ``encode_job``
    refuses one that does not start with the prefix."""
    head = protocol.as_int32_array(prefix)
    if len(head) == 0:
        raise errors.BadRequest("prefix must hold at least one token id")
    if isinstance(seqs, (Mapping, protocol.SeqSpec)):
        seqs = [seqs]
    out: list[Any] = []
    for i, seq in enumerate(seqs):
        if isinstance(seq, protocol.SeqSpec):
            out.append(seq)
            continue
        if not isinstance(seq, Mapping):
            seq = {"tokens": seq}
        elif seq.get("student") is not None:
            raise errors.BadRequest(
                f"seqs[{i}]: a student-text sequence takes no prefix (token ids): its view "
                "carries its whole prompt as text"
            )
        elif seq.get("tokens") is None:
            raise errors.BadRequest(f"seqs[{i}]: with a prefix, a sequence needs 'tokens'")
        whole = dict(seq, tokens=head + protocol.as_int32_array(seq["tokens"]))
        if seq.get("prompt_len") is None and seq.get("mask") is None:
            whole["prompt_len"] = len(head)
        out.append(whole)
    return out


def teacher_settings(
    outputs: Any = None,
    topk: int | None = None,
    gather_ids: Any = None,
    sampling: Mapping[str, Any] | None = None,
    float16: bool = False,
    hidden_dtype: str | None = None,
    max_result_bytes: int | None = None,
) -> dict[str, Any] | None:
    """The teacher-output arguments of a job as given (``None``: none given, a plain job);
    ``output_request`` builds them into the job's ``TokenOutputs`` once its sequences are
    known. ``hidden_dtype``: of the ``"hidden"`` rows (default bfloat16); ``max_result_bytes``:
    the job's own limit on its result's arrays (the worker answers ``too_large`` over it)."""
    given = (outputs, topk, gather_ids, sampling, hidden_dtype, max_result_bytes)
    if all(x is None for x in given) and not float16:
        return None
    return {"outputs": outputs, "topk": topk, "gather_ids": gather_ids, "sampling": sampling,
            "float16": float16, "hidden_dtype": hidden_dtype,
            "max_result_bytes": max_result_bytes}  # fmt: skip


def output_request(
    settings: TokenOutputs | Mapping[str, Any] | None, specs: list[protocol.SeqSpec]
) -> TokenOutputs | None:
    """The job's teacher outputs (``None``: plain log-probs), checked (``BadRequest``): a
    ``TokenOutputs`` as it is, or ``teacher_settings`` built into one. ``outputs`` defaults to
    ``("logps",)`` when another setting is given; ``gather_ids`` there are shared by every
    position; ids per position travel on the sequences (``specs``), whose K is the width."""
    if settings is None or isinstance(settings, TokenOutputs):
        return settings
    names = settings.get("outputs")
    names = (names,) if isinstance(names, str) else names or ("logps",)
    hidden_dtype = settings.get("hidden_dtype")
    if hidden_dtype is not None and "hidden" not in names:
        raise errors.BadRequest(
            f"hidden_dtype={hidden_dtype!r} given but 'hidden' is not a requested output: "
            "ask for outputs=(..., 'hidden')"
        )
    limit = settings.get("max_result_bytes")
    ids = settings.get("gather_ids")
    if ids is not None and hasattr(ids, "tolist"):
        ids = ids.tolist()
    sampling = settings.get("sampling")
    width = protocol.gather_width(
        [(s.num_scored, None if s.gather_ids is None else len(s.gather_ids)) for s in specs]
    )
    return TokenOutputs(
        outputs=frozenset(names),
        topk=settings.get("topk") or 0,
        gather_ids=tuple(ids) if ids is not None else (),
        gather_width=width,
        sampling=Sampling(**sampling) if isinstance(sampling, Mapping) else sampling,
        float16=bool(settings.get("float16")),
        hidden_dtype="bfloat16" if hidden_dtype is None else hidden_dtype,
        max_result_bytes=0 if limit is None else limit,
    )


@dataclass(frozen=True)
class JobSpec:
    """One job for ``score_many``: its sequences and optional per-job settings."""

    seqs: Any
    mode: str | None = None
    temperature: float | None = None
    meta: Any = None
    job_id: str | None = None
    deadline_ms: int | None = None
    # per-job weights: adapter under --adapter-root, version under --model-root
    adapter: str | None = None
    version: str | None = None
    # teacher outputs (docs/distillation.md), as ``client.score`` takes them; a job that sets
    # none of these six takes score_many's, a job that sets any takes none of them
    outputs: Any = None
    topk: int | None = None
    gather_ids: Any = None
    sampling: Mapping[str, Any] | None = None
    float16: bool | None = None
    hidden_dtype: str | None = None  # of the "hidden" rows: bfloat16 (default), float32, float16
    # the job's own limit on its result's arrays (too_large over it); None takes score_many's
    max_result_bytes: int | None = None
    # process rewards (docs/rewards.md): the job's step map; None takes score_many's
    step: Mapping[str, Any] | None = None
    # every job option as one ScoreOptions (instead of the separate settings above)
    options: ScoreOptions | None = None
    # the job's images (bytes, paths or PIL images; docs/client.md) and processor options
    images: Any = None
    processor: Mapping[str, int] | None = None

    def sets_outputs(self) -> bool:
        """Whether this job names any teacher-output setting of its own."""
        return any(getattr(self, k) is not None for k in TEACHER_SETTINGS)

    def teacher(self) -> dict[str, Any] | None:
        """This job's teacher-output settings (``teacher_settings`` of its six) and limit."""
        return teacher_settings(
            self.outputs, self.topk, self.gather_ids, self.sampling, bool(self.float16),
            self.hidden_dtype, self.max_result_bytes,
        )  # fmt: skip


#: The ``JobSpec`` (and job map) keys that name teacher outputs, taken or left as one group.
TEACHER_SETTINGS = ("outputs", "topk", "gather_ids", "sampling", "float16", "hidden_dtype")


def with_defaults(spec: JobSpec, defaults: JobSpec, mode: str) -> JobSpec:
    """``spec`` with ``defaults``' teacher outputs (when ``spec`` sets none and its ``mode``,
    as resolved by the caller, is not ``reward``, which has no log-probs), ``max_result_bytes``
    (the same, when ``spec`` has none of its own) and ``step`` (when
    ``spec`` has none and is a ``reward`` job, the only mode with step scores)."""
    if spec.options is not None:  # the job's own options, whole
        return spec
    changes: dict[str, Any] = {}
    if not spec.sets_outputs() and defaults.sets_outputs() and mode != "reward":
        changes.update({k: getattr(defaults, k) for k in TEACHER_SETTINGS})
    limit = defaults.max_result_bytes
    if spec.max_result_bytes is None and limit is not None and mode != "reward":
        changes["max_result_bytes"] = limit
    if spec.step is None and defaults.step is not None and mode == "reward":
        changes["step"] = defaults.step
    return replace(spec, **changes) if changes else spec


def as_job_spec(item: Any) -> JobSpec:
    """A ``JobSpec`` from a ``JobSpec``, a map with ``seqs`` (and ``mode``/``meta``/``id``, the
    teacher-output keys, ``step``...), a single sequence map with ``tokens``, or a list of
    sequences."""
    if isinstance(item, JobSpec):
        return item
    if isinstance(item, Mapping) and "seqs" in item:
        return JobSpec(
            seqs=item["seqs"],
            mode=item.get("mode"),
            temperature=item.get("temperature"),
            meta=item.get("meta"),
            job_id=item.get("job_id", item.get("id")),
            deadline_ms=item.get("deadline_ms"),
            adapter=item.get("adapter"),
            version=item.get("version"),
            step=item.get("step"),
            options=item.get("options"),
            images=item.get("images"),
            processor=item.get("processor"),
            max_result_bytes=item.get("max_result_bytes"),
            **{k: item.get(k) for k in TEACHER_SETTINGS},
        )
    return JobSpec(seqs=item)
