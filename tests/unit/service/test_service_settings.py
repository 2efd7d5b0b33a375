from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvhint.router.service.settings import RouterSettings
from kvhint.router.service.tenancy import (
    DEFAULT_TENANT,
    AuthError,
    TenantDirectory,
    api_key_from_headers,
)


def test_env_names_used_by_kvhint_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVHINT_ROUTER_PORT", "8181")
    monkeypatch.setenv("KVHINT_ROUTER_WORKERS", "w0=http://127.0.0.1:8001, w1=http://h:9/")
    monkeypatch.setenv("KVHINT_ROUTER_NATS_URL", "nats://127.0.0.1:4333")
    monkeypatch.setenv("KVHINT_ROUTER_DATABASE_URL", "postgresql://u@h/db")
    settings = RouterSettings()
    assert settings.port == 8181
    assert [(w.id, w.url) for w in settings.workers] == [("w0", "http://127.0.0.1:8001"),
                                                          ("w1", "http://h:9")]
    assert settings.nats_url == "nats://127.0.0.1:4333"
    assert settings.database_url == "postgresql+psycopg://u@h/db"
    assert settings.dev_mode


def test_config_file_under_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(
        "port: 9000\n"
        "workers: [{id: a, url: 'http://a:1'}]\n"
        "admin_keys: [root]\n"
        "tenants:\n"
        "  - {name: acme, api_keys: [k-acme], admin_keys: [adm-acme]}\n"
        "routing: {seed: 7, new_session_spread: 0.5}\n")
    monkeypatch.setenv("KVHINT_ROUTER_PORT", "9100")
    settings = RouterSettings(config_file=config)
    assert settings.port == 9100  # environment wins over the file
    assert settings.workers[0].id == "a"
    assert settings.routing.seed == 7
    assert settings.routing.new_session_spread == 0.5
    assert RouterSettings().routing.new_session_spread == 0.0  # off unless asked for
    assert not settings.dev_mode


@pytest.mark.parametrize("bad", [
    {"workers": "w0"},                                    # no URL
    {"workers": "w.0=http://a:1"},                        # not a NATS token
    {"workers": "w0=ftp://a"},                            # not HTTP
    {"workers": "w0=http://a:1,w0=http://b:1"},           # duplicate id
    {"tenants": [{"name": "x", "cache_salt": "a/b"}]},    # vLLM rejects '/'
    {"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}]},
    # One salt for two tenants would share their cached prompts.
    {"tenants": [{"name": "a", "cache_salt": "s"}, {"name": "b", "cache_salt": "s"}]},
    {"unknown_field": 1},
    {"routing": {"new_session_spread": -1}},
    # A misspelt key at any depth is refused, not ignored (an operator who wrote
    # `hints: {enable: false}` got hints on; `budget: {max_actions_per_min: 1}` got 600).
    {"hints": {"enable": False}},
    {"routing": {"session_forget": 60}},
    {"tenants": [{"name": "a", "budget": {"max_actions_per_min": 1}}]},
    {"tenants": [{"name": "a", "api_key": ["k"]}]},
    {"workers": [{"id": "w0", "url": "http://a:1", "weight": 2}]},
    # Refused here, not at start-up after the migration ran.
    {"log_level": "verbose"},
    {"subject_prefix": "kv hint"},
])
def test_bad_settings_are_refused_with_a_message(bad: dict) -> None:
    with pytest.raises(ValidationError):
        RouterSettings(**bad)


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        RouterSettings(config_file=tmp_path / "nope.yaml")


def test_dev_mode_is_one_open_tenant() -> None:
    directory = TenantDirectory(RouterSettings())
    assert directory.dev_mode
    tenant = directory.client(None)
    assert tenant.name == DEFAULT_TENANT and tenant.cache_salt is None
    assert directory.admin(None).is_admin


def test_keys_map_to_tenants_and_admins() -> None:
    directory = TenantDirectory(RouterSettings(
        admin_keys=["root"],
        tenants=[{"name": "acme", "api_keys": ["k1"], "admin_keys": ["a1"]},
                 {"name": "beta", "api_keys": ["k2"], "cache_salt": "fixed-salt"}]))
    acme, beta = directory.client("k1"), directory.client("k2")
    assert acme.name == "acme" and beta.name == "beta"
    assert beta.cache_salt == "fixed-salt"
    assert acme.cache_salt and acme.cache_salt != beta.cache_salt
    assert acme.worker_session_id("s1") == "acme/s1"
    with pytest.raises(AuthError) as missing:
        directory.client(None)
    assert missing.value.status == 401
    with pytest.raises(AuthError):
        directory.client("nope")
    with pytest.raises(AuthError) as not_admin:
        directory.admin("k1")
    assert not_admin.value.status == 403
    tenant_admin = directory.admin("a1")
    assert tenant_admin.may_act_for("acme") and not tenant_admin.may_act_for("beta")
    assert directory.admin("root").may_act_for("beta")


def test_api_key_header_forms() -> None:
    assert api_key_from_headers("Bearer abc", None) == "abc"
    assert api_key_from_headers("bearer  abc ", None) == "abc"
    assert api_key_from_headers(None, "xyz") == "xyz"
    assert api_key_from_headers("Basic abc", None) is None


def test_check_config_reports_bad_yaml_and_bad_keys_without_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvhint.router.cli import main

    broken = tmp_path / "broken.yaml"
    broken.write_text("routing: {policy: kvhint\n")
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text("hints:\n  enable: false\n")
    for config in (broken, misspelt):
        assert main(["router", "--config", str(config), "--check-config"]) == 2
        assert "invalid settings" in capsys.readouterr().err
    # A refused setting is named, its value never shown (pydantic's own text echoed the
    # input: the settings given, keys included).
    placeholder = tmp_path / "placeholder.yaml"
    placeholder.write_text("admin_keys: [change-me-admin-0123]\nhints: {enable: 1}\n")
    assert main(["router", "--config", str(placeholder), "--check-config"]) == 2
    err = capsys.readouterr().err
    assert "(settings): Value error" in err or "hints.enable" in err
    assert "change-me-admin-0123" not in err and "input_value" not in err
    placeholder.write_text("admin_keys: [change-me-admin-0123]\n")
    assert main(["router", "--config", str(placeholder), "--check-config"]) == 2
    err = capsys.readouterr().err
    assert "admin_keys: still the deploy files' example value" in err
    assert "change-me-admin-0123" not in err
    assert RouterSettings(log_level="DEBUG").log_level == "debug"


def test_model_prompt_flags_take_a_template_file_or_inline_text(tmp_path: Path) -> None:
    """As vLLM's --chat-template: a file path, or the template itself; a value that
    looks like a path but cannot be read is refused at start, not at the first request."""
    template = tmp_path / "tools.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    settings = RouterSettings(model_prompts={
        "tiny": {"chat_template": str(template), "exclude_tools_when_tool_choice_none": True},
        "*": {"chat_template": "{{ messages[0].content }}\\n",
              "default_chat_template_kwargs": {"enable_thinking": False}}})
    assert settings.model_prompts["tiny"].chat_template == template.read_text()
    assert settings.model_prompts["*"].chat_template == "{{ messages[0].content }}\n"
    with pytest.raises(ValidationError, match="looks like a file path"):
        RouterSettings(model_prompts={"tiny": {"chat_template": str(tmp_path / "nope.jinja")}})
    with pytest.raises(ValidationError):
        RouterSettings(model_prompts={"tiny": {"template": "x"}})


def test_a_store_it_cannot_reach_stops_the_router_with_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, the service died in its lifespan and printed the driver's traceback.
    A closed local port stands in for a PostgreSQL that is down."""
    import socket

    from kvhint.router.cli import main

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    config = tmp_path / "router.yaml"
    config.write_text(f"database_url: postgresql://kvhint:secret@127.0.0.1:{port}/kvhint\n")
    assert main(["router", "--config", str(config)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("kvhint router: cannot connect to the store at "
                             f"postgresql+psycopg://kvhint:***@127.0.0.1:{port}/kvhint: ")
    assert "secret" not in err[0]


def test_a_published_salt_secret_is_announced_outside_dev_mode(
        caplog: pytest.LogCaptureFixture) -> None:
    """Tenants' derived salts are HMACs of salt_secret: with the default (published)
    one, anyone knowing a tenant's name knows its salt."""
    from kvhint.router.service.runtime import _announce

    def warned(settings: RouterSettings) -> bool:
        caplog.clear()
        _announce(settings, TenantDirectory(settings))
        return any("salt_secret" in r.getMessage() for r in caplog.records)

    tenants = [{"name": "acme", "api_keys": ["k1"]}]
    assert warned(RouterSettings(tenants=tenants))
    assert not warned(RouterSettings(tenants=tenants, salt_secret="ours"))
    assert not warned(RouterSettings(tenants=[{**tenants[0], "cache_salt": "own"}]))
    assert not warned(RouterSettings())  # dev mode: one tenant, no salt


def test_check_config_shows_no_credentials_of_the_nats_and_store_urls(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvhint.router.cli import main

    config = tmp_path / "router.yaml"
    config.write_text("nats_url: nats://router:n4ts-pw@nats:4222\n"
                      "database_url: postgresql+psycopg://kvhint:db-pw@pg:5432/kvhint\n")
    assert main(["router", "--config", str(config), "--check-config"]) == 0
    out = capsys.readouterr().out
    assert "n4ts-pw" not in out and "db-pw" not in out
    shown = json.loads(out)
    assert shown["nats_url"] == "nats://***@nats:4222"
    assert shown["database_url"] == "postgresql+psycopg://kvhint:***@pg:5432/kvhint"


@pytest.mark.parametrize("url", ["nats://u:s3cret@h:notaport", "nats://u:s3cret@:4222",
                                 "nats://h:99999", "nats://a:4222,ws://b:80", "http://h:4222",
                                 # '/', '#' or '?' ends the host part: percent-encode them
                                 "nats://u:s3cret/x@h:4222", "nats://u:s3cret#x@h:4222"])
def test_a_nats_url_nats_cannot_connect_to_is_refused_at_start(url: str) -> None:
    """nats-py refuses such a URL with ValueError or AssertionError, which the NATS link's
    connect loop did not catch: the loop ended and the router served on without NATS (no
    index, no hints), nothing counted. The plugin checks its nats_url the same way
    (schemas.nats_address.nats_url_problem); the password is never shown."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="nats_url") as refused:
        RouterSettings(nats_url=url)
    assert "s3cret" not in str(refused.value).split("input_value")[0]
    assert RouterSettings(nats_url="tls://u:pw@h:4222, nats://[::1]:4222").nats_url
    assert RouterSettings(nats_url="nats://u:s3c%2Fr%23et@h:4222").nats_url


@pytest.mark.parametrize(("key", "env", "under", "floor"), [
    ("hints.tick_s", "HINTS__TICK_S", "1e-9", "0.05"),
    ("health_probe_s", "HEALTH_PROBE_S", "1e-9", "0.05"),
    ("store_flush_interval_s", "STORE_FLUSH_INTERVAL_S", "0.001", "0.01"),
    ("events_stream_max_age_s", "EVENTS_STREAM_MAX_AGE_S", "0.05", "60"),
    ("outcomes_stream_max_age_s", "OUTCOMES_STREAM_MAX_AGE_S", "1", "60"),
    ("releases_stream_max_age_s", "RELEASES_STREAM_MAX_AGE_S", "1", "60"),
    ("events_stream_max_bytes", "EVENTS_STREAM_MAX_BYTES", str(64 << 10), str(1 << 20)),
    ("outcomes_stream_max_bytes", "OUTCOMES_STREAM_MAX_BYTES", "1", str(1 << 20)),
    ("releases_stream_max_bytes", "RELEASES_STREAM_MAX_BYTES", "1", str(1 << 20)),
])
def test_a_period_or_stream_bound_under_its_floor_is_refused_naming_it(
        key: str, env: str, under: str, floor: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, any positive value passed: a tick_s of 1e-9 ran the planner's walk of every
    session back to back on the event loop; a stream kept 50 ms is one nats-server
    refuses to create (the plugin's own floors are the same: engine_plugin/config.py)."""
    monkeypatch.setenv(f"KVHINT_ROUTER_{env}", under)
    with pytest.raises(ValidationError) as refused:
        RouterSettings()
    assert key in str(refused.value)
    monkeypatch.setenv(f"KVHINT_ROUTER_{env}", floor)
    settings = RouterSettings()
    owner, _, name = key.rpartition(".")
    assert getattr(getattr(settings, owner) if owner else settings, name) == float(floor)


def test_an_empty_worker_key_is_refused_not_sent_as_no_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A worker key set to nothing (an empty Kubernetes Secret behind
    KVHINT_ROUTER_WORKER_API_KEY, a blank ``api_key``) is refused at validation, named;
    before, the router started and quietly sent the workers no key. Unset: none sent."""
    from kvhint.router.cli import main

    for blank in ("", "  \n"):
        with pytest.raises(ValidationError, match="worker_api_key is empty"):
            RouterSettings(worker_api_key=blank)
        with pytest.raises(ValidationError, match="api_key is empty"):
            RouterSettings(workers=[{"id": "w0", "url": "http://h:8", "api_key": blank}])
    monkeypatch.setenv("KVHINT_ROUTER_WORKER_API_KEY", "")
    with pytest.raises(ValidationError, match="worker_api_key is empty"):
        RouterSettings()
    monkeypatch.delenv("KVHINT_ROUTER_WORKER_API_KEY")
    assert RouterSettings().worker_api_key is None
    assert RouterSettings(worker_api_key="k").worker_api_key.get_secret_value() == "k"
    config = tmp_path / "router.yaml"
    config.write_text('worker_api_key: ""\n')
    assert main(["router", "--config", str(config), "--check-config"]) == 2
    err = capsys.readouterr().err
    assert "worker_api_key: Value error, worker_api_key is empty" in err
