"""On-policy distillation against a scoring worker: one request for the teacher's per-token
outputs, three KL losses from them (see docs/distillation.md).

Runnable as it stands against any worker serving a reference model on the queue (``--vocab`` its
vocabulary; 259 for the tiny models of ``scoring-worker demo --save-models``):

    python docs/examples/distill.py --redis-url redis://127.0.0.1:6379/0 --queue default --vocab 259

The "student" here is a random numpy model so the file needs no torch: in a trainer, its log-probs
come from the policy's forward (with gradients) and the losses below are written in torch the same
way. Row ``i`` of every array belongs to the ``i``-th scored (completion) token.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from worker.client import ScoringClient

K = 16  # the teacher's top-k and the student's top-k


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax."""
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def log1mexp(x: np.ndarray) -> np.ndarray:
    """``log(1 - exp(x))`` for ``x <= 0``, stable at both ends."""
    x = np.minimum(x, -1e-12)
    return np.where(x > -0.693, np.log(-np.expm1(x)), np.log1p(-np.exp(x)))


def reverse_kl(student_logps: np.ndarray, teacher_logps: np.ndarray) -> np.ndarray:
    """Per-token reverse KL estimate on the student's own samples: ``log q(y) - log p(y)``
    (its expectation under the student is ``KL(q || p)``); ``[n]``."""
    return student_logps - teacher_logps


def topk_forward_kl(
    teacher_ids: np.ndarray,
    teacher_topk: np.ndarray,
    teacher_tail: np.ndarray,
    student_lp: np.ndarray,
) -> np.ndarray:
    """``KL(p || q)`` over the teacher's top k plus one bucket for the rest of the vocabulary:
    ``sum_top p (log p - log q) + p_tail (log p_tail - log q_tail)``; ``[n]``. ``student_lp``:
    the student's full log-probs ``[n, V]`` (in a trainer: its logits at those positions)."""
    s_top = np.take_along_axis(student_lp, teacher_ids.astype(np.int64), axis=1)  # [n, k]
    s_tail = log1mexp(np.logaddexp.reduce(s_top, axis=1))  # [n] student mass outside
    t_top = teacher_topk.astype(np.float64)
    kl = (np.exp(t_top) * (t_top - s_top)).sum(axis=1)
    finite = np.isfinite(teacher_tail)  # -inf: the top k hold all the teacher's mass
    t_tail = np.where(finite, teacher_tail, 0.0)
    tail = np.where(finite, np.exp(t_tail) * (t_tail - s_tail), 0.0)
    return kl + tail


def gathered_reverse_kl(student_topk: np.ndarray, teacher_at_student: np.ndarray) -> np.ndarray:
    """``KL(q || p)`` restricted to the student's own top k, both renormalised there; ``[n]``.
    ``teacher_at_student``: the teacher's log-probs gathered at the student's top-k ids."""
    q = log_softmax(student_topk.astype(np.float64))
    p = log_softmax(teacher_at_student.astype(np.float64))
    return (np.exp(q) * (q - p)).sum(axis=1)


def distill_step(client: Any, vocab: int, seed: int = 0) -> dict[str, float]:
    """One trainer step: rollouts from the student, one teacher request, the three losses."""
    rng = np.random.default_rng(seed)
    rollouts, student = [], []
    for n in (24, 40):
        tokens = rng.integers(0, vocab, n)
        prompt = n // 3
        lp = log_softmax(rng.normal(size=(n - prompt, vocab)))  # student log-probs per position
        top = np.argsort(-lp, axis=1)[:, :K].astype(np.int32)  # the student's top-k ids
        rollouts.append({"tokens": tokens, "prompt_len": prompt, "gather_ids": top})
        student.append(lp)
    teacher = client.score(
        rollouts, outputs=("logps", "entropy", "topk", "gather"), topk=K, timeout=120
    )
    losses: dict[str, list[np.ndarray]] = {"reverse_kl": [], "topk_forward_kl": [], "gather": []}
    for seq, lp, t in zip(rollouts, student, teacher, strict=True):
        labels = seq["tokens"][seq["prompt_len"] :]
        student_logps = lp[np.arange(len(labels)), labels]
        losses["reverse_kl"].append(reverse_kl(student_logps, t.logps))
        losses["topk_forward_kl"].append(
            topk_forward_kl(t.topk_ids, t.topk_logps, t.topk_tail_logp, lp)
        )
        student_topk = np.take_along_axis(lp, seq["gather_ids"].astype(np.int64), axis=1)
        losses["gather"].append(gathered_reverse_kl(student_topk, t.gather_logps))
        # high-entropy tokens (the top 20%) are the ones an entropy-aware loss would keep
        assert t.entropy.shape == labels.shape
    return {name: float(np.concatenate(v).mean()) for name, v in losses.items()}


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Parse the flags, run one step, print and return the mean losses."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--queue", default="default", help="the workers' --queue")
    parser.add_argument("--vocab", type=int, required=True, help="the teacher's vocabulary size")
    args = parser.parse_args(argv)
    with ScoringClient(args.redis_url, queue=args.queue) as client:
        losses = distill_step(client, args.vocab)
    for name, value in losses.items():
        print(f"{name:>16}: {value:.4f}")
    return losses


if __name__ == "__main__":
    main()
