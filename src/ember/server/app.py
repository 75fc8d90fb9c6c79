"""create_app: the FastAPI application, its error handlers and its lifespan."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from ember import webchat
from ember.server.errors import APIError, error_param
from ember.server.middleware import RequestPipeline
from ember.server.routes import admin, chat, completions, health, models, sessions, tokenize
from ember.server.state import ServerState

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def create_app(state: ServerState) -> FastAPI:
    """The ASGI app. The model loads in the background once the app starts."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        grpc_server = None
        if state.config.grpc_port is not None:
            # Same loop and state as HTTP; started before the model loads so health says NOT_SERVING meanwhile.
            from ember.grpc.server import GrpcServer

            grpc_server = GrpcServer(state)
            await grpc_server.start()
        loading = asyncio.create_task(state.load())
        watching = asyncio.create_task(state.watch_latency())
        app.state.loading_task = loading
        try:
            yield
        finally:
            loading.cancel()
            watching.cancel()
            if grpc_server is not None:
                await grpc_server.stop()
            await state.shutdown()

    app = FastAPI(title="Ember", version="0.1.0", description="OpenAI-compatible, low-latency chat serving.", lifespan=lifespan)
    app.state.ember = state
    app.add_middleware(RequestPipeline, state=state)
    for module in (chat, completions, models, health, sessions, admin, tokenize):
        app.include_router(module.router)
    app.router.routes.extend(webchat.routes())  # the chat page at /

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        _count(state, exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def on_invalid_body(request: Request, exc: RequestValidationError) -> Response:
        # OpenAI answers 400, never FastAPI's 422, for a body it cannot accept.
        first = exc.errors()[0] if exc.errors() else {}
        param = error_param(first)
        kind = first.get("type", "")
        if kind == "json_invalid":
            message = "We could not parse the JSON body of your request. Send valid JSON encoded as UTF-8."
        elif kind == "missing" and param is None:
            message = "The request body is missing."
        else:
            message = f"Invalid value for '{param}': {first.get('msg', 'invalid')}" if param else str(first.get("msg", "Invalid request."))
        _count(state, 400)
        return APIError(400, message, "invalid_request_error", param, "invalid_value").response()

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        _count(state, exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else "Request failed."
        if exc.status_code == 400 and "parsing the body" in message:
            message = "We could not read the request body. Send valid JSON encoded as UTF-8."
        error = APIError(exc.status_code, message, _STATUS_TYPES.get(exc.status_code, "invalid_request_error"))
        if exc.headers:
            error.headers.update(exc.headers)
        return error.response()

    # Unhandled errors are answered (and logged, once) by RequestPipeline.

    return app


def _count(state: ServerState, status: int) -> None:
    state.metrics.errors.labels(state.model_name, str(status)).inc()
