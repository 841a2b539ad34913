"""What the load client itself costs: CPU per request and per token, and how late it sends.

Open-loop numbers are only as good as the client's punctuality: if it sends late, or its
event loop is busy when tokens arrive, the measured latencies include the client. Start lag
is when a request's task began minus its scheduled arrival (the event loop's delay); send
lag is when its bytes were written (start lag plus, for a new connection, the TCP connect).
"""
from __future__ import annotations

import msgspec
import numpy as np


class ClientOverhead(msgspec.Struct, frozen=True, kw_only=True):
    requests: int
    tokens: int
    wall_s: float
    cpu_s: float  # this process's user + system CPU over the run
    cpu_per_request_us: float
    cpu_per_token_us: float
    cpu_utilization: float  # cpu_s / wall_s: near 1.0 means the client is a bottleneck (one core)
    start_lag_p50_ms: float
    start_lag_p99_ms: float
    start_lag_max_ms: float
    send_lag_p50_ms: float
    send_lag_p99_ms: float
    send_lag_max_ms: float
    connections_opened: int
    peak_in_flight: int

    def lines(self) -> list[str]:
        return [
            f"client CPU {self.cpu_s:.2f} s over {self.wall_s:.1f} s wall ({self.cpu_utilization:.0%} of a core): "
            f"{self.cpu_per_request_us:.0f} us/request, {self.cpu_per_token_us:.1f} us/token",
            f"start P50 {self.start_lag_p50_ms:.2f} / P99 {self.start_lag_p99_ms:.2f} / "
            f"max {self.start_lag_max_ms:.2f} ms; send P50 {self.send_lag_p50_ms:.2f} / P99 "
            f"{self.send_lag_p99_ms:.2f} / max {self.send_lag_max_ms:.2f} ms; {self.connections_opened} connections, "
            f"peak {self.peak_in_flight} in flight",
        ]

    def as_extra(self) -> dict[str, str]:
        return {"client overhead": self.lines()[0], "client lag vs schedule": self.lines()[1]}


def measure_overhead(*, requests: int, tokens: int, wall_s: float, cpu_s: float, start_lags: list[float],
                     send_lags: list[float], connections: int, peak: int) -> ClientOverhead:
    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) * 1000 if values else 0.0

    return ClientOverhead(
        requests=requests, tokens=tokens, wall_s=wall_s, cpu_s=cpu_s,
        cpu_per_request_us=cpu_s / max(requests, 1) * 1e6, cpu_per_token_us=cpu_s / max(tokens, 1) * 1e6,
        cpu_utilization=cpu_s / wall_s if wall_s > 0 else 0.0,
        start_lag_p50_ms=pct(start_lags, 50), start_lag_p99_ms=pct(start_lags, 99),
        start_lag_max_ms=max(start_lags, default=0.0) * 1000,
        send_lag_p50_ms=pct(send_lags, 50), send_lag_p99_ms=pct(send_lags, 99),
        send_lag_max_ms=max(send_lags, default=0.0) * 1000,
        connections_opened=connections, peak_in_flight=peak,
    )


__all__ = ["ClientOverhead", "measure_overhead"]
