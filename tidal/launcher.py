"""The supervisor behind `tidal up`: NATS, then every service as a child process, then stop in order.

Start: the CPU attention kernel, built once per venv if missing (tidal/prebuild.py: never inside a
worker's start), the embedded nats-server (unless a NATS url is given), the registry (waited for:
the others announce themselves in it), then the other services; each must answer its health
subject (`starting` with its progress, which is printed, then `ready`) and never stay silent for
`wait_s`, or start-up fails with the cause read from its log (tidal/start_report.py), everything
started is stopped and the exit code is 1. The state file `<data_dir>/run.json` records the NATS url and every child (pid,
process group, start time) for `tidal down` and `tidal status`.

Running: a child that exits on its own is reported and restarted with backoff
(`tidal.restart_policy`: 1 s, 2 s, 4 s ... 30 s; after more than 5 crashes within 60 s it stays
down). The embedded nats-server is restarted the same way, on the same port and store.

Stop (Ctrl-C, SIGTERM, `tidal down`): every service but the registry gets SIGTERM (its
process group) and its drain deadline plus 5 s, then SIGKILL; then the registry likewise;
NATS last. A second Ctrl-C skips the waiting. No process is left behind.
"""
from __future__ import annotations

import asyncio
import os

import psutil
import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from shared.bus import Bus, BusSettings
from shared.config import ClusterConfig
from shared.nats_server import NatsServer
from shared.nats_users import NatsUsers, redact
from shared.subjects import SERVICES
from shared.wire import TidalError
from tidal import demo
from tidal.launch_plan import ChildSpec, plan_children
from tidal.nats_access import embedded_access, external_access, write_scheduler_credentials
from tidal.prebuild import build_kernels
from tidal.process_control import create_time, pid_alive, recorded_alive, stop_recorded
from tidal.restart_policy import RestartPolicy
from tidal.start_report import wait_healthy
from shared.run_state import ProcessInfo, RunState, read_state, remove_state, write_state

STOP_GRACE_S = 5.0  # beyond a service's drain deadline, before SIGKILL


class Child:
    """One service process (restartable)."""

    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = -1
        self.started = 0.0
        self.created = 0.0
        self.restart_at: float | None = None
        self.gave_up = False

    @property
    def instance(self) -> str:
        return self.spec.instance(max(self.restarts, 0))

    def start(self) -> None:
        self.restarts += 1
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.spec.log_path, "ab") as log:
            log.write(f"--- tidal up: starting {self.instance} at {time.strftime('%Y-%m-%dT%H:%M:%S')} ---\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.spec.argv(self.restarts), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env},
            )
        self.started = time.monotonic()
        self.created = create_time(self.proc.pid)
        self.restart_at = None

    def exited(self) -> int | None:
        """The exit code if the process has exited (reaped), else None."""
        return None if self.proc is None else self.proc.poll()

    def info(self) -> ProcessInfo:
        assert self.proc is not None
        return ProcessInfo(
            name=self.spec.name, instance=self.instance, kind="service", pid=self.proc.pid, pgid=self.proc.pid,
            create_time=self.created, log=str(self.spec.log_path), worker_id=self.spec.worker_id,
            restarts=self.restarts,
        )

    def cpu_seconds(self) -> float:
        """CPU time the process has used (0 when it is gone): a silent process using more is working."""
        try:
            times = psutil.Process(self.proc.pid).cpu_times() if self.proc is not None else None
        except psutil.Error:
            return 0.0
        return 0.0 if times is None else times.user + times.system

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.spec.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class Launcher:
    def __init__(self, cfg: ClusterConfig, *, config_path: str | None, nats_url: str | None,
                 services: list[str] | None = None, workers: list[str] | None = None, wait_s: float = 60.0,
                 out: Callable[[str], None] = print, nats_credentials: str | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.data_dir = Path(cfg.cluster.data_dir)
        self.logs_dir = self.data_dir / "logs"
        self.external_nats = nats_url or (None if cfg.cluster.embedded_nats else cfg.cluster.nats_url)
        self.nats_credentials = nats_credentials  # a folder of per-role credentials files, for external_nats
        self.scheduler_credentials: Path | None = None
        self.services, self.workers, self.wait_s, self.out = services, workers, wait_s, out
        self.nats: NatsServer | None = None
        self.nats_info: ProcessInfo | None = None
        self.children: list[Child] = []
        self.policy = RestartPolicy()
        self.state: RunState | None = None
        self.bus: Bus | None = None
        self._stop = asyncio.Event()
        self._hurry = threading.Event()

    # --- entry point ----------------------------------------------------------------------
    async def run(self) -> int:
        refusal = self._refuse_if_running()
        if refusal:
            self.out(refusal)
            return 1
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        code = 0
        try:
            if await self._start_up():
                self._banner()
                usage = asyncio.ensure_future(self._show_usage())  # alongside supervision, not before it
                try:
                    await self._supervise()
                finally:
                    usage.cancel()
            else:
                code = 1 if not self._stop.is_set() else 130
        finally:
            await self._stop_all()
        return code

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._stop.is_set():
            self._hurry.set()
            self.out("tidal: second signal: killing what is left")
        else:
            self.out(f"tidal: {sig.name} received: stopping the cluster (Ctrl-C again to kill at once)")
        self._stop.set()

    def _refuse_if_running(self) -> str | None:
        try:
            old = read_state(self.data_dir)
        except ValueError as exc:
            return f"tidal: {exc}"
        if old is None:
            return None
        if pid_alive(old.launcher_pid, old.launcher_create_time):
            return (f"tidal: a cluster is already running from {self.data_dir} (launcher pid {old.launcher_pid}, "
                    f"NATS {redact(old.nats_url)}); stop it with `tidal down` first")
        alive = [p for p in old.processes if recorded_alive(p)]
        if alive:
            return (f"tidal: {len(alive)} process(es) of an earlier `tidal up` from {self.data_dir} still run "
                    f"(its launcher is gone); stop them with `tidal down` first")
        remove_state(self.data_dir)  # stale: its processes are all gone
        return None

    # --- start-up -------------------------------------------------------------------------
    async def _start_up(self) -> bool:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        if self.services is None or "gpu_worker" in self.services:  # demo checkpoints, once, before any worker
            from services.gpu_worker.demo_assets import AssetError

            try:
                await asyncio.to_thread(demo.prepare_assets, self.cfg, self.out)
            except AssetError as exc:
                self.out(f"tidal: {exc}")
                return False
            if not await build_kernels(self.cfg, self.services, self.workers, self._stop, self.out):
                return False
        if self.external_nats is None:
            # per-service users by default: a client without credentials cannot publish anything
            self.nats = NatsServer(store_dir=self.data_dir / "nats", log_file=self.logs_dir / "nats.log",
                                   users=NatsUsers.generate())
            await asyncio.to_thread(self.nats.start)
            self.nats_info = self._nats_process_info()
            self.out(f"tidal: embedded nats-server on {self.nats.url} (JetStream store {self.data_dir / 'nats'})")
            self.scheduler_credentials = write_scheduler_credentials(self.nats, self.data_dir)
        # each service its own NATS user; this user's tools (the run state, mode 0600) the operator's (embedded)
        # or `cli` (a NATS of your own, with --nats-credentials): tidal/nats_access.py
        try:
            access = embedded_access(self.nats) if self.nats else external_access(
                str(self.external_nats), self.nats_credentials, self.services or SERVICES)
        except ValueError as exc:
            self.out(f"tidal: {exc}")
            return False
        nats_url = access.tools_url
        run_id = secrets.token_hex(3)
        specs = plan_children(self.cfg, nats_url=nats_url, config_path=self.config_path, run_id=run_id,
                              logs_dir=self.logs_dir, services=self.services, workers=self.workers,
                              role_url=access.role_url)
        self.children = [Child(spec) for spec in specs]
        self.state = RunState(
            launcher_pid=os.getpid(), launcher_create_time=create_time(os.getpid()), nats_url=nats_url,
            embedded_nats=self.nats is not None, data_dir=str(self.data_dir), config=self.config_path,
            gateway_url=self.gateway_url, started_ts=time.time(),
        )
        self._save()
        try:
            self.bus = await Bus.connect(BusSettings(url=nats_url, initial_connect_s=10.0), service="cli")
        except TidalError as exc:
            self.out(f"tidal: cannot reach NATS at {redact(nats_url)}: {exc}")
            return False
        first = [c for c in self.children if c.spec.name == "registry"]
        rest = [c for c in self.children if c.spec.name != "registry"]
        for group in (first, rest):
            for child in group:
                child.start()
            self._save()
            if not await self._wait_healthy(group):
                return False
        assert self.state is not None
        self.state.ready = True
        self._save()
        return True

    async def _wait_healthy(self, children: list[Child]) -> bool:
        assert self.bus is not None
        return await wait_healthy(self.bus, children, self.wait_s, self._stop, self.out)

    @property
    def gateway_url(self) -> str:
        return f"http://{self.cfg.gateway.host}:{self.cfg.gateway.port}"

    def _banner(self) -> None:
        assert self.state is not None
        tidal = demo.tidal_command()
        self.out(
            f"tidal: cluster up: {len(self.children)} service processes on {redact(self.state.nats_url)}\n"
            f"  gateway:  {self.gateway_url} (OpenAI API)\n"
            f"  logs:     {self.logs_dir}/\n"
            + (f"  scheduler credentials: {self.scheduler_credentials} (NATS user `scheduler`: worker.ctl)\n"
               if self.scheduler_credentials else "") +
            f"  status:   {tidal} status{self._config_flag()}\n"
            f"  stop:     Ctrl-C here, or `{tidal} down{self._config_flag()}` from another shell"
        )

    async def _show_usage(self) -> None:
        """Once the gateway serves (a worker is ready behind it): how to call it."""
        if self.services is not None and "gateway" not in self.services:
            return
        if await demo.wait_until_serving(self.gateway_url, self.wait_s, self._stop):
            self.out(f"tidal: ready: {self.gateway_url} serves\n{demo.usage_banner(self.cfg, self.gateway_url)}")
        elif not self._stop.is_set():
            self.out(f"tidal: {self.gateway_url}/ready did not answer 200 within {self.wait_s:.0f}s; "
                     f"see {self.logs_dir}/gateway.log and the gpu_worker logs")

    def _config_flag(self) -> str:
        return f" --config {self.config_path}" if self.config_path else ""

    # --- supervision ----------------------------------------------------------------------
    async def _supervise(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for child in self.children:
                code = child.exited()
                if code is not None and child.restart_at is None and not child.gave_up:
                    delay = self.policy.crashed(child.spec.label, now, now - child.started)
                    if delay is None:
                        child.gave_up = True
                        self.out(f"tidal: {child.spec.label} exited with code {code}; it crashed too often, "
                                 f"leaving it down (log: {child.spec.log_path})")
                    else:
                        child.restart_at = now + delay
                        self.out(f"tidal: {child.spec.label} exited with code {code}; restarting in {delay:.0f}s "
                                 f"(log: {child.spec.log_path})")
                elif child.restart_at is not None and now >= child.restart_at:
                    child.start()
                    self._save()
                    self.out(f"tidal: {child.spec.label} restarted as {child.instance} (pid {child.proc.pid})")  # type: ignore[union-attr]
            await self._watch_nats(now)
            try:
                await asyncio.wait_for(self._stop.wait(), 0.2)
            except asyncio.TimeoutError:
                pass

    async def _watch_nats(self, now: float) -> None:
        if self.nats is None or self.nats.proc is None or self.nats.proc.poll() is None:
            return
        delay = self.policy.crashed("nats", now, 0.0)
        self.out(f"tidal: nats-server exited with code {self.nats.proc.returncode}; see {self.logs_dir / 'nats.log'}")
        if delay is None:
            self.out("tidal: nats-server keeps dying; stopping the cluster")
            self._stop.set()
            return
        await asyncio.sleep(delay)
        await asyncio.to_thread(self.nats.start)
        self.nats_info = self._nats_process_info()
        self._save()
        self.out(f"tidal: nats-server restarted on {self.nats.url}")

    # --- stop -----------------------------------------------------------------------------
    async def _stop_all(self) -> None:
        running = [c for c in self.children if c.proc is not None and c.exited() is None]
        waves = [[c for c in running if c.spec.name != "registry"], [c for c in running if c.spec.name == "registry"]]
        if running:
            self.out("tidal: stopping services (SIGTERM, then their drain deadline)")
        for wave in waves:
            if wave:
                grace = max(c.spec.drain_timeout_s for c in wave) + STOP_GRACE_S
                await asyncio.to_thread(stop_recorded, [c.info() for c in wave], grace_s=grace, hurry=self._hurry)
                for child in wave:
                    child.exited()  # reap
        if self.bus is not None:
            await self.bus.close()
        if self.nats is not None and self.nats_info is not None:
            await asyncio.to_thread(stop_recorded, [self.nats_info], grace_s=10.0, hurry=self._hurry)
            if self.nats.proc is not None:
                self.nats.proc.poll()
        left = [p for p in self._recorded() if recorded_alive(p)]
        if left:
            self.out("tidal: still running after stop: " + ", ".join(f"{p.name} pid {p.pid}" for p in left))
        else:
            self.out("tidal: stopped; no process left")
        remove_state(self.data_dir, launcher_pid=os.getpid())

    # --- state file -----------------------------------------------------------------------
    def _nats_process_info(self) -> ProcessInfo:
        assert self.nats is not None and self.nats.proc is not None
        pid = self.nats.proc.pid
        return ProcessInfo(name="nats", instance="", kind="nats", pid=pid, pgid=pid, create_time=create_time(pid),
                           log=str(self.logs_dir / "nats.log"))

    def _recorded(self) -> list[ProcessInfo]:
        procs = [c.info() for c in self.children if c.proc is not None]
        return procs + ([self.nats_info] if self.nats_info else [])

    def _save(self) -> None:
        if self.state is not None:
            self.state.processes = self._recorded()
            write_state(self.state)
