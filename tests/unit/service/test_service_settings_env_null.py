"""The environment's ``null``: every router setting whose type takes None (a documented
"`null`: no bound / off / derived") can be set to None from its variable, as a config
file's ``null`` does; Kubernetes operators configure by environment only. The settings
are enumerated from the model, so a new optional setting is covered without a test of
its own."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from kvhint.router.service.settings import ENV_NULL, ENV_PREFIX, RouterSettings

# The served-model key used for model_prompts.<model>.* (the variable's segment).
_MODEL = "m"


def _takes_none(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def _model(annotation: Any) -> type[BaseModel] | None:
    """``X`` or ``X | None`` where X is a pydantic model -> X (not a list's entry)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for candidate in (annotation, *(typing.get_args(annotation) if union else ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _optional_settings(fields: dict[str, FieldInfo], variable: str,
                       path: tuple[str, ...]) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(variable, attribute path) of each setting under ``fields`` that takes None and
    that a variable of its own reaches: top-level ones, the sections' (``routing`` ...),
    and ``model_prompts.<model>``'s (dict entries, through the nested delimiter). A
    list's entries (``tenants``) have no variables of their own: their parent's JSON
    says null as JSON does."""
    for name, field in fields.items():
        var, at = f"{variable}{name.upper()}", (*path, name)
        if _takes_none(field.annotation):
            yield var, at
        origin, args = typing.get_origin(field.annotation), typing.get_args(field.annotation)
        if (section := _model(field.annotation)) is not None:
            yield from _optional_settings(section.model_fields, var + "__", at)
        elif origin is dict and (entry := _model(args[1])) is not None:
            yield from _optional_settings(entry.model_fields, f"{var}__{_MODEL.upper()}__",
                                          (*at, _MODEL))


OPTIONAL = list(_optional_settings(RouterSettings.model_fields, ENV_PREFIX, ()))


def _value(settings: RouterSettings, path: tuple[str, ...]) -> Any:
    value: Any = settings
    for step in path:
        value = value[step] if isinstance(value, dict) else getattr(value, step)
    return value


def test_the_enumeration_finds_the_documented_optional_settings() -> None:
    found = {".".join(path) for _, path in OPTIONAL}
    assert {"stream_event_max_bytes", "upstream_answer_max_bytes", "trace_max_bytes",
            "http_max_concurrency", "config_file", "tokenizer", "metrics_token",
            "routing.session_refresh", "responses.background_idle_s",
            f"model_prompts.{_MODEL}.chat_template"} <= found


@pytest.mark.parametrize(("variable", "path"), OPTIONAL, ids=[v for v, _ in OPTIONAL])
def test_every_optional_setting_takes_null_from_its_variable(
        variable: str, path: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, ENV_NULL)
    assert _value(RouterSettings(), path) is None


def test_null_in_the_environment_wins_over_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "router.yaml"
    config.write_text("stream_event_max_bytes: 1000\nrouting: {session_refresh: true}\n")
    monkeypatch.setenv("KVHINT_ROUTER_STREAM_EVENT_MAX_BYTES", "null")
    monkeypatch.setenv("KVHINT_ROUTER_ROUTING__SESSION_REFRESH", "null")
    settings = RouterSettings(config_file=config)
    assert settings.stream_event_max_bytes is None
    assert settings.routing.session_refresh is None


@pytest.mark.parametrize(("variable", "value", "setting"), [
    # Garbage is refused as before, naming the setting.
    ("KVHINT_ROUTER_STREAM_EVENT_MAX_BYTES", "lots", "stream_event_max_bytes"),
    ("KVHINT_ROUTER_RESPONSES__BACKGROUND_IDLE_S", "never", "responses.background_idle_s"),
    # Only the exact spelling is None; "None" is not a number.
    ("KVHINT_ROUTER_UPSTREAM_ANSWER_MAX_BYTES", "None", "upstream_answer_max_bytes"),
    # An empty variable is not null: a number setting refuses it (an empty Secret or
    # a templating slip should not lift a bound silently).
    ("KVHINT_ROUTER_STREAM_EVENT_MAX_BYTES", "", "stream_event_max_bytes"),
    # Path("") would be the working directory: recording on where off was meant.
    ("KVHINT_ROUTER_TRACE_DIR", "", "trace_dir"),
    # A setting that takes no None refuses null, naming itself.
    ("KVHINT_ROUTER_PORT", "null", "port"),
    ("KVHINT_ROUTER_ROUTING__MAX_N", "null", "routing.max_n"),
])
def test_garbage_and_null_where_none_is_not_allowed_are_refused_by_name(
        variable: str, value: str, setting: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as caught:
        RouterSettings()
    assert [".".join(map(str, e["loc"])) for e in caught.value.errors()] == [setting]
