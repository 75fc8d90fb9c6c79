"""Named exceptions of the engine and model layers.

Every message says what was wrong and what the user can do about it. The server
maps these to OpenAI-style error bodies (``server/errors.py``).
"""

from __future__ import annotations


class EmberError(Exception):
    """Base class of every error Ember raises on purpose."""


class ModelNotFoundError(EmberError):
    """The model path does not exist or holds no loadable model."""


class ModelFormatError(EmberError):
    """The model file exists but is corrupt, truncated or of an unsupported kind."""


class InvalidSamplingParamsError(EmberError, ValueError):
    """A sampling value is out of range; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceededError(EmberError, ValueError):
    """Prompt plus requested completion do not fit the model's context."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        if num_prompt_tokens >= max_model_len:
            message = (
                f"This model's maximum context length is {max_model_len} tokens, "
                f"but the prompt has {num_prompt_tokens} tokens. Shorten the messages."
            )
        else:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. "
                f"You requested {num_prompt_tokens + max_tokens} tokens "
                f"({num_prompt_tokens} in the prompt, {max_tokens} for the completion). "
                "Reduce the length of the messages or the completion."
            )
        super().__init__(message)


class EngineDeadError(EmberError):
    """The engine's step loop stopped because of an internal error."""


class EngineOverloadedError(EmberError):
    """The engine cannot take the request now; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
