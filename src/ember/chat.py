"""``ember chat``: a terminal chat against any OpenAI-compatible URL.

Streams each reply as it arrives, keeps the conversation (and its session id,
so Ember keeps the KV cache warm), and prints time to first token and tokens
per second after every reply. ``/reset`` starts over, ``/exit`` (or EOF) quits.
With piped stdin, every line is one user turn.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from ember.client.defaults import DEFAULT_BASE_URL
from ember.client.results import ChatResult


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat in the terminal with a server", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default=os.environ.get("EMBER_URL", DEFAULT_BASE_URL), help="OpenAI-compatible base URL (env EMBER_URL)")
    p.add_argument("--model", default=None, help="model id (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("EMBER_API_KEY"), help="API key (env EMBER_API_KEY)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=None, help="per-reply max_tokens (default: the server's preset)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's, see its /v1/models)")
    p.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    from ember.client import Client, EmberClientError

    interactive = stdin.isatty()
    params = {} if args.temperature is None else {"temperature": args.temperature}
    if args.max_tokens is not None:
        params["max_tokens"] = args.max_tokens
    with Client(args.url, api_key=args.api_key, model=args.model) as client:
        conversation = client.conversation(system=args.system, **params)
        if interactive:
            stdout.write(f"Chatting with {args.url} (session {conversation.session_id}). /reset to start over, /exit to quit.\n")
        while True:
            if interactive:
                stdout.write("\n> ")
                stdout.flush()
            line = stdin.readline()
            if not line:
                break
            text = line.strip()
            if not text:
                continue
            if text == "/exit":
                break
            if text == "/reset":
                conversation = client.conversation(system=args.system, **params)
                stdout.write(f"(new conversation, session {conversation.session_id})\n")
                continue
            try:
                stream = conversation.stream(text)
                for delta in stream:
                    stdout.write(delta)
                    stdout.flush()
                result = stream.result
            except EmberClientError as exc:
                stdout.write(f"\n[error] {exc}\n")
                continue
            stdout.write("\n" + _stats_line(result) + "\n")
            stdout.flush()
    return 0


def _stats_line(result: ChatResult) -> str:
    tokens = result.usage.completion_tokens if result.usage else 0
    ttft = result.ttft_s or 0.0
    decode_s = max(result.latency_s - ttft, 1e-9)
    rate = (tokens - 1) / decode_s if tokens > 1 else 0.0
    return f"[TTFT {ttft * 1000:.0f} ms · {rate:.1f} tok/s · {tokens} tokens · {result.finish_reason}]"
