"""The settings of every process as JSON Schema files in ``deploy/schemas/`` (what deployments validate
against and what the docs list). ``python -m services.cli.schemas`` rewrites them; a test fails when they
are out of date, so a new field cannot ship undocumented."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic_settings import BaseSettings

from services.cli.main import BenchSettings, GoodputSettings, SimSettings
from services.cli.run_job import MainJobSettings
from services.cli.stack import StackSettings
from services.engine_sim.config import EngineSimSettings
from services.gateway.config import GatewaySettings
from services.migrator.config import MigratorSettings
from services.monitor.config import MonitorSettings
from services.planner.config import PlannerSettings
from services.worker.config import WorkerSettings

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "deploy" / "schemas"

SETTINGS: dict[str, type[BaseSettings]] = {
    "gateway": GatewaySettings,
    "worker": WorkerSettings,
    "monitor": MonitorSettings,
    "planner": PlannerSettings,
    "migrator": MigratorSettings,
    "engine_sim": EngineSimSettings,
    "stack": StackSettings,
    "run": MainJobSettings,
    "bench": BenchSettings,
    "sim": SimSettings,
    "goodput": GoodputSettings,
}


def render(cls: type[BaseSettings]) -> str:
    schema = cls.model_json_schema()
    schema["x-env-prefix"] = cls.model_config.get("env_prefix", "")
    return json.dumps(schema, indent=2, sort_keys=True, default=str) + "\n"


def main() -> None:
    SCHEMA_DIR.mkdir(parents=True, exist_ok=True)
    for name, cls in SETTINGS.items():
        (SCHEMA_DIR / f"{name}.json").write_text(render(cls))
    print(f"wrote {len(SETTINGS)} schemas to {SCHEMA_DIR}")


if __name__ == "__main__":
    main()
