"""The benchmarks (``make bench``, ``scoring-worker bench --suite NAME``): each module has a
``main(argv)`` and runs alone as ``python -m worker.devtools.bench.NAME``.

* ``executor``: the executor against the naive in-trainer way, in-process (``teacher``: its
  distillation-outputs row); ``floor``: the executor against the floor of one forward per
  sequence; ``naive``: end to end through Redis and a worker against the naive way.
* ``e2e``: queue overhead (in-process vs a pipelined worker); ``small``: latency of small jobs;
  ``capacity``: the queue's jobs/s with the no-op scorer; ``soak``: a long run's drift;
  ``fairness``: one worker's weighted queues under a burst.
* ``adapters``: per-job LoRA adapters on SmolLM2; ``dtype``: float32 vs bfloat16 on the CPU;
  ``gateway``: the HTTP gateway vs ``score_many``; ``tensor_parallel``: per-rank memory of a
  sharded model; ``coldstart``: process start to ready and to the first result.
* ``group_arith``: no measurement, the FLOPs and K/V bytes of group scoring with and without
  prefix sharing on GPU-sized model shapes (docs/performance.md).
"""
