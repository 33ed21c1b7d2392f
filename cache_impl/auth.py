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

from .config import ConfigError

ADMIN_TOKEN_ENV = "KVGATE_ADMIN_TOKEN"        # where `kvgate serve --admin` and the admin client find it
ADMIN_TOKEN_HEADER = "X-Kvgate-Admin-Token"
MIN_ADMIN_TOKEN_CHARS = 16
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
                          f"`python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    if len(token) < MIN_ADMIN_TOKEN_CHARS or not set(token) <= _TOKEN_CHARS:
        raise ConfigError(f"--admin: expected an admin token of at least {MIN_ADMIN_TOKEN_CHARS} printable ASCII "
                          f"characters without spaces in {env_name}, found {len(token)} characters"
                          + ("" if set(token) <= _TOKEN_CHARS else " with others among them"))
    return token
