"""Tensor parallelism: one model over the N devices of a node, as one worker.

A group is N processes, one per device. Rank 0 runs the ordinary daemon with a ``GroupScorer``
and alone talks to Redis; each call it scores is broadcast to ranks 1..N-1, which run the same
forward on their shards (``follow``). transformers shards the backbone (its
``DistributedConfig(tp_size=N)``); this package adds what it lacks for scoring:

* ``plan``: the tensor-parallel plan, one function of a checkpoint's config and N, and every
  refusal at start (no plan for the architecture; N against the heads, the KV heads, the
  vocabulary; more ranks than devices);
* ``collectives``: every collective of the group, with which ranks call what in which order,
  and joining the group;
* ``head``: the vocabulary-parallel LM head (per-shard statistics, combined; never ``[N, V]``);
* ``forward``: ``ParallelForward``, the single-device forward with that head and a vote after
  each forward that makes a failure on one rank the same failure on all;
* ``executor``: ``ParallelExecutor``, the executor of one rank (loading, info, per-rank peaks);
* ``group``: the leader's ``GroupScorer`` and the followers' ``follow`` loop.

Processes, heartbeats and the step deadline are the command line's
(``worker.processes.tp_group``).
"""
