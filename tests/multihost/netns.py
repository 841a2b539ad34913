"""Three "hosts" on one machine: Linux network namespaces on a bridge, addresses 10.77.0.1-3/24.

Each namespace has its own loopback and port space and one link (`eth0`, a veth pair whose other
end is on the bridge); the bridge itself holds 10.77.0.254 so the test process reaches the hosts.
`cut(i)` takes host i's link down (a partition: its processes keep running, nothing reaches them),
`heal(i)` brings it back. Traffic goes only to the addresses made here. Needs root and `ip netns`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

SUBNET = "10.77.0"
BRIDGE_ADDRESS = f"{SUBNET}.254"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (the reason to skip), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"tdlprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    def __init__(self, count: int = 3) -> None:
        tag = f"{os.getpid() % 10000}"
        self.count = count
        self.bridge = f"tdl{tag}br"
        self.namespaces = [f"tdl{tag}h{i}" for i in range(1, count + 1)]
        self.links = [f"tdl{tag}v{i}" for i in range(1, count + 1)]  # the bridge's end of each host's link

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host}"

    def create(self) -> "Hosts":
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host, (ns, link) in enumerate(zip(self.namespaces, self.links), start=1):
            _ip("netns", "add", ns)
            _ip("link", "add", link, "type", "veth", "peer", "name", f"{link}p")
            _ip("link", "set", f"{link}p", "netns", ns)
            _ip("-n", ns, "link", "set", f"{link}p", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", link, "master", self.bridge)
            _ip("link", "set", link, "up")
        return self

    def cut(self, host: int) -> None:
        _ip("link", "set", self.links[host - 1], "down")

    def heal(self, host: int) -> None:
        _ip("link", "set", self.links[host - 1], "up")

    def popen(self, host: int, argv: Sequence[str], *, log: Path, env: Mapping[str, str],
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """`argv` run inside host `host` (its own process group), output to `log`."""
        with open(log, "ab") as out:
            return subprocess.Popen(["ip", "netns", "exec", self.namespaces[host - 1], *argv], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    env=dict(env), cwd=cwd)

    def destroy(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)
        for link in self.links:
            _ip("link", "del", link, check=False)
        _ip("link", "del", self.bridge, check=False)
