"""`python -m services.dispatcher`: admission queues, routing, re-dispatch on worker death.

See services/dispatcher/actor.py (the bus side), core.py (the decisions) and docs/serving.md.
"""
from __future__ import annotations

from shared.announce import service_id
from shared.bootstrap import bootstrap
from shared.service import run

from services.dispatcher.actor import Dispatcher


def main() -> None:
    boot = bootstrap("dispatcher")
    dispatcher = Dispatcher(boot.config, service_id(boot.service.settings.instance))
    boot.service.add_actor(dispatcher)
    boot.service.on_drain.append(dispatcher.drain)
    boot.announce()
    run(boot.service)


if __name__ == "__main__":
    main()
