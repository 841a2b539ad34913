"""Turn generated columns (numpy arrays) into a `Trace`."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loadgen.traces.schema import AdapterInfo, GeneratorParams, Trace, TraceHeader, TraceRecord


def make_trace(params: GeneratorParams, duration_s: float, times: np.ndarray, models: Sequence[str],
               model_idx: np.ndarray, prompts: np.ndarray, outputs: np.ndarray,
               adapter_names: Sequence[str | None] | None = None, adapter_idx: np.ndarray | None = None,
               adapters: list[AdapterInfo] | None = None) -> Trace:
    """Records in arrival order; ids are `req-<index>`. `adapter_idx` indexes `adapter_names`."""
    order = np.argsort(times, kind="stable")
    times = np.round(times[order], 6).tolist()
    model_of = [models[i] for i in model_idx[order].tolist()]
    prompts_l, outputs_l = prompts[order].tolist(), outputs[order].tolist()
    if adapter_idx is None or adapter_names is None:
        adapter_of: list[str | None] = [None] * len(times)
    else:
        adapter_of = [adapter_names[i] for i in adapter_idx[order].tolist()]
    records = [
        TraceRecord(arrival_s=t, model=m, prompt_tokens=p, output_tokens=o, adapter=a, request_id=f"req-{i}")
        for i, (t, m, p, o, a) in enumerate(zip(times, model_of, prompts_l, outputs_l, adapter_of))
    ]
    header = TraceHeader(params=params, num_records=len(records), duration_s=duration_s, adapters=adapters or [])
    return Trace(header=header, records=records)
