"""Generate the config's demo checkpoints and adapters, and import its GGUF models, once, cached under `data_dir`.

A `[[models]]` entry with `demo = {...}` (and no `path`) is a small random-weight model
with a real trained byte-level BPE tokenizer (`engine.checkpoint_gen`): it serves real
tokens and text, but the text is gibberish. A demo `[[adapters]]` entry is a random PEFT
LoRA adapter of its base. A `[[models]]` entry with `gguf = {...}` is a real trained
llama.cpp GGUF file (a path, or a file shipped inside an installed Python package) imported
with `engine.gguf_import`. Each lands at its resolved `path` (data_dir/models/<name>,
data_dir/adapters/<name>) with a stamp of the spec it was made from; a changed spec makes
it again. Generation happens in a temporary sibling directory, renamed into place, under a
file lock, so concurrent workers and `tidal up` never see half a checkpoint.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from shared.config import AdapterSpec, ClusterConfig, ModelSpec

STAMP = ".tidal-demo.json"


class AssetError(RuntimeError):
    """A model cannot be generated or imported; the message names the model and why."""


def gguf_path(m: ModelSpec) -> Path:
    """The GGUF file of `m` (its `gguf.file`, inside `gguf.package` when set), found without importing
    the package; raises AssetError when the package is not installed."""
    assert m.gguf is not None
    if m.gguf.package is None:
        return Path(m.gguf.file)
    try:
        spec = importlib.util.find_spec(m.gguf.package)
    except (ImportError, ValueError):
        spec = None
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    if not dirs:
        raise AssetError(f"model {m.name!r}: the Python package {m.gguf.package!r} holding its GGUF file is not "
                         "installed (`make install` installs it)")
    return Path(dirs[0]) / m.gguf.file


def _stamp(spec: ModelSpec | AdapterSpec, extra: dict[str, object]) -> dict[str, object]:
    return {"demo": msgspec.to_builtins(spec.demo), **extra}


def _current(path: Path, stamp: dict[str, object]) -> bool:
    try:
        return json.loads((path / STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(data_dir: Path) -> Iterator[None]:
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / ".demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(path: Path, stamp: dict[str, object], make: Callable[[Path], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        make(tmp)
        (tmp / STAMP).write_text(json.dumps(stamp))
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def pending_demo_assets(cfg: ClusterConfig, models: list[str] | None = None) -> list[str]:
    """Names of the demo models/adapters (of `models`, default all) not generated yet."""
    wanted = set(models) if models is not None else {m.name for m in cfg.models}
    out = [m.name for m in cfg.models
           if m.name in wanted and (m.demo is not None or m.gguf is not None)
           and not _current(Path(str(m.path)), _model_stamp(m))]
    out += [a.name for a in cfg.adapters
            if a.base in wanted and a.demo is not None and not _current(Path(str(a.path)), _adapter_stamp(cfg, a))]
    return out


def _model_stamp(m: ModelSpec) -> dict[str, object]:
    if m.gguf is not None:
        try:
            path = gguf_path(m)
            size: int | None = path.stat().st_size
        except (AssetError, OSError):
            path, size = None, None  # not current: ensure_demo_assets says why
        return {"gguf": str(path), "source_bytes": size, "dtype": m.dtype}
    return _stamp(m, {"dtype": m.dtype, "max_context": m.max_context})


def _adapter_stamp(cfg: ClusterConfig, a: AdapterSpec) -> dict[str, object]:
    return _stamp(a, {"rank": a.rank, "targets": list(a.targets), "base": _model_stamp(cfg.model(a.base))})


def ensure_demo_assets(cfg: ClusterConfig, *, models: list[str] | None = None,
                       progress: Callable[[str], None] | None = None) -> list[str]:
    """Generate what `pending_demo_assets` lists (blocking); returns the names generated."""
    from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
    from services.gpu_worker.engine.gguf_import import GGUFImportError, import_gguf

    if not pending_demo_assets(cfg, models):
        return []
    made: list[str] = []
    wanted = set(models) if models is not None else {m.name for m in cfg.models}
    with _locked(Path(cfg.cluster.data_dir)):
        for m in cfg.models:
            if m.name not in wanted or m.gguf is None or _current(Path(str(m.path)), _model_stamp(m)):
                continue
            source = gguf_path(m)
            if progress:
                progress(f"importing GGUF model {m.name} from {source} into {m.path} (once)")
            try:
                _build(Path(str(m.path)), _model_stamp(m),
                       lambda out, source=source, m=m: import_gguf(source, out, dtype=m.dtype))
            except GGUFImportError as exc:
                raise AssetError(f"model {m.name!r}: {exc}") from None
            made.append(m.name)
        for m in cfg.models:
            if m.name not in wanted or m.demo is None or _current(Path(str(m.path)), _model_stamp(m)):
                continue
            if progress:
                progress(f"generating demo model {m.name} ({m.demo.arch}, {m.demo.layers} layers) in {m.path}")
            d = m.demo
            _build(Path(str(m.path)), _model_stamp(m), lambda out, d=d, m=m: make_model(
                out, arch=d.arch, layers=d.layers, hidden=d.hidden, heads=d.heads, kv_heads=d.kv_heads,
                intermediate=d.intermediate, vocab=d.vocab, seed=d.seed, dtype=m.dtype, max_position=m.max_context))
            made.append(m.name)
        for a in cfg.adapters:
            if a.base not in wanted or a.demo is None or _current(Path(str(a.path)), _adapter_stamp(cfg, a)):
                continue
            if progress:
                progress(f"generating demo LoRA adapter {a.name} (rank {a.rank} of {a.base}) in {a.path}")
            base = str(cfg.model(a.base).path)
            _build(Path(str(a.path)), _adapter_stamp(cfg, a), lambda out, a=a, base=base: make_lora(
                out, base, rank=a.rank, targets=list(a.targets), seed=a.demo.seed))  # type: ignore[union-attr]
            made.append(a.name)
    return made
