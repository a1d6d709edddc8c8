"""The server's API key without the key: replicas hold a salted SHA-256 of it and compare the
bearer token's digest in constant time. The key itself never enters a config, a deployment
argument or a runtime environment, so Ray's logs and dashboard never see it (use a
high-entropy key, e.g. ``openssl rand -hex 32``: a digest of a guessable one can be guessed)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass

from troupe.serving.protocol import RequestError


@dataclass(frozen=True)
class KeyDigest:
    salt: str    # hex
    sha256: str  # hex digest of salt + key

    @classmethod
    def of(cls, key: str) -> "KeyDigest":
        salt = secrets.token_hex(16)
        return cls(salt, _digest(salt, key))

    def matches(self, token: str) -> bool:
        return hmac.compare_digest(_digest(self.salt, token), self.sha256)


def authorize(header: str | None, key: KeyDigest | None) -> None:
    """Let a request through when its ``Authorization`` header is ``Bearer <key>`` (or the
    server has no key); else a 401 (the replicas' and agent mode's servers both check here)."""
    if key is None:
        return
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not key.matches(token.strip()):
        raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error")


def take_key(env: str) -> tuple[str | None, KeyDigest | None]:
    """The key in environment variable ``env`` and its digest, the variable removed from this
    process's environment: call it before Ray starts, so that no process the driver starts
    (Ray's own included) inherits the key. (None, None) when the variable is unset or empty."""
    key = os.environ.pop(env, None) or None
    return key, KeyDigest.of(key) if key else None


def _digest(salt: str, key: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt) + key.encode()).hexdigest()
