"""The GPU check: ``python3 -m worker.devtools.gpu_check --out DIR`` on a GPU machine with
torch and transformers but no network, no Redis, no venv and perhaps no pip (docs/gpu-check.md).

* ``check``: options, the steps with their budgets, the wheels preflight, the report files.
* ``runner``: each step as its own process under its limit, with every file under ``OUT``.
* ``steps``: the measured steps (``python -m worker.devtools.gpu_check.steps``); ``e2e``, the
  end-to-end step through an embedded Valkey and a worker subprocess.
* ``model``, ``shapes``: the benchmark model and its sizes, FLOPs and each device's bf16 peak.
* ``record``, ``report``: a step's record (and its deadline) and the markdown report.
* ``wheels``: the wheels the GPU machine lacks (``make gpu-wheels``) and their install.
"""
