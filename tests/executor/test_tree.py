"""Prefix sharing: a GRPO group scored as one tree row gives what each sequence gives alone.

The trie (``tree.trie``) against a dict trie; the tree attention (``tree.attention``) through the
executor with ``prefix_sharing="auto"`` against the same executor with ``"off"`` (every sequence
alone), on tiny random models of each attention variant: log-probs with temperature and masks,
teacher outputs, rewards, ``mode="both"``; the refusals (linear attention); the OOM split; and a
real worker over Redis.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.models import tiny_model, tiny_reward
from tests.support.models import tiny_variant as tiny
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.executor.tree.trie import SharedGroup, naive_tree_tokens, plan_trees, shared_groups
from worker.request import ScoreOptions
from worker.scorer.teacher import Sampling, TokenOutputs

VOCAB = 96
ATOL = 2e-5
PROMPT = 40  # above the default min_shared_tokens (32)


def group_seqs(seed: int = 0, g: int = 4) -> list[list[int]]:
    """One prompt of ``PROMPT`` ids, ``g`` completions (two share their first ids), and an
    unrelated sequence."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, PROMPT).tolist()
    out = [prompt + rng.integers(0, VOCAB, 3 + 2 * i).tolist() for i in range(g)]
    out[1] = out[0][: PROMPT + 2] + out[1][PROMPT + 2 :]  # shares more than the prompt
    out.append(rng.integers(0, VOCAB, 17).tolist())
    return out


def _pair(model: Any, **kw: Any) -> tuple[StatelessExecutor, StatelessExecutor]:
    on = StatelessExecutor(ExecutorConfig(prefix_sharing="auto", **kw), model)
    off = StatelessExecutor(ExecutorConfig(prefix_sharing="off", **kw), model)
    assert on.info["prefix_sharing"] == "on", on.info["prefix_sharing"]
    assert off.info["prefix_sharing"].startswith("off:")
    return on, off


def _inputs(seqs: list[list[int]]) -> list[SequenceInput]:
    """Completions scored after the prompt (the unrelated sequence after its fifth id)."""
    return [SequenceInput(s, prompt_len=PROMPT if len(s) > PROMPT else 5) for s in seqs]


def _unique(seqs: list[list[int]]) -> int:
    """Tokens of the group's tree row plus the unrelated sequence."""
    return PROMPT + sum(len(s) - PROMPT for s in seqs[:-1]) + len(seqs[-1])


# ---------------------------------------------------------------- the trie


def _random_forest(rng: np.random.Generator) -> list[np.ndarray]:
    """Sequences over 3 ids sharing roots and second turns at random (dense sharing)."""
    roots = [rng.integers(0, 3, int(rng.integers(1, 8))) for _ in range(3)]
    out = []
    for n in rng.integers(1, 6, int(rng.integers(2, 10))):
        root = roots[int(rng.integers(0, 3))]
        turn = roots[int(rng.integers(0, 3))][: int(rng.integers(0, 5))]
        out.append(np.concatenate([root, turn, rng.integers(0, 3, int(n))]).astype(np.int64))
    return out


def _check_tree(group: SharedGroup, seqs: list[np.ndarray], min_shared: int) -> None:
    """Every node holds at least ``min_shared`` ids that at least two members below it share;
    each member's path covers its first ids contiguously and keeps its last id out."""
    for k, i in enumerate(group.members):
        path = group.path(k)
        assert group.nodes[path[0]].start == 0
        for a, b in pairwise(path):
            assert group.nodes[a].end == group.nodes[b].start and group.nodes[b].parent == a
        assert group.depth(k) < len(seqs[i])
    for j, node in enumerate(group.nodes):
        below = [group.members[k] for k in range(len(group.members)) if j in group.path(k)]
        assert len(below) >= 2 and len(node) >= min_shared
        for i in below:
            np.testing.assert_array_equal(seqs[i][node.start : node.end],
                                          seqs[below[0]][node.start : node.end])  # fmt: skip


def test_shared_groups_match_a_dict_trie() -> None:
    """With every shared id worth sharing (``min_shared=1``) the trees compute what a dict trie
    counts; with a larger minimum every node still holds what its members share."""
    rng = np.random.default_rng(3)
    for _ in range(300):
        seqs = _random_forest(rng)
        lengths = [len(s) for s in seqs]
        for m in (1, 2, 4):
            groups = shared_groups(seqs, m)
            members = [i for g in groups for i in g.members]
            assert len(members) == len(set(members))
            for group in groups:
                _check_tree(group, seqs, m)
            alone = sum(n for i, n in enumerate(lengths) if i not in members)
            total = sum(g.unique_tokens(lengths) for g in groups) + alone
            if m == 1:
                assert total == naive_tree_tokens(seqs), seqs
            assert total >= naive_tree_tokens(seqs)


def test_turns_share_each_level() -> None:
    """Agent rollouts: a system prompt (40 ids), two first turns (40 more each) under it, two
    completions under each turn: one node per shared segment; a segment shorter than
    ``min_shared`` is folded into the nodes below it."""
    system = list(range(40))
    turns = [[60 + t] * 40 for t in range(2)]
    seqs = [np.array(system + turns[i // 2] + [90 + i] * 5) for i in range(4)]
    (group,) = shared_groups(seqs, 32)
    assert sorted((n.start, n.end, n.parent) for n in group.nodes) == [
        (0, 40, -1), (40, 80, 0), (40, 80, 0)]  # fmt: skip
    assert [group.depth(k) for k in range(4)] == [80] * 4
    assert group.unique_tokens([len(s) for s in seqs]) == 40 + 2 * 40 + 4 * 5
    short = [np.array(system + [60 + i // 2] * 30 + [i]) for i in range(4)]  # turns of 30 ids
    (group,) = shared_groups(short, 32)
    assert [(n.start, n.end) for n in group.nodes] == [(0, 40)]
    long_turns = [np.array(system[:10] + [60 + i // 2] * 60 + [i]) for i in range(4)]
    assert sorted((g.prefix_len, g.members) for g in shared_groups(long_turns, 32)) == [
        (70, (0, 1)),
        (70, (2, 3)),
    ]  # a short common root is folded into the two below it
    assert shared_groups([np.arange(40), np.arange(40)], 32)[0].prefix_len == 39  # one id left
    assert shared_groups([np.arange(20), np.arange(20)], 32) == []  # below min_shared


def test_a_subset_keeps_the_nodes_its_members_share() -> None:
    system = list(range(40))
    seqs = [np.array(system + [60 + i // 2] * 40 + [90 + i] * 5) for i in range(4)]
    (group,) = shared_groups(seqs, 32)
    pair = group.subset([0, 1])
    assert pair is not None and pair.members == (0, 1)
    assert [(n.start, n.end) for n in pair.nodes] == [(0, 40), (40, 80)]
    cross = group.subset([0, 2])  # different turns: only the system prompt
    assert cross is not None and [(n.start, n.end) for n in cross.nodes] == [(0, 40)]
    assert group.subset([3]) is None


def test_plan_trees_splits_a_row_between_its_continuations() -> None:
    lengths = [60, 70, 80, 50]
    (group,) = shared_groups([np.r_[np.arange(40), np.full(n - 40, i)] for i, n in
                              enumerate(lengths)], 32)  # fmt: skip
    forwards = plan_trees([group], lengths, max_batch_tokens=100)
    rows = [r for fwd in forwards for r in fwd]
    assert all(r.unique_tokens(lengths) <= 100 for r in rows)
    assert sorted(i for r in rows for i in r.members) == [0, 1, 2, 3]


# ---------------------------------------------------------------- the tree against alone


def _close(a: Any, b: Any) -> None:
    np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "mistral", "gpt_oss", "gpt2"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_tree_log_probs_equal_per_sequence(arch: str, backend: str) -> None:
    model = tiny(arch)
    if arch in ("gemma2", "gpt_oss") and backend == "sdpa":
        pytest.skip(f"{arch} does not run on sdpa")
    on, off = _pair(model, attention_backend=backend)
    seqs = group_seqs()
    for temperature in (1.0, 0.7):
        inputs = [SequenceInput(s, prompt_len=PROMPT - 3) for s in seqs[:3]]
        inputs += [
            SequenceInput(s, mask=[int(i % 3 == 1) for i in range(len(s))]) for s in seqs[3:]
        ]
        a = on.score(inputs, temperature=temperature)
        b = off.score(inputs, temperature=temperature)
        for x, y in zip(a.scores, b.scores, strict=True):
            _close(x.logps, y.logps)
        assert a.metrics.shared_prefix_tokens == PROMPT  # one tree row
        assert a.metrics.forward_tokens == _unique(seqs)
        assert b.metrics.forward_tokens == sum(len(s) for s in seqs)
        assert b.metrics.shared_prefix_tokens == 0


def test_teacher_outputs_equal_per_sequence() -> None:
    on, off = _pair(tiny("llama"))
    seqs = _inputs(group_seqs(1))
    spec = TokenOutputs(("logps", "entropy", "topk", "gather", "processed_logps"), topk=5,
                        gather_ids=(1, 7, 3), sampling=Sampling(top_k=7, top_p=0.9))  # fmt: skip
    a = on.score(seqs, temperature=0.8, options=ScoreOptions(outputs=spec))
    b = off.score(seqs, temperature=0.8, options=ScoreOptions(outputs=spec))
    assert a.metrics.shared_prefix_tokens > 0
    for x, y in zip(a.scores, b.scores, strict=True):
        _close(x.logps, y.logps)
        assert x.arrays is not None and y.arrays is not None and x.arrays.keys() == y.arrays.keys()
        for name in x.arrays:
            if x.arrays[name].dtype.kind == "f":
                _close(x.arrays[name], y.arrays[name])
            else:
                np.testing.assert_array_equal(x.arrays[name], y.arrays[name])


def test_rewards_at_each_true_last_token() -> None:
    reward = tiny_reward("llama").float().eval()
    on = StatelessExecutor(ExecutorConfig(mode="reward"), None, reward)
    off = StatelessExecutor(ExecutorConfig(mode="reward", prefix_sharing="off"), None, reward)
    assert on.info["prefix_sharing"] == "on"
    seqs = [SequenceInput(s) for s in group_seqs(2)]
    a, b = on.score(seqs), off.score(seqs)
    assert a.metrics.shared_prefix_tokens == PROMPT
    for x, y in zip(a.scores, b.scores, strict=True):
        assert x.reward is not None and y.reward is not None
        assert abs(x.reward - y.reward) <= ATOL


def test_mode_both_shares_for_both_models() -> None:
    model, reward = tiny("llama"), tiny_reward("llama").float().eval()
    on = StatelessExecutor(ExecutorConfig(mode="both"), model, reward)
    off = StatelessExecutor(ExecutorConfig(mode="both", prefix_sharing="off"), model, reward)
    assert on.info["prefix_sharing"] == "on"
    seqs = _inputs(group_seqs(4))
    a, b = on.score(seqs, mode="both"), off.score(seqs, mode="both")
    assert a.metrics.shared_prefix_tokens > 0
    for x, y in zip(a.scores, b.scores, strict=True):
        _close(x.logps, y.logps)
        assert abs(x.reward - y.reward) <= ATOL  # type: ignore[operator]


def test_a_request_costs_its_unique_tokens_at_intake() -> None:
    """``prepare`` plans the sharing once: ``Prepared.cost`` is what the batcher counts (the
    tree's unique tokens), ``None`` with sharing off or nothing shared."""
    from worker.request import ScoreRequest

    on, off = _pair(tiny("llama"))
    seqs = agent_seqs(30)
    inputs = [SequenceInput(s, prompt_len=5) for s in seqs]
    prompt = AGENT_SYSTEM + AGENT_TURN + AGENT_REPLY
    unique = AGENT_SHARED + sum(len(s) - prompt for s in seqs[:-1]) + len(seqs[-1])
    assert on.prepare(ScoreRequest(inputs)).cost == unique
    assert off.prepare(ScoreRequest(inputs)).cost is None
    assert on.prepare(ScoreRequest(inputs[-1:])).cost is None


def test_linear_attention_is_served_per_sequence_with_its_reason() -> None:
    model = tiny("qwen3_next")
    ex = StatelessExecutor(ExecutorConfig(attention_backend="eager"), model)
    assert ex.info["prefix_sharing"].startswith("off: "), ex.info["prefix_sharing"]
    assert "linear" in ex.info["prefix_sharing"]
    out = ex.score(_inputs(group_seqs(5)))
    assert out.metrics.shared_prefix_tokens == 0


def test_a_window_the_attention_is_not_told_turns_sharing_off() -> None:
    model = tiny("gemma2")  # its layers keep the window they were built with (5) ...
    model.config.sliding_window = 4096  # ... while its mask would apply 4096, past the probe
    ex = StatelessExecutor(ExecutorConfig(attention_backend="eager"), model)
    assert "sliding window 4096" in ex.info["prefix_sharing"], ex.info["prefix_sharing"]


def test_short_prefixes_are_not_shared() -> None:
    on, _ = _pair(tiny("llama"), min_shared_tokens=PROMPT + 10)
    out = on.score(_inputs(group_seqs(6)))
    assert out.metrics.shared_prefix_tokens == 0


def test_oom_splits_a_tree_between_its_continuations(monkeypatch: pytest.MonkeyPatch) -> None:
    on, off = _pair(tiny("llama"))
    forward = on._runner.forward
    real = forward.compute_tree
    sizes: list[int] = []

    def tight(seqs: list[Any], *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(seqs))
        if len(seqs) > 2:
            raise torch.OutOfMemoryError("probe: out of memory")
        return real(seqs, *args, **kwargs)

    monkeypatch.setattr(forward, "compute_tree", tight)
    seqs = _inputs(group_seqs(7, g=6))
    a, b = on.score(seqs), off.score(seqs)
    assert a.metrics.oom_splits >= 1 and max(sizes) > 2 and 2 in sizes
    for x, y in zip(a.scores, b.scores, strict=True):
        _close(x.logps, y.logps)


def test_a_failing_tree_forward_falls_back_per_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    on, off = _pair(tiny("llama"))

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("probe: tree kernel failed")

    monkeypatch.setattr(on._runner.forward, "compute_tree", broken)
    seqs = _inputs(group_seqs(8))
    a, b = on.score(seqs), off.score(seqs)
    assert a.metrics.shared_prefix_tokens == 0
    for x, y in zip(a.scores, b.scores, strict=True):
        _close(x.logps, y.logps)


# ---------------------------------------------------------------- through a real worker


@pytest.mark.redis
def test_grpo_batch_through_redis_equal_on_and_off(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    from tests.support.daemon import thread_worker
    from worker.client import ScoringClient

    model = tiny("llama")
    seqs = group_seqs(9, g=6)[:-1]  # one prompt, six completions
    job = [{"tokens": s, "prompt_len": PROMPT} for s in seqs]
    results: dict[str, Any] = {}
    for sharing in ("auto", "off"):
        executor = StatelessExecutor(ExecutorConfig(prefix_sharing=sharing), model)
        queue = f"{key_prefix}{sharing}"
        with (
            thread_worker(redis_url, queue, executor) as (_, registry),
            ScoringClient(redis_url, queue=queue, wait_for_unknown_queue=True) as client,
        ):
            results[sharing] = client.result(client.submit(job), timeout=60).seqs
        for name in ("scoring_forward_tokens_total", "scoring_shared_prefix_tokens_total"):
            results[f"{sharing}:{name}"] = registry.get_sample_value(name)
    for x, y in zip(results["auto"], results["off"], strict=True):
        _close(x.logps, y.logps)
    unique = PROMPT + sum(len(s) - PROMPT for s in seqs)
    assert results["auto:scoring_forward_tokens_total"] == unique
    assert results["auto:scoring_shared_prefix_tokens_total"] == PROMPT
    assert results["off:scoring_forward_tokens_total"] == sum(len(s) for s in seqs)
    assert results["off:scoring_shared_prefix_tokens_total"] == 0


def test_continuations_in_chunks_give_the_same_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.executor.tree import attention

    on, off = _pair(tiny("mistral"))
    monkeypatch.setattr(attention, "_CHUNK_BYTES", 1)  # one continuation per chunk
    seqs = _inputs(group_seqs(10, g=5))
    a, b = on.score(seqs), off.score(seqs)
    assert a.metrics.shared_prefix_tokens == PROMPT
    for x, y in zip(a.scores, b.scores, strict=True):
        _close(x.logps, y.logps)


def _two_prompts(seed: int) -> list[list[int]]:
    """Two prompts (40 and 51 ids) with three completions each: two rows of different prefixes
    in one forward."""
    rng = np.random.default_rng(seed)
    out = []
    for p in (PROMPT, PROMPT + 11):
        prompt = rng.integers(0, VOCAB, p).tolist()
        out += [prompt + rng.integers(0, VOCAB, 2 + 3 * i).tolist() for i in range(3)]
    return out


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt_oss"])
def test_rows_of_different_prefixes_in_one_forward(arch: str) -> None:
    on, off = _pair(tiny(arch), attention_backend="eager" if arch == "gpt_oss" else "sdpa")
    seqs = [SequenceInput(s, prompt_len=PROMPT - 1) for s in _two_prompts(11)]
    a, b = on.score(seqs, temperature=0.9), off.score(seqs, temperature=0.9)
    assert a.metrics.shared_prefix_tokens == 2 * PROMPT + 11
    assert a.metrics.forwards == 1  # both rows in one forward
    for x, y in zip(a.scores, b.scores, strict=True):
        _close(x.logps, y.logps)


def test_one_model_both_surfaces_reads_rewards_from_the_tree_row() -> None:
    from worker.executor.rewards.pooling import ValueHeadAdapter

    model = tiny("llama")
    torch.manual_seed(5)
    adapter = ValueHeadAdapter(torch.nn.Linear(32, 1))
    on = StatelessExecutor(ExecutorConfig(mode="both"), model, reward_adapter=adapter)
    off = StatelessExecutor(
        ExecutorConfig(mode="both", prefix_sharing="off"), model, reward_adapter=adapter
    )
    assert on.info["prefix_sharing"] == "on"
    seqs = [SequenceInput(s, prompt_len=PROMPT - 1) for s in _two_prompts(12)]
    a, b = on.score(seqs, mode="both"), off.score(seqs, mode="both")
    assert a.metrics.shared_prefix_tokens == 2 * PROMPT + 11
    for x, y in zip(a.scores, b.scores, strict=True):
        _close(x.logps, y.logps)
        assert abs(x.reward - y.reward) <= ATOL  # type: ignore[operator]


def test_token_level_rewards_equal_per_sequence() -> None:
    from worker.executor.rewards.pooling import ValueHeadAdapter

    torch.manual_seed(6)
    adapter = ValueHeadAdapter(torch.nn.Linear(32, 1), token_level=True)
    model = tiny("llama")
    on = StatelessExecutor(ExecutorConfig(mode="both"), model, reward_adapter=adapter)
    off = StatelessExecutor(
        ExecutorConfig(mode="both", prefix_sharing="off"), model, reward_adapter=adapter
    )
    seqs = [SequenceInput(s, prompt_len=5) for s in agent_seqs(13)]
    a, b = on.score(seqs, mode="both"), off.score(seqs, mode="both")
    assert a.metrics.shared_prefix_tokens == AGENT_SHARED
    for x, y in zip(a.scores, b.scores, strict=True):
        assert x.token_scores is not None and y.token_scores is not None
        _close(x.token_scores, y.token_scores)  # every position, shared ones included
        _close(x.logps, y.logps)
        assert abs(x.reward - y.reward) <= ATOL  # type: ignore[operator]


STEP_TAG = 7


@pytest.mark.parametrize("head", ["token-classification", "lm-label"])
def test_step_scores_equal_per_sequence(head: str) -> None:
    """Process-reward step scores at tag positions in the shared turns and in the completions."""
    from worker.scorer.steps import StepOptions

    if head == "token-classification":
        model = tiny_model("ForTokenClassification", "llama", 3, num_labels=2)
        step = StepOptions(tag_id=STEP_TAG, positive_index=1)
    else:
        model = tiny("llama")
        step = StepOptions(tag_id=STEP_TAG, label_token_ids=(11, 12))
    on = StatelessExecutor(ExecutorConfig(mode="reward"), reward_model=model)
    off = StatelessExecutor(ExecutorConfig(mode="reward", prefix_sharing="off"), None, model)
    assert on.info["prefix_sharing"] == "on"
    seqs = agent_seqs(16)
    for seq in seqs:
        seq[10::9] = [STEP_TAG] * len(seq[10::9])  # tags in every segment
    options = ScoreOptions(step=step)
    a = on.score([SequenceInput(s) for s in seqs], options=options)
    b = off.score([SequenceInput(s) for s in seqs], options=options)
    assert a.metrics.shared_prefix_tokens == AGENT_SHARED
    for x, y in zip(a.scores, b.scores, strict=True):
        assert x.step_positions is not None and y.step_positions is not None
        np.testing.assert_array_equal(x.step_positions, y.step_positions)
        _close(x.step_scores, y.step_scores)


def test_multi_objective_rewards_equal_per_sequence() -> None:
    reward = tiny_reward("llama", num_labels=3).float().eval()
    on = StatelessExecutor(ExecutorConfig(mode="reward"), None, reward)
    off = StatelessExecutor(ExecutorConfig(mode="reward", prefix_sharing="off"), None, reward)
    seqs = [SequenceInput(s) for s in agent_seqs(17)]
    a, b = on.score(seqs), off.score(seqs)
    assert a.metrics.shared_prefix_tokens == AGENT_SHARED
    for x, y in zip(a.scores, b.scores, strict=True):
        assert x.rewards is not None and y.rewards is not None and x.rewards.shape == (3,)
        _close(x.rewards, y.rewards)
        assert abs(x.reward - y.reward) <= ATOL  # type: ignore[operator]


# ---------------------------------------------------------------- agent turns: several levels

AGENT_SYSTEM, AGENT_TURN, AGENT_REPLY = 40, 36, 34


def agent_seqs(seed: int) -> list[list[int]]:
    """Three-turn agent rollouts: one system prompt (40 ids), two first turns under it (36 ids
    each), two second turns under each (34 ids), two final completions under each of those
    (2-9 ids): a tree of 1 + 2 + 4 shared nodes over 8 sequences, and an unrelated one."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, AGENT_SYSTEM).tolist()
    out = []
    for _ in range(2):
        turn = rng.integers(0, VOCAB, AGENT_TURN).tolist()
        for _ in range(2):
            reply = rng.integers(0, VOCAB, AGENT_REPLY).tolist()
            for _ in range(2):
                tail = [len(out), *rng.integers(0, VOCAB, int(rng.integers(1, 9))).tolist()]
                out.append(system + turn + reply + tail)  # siblings differ at their first id
    out.append(rng.integers(0, VOCAB, 21).tolist())
    return out


AGENT_SHARED = AGENT_SYSTEM + 2 * AGENT_TURN + 4 * AGENT_REPLY


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "mistral", "gpt_oss", "gpt2"])
def test_agent_turns_share_every_level(arch: str) -> None:
    backend = "eager" if arch in ("gemma2", "gpt_oss") else "sdpa"
    on, off = _pair(tiny(arch), attention_backend=backend)
    seqs = agent_seqs(20)
    prompt = AGENT_SYSTEM + AGENT_TURN + AGENT_REPLY
    inputs = [SequenceInput(s, prompt_len=AGENT_SYSTEM) for s in seqs[:4]]
    inputs += [SequenceInput(s, mask=[int(i % 4 > 1) for i in range(len(s))]) for s in seqs[4:]]
    a, b = on.score(inputs, temperature=0.8), off.score(inputs, temperature=0.8)
    assert a.metrics.shared_prefix_tokens == AGENT_SHARED
    conts = sum(len(s) - prompt for s in seqs[:-1])
    assert a.metrics.forward_tokens == AGENT_SHARED + conts + len(seqs[-1])
    assert a.metrics.forwards == 2  # the tree row, the unrelated sequence
    assert [x.shared_tokens for x in a.scores] == [prompt] * 8 + [0]  # every level on its path
    assert all(y.shared_tokens == 0 for y in b.scores)
    for x, y in zip(a.scores, b.scores, strict=True):
        _close(x.logps, y.logps)


def test_a_tree_split_between_its_members_keeps_their_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tree over the budget is split in trie order: each part keeps the nodes its members
    share; the OOM split of one tree row does the same."""
    on, off = _pair(tiny("llama"), max_batch_tokens=200)
    seqs = [SequenceInput(s, prompt_len=5) for s in agent_seqs(21)]
    a, b = on.score(seqs), off.score(seqs)
    assert a.metrics.forwards > 2  # the tree of 8 (about 460 ids) in parts
    assert AGENT_SYSTEM < a.metrics.shared_prefix_tokens < AGENT_SHARED * 2
    for x, y in zip(a.scores, b.scores, strict=True):
        _close(x.logps, y.logps)
    on, _ = _pair(tiny("llama"))
    forward = on._runner.forward
    real = forward.compute_tree
    rows: list[Any] = []

    def tight(seqs: list[Any], group: Any, tree: Any, *args: Any, **kwargs: Any) -> Any:
        rows.extend(tree)
        if len(seqs) > 2:
            raise torch.OutOfMemoryError("probe: out of memory")
        return real(seqs, group, tree, *args, **kwargs)

    monkeypatch.setattr(forward, "compute_tree", tight)
    c = on.score(seqs)
    assert c.metrics.oom_splits >= 1
    pairs = [r for r in rows if len(r.members) == 2]
    assert pairs and all(len(r.nodes) == 3 for r in pairs)  # system, turn, reply kept
    for x, y in zip(c.scores, b.scores, strict=True):
        _close(x.logps, y.logps)


def test_a_tree_forward_that_returns_a_cache_is_rejected() -> None:
    from transformers import DynamicCache

    from worker.errors import KVCacheRejected

    model = tiny("llama")
    ex = StatelessExecutor(ExecutorConfig(), model)
    assert ex.info["prefix_sharing"] == "on"
    original = model.model.forward

    def leaking(*args: Any, **kwargs: Any) -> Any:  # a backbone that returns a cache anyway
        out = original(*args, **kwargs)
        cache = DynamicCache(config=model.config)
        kv = out.last_hidden_state.new_zeros(1, 2, 4, 8)  # [R, kv_heads, T, d]
        cache.update(kv, kv.clone(), 0)
        out["past_key_values"] = cache
        return out

    model.model.forward = leaking
    seqs = [SequenceInput(s, prompt_len=PROMPT) for s in group_seqs(14)[:-1]]  # one tree row
    with pytest.raises(KVCacheRejected, match="KV cache"):
        ex.score(seqs)


def test_identical_and_nested_sequences() -> None:
    on, off = _pair(tiny("llama"))
    base = group_seqs(15)[0]
    seqs = [base, list(base), base[:-2], [*base, 3, 4, 5]]  # equal twice, a prefix of the others
    inputs = [SequenceInput(s, prompt_len=PROMPT - 5) for s in seqs]
    a, b = on.score(inputs), off.score(inputs)
    assert a.metrics.shared_prefix_tokens == len(base) - 3  # one id short of the shortest
    for x, y in zip(a.scores, b.scores, strict=True):
        _close(x.logps, y.logps)


# ---------------------------------------------------------------- flex: a BlockMask of the rows


def _tree_layout(sets: list[list[list[int]]]) -> tuple[Any, list[np.ndarray], list[int]]:
    """One tree forward of each set's shared trees (several rows, rows of unequal widths, so
    with fill): its layout, the sequences, the batch order."""
    from worker.executor.tree.layout import tree_batch

    seqs = [np.asarray(s, dtype=np.int64) for group in sets for s in group]
    rows, first = [], 0
    for group in sets:
        found = shared_groups(seqs[first : first + len(group)], 32)
        rows += [SharedGroup(g.nodes, tuple(first + i for i in g.members), g.attach) for g in found]
        first += len(group)
    batch, order = tree_batch(seqs, rows, list(range(len(seqs))))
    return batch.tree, seqs, order


def _alone(layout: Any, seqs: list[np.ndarray], order: list[int], window: int | None) -> Any:
    """Naive: which row slots each slot sees, ``[R, T, T]``, from every sequence alone: the
    slot of its position ``p`` sees the slots of its positions ``p - window < j <= p``."""
    rows, width = layout.seg.shape
    seen = np.zeros((rows * width, rows * width), dtype=bool)
    for k, i in enumerate(order):
        n = len(seqs[i])
        flat = layout.flat(k, np.arange(n))  # [n] slot of each position
        p = np.arange(n)
        ok = (p[None, :] <= p[:, None]) & (p[:, None] - p[None, :] < (window or n + 1))
        seen[np.ix_(flat, flat)] |= ok
    out = np.zeros((rows, width, width), dtype=bool)
    for r in range(rows):
        part = slice(r * width, (r + 1) * width)
        out[r] = seen[part, part]
        assert not seen[part].any(axis=0)[: r * width].any()  # never another row
    return out


@pytest.mark.parametrize("window", [None, 5, 40])
def test_the_row_maps_see_what_each_sequence_sees_alone(window: int | None) -> None:
    """``dense_mask`` (what the flex ``mask_mod`` computes) from the layout's ``seg``,
    ``seg_end`` and ``positions``: exactly the slots of each sequence's own earlier positions
    within the window; fill slots see nothing and are seen by nothing."""
    from worker.executor.tree.attention import dense_mask

    layout, seqs, order = _tree_layout([agent_seqs(40)[:-1], group_seqs(41)[:-1]])
    rows, width = layout.seg.shape
    assert rows == 2 and (layout.seg == -1).any()  # the narrower row has fill
    got = dense_mask(layout, window)  # [R, P, P]
    assert got.shape[1] % 128 == 0 and not got[:, width:].any() and not got[:, :, width:].any()
    np.testing.assert_array_equal(
        got[:, :width, :width].numpy(), _alone(layout, seqs, order, window)
    )


@pytest.mark.parametrize("block", [16, 128])
@pytest.mark.parametrize("window", [None, 5])
def test_the_block_lists_equal_torchs_own(
    monkeypatch: pytest.MonkeyPatch, block: int, window: int | None
) -> None:
    """``block_mask`` builds the tile lists ``create_block_mask`` would build from the same
    ``mask_mod`` (skipped tiles, tiles run without the mask), and caches it per window."""
    from torch.nn.attention.flex_attention import create_block_mask

    from worker.executor.tree import attention

    monkeypatch.setattr(attention, "_BLOCK", block)
    monkeypatch.setattr(attention, "_MASK_SLOTS", 1)  # one query tile per step
    layout, _, _ = _tree_layout([agent_seqs(42)[:-1], _two_prompts(43)])
    mine = attention.block_mask(layout, window)
    assert attention.block_mask(layout, window) is mine and list(layout.masks) == [window]
    rows, width = layout.seg.shape
    theirs = create_block_mask(mine.mask_mod, rows, None, width, width, "cpu", BLOCK_SIZE=block)
    assert (mine.kv_num_blocks + mine.full_kv_num_blocks < width // block).any()  # some skipped
    if block == 16 and window is None:  # tiles inside a root node need no mask
        assert mine.full_kv_num_blocks.sum() > 0
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        torch.testing.assert_close(getattr(mine, name), getattr(theirs, name), rtol=0, atol=0)


@pytest.mark.parametrize("heads", [(4, 2), (3, 1)])
def test_flex_tree_attention_equals_the_gathered_math(heads: tuple[int, int]) -> None:
    """``tree_attention`` with ``kernel="flex"`` against the eager math of the same layout:
    windows, softcap, GQA (a head count that is not a power of two repeats K/V instead)."""
    from dataclasses import replace

    from worker.executor.tree.attention import tree_attention

    layout, _, _ = _tree_layout([agent_seqs(44)[:-1], group_seqs(45)[:-1]])
    rows, width = layout.seg.shape
    h, kv = heads
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, h, width, 8, generator=gen)  # [R, H, T, D]
    k, v = (torch.randn(rows, kv, width, 8, generator=gen) for _ in range(2))
    real = (layout.seg >= 0)[..., None, None]  # [R, T, 1, 1] slots that are not fill
    module = torch.nn.Module()
    for window, softcap in ((None, None), (5, None), (None, 1.5), (7, 2.0)):
        kw = {"scaling": 0.3, "sliding_window": window, "softcap": softcap}
        flex = replace(layout, kernel="flex", masks={})
        got, _ = tree_attention(module, q, k, v, None, scoring_tree=flex, **kw)
        want, _ = tree_attention(
            module, q, k, v, None, scoring_tree=replace(layout, kernel="eager"), **kw
        )
        assert list(flex.masks) == [window]
        torch.testing.assert_close(got * real, want * real, rtol=0, atol=2e-6)
        assert not got[~real.expand_as(got)].any()  # fill slots: zeros


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_flex_backend_tree_rows_read_the_nodes_in_place(
    monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """On ``flex_attention`` a tree forward is one flex call per layer over a ``BlockMask``
    (no context K/V gathered per segment), equal to every sequence alone: the agent set (three
    levels) and a GRPO group in one call (two rows of one forward), with temperature and masks;
    mistral's window (5) is far shorter than the rows' positions. On a CPU both sides run
    torch's uncompiled flex math (``worker.executor.flex``), the same assertions on every CPU."""
    from worker.executor.tree import attention

    on, off = _pair(tiny(arch), attention_backend="flex_attention", self_check=False)
    assert on.info["attention_backend"] == off.info["attention_backend"] == "flex_attention"
    windows: list[int | None] = []
    real_flex = attention._flex

    def flex(*args: Any, **kwargs: Any) -> Any:
        windows.append(kwargs["window"])
        return real_flex(*args, **kwargs)

    def gathered(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("context K/V gathered on the flex backend")

    monkeypatch.setattr(attention, "_flex", flex)
    monkeypatch.setattr(attention, "_gathered", gathered)
    seqs = agent_seqs(46)[:-1] + group_seqs(47)[:-1]  # every sequence in a tree
    inputs = [
        SequenceInput(s, prompt_len=PROMPT - 3)
        if n % 2
        else SequenceInput(s, mask=[int(i % 3 == 1) for i in range(len(s))])
        for n, s in enumerate(seqs)
    ]
    a, b = on.score(inputs, temperature=0.7), off.score(inputs, temperature=0.7)
    assert a.metrics.shared_prefix_tokens == AGENT_SHARED + PROMPT
    assert a.metrics.backend == "flex_attention" and a.metrics.forwards == 1
    layers = on._runner.forward.models[0].config.num_hidden_layers
    assert windows == [5 if arch == "mistral" else None] * layers  # one tree forward
    for x, y in zip(a.scores, b.scores, strict=True):
        _close(x.logps, y.logps)
