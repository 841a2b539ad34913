"""A busy co-located engine: the load another worker on the same box puts beside a profile.

`tidal bench fidelity --default-cluster` fits the simulator's profile on the box the cluster runs on; the
live workers run side by side there (two CPU workers on two cores share caches and memory bandwidth, and
each is slower than one alone — the default cluster's first prefills ran ~1.3x the pace a lone profile
measured). So while the profile is measured, each other worker of the cluster is stood in for by one of
these: the same engine settings, prefilling a long prompt and decoding a batch in turn until its stdin
closes. It prints `ready` once its engine is built, so the profile starts only when every peer is busy.

Run: `python -m loadgen.profiler.busy_peer MODEL_DIR THREADS POOL_BYTES MAX_BATCH STEP_TOKENS MAX_LEN`.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path

PROMPT, BATCH, DECODE_TOKENS = 1024, 8, 32  # the default cluster's trace: ~1k-token prompts, a batch decoding


def _busy(model_dir: Path, threads: int, pool: int, max_batch: int, step_tokens: int, max_len: int,
          stop: threading.Event) -> None:
    import torch

    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
    from services.gpu_worker.engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), pool_bytes=pool, max_num_seqs=max_batch,
                                    max_num_batched_tokens=max(step_tokens, max_batch), max_model_len=max_len,
                                    num_threads=threads))
    vocab = engine.runner.cfg.vocab_size
    prompt = min(PROMPT, engine.max_model_len - DECODE_TOKENS - 1)
    params = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    print("ready", flush=True)
    n = 0
    while not stop.is_set():
        for i in range(BATCH):
            engine.add_request(f"b{n}-{i}", [(16 + n + i + j) % vocab for j in range(prompt if i == 0 else 16)], params)
        while engine.has_unfinished and not stop.is_set():
            engine.step()
        n += 1


def main(argv: list[str]) -> int:
    model_dir, threads, pool, max_batch, step_tokens, max_len = argv
    stop = threading.Event()
    worker = threading.Thread(target=_busy, args=(Path(model_dir), int(threads), int(pool), int(max_batch),
                                                  int(step_tokens), int(max_len), stop), daemon=True)
    worker.start()
    sys.stdin.read()  # until the parent closes it (or dies)
    stop.set()
    worker.join(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
