"""Tokenizer and chat template.

A Hugging Face ``tokenizers.Tokenizer`` is built either from a directory's
tokenizer.json or from the vocabulary and merges inside a GGUF file. Building
from GGUF takes a moment, so the result is cached as tokenizer.json under the
user cache directory, keyed by the model file's hash.

Chat templates are the model's own Jinja templates, rendered in Jinja2's
immutable sandbox: a template comes from a file the user did not write, so it
must not reach Python internals.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ember.errors import ModelFormatError
from ember.model.checkpoint import TokenizerSource

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer regexes by GGUF ``tokenizer.ggml.pre``, as llama.cpp defines them.
_LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Used when a model ships no chat template: ChatML, which most chat models know.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """Ember's cache directory (``EMBER_CACHE_DIR`` or the platform user cache)."""
    override = os.environ.get("EMBER_CACHE_DIR")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("ember"))


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama-bpe", "llama3", "dbrx", "smaug-bpe"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_REGEX), "isolated"), byte_level])
    if pre == "qwen2":
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_REGEX), "isolated"), byte_level])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # Every digit on its own, then GPT-2's regex (llama.cpp: LLAMA_VOCAB_PRE_TYPE_SMOLLM).
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return gpt2


def build_gguf_tokenizer(vocab: dict[str, Any]) -> HFTokenizer:
    """Build a byte-level BPE tokenizer from GGUF tokens, merges and token types."""
    if vocab["model"] != "gpt2":
        raise ModelFormatError(
            f"GGUF tokenizer model {vocab['model']!r} is not supported (byte-level BPE 'gpt2' is). "
            "Use the model's Hugging Face directory, whose tokenizer.json Ember reads directly."
        )
    tokens: list[str] = vocab["tokens"]
    merges = [tuple(m.split(" ", 1)) for m in vocab["merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, ignore_merges=False)
    tokenizer = HFTokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(vocab["pre"])
    tokenizer.decoder = decoders.ByteLevel()
    types = vocab["token_types"]
    added = [
        AddedToken(tokens[i], special=types[i] == _TOKEN_TYPE_CONTROL, normalized=False)
        for i in range(len(types))
        if types[i] in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])
    return tokenizer


def load_hf_tokenizer(source: TokenizerSource) -> HFTokenizer:
    """The ``tokenizers.Tokenizer`` for a model, from tokenizer.json or the GGUF cache."""
    if source.tokenizer_json_path:
        return HFTokenizer.from_file(source.tokenizer_json_path)
    assert source.gguf_vocab is not None
    cached = cache_dir() / "tokenizers" / f"{source.fingerprint}.json"
    if cached.is_file():
        try:
            return HFTokenizer.from_file(str(cached))
        except Exception:
            cached.unlink(missing_ok=True)  # a torn write; rebuild below
    tokenizer = build_gguf_tokenizer(source.gguf_vocab)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tokenizer.save(str(tmp))
        os.replace(tmp, cached)  # atomic: concurrent servers never read half a file
    except OSError:
        pass  # a read-only cache only costs the rebuild next time
    return tokenizer


@dataclass
class ChatMessage:
    """One message of a conversation, after the server validated it."""

    role: str
    content: str


class Tokenizer:
    """Encodes text, decodes ids, and renders the model's chat template."""

    def __init__(self, source: TokenizerSource) -> None:
        self._tok = load_hf_tokenizer(source)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = source.bos_token_id
        self.eos_token_ids: tuple[int, ...] = source.eos_token_ids
        self.add_bos_token = source.add_bos_token
        self.bos_token = self._tok.id_to_token(source.bos_token_id) if source.bos_token_id is not None else ""
        eos0 = source.eos_token_ids[0] if source.eos_token_ids else None
        self.eos_token = self._tok.id_to_token(eos0) if eos0 is not None else ""
        self.set_chat_template(source.chat_template or DEFAULT_CHAT_TEMPLATE)
        self.special_token_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def set_chat_template(self, source: str) -> None:
        """Render chats with ``source`` (Jinja); ``ModelFormatError`` if it does not compile."""
        self._template = _compile_template(source)
        self.chat_template_source = source
        # A template that reads `tools` renders tool definitions itself (server/tools.py).
        self.template_renders_tools = "tools" in _template_variables(source)

    @property
    def hf(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (used by the detokenizer)."""
        return self._tok

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are parsed as such."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id if (self.add_bos_token if add_bos is None else add_bos) else None
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (for OpenAI logprobs ``bytes``)."""
        piece = self._tok.decode([token_id], skip_special_tokens=False)
        return piece.encode("utf-8", errors="surrogatepass")

    def render_chat(
        self,
        messages: Sequence[ChatMessage | dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for ``messages`` according to the chat template (``tools`` for templates that read them)."""
        from jinja2 import TemplateError

        rows = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
        extra = {} if tools is None else {"tools": tools}
        try:
            return self._template.render(
                messages=rows,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except TemplateError as exc:
            raise ValueError(f"The chat template rejected these messages: {exc}") from exc

    def encode_chat(self, messages: Sequence[ChatMessage | dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode_rendered(self.render_chat(messages, add_generation_prompt))

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of a rendered chat prompt. Templates usually write the BOS text
        themselves; a BOS id is added only when the model wants one and the text lacks it."""
        return self.encode(text, add_bos=self.add_bos_token and not text.startswith(self.bos_token or "\0"))


def check_chat_template_file(path: str) -> str:
    """The text of a ``--chat-template`` file; ``SystemExit`` with the reason if it is unreadable or invalid."""
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"--chat-template {path}: cannot read it ({exc})") from None
    try:
        _compile_template(source)
    except ModelFormatError as exc:
        raise SystemExit(f"--chat-template {path}: {exc}") from None
    return source


def _template_variables(source: str) -> set[str]:
    """Names a template reads from its context (``tools``, ``messages`` ...)."""
    from jinja2 import Environment, meta

    return set(meta.find_undeclared_variables(Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)))


def _compile_template(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        from jinja2 import TemplateError

        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(source)
    except Exception as exc:
        raise ModelFormatError(f"The chat template does not compile: {exc}") from exc
