"""KunServe buddy groups on the worker: stage-by-stage execution across members, remote
attention and live KV exchange (docs/kunserve.md "Group execution", "Live KV exchange").

The engine-side pieces (`member`, `stage_executor`, `engine_step`, `wire`) do no I/O: a
transport hands them frames (`loopback` in one process; `dataplane_transport` between
worker processes over the data plane).
"""
