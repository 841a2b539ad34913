"""Per-token cost of structured output in the sampler: SmolLM2's tokenizer (49152 tokens), a batch
of 8 rows, with and without a JSON-schema grammar on every row (same run, same logits, same seeds).

    .venv/bin/python tests/engine/bench_guided_overhead.py <a checkpoint directory with tokenizer.json>
"""
import json
import sys
import time

import torch

from services.gpu_worker.engine.sampler import Sampler
from services.gpu_worker.engine.sampling_params import SamplingParams
from services.gpu_worker.engine.tokenizer import EngineTokenizer
tok = EngineTokenizer.from_dir(sys.argv[1] if len(sys.argv) > 1 else "/tmp/smollm2")
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 5}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
B, STEPS, V = 8, 40, max(tok.vocab_size, 512)
gen = torch.Generator().manual_seed(0)
logits = [torch.randn(B, V, generator=gen) for _ in range(STEPS)]
S = Sampler(tok)
runs = iter(range(1000))
def run(guided):
    s = S
    k = next(runs)
    p = [SamplingParams(temperature=1.0, seed=i, guided=("json_schema", json.dumps(schema)) if guided else None) for i in range(B)]
    outs = [[] for _ in range(B)]
    t = time.perf_counter()
    for step in range(STEPS):
        r = s.sample(logits[step], [f"s{k}-{i}" for i in range(B)], p, outputs=outs)
        for i, tkn in enumerate(r.token_ids):
            outs[i].append(tkn)
    return (time.perf_counter() - t) / STEPS
run(True); run(False)
base = min(run(False) for _ in range(3)); guided = min(run(True) for _ in range(3))
print(f"batch {B}, vocab {V}: sampler step {base*1e3:.2f} ms plain, {guided*1e3:.2f} ms guided "
      f"-> +{(guided-base)*1e3/B:.3f} ms per guided token")
