"""`poise up`'s supervision: restarts with back-off, gives up after repeated crashes, leaves retired workers;
its processes end with it, however it ends."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from services.cli.supervise import RestartPolicy, Supervisor
from shared.devservers import ManagedProcess


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _exited(proc: ManagedProcess) -> None:
    proc.proc.wait(30)


def test_a_crashed_process_is_restarted_with_back_off_then_given_up(tmp_path: Path) -> None:
    clock, said = _Clock(), []
    crasher = ManagedProcess("planner", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "planner.log")
    sup = Supervisor([crasher], RestartPolicy(backoff_s=1, backoff_max_s=4, max_crashes=3, window_s=100),
                     say=said.append, clock=clock)
    delays = []
    for _ in range(3):
        _exited(crasher)
        assert sup.poll() is None and "exited with code 3" in said[-1]
        starts = crasher.starts
        waited = 0.0
        while crasher.starts == starts:  # not before its back-off
            clock.now += 0.5
            waited += 0.5
            assert sup.poll() is None
        delays.append(waited)
    assert delays == [1.0, 2.0, 4.0] and sup.restarts == 3
    _exited(crasher)
    reason = sup.poll()
    assert reason is not None and "planner exited 4 times within 100s" in reason and "last exit code 3" in reason
    assert "--- restart 3 of planner" in (tmp_path / "planner.log").read_text()


def test_crashes_outside_the_window_are_forgiven_and_retired_workers_stay_down(tmp_path: Path) -> None:
    clock = _Clock()
    crasher = ManagedProcess("gateway", [sys.executable, "-c", "raise SystemExit(1)"], tmp_path / "g.log")
    retired = ManagedProcess("worker-d1", [sys.executable, "-c", "pass"], tmp_path / "w.log")
    sup = Supervisor([crasher, retired], RestartPolicy(backoff_s=1, max_crashes=1, window_s=10), clock=clock)
    for _ in range(4):  # one crash per 20 s never reaches two within 10 s
        _exited(crasher)
        _exited(retired)
        assert sup.poll() is None
        clock.now += 20
        assert sup.poll() is None
    assert crasher.starts == 5 and retired.starts == 1  # exit 0 of a worker: scaled in on purpose


def test_children_end_with_a_launcher_that_is_killed(tmp_path: Path) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from shared.devservers import ManagedProcess; "
        f"p = ManagedProcess('child', ['sleep', '300'], Path({str(tmp_path / 'c.log')!r})); "
        "print(p.proc.pid, flush=True); time.sleep(300)")], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    child = int(launcher.stdout.readline())
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(10)
    deadline = time.monotonic() + 10
    while _running(child):
        assert time.monotonic() < deadline, "the child outlived its launcher"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # exited, waiting for init to reap it

