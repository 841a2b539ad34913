"""`tidal up` / `tidal status` / `tidal down` as a user runs them: real processes, real NATS."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from service_procs import ROOT, write_config
from shared.bus import Bus, BusSettings
from shared.config import load_config
from shared.events.ctl import CtlDone, CtlRefused, EvictModel
from shared.nats_credentials import read_credentials
from shared.subjects import worker_ctl
from shared.run_state import RunState, read_state

pytestmark = pytest.mark.timeout(240)


def user_env(cwd: Path, **extra: str) -> dict[str, str]:
    """The environment of a user whose per-user state (XDG_STATE_HOME) is private to the test."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(cwd / "user-state")}
    env.pop("TIDAL_STATE", None)
    return {**env, **extra}


def tidal(*args: str, cwd: Path, timeout: float = 90, home: Path | None = None,
          **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tidal", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=user_env(home or cwd, **env))


def start_up(config: Path, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tidal", "up", "--config", str(config)], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=user_env(cwd))


def wait_ready(up: subprocess.Popen[str], data_dir: Path, timeout: float = 120) -> RunState:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise AssertionError(f"tidal up exited with {up.returncode}:\n{up.stdout.read()}")  # type: ignore[union-attr]
        state = read_state(data_dir)
        if state is not None and state.ready:
            return state
        time.sleep(0.2)
    up.kill()
    raise AssertionError("tidal up did not become ready")


def alive(pid: int, created: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - created) < 0.5
    except psutil.NoSuchProcess:
        return False


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Any live process whose command line mentions `text` (our config or NATS store path)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(text in arg for arg in proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def assert_nothing_left(state: RunState, config: Path) -> None:
    assert state.processes and all(p.pid > 0 for p in state.processes)
    left = [(p.name, p.pid) for p in state.processes if alive(p.pid, p.create_time)]
    assert left == [], f"still running: {left}"
    assert not alive(state.launcher_pid, state.launcher_create_time)
    assert processes_mentioning(str(config)) == []  # no service process of this cluster
    assert processes_mentioning(str(Path(state.data_dir) / "nats")) == []  # no nats-server on our store


async def scheduler_ctl(url: str) -> CtlDone | CtlRefused:
    bus = await Bus.connect(BusSettings(url=url, initial_connect_s=5.0), service="scheduler")
    try:
        return await bus.request(worker_ctl("w0"), EvictModel(idempotency_key="sched-1", model="not-loaded"),
                                 CtlDone | CtlRefused, timeout=10)  # type: ignore[no-any-return]
    finally:
        await bus.close()


def test_up_status_down_leaves_no_process(tmp_path):
    config = write_config(tmp_path)
    data_dir = tmp_path / "data"
    up = start_up(config, tmp_path)
    try:
        state = wait_ready(up, data_dir)
        names = sorted(p.name for p in state.services())
        assert names == ["dispatcher", "gateway", "gpu_worker", "gpu_worker", "planner", "predictor", "registry"]
        nats = state.nats()
        # the embedded NATS has per-service users: this user's tools hold the operator's (state file 0600)
        assert nats is not None and state.embedded_nats and state.nats_url.startswith("nats://operator:")
        assert "@127.0.0.1:" in state.nats_url and (data_dir / "run.json").stat().st_mode & 0o077 == 0
        assert all(alive(p.pid, p.create_time) for p in state.processes)
        running_passwords = re.findall(r'password: "([0-9a-f]+)"', (data_dir / "nats" / "nats.conf").read_text())
        for proc in state.services():  # no password on any command line (`ps` shows them to every user)
            assert not [pw for pw in running_passwords if pw in " ".join(psutil.Process(proc.pid).cmdline())]
        # an external scheduler needs only the scheduler's credentials file: it drives worker.ctl with it
        scheduler_file = data_dir / "credentials" / "scheduler.toml"
        assert scheduler_file.stat().st_mode & 0o077 == 0
        creds = read_credentials(scheduler_file)
        assert creds.user == "scheduler" and creds.url and creds.password in running_passwords
        assert asyncio.run(scheduler_ctl(creds.url_with())).worker_id == "w0"

        status = tidal("status", "--config", str(config), "--json", cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert report["registry_reachable"] is True
        by_instance = {row["instance"]: row for row in report["services"]}
        for proc in state.services():  # every process registered itself and answers health
            assert by_instance[proc.instance]["health"] == "ok", by_instance.get(proc.instance)
            assert by_instance[proc.instance]["pid"] == proc.pid
        workers = {w["worker_id"]: w for w in report["workers"]}
        assert set(workers) == {"w0", "w1"}
        assert all(w["liveness"] == "alive" and w["last_heartbeat_age_s"] < 1.0 for w in workers.values())
        assert (workers["w0"]["memory_capacity_bytes"], workers["w1"]["device"]) == (64 << 20, "cpu")

        table = tidal("status", "--config", str(config), cwd=tmp_path)
        assert table.returncode == 0 and "gpu_worker" in table.stdout and "alive" in table.stdout

        # from another folder, with no flag: this user's running cluster; or named by --state / TIDAL_STATE
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        for extra, env in (((), {}), (("--state", str(data_dir)), {}), ((), {"TIDAL_STATE": str(data_dir)})):
            found = tidal("status", "--json", *extra, cwd=elsewhere, home=tmp_path, **env)
            assert found.returncode == 0, (extra, env, found.stderr)
            assert json.loads(found.stdout)["nats_url"] == state.nats_url
        # bench serve from there too: the running cluster's gateway (not the default port) and its NATS
        trace = elsewhere / "t.jsonl"
        assert tidal("trace", "poisson", "--model", "not-served", "--duration", "2", "--out", str(trace),
                     cwd=elsewhere, home=tmp_path).returncode == 0
        serve = tidal("bench", "serve", str(trace), "--no-live", "--no-probe", cwd=elsewhere, home=tmp_path)
        gateway = f"http://127.0.0.1:{load_config(config).gateway.port}"
        assert serve.returncode == 2 and f"the gateway at {gateway} does not serve" in serve.stderr, serve.stderr
        other_user = tidal("status", cwd=elsewhere)  # another user's state: nothing running, and says where it looked
        assert other_user.returncode == 1 and "no Tidal cluster is running: looked in" in other_user.stderr
        assert str(elsewhere / ".tidal" / "run.json") in other_user.stderr
        assert str(elsewhere / "user-state" / "tidal" / "clusters") in other_user.stderr

        down = tidal("down", cwd=elsewhere, home=tmp_path)
        assert down.returncode == 0, down.stdout + down.stderr
        assert "no process left" in down.stdout
        assert up.wait(30) == 0
        out = up.stdout.read()  # type: ignore[union-attr]
        assert f"http://127.0.0.1:{load_config(config).gateway.port}" in out and "stopped; no process left" in out
        assert_nothing_left(state, config)
        assert read_state(data_dir) is None
        assert list((tmp_path / "user-state" / "tidal" / "clusters").glob("*.json")) == []  # its pointer too
        assert (data_dir / "logs" / "registry.log").exists() and (data_dir / "logs" / "gpu_worker-w0.log").exists()
        passwords = re.findall(r'password: "([0-9a-f]+)"', (data_dir / "nats" / "nats.conf").read_text())
        assert len(passwords) >= 7  # the six services, the cli, the scheduler and the operator
        for log in (data_dir / "logs").glob("*.log"):  # every service kept within its own user's permissions
            text = log.read_text(errors="replace")
            assert "permissions violation" not in text.lower(), (log.name, text[-2000:])
            assert not [p for p in passwords if p in text], log.name  # no password in any log
        assert not [p for p in passwords if p in out]
    finally:
        if up.poll() is None:
            up.kill()
            tidal("down", "--config", str(config), cwd=tmp_path)


def test_crashed_child_is_restarted_and_ctrl_c_stops_everything(tmp_path):
    config = write_config(tmp_path)
    data_dir = tmp_path / "data"
    up = start_up(config, tmp_path)
    try:
        state = wait_ready(up, data_dir)
        dispatcher = next(p for p in state.services() if p.name == "dispatcher")
        os.kill(dispatcher.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        restarted = None
        while time.monotonic() < deadline and restarted is None:
            latest = read_state(data_dir)
            now = next(p for p in latest.services() if p.name == "dispatcher") if latest else None
            if now is not None and now.restarts == 1 and now.pid != dispatcher.pid:
                restarted = now
            time.sleep(0.2)
        assert restarted is not None and restarted.instance.endswith("-r1")
        for _ in range(100):  # the restarted process registers and answers health
            report = json.loads(tidal("status", "--config", str(config), "--json", cwd=tmp_path).stdout)
            rows = {r["instance"]: r for r in report["services"]}
            if rows.get(restarted.instance, {}).get("health") == "ok":
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"restarted dispatcher never healthy: {rows}")
        final = read_state(data_dir)
        up.send_signal(signal.SIGINT)  # Ctrl-C
        assert up.wait(60) == 0
        out = up.stdout.read()  # type: ignore[union-attr]
        assert "dispatcher exited with code -9; restarting" in out and "SIGINT received" in out
        assert_nothing_left(final, config)
    finally:
        if up.poll() is None:
            up.kill()
            tidal("down", "--config", str(config), cwd=tmp_path)


def test_bad_config_starts_nothing_and_names_the_key(tmp_path):
    config = write_config(tmp_path, '[cluster]\ndata_dir = "data"\n[[workers]]\nid = "w0"\nmemory = "lots"\n')
    result = tidal("up", "--config", str(config), cwd=tmp_path, timeout=30)
    assert result.returncode == 2
    assert "workers[0].memory" in result.stderr and "lots" in result.stderr
    assert not (tmp_path / "data").exists()  # nothing started, nothing written


def test_down_and_status_with_nothing_running_say_so(tmp_path):
    config = write_config(tmp_path)
    down = tidal("down", "--config", str(config), cwd=tmp_path, timeout=30)
    assert down.returncode == 1 and "no Tidal cluster is running" in down.stderr
    status = tidal("status", "--config", str(config), cwd=tmp_path, timeout=30)
    assert status.returncode == 1 and "no Tidal cluster is running" in status.stderr
