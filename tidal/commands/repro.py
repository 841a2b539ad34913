"""`tidal repro PAPER [options]`: reproduce a paper's evaluation in the simulator.

Each paper is its own module `tidal/commands/repro_<paper>.py` exposing `HELP`,
`add_arguments(parser)` and `run(args) -> int`; adding one is one entry in PAPERS.
"""
from __future__ import annotations

import argparse
import importlib

from tidal.commands.profile_option import add_profile_option, measured_run

# paper name -> module under tidal.commands
PAPERS: dict[str, str] = {
    "mell": "repro_mell",
    "caraserve": "repro_caraserve",
    "kunserve": "repro_kunserve",
    "warmserve": "repro_warmserve",
    "economy": "repro_economy",
    "prefix": "repro_prefix",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("repro", help="reproduce a paper's evaluation in the simulator")
    papers = p.add_subparsers(dest="paper", metavar="PAPER")
    for name, module_name in PAPERS.items():
        try:
            module = importlib.import_module(f"tidal.commands.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"tidal.commands.{module_name}":
                continue  # reproduction not built yet
            raise
        sp = papers.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sp)
        add_profile_option(sp)  # every paper: --profile FILE|h200-measured (profile_option.py)
        sp.set_defaults(func=measured_run(name, module.run))
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
