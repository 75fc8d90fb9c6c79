"""Which grammar a request's output must follow, compiled into one Constraint per choice.

``response_format`` and tools are the two sources (``server/tools.py`` writes
the tool-call grammar). Compiling happens here, on the event loop and before
admission, so a schema the library cannot use is a 400 naming the field, and
the engine thread only ever advances ready matchers.
"""

from __future__ import annotations

from ember.engine.api import GRAMMAR_INSTALL_HINT, AsyncEngine, Constraint, GrammarSpec, InvalidGrammarError, grammar_available
from ember.server.errors import bad_request
from ember.server.protocol import ChatCompletionRequest, ResponseFormatJsonObject, ResponseFormatJsonSchema
from ember.server.tools import ToolSpec, call_grammar
from ember.server.unsupported import unsupported_value


def chat_grammar(body: ChatCompletionRequest, tools: ToolSpec) -> tuple[GrammarSpec | None, str]:
    """The grammar of a chat reply (None for free text) and the request field it comes from."""
    fmt = body.response_format
    structured = isinstance(fmt, (ResponseFormatJsonObject, ResponseFormatJsonSchema))
    if tools.calls_possible:
        if structured:
            raise unsupported_value(
                "response_format together with tools is not supported: send tool_choice 'none' to get a structured reply, or drop response_format.",
                "response_format",
            )
        return call_grammar(tools), "tools"
    if isinstance(fmt, ResponseFormatJsonSchema):
        schema = fmt.json_schema.json_schema
        if schema is None:
            return GrammarSpec.json_object(), "response_format"
        return GrammarSpec.json_schema(schema), "response_format.json_schema.schema"
    if isinstance(fmt, ResponseFormatJsonObject):
        return GrammarSpec.json_object(), "response_format"
    return None, ""


def compile_constraints(engine: AsyncEngine, spec: GrammarSpec | None, param: str, n: int) -> list[Constraint | None]:
    """One Constraint per choice (the grammar compiles once; copies are cheap); 400 on failure."""
    if spec is None:
        return [None] * n
    if not grammar_available():
        raise bad_request(
            f"'{param.split('.')[0]}' needs the grammar library, which this server lacks: install it with {GRAMMAR_INSTALL_HINT}.",
            param.split(".")[0],
            "structured_outputs_unavailable",
        )
    try:
        return [engine.compile_grammar(spec, param) for _ in range(n)]
    except InvalidGrammarError as exc:
        raise bad_request(str(exc), exc.param, "invalid_schema") from None
