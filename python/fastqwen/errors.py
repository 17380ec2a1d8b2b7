"""The one exception type for a request that cannot be served as asked."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A bad request: the message says what is wrong, `param` names the offending field.

    A ValueError, so plain `except ValueError` callers keep working; the server maps it to HTTP 400.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
