"""API keys: `Authorization: Bearer <key>` checked in constant time against the configured keys.

Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every configured key
without stopping at a match, so neither the key's length nor which key matched shows in the
timing. The digest (hex, shortened) also names the key in rate limits and logs — never the key.
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

BEARER = b"bearer "


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(k.encode()) for k in keys]

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: bytes | None) -> str | None:
        """The key's id (a digest prefix) if the header carries a configured key, else None."""
        if authorization is None or authorization[:7].lower() != BEARER:
            return None
        presented = _digest(authorization[7:].strip())
        matched = False
        for digest in self._digests:  # no early exit: the time does not depend on which key matched
            matched |= hmac.compare_digest(presented, digest)
        return presented.hex()[:16] if matched else None

    @staticmethod
    def key_id(authorization: bytes | None) -> str | None:
        """The id of whatever bearer key was sent (rate limits without configured keys)."""
        if authorization is None or authorization[:7].lower() != BEARER:
            return None
        return _digest(authorization[7:].strip()).hex()[:16]


__all__ = ["ApiKeys"]
