"""nats-server configuration for a NATS of your own (several hosts; docs/operations.md "Several hosts"):
one server, or one node of a NATS cluster, with Tidal's per-role users and their credentials files.

`tidal nats-config` writes it. Every node of a cluster gets the same users: the passwords are read back
from the credentials folder when it exists (run the command once per node with the same `--out`, or copy
the folder). The routes between nodes authenticate too (user `route`), so a stranger cannot join the
cluster through its cluster port. Monitoring is off unless asked for (it names every connection's user).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from shared import subjects
from shared.nats_credentials import NatsCredentials, credentials_path, read_credentials, write_credentials
from shared.nats_users import OPERATOR, NatsUsers

ROUTE_USER = "route"  # the cluster's routes between nodes (not a Tidal role)
MAX_PAYLOAD = "8MB"  # a KV migration's token fallback and big registry records fit; the clients follow the server


@dataclass(frozen=True)
class ServerConf:
    listen: str = "0.0.0.0:4222"
    store_dir: str = "/var/lib/tidal/nats"
    monitor: str | None = None  # host:port of the monitoring endpoint; None: off
    node: str | None = None  # server_name of a cluster node; None: a single server
    cluster_listen: str = "0.0.0.0:6222"
    routes: tuple[str, ...] = ()  # host:port of every node's cluster port (itself included)


def load_or_generate_users(credentials_dir: Path) -> tuple[NatsUsers, str]:
    """The users of every role (and the operator) and the route password: read back from
    `credentials_dir` where a file exists (the same users on every node), generated otherwise."""
    passwords: dict[str, str] = {}
    for role in (*subjects.ROLES, OPERATOR, ROUTE_USER):
        path = credentials_path(credentials_dir, role)
        passwords[role] = read_credentials(path).password if path.exists() else secrets.token_hex(16)
    route = passwords.pop(ROUTE_USER)
    return NatsUsers(passwords), route


def write_credentials_dir(credentials_dir: Path, users: NatsUsers, route_password: str, url: str | None) -> list[Path]:
    paths = users.write_credentials(credentials_dir, url, [*subjects.ROLES, OPERATOR])
    paths.append(write_credentials(credentials_path(credentials_dir, ROUTE_USER), ROUTE_USER,
                                   NatsCredentials(ROUTE_USER, route_password)))
    return paths


def render_server_conf(conf: ServerConf, users: NatsUsers, route_password: str) -> str:
    lines = [
        "# Written by `tidal nats-config`: Tidal's per-role users with the subject catalog's permissions.",
        "# It holds every role's password: readable by the nats-server's user only.",
        f'listen: "{conf.listen}"',
        f"max_payload: {MAX_PAYLOAD}",
    ]
    if conf.monitor:
        lines.append(f'http: "{conf.monitor}"  # monitoring lists every connection and its user: keep it private')
    if conf.node:
        lines.append(f'server_name: "{conf.node}"')
    lines += ["jetstream {", f'  store_dir: "{conf.store_dir}"',
              "  sync_interval: always  # an acknowledged registry write survives a crash", "}"]
    if conf.node:
        routes = "".join(f'    "nats-route://{ROUTE_USER}:{route_password}@{route}"\n' for route in conf.routes)
        lines += [
            "cluster {",
            '  name: "tidal"',
            f'  listen: "{conf.cluster_listen}"',
            f'  authorization {{ user: "{ROUTE_USER}", password: "{route_password}" }}',
            f"  routes: [\n{routes}  ]",
            "}",
        ]
    return "\n".join(lines) + "\n" + users.authorization()


__all__ = ["MAX_PAYLOAD", "ROUTE_USER", "ServerConf", "load_or_generate_users", "render_server_conf",
           "write_credentials_dir"]
