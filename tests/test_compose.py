"""compose/ without a Docker engine: the YAML, the service commands, and NATS permissions that
give each service exactly what the subject catalog says it uses (checked on paper and on a
real nats-server running the same authorization block)."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import nats
import pytest
import yaml

from shared import subjects
from shared.events.registry import Bucket
from shared.nats_server import NatsServer, nats_server_binary
from shared.subjects import CATALOG, Pattern

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose"
PASSWORDS = {role: f"pw-{role}" for role in subjects.ROLES}


# --- a small reader for the NATS config format (maps, arrays, strings, $VARs, bare words) ---
_TOKEN = re.compile(r'\s+|#[^\n]*|//[^\n]*|"((?:[^"\\]|\\.)*)"|([{}\[\],:=])|([^\s{}\[\],:="#]+)')


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        assert m, f"unreadable nats.conf at {text[pos:pos + 30]!r}"
        pos = m.end()
        if m.group(1) is not None:
            out.append(("str", m.group(1)))
        elif m.group(2):
            out.append(("sym", m.group(2)))
        elif m.group(3):
            out.append(("word", m.group(3)))
    return out


def parse_nats_conf(text: str) -> dict:
    toks = _tokens(text)
    pos = 0

    def value():
        nonlocal pos
        kind, tok = toks[pos]
        pos += 1
        if (kind, tok) == ("sym", "{"):
            return mapping("}")
        if (kind, tok) == ("sym", "["):
            items = []
            while toks[pos] != ("sym", "]"):
                if toks[pos] == ("sym", ","):
                    pos += 1
                    continue
                items.append(value())
            pos += 1
            return items
        return tok

    def mapping(end: str | None) -> dict:
        nonlocal pos
        out = {}
        while pos < len(toks) and toks[pos] != ("sym", end):
            if toks[pos] == ("sym", ","):
                pos += 1
                continue
            key = toks[pos][1]
            pos += 1
            if toks[pos] in (("sym", ":"), ("sym", "=")):
                pos += 1
            out[key] = value()
        pos += 1
        return out

    return mapping(None)


def covers(allowed: str, subject: str) -> bool:
    """NATS wildcard semantics: does permission `allowed` cover `subject` (itself maybe a wildcard)?"""
    a, s = allowed.split("."), subject.split(".")
    for i, tok in enumerate(a):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]) or (tok == "*" and s[i] == ">"):
            return False
    return len(a) == len(s)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def users() -> dict[str, dict]:
    conf = parse_nats_conf((COMPOSE / "nats.conf").read_text())
    return {u["user"]: u for u in conf["authorization"]["users"]}


def _module(service: dict) -> str:
    command = service["command"]
    return command[command.index("-m") + 1]


def tidal_services(compose: dict) -> dict[str, dict]:
    """The containers built from the Tidal image (not nats, prometheus, grafana)."""
    return {name: s for name, s in compose["services"].items() if "build" in s}


NATS_NODES = ("nats-1", "nats-2", "nats-3")


def test_compose_yaml_has_nats_and_one_container_per_service(compose):
    services = compose["services"]
    assert set(services) - set(tidal_services(compose)) == {*NATS_NODES, "prometheus", "grafana"}
    for node in NATS_NODES:  # one cluster: each node its name, its own store, all answering to `nats`
        spec = services[node]
        assert spec["image"].startswith("nats:") and spec["command"] == ["-c", "/etc/nats/nats-cluster.conf"]
        assert {"./nats.conf:/etc/nats/nats.conf:ro", "./nats-cluster.conf:/etc/nats/nats-cluster.conf:ro",
                f"nats-data-{node[-1]}:/data"} == set(spec["volumes"])
        assert spec["environment"]["TIDAL_NATS_SERVER_NAME"] == node
        assert spec["networks"]["default"]["aliases"] == ["nats"]
    assert {f"nats-data-{i}" for i in (1, 2, 3)} <= set(compose["volumes"])
    modules = {_module(s) for s in tidal_services(compose).values()}
    assert modules == {f"services.{name}" for name in subjects.SERVICES}
    for service in tidal_services(compose).values():
        assert service["build"]["dockerfile"] == "compose/Dockerfile"
        assert {n: d["condition"] for n, d in service["depends_on"].items()} == dict.fromkeys(NATS_NODES,
                                                                                              "service_healthy")
        assert service["environment"]["TIDAL__REGISTRY__REPLICAS"] == "3"  # R3 buckets on the three nodes
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    assert dockerfile.startswith(("FROM python:3.11-slim", "# ")) and "FROM python:3.11-slim" in dockerfile
    assert "--constraint constraints.txt" in dockerfile


def test_every_service_command_names_an_existing_module(compose):
    for name, service in tidal_services(compose).items():
        module = _module(service)
        assert module.startswith("services."), (name, module)
        main = ROOT / Path(*module.split(".")) / "__main__.py"
        assert main.is_file(), f"{name}: {module} has no {main.relative_to(ROOT)}"


def test_each_container_connects_as_its_own_nats_user(compose):
    nats_env = compose["services"]["nats-1"]["environment"]
    for role in subjects.ROLES:
        assert f"TIDAL_NATS_{role.upper()}_PASSWORD" in nats_env
    for name, service in tidal_services(compose).items():
        role = _module(service).split(".")[1]
        url = urlsplit(service["environment"]["TIDAL_NATS_URL"])
        assert url.username == role and url.hostname == "nats", name
        assert f"TIDAL_NATS_{role.upper()}_PASSWORD" in url.password


def _expected(role: str) -> tuple[set[str], set[str], bool]:
    """What the catalog gives a role, computed here independently of shared.nats_permissions."""
    pub = {s.wildcard for s in CATALOG.values() if role in s.publishers}
    sub = {s.wildcard for s in CATALOG.values() if role in s.listeners}
    if any(s.pattern is Pattern.REQUEST for s in CATALOG.values() if role in s.publishers):
        sub.add("_INBOX.>")
    if role == "registry":  # JetStream for the catalog's KV buckets
        pub |= {"$JS.API.>", "$JS.ACK.>", "$JS.FC.>"} | {f"$KV.tidal_{b}.>" for b in Bucket}
        sub.add("_INBOX.>")
    if role == "predictor":  # JetStream for its own history bucket only
        pub |= {"$JS.API.>", "$JS.ACK.>", "$JS.FC.>", "$KV.tidal_predictor.>"}
        sub.add("_INBOX.>")
    responds = any(s.pattern is Pattern.REQUEST for s in CATALOG.values() if role in s.listeners)
    return pub, sub, responds


def test_permissions_are_exactly_what_the_catalog_gives(users):
    assert set(users) == set(subjects.ROLES)
    for role, user in users.items():
        perms = user["permissions"]
        pub, sub, responds = _expected(role)
        assert set(perms["publish"]["allow"]) == pub, role
        assert set(perms["subscribe"]["allow"]) == sub, role
        assert (perms.get("allow_responses") == "true") == responds, role
        assert user["password"] == f"$TIDAL_NATS_{role.upper()}_PASSWORD"


def test_every_catalog_use_is_permitted_and_nothing_else(users):
    for spec in CATALOG.values():
        for role in subjects.ROLES:
            perms = users[role]["permissions"]
            can_pub = any(covers(a, spec.wildcard) for a in perms["publish"]["allow"])
            can_sub = any(covers(a, spec.wildcard) for a in perms["subscribe"]["allow"])
            assert can_pub == (role in spec.publishers), (role, "publish", spec.template)
            assert can_sub == (role in spec.listeners), (role, "subscribe", spec.template)
    worker = users["gpu_worker"]["permissions"]["publish"]["allow"]
    assert not any(covers(a, "tidal.v1.dispatch.submit") for a in worker)  # a worker cannot act as a gateway
    # A worker may publish a *targeted* abort (worker_id set: it stops only a superseded copy of a
    # request, the assignment fence); it already publishes any request's chunks, so this grants no
    # new power over a stream. It still cannot submit work or create buckets.
    assert any(covers(a, "tidal.v1.req.r1.abort") for a in worker)
    assert not any(covers(a, "$JS.API.STREAM.CREATE.KV_tidal_models") for a in worker)


@pytest.mark.parametrize("conf", ["nats.conf", "nats-cluster.conf"])
def test_the_real_nats_server_accepts_the_config(conf: str):
    env = {**os.environ, **{f"TIDAL_NATS_{r.upper()}_PASSWORD": p for r, p in PASSWORDS.items()},
           "TIDAL_NATS_SERVER_NAME": "nats-1"}
    done = subprocess.run([nats_server_binary(), "-t", "-c", str(COMPOSE / conf)],
                          env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "is valid" in done.stdout + done.stderr


def test_the_cluster_config_routes_to_every_node():
    conf = parse_nats_conf((COMPOSE / "nats-cluster.conf").read_text())
    assert conf["include"] == "./nats.conf" and conf["server_name"] == "$TIDAL_NATS_SERVER_NAME"
    assert conf["cluster"]["name"] == "tidal" and conf["cluster"]["listen"] == "0.0.0.0:6222"
    assert conf["cluster"]["routes"] == [f"nats-route://{node}:6222" for node in NATS_NODES]


@pytest.fixture
async def secured_nats(tmp_path, monkeypatch):
    """A real nats-server with compose/nats.conf's authorization block, verbatim."""
    for role, password in PASSWORDS.items():
        monkeypatch.setenv(f"TIDAL_NATS_{role.upper()}_PASSWORD", password)
    text = (COMPOSE / "nats.conf").read_text()
    server = NatsServer(store_dir=tmp_path / "nats", extra_config=text[text.index("authorization {"):]).start()
    yield server
    server.stop()


async def _connect(server: NatsServer, role: str, errors: list[str]) -> nats.NATS:
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return await nats.connect(server.url, user=role, password=PASSWORDS[role], error_cb=on_error,
                              allow_reconnect=False, connect_timeout=2)


async def _wait_for(errors: list[str], needle: str) -> None:
    for _ in range(100):
        if any(needle.lower() in e.lower() for e in errors):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no error containing {needle!r}: {errors}")


async def _request_once_served(conn: nats.NATS, subject: str, data: bytes):
    """A request to a subscription another connection just made and flushed: nats-server may still answer
    no-responders for a few ms (3 of 16 runs here; a retry 50 ms later was served). Only that answer is
    retried, for at most 1 s; a permission refusal or a timeout still fails."""
    for _ in range(20):
        try:
            return await conn.request(subject, data, timeout=2)
        except nats.errors.NoRespondersError:
            await asyncio.sleep(0.05)
    return await conn.request(subject, data, timeout=2)


async def test_the_server_enforces_the_catalog(secured_nats):
    errors: dict[str, list[str]] = {role: [] for role in subjects.ROLES}
    conns = {role: await _connect(secured_nats, role, errors[role])
             for role in ("gateway", "dispatcher", "gpu_worker", "scheduler", "registry")}
    try:
        received: list[bytes] = []

        async def dispatcher(msg):
            received.append(msg.data)
            await msg.respond(b"accepted")

        await conns["dispatcher"].subscribe(subjects.dispatch_submit(), queue="dispatcher", cb=dispatcher)

        async def worker(msg):
            await msg.respond(b"done")

        await conns["gpu_worker"].subscribe(subjects.worker_ctl("cpu-0"), cb=worker)
        await conns["dispatcher"].flush()
        await conns["gpu_worker"].flush()

        # request/reply works through _INBOX.> and allow_responses
        assert (await conns["gateway"].request(subjects.dispatch_submit(), b"r1", timeout=2)).data == b"accepted"
        assert (await conns["scheduler"].request(subjects.worker_ctl("cpu-0"), b"c", timeout=2)).data == b"done"

        # a worker cannot publish on the gateway's subjects, nor read other requests' tokens
        await conns["gpu_worker"].publish(subjects.dispatch_submit(), b"forged")
        await conns["gpu_worker"].flush()
        await _wait_for(errors["gpu_worker"], "Permissions Violation for Publish")
        await conns["gpu_worker"].subscribe(subjects.CATALOG["request.out"].wildcard)
        await _wait_for(errors["gpu_worker"], "Permissions Violation for Subscription")
        # the gateway may send adapter commands (its runtime LoRA routes) and nothing else: no model, group or
        # migration command on worker.ctl, no request handed to a worker past the dispatcher, no capacity request
        await conns["gpu_worker"].subscribe(subjects.worker_adapters("cpu-0"), cb=worker)
        await conns["gpu_worker"].flush()
        assert (await _request_once_served(conns["gateway"], subjects.worker_adapters("cpu-0"), b"a")).data == b"done"
        with pytest.raises(Exception):  # the server drops it: no worker ever sees it
            await conns["gateway"].request(subjects.worker_ctl("cpu-0"), b"evict", timeout=1)
        await _wait_for(errors["gateway"], f'Permissions Violation for Publish to "{subjects.worker_ctl("cpu-0")}"')
        errors["gateway"].clear()
        await conns["gateway"].publish(subjects.worker_assign("cpu-0"), b"forged assignment")
        await _wait_for(errors["gateway"], "Permissions Violation for Publish")
        errors["gateway"].clear()
        await conns["gateway"].publish(subjects.planner_capacity(), b"forged capacity request")
        await _wait_for(errors["gateway"], f'Permissions Violation for Publish to "{subjects.planner_capacity()}"')
        assert received == [b"r1"]

        # the registry alone reaches JetStream: its KV buckets work end to end
        kv = await conns["registry"].jetstream(timeout=2).create_key_value(bucket=subjects.kv_bucket("models"))
        rev = await kv.create("llama", b"v1")
        assert await kv.update("llama", b"v2", last=rev) == rev + 1
        watcher = await kv.watch("*")
        assert (await watcher.updates(timeout=2)).value == b"v2"
        await watcher.stop()
        with pytest.raises(Exception):
            await conns["gateway"].jetstream(timeout=1).key_value(subjects.kv_bucket("models"))
        await _wait_for(errors["gateway"], "Permissions Violation for Publish to \"$JS.API")
    finally:
        for conn in conns.values():
            await conn.close()
