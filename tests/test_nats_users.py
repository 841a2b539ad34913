"""The embedded nats-server's per-role users (shared/nats_users.py), on a real nats-server: a client
without credentials cannot connect, and only the dispatcher's user can ask the planner for capacity
(`tidal.v1.planner.capacity`): a forged request from any other role never reaches it."""
from __future__ import annotations

import time

import pytest

from shared.bus import Bus, BusSettings, Delivery
from shared.events.plan import CapacityReply, CapacityRequest
from shared.nats_server import NatsServer
from shared.nats_users import OPERATOR, NatsUsers, redact
from shared.subjects import ROLES, planner_capacity
from shared.wire import DeadlineExceeded, NoResponders, Unavailable

pytestmark = pytest.mark.timeout(60)


def capacity(sender: str) -> CapacityRequest:
    return CapacityRequest(dispatcher_id=f"forged-by-{sender}", model="m", queued_requests=1, ts=time.time())


async def connect(url: str, service: str) -> Bus:
    return await Bus.connect(BusSettings(url=url, initial_connect_s=2.0, request_timeout_s=1.0), service=service)


async def test_only_the_dispatcher_reaches_the_planner_and_strangers_cannot_connect(tmp_path) -> None:
    users = NatsUsers.generate()
    server = NatsServer(store_dir=tmp_path / "nats", users=users).start()
    buses: list[Bus] = []
    try:
        assert oct((tmp_path / "nats" / "nats.conf").stat().st_mode & 0o777) == "0o600"
        with pytest.raises(Unavailable) as stranger:
            await connect(server.url, "stranger")  # no credentials: refused
        assert users.passwords["planner"] not in str(stranger.value)
        with pytest.raises(Unavailable) as wrong:
            await connect(server.url.replace("nats://", "nats://planner:guess@"), "guesser")
        assert "guess" not in str(wrong.value)  # the password is never shown
        planner = await connect(server.url_for("planner"), "planner")
        buses.append(planner)
        asked: list[str] = []

        async def on_capacity(msg: CapacityRequest, _ctx: Delivery) -> CapacityReply:
            asked.append(msg.dispatcher_id)
            return CapacityReply(model=msg.model, outcome="none")

        await planner.subscribe(planner_capacity(), CapacityRequest, on_capacity, queue="planner")
        dispatcher = await connect(server.url_for("dispatcher"), "dispatcher")
        buses.append(dispatcher)
        reply = await dispatcher.request(planner_capacity(), capacity("dispatcher"), CapacityReply)
        assert isinstance(reply, CapacityReply) and reply.outcome == "none"
        for role in (r for r in ROLES if r not in ("dispatcher", "planner")):
            forger = await connect(server.url_for(role), role)
            buses.append(forger)
            with pytest.raises((DeadlineExceeded, NoResponders)):
                await forger.request(planner_capacity(), capacity(role), CapacityReply, timeout=0.5)
        operator = await connect(server.url_for(OPERATOR), "cli")  # this user's own tools: every subject
        buses.append(operator)
        await operator.request(planner_capacity(), capacity(OPERATOR), CapacityReply)
        assert asked == ["forged-by-dispatcher", f"forged-by-{OPERATOR}"]
    finally:
        for bus in buses:
            await bus.close()
        server.stop()


def test_urls_carry_each_roles_credentials_and_redact_hides_them() -> None:
    users = NatsUsers.generate()
    url = users.url("nats://127.0.0.1:4222", "gpu_worker")
    assert url == f"nats://gpu_worker:{users.passwords['gpu_worker']}@127.0.0.1:4222"
    assert redact(url) == "nats://gpu_worker:***@127.0.0.1:4222"
    assert redact("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
    assert len(set(users.passwords.values())) == len(users.passwords) == len(ROLES) + 1
    assert NatsUsers.generate().passwords != users.passwords  # fresh for every `tidal up`
