"""An S3 server for tests: moto's (``moto[server]``) on 127.0.0.1, or the one named by
``CDCD_TEST_S3_URL=s3://bucket/prefix`` (with the standard ``AWS_*`` variables for its
credentials and endpoint), plus an HTTP proxy that answers chosen requests with an error.

* :func:`launch_s3` starts moto's server on a free port (or describes the external store);
  :meth:`S3Store.new_prefix` gives each test its own ``s3://bucket/prefix`` (a new bucket on
  moto, a new prefix under the external URL) and :meth:`S3Store.download` copies a prefix into
  a local folder, so the checks written for the file sink's folders read it.
* :class:`FailingProxy` forwards HTTP to the S3 server and answers the next ``n`` requests (or
  all, while ``failing`` is negative) with a status and S3 error code of the test's choosing
  (503 SlowDown, 500 InternalError, 429): throttling and server errors as S3 gives them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow.fs as pafs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class S3Store:
    endpoint: str | None  # None: the AWS SDK's default (external store without an endpoint)
    access_key: str | None
    secret_key: str | None
    region: str
    base: str | None = None  # external: "bucket/prefix"; moto: None (a bucket per prefix)
    process: subprocess.Popen[bytes] | None = None
    buckets: list[str] = field(default_factory=list)

    @property
    def external(self) -> bool:
        return self.process is None

    def filesystem(self, endpoint: str | None = None) -> pafs.S3FileSystem:
        where = urlsplit(endpoint or self.endpoint or "")
        options: dict[str, Any] = {"region": self.region, "allow_bucket_creation": True}
        if self.access_key and self.secret_key:
            options |= {"access_key": self.access_key, "secret_key": self.secret_key}
        if where.netloc:
            options |= {"endpoint_override": where.netloc, "scheme": where.scheme}
        return pafs.S3FileSystem(**options)

    def storage(self, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        """``sinks[].storage`` for this store (through ``endpoint`` when given)."""
        out: dict[str, Any] = {"region": self.region, **extra}
        if endpoint or self.endpoint:
            out["endpoint_url"] = endpoint or self.endpoint
        if self.access_key and self.secret_key:
            out |= {"access_key_id": self.access_key, "secret_access_key": self.secret_key}
        return out

    def new_prefix(self, name: str = "out") -> str:
        """A fresh, empty ``bucket/prefix`` (without the scheme)."""
        if self.base is not None:
            return f"{self.base}/{uuid.uuid4().hex[:12]}/{name}"
        bucket = f"cdcd-test-{uuid.uuid4().hex[:12]}"
        self.filesystem().create_dir(bucket)
        self.buckets.append(bucket)
        return f"{bucket}/{name}"

    def keys(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix`` (relative name -> size)."""
        selector = pafs.FileSelector(prefix, recursive=True, allow_not_found=True)
        infos = self.filesystem().get_file_info(selector)
        cut = len(prefix) + 1
        return {i.path[cut:]: i.size for i in infos if i.type == pafs.FileType.File}

    def download(self, prefix: str, local: Path) -> Path:
        """Copy every object under ``prefix`` into ``local`` (same relative layout)."""
        fs = self.filesystem()
        for name in self.keys(prefix):
            target = local / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with fs.open_input_stream(f"{prefix}/{name}") as src:
                target.write_bytes(src.read())
        local.mkdir(parents=True, exist_ok=True)
        return local

    def close(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def launch_s3() -> S3Store:
    """moto's S3 server on a free loopback port, or the store named by CDCD_TEST_S3_URL."""
    url = os.environ.get("CDCD_TEST_S3_URL")
    if url:
        parts = urlsplit(url)
        return S3Store(
            endpoint=os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"),
            access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
            secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
            region=os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            base=f"{parts.netloc}{parts.path}".rstrip("/"),
        )
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("moto's S3 server did not start") from None
            time.sleep(0.2)
    return S3Store(endpoint, "testing", "testing", "us-east-1", process=process)


_ERROR_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
    "<Message>injected by the test proxy</Message><RequestId>test</RequestId></Error>"
)


class FailingProxy:
    """HTTP proxy on 127.0.0.1 in front of an S3 endpoint that fails chosen requests.

    ``fail(n, status, code, methods, after)`` lets ``after`` requests whose method is in
    ``methods`` through, then answers the next ``n`` of them (``n < 0``: every one, until
    ``fail(0)``) with ``status`` and an S3 error body;
    everything else is forwarded (one upstream connection per request). ``failed`` counts the
    requests answered with an error.
    """

    def __init__(self, upstream: str) -> None:
        where = urlsplit(upstream)
        self.upstream = (where.hostname or "127.0.0.1", where.port or 80)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.failed = 0
        self._failing = 0
        self._status = 503
        self._code = "SlowDown"
        self._methods: frozenset[str] = frozenset({"PUT", "POST"})
        self._after = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FailingProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def fail(
        self,
        n: int,
        status: int = 503,
        code: str = "SlowDown",
        methods: tuple[str, ...] = ("PUT", "POST"),
        after: int = 0,
    ) -> None:
        with self._lock:
            self._failing, self._status, self._code = n, status, code
            self._methods = frozenset(methods)
            self._after = after

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()

    def _should_fail(self, method: str) -> tuple[int, str] | None:
        with self._lock:
            if self._failing == 0 or method not in self._methods:
                return None
            if self._after > 0:
                self._after -= 1
                return None
            if self._failing > 0:
                self._failing -= 1
            self.failed += 1
            return self._status, self._code

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                body = await _read_body(reader, head)
                method = head.split(b" ", 1)[0].decode()
                failure = self._should_fail(method)
                if failure is not None:
                    status, code = failure
                    payload = _ERROR_BODY.format(code=code).encode()
                    writer.write(
                        f"HTTP/1.1 {status} Error\r\nContent-Type: application/xml\r\n"
                        f"Content-Length: {len(payload)}\r\n\r\n".encode()
                        + payload
                    )
                    await writer.drain()
                    continue
                up_r, up_w = await asyncio.open_connection(*self.upstream)
                lines = [
                    line
                    for line in head.rstrip(b"\r\n").split(b"\r\n")
                    if not line.lower().startswith(b"connection:")
                ]
                up_w.write(b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + body)
                await up_w.drain()
                response = await up_r.read()
                up_w.close()
                writer.write(response)
                await writer.drain()
                if b"\r\nconnection: close" in response.split(b"\r\n\r\n", 1)[0].lower():
                    break
        writer.close()


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    headers = {
        k.strip().lower(): v.strip()
        for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)
    }
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        parts = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            parts.append(size_line)
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    line = await reader.readuntil(b"\r\n")
                    parts.append(line)
                    if line == b"\r\n":
                        return b"".join(parts)
            parts.append(await reader.readexactly(size + 2))
    return await reader.readexactly(int(headers.get(b"content-length", b"0")))
