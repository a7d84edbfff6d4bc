"""The LM head: completion-only log-probs and teacher outputs without a ``[rows, V]`` float32
block in main memory.

* ``logprobs``: the whole-vocabulary blocks (``chunked_token_logps``), the logit transforms and
  the naive reference they are checked against.
* ``tiles``: the vocabulary-tiled head used on CPU (a running logsumexp over ``[rows, tile]``
  slices); ``sums``, the running state both tile folds share; ``topk``, the torch fold's running
  top-k; ``native``, the compiled fold (``native_tiles.c``, built on first use).
* ``teacher``: distillation outputs (entropy, top-k with its tail, log-probs at given ids);
  ``sampling``, the sampler-processed distribution (top-k / top-p / min-p); ``hidden``, the
  rows the head reads (a job's ``hidden`` output) and what turns them into logits.
"""
