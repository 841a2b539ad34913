"""A role's NATS credentials in a file: what one process needs to connect as its role, so that no
password is ever on a command line (`ps` shows every user's arguments) and nobody needs nats.conf.

One small TOML file per role, mode 0600:

    # NATS credentials of the Tidal role "scheduler" ...
    user = "scheduler"
    password = "3f9a..."
    url = "nats://10.77.0.1:4222"   # optional: the servers, comma-separated for a NATS cluster

`tidal up` writes `<data_dir>/credentials/scheduler.toml` for an external scheduler to its embedded
NATS; `tidal nats-config` writes one per role for a NATS of your own (several hosts, docs/operations.md)
and `tidal up --nats URL --nats-credentials DIR` gives each child its own from DIR, in its environment.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

CREDENTIALS_DIR = "credentials"  # under a data_dir, or the folder `tidal nats-config` writes


@dataclass(frozen=True)
class NatsCredentials:
    user: str
    password: str
    url: str | None = None  # the NATS servers, comma-separated; None: given elsewhere (`--nats`)

    def url_with(self, base_url: str | None = None) -> str:
        """`base_url` (else this file's url) with these credentials in every server of it."""
        servers = base_url or self.url
        if not servers:
            raise ValueError(f"no NATS URL for user {self.user!r}: the credentials file names none and none was given")
        return ",".join(with_user(server.strip(), self.user, self.password) for server in servers.split(",")
                        if server.strip())


def with_user(server: str, user: str, password: str) -> str:
    """One server URL (`nats://host:port`) carrying `user`:`password` (replacing any it had)."""
    parts = urlsplit(server if "://" in server else f"nats://{server}")
    if not parts.hostname:
        raise ValueError(f"not a NATS server URL: {server!r} (expected nats://host:port)")
    netloc = f"{user}:{password}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def credentials_path(directory: str | Path, role: str) -> Path:
    return Path(directory) / f"{role}.toml"


def write_credentials(path: str | Path, role: str, creds: NatsCredentials) -> Path:
    """Write (or replace) the file, readable by its owner only from the first byte on."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f'# NATS credentials of the Tidal role "{role}": keep this file private (mode 0600).',
             f'user = "{creds.user}"', f'password = "{creds.password}"']
    if creds.url:
        lines.append(f'url = "{creds.url}"  # the NATS servers, comma-separated')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)  # an existing file keeps its mode through O_TRUNC: set it
        out.write("\n".join(lines) + "\n")
    return path


def read_credentials(path: str | Path) -> NatsCredentials:
    """The file's credentials; ValueError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"NATS credentials file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read NATS credentials file {path}: {exc}") from None
    for key in ("user", "password"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ValueError(f"NATS credentials file {path}: `{key}` is missing or not a non-empty string")
    url = data.get("url")
    if url is not None and not isinstance(url, str):
        raise ValueError(f"NATS credentials file {path}: `url` must be a string")
    unknown = set(data) - {"user", "password", "url"}
    if unknown:
        raise ValueError(f"NATS credentials file {path}: unknown key(s) {', '.join(sorted(unknown))}")
    return NatsCredentials(user=data["user"], password=data["password"], url=url or None)


def split_credentials(url: str) -> tuple[list[str], str | None, str | None]:
    """A (comma-separated) URL as the client connects with it: the servers without credentials, and the
    user and password the first of them carried. Given as connect options rather than in each URL, the
    client also authenticates to the servers it discovers from a NATS cluster (nats-py does not copy a
    URL's credentials to those)."""
    servers, user, password = [], None, None
    for server in (s.strip() for s in url.split(",")):
        if not server:
            continue
        parts = urlsplit(server)
        if parts.username is not None and user is None:
            user, password = parts.username, parts.password
        netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
        servers.append(urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)))
    if not servers:
        raise ValueError(f"no NATS server in URL {url!r}")
    return servers, user, password


__all__ = ["CREDENTIALS_DIR", "NatsCredentials", "credentials_path", "read_credentials", "split_credentials",
           "with_user", "write_credentials"]
