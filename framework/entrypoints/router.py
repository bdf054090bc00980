"""``tokenmill router``: disaggregated serving's proxy, speaking the protocol of vLLM's
disaggregated-serving proxy. A completion or chat request goes first to a prefill instance
with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``; the
``kv_transfer_params`` of its answer go with the original request to a decode instance, whose
answer (streamed or not) goes back to the client.

Prefill instances are chosen least-loaded (requests in flight through this router); decode
instances by prefix affinity first (the instance whose prefix cache, as its published KV
events say, holds the longest prefix of the prompt's blocks) and least-loaded among equals."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.entrypoints.router_pool import Instance, InstancePool, NoInstanceError, Role

logger = logging.getLogger(__name__)

REMOTE_DECODE_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What the prefill request carries: "keep this prompt's KV for a decode instance to pull"."""


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    text = "route OpenAI requests over prefill and decode instances (disaggregated serving)"
    parser = subparsers.add_parser("router", help=text, description=text)
    parser.add_argument(
        "--prefill", nargs="+", required=True, metavar="URL", help="prefill instances' base URLs"
    )
    parser.add_argument(
        "--decode", nargs="+", required=True, metavar="URL", help="decode instances' base URLs"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8000, help="port to bind")
    parser.add_argument(
        "--health-interval",
        type=float,
        default=1.0,
        help="seconds between health checks (and KV-event fetches) of each instance",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=2.0,
        help="seconds to connect to an instance (and to answer a health check)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds an instance may go without sending a byte of its answer",
    )
    parser.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    app = make_app(
        args.prefill,
        args.decode,
        args.health_interval,
        args.connect_timeout,
        args.request_timeout,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0


def error_response(message: str, status: HTTPStatus) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=status)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token, not streamed, its KV kept."""
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = dict(REMOTE_DECODE_PARAMS)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    return out


def make_app(
    prefill: list[str],
    decode: list[str],
    health_interval: float = 1.0,
    connect_timeout: float = 2.0,
    request_timeout: float = 600.0,
) -> FastAPI:
    """The router's FastAPI app over the given instances' base URLs."""
    pool = InstancePool(prefill, decode)
    timeout = httpx.Timeout(request_timeout, connect=connect_timeout, pool=connect_timeout)
    client = httpx.AsyncClient(timeout=timeout)
    health_client = httpx.AsyncClient(timeout=connect_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.gather(*(pool.check(health_client, i) for i in pool.instances))
        watcher = asyncio.create_task(pool.watch(health_client, health_interval))
        try:
            yield
        finally:
            watcher.cancel()
            await client.aclose()
            await health_client.aclose()

    app = FastAPI(title="tokenmill router", lifespan=lifespan)
    app.state.pool = pool

    async def send(
        role: Role, path: str, body: dict, headers: dict[str, str], hashes: list[str] = ()
    ) -> tuple[Instance, httpx.Response]:
        """POST ``body`` to an up instance of ``role``, streaming its answer; an instance that
        cannot be reached is marked down and the next one tried."""
        while True:
            instance = pool.pick(role, hashes)
            request = client.build_request("POST", instance.url + path, json=body, headers=headers)
            instance.in_flight += 1
            try:
                return instance, await client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                instance.in_flight -= 1
                instance.mark_down(f"{type(e).__name__}: {e}")
            except BaseException:
                instance.in_flight -= 1
                raise

    async def relay(instance: Instance, answer: httpx.Response) -> Response:
        """The instance's answer as the client's, streamed through."""

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                logger.warning("%s broke off its answer: %s", instance.url, e)
            finally:
                instance.in_flight -= 1
                await answer.aclose()

        kept = {k: v for k, v in answer.headers.items() if k.lower() in ("content-type",)}
        return StreamingResponse(chunks(), status_code=answer.status_code, headers=kept)

    async def disaggregated(raw: Request, path: str) -> Response:
        try:
            body = json.loads(await raw.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_response(
                f"the request body is not valid JSON: {e}", HTTPStatus.BAD_REQUEST
            )
        if not isinstance(body, dict):
            return error_response("the request body must be a JSON object", HTTPStatus.BAD_REQUEST)
        headers = {
            k: v for k, v in raw.headers.items() if k.lower() in ("authorization", "x-request-id")
        }
        try:
            instance, answer = await send("prefill", path, prefill_body(body), headers)
            try:
                await answer.aread()
            finally:
                instance.in_flight -= 1
                await answer.aclose()
            if answer.status_code != 200:
                return Response(
                    answer.content,
                    status_code=answer.status_code,
                    media_type=answer.headers.get("content-type"),
                )
            params = answer.json().get("kv_transfer_params")
            hashes = (params or {}).get("block_hashes") or []
            body["kv_transfer_params"] = params
            instance, answer = await send("decode", path, body, headers, hashes)
        except NoInstanceError as e:
            return error_response(str(e), HTTPStatus.SERVICE_UNAVAILABLE)
        except httpx.TimeoutException as e:
            return error_response(f"an instance timed out: {e}", HTTPStatus.GATEWAY_TIMEOUT)
        except httpx.HTTPError as e:
            return error_response(f"an instance failed: {e}", HTTPStatus.BAD_GATEWAY)
        return await relay(instance, answer)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await disaggregated(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await disaggregated(raw, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        headers = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}
        try:
            instance = pool.pick("decode")
            answer = await client.get(instance.url + "/v1/models", headers=headers)
        except NoInstanceError as e:
            return error_response(str(e), HTTPStatus.SERVICE_UNAVAILABLE)
        except httpx.HTTPError as e:
            return error_response(f"{instance.url} failed: {e}", HTTPStatus.BAD_GATEWAY)
        return Response(
            answer.content,
            status_code=answer.status_code,
            media_type=answer.headers.get("content-type"),
        )

    @app.get("/health")
    async def health() -> Response:
        reason = pool.all_up()
        if reason is not None:
            return error_response(reason, HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=200)

    return app
