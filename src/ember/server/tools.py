"""Tool calling: tools into the prompt, the grammar of a call, calls out of the reply.

The wire format of a call is the one tools-aware chat templates of the
Hermes / Qwen family teach their models, written compact::

    <tool_call>
    {"name":"get_weather","arguments":{"city":"Paris"}}
    </tool_call>

Several calls (``parallel_tool_calls``) follow each other, one per line.

``tool_choice`` decides what the grammar (engine/constraints.py) allows:

- ``none``: tools are not shown to the model and no call can be made.
- ``auto``: the reply is either text or calls, decided by its first
  character: a reply that starts with ``<`` is calls, and then every call is
  constrained to the given schemas; text may never contain ``<tool_call>``.
- ``required``: one or more calls (exactly one without parallel calls).
- a named function: exactly one call of that function.

A chat template that reads ``tools`` itself (``--chat-template FILE``) gets the
tool definitions and the history in Hugging Face's shape; for one that does not
(SmolLM2's), the definitions go into the system message and past calls and
results are written as the format above, ``<tool_response>`` for results.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from ember.engine.api import GrammarSpec
from ember.server.errors import bad_request
from ember.server.protocol import ChatCompletionRequest, ChatMessage, FunctionDefinition, NamedToolChoice

ToolMode = Literal["none", "auto", "required", "named"]

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
# Inside a call, before the function's name and before its arguments (compact JSON).
_NAME_PREFIX = '{"name":'
_ARGS_PREFIX = ',"arguments":'
_BODY_CLOSE = "}"
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolSpec:
    """What a request allows: its mode, the functions calls may use, and whether several may follow."""

    mode: ToolMode
    functions: tuple[FunctionDefinition, ...] = ()
    parallel: bool = True
    # Every function of the request (the prompt shows all of them, even for a named choice).
    offered: tuple[FunctionDefinition, ...] = ()

    @property
    def calls_possible(self) -> bool:
        return self.mode != "none" and bool(self.functions)


def tool_spec(body: ChatCompletionRequest) -> ToolSpec:
    """The request's tool settings, validated; 400s name the field at fault."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools: send the functions the model may call in 'tools'.", "tool_choice")
        return ToolSpec("none")
    functions = tuple(t.function for t in tools)
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("Function names in 'tools' must be unique.", "tools")
    for i, function in enumerate(functions):
        if function.parameters is not None and function.parameters.get("type", "object") != "object":
            raise bad_request("A function's parameters must be a JSON schema of type 'object'.", f"tools.{i}.function.parameters")
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        chosen = [f for f in functions if f.name == choice.function.name]
        if not chosen:
            raise bad_request(f"tool_choice names '{choice.function.name}', which is not in 'tools'.", "tool_choice")
        return ToolSpec("named", tuple(chosen), parallel=False, offered=functions)
    mode: ToolMode = choice or "auto"
    return ToolSpec(mode, functions if mode != "none" else (), parallel, functions)


# -- the prompt ---------------------------------------------------------------------


def openai_tool(function: FunctionDefinition) -> dict[str, Any]:
    """A function as OpenAI (and Hugging Face templates) write it."""
    entry: dict[str, Any] = {"name": function.name}
    if function.description:
        entry["description"] = function.description
    entry["parameters"] = function.parameters if function.parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": entry}


def tools_section(spec: ToolSpec) -> str:
    """The system-prompt text that shows the model its tools and the call format."""
    lines = [json.dumps(openai_tool(f), ensure_ascii=False) for f in spec.offered]
    rule = {
        "auto": "Call a function only when it helps; otherwise answer in plain text.",
        "required": "You must call at least one function.",
        "named": f"You must call the function {spec.functions[0].name}." if spec.functions else "",
    }.get(spec.mode, "")
    return (
        "# Tools\n\n"
        "You can call functions to help with the user's request. These are their signatures, one JSON object per line:\n"
        "<tools>\n" + "\n".join(lines) + "\n</tools>\n\n"
        "To call a function, reply with a JSON object holding its name and arguments inside <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name":"<function name>","arguments":{<arguments>}}\n</tool_call>\n' + rule
    ).rstrip()


def format_call(name: str, arguments: str) -> str:
    """One call as the model writes it; ``arguments`` is JSON text, kept as sent."""
    return f"{CALL_OPEN}{_NAME_PREFIX}{json.dumps(name, ensure_ascii=False)}{_ARGS_PREFIX}{arguments}{_BODY_CLOSE}{CALL_CLOSE}"


def render_messages(
    messages: list[ChatMessage], spec: ToolSpec, template_renders_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages for the chat template, and the ``tools`` argument for templates that read it."""
    if template_renders_tools:
        tools = [openai_tool(f) for f in spec.offered] if spec.mode != "none" else None
        return [_hf_message(m) for m in messages], tools or None
    rows: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        if role == "tool":
            result = f"<tool_response>\n{m.text()}\n</tool_response>"
            if rows and rows[-1].get("_tool_results"):
                rows[-1]["content"] += "\n" + result
            else:
                rows.append({"role": "user", "content": result, "_tool_results": True})
            continue
        content = m.text()
        if role == "assistant" and m.tool_calls:
            calls = "\n".join(format_call(c.function.name, c.function.arguments) for c in m.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        rows.append({"role": role, "content": content})
    for row in rows:
        row.pop("_tool_results", None)
    if spec.mode != "none" and spec.offered:
        section = tools_section(spec)
        if rows and rows[0]["role"] == "system":
            rows[0]["content"] = f"{rows[0]['content']}\n\n{section}" if rows[0]["content"] else section
        else:
            rows.insert(0, {"role": "system", "content": section})
    return rows, None


def _hf_message(m: ChatMessage) -> dict[str, Any]:
    row: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        row["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments_value(c.function.arguments)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        row["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        row["name"] = m.name
    return row


def _arguments_value(arguments: str) -> Any:
    """Hugging Face templates expect arguments as a mapping; text that is not JSON stays text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# -- the grammar ----------------------------------------------------------------------


def call_grammar(spec: ToolSpec) -> GrammarSpec | None:
    """The Lark grammar (llguidance dialect) a reply must follow; None when no call is possible."""
    if not spec.calls_possible:
        return None
    alternatives = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": f.parameters if f.parameters is not None else _NO_PARAMETERS},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in spec.functions
    ]
    body = json.dumps({"anyOf": alternatives, "x-guidance": {"whitespace_flexible": False}}, ensure_ascii=False)
    calls = 'call ("\\n" call)*' if spec.parallel else "call"
    rules = [
        f"start: {'TEXT | calls' if spec.mode == 'auto' else 'calls'}",
        f"calls: {calls}",
        f"call: {json.dumps(CALL_OPEN)} body {json.dumps(CALL_CLOSE)}",
        f"body: %json {body}",
    ]
    if spec.mode == "auto":
        # Text never starts with "<" (that is how a call begins) and never holds a call tag.
        rules.append("TEXT: /[^<](.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/")
    return GrammarSpec.lark("\n".join(rules))


# -- the reply --------------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """A call read from the reply; ``complete`` once its closing tag arrived."""

    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A piece of a call for a stream: the first piece of a call carries its id and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        piece: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            piece.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        else:
            piece["function"] = {"arguments": self.arguments}
        return piece


@dataclass
class ReplyParser:
    """Splits a reply into content and tool calls as its text arrives.

    The grammar guarantees the compact format, so parsing is a walk over known
    prefixes; the arguments object is scanned for its closing brace (strings
    and escapes respected) so each piece is streamed the moment it arrives.
    Feeding a whole reply at once gives the same calls as feeding it in pieces.
    """

    mode: ToolMode
    calls: list[ToolCall] = field(default_factory=list)
    is_calls: bool | None = None  # None until the first character decides
    text: str = ""  # everything fed in call mode, in case it does not parse
    _buffer: str = ""
    _state: str = "open"  # open, name, args_prefix, args, close, between
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def __post_init__(self) -> None:
        if self.mode in ("required", "named"):
            self.is_calls = True
        elif self.mode == "none":
            self.is_calls = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content to stream and call pieces to stream, for the new ``text``."""
        if self.is_calls is None and text:
            self.is_calls = text[0] == "<"
        if not self.is_calls:
            return text, []
        self.text += text
        self._buffer += text
        deltas: list[ToolCallDelta] = []
        while self._step(deltas):
            pass
        return "", deltas

    def _step(self, deltas: list[ToolCallDelta]) -> bool:
        """Consume what the buffer allows in the current state; False when it must wait for more text."""
        b = self._buffer
        if self._state in ("open", "between"):
            if self._state == "between" and b.startswith("\n"):
                b = self._buffer = b[1:]
            prefix = CALL_OPEN + _NAME_PREFIX
            if len(b) < len(prefix):
                return False
            if not b.startswith(prefix):
                return self._give_up()
            self._buffer, self._state = b[len(prefix) :], "name"
            return True
        if self._state == "name":
            if not b:
                return False
            if b[0] != '"':
                return self._give_up()
            end = _string_end(b)
            if end < 0:
                return False
            try:
                name = json.loads(b[: end + 1])
            except ValueError:
                return self._give_up()
            self.calls.append(ToolCall(new_call_id(), name))
            deltas.append(ToolCallDelta(len(self.calls) - 1, "", self.calls[-1].id, name))
            self._buffer, self._state = b[end + 1 :], "args_prefix"
            return True
        if self._state == "args_prefix":
            if len(b) < len(_ARGS_PREFIX):
                return False
            if not b.startswith(_ARGS_PREFIX):
                return self._give_up()
            self._buffer, self._state = b[len(_ARGS_PREFIX) :], "args"
            self._depth, self._in_string, self._escaped = 0, False, False
            return True
        if self._state == "args":
            taken, done = self._scan_arguments(b)
            if taken:
                self.calls[-1].arguments += b[:taken]
                deltas.append(ToolCallDelta(len(self.calls) - 1, b[:taken]))
                self._buffer = b[taken:]
            if done:
                self._state = "close"
                return True
            return False
        if self._state == "close":
            closing = _BODY_CLOSE + CALL_CLOSE
            if len(b) < len(closing):
                return False
            if not b.startswith(closing):
                return self._give_up()
            self.calls[-1].complete = True
            self._buffer, self._state = b[len(closing) :], "between"
            return bool(self._buffer)
        return False

    def _scan_arguments(self, text: str) -> tuple[int, bool]:
        """How many characters of ``text`` belong to the arguments object, and whether it closed."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1, True
        return len(text), False

    def _give_up(self) -> bool:
        # Unreachable under the grammar; keep what arrived rather than lose it.
        self._state = "broken"
        return False

    @property
    def made_calls(self) -> bool:
        return bool(self.is_calls and self.calls)

    @property
    def broken(self) -> bool:
        """True if the text left the call format (only without a grammar, e.g. a custom template's own format)."""
        return self._state == "broken"


def _string_end(text: str) -> int:
    """Index of the quote closing the JSON string that starts at ``text[0]`` (a quote); -1 if not there yet."""
    escaped = False
    for i in range(1, len(text)):
        ch = text[i]
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            return i
    return -1
