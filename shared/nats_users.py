"""Per-role NATS users for the embedded nats-server that `tidal up` starts.

Without them anyone who can reach the port may publish anything: a forged `CapacityRequest` made the
planner load a model. `NatsUsers.generate()` gives every role of the subject catalog (the services,
`cli`, `scheduler`) a random password and the exact permissions `shared.nats_permissions` derives
for it, plus `operator`: every subject, for this user's own tools (the `tidal` commands, benches,
a scheduler under development). The URLs carry the credentials (`nats://role:password@host:port`);
the launcher gives each service its own and keeps the operator's in the run state (mode 0600), and
`redact` hides a password wherever a URL is shown. `write_credentials` / `from_credentials_dir`: the
same users as one credentials file per role (shared/nats_credentials.py), for a NATS of your own.
"""
from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from shared import subjects
from shared.nats_credentials import NatsCredentials, credentials_path, read_credentials, write_credentials
from shared.nats_permissions import render_authorization
from shared.url_credentials import redact

OPERATOR = "operator"


@dataclass(frozen=True)
class NatsUsers:
    passwords: Mapping[str, str]  # role -> password (hex: safe in a URL and in nats.conf)

    @classmethod
    def generate(cls) -> "NatsUsers":
        return cls({role: secrets.token_hex(16) for role in (*subjects.ROLES, OPERATOR)})

    @classmethod
    def from_credentials_dir(cls, directory: str | Path, roles: Iterable[str]) -> "NatsUsers":
        """The users of `roles` from their credentials files in `directory` (`tidal nats-config` writes them);
        ValueError naming the file that is missing or wrong."""
        passwords: dict[str, str] = {}
        for role in roles:
            creds = read_credentials(credentials_path(directory, role))
            if creds.user != role:
                raise ValueError(f"{credentials_path(directory, role)} is for user {creds.user!r}, not {role!r}")
            passwords[role] = creds.password
        return cls(passwords)

    def url(self, base_url: str, role: str) -> str:
        """`base_url` (comma-separated servers allowed) with `role`'s credentials; KeyError for a role
        without a user."""
        return NatsCredentials(role, self.passwords[role]).url_with(base_url)

    def write_credentials(self, directory: str | Path, url: str | None, roles: Iterable[str]) -> list[Path]:
        """One credentials file (mode 0600) per role in `directory`, naming `url` as the servers."""
        return [write_credentials(credentials_path(directory, role), role,
                                  NatsCredentials(role, self.passwords[role], url)) for role in roles]

    def authorization(self) -> str:
        """nats.conf's `authorization` block: the catalog's roles and the operator."""
        return render_authorization(passwords=self.passwords, operator=OPERATOR in self.passwords)


__all__ = ["OPERATOR", "NatsUsers", "redact"]
