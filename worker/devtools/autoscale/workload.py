"""The RL workload: steps of B x G rollouts arriving in a burst after each generation phase.

A step is a generation phase of ``gen_s`` seconds (the policy samples; the scoring queue gets
nothing), then the B x G rollouts of the step are submitted at once (over ``spread_s`` when set),
and the trainer waits until every one of them has its score; the next generation phase starts
then. After the steps comes one more generation phase and a small tail batch of ``tail_jobs``
jobs (an evaluation, a last partial step): it counts in no figure, but a setting that leaves it
unserved (an ``activationLagCount`` above its size at zero replicas) strands the run. A
rollout is one job of ``prompt + completion`` tokens, both drawn uniformly from their
ranges with a fixed seed (defaults: the ragged RL lengths of the ``naive`` benchmark, prompts
64-256 and completions 16-768 tokens).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import simpy

from worker.devtools.autoscale.fleet import Job, Process, Stream


@dataclass(frozen=True)
class RlWorkload:
    """One RL run: ``steps`` steps of ``prompts x group`` rollouts."""

    gen_s: float
    prompts: int = 64
    group: int = 8
    steps: int = 6
    prompt_tokens: tuple[int, int] = (64, 256)
    completion_tokens: tuple[int, int] = (16, 768)
    spread_s: float = 0.0
    seed: int = 7
    tail_jobs: int = 16  # a last, small batch (an evaluation, a partial step); 0: none

    def __post_init__(self) -> None:
        if self.gen_s < 0 or self.prompts <= 0 or self.group <= 0 or self.steps < 2:
            raise ValueError(f"need gen_s >= 0, prompts, group > 0 and steps >= 2: {self}")

    @property
    def rollouts(self) -> int:
        """Jobs per step (B x G)."""
        return self.prompts * self.group

    def sizes(self) -> list[list[int]]:
        """Tokens of every rollout, per step (the same for every setting: fixed seed); the tail
        batch last, when there is one."""
        rng = random.Random(self.seed)
        steps = [self.rollouts] * self.steps + ([self.tail_jobs] if self.tail_jobs else [])
        return [
            [
                rng.randint(*self.prompt_tokens) + rng.randint(*self.completion_tokens)
                for _ in range(n)
            ]
            for n in steps
        ]


@dataclass
class StepRecord:
    """One step as the trainer saw it."""

    gen_start_s: float
    submitted_s: float
    done_s: float = 0.0
    jobs: list[Job] = field(default_factory=list)

    @property
    def wait_s(self) -> float:
        """Time the trainer waited for the step's scores."""
        return self.done_s - self.submitted_s


class Trainer:
    """Runs the steps of a workload against a stream; records each step."""

    def __init__(self, env: simpy.Environment, stream: Stream, workload: RlWorkload) -> None:
        self.env, self.stream, self.workload = env, stream, workload
        self.steps: list[StepRecord] = []
        self._left = 0
        self._all_done: simpy.Event | None = None
        stream.on_done.append(self._done)
        self.process = env.process(self._run())

    def _done(self, job: Job) -> None:
        self._left -= 1
        if self._left == 0 and self._all_done is not None:
            self._all_done.succeed()

    def _run(self) -> Process:
        w, next_id = self.workload, 0
        for step, sizes in enumerate(w.sizes()):
            gen_start = self.env.now
            yield self.env.timeout(w.gen_s)
            record = StepRecord(gen_start, self.env.now)
            self.steps.append(record)
            self._left = len(sizes)
            self._all_done = self.env.event()
            gap = w.spread_s / len(sizes)
            for tokens in sizes:
                job = Job(next_id, tokens, self.env.now, step)
                next_id += 1
                record.jobs.append(job)
                self.stream.add(job)
                if gap > 0:
                    yield self.env.timeout(gap)
            yield self._all_done
            record.done_s = self.env.now
