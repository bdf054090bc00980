"""The OpenAI-compatible HTTP server: FastAPI routes over one ``AsyncLLM``."""

from __future__ import annotations

import asyncio
import hmac
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tokenmill
from tokenmill import envs
from tokenmill.engine.async_llm import AsyncLLM, EngineStalledError
from tokenmill.engine.core_client import EngineDeadError
from tokenmill.entrypoints.openai.errors import (
    OpenAIError,
    from_exception,
    from_validation_error,
    model_not_found,
)
from tokenmill.entrypoints.openai.chat_template import ChatRenderer
from tokenmill.entrypoints.openai.metrics import PrometheusMetrics
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from tokenmill.entrypoints.openai.server_options import ServerOptions
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_completions import OpenAIServingCompletion
from tokenmill.entrypoints.openai.serving_models import ServedModels
from tokenmill.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from tokenmill.entrypoints.openai.tool_calls import load_tool_parser
from tokenmill.entrypoints.web_ui import add_web_ui

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class APIKeyMiddleware:
    """401 for ``/v1/*`` requests without ``Authorization: Bearer <api_key>`` (the scheme in
    any case, as HTTP has it)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _route_path(scope).startswith("/v1"):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(
                given.strip(), self.expected
            ):
                error = OpenAIError(
                    "Incorrect API key provided.", HTTPStatus.UNAUTHORIZED, code="invalid_api_key"
                )
                await error.to_response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The request's path without the ``--root-path`` prefix a proxy may have kept."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class RequestIdMiddleware:
    """``--enable-request-id-headers``: each response carries ``X-Request-Id``, the
    request's own or a new one (vLLM's)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id")
        request_id = given or uuid.uuid4().hex.encode()

        async def add_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, add_header)


class InternalErrorMiddleware:
    """A 500 in OpenAI's form for an exception no handler took, logged once by
    ``from_exception`` (Starlette's outermost middleware would log it a second time)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:
            error = from_exception(e)
            if not started:
                await error.to_response()(scope, receive, send)


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str],
    api_key: str | None = None,
    tool_call_parser: str | None = None,
    options: ServerOptions | None = None,
    lora_modules: dict[str, str] | None = None,
    web_ui: bool = True,
) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``served_model_names`` (the first is the one
    responses name); it shuts the engine down when the app stops. ``tool_call_parser``: the
    registered tool parser that ``tool_choice="auto"`` uses; None refuses "auto".
    ``options``: the server's flags (``ServerOptions``); raises ``ValueError`` for a bad one.
    ``lora_modules`` (name -> adapter directory, with ``enable_lora``) are served as models
    of their own; an adapter the engine refuses raises ``OpenAIError``. With
    ``TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING`` adapters load and unload at run time too.
    ``web_ui``: serve the browser pages at ``/`` and ``/engine`` (see ``web_ui``)."""
    options = options or ServerOptions()
    models = ServedModels(engine, served_model_names)
    for name, path in (lora_modules or {}).items():
        models.add_adapter(name, path)
    metrics = PrometheusMetrics(
        engine.get_stats,
        engine.get_engine_stats,
        served_model_names[0],
        options.metrics_names,
        engine.max_model_len,
    )
    engine.stat_loggers.append(metrics)
    renderer = ChatRenderer.create(engine.tokenizer, options)
    completions = OpenAIServingCompletion(engine, models, options)
    parser = load_tool_parser(tool_call_parser) if tool_call_parser else None
    chat = OpenAIServingChat(engine, models, parser, options, renderer)
    tokenization = OpenAIServingTokenization(engine, models, renderer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()

    app = FastAPI(title="tokenmill", lifespan=lifespan, root_path=options.root_path)
    app.add_middleware(InternalErrorMiddleware)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if options.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.to_response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).to_response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return OpenAIError(str(exc.detail), HTTPStatus(exc.status_code), kind).to_response()

    @app.get("/health")
    async def health() -> Response:
        try:
            engine.check_health()
        except (EngineDeadError, EngineStalledError) as e:
            return OpenAIError(
                str(e), HTTPStatus.SERVICE_UNAVAILABLE, "server_error"
            ).to_response()
        return Response(status_code=200)

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        """SageMaker's health check: ``/health``'s answer."""
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tokenmill.__version__}

    if options.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> Response:
            return _json_response(tokenization.tokenizer_info, None)

    if options.enable_server_load_tracking:

        @app.get("/load")
        async def load() -> dict[str, int]:
            """vLLM's server load: the requests not yet finished."""
            return {"server_load": engine.num_unfinished_requests}

    @app.post("/invocations")
    async def invocations(raw: Request) -> Response:
        """SageMaker's inference route: a chat body (with ``messages``) or a completion body
        (with ``prompt``), answered as its endpoint answers it."""
        body = await _json_body(raw)
        if isinstance(body, dict) and "messages" in body:
            request = _validate(ChatCompletionRequest, body)
            return await _respond(chat.create_chat_completion(request), raw)
        if isinstance(body, dict) and "prompt" in body:
            request = _validate(CompletionRequest, body)
            return await _respond(completions.create_completion(request), raw)
        raise OpenAIError(
            "/invocations takes a chat completion body (with messages) or a completion body "
            "(with prompt)"
        )

    @app.get("/kv_events")
    async def kv_events(after: int = 0, log_id: str = "") -> dict[str, Any]:
        """The prefix cache's changes after event ``after`` of log ``log_id`` (BlockStored /
        BlockRemoved with hex block hashes), or a snapshot of its hashes (``reset``): what a
        router's prefix affinity follows."""
        return engine.kv_event_log.since(after, log_id)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=models.cards())

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> ModelCard:
        for card in models.cards():
            if card.id == model:
                return card
        raise model_not_found(model)

    if envs.TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            await models.load_adapter(body.lora_name, body.lora_path)
            return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            models.unload_adapter(body.lora_name)
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await _respond(completions.create_completion(body), raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await _respond(chat.create_chat_completion(body), raw)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> Response:
        return await engine.run_off_loop(_json_response, tokenization.tokenize_request, body)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await engine.run_off_loop(_json_response, tokenization.detokenize_request, body)

    if web_ui:
        add_web_ui(app)
    return app


async def _json_body(raw: Request) -> Any:
    try:
        return json.loads(await raw.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"the request body is not valid JSON: {e}") from None


def _validate(model: type[M], body: dict[str, Any]) -> M:
    """``body`` as ``model``; a 400 naming the field, as the routes answer one."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(RequestValidationError(e.errors())) from None


def _json_response(handler: Callable[[T], BaseModel], body: T) -> Response:
    """``handler(body)`` as a JSON response: called off the event loop, as both the work and
    the rendering grow with the client's input (a 10 MB text has millions of tokens)."""
    return Response(handler(body).model_dump_json(), media_type="application/json")


async def _respond(result: Awaitable, raw: Request) -> Response:
    """Await the handler while watching for a client disconnect, which cancels it (and so
    aborts its requests); then wrap the result as JSON or as an event stream."""
    out = await _cancel_on_disconnect(result, raw)
    if isinstance(out, AsyncIterator):
        return StreamingResponse(out, media_type="text/event-stream")
    return Response(out.model_dump_json(), media_type="application/json")


async def _cancel_on_disconnect(result: Awaitable[T], raw: Request) -> T:
    handler = asyncio.ensure_future(result)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        done, _ = await asyncio.wait((handler, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler.done():
            handler.cancel()
    if handler not in done:
        raise OpenAIError("the client disconnected", HTTPStatus.BAD_REQUEST)
    return handler.result()


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
