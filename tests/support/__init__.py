"""Helpers shared by the tests, imported one way: ``from tests.support.<module> import ...``.

- ``models``: tiny transformers models built from configs with a fixed seed (the package's one
  builder, ``worker.demo.tiny``), the SmolLM2 GGUF.
- ``daemon``: subprocess workers (the package's one launcher, ``worker.processes.local``), the
  demo started for a test, enqueue/collect helpers, waiting.
- ``cluster``: a local Redis Cluster fixture.
- ``client``: ``Responder``, a worker double for the client tests, and in-flight counters.
- ``crash_worker``: a worker that dies on a marker token (run as a script).
- ``ops``: the PromQL reference extractor, the exported-series catalog, dashboard/alert readers.
- ``architecture``: the layer rules of ``worker/`` and the import/size checker.
- ``adapters``: a tiny base model on disk with PEFT LoRA adapters, and their float64 reference.
- ``failover``: a Redis Cluster of primaries with replicas, and the failover of a primary.
- ``gateway``: the gateway served in a background thread for real HTTP clients.
- ``gpu_box``: an interpreter built like the GPU machine's (the GPU check's CPU run).
- ``oom``: a simulated device memory that runs out inside a forward.
- ``tp_ranks``: one rank of the two-rank tensor-parallel scenarios (run as a module).
"""
