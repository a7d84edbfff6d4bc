"""The gateway's settings: one frozen dataclass, built once by ``scoring-worker gateway`` from
flags and ``SCORING_GATEWAY_*`` variables and passed down (nothing here reads the environment)."""

from __future__ import annotations

from dataclasses import dataclass

#: Routes that answer without the API key (a load balancer's probe has none).
OPEN_PATHS = frozenset({"/health", "/health/"})


@dataclass(frozen=True)
class GatewayConfig:
    """How the gateway serves (every field has the flag of the same name, ``--api-key`` ...).

    ``api_key``: when set, every route but ``/health`` needs ``Authorization: Bearer <key>`` or
    ``X-API-Key: <key>`` (the Tinker SDK's header; it only sends keys that start ``tml-``).
    ``model_name``: the name ``/v1/models`` lists first and a request's ``model`` may carry for
    the base weights (None: the ``model`` the live workers report). ``timeout_s``: how long a
    request waits for its scores before a 504 (also the job's ``deadline_ms``). ``window_ms``,
    ``max_batch_seqs``, ``max_batch_tokens``: the coalescing of concurrent requests into jobs.
    ``max_body_bytes`` (413 above) and ``max_concurrent`` (503 above) are the limits.
    ``resubmit_after_s``: a job without a result that long is added again (None: off).
    ``worker_check_s``: how long an answer about the queue (live workers, a consumer group) is
    reused. The queue rule, per request: a queue that is served, or has a consumer group, takes
    the request and it waits for a worker within ``timeout_s`` (scale from zero, restarts); a
    queue with neither is refused (503 ``unknown_queue``) unless ``allow_unknown_queue`` (a fleet
    that creates its group on first start). ``check_queue`` False: nothing is asked (every
    request waits; ``/health`` says nothing of the queue).
    ``tinker_max_pending``: Tinker samples submitted and not yet retrieved, at most (more get
    429, which the SDK backs off from); ``tinker_result_ttl_s``: how long an answer waits to be
    retrieved before it is dropped. ``image_token_id``: the served vision-language model's
    image token, what a Tinker ``ImageChunk`` expands to (None: image chunks are refused).
    ``allow_redis_eviction``: serve even when a Redis primary's ``maxmemory-policy`` is not
    ``noeviction`` (refused at start otherwise); ``redis_check_interval_s``: how often the
    policy, persistence and memory are read again (``scoring_redis_*``, ``/health``).
    """

    api_key: str | None = None
    model_name: str | None = None
    timeout_s: float = 100.0
    window_ms: float = 5.0
    max_batch_seqs: int = 256
    max_batch_tokens: int = 1 << 20
    max_body_bytes: int = 64 * 1024 * 1024
    max_concurrent: int = 8192
    resubmit_after_s: float | None = 30.0
    worker_check_s: float = 1.0
    check_queue: bool = True
    allow_unknown_queue: bool = False
    tinker_max_pending: int = 4096
    tinker_result_ttl_s: float = 600.0
    image_token_id: int | None = None
    allow_redis_eviction: bool = False
    redis_check_interval_s: float = 60.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.window_ms < 0:
            raise ValueError(f"window_ms must be >= 0, got {self.window_ms}")
        if self.max_batch_seqs < 1 or self.max_batch_tokens < 1:
            raise ValueError("max_batch_seqs and max_batch_tokens must be >= 1")
        if self.max_body_bytes < 1 or self.max_concurrent < 1:
            raise ValueError("max_body_bytes and max_concurrent must be >= 1")
        if self.tinker_max_pending < 1 or self.tinker_result_ttl_s <= 0:
            raise ValueError("tinker_max_pending must be >= 1 and tinker_result_ttl_s > 0")
        if self.image_token_id is not None and not 0 <= self.image_token_id < 2**31:
            raise ValueError(f"image_token_id must be a token id >= 0: {self.image_token_id}")
        if self.redis_check_interval_s <= 0:
            raise ValueError(f"redis_check_interval_s must be > 0: {self.redis_check_interval_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for no key)")
