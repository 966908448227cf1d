"""A sink call again after a backoff while it fails transiently: how the writer and the snapshots
call the sinks (a :class:`~cdcd.errors.DefiniteSinkError` or any other error stops cdcd)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

from cdcd.errors import TransientSinkError
from cdcd.stats import SinkStats

log = structlog.get_logger("cdcd.writer")

T = TypeVar("T")


async def retrying(
    call: Callable[[], Awaitable[T]],
    what: str,
    stats: SinkStats,
    failed: TransientSinkError | None = None,
) -> T:
    """``await call()``, again after a backoff (0.5 s doubling to 10 s) while it raises
    :class:`TransientSinkError`; ``failed``: it already did once (wait before the first call)."""
    delay = 0.5
    while True:
        if failed is not None:
            stats.retries += 1
            log.warning(
                "sink call failed; retrying",
                sink=stats.type_name,
                call=what,
                error=str(failed),
                backoff_s=delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
        try:
            return await call()
        except TransientSinkError as exc:
            failed = exc
