"""cdcd.runtime, each in a Python process of its own: the first SIGTERM/SIGINT asks for a
stop, a second one ends the process at once, even while the event loop is busy; numpy and
pandas stay out of ``cdcd run``."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap

from tests.e2e import REPO

#: asks for a stop on the first signal, then keeps the event loop busy (a blocking call)
_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, time
    from cdcd.runtime import on_stop_signals

    async def main() -> None:
        stopping = asyncio.Event()
        on_stop_signals(stopping.set)
        print("ready", flush=True)
        await stopping.wait()
        print("stopping", flush=True)
        time.sleep(60)  # a drain that does not return

    asyncio.run(main())
    """
)


def _started() -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_a_second_signal_ends_a_busy_process() -> None:
    for first, second in ((signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGTERM)):
        proc = _started()
        try:
            proc.send_signal(first)
            assert proc.stdout is not None and proc.stdout.readline() == "stopping\n"
            proc.send_signal(second)
            assert proc.wait(30) == -second  # killed by it, not after the 60 s
        finally:
            proc.kill()
            proc.wait()


def test_cdcd_run_keeps_numpy_and_pandas_out() -> None:
    """pyarrow would load numpy at import and pandas at its first conversion (~50 MB of RSS,
    docs/guarantees.md); ``CDCD_ALLOW_NUMPY=1`` lets them load."""
    script = textwrap.dedent(
        """
        import sys
        from cdcd.runtime import keep_unused_modules_out
        keep_unused_modules_out()
        import pyarrow as pa
        pa.array([1, 2, None])
        print(sorted({m.split(".")[0] for m in sys.modules} & {"numpy", "pandas"}))
        """
    )

    def loaded(**env: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
            env={**os.environ, **env},
        )
        return out.stdout.strip()

    assert loaded(CDCD_ALLOW_NUMPY="0") == "[]"
    if importlib.util.find_spec("numpy") and importlib.util.find_spec("pandas"):
        assert loaded(CDCD_ALLOW_NUMPY="1") == "['numpy', 'pandas']"
