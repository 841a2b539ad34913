"""`python -m services.registry`: the durable catalog (JetStream KV), its API, and liveness."""
from __future__ import annotations

from shared.bootstrap import bootstrap
from shared.announce import service_id
from shared.service import run

from services.registry.api import RegistryApi
from services.registry.liveness_actor import LivenessActor
from services.registry.local_catalog import LocalCatalog
from services.registry.store import CatalogStore


def main() -> None:
    boot = bootstrap("registry")
    reg = boot.config.registry
    store = CatalogStore(history=reg.kv_history, replicas=reg.replicas)
    boot.service.add_actor(RegistryApi(store))
    boot.service.add_actor(LivenessActor(
        store, dead_after=float(reg.dead_after), heartbeat_interval=float(reg.heartbeat_interval),
        self_service_id=service_id(boot.service.settings.instance),  # hearing itself: is the registry cut off?
    ))
    boot.announce(catalog=LocalCatalog(store))
    run(boot.service)


if __name__ == "__main__":
    main()
