"""`python -m services.gpu_worker --worker-id ID`: one worker per device.

Here it registers its WorkerRecord (device, memory capacity from the cluster config) and
sends heartbeats, so liveness is real; the engine, assignments and control commands come in
later issues.
"""
from __future__ import annotations

import argparse
import os

from shared.bootstrap import bootstrap, fail
from shared.service import run


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.gpu_worker")
    parser.add_argument("--worker-id", default=os.environ.get("TIDAL_WORKER_ID"),
                        help="which [[workers]] entry of the cluster config this process is [TIDAL_WORKER_ID]")
    boot = bootstrap("gpu_worker", parser=parser)
    worker_id = boot.args.worker_id
    known = [w.id for w in boot.config.workers]
    if not worker_id:
        fail(f"--worker-id is required (workers in the config: {', '.join(known) or 'none'})")
    if worker_id not in known:
        fail(f"unknown worker id {worker_id!r} (workers in the config: {', '.join(known) or 'none'})")
    boot.announce(worker=boot.config.worker(worker_id))
    run(boot.service)


if __name__ == "__main__":
    main()
