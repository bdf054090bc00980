"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the status
codes api.openai.com uses."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from tokenmill.engine.async_llm import EngineStepError, QueueFullError
from tokenmill.engine.core_client import EngineDeadError
from tokenmill.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

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
    (400); its ``param`` is the request field its message starts with, if any of ``params``.
    The engine's own failures are 500s that name no internals; an unexpected exception is
    logged here, with its traceback, and only here."""
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
    if isinstance(e, EngineStepError):
        message = "the engine step running this request failed; the server log has the cause"
        return OpenAIError(message, HTTPStatus.INTERNAL_SERVER_ERROR, "server_error")
    logger.error("request failed", exc_info=e)
    return OpenAIError(
        "The server had an error while processing your request.",
        HTTPStatus.INTERNAL_SERVER_ERROR,
        "server_error",
    )


def from_validation_error(exc: RequestValidationError) -> OpenAIError:
    """A 400 naming the offending field, in place of FastAPI's 422."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request body")
    first = errors[0]
    loc = _field_path(first)
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


def _field_path(error: dict) -> list[str]:
    """The request fields (and indices) an error is at, without ``body`` and without the
    names of union alternatives (``str``, ``list[int]``, a model class), which are internal."""
    return [
        str(part)
        for part in error.get("loc", ())
        if isinstance(part, int)
        or not (part == "body" or part in _TYPE_NAMES or "[" in part or part[:1].isupper())
    ]


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _describe(error: dict) -> str:
    loc = ".".join(_field_path(error))
    got = repr(error.get("input"))
    if len(got) > 60:
        got = got[:57] + "..."
    message = error.get("msg", "invalid").removeprefix("Value error, ")
    return f"{loc}: {message} (got {got})"
