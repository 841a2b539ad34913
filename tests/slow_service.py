"""A small real service for the runtime tests: `python tests/slow_service.py --nats URL [...]`.

It answers `tidal.v1.testslow.work` (sleep, then reply) through an actor with bounded
concurrency, and with `--crash` runs a background task that escalates on its first crash.
"""
from __future__ import annotations

import argparse
import asyncio

import msgspec

from shared.actors import ESCALATE, Actor
from shared.bus import Delivery
from shared.service import Service, parse_settings, run

SERVICE = "testslow"
WORK_SUBJECT = "tidal.v1.testslow.work"


class SlowWork(msgspec.Struct, frozen=True):
    n: int
    seconds: float


class WorkDone(msgspec.Struct, frozen=True):
    n: int


class SlowActor(Actor):
    def __init__(self, crash: bool) -> None:
        super().__init__("slow", concurrency=8)
        self.crash = crash

    async def on_start(self) -> None:
        await self.bind(WORK_SUBJECT, SlowWork, self.work, queue=SERVICE)
        if self.crash:
            self.spawn("doomed", self.doomed, policy=ESCALATE)

    async def work(self, msg: SlowWork, _ctx: Delivery) -> WorkDone:
        await asyncio.sleep(msg.seconds)
        return WorkDone(n=msg.n)

    async def doomed(self) -> None:
        await asyncio.sleep(0.5)
        raise RuntimeError("the background task died")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--crash", action="store_true")
    settings = parse_settings(SERVICE, parser=parser)
    service = Service(settings, version="test-1")
    service.add_actor(SlowActor(crash=parse_settings.last_args.crash))  # type: ignore[attr-defined]
    run(service)


if __name__ == "__main__":
    main()
