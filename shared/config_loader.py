"""Loading the cluster config: TOML -> environment overrides -> typed decode -> cross-checks.

Errors become one `ConfigError` naming the key path the way a user writes it
(`workers[1].memory`, `gateway.limits.max_tokens`) and what was expected there.
"""
from __future__ import annotations

import copy
import json
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from shared.config_schema import DEFAULT_CONFIG_PATH, DEVICE_PATTERN, ClusterConfig, ConfigError
from shared.config_units import dec_hook, enc_hook
from shared.events.base import ID_PATTERN, NAME_PATTERN

ENV_PREFIX = "TIDAL__"
_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_SEGMENT = re.compile(r"\.([A-Za-z0-9_]+)|\[(\d+)\]")
_SECRETS = ("api_keys", "password", "token")  # never echo these values in an error
_PATTERN_NAMES = {
    DEVICE_PATTERN: '"cpu" or "cuda:N"',
    ID_PATTERN: "an id of letters, digits, '_' and '-' (1-64 chars)",
    NAME_PATTERN: "a name of letters, digits, '.', '_' and '-' (1-64 chars)",
}


def load(path: Path | None, env: Mapping[str, str]) -> ClusterConfig:
    if path is None:
        return parse(DEFAULT_CONFIG_PATH.read_text(), source="embedded default", base_dir=Path.cwd(), env=env)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError("", f"cannot read the config file: {exc.strerror or exc}", source=str(path)) from None
    return parse(text, source=str(path), base_dir=path.resolve().parent, env=env)


def parse(text: str, *, source: str, base_dir: Path, env: Mapping[str, str]) -> ClusterConfig:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"invalid TOML: {exc}", source=source) from None
    merged, origins = apply_env(raw, env)
    try:
        cfg = msgspec.convert(merged, ClusterConfig, dec_hook=dec_hook)
    except msgspec.ValidationError as exc:
        key_path, detail = explain(str(exc), merged)
        origin = next((v for k, v in origins.items() if _related(k, key_path)), None)
        raise ConfigError(key_path, detail, source=_from_env(origin) if origin else source) from None
    check_references(cfg, source)
    return resolve_paths(cfg, base_dir)


# --- environment overrides ---
def apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Merge `TIDAL__A__B=value` overrides into a copy of `raw`; returns it and {key path: variable}."""
    merged = copy.deepcopy(raw)
    origins: dict[str, str] = {}
    for var in sorted(k for k in env if k.startswith(ENV_PREFIX)):
        segments = [s.lower() for s in var[len(ENV_PREFIX):].split("__")]
        if not all(segments):
            raise ConfigError("", "empty key segment in the variable name", source=_from_env(var))
        key_path, target = _walk_type(segments, merged, var)
        value = _convert_env_value(env[var], target, key_path, var)
        _assign(merged, segments, value)
        origins[key_path] = var
    return merged, origins


def _walk_type(segments: list[str], merged: dict[str, Any], var: str) -> tuple[str, Any]:
    """The key path and the declared type the variable addresses; refuses unknown keys."""
    tp: Any = ClusterConfig
    node: Any = merged
    key_path = ""
    for seg in segments:
        tp = _strip(tp)
        if typing.get_origin(tp) is list:
            if not seg.isdigit() or not isinstance(node, list) or int(seg) >= len(node):
                size = len(node) if isinstance(node, list) else 0
                raise ConfigError(key_path, f"expected a list index below {size}, got {seg!r}", source=_from_env(var))
            key_path += f"[{seg}]"
            tp, node = typing.get_args(tp)[0], node[int(seg)]
            continue
        fields = {f.name: f.type for f in msgspec.structs.fields(tp)} if _is_struct(tp) else {}
        if seg not in fields:
            allowed = ", ".join(sorted(fields)) or "nothing (not a table)"
            raise ConfigError(_join(key_path, seg), f"unknown key (expected one of: {allowed})", source=_from_env(var))
        key_path = _join(key_path, seg)
        tp = fields[seg]
        node = node.get(seg) if isinstance(node, dict) else None
    return key_path, tp


def _convert_env_value(text: str, target: Any, key_path: str, var: str) -> Any:
    base = _strip(target)
    if text == "" and _optional(target):
        return None
    value: Any = text
    if typing.get_origin(base) in (list, dict) or _is_struct(base):
        try:
            value = tomllib.loads(f"v = {text}")["v"]  # TOML inline syntax: ["a", "b"], {x = 1}
        except tomllib.TOMLDecodeError as exc:
            detail = f"expected a TOML array or inline table, got {text!r} ({exc})"
            raise ConfigError(key_path, detail, source=_from_env(var)) from None
    try:
        typed = msgspec.convert(value, target, strict=False, dec_hook=dec_hook)
    except msgspec.ValidationError as exc:
        sub_path, detail = explain(str(exc), value, target)
        if sub_path:
            key_path = key_path + sub_path if sub_path.startswith("[") else _join(key_path, sub_path)
        raise ConfigError(key_path, detail, source=_from_env(var)) from None
    return msgspec.to_builtins(typed, enc_hook=enc_hook)


def _assign(tree: dict[str, Any], segments: list[str], value: Any) -> None:
    node: Any = tree
    for seg in segments[:-1]:
        node = node[int(seg)] if isinstance(node, list) else node.setdefault(seg, {})
    last = segments[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


# --- error messages ---
def explain(message: str, raw: Any, root: Any = ClusterConfig) -> tuple[str, str]:
    """(key path, detail) from a msgspec ValidationError message, the raw value tree and its type."""
    match = _AT.match(message)
    assert match is not None
    msg, key_path = match.group("msg"), (match.group("path") or "").lstrip(".")
    if m := re.match(r"Object contains unknown field `([^`]*)`", msg):
        key_path = _join(key_path, m.group(1))
        parent = _strip(_type_at(key_path.rpartition(".")[0] if "." in key_path else "", root))
        allowed = ", ".join(f.name for f in msgspec.structs.fields(parent)) if _is_struct(parent) else "?"
        return key_path, f"unknown key (expected one of: {allowed})"
    if m := re.match(r"Object missing required field `([^`]*)`", msg):
        return _join(key_path, m.group(1)), "missing (required)"
    found = _value_at(raw, key_path)
    got = json.dumps(found) if isinstance(found, (str, int, float, bool)) else type(found).__name__
    if any(secret in key_path for secret in _SECRETS):
        got = "a value (not shown)"
    if m := re.match(r"Expected `str` matching regex '(.*)'$", msg):
        return key_path, f"expected {_PATTERN_NAMES.get(m.group(1), 'a string matching ' + m.group(1))}, got {got}"
    if msg.startswith("Invalid enum value"):
        choices = [a for a in typing.get_args(_strip(_type_at(key_path, root))) if isinstance(a, str)]
        return key_path, f"expected one of {', '.join(json.dumps(c) for c in choices)}, got {got}"
    if m := re.match(r"Expected (.*?), got `[^`]*`$", msg):
        return key_path, f"expected {m.group(1).replace('`', '')}, got {got}"
    if msg.startswith("Expected "):
        return key_path, f"expected {msg[len('Expected '):].replace('`', '')}, got {got}"
    return key_path, msg


def _value_at(raw: Any, key_path: str) -> Any:
    node = raw
    for name, index in _SEGMENT.findall("." + key_path if key_path else ""):
        try:
            node = node[int(index)] if index else node[name]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def _type_at(key_path: str, root: Any = ClusterConfig) -> Any:
    tp: Any = root
    for name, index in _SEGMENT.findall("." + key_path if key_path else ""):
        tp = _strip(tp)
        if index:
            tp = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        else:
            fields = {f.name: f.type for f in msgspec.structs.fields(tp)} if _is_struct(tp) else {}
            tp = fields.get(name)
    return tp


# --- cross-references and paths ---
def check_references(cfg: ClusterConfig, source: str) -> None:
    def fail(key_path: str, detail: str) -> None:
        raise ConfigError(key_path, detail, source=source)

    models = [m.name for m in cfg.models]
    for i, model in enumerate(cfg.models):
        if model.name in models[:i]:
            fail(f"models[{i}].name", f"duplicate model {json.dumps(model.name)}")
        if model.path is None and model.demo is None and model.gguf is None:
            fail(f"models[{i}]", "set path (a local Hugging Face directory), gguf (a GGUF file to import) "
                 "or demo (a generated model)")
    adapters = [a.name for a in cfg.adapters]
    for i, adapter in enumerate(cfg.adapters):
        if adapter.name in adapters[:i] or adapter.name in models:
            fail(f"adapters[{i}].name", f"duplicate name {json.dumps(adapter.name)} (models and adapters share names)")
        if adapter.base not in models:
            fail(f"adapters[{i}].base", f"unknown model {json.dumps(adapter.base)} (models: {', '.join(models)})")
        if adapter.path is None and adapter.demo is None:
            fail(f"adapters[{i}]", "set path (a PEFT directory) or demo (a generated adapter)")
    ids = [w.id for w in cfg.workers]
    for i, worker in enumerate(cfg.workers):
        if worker.id in ids[:i]:
            fail(f"workers[{i}].id", f"duplicate worker id {json.dumps(worker.id)}")
        for j, name in enumerate(worker.models):
            if name not in models:
                fail(f"workers[{i}].models[{j}]", f"unknown model {json.dumps(name)} (models: {', '.join(models)})")
        for j, name in enumerate(worker.adapters):
            if name not in adapters:
                fail(f"workers[{i}].adapters[{j}]", f"unknown adapter {json.dumps(name)}")
            base = cfg.adapters[adapters.index(name)].base
            if base not in worker.models:
                fail(f"workers[{i}].adapters[{j}]", f"adapter {json.dumps(name)} needs its base model "
                     f"{json.dumps(base)} in this worker's models")


def resolve_paths(cfg: ClusterConfig, base_dir: Path) -> ClusterConfig:
    """Make data_dir and model/adapter paths absolute; give generated ones their place under data_dir."""
    data_dir = (base_dir / cfg.cluster.data_dir).resolve()
    replace = msgspec.structs.replace
    models = [replace(m, path=str((base_dir / m.path).resolve() if m.path else data_dir / "models" / m.name))
              for m in cfg.models]
    models = [replace(m, gguf=replace(m.gguf, file=str((base_dir / m.gguf.file).resolve())))
              if m.gguf is not None and m.gguf.package is None else m for m in models]
    adapters = [replace(a, path=str((base_dir / a.path).resolve() if a.path else data_dir / "adapters" / a.name))
                for a in cfg.adapters]
    return replace(cfg, cluster=replace(cfg.cluster, data_dir=str(data_dir)), models=models, adapters=adapters)


# --- type helpers ---
def _strip(tp: Any) -> Any:
    """Drop Annotated and Optional wrappers."""
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):
            rest = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(rest) != 1:
                return tp
            tp = rest[0]
        else:
            return tp


def _optional(tp: Any) -> bool:
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return type(None) in typing.get_args(tp)


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _from_env(var: str) -> str:
    return f"environment variable {var}"


def _related(a: str, b: str) -> bool:
    """One key path is the other or lies inside it (`registry` and `registry.dead_after`)."""
    return a == b or a.startswith(b + ".") or a.startswith(b + "[") or b.startswith(a + ".") or b.startswith(a + "[")


def _join(key_path: str, name: str) -> str:
    return f"{key_path}.{name}" if key_path else name

