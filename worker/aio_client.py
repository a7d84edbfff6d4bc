"""Documented import path of the asyncio producer.

``from worker.aio_client import AsyncScoringClient`` keeps working.

The implementation lives in ``worker.client.aio``; this module only re-exports it.
"""

from worker.client.aio import AsyncScoringClient

__all__ = ["AsyncScoringClient"]
