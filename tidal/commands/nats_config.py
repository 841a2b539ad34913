"""`tidal nats-config --out DIR [--node NAME --routes H1:6222,H2:6222,H3:6222]`: a NATS of your own.

Writes DIR/nats.conf (or DIR/nats-<NAME>.conf for one node of a NATS cluster) with Tidal's per-role users,
and DIR/credentials/<role>.toml, one file per role (mode 0600). Start `nats-server -c` on that file on
the NATS host(s); copy the credentials folder (or only the roles a host runs, plus `cli`) to each Tidal
host and run `tidal up --nats URL --nats-credentials DIR/credentials` there. Give an external scheduler
`scheduler.toml` alone. Run it again with the same --out for the next node: the users are read back.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("nats-config", help="write a nats-server config and per-role credentials files")
    parser.add_argument("--out", required=True, help="folder for the config and credentials/ (created)")
    parser.add_argument("--url", help="the NATS servers the credentials files name (comma-separated)")
    parser.add_argument("--listen", default="0.0.0.0:4222", help="client listener (default: %(default)s)")
    parser.add_argument("--store-dir", default=None, help="JetStream store (default: OUT/jetstream[-NODE])")
    parser.add_argument("--monitor", metavar="HOST:PORT", default=None,
                        help="monitoring endpoint (default: off; it lists every connection and its user)")
    parser.add_argument("--node", help="this node's server_name, for one node of a NATS cluster")
    parser.add_argument("--routes", type=_csv, default=[], metavar="LIST",
                        help="with --node: every node's cluster address host:6222, comma-separated")
    parser.add_argument("--cluster-listen", default="0.0.0.0:6222", help="with --node (default: %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.nats_host_conf import ServerConf, load_or_generate_users, render_server_conf, write_credentials_dir

    if bool(args.node) != bool(args.routes):
        print("tidal nats-config: --node and --routes go together (one node of a NATS cluster)", file=sys.stderr)
        return 2
    out = Path(args.out)
    creds_dir = out / "credentials"
    try:
        users, route_password = load_or_generate_users(creds_dir)
    except ValueError as exc:
        print(f"tidal nats-config: {exc}", file=sys.stderr)
        return 2
    store = args.store_dir or str(out / (f"jetstream-{args.node}" if args.node else "jetstream"))
    conf = ServerConf(listen=args.listen, store_dir=store, monitor=args.monitor, node=args.node,
                      cluster_listen=args.cluster_listen, routes=tuple(args.routes))
    url = args.url
    if url is None and (creds_dir / "cli.toml").exists():  # the next node of a cluster: keep the servers named
        from shared.nats_credentials import read_credentials

        url = read_credentials(creds_dir / "cli.toml").url
    write_credentials_dir(creds_dir, users, route_password, url)
    path = out / (f"nats-{args.node}.conf" if args.node else "nats.conf")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds every password
    with os.fdopen(fd, "w") as conf_file:
        os.fchmod(conf_file.fileno(), 0o600)
        conf_file.write(render_server_conf(conf, users, route_password))
    print(f"wrote {path} (nats-server -c {path}) and {creds_dir}/<role>.toml")
    return 0
