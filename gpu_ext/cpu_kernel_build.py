"""Where and when gpu_ext's native CPU kernels are built: ahead of time, into the venv.

A kernel is compiled with torch's C++ extension JIT (ninja and a C++ compiler: g++ or clang++).
The compile takes 10-30 s on an idle core and over a minute on a busy 2-core box, so it must
not happen inside a worker's start-up: `make install` builds it (`python -m gpu_ext.cpu_attention
--build`), and `tidal up` builds it before any worker starts when it is missing (a new CPU, a new
torch, a changed source).

The build lives in the **venv** (`<sys.prefix>/var/tidal-kernels/<name>/`), not torch's
user-wide `~/.cache/torch_extensions`: its build.ninja bakes in one venv's include and library
paths, so two checkouts sharing that cache rebuild each other's kernels, even under a running
cluster. Where the prefix is not writable (a system Python), the per-user cache holds one
folder per prefix (`~/.cache/tidal/kernels/<hash of the prefix>/`). TIDAL_KERNEL_DIR overrides both.

`name` keys everything the machine code depends on (source, flags, the CPU's flags, torch's
version): a built library of that name is loaded as is, without ninja or a compiler. Nothing
here imports torch at module level, so `tidal up` can ask `built()` cheaply.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import sys
from pathlib import Path

DISABLE_ENV = "TIDAL_CPU_KERNELS"  # "0": never build nor load, the torch path everywhere
DIR_ENV = "TIDAL_KERNEL_DIR"


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0"


def _cpu_flags() -> str:
    # -march=native code must not run on another CPU: the CPU's flags are part of the key
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return cpu


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def kernel_name(prefix: str, source: str, flags: list[str]) -> str:
    key = source + " ".join(flags) + _cpu_flags() + _torch_version()
    return f"{prefix}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _writable(path: Path) -> bool:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return os.access(probe, os.W_OK)


def kernels_dir() -> Path:
    """This interpreter's kernel folder: the venv's, else one per prefix in the user's cache."""
    override = os.environ.get(DIR_ENV)
    if override:
        return Path(override).expanduser()
    in_prefix = Path(sys.prefix) / "var" / "tidal-kernels"
    if _writable(in_prefix):
        return in_prefix
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tidal" / "kernels" / hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]


def library_path(name: str) -> Path:
    return kernels_dir() / name / f"{name}.so"


def built(name: str) -> bool:
    return library_path(name).is_file()


def build_and_load(name: str, source: str, flags: list[str], ldflags: list[str]) -> None:
    """Load the library `name` (its ops register under torch.ops.<name>), compiling it first if missing.

    Raises whatever the compile raises (no compiler, no ninja, a build error): the caller falls back."""
    import torch

    lib = library_path(name)
    if lib.is_file():
        torch.ops.load_library(str(lib))
        return
    from torch.utils.cpp_extension import load

    folder = lib.parent
    folder.mkdir(parents=True, exist_ok=True)
    # a source file, not load_inline: that would prepend <torch/extension.h> (2x the build time)
    src = folder / f"{name}.cpp"
    if not src.is_file() or src.read_text() != source:
        tmp = src.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(src)
    # torch's own lock file in `folder` makes a second process wait for the first one's build
    load(name, [str(src)], extra_cflags=flags, extra_ldflags=ldflags, build_directory=str(folder),
         is_python_module=False, verbose=False)


__all__ = ["DISABLE_ENV", "built", "build_and_load", "enabled", "kernel_name", "kernels_dir", "library_path"]
