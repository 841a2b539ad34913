"""Per-role NATS users for the embedded nats-server that `tidal up` starts.

Without them anyone who can reach the port may publish anything: a forged `CapacityRequest` made the
planner load a model. `NatsUsers.generate()` gives every role of the subject catalog (the services,
`cli`, `scheduler`) a random password and the exact permissions `shared.nats_permissions` derives
for it, plus `operator`: every subject, for this user's own tools (the `tidal` commands, benches,
a scheduler under development). The URLs carry the credentials (`nats://role:password@host:port`);
the launcher gives each service its own and keeps the operator's in the run state (mode 0600), and
`redact` hides a password wherever a URL is shown.
"""
from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from shared import subjects
from shared.nats_permissions import render_authorization
from shared.url_credentials import redact

OPERATOR = "operator"


@dataclass(frozen=True)
class NatsUsers:
    passwords: Mapping[str, str]  # role -> password (hex: safe in a URL and in nats.conf)

    @classmethod
    def generate(cls) -> "NatsUsers":
        return cls({role: secrets.token_hex(16) for role in (*subjects.ROLES, OPERATOR)})

    def url(self, base_url: str, role: str) -> str:
        """`base_url` with `role`'s credentials; KeyError for a role without a user."""
        password = self.passwords[role]
        parts = urlsplit(base_url)
        netloc = f"{role}:{password}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

    def authorization(self) -> str:
        """nats.conf's `authorization` block: the catalog's roles and the operator."""
        return render_authorization(passwords=self.passwords, operator=OPERATOR in self.passwords)


__all__ = ["OPERATOR", "NatsUsers", "redact"]
