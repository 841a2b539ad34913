"""The `make run` / `tidal up` demo: generate the demo checkpoints once, then show how to call the cluster.

`prepare_assets` generates the config's demo models and adapters that are missing or stale
(cached under `data_dir`, see services.gpu_worker.demo_assets) before any worker starts.
`wait_until_serving` polls the gateway's `/ready` until a worker serves something, and
`usage_banner` prints a ready-to-paste `curl` line and the equivalent `openai` snippet.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from typing import Callable

from shared.config import ClusterConfig

PROMPT = "Tell me about the Jargon File."


def prepare_assets(cfg: ClusterConfig, out: Callable[[str], None]) -> None:
    """Generate missing demo models/adapters (blocking; seconds on 2 cores)."""
    from services.gpu_worker.demo_assets import ensure_demo_assets, pending_demo_assets

    served = sorted({m for w in cfg.workers for m in w.models})
    if not pending_demo_assets(cfg, served):
        return
    started = time.monotonic()
    made = ensure_demo_assets(cfg, models=served, progress=lambda line: out(f"tidal: {line}"))
    out(f"tidal: generated {len(made)} demo asset(s) in {time.monotonic() - started:.1f}s "
        f"(cached under {cfg.cluster.data_dir}; random weights: the text they write is gibberish)")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


async def wait_until_serving(url: str, timeout_s: float, stop: asyncio.Event) -> bool:
    """True once the gateway's /ready answers 200 (a worker serves a model), False at timeout or stop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        if await asyncio.to_thread(_ready, url):
            return True
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except asyncio.TimeoutError:
            pass
    return False


def example_model(cfg: ClusterConfig) -> str | None:
    """A model some worker serves (the first in config order)."""
    served = {m for w in cfg.workers for m in w.models}
    return next((m.name for m in cfg.models if m.name in served), None)


def usage_banner(cfg: ClusterConfig, url: str) -> str:
    model = example_model(cfg)
    if model is None:
        return "  (no worker serves a model in this config: nothing to call yet)"
    keyed = bool(cfg.gateway.api_keys)
    auth = ' -H "Authorization: Bearer $TIDAL_API_KEY"' if keyed else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32})
    adapters = [a.name for a in cfg.adapters if a.base == model]
    others = [m.name for m in cfg.models if m.name != model and any(m.name in w.models for w in cfg.workers)]
    names = ", ".join([model, *others, *adapters])
    return (
        ("  (API keys are on: export TIDAL_API_KEY=<one of gateway.api_keys> first)\n" if keyed else "")
        + f"  try it (models: {names}):\n"
        f"    curl -sN {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"      -d '{body}'\n"
        f"  or with the openai client (pip install openai):\n"
        f"    python - <<'EOF'\n"
        f"    from openai import OpenAI\n"
        f"    import os\n"
        f"    client = OpenAI(base_url=\"{url}/v1\", api_key=os.environ.get(\"TIDAL_API_KEY\", \"unused\"))\n"
        f"    stream = client.chat.completions.create(model=\"{model}\", max_tokens=32, stream=True,\n"
        f"        messages=[{{\"role\": \"user\", \"content\": \"{PROMPT}\"}}])\n"
        f"    for chunk in stream:\n"
        f"        print(chunk.choices[0].delta.content or \"\", end=\"\", flush=True)\n"
        f"    print()\n"
        f"    EOF\n"
        f"  (demo models have random weights and a real tokenizer: fluent-looking gibberish, by design)"
    )
