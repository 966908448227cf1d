"""The process around the pipeline: the event loop (uvloop), signals, GC settings.

``cdcd run`` comes here (:func:`run`); so do the other commands that need an event loop
(:func:`run_async`). Nothing here knows how the pipeline works inside.
"""

from __future__ import annotations

import asyncio
import gc
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a uvloop event loop (asyncio's own if uvloop is missing)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def tune_gc() -> None:
    """A large transaction is millions of buffered objects. With the default thresholds
    (700, 10, 10) the cyclic GC re-traverses them again and again (a third of the CPU time in
    the benchmark's W1); collecting young objects every 50,000 allocations keeps the cost small
    while cyclic garbage (rare here) is still collected."""
    gc.set_threshold(50_000, 20, 100)


def on_stop_signals(handler: Callable[[], None]) -> Callable[[], None]:
    """Call ``handler`` on SIGTERM and SIGINT; returns what removes the handlers."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handler)

    def remove() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    return remove


async def _run_pipeline(config: Any, endpos: int | None) -> int:
    from cdcd.pipeline.service import Pipeline

    pipeline = Pipeline(config, endpos=endpos)
    remove = on_stop_signals(pipeline.request_stop)
    try:
        return await pipeline.run()
    finally:
        remove()


def run(config: Any, endpos: int | None) -> int:
    """``cdcd run``: the daemon. Returns the exit code."""
    tune_gc()
    return int(run_async(_run_pipeline(config, endpos)))
