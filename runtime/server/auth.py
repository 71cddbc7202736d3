"""Optional API keys for the OpenAI routes: ``--api-key`` (repeatable) or ``KUBELLM_API_KEY`` (comma-separated).

Health and metrics stay open (the kubelet and Prometheus carry no key). Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import os

from fastapi import Request

from kubellm.runtime.server.errors import APIError

API_KEY_ENV = "KUBELLM_API_KEY"  # what the operator renders from spec.auth.apiKeySecretRef


def api_keys_from(flags: list[str] | None, environ=os.environ) -> tuple[str, ...]:
    """The keys to accept: the flags, else the environment variable; empty entries dropped."""
    raw = list(flags or []) or environ.get(API_KEY_ENV, "").split(",")
    return tuple(k.strip() for k in raw if k.strip())


def require_api_key(keys: tuple[str, ...]):
    """A FastAPI dependency that answers 401 unless the request carries one of ``keys`` (no-op without keys)."""
    encoded = [k.encode() for k in keys]

    async def check(request: Request) -> None:
        if not encoded:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        # Compare against every key, so the time taken says nothing about which one nearly matched.
        ok = scheme.lower() == "bearer" and any([hmac.compare_digest(given, k) for k in encoded])
        if not ok:
            raise APIError(401, "invalid or missing API key: send `Authorization: Bearer <key>`",
                           "authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    return check
