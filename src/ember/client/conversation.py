"""Conversations: a message history plus a session id, one turn at a time.

The session id travels as ``X-Session-ID`` so that Ember (and its router) keep
the conversation's KV cache hot on the same replica. A turn joins the history
only when it completed: a failed or abandoned turn leaves the history as it was,
so ``send`` can simply be called again.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from ember.client.results import ChatResult
from ember.client.streaming import AsyncChatStream, ChatStream

if TYPE_CHECKING:
    from ember.client.async_client import AsyncClient
    from ember.client.client import Client


class _History:
    """The shared part: history, session id and default call keywords."""

    def __init__(self, system: str | None, session_id: str | None, params: dict[str, Any]) -> None:
        self.session_id = session_id or uuid.uuid4().hex
        self.messages: list[dict[str, Any]] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})
        self._params = params

    def _turn(self, text: str, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The user message and the chat keywords for the next turn."""
        user_message = {"role": "user", "content": text}
        keywords = {**self._params, **params, "session_id": self.session_id}
        keywords["messages"] = [*self.messages, user_message]
        return user_message, keywords

    def _commit(self, user_message: dict[str, Any], result: ChatResult) -> None:
        self.messages.append(user_message)
        self.messages.append({"role": "assistant", "content": result.text})


class AsyncConversation(_History):
    """A conversation over an ``AsyncClient``; make it with ``client.conversation(system=...)``."""

    def __init__(self, client: AsyncClient, *, system: str | None = None, session_id: str | None = None, **params: Any) -> None:
        super().__init__(system, session_id, params)
        self._client = client

    async def send(self, text: str, **params: Any) -> ChatResult:
        """Send a user turn; returns the answer, and both turns join the history."""
        user_message, keywords = self._turn(text, params)
        result = await self._client.chat(**keywords)
        self._commit(user_message, result)
        return result

    def stream(self, text: str, **params: Any) -> AsyncChatStream:
        """Stream a user turn; both turns join the history when the stream ends successfully."""
        user_message, keywords = self._turn(text, params)
        messages = keywords.pop("messages")
        return self._client._stream_chat(messages, keywords, lambda result: self._commit(user_message, result))


class Conversation(_History):
    """A conversation over a blocking ``Client``; make it with ``client.conversation(system=...)``."""

    def __init__(self, client: Client, *, system: str | None = None, session_id: str | None = None, **params: Any) -> None:
        super().__init__(system, session_id, params)
        self._client = client

    def send(self, text: str, **params: Any) -> ChatResult:
        """Send a user turn; returns the answer, and both turns join the history."""
        user_message, keywords = self._turn(text, params)
        result = self._client.chat(**keywords)
        self._commit(user_message, result)
        return result

    def stream(self, text: str, **params: Any) -> ChatStream:
        """Stream a user turn; both turns join the history when the stream ends successfully."""
        user_message, keywords = self._turn(text, params)
        messages = keywords.pop("messages")
        return self._client._stream_chat(messages, keywords, lambda result: self._commit(user_message, result))
