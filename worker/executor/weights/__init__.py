"""The weights a worker scores with: loading checkpoints (local folders, hub ids offline,
GGUF files), per-job LoRA adapters and full-checkpoint versions, and which of them stay resident.

* ``loading``: devices, dtypes, ``load_model``/``load_models`` and the tokenizers.
* ``adapters``: reading a PEFT LoRA adapter and applying its delta to one forward.
* ``residency``: ``WeightsConfig`` and the LRU of resident adapters and versions.
* ``router``: ``WeightsRouter``, which routes each job to the base, an adapter or a version.
"""
