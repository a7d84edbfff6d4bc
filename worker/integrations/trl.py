"""A TRL reward function backed by the fleet: ``reward_function(redis_url, queue=...)`` for
``GRPOTrainer(reward_funcs=[...])``.

What TRL's own model reward does (``trl/trainer/grpo_trainer.py``, ``_calculate_rewards``, the
``nn.Module`` branch): text prompts score ``prompt + completion``; conversational ones render
``prompt + completion`` messages with the reward model's chat template
(``trl/data_utils.py``, ``apply_chat_template``: ``{"messages": p + c}``, ``tokenize=False``);
then ``tokenizer(text, add_special_tokens=False)`` and ``logits[:, 0]``. The worker does exactly
that: text goes as ``text`` (tokenized by the reward model's own tokenizer, no special tokens
added), conversations as ``messages`` (its chat template, ``apply_chat_template(tokenize=True)``,
the same ids when no ``chat_template_kwargs`` are set), read by the model's own head at the last
token. TRL calls an async callable per process on its local batch (``asyncio.gather`` on its
``async_loop``): one call is one job with every sample of the batch. ``__name__`` is what TRL
logs the reward under (``rewards/<name>/mean``).

Images (a vision-language dataset): TRL passes the dataset's other columns as keyword
arguments, so its ``images`` (a list per sample) or ``image`` (one per sample) column arrives
here; each sample's images go with its sequence (each distinct image once per job: a prompt's
image shared by its ``num_generations`` completions is sent once), the sample's ``images`` naming
them in order. The worker scores images in mode ``reference`` only, so a reward job with images
is its ``bad_request``, raised as ``BadRequestError`` with the worker's reason.

No token ``prefix``: the ids are the worker's to make (the reward model's tokenizer, which this
process does not hold), and a prompt and its completion tokenized apart are not their
concatenation tokenized. The prompt's text goes with each completion; since the local batch is
one job (TRL's ``num_generations`` completions of a prompt together), the worker's own prefix
detection computes each prompt's common ids once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.client.coalesce import BatchKey
from worker.integrations.shared import coalescer, settings, wait_unknown


def sequence(prompt: Any, completion: Any) -> dict[str, Any]:
    """The sequence map TRL's model reward scores for one sample."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):  # conversational
        turns = (
            completion
            if isinstance(completion, list)
            else [{"role": "assistant", "content": str(completion)}]
        )
        return {"messages": [*prompt, *turns]}
    return {"text": f"{prompt}{completion}"}


def sample_images(columns: dict[str, Any], n: int) -> list[list[Any]]:
    """Each sample's images from TRL's keyword arguments: the ``images`` column (a list, or
    None, per sample) or the ``image`` column (one image, or None, per sample); ``[[]] * n``
    without either. ``ValueError`` when a column does not hold one entry per sample."""
    name = "images" if columns.get("images") is not None else "image"
    column = columns.get(name)
    if column is None:
        return [[] for _ in range(n)]
    if not isinstance(column, (list, tuple)) or len(column) != n:
        raise ValueError(f"the {name!r} column must hold one entry per sample ({n})")
    out: list[list[Any]] = []
    for entry in column:
        if entry is None:
            out.append([])
        elif name == "images":
            out.append([i for i in entry if i is not None])
        else:
            out.append([entry])
    return out


class RewardFunction:
    """An async ``f(prompts, completions, completion_ids, **kw) -> list[float]`` (see the
    module docstring); ``adapter`` / ``version`` pick the reward model's weights."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        queue: str | None = None,
        partitions: int = 1,
        name: str = "scoring_worker",
        timeout_s: float = 600.0,
        adapter: str | None = None,
        version: str | None = None,
        wait_for_unknown_queue: bool | None = None,
    ) -> None:
        self.redis_url, self.queue = settings(redis_url, queue)
        self.wait_for_unknown_queue = wait_unknown(wait_for_unknown_queue)
        self.partitions = partitions
        self.__name__ = name
        self.timeout_s = timeout_s
        self.key = BatchKey(mode="reward", adapter=adapter, version=version)

    async def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Any = None,
        **kwargs: Any,
    ) -> list[float]:
        seqs = [sequence(p, c) for p, c in zip(prompts, completions, strict=True)]
        if not seqs:
            return []
        shown = sample_images(kwargs, len(seqs))
        files: list[Any] = []
        for seq, images in zip(seqs, shown, strict=True):
            if images:
                seq["images"] = list(range(len(files), len(files) + len(images)))
                files.extend(images)
        batcher = coalescer(
            self.redis_url,
            self.queue,
            self.partitions,
            wait_for_unknown_queue=self.wait_for_unknown_queue,
        )
        scores = await batcher.score(seqs, self.key, self.timeout_s, images=files or None)
        return [float(s.reward) if s.reward is not None else float("nan") for s in scores]


def reward_function(
    redis_url: str | None = None, queue: str | None = None, **options: Any
) -> RewardFunction:
    """A reward function for ``GRPOTrainer(reward_funcs=[...])`` scored by the workers of
    ``queue`` (``options``: ``partitions``, ``name``, ``timeout_s``, ``adapter``, ``version``,
    ``wait_for_unknown_queue``). A queue no worker ever served raises ``UnknownQueueError`` at
    the first call (a typo), unless ``wait_for_unknown_queue``."""
    return RewardFunction(redis_url, queue=queue, **options)
