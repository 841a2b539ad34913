"""`python -m services.gateway`: starts, announces itself in the registry, answers health, drains.

Its real work comes in later issues; until then it runs and does nothing else.
"""
from __future__ import annotations

from shared.bootstrap import bootstrap
from shared.service import run


def main() -> None:
    boot = bootstrap("gateway")
    boot.announce()
    run(boot.service)


if __name__ == "__main__":
    main()
