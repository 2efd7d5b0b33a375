"""The rules of origin_policy.py on their own: which Host headers dev mode serves (DNS
rebinding), how CORS settings are read and refused. The app around them:
tests/integration/service/test_service_origin_policy.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvhint.router.service.metric_labels import CORS_REFUSAL_REASONS
from kvhint.router.service.origin_policy import CORS_REFUSALS, host_served
from kvhint.router.service.settings import RouterSettings

ALLOWED = frozenset({"gpu.lan"})


@pytest.mark.parametrize("host", [
    None,  # HTTP/1.0 without Host: no browser sends that
    "localhost", "LOCALHOST:8080", "localhost.", "app.localhost:3000",
    "127.0.0.1", "127.0.0.1:8080", "127.8.9.10", "[::1]:8080", "[::1]",
    "10.0.0.5:8080", "192.168.1.20", "[fe80::1]",  # any address: cannot be re-pointed
    "router:8080", "worker-0", "kvhint_router",  # compose service names, no dot
    "gpu.lan", "GPU.LAN:8080", "gpu.lan.",  # allowed_hosts
])
def test_served_hosts(host: str | None) -> None:
    assert host_served(host, ALLOWED)


@pytest.mark.parametrize("host", [
    "evil.example", "evil.example:8080", "evil.example.", "a.b.evil.example",
    "localhost.evil.example", "127.0.0.1.evil.example", "gpu.lan.evil.example",
    "router.",  # absolute: a top-level name in public DNS
    "", ":8080", "evil.example:80x", "[::1", "[evil.example]", "a b", "évil",
])
def test_refused_hosts(host: str) -> None:
    assert not host_served(host, ALLOWED)


def test_cors_settings_are_normalized_as_browsers_send_origins() -> None:
    settings = RouterSettings(cors_allowed_origins=["https://App.Example:443/",
                                                    "http://localhost:3000"],
                              allowed_hosts=["Gpu.Lan."])
    assert settings.cors_allowed_origins == ["https://app.example", "http://localhost:3000"]
    assert settings.allowed_hosts == ["gpu.lan"]
    assert RouterSettings().cors_allowed_origins == [] and not RouterSettings().allowed_hosts


def test_environment_lists_are_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVHINT_ROUTER_CORS_ALLOWED_ORIGINS", "https://a.example, http://b:8")
    monkeypatch.setenv("KVHINT_ROUTER_ALLOWED_HOSTS", "gpu.lan,box")
    settings = RouterSettings()
    assert settings.cors_allowed_origins == ["https://a.example", "http://b:8"]
    assert settings.allowed_hosts == ["gpu.lan", "box"]


@pytest.mark.parametrize(("extra", "says"), [
    ({"cors_allowed_origins": ["*"], "cors_allow_credentials": True}, "credentials"),
    ({"cors_allowed_origins": ["*", "https://a.example"]}, "list it alone"),
    ({"cors_allowed_origins": ["null"]}, "sandboxed"),
    ({"cors_allowed_origins": ["https://a.example/app"]}, "not an origin"),
    ({"cors_allowed_origins": ["a.example"]}, "not an origin"),
    ({"cors_allowed_origins": ["ftp://a.example"]}, "not an origin"),
    ({"cors_allowed_origins": ["https://user@a.example"]}, "not an origin"),
    ({"allowed_hosts": ["gpu.lan:8080"]}, "not a host name"),
    ({"allowed_hosts": ["http://gpu.lan"]}, "not a host name"),
])
def test_bad_settings_are_refused_with_a_reason(extra: dict, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        RouterSettings(**extra)


def test_every_cors_refusal_has_its_metric_series() -> None:
    assert set(CORS_REFUSALS) == set(CORS_REFUSAL_REASONS)
