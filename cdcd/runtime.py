"""The process around the pipeline: the event loop (uvloop), signals, GC and allocator
settings, the modules the daemon keeps out.

``cdcd run`` comes here (:func:`run`); so do the other commands that need an event loop
(:func:`run_async`). Nothing here knows how the pipeline works inside.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import importlib.abc
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from cdcd.errors import EXIT_FAILURE

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


#: glibc's ``mallopt`` parameter for the size from which blocks are mapped on their own
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 128 * 1024


def return_large_blocks() -> None:
    """Large blocks (128 KiB and more: Arrow's buffers, a Parquet row group's pages, chunks of a
    compact transaction) go back to the system when freed. glibc starts that way but raises
    the threshold to the size of each large block freed (up to 32 MiB), after which such
    blocks come from its heap, where what is freed stays in the process: the TOAST workload
    of ``tests/integration/test_sink_memory.py`` peaked at 170-180 MiB that way, 160-165 with
    the threshold fixed (``mallopt(M_MMAP_THRESHOLD)``, which also stops the raising). A
    user's ``MALLOC_MMAP_THRESHOLD_`` wins; without glibc's ``mallopt`` nothing changes."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


#: what ``cdcd run`` does not load (:func:`keep_unused_modules_out`); ``CDCD_ALLOW_NUMPY=1``
#: lets them load, for a third-party sink that needs them
_UNUSED_MODULES = ("numpy", "pandas")
ALLOW_NUMPY_ENV = "CDCD_ALLOW_NUMPY"


class _Refuse(importlib.abc.MetaPathFinder):
    """Refuses to import :data:`_UNUSED_MODULES` (see :func:`keep_unused_modules_out`)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.partition(".")[0] in _UNUSED_MODULES:
            raise ModuleNotFoundError(
                f"{name} is not loaded in cdcd run (set {ALLOW_NUMPY_ENV}=1 to allow it)",
                name=name,
            )
        return None


def keep_unused_modules_out() -> None:
    """Keep numpy and pandas out of the daemon. pyarrow (the Parquet sink) imports numpy when
    it is installed, and pandas the first time it converts a Python sequence (``pa.array``: is
    it a pandas object?): about 17 and 31 MB of RSS that cdcd never uses, enough to take a
    Parquet sink past ``buffer.memory_limit`` + 150 MB (docs/guarantees.md). Refused, pyarrow
    carries on without them, as where they are not installed (the container image)."""
    if os.environ.get(ALLOW_NUMPY_ENV) == "1":
        return
    if any(name in sys.modules for name in _UNUSED_MODULES):
        return  # already loaded (cdcd run inside a larger program): too late to save anything
    if not any(isinstance(finder, _Refuse) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Refuse())


def on_stop_signals(handler: Callable[[], None]) -> Callable[[], None]:
    """Call ``handler`` on the first SIGTERM or SIGINT; returns what removes the handlers.

    The first signal asks for an orderly stop. From then on both signals have their default
    action again, so a second one ends the process at once, by the kernel, even while the event
    loop is busy (exit status 128 + the signal's number: 143 for SIGTERM, 130 for SIGINT). That
    is as safe as a crash: nothing is confirmed that is not durable, and a file is published
    complete or not at all.
    """
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    stopping = False

    def on_signal(number: int) -> None:
        nonlocal stopping
        if stopping:  # a second one the loop read along with the first
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
            return
        stopping = True
        for sig in signals:
            signal.signal(sig, signal.SIG_DFL)
        handler()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal, int(sig))

    def remove() -> None:
        for sig in signals:
            loop.remove_signal_handler(sig)

    return remove


#: how long past ``shutdown.grace_period`` a stopping daemon may take before it is ended
WATCHDOG_MARGIN = 10.0


def exit_after(seconds: float, code: int) -> None:
    """End the process with ``code`` in ``seconds`` unless it has exited by then: the last
    resort after a stop request, should something not return in time (a thread blocked in a
    write or an upload holds up the interpreter's exit)."""

    def end() -> None:
        sys.stderr.write(
            f"cdcd: still running {seconds:.0f} s after the stop request; exiting now\n"
        )
        _exit_now(code)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()


async def _run_pipeline(config: Any, endpos: int | None) -> int:
    from cdcd.pipeline.service import Pipeline

    pipeline = Pipeline(config, endpos=endpos)

    def stop() -> None:
        pipeline.request_stop()
        exit_after(config.shutdown.grace_period + WATCHDOG_MARGIN, EXIT_FAILURE)

    remove = on_stop_signals(stop)
    try:
        code = await pipeline.run()
    finally:
        remove()
    if pipeline.abandoned:  # what is durable is confirmed; a sink's thread may still be busy
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process without waiting for threads (the interpreter would join them)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(config: Any, endpos: int | None) -> int:
    """``cdcd run``: the daemon. Returns the exit code."""
    tune_gc()
    return_large_blocks()
    keep_unused_modules_out()
    return int(run_async(_run_pipeline(config, endpos)))
