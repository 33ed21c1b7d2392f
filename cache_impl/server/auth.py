"""The server's two secrets: the API key (for /v1/*) and the admin token (for /admin/*).

Clients send the API key as `Authorization: Bearer KEY` (as OpenAI's do) and the admin
token in its own header, `X-Kvgate-Admin-Token: TOKEN`, so a client may hold both.
Both are compared in constant time. Admin routes exist only with a token: whoever can
reach them can evict tiers and arm disk faults, and "only on loopback" still means
every local user.
"""

from __future__ import annotations

import hmac
import os
import string
from typing import Optional

from cache_impl.cache.config import ConfigError

ADMIN_TOKEN_ENV = "KVGATE_ADMIN_TOKEN"        # where `kvgate serve --admin` and the admin client find it
ADMIN_TOKEN_HEADER = "X-Kvgate-Admin-Token"
MIN_SECRET_CHARS = 16  # the admin token's and the API key's least length
_TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + string.punctuation)


def secret_matches(given: Optional[str], expected: str) -> bool:
    """Whether a header value is the secret, in time independent of where they differ."""
    if given is None:
        return False
    # Header values arrive decoded as latin-1: encoding them back gives the bytes sent.
    return hmac.compare_digest(given.encode("latin-1", "replace"), expected.encode("utf-8"))


def admin_token_from_env(env_name: str = ADMIN_TOKEN_ENV) -> str:
    """The admin token in `env_name`; a ConfigError when it is unset or too weak to guard the routes."""
    token = os.environ.get(env_name, "")
    if not token:
        raise ConfigError(f"--admin: expected an admin token in the environment variable {env_name} (clients "
                          f"send it in the {ADMIN_TOKEN_HEADER} header), found none; generate one with "
                          f"`{_GENERATE}`")
    return _strong(token, "--admin", "an admin token", env_name)


def api_key_from_env(env_name: str) -> Optional[str]:
    """The API key in `env_name`, None when it is unset or empty; a ConfigError when it is too weak."""
    key = os.environ.get(env_name, "")
    return _strong(key, "--api-key-env", "an API key", env_name) if key else None


_GENERATE = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


def _strong(secret: str, flag: str, what: str, env_name: str) -> str:
    """`secret` when it is at least MIN_SECRET_CHARS printable ASCII characters, else a ConfigError."""
    if len(secret) < MIN_SECRET_CHARS or not set(secret) <= _TOKEN_CHARS:
        raise ConfigError(f"{flag}: expected {what} of at least {MIN_SECRET_CHARS} printable ASCII characters "
                          f"without spaces in {env_name}, found {len(secret)} characters"
                          + ("" if set(secret) <= _TOKEN_CHARS else " with others among them")
                          + f"; generate one with `{_GENERATE}`")
    return secret
