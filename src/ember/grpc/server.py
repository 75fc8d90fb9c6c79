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
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import BaseModel, ValidationError

from ember.engine.request import FinishReason, RequestOutput
from ember.grpc import convert, status
from ember.grpc.api import SERVICE_NAME, pb, pb_grpc
from ember.grpc.health import ReadinessHealth
from ember.server.errors import APIError, from_validation_error
from ember.server.generation import Caller, PreparedRequest, admit, prepare_chat, prepare_completion, run
from ember.server.middleware import authenticate, log_access
from ember.server.protocol import ChatCompletionRequest, CompletionRequest, new_id
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
            key = Path(config.ssl_keyfile or config.ssl_certfile).read_bytes()
            credentials = grpc.ssl_server_credentials([(key, Path(config.ssl_certfile).read_bytes())])
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


class GenerationService(pb_grpc.GenerationServicer):
    """``ember.v1.Generation``: streaming ``Chat`` and unary ``Complete``."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        key = state.config.api_key
        self._api_key = key.encode() if key else None

    async def Chat(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        call = _Call(self.state, context, "Chat")
        try:
            caller = call.open(self._api_key)
            body = _validated(ChatCompletionRequest, call.with_deadline(convert.chat_body(request)))
            prepared = call.prepared(prepare_chat(self.state, caller, body))
            await admit(self.state, caller, prepared)
            await call.send_headers(prepared)
            yield pb.ChatChunk(id=new_id("chatcmpl"), model=self.state.model_name)
            pending_tokens = 0  # tokens of outputs that added no text yet (held back by the detokenizer)
            # aclosing: however this loop is left, the engine request ends with it.
            async with contextlib.aclosing(run(self.state, prepared)) as outputs:
                async for out in outputs:
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
        except APIError as exc:
            await call.fail(exc)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:
            log.exception("gRPC Chat %s failed", call.request_id)
            await call.fail(APIError(500, "Internal error while generating.", "server_error", None, "internal_error"))
        finally:
            call.close()

    async def Complete(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        call = _Call(self.state, context, "Complete")
        try:
            caller = call.open(self._api_key)
            body = _validated(CompletionRequest, call.with_deadline(convert.completion_body(request)))
            prepared = call.prepared(prepare_completion(self.state, caller, body))
            await admit(self.state, caller, prepared)
            await call.send_headers(prepared)
            parts: list[str] = []
            final: RequestOutput | None = None
            async with contextlib.aclosing(run(self.state, prepared)) as outputs:
                async for out in outputs:
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
        except APIError as exc:
            await call.fail(exc)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:
            log.exception("gRPC Complete %s failed", call.request_id)
            await call.fail(APIError(500, "Internal error while generating.", "server_error", None, "internal_error"))
        finally:
            call.close()


class _Call:
    """One RPC's bookkeeping, mirroring the HTTP middleware: id, key, in-flight count, cleanup, log.

    Invariant: ``close`` runs exactly once per call (from the handler's
    ``finally``); it undoes what ``open`` counted and runs ``on_done``.
    """

    def __init__(self, state: ServerState, context: grpc.aio.ServicerContext, method: str) -> None:
        self.state = state
        self.context = context
        self.path = f"/{SERVICE_NAME}/{method}"
        self.started = time.perf_counter()
        self.metadata = {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
        request_id = self.metadata.get("x-request-id") or uuid.uuid4().hex
        if len(request_id) > 128 or not request_id.isprintable():
            request_id = uuid.uuid4().hex
        self.request_id = request_id
        self.record: dict[str, Any] = {}
        self.status = 499  # until the call succeeds or fails with a status: the client went away
        self.caller: Caller | None = None
        self.deadline_s = context.time_remaining()  # None: the client set no deadline

    def open(self, api_key: bytes | None) -> Caller:
        """Authenticate and start counting the call in flight; raises ``APIError`` (401)."""
        namespace = authenticate(api_key, self.metadata)
        self.caller = Caller(self.request_id, self.metadata, namespace)
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


def _validated(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _usage(out: RequestOutput, prepared: PreparedRequest) -> Any:
    return convert.usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens, prepared.max_tokens)


def _text(value: str | int | None) -> str:
    return "" if value is None else str(value)
