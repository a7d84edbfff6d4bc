"""What ``scoring-worker demo`` needs besides the worker: sample rollouts (``samples``), the tiny
random models built from a config with a fixed seed (``tiny``: its checkpoints, and the models
tests, benchmarks and the GPU check build) and an embedded Valkey server (``embedded``)."""
