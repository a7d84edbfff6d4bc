"""A verl custom reward function backed by the fleet: ``compute_score`` for
``reward.custom_reward_function.path=<this file> name=compute_score``.

verl calls ``[async] compute_score(data_source, solution_str, ground_truth, extra_info, **kw)``
once per sample (its reward managers, e.g. ``verl/experimental/reward_loop/reward_manager/
dapo.py``, ``run_single``) and reads a float or a dict with ``"score"``. Concurrent calls of one
process share one client and are coalesced into fleet-sized jobs (``worker.integrations.
shared``). What is scored: ``solution_str`` (the decoded response, special tokens skipped, as
verl decodes it), after the prompt when ``extra_info`` carries one under ``prompt_key`` (a string
is prepended as text, a list of chat messages becomes ``messages`` with the response as the
assistant's turn); re-tokenized by the reward model's own tokenizer, so no token ``prefix``
(the worker's own detection shares a prompt's ids among the samples of one coalesced job). For
token-exact rewards, and the prompt's ids sent once per group, use
``worker.integrations.verl_manager``.

Settings: the keyword arguments, which verl fills from
``reward.custom_reward_function.reward_kwargs`` (``redis_url``, ``queue``, ``partitions``,
``timeout_s``, ``wait_for_unknown_queue``, ...: verl's ``get_custom_reward_fn`` passes them on
every call), else ``SCORING_REDIS_URL`` / ``SCORING_QUEUE`` / ``SCORING_WAIT_FOR_UNKNOWN_QUEUE``
(on other Ray nodes only through a ``runtime_env``). A queue no worker ever served raises
``UnknownQueueError`` at once (a typo), unless ``wait_for_unknown_queue``.
"""

from __future__ import annotations

from typing import Any

from worker.client.coalesce import BatchKey
from worker.integrations.shared import coalescer, settings, wait_unknown


def sequence(solution_str: str, extra_info: Any, prompt_key: str = "prompt") -> dict[str, Any]:
    """The sequence map one sample is scored as."""
    prompt = extra_info.get(prompt_key) if isinstance(extra_info, dict) else None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return {"messages": [*prompt, {"role": "assistant", "content": solution_str}]}
    if isinstance(prompt, str):
        return {"text": prompt + solution_str}
    return {"text": solution_str}


async def compute_score(
    data_source: Any = None,
    solution_str: str = "",
    ground_truth: Any = None,
    extra_info: Any = None,
    *,
    redis_url: str | None = None,
    queue: str | None = None,
    partitions: int = 1,
    prompt_key: str = "prompt",
    timeout_s: float = 600.0,
    adapter: str | None = None,
    version: str | None = None,
    wait_for_unknown_queue: bool | None = None,
    **kwargs: Any,
) -> float:
    """The reward model's score of one sample (see the module docstring)."""
    url, q = settings(redis_url, queue)
    key = BatchKey(mode="reward", adapter=adapter, version=version)
    seq = sequence(solution_str, extra_info, prompt_key)
    batcher = coalescer(
        url, q, int(partitions), wait_for_unknown_queue=wait_unknown(wait_for_unknown_queue)
    )
    (score,) = await batcher.score([seq], key, float(timeout_s))
    return float(score.reward) if score.reward is not None else float("nan")
