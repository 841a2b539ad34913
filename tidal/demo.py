"""The `make run` / `tidal up` demo: prepare the checkpoints once, then show how to call the cluster.

`prepare_assets` imports the config's GGUF models and generates its demo models and adapters
that are missing or stale (cached under `data_dir`, see services.gpu_worker.demo_assets)
before any worker starts.
`wait_until_serving` polls the gateway's `/ready` until a worker serves something, and
`usage_banner` prints a ready-to-paste `curl` line and the equivalent `openai` snippet, run by
this venv's interpreter (named by its path: `python` on PATH may be another one, without openai);
`tidal_command` is how to call `tidal` from the user's shell (`tidal` when it is on PATH, else its path).
"""
from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

from loadgen.runner.bench_cluster import gateway_ready
from shared.config import ClusterConfig

PROMPT = "What is the capital of France?"


def prepare_assets(cfg: ClusterConfig, out: Callable[[str], None]) -> None:
    """Import GGUF models and generate demo models/adapters that are missing (blocking; seconds on
    2 cores). Raises demo_assets.AssetError naming a model that cannot be prepared."""
    from services.gpu_worker.demo_assets import ensure_demo_assets, pending_demo_assets

    served = sorted({m for w in cfg.workers for m in w.models})
    if not pending_demo_assets(cfg, served):
        return
    started = time.monotonic()
    made = set(ensure_demo_assets(cfg, models=served, progress=lambda line: out(f"tidal: {line}")))
    demo = [m.name for m in cfg.models if m.name in made and m.demo is not None]
    demo += [a.name for a in cfg.adapters if a.name in made]
    note = "; the demo models have random weights: the text they write is gibberish" if demo else ""
    out(f"tidal: prepared {len(made)} model(s)/adapter(s) in {time.monotonic() - started:.1f}s "
        f"(cached under {cfg.cluster.data_dir}{note})")


async def wait_until_serving(url: str, timeout_s: float, stop: asyncio.Event) -> bool:
    """True once the gateway's /ready answers 200 (a worker serves a model), False at timeout or stop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        if await asyncio.to_thread(gateway_ready, url):
            return True
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except asyncio.TimeoutError:
            pass
    return False


def example_model(cfg: ClusterConfig) -> str | None:
    """A model some worker serves (the first in config order: the default config lists its real one first)."""
    served = {m for w in cfg.workers for m in w.models}
    return next((m.name for m in cfg.models if m.name in served), None)


def shell_path(path: Path) -> str:
    """`path` as a user pastes it: relative to the current folder when inside it, else absolute."""
    try:
        rel = path.relative_to(Path.cwd())
        text = str(rel) if str(rel).startswith(".") or os.sep in str(rel) else f".{os.sep}{rel}"
    except ValueError:
        text = str(path)
    return shlex.quote(text)


def tidal_command() -> str:
    """`tidal` if that is this install's on PATH (an activated venv), else the script's path (`.venv/bin/tidal`)."""
    script = Path(sys.executable).parent / "tidal"
    found = shutil.which("tidal")
    if found and script.exists() and Path(found).resolve() == script.resolve():
        return "tidal"
    return shell_path(script) if script.exists() else f"{shell_path(Path(sys.executable))} -m tidal"


def usage_banner(cfg: ClusterConfig, url: str, python: str | None = None) -> str:
    """`python`: the interpreter the openai snippet names (default: this one, whose venv has openai)."""
    python = python or shell_path(Path(sys.executable))
    model = example_model(cfg)
    if model is None:
        return "  (no worker serves a model in this config: nothing to call yet)"
    keyed = bool(cfg.gateway.api_keys)
    auth = ' -H "Authorization: Bearer $TIDAL_API_KEY"' if keyed else ""
    # greedy: a 135M model sampled at temperature 1 wanders; at 0 it answers the same way every time
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32,
                       "temperature": 0})
    others = [m.name for m in cfg.models if m.name != model and any(m.name in w.models for w in cfg.workers)]
    adapters = [a.name for a in cfg.adapters if a.base == model or a.base in others]
    demo = [m.name for m in cfg.models if m.demo is not None and (m.name == model or m.name in others)]
    names = ", ".join([model, *others, *adapters])
    # the commands start at column 0: pasted as printed, the heredoc's closing EOF must be alone on its line
    # and Python refuses indented top-level code
    return (
        ("  (API keys are on: export TIDAL_API_KEY=<one of gateway.api_keys> first)\n" if keyed else "")
        + f"  try it (models: {names}):\n\n"
        f"curl -sN {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"  -d '{body}'\n\n"
        f"  or with the openai client, in this venv's Python:\n\n"
        f"{python} - <<'EOF'\n"
        f"from openai import OpenAI\n"
        f"import os\n"
        f"client = OpenAI(base_url=\"{url}/v1\", api_key=os.environ.get(\"TIDAL_API_KEY\", \"unused\"))\n"
        f"stream = client.chat.completions.create(model=\"{model}\", max_tokens=32, temperature=0, stream=True,\n"
        f"    messages=[{{\"role\": \"user\", \"content\": \"{PROMPT}\"}}])\n"
        f"for chunk in stream:\n"
        f"    print(chunk.choices[0].delta.content or \"\", end=\"\", flush=True)\n"
        f"print()\n"
        f"EOF\n"
        + (f"\n  ({', '.join(demo)}: random weights and a real tokenizer: fluent-looking gibberish, by design)"
           if demo else "")
    )
