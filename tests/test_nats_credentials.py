"""Per-role NATS credentials files (shared/nats_credentials.py) and how `tidal up --nats URL
--nats-credentials DIR` gives each child its own (tidal/nats_access.py): private files, clear errors
naming the file, comma-separated servers, and a real nats-server that lets each role in as itself."""
from __future__ import annotations

import asyncio

import nats
import pytest

from shared.bus import Bus, BusSettings
from shared.nats_credentials import NatsCredentials, read_credentials, split_credentials, write_credentials
from shared.nats_server import NatsServer
from shared.nats_users import NatsUsers
from shared.subjects import SERVICES, planner_capacity
from shared.url_credentials import redact
from tidal.nats_access import external_access


def test_a_written_file_is_private_and_reads_back(tmp_path) -> None:
    path = tmp_path / "scheduler.toml"
    path.write_text("old")
    path.chmod(0o644)  # an existing file loses its wider mode
    write_credentials(path, "scheduler", NatsCredentials("scheduler", "s3cr3t", "nats://h1:4222,nats://h2:4222"))
    assert path.stat().st_mode & 0o077 == 0
    creds = read_credentials(path)
    assert creds == NatsCredentials("scheduler", "s3cr3t", "nats://h1:4222,nats://h2:4222")
    assert creds.url_with() == "nats://scheduler:s3cr3t@h1:4222,nats://scheduler:s3cr3t@h2:4222"
    assert creds.url_with("nats://other:4222") == "nats://scheduler:s3cr3t@other:4222"


@pytest.mark.parametrize(("text", "needle"), [
    ('user = "a"\n', "`password` is missing"),
    ('user = "a"\npassword = 3\n', "`password` is missing or not a non-empty string"),
    ('user = "a"\npassword = "b"\nurl = 5\n', "`url` must be a string"),
    ('user = "a"\npassword = "b"\ntoken = "c"\n', "unknown key(s) token"),
    ("user = ", "cannot read NATS credentials file"),
])
def test_a_bad_file_is_refused_naming_it_and_the_problem(tmp_path, text: str, needle: str) -> None:
    path = tmp_path / "cli.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match="cli.toml") as err:
        read_credentials(path)
    assert needle in str(err.value)
    with pytest.raises(ValueError, match="does not exist"):
        read_credentials(tmp_path / "nope.toml")


def test_split_credentials_gives_servers_without_them() -> None:
    servers, user, password = split_credentials("nats://cli:pw@10.0.0.1:4222, nats://cli:pw@10.0.0.2:4222")
    assert (servers, user, password) == (["nats://10.0.0.1:4222", "nats://10.0.0.2:4222"], "cli", "pw")
    assert split_credentials("nats://127.0.0.1:4222") == (["nats://127.0.0.1:4222"], None, None)
    with pytest.raises(ValueError, match="no NATS server"):
        split_credentials(" , ")


def test_external_access_refuses_a_missing_role_file_before_starting(tmp_path) -> None:
    users = NatsUsers.generate()
    users.write_credentials(tmp_path, None, ["registry", "cli"])
    with pytest.raises(ValueError, match="gateway.toml does not exist"):
        external_access("nats://10.0.0.1:4222", str(tmp_path), ["registry", "gateway"])
    access = external_access("nats://10.0.0.1:4222", str(tmp_path), ["registry"])
    assert access.role_url("registry") == f"nats://registry:{users.passwords['registry']}@10.0.0.1:4222"
    assert access.tools_url.startswith("nats://cli:")
    plain = external_access("nats://10.0.0.1:4222", None, SERVICES)
    assert plain.role_url("gateway") == plain.tools_url == "nats://10.0.0.1:4222"


async def test_each_role_connects_as_itself_with_its_file(tmp_path) -> None:
    users = NatsUsers.generate()
    server = NatsServer(store_dir=tmp_path / "nats", users=users).start()
    try:
        users.write_credentials(tmp_path / "creds", f"{server.url},{server.url}", ["dispatcher", "gateway", "cli"])
        access = external_access(server.url, str(tmp_path / "creds"), ["dispatcher", "gateway"])
        assert "monitor" not in server.config_text() and "http:" not in server.config_text()  # monitoring off
        for role in ("dispatcher", "gateway"):
            url = read_credentials(tmp_path / "creds" / f"{role}.toml").url_with()  # two servers, one NATS
            bus = await Bus.connect(BusSettings(url=url, initial_connect_s=5.0), service=role)
            await bus.close()
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        gateway = await nats.connect(access.role_url("gateway"), error_cb=on_error, allow_reconnect=False)
        await gateway.publish(planner_capacity(), b"forged")  # outside the gateway's permissions
        await gateway.flush()
        for _ in range(100):
            if errors:
                break
            await asyncio.sleep(0.02)
        assert any("permissions violation" in e.lower() for e in errors), errors
        await gateway.close()
        assert "***" in redact(access.role_url("gateway"))
    finally:
        server.stop()

