"""Hide the password of a URL that carries credentials (`nats://role:password@host:port`)."""
from __future__ import annotations

import re

_CREDENTIALS = re.compile(r"//([^:/@]+):[^@/]*@")


def redact(url: str) -> str:
    """The URL with its password (if any) hidden: for logs, banners, status lines and errors."""
    return _CREDENTIALS.sub(r"//\1:***@", url)


__all__ = ["redact"]
