"""End to end: SIGTERM to a real `kvmesh serve` process (what Kubernetes or systemd sends) while
streams run. It drains before it stops (deploy/cmd_serve.py): every worker leaves the routable
set and the running streams get router.drain_grace_s to finish (what outlives it ends
retryably: UNAVAILABLE with the tokens received, for the client to resume once the service is
back); then the app is deleted, the workers killed, Ray shut down, and the process exits 0.

Its own cluster (the process starts a private local Ray), so it is marked `slow` (CI skips it:
`pytest -m slow tests/test_serve_sigterm_e2e.py` runs it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from e2e_cluster import tiny_cluster_config
from kvmesh.core.errors import KvmeshError, WorkerFailedError
from kvmesh.core.seams import FinishReason, SamplingParams
from kvmesh.router.client import KvmeshClient
from kvmesh.router.retry import RetryPolicy

NUM_STREAMS = 4
MAX_TOKENS = 512  # hundreds of engine steps: still running when the drain starts, on any machine
LONG_GRACE_S = 120.0  # far longer than the streams need: they finish inside it
START_TIMEOUT_S = 300.0
STREAM_TIMEOUT_S = LONG_GRACE_S + 60

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


class ServeProcess:
    """`kvmesh serve --config FILE` in a session of its own; its stdout lines with the
    monotonic time each arrived."""

    def __init__(self, config_file: Path):
        env = {**os.environ, "RAY_ADDRESS": "local", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        kvmesh = Path(sys.executable).with_name("kvmesh")
        self.proc = subprocess.Popen([str(kvmesh), "serve", "--config", str(config_file)], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for_line(self, prefix: str, timeout_s: float) -> float:
        """When the first line starting with `prefix` arrived."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for at, line in list(self.lines):
                if line.startswith(prefix):
                    return at
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no {prefix!r} line; output:\n" + "\n".join(line for _, line in self.lines[-40:]))

    def kill(self) -> None:
        """What is left of the process group (a failed test), by its id."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)


def _stream(target: str, index: int, started: threading.Event) -> tuple[list, BaseException | None, float]:
    """One greedy stream, no retries: (its deltas, the error that ended it or None, when it
    ended)."""
    deltas, error = [], None
    try:
        with KvmeshClient(target, retry_policy=RetryPolicy(max_attempts=1)) as client:
            sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            for delta in client.generate(f"Stream {index}: the harbour ledger records", sampling=sampling,
                                         timeout_s=STREAM_TIMEOUT_S):
                deltas.append(delta)
                if sum(len(d.token_ids) for d in deltas) >= 3:
                    started.set()
    except KvmeshError as exc:
        error = exc
    finally:
        started.set()
    return deltas, error, time.monotonic()


@pytest.mark.parametrize("grace_s", [LONG_GRACE_S, 0.0], ids=["streams-finish", "no-grace"])
def test_sigterm_drains_the_streams_then_exits_zero(tiny_model_dir, tmp_path, grace_s):
    """A grace the streams fit in: each completes. No grace: each ends at once, retryably
    (UNAVAILABLE, with the tokens it received), and the drain reports them."""
    from concurrent.futures import ThreadPoolExecutor

    config = tiny_cluster_config(tiny_model_dir, num_workers=1, max_num_seqs=NUM_STREAMS, num_blocks=256,
                                 max_new_tokens=MAX_TOKENS, router={"drain_grace_s": grace_s})
    config_file = tmp_path / "kvmesh.yaml"
    config_file.write_text(yaml.safe_dump(config.to_dict()))
    serve = ServeProcess(config_file)
    try:
        serve.wait_for_line("kvmesh serve: ready", START_TIMEOUT_S)
        target = f"127.0.0.1:{config.router.grpc_port}"
        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            started = [threading.Event() for _ in range(NUM_STREAMS)]
            futures = [pool.submit(_stream, target, i, e) for i, e in enumerate(started)]
            for event in started:
                assert event.wait(120), "a stream never started"
            serve.proc.send_signal(signal.SIGTERM)
            results = [f.result(timeout=STREAM_TIMEOUT_S + 30) for f in futures]
        draining_at = serve.wait_for_line("kvmesh serve: draining", 30)
        assert serve.proc.wait(LONG_GRACE_S + 60) == 0
        serve.wait_for_line("kvmesh serve: shutting down", 10)
    finally:
        if serve.proc.poll() is None:
            serve.kill()
    output = "\n".join(line for _, line in serve.lines)
    # The drain held the process while streams ran: at least one ended after it began.
    assert max(ended_at for _, _, ended_at in results) > draining_at, "every stream ended before the drain began"
    if grace_s:
        for deltas, error, _ in results:  # every stream whole: the drain let it finish
            assert error is None, (error, output)
            assert sum(len(d.token_ids) for d in deltas) == MAX_TOKENS, output
            assert deltas[-1].finished and deltas[-1].finish_reason is FinishReason.LENGTH
        assert "kvmesh serve: drained 1 worker(s); 0 request(s) outlived the grace" in output, output
        return
    for deltas, error, _ in results:  # each ended retryably, carrying what it had received
        received = sum(len(d.token_ids) for d in deltas)
        assert isinstance(error, WorkerFailedError) and 3 <= received < MAX_TOKENS, (error, received, output)
        assert not deltas[-1].finished
    assert f"kvmesh serve: drained 1 worker(s); {NUM_STREAMS} request(s) outlived the grace" in output, output
