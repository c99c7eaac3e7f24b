"""The HTTP side of `mosaic serve`: routes, the API key, bounded JSON bodies, errors in each protocol's shape,
streaming with keepalives, and cancelling a generation whose client went away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from importlib import resources
from typing import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from . import anthropic_api, openai_api
from .fleet import Fleet
from .prompt import prompt_ids
from .request import Generation, RequestError
from .run import Run
from .worker import Failed, Finished, Job, Started, Worker

log = logging.getLogger("mosaic.serve")
MAX_BODY_BYTES = 32 << 20  # an agent's request with every tool schema is a few MB at most
KEEPALIVE_S = 10.0  # a frame at least this often while a long prefill or a queue keeps a stream silent
ERROR_SHAPES = {"openai": openai_api.error_body, "anthropic": anthropic_api.error_body}
STREAM_ERRORS = {"openai": openai_api.stream_error, "anthropic": anthropic_api.stream_error}


def error_response(err: RequestError, protocol: str) -> JSONResponse:
    # The SDKs retry 5xx; an engine failure (a damaged record) would fail again.
    headers = {"x-should-retry": "false"} if err.status >= 500 else None
    return JSONResponse(ERROR_SHAPES[protocol](err), status_code=err.status, headers=headers)


def protocol_of(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


async def read_json(request: Request) -> dict:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(f"the body is {int(declared):,} bytes; at most {MAX_BODY_BYTES:,}", status=413,
                           kind="too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise RequestError(f"the body is over {MAX_BODY_BYTES:,} bytes", status=413, kind="too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise RequestError("the client went away while sending its body") from None
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


class EventStream(Response):
    """Server-sent events from an async iterator of frames, with a keepalive frame while it is silent. When
    the stream ends for any reason (finished, or the client gone), its generation is cancelled."""

    def __init__(self, frames: AsyncIterator[str], keepalive: str, on_close: Callable[[], None]):
        # Not Response.__init__: it would declare a Content-Length for an empty body.
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.frames, self.keepalive, self.on_close = frames, keepalive, on_close

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        it, pending = aiter(self.frames), None
        try:
            while True:
                pending = pending or asyncio.ensure_future(anext(it))
                done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
                if not done:
                    await send({"type": "http.response.body", "body": self.keepalive.encode(), "more_body": True})
                    continue
                try:
                    frame = pending.result()
                except StopAsyncIteration:
                    break
                pending = None
                await send({"type": "http.response.body", "body": frame.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away: nothing more to send
        finally:
            self.on_close()
            if pending is not None and not pending.done():
                pending.cancel()  # and wait for it: a generator cannot be closed while it is running
                with contextlib.suppress(BaseException):
                    await pending
            await self.frames.aclose()


class Server:
    def __init__(self, fleet: Fleet, worker: Worker, *, max_seq: int, api_key: str | None = None):
        self.fleet, self.worker, self.max_seq, self.api_key = fleet, worker, max_seq, api_key
        self.started = int(time.time())

    def check_key(self, request: Request) -> None:
        if not self.api_key:
            return
        auth = request.headers.get("authorization") or ""
        given = [request.headers.get("x-api-key") or "", auth[7:].strip() if auth[:7].lower() == "bearer " else ""]
        # Either header may carry it; a client can send both (Claude Code with two keys set), one stale.
        if not any(secrets.compare_digest(g.encode(), self.api_key.encode()) for g in given):
            raise RequestError("a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)",
                               status=401, kind="authentication")

    async def generate(self, request: Request, gen: Generation, protocol: str,
                       body: Callable[[Run], Awaitable[dict]], stream: Callable[[Run], AsyncIterator[str]]) -> Response:
        """Render the prompt (its errors are a 4xx here), queue the generation, and answer: a stream at once
        (keepalives while it waits its turn), or the whole body when it is done. A client that leaves
        cancels it, queued or running."""
        entry = self.fleet.pick(gen.model or None)
        ids, forced = await run_in_threadpool(prompt_ids, entry, gen, self.max_seq)
        job = Job(entry, gen, ids, asyncio.get_running_loop())
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        self.worker.submit(job)

        def close() -> None:
            job.cancelled.set()
            watcher.cancel()

        if gen.stream:
            keepalive = "event: ping\ndata: {\"type\": \"ping\"}\n\n" if protocol == "anthropic" else ": keepalive\n\n"
            return EventStream(_once_started(job, gen, forced, protocol, stream), keepalive, close)
        try:
            first = await job.events.get()
            if isinstance(first, Failed):
                raise first.error
            if not isinstance(first, Started):  # the client left while it was queued
                return Response(status_code=499)
            return JSONResponse(await body(Run(gen, first, _events(job), forced)))
        finally:
            close()

    # -- routes ---------------------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        gen = openai_api.parse_chat(await read_json(request))
        return await self.generate(request, gen, "openai", openai_api.chat_body, openai_api.chat_stream)

    async def completions(self, request: Request) -> Response:
        gen = openai_api.parse_completion(await read_json(request))
        return await self.generate(request, gen, "openai", openai_api.completion_body, openai_api.completion_stream)

    async def messages(self, request: Request) -> Response:
        gen = anthropic_api.parse_messages(await read_json(request))
        return await self.generate(request, gen, "anthropic", anthropic_api.message_body,
                                   anthropic_api.message_stream)

    async def count_tokens(self, request: Request) -> Response:
        gen = anthropic_api.parse_messages(await read_json(request), counting=True)
        entry = self.fleet.pick(gen.model or None)
        ids, _ = await run_in_threadpool(prompt_ids, entry, gen, self.max_seq)
        return JSONResponse({"input_tokens": len(ids)})

    async def models(self, request: Request) -> Response:
        return JSONResponse(openai_api.models_body(list(self.fleet.entries), self.started))

    async def health(self, request: Request) -> Response:
        resident = self.fleet.resident
        return JSONResponse({"status": "ok", "model": resident.name if resident else None,
                             "generating": self.worker.running is not None, "waiting": self.worker.waiting})

    async def stats(self, request: Request) -> Response:
        return JSONResponse(engine_stats(self.fleet))

    async def web_chat(self, request: Request) -> Response:
        return HTMLResponse(resources.files(__package__).joinpath("webchat.html").read_text(encoding="utf-8"))


def _guarded(server: Server, handler, keyed: bool):
    async def endpoint(request: Request) -> Response:
        protocol = protocol_of(request.url.path)
        try:
            if keyed:
                server.check_key(request)
            return await handler(request)
        except RequestError as e:
            return error_response(e, protocol)
    return endpoint


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when its client disconnects: the worker stops within a token, or skips it if queued."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancelled.set()
            job.events.put_nowait(Finished("cancelled", 0))
            return


async def _once_started(job: Job, gen: Generation, forced: str, protocol: str,
                        stream: Callable[[Run], AsyncIterator[str]]) -> AsyncIterator[str]:
    """A stream's frames: nothing (keepalives) until the job starts, then the protocol's frames."""
    first = await job.events.get()
    if isinstance(first, Failed):
        yield STREAM_ERRORS[protocol](first.error)
        return
    if not isinstance(first, Started):
        return
    async for frame in stream(Run(gen, first, _events(job), forced)):
        yield frame


async def _events(job: Job):
    while True:
        event = await job.events.get()
        yield event
        if isinstance(event, (Finished, Failed)):
            return


def engine_stats(fleet: Fleet) -> dict:
    """What the web chat shows beside an answer: the resident engine's cache, reads, memory and speed."""
    engine, entry = fleet.engine, fleet.resident  # read once: the worker may be switching models
    if engine is None or entry is None:
        return {"model": None}
    s, store, limit = engine.stats, engine.store, engine.memory_limit
    out = {"model": entry.name, "settings": engine.settings, "prompt_tokens": s.prompt_tokens,
           "new_tokens": s.new_tokens, "ttft_s": s.ttft_s, "tok_per_s": s.tok_per_s, "hit_rate": s.hit_rate,
           "bytes_read": s.bytes_read, "context_tokens": engine.model.state.length,
           "max_seq": engine.model.state.max_seq}
    if store is not None:
        record = engine.vault.header.record_bytes
        out["ring"] = {"slots": store.policy.usable, "records": engine.vault.header.num_records,
                       "bytes": store.policy.usable * record,
                       "given_back": engine.valve.counters.given_back if engine.valve else 0}
    if limit is not None:
        out["memory"] = {"available_at_open": limit.available, "bounded_by": limit.bound}
    return out


def build_app(server: Server) -> Starlette:
    keyed = [("/v1/models", server.models, ["GET"]), ("/models", server.models, ["GET"]),
             ("/v1/chat/completions", server.chat_completions, ["POST"]),
             ("/chat/completions", server.chat_completions, ["POST"]),
             ("/v1/completions", server.completions, ["POST"]), ("/completions", server.completions, ["POST"]),
             ("/v1/messages", server.messages, ["POST"]), ("/v1/messages/count_tokens", server.count_tokens, ["POST"]),
             ("/stats", server.stats, ["GET"])]
    open_ = [("/health", server.health, ["GET"]), ("/", server.web_chat, ["GET"])]
    routes = [Route(path, _guarded(server, fn, True), methods=m) for path, fn, m in keyed]
    routes += [Route(path, _guarded(server, fn, False), methods=m) for path, fn, m in open_]

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found" if exc.status_code == 404 else "invalid_request"
        what = f"no such endpoint: {request.method} {request.url.path}" if exc.status_code == 404 else \
            f"{request.method} is not allowed on {request.url.path}" if exc.status_code == 405 else str(exc.detail)
        return error_response(RequestError(what, status=exc.status_code, kind=kind), protocol_of(request.url.path))

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path, exc_info=exc)
        return error_response(RequestError(f"internal error: {type(exc).__name__}", status=500, kind="engine"),
                              protocol_of(request.url.path))

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal_error})
