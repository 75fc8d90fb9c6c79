"""Ember's client SDK: OpenAI-compatible chat with retries, failover and latency-aware time limits.

::

    from ember.client import Client

    with Client("http://127.0.0.1:8000/v1") as client:
        result = client.chat("Hello!", max_tokens=32)
        print(result.text, result.ttft_s, result.retries)

``AsyncClient`` is the asyncio twin. Both work against Ember, its router and
any OpenAI-compatible endpoint. ``transport="http2"`` multiplexes every call
over one HTTP/2 connection; ``transport="grpc"`` (base URL ``grpc://host:port``)
speaks Ember's gRPC API, with the same methods, errors, retries and failover. Errors derive from ``EmberClientError``
(see ``ember.client.errors`` for the tree).
"""

from ember.client.async_client import AsyncClient
from ember.client.call import Timeouts
from ember.client.client import Client
from ember.client.conversation import AsyncConversation, Conversation
from ember.client.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConnectTimeout,
    DeadlineExceeded,
    EmberClientError,
    FirstTokenTimeout,
    RateLimitedError,
    ServerError,
    StallTimeout,
    StreamError,
)
from ember.client.results import ChatResult, Usage, WarmupResult
from ember.client.retry import RetryPolicy
from ember.client.streaming import AsyncChatStream, ChatStream

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncChatStream",
    "AsyncClient",
    "AsyncConversation",
    "AuthenticationError",
    "BadRequestError",
    "ChatResult",
    "ChatStream",
    "Client",
    "ConnectTimeout",
    "Conversation",
    "DeadlineExceeded",
    "EmberClientError",
    "FirstTokenTimeout",
    "RateLimitedError",
    "RetryPolicy",
    "ServerError",
    "StallTimeout",
    "StreamError",
    "Timeouts",
    "Usage",
    "WarmupResult",
]
