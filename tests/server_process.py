"""Start the real server (python -m fastqwen.serve) in a subprocess on 127.0.0.1, and wait until it is healthy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoggedProcess:
    """A process on 127.0.0.1 whose output goes to a log file, waited for until it says it is ready, and stopped with
    SIGTERM (SIGKILL after 30 s). The servers here and the gateway in tests/test_gateway_smg.py are ones."""

    def __init__(self, what: str, cmd: list[str], log_path: str, ready, timeout: float):
        """ready(): whether the process is ready to serve (an HTTP error counts as not yet)."""
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if ready():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{what} was not ready in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


class ServerProcess(LoggedProcess):
    def __init__(self, model: str, *args: str, timeout: float = 120.0, log_dir: str | None = None):
        """log_dir: where the server's log goes (default: next to the model folder)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "fastqwen.serve",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        log_path = os.path.join(log_dir or os.path.dirname(model), f"server-{self.port}.log")
        healthy = lambda: httpx.get(self.url + "/health", timeout=1.0).status_code == 200  # noqa: E731
        super().__init__("the server", [*cmd, *args], log_path, healthy, timeout)


def metrics_when_idle(url: str, timeout: float = 30.0) -> str:
    """/metrics once no request runs and no KV page is held (or the last scrape when the timeout passes)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics").text
        idle = metric(text, "fastqwen:num_requests_running") == 0 and metric(text, "fastqwen:kv_cache_usage_perc") == 0
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def metric(text: str, name: str) -> float:
    """The value of the first sample of a metric in Prometheus text (labels ignored)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
