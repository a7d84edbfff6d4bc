"""The GPU check: ``python3 -m worker.devtools.gpu_check --out DIR`` on a GPU machine with
torch and transformers but no network, no Redis and no venv (README, *GPU check*).

* ``check``: the runner (options, the steps with their budgets, the report files).
* ``steps``: each step run as its own process (``python -m worker.devtools.gpu_check.steps``);
  ``e2e``, the end-to-end step through an embedded Valkey and a worker subprocess.
* ``model``, ``shapes``: the benchmark model and its sizes, FLOPs and each device's bf16 peak.
* ``record``, ``report``: a step's record and the markdown report.
* ``wheels``: the pure-Python wheels the GPU machine lacks (``make gpu-wheels``) and their install.
"""
