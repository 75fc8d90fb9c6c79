"""Send one chat over Ember's gRPC API (``ember.v1.Generation/Chat``) and record it like an HTTP one.

The twin of ``sender.Sender`` for ``--transport grpc``: the same
``RequestSpec`` in, the same ``RequestRecord`` out, so every workload,
metric and report works unchanged. The body a spec would POST is converted
with ``ember.grpc.convert`` (what the SDK does too); one request is one RPC
on a channel shared by all requests (one HTTP/2 connection), never retried.

Chunk times are taken when a message leaves grpc, before it is converted.
A non-streamed spec (``stream=False``) still uses the streaming RPC, the
only chat method, but records its text as arriving with the last message,
as a full JSON reply would. Errors use the HTTP sender's kinds: an error
status Ember sent is ``http_<status>`` of the status it stands for (or
``stream_error`` once the stream had started), DEADLINE_EXCEEDED is
``timeout``, a failed connection ``connect`` (``disconnect`` mid-stream).
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

import grpc

from ember import __version__
from ember.bench.record import Clock, RequestRecord
from ember.bench.sender import BenchError, Target
from ember.bench.workloads import RequestSpec
from ember.grpc import convert, status
from ember.grpc.api import pb_grpc

# Ember sends this in every reply's initial metadata (as the HTTP header of the same name).
EMBER_REPLY_METADATA = "x-ember-max-tokens"


class GrpcSender:
    """Sends ``RequestSpec``s as ``Chat`` RPCs over one channel; use as ``async with GrpcSender(target, clock)``.

    ``target.url`` is ``grpc://host:port`` or ``grpcs://host:port``
    (``target.cacert`` names the certificate to trust). Without ``target.model``
    the server's own model is used, and ``model`` is learnt from the first reply.
    """

    def __init__(self, target: Target, clock: Clock) -> None:
        self.target = target
        self.clock = clock
        self.model = target.model or ""
        self.server_is_ember = False
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GenerationStub | None = None
        self._metadata = tuple((name.lower(), value) for name, value in target.headers)
        if target.api_key:
            self._metadata += (("authorization", f"Bearer {target.api_key}"),)

    async def __aenter__(self) -> GrpcSender:
        parts = urlsplit(self.target.url)
        if parts.scheme not in ("grpc", "grpcs") or not parts.hostname or parts.port is None:
            raise BenchError(f"--transport grpc needs --url grpc://host:port (or grpcs://), got {self.target.url!r}")
        address = f"{parts.hostname}:{parts.port}"
        options = (("grpc.primary_user_agent", f"ember-bench/{__version__}"), ("grpc.enable_retries", 0))
        if parts.scheme == "grpcs":
            # Read once, before the first request is sent: nothing is in flight to block.
            roots = Path(self.target.cacert).read_bytes() if self.target.cacert else None  # noqa: ASYNC240
            self._channel = grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=roots), options=options)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = pb_grpc.GenerationStub(self._channel)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def warmup(self, count: int) -> None:
        """Send ``count`` short unrecorded chats; fail fast if the first fails (as ``Sender.warmup``)."""
        for index in range(count):
            record = await self.send(RequestSpec([{"role": "user", "content": "Say hello."}], max_tokens=2), index=-1 - index)
            if not record.ok:
                raise BenchError(f"warm-up request to {self.target.url} failed ({record.error_kind}): {record.error}")

    async def send(self, spec: RequestSpec, index: int, scheduled_s: float | None = None) -> RequestRecord:
        """Send ``spec`` once as a ``Chat`` RPC and return its record; errors are recorded, not raised."""
        if self._stub is None:
            raise RuntimeError("use 'async with GrpcSender(...)' before sending")
        record = RequestRecord(
            index=index, group=spec.group, stream=spec.stream, max_tokens=spec.max_tokens,
            conversation_id=spec.conversation_id, turn=spec.turn, session_id=spec.session_id,
        )  # fmt: skip
        # Convert before the clock starts, as the HTTP sender encodes its JSON first.
        request = convert.chat_request(spec.body(self.model))
        metadata = self._metadata + tuple((name.lower(), value) for name, value in spec.headers().items())
        parts: list[str] = []
        started = False
        record.start_s = self.clock()
        record.scheduled_s = record.start_s if scheduled_s is None else scheduled_s
        try:
            rpc = self._stub.Chat(request, metadata=metadata, timeout=self.target.timeout_s)
            async for message in rpc:
                arrived_s = self.clock()
                if not started:
                    started = True
                    self.server_is_ember = self.server_is_ember or _has_key(await rpc.initial_metadata(), EMBER_REPLY_METADATA)
                    self.model = self.model or message.model
                if message.text:
                    parts.append(message.text)
                    if spec.stream:
                        record.chunk_times_s.append(arrived_s)
                if message.finish_reason:
                    record.finish_reason, implied_stop = convert.FINISH_FIELDS.get(message.finish_reason, (None, None))
                    record.stop_reason = message.stop_reason or implied_stop
                if message.HasField("usage"):
                    record.prompt_tokens = message.usage.prompt_tokens
                    record.output_tokens = message.usage.completion_tokens
                    record.output_tokens_source = "usage"
                    record.cached_tokens = message.usage.cached_tokens
            record.status = 200
            if not spec.stream and parts:
                record.chunk_times_s = [self.clock()]
        except grpc.aio.AioRpcError as exc:
            decoded = status.decode(exc)
            record.status = decoded.http_status
            record.error = decoded.body["error"]["message"]
            if decoded.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                record.error_kind = "timeout"
            elif decoded.from_ember:
                record.error_kind = "stream_error" if started else f"http_{decoded.http_status}"
            else:
                record.error_kind = "disconnect" if started else "connect"
        record.output_text = "".join(parts)
        if record.error_kind is None and record.finish_reason is None:
            record.error_kind, record.error = "incomplete", "stream ended without finish_reason"
        record.end_s = self.clock()
        return record


def _has_key(metadata: object, key: str) -> bool:
    return any(name == key for name, _ in metadata or ())  # type: ignore[attr-defined]
