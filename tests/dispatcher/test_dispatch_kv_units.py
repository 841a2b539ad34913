"""KV and queued prompts in one unit (pure): a worker reports blocks of ONE layer's KV, the router
weighs tokens, so a 30-layer instance's KV must count its tokens once, not once per layer."""
from __future__ import annotations

import msgspec
from dispatcher.dispatch_builders import core, heartbeat, instance, sends, stats, submit

from shared.events import LayerRange


def test_least_load_weighs_kv_tokens_not_per_layer_blocks() -> None:
    c = core(max_batch=8)
    for w in ("w0", "w1"):
        c.heartbeat(heartbeat(w), 0.0)
    # w0: one running request with 160 tokens of KV over 30 layers (10 blocks of 16 per layer)
    busy_kv = msgspec.structs.replace(instance("i0", running=1, used=300, total=30 * 64),
                                      layers=LayerRange(start=0, end=30))
    # w1: nothing in KV, 1,000 prompt tokens queued
    queued = msgspec.structs.replace(instance("i1", waiting=1, total=30 * 64), queued_prompt_tokens=1000,
                                     layers=LayerRange(start=0, end=30))
    c.worker_stats(stats("w0", busy_kv), 0.0)
    c.worker_stats(stats("w1", queued), 0.0)
    views = {v.worker_id: v for v in c.table.views("m", 0.1)}
    assert views["w0"].kv_tokens_used == 160 and views["w0"].kv_tokens_total == 64 * 16
    assert views["w0"].outstanding_tokens < views["w1"].outstanding_tokens
    _, effects = c.submit(submit("r", prompt=64), 0.2)
    assert [s.worker_id for s in sends(effects)] == ["w0"]
