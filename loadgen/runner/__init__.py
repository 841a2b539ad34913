"""The live runner: open-loop arrivals from a trace against the gateway over streaming HTTP,
one `RequestRecord` per request, and the client's own overhead measured."""
from loadgen.runner.overhead import ClientOverhead
from loadgen.runner.runner import LiveResult, LoadRunner, RunnerConfig, RunOutcome, RunProgress, run_trace

__all__ = ["ClientOverhead", "LiveResult", "LoadRunner", "RunOutcome", "RunProgress", "RunnerConfig", "run_trace"]
