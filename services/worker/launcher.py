"""How the sidecar starts an engine: the command line (a pure function) and the child process.

:func:`build_engine_command` turns :class:`WorkerSettings` into argv for engine_sim or SGLang (``None`` for
``attach``); it is unit-tested and does no I/O. :class:`EngineProcess` runs that argv as a child in its own
session with output appended to a log file, and stops it with SIGTERM, then SIGKILL.

SGLang is pinned: :data:`SUPPORTED_SGLANG_VERSIONS` are the versions whose source the command line
(:data:`SGLANG_OPTIONS`) and the HTTP API Poise uses were checked against. :func:`installed_sglang_version`
asks the engine's own interpreter which sglang it has (Poise never imports sglang) and
:func:`check_sglang_version` refuses any other with a clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from services.worker.config import SGLANG_DEFAULT_BOOTSTRAP_PORT, WorkerSettings
from shared.engine.chunking import role_chunk_tokens
from shared.errors import ConfigError
from shared.protocol.messages import Role
from shared.security import without_secrets

log = logging.getLogger(__name__)


def _pd_mode(role: Role | None) -> bool:
    return role in ("prefill", "decode")


def build_engine_command(settings: WorkerSettings, *, python: str = sys.executable,
                         role: Role | None = None) -> list[str] | None:
    """The engine's argv, or ``None`` when the sidecar attaches to a running engine.

    ``role`` overrides ``settings.role`` (a restart after a role switch relaunches in the current role).
    Ports must already be concrete (see :func:`resolve_ports`).
    """
    if settings.engine_kind == "attach":
        return None
    role = role or settings.role
    if role is None:
        raise ValueError(f"engine_kind={settings.engine_kind} needs a role")
    if settings.engine_port == 0 or (_pd_mode(role) and not settings.bootstrap_port):
        raise ValueError("resolve ports before building the engine command (engine_port/bootstrap_port unset or 0)")
    if settings.engine_kind == "sim":
        return _sim_command(settings, python, role)
    return _sglang_command(settings, python, role)


def _sim_command(s: WorkerSettings, python: str, role: Role) -> list[str]:
    cmd = [python, "-m", "services.engine_sim",
           "--host", s.engine_host, "--port", str(s.engine_port), "--mode", role]
    if _pd_mode(role):
        cmd += ["--bootstrap-port", str(s.bootstrap_port)]
    if s.model:
        cmd += ["--served-model-name", s.model]
    cmd += ["--profile", s.profile, "--time-scale", repr(s.time_scale), "--seed", str(s.seed),
            "--instance-id", s.instance_id, "--enable-pd-role-switch", "--enable-cache-report"]
    return cmd + role_extra_args(s.extra_args, role)


#: SGLang versions this launcher (flags) and Poise's engine client (HTTP API) were checked against, from the
#: wheel's source (sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl); never run on a GPU here.
SUPPORTED_SGLANG_VERSIONS: tuple[str, ...] = ("0.5.23",)

#: Every ``sglang.launch_server`` option the sglang command line can contain, with where SGLang 0.5.23 defines
#: it (paths inside the wheel). ``ServerArgs`` registers each annotated field of ``arg_groups/fields/*.py`` as
#: ``--field-name`` (``arg_groups/arg_utils.py`` add_cli_args_from_dataclass: ``bool`` fields are store_true
#: flags without a value, ``Literal`` fields take one of their values). tests/contract/fixtures/sglang-0.5.23/
#: cli_flags.json is generated from the same source, and the unit tests check every emitted option against it.
#: The parser keeps argparse's allow_abbrev (server_args.py prepare_server_args), so full names only: ``--tp``
#: works in 0.5.23 only as an abbreviation of ``--tp-size``.
SGLANG_OPTIONS: dict[str, str] = {
    "--model-path": "sglang/srt/arg_groups/fields/model.py:51",
    "--served-model-name": "sglang/srt/arg_groups/fields/serving.py:168",
    "--host": "sglang/srt/arg_groups/fields/serving.py:65",
    "--port": "sglang/srt/arg_groups/fields/serving.py:66",
    "--tp-size": "sglang/srt/arg_groups/fields/parallel.py:45",
    "--mem-fraction-static": "sglang/srt/arg_groups/fields/schedule.py:27",
    "--max-running-requests": "sglang/srt/arg_groups/fields/schedule.py:31",
    "--disaggregation-mode": "sglang/srt/arg_groups/fields/disagg.py:55",  # Literal null|prefill|decode
    "--disaggregation-bootstrap-port": "sglang/srt/arg_groups/fields/disagg.py:81",  # int, default 8998
    "--disaggregation-transfer-backend": "sglang/srt/arg_groups/fields/disagg.py:65",  # choices.py:122
    "--disaggregation-ib-device": "sglang/srt/arg_groups/fields/disagg.py:84",
    "--enable-pd-role-switch": "sglang/srt/arg_groups/fields/disagg.py:121",  # store_true
    "--enable-metrics": "sglang/srt/arg_groups/fields/observability.py:70",  # store_true
    # store_true: the usage carries prompt_tokens_details.cached_tokens, which the gateway's events pass to the
    # planner (prefill planned on uncached tokens: docs/prefix-cache.md)
    "--enable-cache-report": "sglang/srt/arg_groups/fields/serving.py:196",
    "--enable-return-hidden-states": "sglang/srt/arg_groups/fields/exec_.py:112",  # store_true (= mode full)
    "--return-hidden-states-mode": "sglang/srt/arg_groups/fields/exec_.py:117",  # last|full
    "--api-key": "sglang/srt/arg_groups/fields/serving.py:160",
    "--device": "sglang/srt/arg_groups/fields/device.py:24",
    "--attention-backend": "sglang/srt/arg_groups/fields/exec_.py:207",
    "--max-total-tokens": "sglang/srt/arg_groups/fields/schedule.py:39",
    "--disable-overlap-schedule": "sglang/srt/arg_groups/fields/schedule.py:193",  # store_true
    "--sleep-on-idle": "sglang/srt/arg_groups/fields/device.py:74",  # store_true
    "--disaggregation-decode-retraction-backup": "sglang/srt/arg_groups/fields/disagg.py:95",
}


def _sglang_command(s: WorkerSettings, python: str, role: Role) -> list[str]:
    assert s.model_path is not None  # WorkerSettings guarantees it for sglang
    python = s.sglang_python or python
    # ``python -m sglang.launch_server`` still works in 0.5.23 (it warns that ``sglang serve`` is preferred;
    # sglang/launch_server.py); both parse argv with server_args.prepare_server_args.
    cmd = [python, "-m", "sglang.launch_server", "--model-path", s.model_path]
    if s.model:
        cmd += ["--served-model-name", s.model]
    cmd += ["--host", s.engine_host, "--port", str(s.engine_port), "--tp-size", str(s.tp)]
    for flag, value in (("--device", s.device), ("--attention-backend", s.attention_backend),
                        ("--max-total-tokens", s.max_total_tokens)):
        if value is not None:
            cmd += [flag, str(value)]
    if s.disable_overlap_schedule:
        cmd += ["--disable-overlap-schedule"]
    if s.sleep_on_idle:
        cmd += ["--sleep-on-idle"]
    if s.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", repr(s.mem_fraction_static)]
    cap = s.sglang_request_cap
    if cap is not None and not any(a.partition("=")[0] == "--max-running-requests" for a in s.extra_args):
        cmd += ["--max-running-requests", str(cap)]
    if _pd_mode(role):  # colocated ("null") is SGLang's default mode: no disaggregation flags
        cmd += ["--disaggregation-mode", role,
                "--disaggregation-bootstrap-port", str(s.bootstrap_port),
                "--disaggregation-transfer-backend", s.transfer_backend]
        if s.ib_device:
            cmd += ["--disaggregation-ib-device", s.ib_device]
        if s.sglang_role_switch:
            cmd += ["--enable-pd-role-switch"]
        if s.decode_retraction_backup is not None:
            cmd += ["--disaggregation-decode-retraction-backup", s.decode_retraction_backup]
    if s.return_hidden_states == "full":
        cmd += ["--enable-return-hidden-states"]
    elif s.return_hidden_states == "last":
        cmd += ["--return-hidden-states-mode", "last"]
    cmd += ["--enable-metrics", "--enable-cache-report"]
    if s.engine_api_key:  # SGLang reads it from its command line only (so it shows in ps on the engine's host)
        # One token: argparse takes a separate value that starts with "-" (a random key may) for an option.
        cmd += [f"--api-key={s.engine_api_key}"]
    return cmd + role_extra_args(s.extra_args, role)


def role_extra_args(extra_args: Sequence[str], role: Role) -> list[str]:
    """``extra_args`` as an engine of ``role`` gets them: a ``--chunked-prefill-size`` the role does not run
    with (``shared.engine.chunking``: a colocated engine keeps its default chunk) is dropped."""
    out = list(extra_args)
    kept: list[str] = []
    i = 0
    while i < len(out):
        flag, _, inline = out[i].partition("=")
        if flag == "--chunked-prefill-size":
            value = inline if inline else (out[i + 1] if i + 1 < len(out) else "")
            step = 1 if inline else 2
            if value.lstrip("-").isdigit() and role_chunk_tokens(int(value), role) is None:
                i += step
                continue
        kept.append(out[i])
        i += 1
    return kept


def engine_environment(settings: WorkerSettings) -> dict[str, str]:
    """What the spawned engine gets in its environment on top of the sidecar's (less the sidecar's secrets):
    ``engine_env``, and engine_sim's API key (SGLang takes its key as a flag, :func:`build_engine_command`)."""
    env = dict(settings.engine_env)
    if settings.engine_api_key and settings.engine_kind == "sim":
        env["POISE_ENGINE_SIM_API_KEY"] = settings.engine_api_key
    return env


class SglangVersionError(ConfigError):
    """The engine's environment has no sglang, or one this worker was not checked against."""


# importlib.metadata answers without importing sglang (whose __init__ loads transformers and torch: seconds);
# the import is the fallback for a source checkout without package metadata.
_VERSION_PROBE = (
    "import importlib.metadata as m\n"
    "try:\n"
    "    print(m.version('sglang'))\n"
    "except m.PackageNotFoundError:\n"
    "    import sglang\n"
    "    print(sglang.__version__)\n"
)


async def installed_sglang_version(python: str, *, env: dict[str, str] | None = None, timeout_s: float = 120.0) -> str:
    """The sglang version in the environment of ``python`` (run as a child process; never imported here)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            python, "-c", _VERSION_PROBE, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, **(env or {})},
        )
    except OSError as exc:
        raise SglangVersionError(f"cannot run the SGLang interpreter {python!r}: {exc}") from exc
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise SglangVersionError(f"{python} did not report its sglang version within {timeout_s:.0f}s") from None
    lines = out.decode(errors="replace").strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join(err.decode(errors="replace").strip().splitlines()[-5:])
        raise SglangVersionError(f"sglang is not importable with {python} (exit {proc.returncode}): {tail or 'no output'}")
    return lines[-1].strip()


def check_sglang_version(version: str, python: str, *, allow_unpinned: bool = False) -> None:
    """Raise :class:`SglangVersionError` unless ``version`` is pinned (a local ``+cu130`` suffix is ignored)."""
    if version.split("+", 1)[0] in SUPPORTED_SGLANG_VERSIONS:
        return
    message = (f"{python} has sglang {version}, but this worker supports sglang "
               f"{' / '.join(SUPPORTED_SGLANG_VERSIONS)} only: its launch flags and Poise's use of the HTTP API were "
               f"checked against that version's source. Install sglang=={SUPPORTED_SGLANG_VERSIONS[-1]} in the "
               "engine's environment (or point sglang_python at one that has it), or set sglang_allow_unpinned "
               "to launch anyway")
    if not allow_unpinned:
        raise SglangVersionError(message)
    log.warning("%s (sglang_allow_unpinned is set: launching)", message)


def resolve_ports(settings: WorkerSettings, free_port: Callable[[str], int]) -> WorkerSettings:
    """Make the ports of a spawned engine concrete: 0 means a free port on ``engine_host``; an unset bootstrap
    port means SGLang's default 8998 for sglang and a free port for sim. ``attach`` is left as it is."""
    if settings.engine_kind == "attach":
        return settings
    update: dict[str, int] = {}
    if settings.engine_port == 0:
        update["engine_port"] = free_port(settings.engine_host)
    if settings.bootstrap_port == 0 or (settings.bootstrap_port is None and settings.engine_kind == "sim"):
        update["bootstrap_port"] = free_port(settings.engine_host)
    elif settings.bootstrap_port is None:
        update["bootstrap_port"] = SGLANG_DEFAULT_BOOTSTRAP_PORT
    return settings.model_copy(update=update) if update else settings


def reclaim_ports(requested: WorkerSettings, current: WorkerSettings, available: Callable[[str, int], bool],
                  free_port: Callable[[str], int]) -> WorkerSettings:
    """Pick again, before a launch, each port :func:`resolve_ports` picked that no longer binds: between the pick
    and the engine's bind any process on the host may take it (as the local end of an outbound connection,
    most often, since free ports come from the ephemeral range). Ports the operator set are left alone: a
    clash there is theirs to see in the engine log."""
    if current.engine_kind == "attach":
        return current
    host = current.engine_host
    update: dict[str, int] = {}
    if requested.engine_port == 0 and not available(host, current.engine_port):
        update["engine_port"] = free_port(host)
    auto_bootstrap = requested.bootstrap_port == 0 or (requested.bootstrap_port is None and requested.engine_kind == "sim")
    if auto_bootstrap and current.bootstrap_port and not available(host, current.bootstrap_port):
        update["bootstrap_port"] = free_port(host)
    return current.model_copy(update=update) if update else current


def signal_group(pid: int, sig: signal.Signals) -> bool:
    """Signal the process group ``pid`` leads: the engine runs in its own session and SGLang spawns scheduler
    and detokenizer children. False when that is not permitted (the caller may signal the process alone)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        return False
    return True


class EngineProcess:
    """One run of the engine as a child process (its own session, so a terminal's Ctrl-C reaches only us)."""

    def __init__(self, argv: list[str], log_path: Path, *, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.log_path = log_path
        self._env = env
        self._proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    def _open_log(self) -> IO[bytes]:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        log_file.write(f"--- starting: {' '.join(self.argv)}\n".encode())
        log_file.flush()
        return log_file

    async def start(self) -> None:
        self._log = self._open_log()  # a local file append: not worth a thread
        env = {**without_secrets(dict(os.environ)), **(self._env or {}), "PYTHONUNBUFFERED": "1"}  # no NATS/etcd passwords
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=self._log, stderr=asyncio.subprocess.STDOUT,
            env=env, start_new_session=True,
        )
        log.info("engine started (pid %d), log %s", self._proc.pid, self.log_path)

    async def wait(self) -> int:
        """Wait for the process to exit and return its exit code."""
        assert self._proc is not None
        return await self._proc.wait()

    def _running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def _send(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        if not signal_group(self._proc.pid, sig):
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(sig)

    async def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM the engine's process group, SIGKILL it after ``timeout_s``; idempotent."""
        if self._running():
            self._send(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.wait(), timeout_s)
            except TimeoutError:
                log.warning("engine pid %s ignored SIGTERM for %.0fs; killing it", self.pid, timeout_s)
                self._send(signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wait(), 5)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.returncode

    def tail(self, lines: int = 20) -> str:
        """The last lines of the engine's log (for error messages)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
