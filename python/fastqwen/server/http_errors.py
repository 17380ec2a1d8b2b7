"""Every error the server answers with, in one shape: OpenAI's JSON error object with the status as its code.

`APIError` is what an endpoint raises for an HTTP status of its choosing; `error_body` / `error_response` write the
shape (the guard, the connection limits and the SSE streams write the body themselves, before or outside FastAPI);
`install_error_handlers` maps every exception that may leave an endpoint to its status: APIError, InvalidRequestError
(400, naming the field), the serving errors (503 with Retry-After for a full queue), pydantic's validation errors and
Starlette's HTTP errors.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InvalidRequestError
from .async_engine import QueueFullError, ServingError


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "PayloadTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def client_closed_response() -> Response:
    # Nobody reads it: the client is gone. 499 is nginx's "client closed request", for the access log.
    return Response(status_code=499)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(_: HTTPRequest, e: APIError):
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(_: HTTPRequest, e: InvalidRequestError):
        return error_response(400, str(e), e.param)

    @app.exception_handler(ServingError)
    async def on_serving_error(_: HTTPRequest, e: ServingError):
        return error_response(e.status, str(e), None, {"Retry-After": "1"} if isinstance(e, QueueFullError) else None)

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: HTTPRequest, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {first.get('msg', '')}", None)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return error_response(400, f"{where}: {first.get('msg', 'invalid value')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: HTTPRequest, e: StarletteHTTPException):
        if e.status_code == 404 and e.detail == "Not Found":  # no route: say which, for whoever probed it (a gateway)
            return error_response(404, f"no endpoint {request.method} {request.url.path} on this server", None)
        return error_response(e.status_code, str(e.detail), None, e.headers)
