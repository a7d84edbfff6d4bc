"""The image metrics of a worker serving a vision-language model: files decoded, processor
cache hits, image tokens, vision-tower seconds and images. A part of ``WorkerMetrics`` (built
from the same registry), recorded per batch from the executor's ``BatchMetrics`` numbers.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class ImageMetrics:
    """The image metrics (a base of ``WorkerMetrics``)."""

    def build_image_metrics(self, r: CollectorRegistry) -> None:
        """Create the image metrics in registry ``r``."""
        self.images_decoded = Counter(
            "scoring_images_decoded_total", "Image files decoded at intake.", registry=r
        )
        self.processor_cache_hits = Counter(
            "scoring_processor_cache_hits_total",
            "Images whose processor output came from the cache (same content and options).",
            registry=r,
        )
        self.image_tokens = Counter(
            "scoring_image_tokens_total",
            "Image tokens of the sequences scored (their positions are never scored).",
            registry=r,
        )
        self.vision_seconds = Counter(
            "scoring_vision_tower_seconds_total", "Seconds in the vision tower.", registry=r
        )
        self.vision_images = Counter(
            "scoring_vision_tower_images_total",
            "Images through the vision tower (once per distinct image of a call).",
            registry=r,
        )

    def record_images(
        self,
        *,
        decoded: int,
        cache_hits: int,
        image_tokens: int,
        vision_s: float,
        vision_images: int = 0,
    ) -> None:
        """Record one batch's images."""
        self.vision_images.inc(vision_images)
        self.images_decoded.inc(decoded)
        self.processor_cache_hits.inc(cache_hits)
        self.image_tokens.inc(image_tokens)
        self.vision_seconds.inc(vision_s)
