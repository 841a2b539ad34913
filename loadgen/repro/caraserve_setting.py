"""The setting `tidal repro caraserve`'s two experiments share (the routing study, caraserve.py, and
the cold start, caraserve_cold.py): the server's model and adapters, the lengths, the burstiness."""
from __future__ import annotations

from pathlib import Path

from loadgen.sim.lora_worker import LoraGeometry
from loadgen.traces.lengths import LengthQuantiles

# MAF's bursty arrivals: gamma gaps of this coefficient of variation. OUR ASSUMPTION (MAF is not in the
# library): between the Azure LLM inference trace 2023's conversation (CV 1.09) and code (CV 13.2) streams.
MAF_CV = 2.0
LORA_PROFILE = Path(__file__).resolve().parents[1] / "sim" / "profiles" / "lora" / "caraserve-a10-llama2-7b.toml"
MODEL = "llama2-7b"
# Alpaca-like lengths (CaraServe §7.1 draws prompts and outputs from Alpaca). The library has no
# published Alpaca quantiles, so these are OUR ASSUMPTION: short instructions, responses of a
# paragraph. They set the load per server; the report says so.
ALPACA_PROMPT = LengthQuantiles(mean=24.0, p50=18.0, p80=34.0, p95=64.0, p99=110.0)
ALPACA_OUTPUT = LengthQuantiles(mean=90.0, p50=70.0, p80=140.0, p95=240.0, p99=380.0)
# CaraServe §7.1: adapters on W_q, W_k, W_v of Llama-2-7B (config.json of meta-llama/Llama-2-7b-hf:
# hidden_size 4096, num_hidden_layers 32), fp16.
ADAPTER_GEOMETRY = LoraGeometry(hidden=4096, layers=32, targets=3)
