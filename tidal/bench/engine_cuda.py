"""`tidal bench engine --device cuda:N`: the engine's decode and prefill steps on a GPU against
the hardware's limits (engine_roofline.py).

Each shape (Llama 3.1 8B, Llama 3.2 1B, Qwen2 7B: the real configs, bf16) gets random weights
generated directly in device memory and handed to the engine's own `ModelRunner` as preloaded
weights (a 16 GB checkpoint written and read back would only cost time), then:
* decode at each batch x context: the sequences' KV blocks are mapped and filled with random
  values (their content does not change the cost), and each timed step is the runner's
  `execute` plus the greedy token fetch, as the engine steps (CUDA graphs on, the default);
  the same row without graphs is the eager baseline;
* prefill of one prompt of each length in one chunk (flash SDPA over the contiguous prompt).
A row reports tokens/s, the step time (median), its roofline time and the fraction reached;
for decode also the GPU time of one graph replay and the host time to launch a step; the
step overhead is the share of the step the GPU is not running the graph (host work, launch,
the fetch). Rows whose KV does not fit in free device memory are shown as skipped.
"""
from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

SHAPES = {  # the public configs' shapes
    "llama-8b": dict(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    "llama-1b": dict(arch="llama", layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, vocab=128256,
                     tie_embeddings=True),
    "qwen2-7b": dict(arch="qwen2", layers=28, hidden=3584, heads=28, kv_heads=4, intermediate=18944, vocab=152064,
                     rope_theta=1e6),
}
SUMMARY_SHAPE, SUMMARY_BATCH, SUMMARY_CONTEXT, SUMMARY_PREFILL = "llama-8b", 64, 4096, 2048
MAX_POSITION = 8192
BLOCK = 16
HEADROOM = 6 << 30  # activations, logits and the graphs' pool beside the KV


@dataclass(slots=True)
class Row:
    shape: str
    kind: str  # decode | prefill
    batch: int
    tokens: int  # context per sequence (decode) or prompt length (prefill)
    step_ms: float | None = None
    tokens_per_s: float | None = None
    roofline_ms: float | None = None
    fraction: float | None = None  # roofline / step (datasheet peaks)
    fraction_measured: float | None = None  # against the ceilings measured on this card
    gpu_ms: float | None = None  # decode: one graph replay
    launch_ms: float | None = None  # host time in execute() per step
    overhead: float | None = None  # 1 - gpu / step
    eager_ms: float | None = None  # decode without graphs
    mfu: float | None = None
    skipped: str | None = None


def device_weights(cfg, model_dir: str, device, seed: int = 0):
    """Random weights shaped like the checkpoint's, made on the device, as the runner holds them."""
    from services.gpu_worker.engine.random_weights import random_weights

    return random_weights(cfg, model_dir, device, seed)


class ShapeBench:
    """One shape's runner on the device and its rows."""

    def __init__(self, name: str, device: str, tmp: Path, peaks, measured: tuple[float, float], steps: int) -> None:
        import torch

        from services.gpu_worker.engine.checkpoint_gen import write_config
        from services.gpu_worker.engine.memory_pool import MemoryPool
        from services.gpu_worker.engine.model_config import load_model_config
        from services.gpu_worker.engine.model_runner import ModelRunner

        self.name, self.device, self.peaks, self.measured, self.steps = name, device, peaks, measured, steps
        model_dir = str(write_config(tmp / name, max_position=MAX_POSITION, **SHAPES[name]))
        self.cfg = load_model_config(model_dir)
        weights = device_weights(self.cfg, model_dir, torch.device(device))
        pool = MemoryPool(_memory(device)[1], device)  # accounting only; the KV region reserves address space
        self.runner = ModelRunner(model_dir, pool.view(name), device=device, block_size=BLOCK, preloaded=weights)
        self.mapped = 0  # KV blocks [0, mapped) have memory behind them

    def close(self) -> None:
        import torch

        self.runner.kv_cache.release_blocks(list(range(self.mapped)))
        self.runner.close()
        del self.runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _kv_blocks(self, blocks: int) -> str | None:
        """Map and fill KV blocks [0, blocks); the reason when they do not fit."""
        if blocks > self.runner.max_kv_blocks:
            return f"{blocks} KV blocks exceed the region's {self.runner.max_kv_blocks}"
        extra = max(0, blocks - self.mapped) * self.runner.kv_block_bytes
        free = _memory(self.device)[0]
        if extra + HEADROOM > free:
            need = blocks * self.runner.kv_block_bytes
            return f"needs {need / 2**30:.0f} GiB of KV, {(free + self.mapped * self.runner.kv_block_bytes - HEADROOM) / 2**30:.0f} GiB free"
        if blocks > self.mapped:
            self.runner.kv_cache.back_blocks(list(range(self.mapped, blocks)))
            self.runner.kv_cache.blocks[:, self.mapped:blocks].normal_(0, 1)
            self.mapped = blocks
        return None

    def _chunks(self, batch: int, start: int, tokens: int):
        from services.gpu_worker.engine.batch import ScheduledChunk

        nb = -(-(start + tokens + self.steps + 8) // BLOCK)
        layers = self.cfg.num_layers
        why = self._kv_blocks(batch * layers * nb)
        if why is not None:
            return None, why
        chunks = [ScheduledChunk(f"s{b}", [(1000 + b) % self.cfg.vocab_size] * tokens, start,
                                 {l: list(range((b * layers + l) * nb, (b * layers + l + 1) * nb)) for l in range(layers)})
                  for b in range(batch)]
        return chunks, None

    def decode(self, batch: int, context: int, eager: bool) -> Row:
        import torch

        from services.gpu_worker.engine.batch import SchedulerOutput
        from tidal.bench.engine_roofline import decode_cost

        row = Row(self.name, "decode", batch, context)
        chunks, row.skipped = self._chunks(batch, context, 1)
        if chunks is None:
            return row
        runner = self.runner

        graphs_on = runner.use_graphs  # the default: on CUDA

        def timed(graphs: bool) -> tuple[float, float]:
            runner.use_graphs = graphs
            walls, launches = [], []
            for step in range(3 + self.steps):  # the first builds and captures the bucket's graph
                t0 = time.perf_counter()
                out = runner.execute(SchedulerOutput(chunks))
                t1 = time.perf_counter()
                ids = out.logits.argmax(-1).tolist()  # the token fetch: the step's one sync
                t2 = time.perf_counter()
                for c, t in zip(chunks, ids):
                    c.token_ids = [t]
                    c.start_pos += 1
                if step >= 3:
                    walls.append(t2 - t0)
                    launches.append(t1 - t0)
            for c in chunks:
                c.start_pos -= 3 + self.steps
            return statistics.median(walls), statistics.median(launches)

        wall, launch = timed(graphs_on)
        row.step_ms, row.launch_ms = wall * 1e3, launch * 1e3
        graph = runner.graphs.graph_for(batch) if runner.graphs is not None else None
        if graph is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                graph.replay()
            end.record()
            end.synchronize()
            row.gpu_ms = start.elapsed_time(end) / 10
            row.overhead = max(0.0, 1 - row.gpu_ms / row.step_ms)
        if eager and graphs_on:
            row.eager_ms = timed(False)[0] * 1e3
            runner.use_graphs = True
        nbytes, flops = decode_cost(self.cfg, batch, context)
        self._fill(row, nbytes, flops, wall, batch)
        return row

    def prefill(self, tokens: int) -> Row:
        import torch

        from services.gpu_worker.engine.batch import SchedulerOutput
        from tidal.bench.engine_roofline import prefill_cost

        row = Row(self.name, "prefill", 1, tokens)
        chunks, row.skipped = self._chunks(1, 0, tokens)
        if chunks is None:
            return row
        times = []
        for rep in range(4):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.runner.execute(SchedulerOutput(chunks)).logits.argmax(-1).tolist()
            if rep:
                times.append(time.perf_counter() - t0)
        wall = statistics.median(times)
        nbytes, flops = prefill_cost(self.cfg, tokens)
        self._fill(row, nbytes, flops, wall, tokens)
        if self.peaks is not None:
            row.mfu = flops / wall / self.peaks.bf16_flops
        return row

    def _fill(self, row: Row, nbytes: int, flops: float, wall: float, tokens: int) -> None:
        from tidal.bench.engine_roofline import roofline_s

        row.step_ms = wall * 1e3
        row.tokens_per_s = tokens / wall
        if self.peaks is not None:
            floor = roofline_s(nbytes, flops, self.peaks.hbm_bytes_per_s, self.peaks.bf16_flops)
            row.roofline_ms = floor * 1e3
            row.fraction = floor / wall
        row.fraction_measured = roofline_s(nbytes, flops, *self.measured) / wall


def _memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of the device's memory (the host's for a CPU dry run)."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(rows: list[Row], header: str) -> str:
    lines = [header, "", "| shape | step | batch | context / prompt | tok/s | step ms | roofline ms | of roofline "
             "| of measured | GPU ms (graph) | launch ms | overhead | eager ms | MFU |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.skipped:
            lines.append(f"| {r.shape} | {r.kind} | {r.batch} | {r.tokens} | skipped: {r.skipped} |" + " |" * 9)
            continue
        lines.append(f"| {r.shape} | {r.kind} | {r.batch} | {r.tokens} | {r.tokens_per_s:,.0f} | {_ms(r.step_ms)} | "
                     f"{_ms(r.roofline_ms)} | {_pct(r.fraction)} | {_pct(r.fraction_measured)} | {_ms(r.gpu_ms)} | "
                     f"{_ms(r.launch_ms)} | {_pct(r.overhead)} | {_ms(r.eager_ms)} | {_pct(r.mfu)} |")
    return "\n".join(lines) + "\n"


def summary(rows: list[Row]) -> str:
    def pick(kind: str, batch: int, tokens: int) -> Row | None:
        return next((r for r in rows if (r.shape, r.kind, r.batch, r.tokens) == (SUMMARY_SHAPE, kind, batch, tokens)
                     and not r.skipped), None)

    dec = pick("decode", SUMMARY_BATCH, SUMMARY_CONTEXT)
    pre = pick("prefill", 1, SUMMARY_PREFILL)
    dec8 = pick("decode", 8, SUMMARY_CONTEXT)
    return (f"bench engine (cuda): decode_roofline_b64={_pct(dec.fraction if dec else None)} "
            f"decode_roofline_b8={_pct(dec8.fraction if dec8 else None)} "
            f"prefill_mfu_2k={_pct(pre.mfu if pre else None)} step_overhead={_pct(dec.overhead if dec else None)}")


def run_cuda(args) -> int:
    import torch

    from tidal.bench.engine_roofline import device_peaks, measure_ceilings
    from tidal.bench.output import out_dir

    device = args.device
    if not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: CUDA is not available here")
    name = torch.cuda.get_device_name(torch.device(device))
    peaks = device_peaks(name)
    out = out_dir(args, time.time())
    out.mkdir(parents=True, exist_ok=True)
    bw, mm = measure_ceilings(device)
    header = (f"Device: {name}; peaks: " + (f"{peaks.hbm_bytes_per_s / 1e12:.2f} TB/s, {peaks.bf16_flops / 1e12:.0f} "
              f"bf16 TFLOP/s dense ({peaks.name}, {peaks.source})" if peaks else "not in the table (fractions of "
              "measured only)") + f"; measured here: copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s; "
              f"torch {torch.__version__}")
    print(header, flush=True)
    batches = [int(b) for b in args.batches.split(",") if b]
    contexts = [int(c) for c in args.contexts.split(",") if c]
    prompts = [int(p) for p in args.prefill_tokens.split(",") if p]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="tidal-bench-engine-cuda-") as tmp:
        for shape in [s for s in args.shapes.split(",") if s]:
            if shape not in SHAPES:
                raise SystemExit(f"--shapes: unknown shape {shape!r}; choose from {sorted(SHAPES)}")
            bench = ShapeBench(shape, device, Path(tmp), peaks, (bw, mm), args.steps)
            try:
                for context in contexts:
                    for batch in batches:
                        rows.append(_row(lambda: bench.decode(batch, context, eager=not args.no_eager),
                                         Row(shape, "decode", batch, context)))
                        _report(rows[-1], out, rows, header)
                for tokens in prompts:
                    rows.append(_row(lambda: bench.prefill(tokens), Row(shape, "prefill", 1, tokens)))
                    _report(rows[-1], out, rows, header)
            finally:
                bench.close()
    print(markdown(rows, header))
    line = summary(rows)
    print(line)
    (out / "summary.txt").write_text(line + "\n")
    return 0


def _row(measure, empty: Row) -> Row:
    """A row, or the same row marked with the error that stopped it (the others still run)."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - reported in the table and the log
        traceback.print_exc()
        empty.skipped = f"error: {exc!r}"[:200]
        return empty


def _report(row: Row, out: Path, rows: list[Row], header: str) -> None:
    """Print the row and rewrite the files after each: a run cut short keeps what it measured."""
    print(json.dumps(asdict(row)), flush=True)
    (out / "engine_cuda.json").write_text(json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=1))
    (out / "engine_cuda.md").write_text(markdown(rows, header))
