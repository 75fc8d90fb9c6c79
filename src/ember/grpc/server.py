"""The gRPC server: ``ember.v1.Generation`` on the HTTP server's engine, with health and reflection.

The app's lifespan starts it when ``--grpc-port`` is set, so it runs on the
same asyncio loop and shares ``ServerState`` (engine, admission, metrics,
drain flag) with the HTTP routes under uvicorn or granian alike.

A call takes the HTTP request's path: authenticate (metadata) → validate (the
equivalent JSON body, through the same pydantic models) → ``prepare_*`` →
``admit`` → ``run``. It counts in ``state.in_flight`` (a drain waits for it),
gives its admission slot back however it ends, increments the same error
counter and writes the same access line.

- Deadline: the call's deadline is the request's timeout, hence its engine
  deadline; when generation runs into it the call ends DEADLINE_EXCEEDED
  (without a deadline the server's default timeout applies, and the reply
  ends normally with FINISH_REASON_TIMEOUT, as over HTTP).
- Cancellation: gRPC cancels the handler's task; leaving ``run`` aborts the
  engine request, which frees its blocks within one engine step.
- Errors: ``APIError`` → status code and trailers (``ember.grpc.status``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import BaseModel, ValidationError

from ember.engine.api import FinishReason, RequestOutput
from ember.grpc import convert, status
from ember.grpc.api import SERVICE_NAME, pb, pb_grpc
from ember.grpc.health import ReadinessHealth
from ember.server.errors import APIError, from_validation_error
from ember.server.generation import Caller, PreparedRequest, admit, prepare_chat, prepare_completion, run
from ember.server.middleware import authenticate, log_access
from ember.server.protocol import ChatCompletionRequest, CompletionRequest, new_id
from ember.server.request_ids import client_request_id
from ember.server.responses import reply_headers
from ember.server.state import ServerState

log = logging.getLogger("ember.server")

HEALTH_SERVICE_NAME = "grpc.health.v1.Health"
# The longest timeout a request may carry (protocol.py); a longer deadline is clamped to it.
MAX_TIMEOUT_S = 3600.0
# The client cancels at its own clock's deadline, which the server (whose
# deadline starts when the call arrives) sees a little early: a cancellation
# this close to the deadline is the deadline.
DEADLINE_SLACK_S = 0.1


class GrpcServer:
    """The gRPC side of one Ember process: start it after the app starts, stop it before the engine."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.health = ReadinessHealth(state, (SERVICE_NAME,))
        self._server: grpc.aio.Server | None = None
        self._following: asyncio.Task[None] | None = None
        self.port: int | None = None

    async def start(self) -> int:
        """Bind ``--grpc-port`` (TLS with the HTTP server's certificate) and start serving; returns the port."""
        config = self.state.config
        server = grpc.aio.server(
            options=[
                # The same body limit as HTTP; gRPC itself answers RESOURCE_EXHAUSTED beyond it.
                ("grpc.max_receive_message_length", config.max_body_bytes),
                # Without this a second server on the same port would start silently and share it.
                ("grpc.so_reuseport", 0),
            ]
        )
        pb_grpc.add_GenerationServicer_to_server(GenerationService(self.state), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"{config.host}:{config.grpc_port}"
        if config.ssl_certfile:
            # At start-up, before anything is served: these reads block no request.
            key = Path(config.ssl_keyfile or config.ssl_certfile).read_bytes()  # noqa: ASYNC240
            credentials = grpc.ssl_server_credentials([(key, Path(config.ssl_certfile).read_bytes())])  # noqa: ASYNC240
            self.port = server.add_secure_port(address, credentials)
        else:
            self.port = server.add_insecure_port(address)
        await self.health.sync()  # NOT_SERVING until the model is ready
        await server.start()
        self._server = server
        self._following = asyncio.ensure_future(self.health.follow())
        log.info("serving gRPC (%s, health, reflection) on %s%s", SERVICE_NAME, address, " with TLS" if config.ssl_certfile else "")
        return self.port

    async def stop(self) -> None:
        """Stop serving; calls still running get ``grpc_grace_s`` (normally none are left after a drain)."""
        if self._following is not None:
            self._following.cancel()
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(self.state.config.grpc_grace_s)


# A request body model: ChatCompletionRequest or CompletionRequest.
Body = TypeVar("Body", bound=BaseModel)


class GenerationService(pb_grpc.GenerationServicer):
    """``ember.v1.Generation``: streaming ``Chat`` and unary ``Complete``."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        key = state.config.api_key
        self._api_key = key.encode() if key else None

    async def Chat(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async with _Call(self.state, context, "Chat") as call:
            prepared = await call.start(self._api_key, ChatCompletionRequest, lambda: convert.chat_body(request), prepare_chat)
            yield pb.ChatChunk(id=new_id("chatcmpl"), model=self.state.model_name)
            pending_tokens = 0  # tokens of outputs that added no text yet (held back by the detokenizer)
            # aclosing: however this loop is left, the engine request ends with it.
            async with contextlib.aclosing(run(self.state, prepared)) as outputs:
                async for _, out in outputs:  # one choice: gRPC has no n
                    pending_tokens += len(out.new_token_ids)
                    if out.finished:
                        call.check_finish(out)
                        yield pb.ChatChunk(
                            text=out.text_delta,
                            num_tokens=pending_tokens,
                            finish_reason=convert.finish_reason(out.finish_reason),
                            stop_reason=_text(out.stop_reason),
                            usage=_usage(out, prepared),
                        )
                    elif out.text_delta:
                        yield pb.ChatChunk(text=out.text_delta, num_tokens=pending_tokens)
                        pending_tokens = 0
            call.status = 200

    async def Complete(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _Call(self.state, context, "Complete") as call:
            prepared = await call.start(self._api_key, CompletionRequest, lambda: convert.completion_body(request), prepare_completion)
            parts: list[str] = []
            final: RequestOutput | None = None
            async with contextlib.aclosing(run(self.state, prepared)) as outputs:
                async for _, out in outputs:  # one choice: gRPC has no n
                    parts.append(out.text_delta)
                    final = out if out.finished else final
            if final is None:
                raise APIError(500, "The generation ended without a final output.", "server_error", None, "internal_error")
            call.check_finish(final)
            call.status = 200
            return pb.CompleteResponse(
                id=new_id("cmpl"),
                model=self.state.model_name,
                text="".join(parts),
                finish_reason=convert.finish_reason(final.finish_reason),
                stop_reason=_text(final.stop_reason),
                usage=_usage(final, prepared),
            )


class _Call:
    """One RPC's bookkeeping, mirroring the HTTP middleware: id, key, in-flight count, cleanup, log.

    Used as ``async with _Call(...) as call:`` around a handler's body, which
    is then every RPC's one error tail: an ``APIError`` ends the call with its
    status, any other exception is logged and ends it as a 500, cancellation
    and an abort pass through. Invariant: ``close`` runs exactly once per call
    (on leaving the block); it undoes what ``open`` counted and runs ``on_done``.
    """

    def __init__(self, state: ServerState, context: grpc.aio.ServicerContext, method: str) -> None:
        self.state = state
        self.context = context
        self.method = method
        self.path = f"/{SERVICE_NAME}/{method}"
        self.started = time.perf_counter()
        self.metadata = {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
        self.request_id = client_request_id(self.metadata.get("x-request-id"))
        self.arrived = time.monotonic()  # the request clock starts before admission
        self.record: dict[str, Any] = {}
        self.status = 499  # until the call succeeds or fails with a status: the client went away
        self.caller: Caller | None = None
        self.deadline_s = context.time_remaining()  # None: the client set no deadline

    async def __aenter__(self) -> _Call:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if isinstance(exc, APIError):
                await self.fail(exc)
            elif isinstance(exc, Exception) and not isinstance(exc, grpc.aio.AbortError):
                log.error("gRPC %s %s failed", self.method, self.request_id, exc_info=exc)
                await self.fail(APIError(500, "Internal error while generating.", "server_error", None, "internal_error"))
            # Anything else (CancelledError, an abort, GeneratorExit) propagates as it is.
        finally:
            self.close()

    async def start(
        self,
        api_key: bytes | None,
        model: type[Body],
        body: Callable[[], dict[str, Any]],
        prepare: Callable[[ServerState, Caller, Body], PreparedRequest],
    ) -> PreparedRequest:
        """Every RPC's opening, in the HTTP routes' order: authenticate, read and validate the body
        (``body()`` converts the message, after authentication), prepare, admit, send the initial metadata."""
        caller = self.open(api_key)
        request = _validated(model, self.with_deadline(body()))
        prepared = self.prepared(prepare(self.state, caller, request))
        await admit(self.state, caller, prepared)
        await self.send_headers(prepared)
        return prepared

    def open(self, api_key: bytes | None) -> Caller:
        """Authenticate and start counting the call in flight; raises ``APIError`` (401)."""
        namespace = authenticate(api_key, self.metadata)
        self.caller = Caller(self.request_id, self.metadata, namespace, arrived=self.arrived)
        self.state.in_flight += 1
        return self.caller

    def with_deadline(self, body: dict[str, Any]) -> dict[str, Any]:
        """Carry the call's deadline as the request's timeout (``timeout`` in the JSON body)."""
        if self.deadline_s is not None:
            if self.deadline_s <= 0:
                raise APIError(504, "The call's deadline passed before it started.", "timeout_error", None, "deadline_exceeded")
            body["timeout"] = min(self.deadline_s, MAX_TIMEOUT_S)
        return body

    def prepared(self, prepared: PreparedRequest) -> PreparedRequest:
        prepared.record = self.record
        return prepared

    async def send_headers(self, prepared: PreparedRequest) -> None:
        """Initial metadata, as HTTP's response headers: request id and the limits applied."""
        headers = [(name.lower(), value) for name, value in reply_headers(self.state, prepared).items()]
        await self.context.send_initial_metadata((("x-request-id", self.request_id), *headers))

    def check_finish(self, out: RequestOutput) -> None:
        """A finish that is an error over gRPC: the call's own deadline, or an abort by the server."""
        if out.finish_reason == FinishReason.TIMEOUT and self.deadline_s is not None:
            raise APIError(504, "The call's deadline passed during generation.", "timeout_error", None, "deadline_exceeded")
        if out.finish_reason == FinishReason.ABORT:
            raise APIError(503, "The server stopped this generation (it is shutting down).", "service_unavailable", None, "aborted")

    async def fail(self, error: APIError) -> None:
        """End the call with ``error``'s status; never returns (``abort`` raises)."""
        self.status = error.status
        self.record["error"] = error.status
        self.state.metrics.errors.labels(self.state.model_name, str(error.status)).inc()
        code = status.code_for(error.status, error.code)
        trailers = status.trailers(
            code,
            error.message,
            http_status=error.status,
            error_type=error.type,
            error_code=error.code,
            param=error.param,
            retry_after_s=status.retry_after_header(error.headers),
            request_id=self.request_id,
        )
        await self.context.abort(code, error.message, trailing_metadata=tuple(trailers))

    def close(self) -> None:
        if self.status == 499 and self.deadline_s is not None and (self.context.time_remaining() or 0.0) <= DEADLINE_SLACK_S:
            self.status = 504  # gRPC cancelled the call at its deadline: log it as such
        if self.caller is not None:
            for done in self.caller.on_done:
                done()  # e.g. give the admission slot back
            self.state.in_flight -= 1
        log_access("GRPC", self.path, self.request_id, self.status, self.started, self.record)


def _validated(model: type[Body], body: dict[str, Any]) -> Body:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _usage(out: RequestOutput, prepared: PreparedRequest) -> Any:
    return convert.usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens, prepared.max_tokens)


def _text(value: str | int | None) -> str:
    return "" if value is None else str(value)
