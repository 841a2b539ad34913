"""`python -m services.predictor`: per-model load per window from the dispatchers' stats, kept in
JetStream, and WarmServe's corrective seasonal forecast of each next window on
`tidal.v1.predict.<model>` (docs/warmserve.md).
"""
from __future__ import annotations

from shared.bootstrap import bootstrap
from shared.service import run

from services.predictor.actor import Predictor


def main() -> None:
    boot = bootstrap("predictor")
    boot.service.add_actor(Predictor(boot.config, boot.service.settings.instance))
    boot.announce()
    run(boot.service)


if __name__ == "__main__":
    main()
