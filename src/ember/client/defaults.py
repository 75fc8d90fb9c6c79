"""Where a client finds its server and its key when the caller names neither.

One definition for every client in the package (``AsyncClient``, ``Client``,
``ember chat``, ``ember bench``): the local Ember server, and the API key from
the environment, Ember's variable first, then the one OpenAI's clients read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ember.config import ServerConfig

DEFAULT_BASE_URL = f"http://{ServerConfig.host}:{ServerConfig.port}/v1"
API_KEY_ENV_VARS = ("EMBER_API_KEY", "OPENAI_API_KEY")


def api_key_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """The first non-empty of ``$EMBER_API_KEY`` and ``$OPENAI_API_KEY``, or None."""
    return next((environ[name] for name in API_KEY_ENV_VARS if environ.get(name)), None)
