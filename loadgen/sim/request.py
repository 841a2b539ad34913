"""A request inside the simulator (mutable, slotted: the hot loop touches it often)."""
from __future__ import annotations


class SimRequest:
    __slots__ = ("order", "request_id", "model", "adapter", "arrival", "prompt", "output", "to_prefill", "computed",
                 "generated", "gen_at_start", "ctx0", "start_step", "epoch", "first_token", "finish", "status",
                 "worker", "error")

    def __init__(self, order: int, request_id: str, model: str, adapter: str | None, arrival: float, prompt: int,
                 output: int) -> None:
        self.order = order  # arrival order: the engine preempts the latest arrival first
        self.request_id = request_id
        self.model = model
        self.adapter = adapter
        self.arrival = arrival
        self.prompt = prompt
        self.output = output  # tokens to generate
        self.to_prefill = prompt  # tokens to compute before the next sample (prompt + generated after a preemption)
        self.computed = 0  # of to_prefill
        self.generated = 0
        self.gen_at_start = 0  # generated when its current decode run began
        self.ctx0 = 0  # KV tokens when its current decode run began
        self.start_step = 0  # the worker's step counter then
        self.epoch = 0  # bumped on preemption: stale heap entries are skipped
        self.first_token = -1.0
        self.finish = -1.0
        self.status = "ok"
        self.worker = ""
        self.error: str | None = None
