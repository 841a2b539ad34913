"""Request traces: a JSONL schema, seeded generators and loaders for public trace files.

See docs/loadgen.md for the schema and each generator's parameters and targets.
"""
from loadgen.traces.schema import Trace, TraceHeader, TraceRecord
from loadgen.traces.io import read_trace, write_trace

__all__ = ["Trace", "TraceHeader", "TraceRecord", "read_trace", "write_trace"]
