"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the status
codes api.openai.com uses."""

from __future__ import annotations

from http import HTTPStatus

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from tokenmill.engine.async_llm import QueueFullError
from tokenmill.engine.core_client import EngineDeadError
from tokenmill.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

MAX_PROBLEMS = 3
"""Validation problems quoted in one message (a union field gives one per alternative)."""


class OpenAIError(Exception):
    """An error answered to the client as-is."""

    def __init__(
        self,
        message: str,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def to_response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status)

    def to_sse(self) -> str:
        """The error as one server-sent event, for failures after a stream has begun."""
        return f"data: {ErrorResponse(error=self.info).model_dump_json()}\n\n"


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        f"The model `{model}` does not exist.",
        HTTPStatus.NOT_FOUND,
        param="model",
        code="model_not_found",
    )


def from_exception(e: Exception, params: tuple[str, ...] = ()) -> OpenAIError:
    """Map an engine exception to its OpenAI error. A ``ValueError`` is the caller's fault
    (400); its ``param`` is the request field its message starts with, if any of ``params``."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, ValueError):
        first = str(e).split(" ", 1)[0].split(".", 1)[0]
        return OpenAIError(str(e), param=first if first in params else None)
    if isinstance(e, QueueFullError):
        return OpenAIError(
            str(e), HTTPStatus.SERVICE_UNAVAILABLE, "server_error", code="server_overloaded"
        )
    if isinstance(e, EngineDeadError):
        return OpenAIError(str(e), HTTPStatus.INTERNAL_SERVER_ERROR, "server_error")
    return OpenAIError(f"internal error: {e!r}", HTTPStatus.INTERNAL_SERVER_ERROR, "server_error")


def from_validation_error(exc: RequestValidationError) -> OpenAIError:
    """A 400 naming the offending field, in place of FastAPI's 422."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return OpenAIError(f"the request body is not valid JSON: {detail}".rstrip(": "))
    if not loc:
        return OpenAIError("the request body must be a JSON object: " + first.get("msg", ""))
    param = loc[0]
    if first.get("type") == "extra_forbidden":
        return OpenAIError(f"Unrecognized request argument supplied: {param}", param=param)
    if first.get("type") == "missing":
        return OpenAIError(f"Missing required parameter: '{'.'.join(loc)}'", param=param)
    problems = sorted({_describe(e) for e in errors})
    more = f"; and {len(problems) - MAX_PROBLEMS} more" if len(problems) > MAX_PROBLEMS else ""
    message = f"Invalid value for '{param}': " + "; ".join(problems[:MAX_PROBLEMS]) + more
    return OpenAIError(message, param=param)


def _describe(error: dict) -> str:
    loc = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
    got = repr(error.get("input"))
    if len(got) > 60:
        got = got[:57] + "..."
    return f"{loc}: {error.get('msg', 'invalid')} (got {got})"
