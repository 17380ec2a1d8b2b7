"""A ceiling on log lines per second, so that no client behaviour (a flood of bad connections, of requests, of
access-log lines) can fill the disk: a token bucket per log handler; what it drops is counted and the count is said
in the next line it lets through. Critical records always pass.
"""

from __future__ import annotations

import logging
import threading
import time


class RateLimitFilter(logging.Filter):
    def __init__(self, lines_per_second: float, burst: float | None = None):
        super().__init__()
        self.rate = lines_per_second
        self.burst = burst if burst is not None else max(1.0, 2 * lines_per_second)
        self._tokens = self.burst
        self._last = time.monotonic()
        self._dropped = 0
        # The engine thread logs too. Reentrant: the server's signal handler logs, and Python runs it in the main
        # thread between any two bytecodes, also inside this count (a plain lock deadlocked the thread with itself).
        self._lock = threading.RLock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.CRITICAL:
            return True
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens < 1.0:
                self._dropped += 1
                return False
            self._tokens -= 1.0
            dropped, self._dropped = self._dropped, 0
        if dropped:
            record.msg = f"{record.getMessage()} [{dropped} earlier log lines dropped: over {self.rate:g} lines/s]"
            record.args = None
        return True


def limit_log_rate(lines_per_second: float, logger_names=("", "uvicorn", "uvicorn.error", "uvicorn.access")) -> None:
    """Put a RateLimitFilter on every handler of these loggers (the root's, and those uvicorn configured)."""
    if lines_per_second <= 0:
        return
    seen = set()
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            if id(handler) not in seen:
                seen.add(id(handler))
                handler.addFilter(RateLimitFilter(lines_per_second))
