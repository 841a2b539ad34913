"""The benchmark cluster moved to `loadgen/runner/bench_cluster.py` (loadgen's live repros use it too, and
loadgen never imports tidal); this name stays for the benches that still import it from here."""
from loadgen.runner.bench_cluster import SERVICES, BenchCluster, _ready, launch, terminate

__all__ = ["SERVICES", "BenchCluster", "_ready", "launch", "terminate"]
