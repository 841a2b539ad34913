"""The worker's own partition detector (services/gpu_worker/bus_watch.py), with a fake clock and link."""
from __future__ import annotations

from services.gpu_worker.bus_watch import BusWatch, fence_after


class Link:
    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.up = True
        self.stall_s = 0.0  # the round trip takes this long (the process was paused meanwhile)

    async def flush(self, _timeout: float) -> None:
        self.clock[0] += self.stall_s
        if not self.up:
            raise TimeoutError("no PONG")


def watch(clock: list[float], link: Link, fenced: list[float]) -> BusWatch:
    return BusWatch(link.flush, fenced.append, fence_after_s=lambda: fence_after(3.0), clock=lambda: clock[0])


async def test_a_worker_cut_off_past_dead_after_fences_itself_once_per_outage() -> None:
    clock, fenced = [0.0], []
    link = Link(clock)
    w = watch(clock, link, fenced)
    for _ in range(5):
        clock[0] += 0.5
        await w.tick()
    assert fenced == []  # round trips complete: never fenced
    link.up = False
    for _ in range(7):  # 3.5 s without a PONG: less than dead_after + margin
        clock[0] += 0.5
        await w.tick()
    assert fenced == []
    for _ in range(4):
        clock[0] += 0.5
        await w.tick()
    assert len(fenced) == 1 and fenced[0] >= 4.0  # once, not at every tick of the outage
    link.up = True
    clock[0] += 0.5
    await w.tick()
    assert w.fenced is False and len(fenced) == 1  # the link is back: a later outage fences again


async def test_a_paused_process_fences_itself_on_resuming_though_its_link_is_fine() -> None:
    clock, fenced = [0.0], []
    link = Link(clock)
    w = watch(clock, link, fenced)
    await w.tick()
    clock[0] += 6.0  # SIGSTOP for 6 s, then SIGCONT: the loop's next tick
    await w.tick()
    assert len(fenced) == 1
    clock[0] += 0.5
    link.stall_s = 5.0  # paused while its round trip was in flight: that counts as the gap it is
    await w.tick()
    assert len(fenced) == 2
