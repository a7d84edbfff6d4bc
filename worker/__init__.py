"""scoring-worker: stateless scoring of RL rollouts from Redis Streams.

Importing ``worker`` (and ``worker.client``/``worker.protocol``) never imports torch.
"""

__version__ = "0.1.0"
