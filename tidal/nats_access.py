"""Which NATS user each process `tidal up` starts connects as, and the credentials it leaves for others.

Embedded NATS: every service its own generated user; this user's tools (the run state, mode 0600) the
operator's; and `<data_dir>/credentials/scheduler.toml`, the scheduler role alone, for an external
scheduler (it needs neither nats.conf nor the operator's password).

A NATS of your own (`--nats URL`, several hosts): with `--nats-credentials DIR` (the files `tidal
nats-config` wrote) every child connects as its own role and `tidal up` itself, its health probe and the
run state as `cli` (allowed to ask every service's health); without it, the URL as given for all. Either
way the URL reaches a child in its environment, never on its command line.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from shared.nats_credentials import CREDENTIALS_DIR, NatsCredentials, credentials_path, write_credentials
from shared.nats_server import NatsServer
from shared.nats_users import OPERATOR, NatsUsers

TOOLS_ROLE = "cli"  # `tidal up`'s probe, `tidal status` and `tidal down` against a NATS of your own


@dataclass(frozen=True)
class NatsAccess:
    tools_url: str  # the launcher's own connection and the run state's URL
    role_url: Callable[[str], str]  # a service -> the URL its process connects with


def embedded_access(server: NatsServer) -> NatsAccess:
    return NatsAccess(tools_url=server.url_for(OPERATOR), role_url=server.url_for)


def external_access(url: str, credentials_dir: str | None, services: Iterable[str]) -> NatsAccess:
    """`url` as given for all, or each role's credentials from `credentials_dir` (ValueError naming a
    missing or malformed file, before anything starts)."""
    if credentials_dir is None:
        return NatsAccess(tools_url=url, role_url=lambda _service: url)
    users = NatsUsers.from_credentials_dir(credentials_dir, {*services, TOOLS_ROLE})
    return NatsAccess(tools_url=users.url(url, TOOLS_ROLE), role_url=lambda service: users.url(url, service))


def write_scheduler_credentials(server: NatsServer, data_dir: Path) -> Path:
    """The scheduler role's credentials file for an external scheduler of this run (mode 0600)."""
    assert server.users is not None, "the embedded NATS always has users"
    creds = NatsCredentials("scheduler", server.users.passwords["scheduler"], server.url)
    return write_credentials(credentials_path(data_dir / CREDENTIALS_DIR, "scheduler"), "scheduler", creds)


__all__ = ["NatsAccess", "TOOLS_ROLE", "embedded_access", "external_access", "write_scheduler_credentials"]
