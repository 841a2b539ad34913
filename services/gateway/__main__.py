"""`python -m services.gateway`: the OpenAI-compatible HTTP API of the cluster.

Listens on the config's `[gateway] host/port` (default 127.0.0.1:8000); `--host`/`--port`
override it (`--port 0`: a free port, logged). Announces itself in the registry, answers
health on NATS and drains on SIGTERM (see services/gateway/server.py).
"""
from __future__ import annotations

import argparse

from shared.bootstrap import bootstrap
from shared.service import run

from services.gateway.server import GatewayServer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.gateway")  # bootstrap adds the common options
    parser.add_argument("--host", default=None, help="HTTP listen address (default: the config's [gateway] host)")
    parser.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's [gateway] port)")
    parser.add_argument("--stream-subscription", choices=["wildcard", "per_request"], default="wildcard",
                        help="how token chunks are received: one wildcard subscription, or one per request")
    boot = bootstrap("gateway", argv, parser=parser)
    args: argparse.Namespace = boot.args
    gateway = boot.config.gateway
    boot.announce()  # first: on SIGTERM its draining heartbeat goes out before the gateway waits for streams
    GatewayServer(
        boot.service, boot.config,
        host=args.host if args.host is not None else gateway.host,
        port=args.port if args.port is not None else gateway.port,
        hub_mode=args.stream_subscription,
    )
    run(boot.service)


if __name__ == "__main__":
    main()
