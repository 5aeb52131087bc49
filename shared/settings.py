"""Typed settings: one pydantic-settings model per service, read from ``POISE_<SVC>_*`` env vars and flags.

Each service defines ``class XSettings(ServiceSettings)`` in ``services/<svc>/config.py`` with
``model_config = settings_config("POISE_X_")``. :func:`parse_settings` adds a ``--flag`` for every field
(``kv_capacity`` → ``--kv-capacity``) whose help is the field's description, so the CLI, the env and the
docs cannot drift apart. Precedence: flags > env > defaults. Lists and dicts are JSON on the command line, as
in the env; a ``list[str]`` flag may also be repeated, one item each (``--slo-class a=1:2 --slo-class b=3:4``).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, get_args, get_origin

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.errors import ConfigError

S = TypeVar("S", bound="ServiceSettings")


def settings_config(env_prefix: str) -> SettingsConfigDict:
    return SettingsConfigDict(env_prefix=env_prefix, extra="forbid", validate_default=True)


class ServiceSettings(BaseSettings):
    """Fields every Poise process has."""

    model_config = settings_config("POISE_")

    log_level: str = Field("INFO", description="Python logging level (DEBUG, INFO, WARNING, ERROR).")


class ControlPlaneSettings(ServiceSettings):
    """Fields of every process that talks to NATS and etcd."""

    namespace: str = Field("default", description="Poise namespace: prefixes every etcd key and NATS subject.")
    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma-separated.")
    etcd_url: str = Field("http://127.0.0.1:2379", description="etcd client URL (host:port of one member).")
    nats_user: str | None = Field(None, description="NATS user name, when the server requires auth (docs/security.md); a user:password@ in nats_url works too.")
    nats_password: str | None = Field(None, description="NATS password for nats_user (prefer the env var to the flag: flags show in ps).")
    etcd_user: str | None = Field(None, description="etcd user name, when etcd's auth is on; a user:password@ in etcd_url works too.")
    etcd_password: str | None = Field(None, description="etcd password for etcd_user (prefer the env var to the flag).")


class SloPlanSettings(ServiceSettings):
    """What SLO-aware policies plan with (gateway, planner): the SLO and the engines' latency profile.

    Defaults are Arrow's Table 1 SLO for Azure conversation and the built-in H100 profile, the same as the
    dev stack's engines; set them to your workload and hardware.
    """

    slo_ttft_s: float = Field(2.0, gt=0.0, description="TTFT SLO the policies plan for, in seconds.")
    slo_tpot_s: float = Field(0.15, gt=0.0, description="TPOT SLO the policies plan for, in seconds.")
    profile: str = Field("llama-3.1-8b-h100", description="Latency profile of the engines (their performance model).")

    def policy_context(self, max_instances: int = 1_000_000) -> Any:
        from shared.policies.context import PolicyContext

        return PolicyContext(ttft_slo_s=self.slo_ttft_s, tpot_slo_s=self.slo_tpot_s, max_instances=max_instances)

    def latency_model(self) -> Any:
        from shared.latency import LatencyModel, load_profile

        return LatencyModel(load_profile(self.profile))


def fill_unset(data: Any, defaults: Mapping[str, Any]) -> Any:
    """``data`` (a settings model's input before validation: flags and env merged) with ``defaults`` for every
    field left unset, so a flag or env var given wins over a default one setting implies; not a dict: as is."""
    if not isinstance(data, dict):
        return data
    merged = dict(data)
    for field, value in defaults.items():
        if merged.get(field) is None:
            merged[field] = value
    return merged


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    return get_origin(annotation) is not None and bool in get_args(annotation) and len(get_args(annotation)) <= 2


def _is_str_list(annotation: Any) -> bool:
    return get_origin(annotation) is list and get_args(annotation) == (str,)


def _str_list_items(values: list[str], flag: str, parser: argparse.ArgumentParser) -> list[str]:
    """Join the occurrences of a repeatable ``list[str]`` flag; one that looks like a JSON list is expanded.

    So ``--api-keys '["a", "b"]'`` means what it always meant, and ``--api-keys a --api-keys b`` is the same.
    """
    items: list[str] = []
    for value in values:
        if not value.lstrip().startswith("["):
            items.append(value)
            continue
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError as exc:
            parser.error(f"{flag}: expected a JSON list or one item ({exc})")
        if not isinstance(decoded, list):
            parser.error(f"{flag}: expected a JSON list or one item")
        items.extend(decoded)
    return items


def parse_settings(cls: type[S], argv: Sequence[str] | None = None, *, prog: str | None = None) -> S:
    """Build ``cls`` from env vars and command-line flags; exits with a clear message on bad input."""
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else None)
    for name, field in cls.model_fields.items():
        env = f"{cls.model_config.get('env_prefix', '')}{name.upper()}"
        default = field.get_default(call_default_factory=True)  # field.default is a placeholder with a factory
        help_text = f"{field.description or ''} [env {env}; default {default!r}]"
        if _is_bool(field.annotation):
            parser.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif _is_str_list(field.annotation):
            parser.add_argument(_flag(name), dest=name, action="append", default=None, help=help_text + " (repeatable)")
        else:
            parser.add_argument(_flag(name), dest=name, default=None, help=help_text)
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {}
    for name, value in vars(args).items():
        if value is None:
            continue
        field = cls.model_fields[name]
        if isinstance(value, list):  # a repeatable list[str] flag: argparse collected its occurrences
            value = _str_list_items(value, _flag(name), parser)
        # Lists and dicts come as JSON on the command line, like pydantic-settings reads them from env.
        if isinstance(value, str) and get_origin(field.annotation) in (list, dict):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                parser.error(f"{_flag(name)}: expected JSON ({exc})")
        overrides[name] = value
    try:
        return cls(**overrides)
    except ValidationError as exc:
        parser.error(str(exc))
    raise AssertionError("unreachable")


def load_settings(cls: type[S], **overrides: Any) -> S:
    """Build settings in code (tests, the stack launcher); bad values raise :class:`ConfigError`."""
    try:
        return cls(**overrides)
    except ValidationError as exc:
        raise ConfigError(str(exc)) from exc


def configure_logging(level: str, service: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
    )
    # One INFO line per HTTP call is noise at hundreds of requests per second (and costs CPU).
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
