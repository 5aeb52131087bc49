"""``python -m services.deploy render|plan|apply --inventory FILE [--out DIR]``

- ``render``: write every node's files under ``DIR/<node>/`` (and ``DIR/plan.txt``); apply nothing.
- ``plan``: the same, and print the plan: every node, every container with its full command line (and the
  SGLang command each sidecar launches), ports, GPUs, environment, and the commands apply would run.
  ``make deploy DRY_RUN=1`` runs this.
- ``apply``: render, print the plan, then ssh to every node (control plane first) and ``docker compose up -d``.
- ``secrets``: add random values for every secret a deployment needs to a ``.env`` file (kept 0600; values
  already there stay). With ``--inventory``: that deployment's; without: deploy/docker-compose.yml's
  (``python -m services.deploy secrets --out deploy/.env``).

render/plan/apply read the secrets from ``--secrets`` (default ``<out>/secrets.env``, created with random
values on first use) and give each node a ``.env`` with the ones its containers use.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from services.deploy import secrets
from services.deploy.apply import ApplyError, apply, apply_steps
from services.deploy.inventory import load_inventory
from services.deploy.render import Assets, Rendering, build_plan, format_plan, render
from shared.errors import ConfigError

REPO_DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DEFAULT_OUT = Path(".poise/deploy")
COMPOSE_NAMESPACE = "default"  # deploy/docker-compose.yml: poise up's defaults
COMPOSE_WORKERS = ("p0", "p1", "d0", "d1")


def load_assets(deploy_dir: Path = REPO_DEPLOY) -> Assets:
    try:
        return Assets(
            dashboard_json=(deploy_dir / "grafana" / "dashboards" / "poise.json").read_text(),
            dashboard_provider_yaml=(deploy_dir / "grafana" / "provisioning" / "dashboards" / "poise.yml").read_text())
    except OSError as exc:
        raise ConfigError(f"Grafana files not found under {deploy_dir} ({exc.strerror}); run from the repository "
                          "or pass --assets-dir") from None


def write(rendering: Rendering, out_dir: Path, plan_text: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for rel, text in rendering.files.items():
        path = out_dir / rel
        if path.name == ".env":  # secrets: this user only
            secrets.write_private(path, text)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (out_dir / "plan.txt").write_text(plan_text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.deploy", description=__doc__.splitlines()[0] if __doc__ else None,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["render", "plan", "apply", "secrets"])
    parser.add_argument("--inventory", type=Path, default=None, help="inventory YAML (deploy/inventory.example.yaml)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"output directory (default {DEFAULT_OUT}/<name>); for secrets: the .env file to write")
    parser.add_argument("--assets-dir", type=Path, default=REPO_DEPLOY, help="where grafana/ is (default: the repo's deploy/)")
    parser.add_argument("--secrets", type=Path, default=None,
                        help="the deployment's secrets (.env format; default <out>/secrets.env, made on first use)")
    args = parser.parse_args(argv)
    if args.command == "secrets":
        return _secrets(args)
    if args.inventory is None:
        parser.error(f"{args.command} needs --inventory")
    try:
        inventory = load_inventory(args.inventory)
        plan = build_plan(inventory, str(args.inventory))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out_dir: Path = args.out or DEFAULT_OUT / inventory.name
    secrets_file: Path = args.secrets or out_dir / "secrets.env"
    values = secrets.ensure_secrets(secrets_file, secrets.all_variables(
        inventory.namespace, [c.name.removeprefix("worker-") for c in plan.engines]))
    try:
        rendering = render(inventory, load_assets(args.assets_dir), source=str(args.inventory), secret_values=values)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    steps = apply_steps(rendering.plan, out_dir)
    plan_text = format_plan(rendering.plan, [f"[{s.node}] {s.display()}" for s in steps])
    write(rendering, out_dir, plan_text)
    if args.command == "render":
        print(f"wrote {len(rendering.files) + 1} files to {out_dir}/ (plan in {out_dir / 'plan.txt'}); nothing applied")
        return 0
    print(plan_text, end="")
    if args.command == "plan":
        print(f"\ndry run: wrote {len(rendering.files) + 1} files to {out_dir}/; nothing applied")
        return 0
    try:
        apply(rendering.plan, out_dir)
    except ApplyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    ctrl = inventory.control_node
    print(f"\napplied. Check it: curl http://{ctrl.address}:{inventory.ports.gateway}/health ; "
          f"poise admin --nats-url nats://{ctrl.address}:{inventory.ports.nats} --namespace {inventory.namespace} status")
    return 0


def _secrets(args: argparse.Namespace) -> int:
    if args.out is None:
        print("error: secrets needs --out FILE (deploy/.env for deploy/docker-compose.yml)", file=sys.stderr)
        return 2
    if args.inventory is not None:
        try:
            inventory = load_inventory(args.inventory)
            plan = build_plan(inventory, str(args.inventory))
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        namespace, workers = inventory.namespace, [c.name.removeprefix("worker-") for c in plan.engines]
    else:
        namespace, workers = COMPOSE_NAMESPACE, list(COMPOSE_WORKERS)
    before = secrets.read_env_file(args.out) if args.out.exists() else {}
    values = secrets.ensure_secrets(args.out, secrets.all_variables(namespace, workers))
    print(f"{args.out}: {len(values) - len(before)} secrets added, {len(before)} kept (mode 0600; never commit it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
