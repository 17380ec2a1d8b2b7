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


class ServerProcess:
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
        self.log_path = os.path.join(log_dir or os.path.dirname(model), f"server-{self.port}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*cmd, *args], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {timeout} s:\n{self.log()}")

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
