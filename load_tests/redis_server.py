"""A real `redis-server` on a free loopback port, in a temp dir: for tests, and for the chaos
campaign, which stops and restarts the Redis its cluster target owns (load_tests/faults.py).

    server = RedisServer.start(tmp_dir)   # waits until it answers PING
    server.url                            # redis://127.0.0.1:<port>/0
    server.kill()                         # SIGKILL: a crash, not a clean shutdown
    server.restart()                      # same port, same dir (append-only file reloaded)
    server.restart(empty=True)            # same port, data files deleted: a Redis without persistence
    server.stop()

Persistence is the append-only file with `appendfsync always`, so a SIGKILL loses nothing
that a client saw acknowledged: a restart models "Redis went away and came back".
CI installs the binary with `apt-get install -y redis-server`; tests that need it skip
with a clear reason when it is missing.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.load_tests.ports import free_port

_START_TIMEOUT_S = 10.0


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    data_dir: Path
    port: int
    _proc: subprocess.Popen | None = field(default=None, repr=False)

    @classmethod
    def start(cls, data_dir: Path, port: int | None = None) -> "RedisServer":
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server not found (apt-get install -y redis-server)")
        server = cls(data_dir=Path(data_dir), port=port or free_port())
        server._launch()
        return server

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _launch(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.data_dir), "--save", "", "--appendonly", "yes",
            "--appendfsync", "always", "--protected-mode", "yes", "--loglevel", "warning",
        ]
        log = open(self.data_dir / "redis.log", "ab")
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _answers_ping(self.port):
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}; see {self.data_dir}/redis.log")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer PING within {_START_TIMEOUT_S}s")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL, like a crashed or partitioned Redis."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None

    def restart(self, empty: bool = False) -> None:
        """Kill and start again on the same port; `empty` deletes the data files first, which is
        what a Redis without persistence (or with its volume lost) comes back as."""
        self.kill()
        if empty:
            for path in self.data_dir.iterdir():
                if path.name != "redis.log":
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        self._launch()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        self._proc = None

    def flushall(self) -> None:
        """Empty the database between tests sharing one server (raw RESP, no client needed)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
            sock.sendall(b"FLUSHALL\r\n")
            assert sock.recv(16).startswith(b"+OK")
