"""Carrying a rendered deployment out: ssh + ``docker compose`` on every node, control-plane node first.

For each node with containers: copy its rendered directory (a tar.gz on ssh's stdin, unpacked into
``<remote_dir>/<name>``), ``docker compose pull``, then ``docker compose up -d --remove-orphans``. Nothing
runs before :func:`preflight` passes: ``ssh`` must be on PATH and no node may have a placeholder address
(the example inventory's RFC 5737 addresses), so the example can never be applied by mistake.

Not run here: these machines have no GPU nodes, no docker engine and no network; the tests check the steps
with a recording runner.
"""

from __future__ import annotations

import io
import shlex
import shutil
import subprocess
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.deploy.inventory import is_placeholder_address
from services.deploy.render import Plan
from shared.errors import PoiseError

SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10")


class ApplyError(PoiseError):
    """The deployment could not be applied (refused before starting, or a step failed)."""


@dataclass(frozen=True)
class Step:
    node: str
    argv: tuple[str, ...]
    upload: Path | None = None  # a local directory sent as a tar.gz on the command's stdin

    def display(self) -> str:
        text = shlex.join(self.argv)
        return text + (f"  < tar.gz of {self.upload}/" if self.upload is not None else "")


Runner = Callable[[Step, bytes | None], int]


def apply_steps(plan: Plan, out_dir: Path) -> list[Step]:
    """Every command apply runs, in order (nodes without containers are left alone)."""
    remote = plan.remote_dir()
    compose = f"docker compose -p {shlex.quote(plan.inventory.name)} -f {shlex.quote(remote + '/docker-compose.yml')}"
    steps: list[Step] = []
    for node in plan.nodes:
        if not node.containers:
            continue
        ssh = ("ssh", *SSH_OPTIONS, node.node.ssh_target)
        steps += [
            Step(node.node.name, (*ssh, f"mkdir -p {shlex.quote(remote)} && tar -xzf - -C {shlex.quote(remote)}"),
                 upload=out_dir / node.node.name),
            Step(node.node.name, (*ssh, f"{compose} pull")),
            Step(node.node.name, (*ssh, f"{compose} up -d --remove-orphans")),
        ]
    return steps


def preflight(plan: Plan, which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """Why apply must not start (empty when it may)."""
    problems = []
    if which("ssh") is None:
        problems.append("ssh is not on PATH: apply runs `ssh <node> docker compose ...` for every node")
    for node in plan.nodes:
        hosts = dict.fromkeys((node.node.address, node.node.ssh_target.rsplit("@", 1)[-1]))  # once when the same
        bad = [h for h in hosts if is_placeholder_address(h)]
        if bad:
            problems.append(f"node {node.node.name}: {' / '.join(bad)} is a documentation placeholder "
                            f"(RFC 5737 / .example): put your nodes' real addresses in the inventory")
    return problems


def pack(directory: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(directory.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(directory)), recursive=False)
    return buf.getvalue()


def run_step(step: Step, stdin: bytes | None) -> int:
    return subprocess.run(step.argv, input=stdin, check=False).returncode


def apply(plan: Plan, out_dir: Path, *, runner: Runner = run_step,
          which: Callable[[str], str | None] = shutil.which, echo: Callable[[str], None] = print) -> None:
    problems = preflight(plan, which)
    if problems:
        raise ApplyError("refusing to apply; nothing was changed on any node:\n" + "\n".join(f"  - {p}" for p in problems))
    for step in apply_steps(plan, out_dir):
        echo(f"[{step.node}] $ {step.display()}")
        rc = runner(step, pack(step.upload) if step.upload is not None else None)
        if rc != 0:
            raise ApplyError(f"[{step.node}] exited {rc}: {step.display()}\n"
                             f"  the nodes before {step.node} were updated; fix the cause and run apply again "
                             f"(it is idempotent: compose only recreates containers whose definition changed)")
