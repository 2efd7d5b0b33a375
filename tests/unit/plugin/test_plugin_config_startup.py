"""The extra config as an operator meets it at start-up: what the pydantic model refuses,
and what the refusal says (the key, never a password).

The connector validates its config in ``__init__`` (``load_plugin_config``), so each
refusal here stops vLLM's start-up with this message
(tests/integration/plugin/test_plugin_index_live.py builds the connector to show it).
"""

from __future__ import annotations

import pytest

from kvhint.engine_plugin.config import PluginConfig, PluginConfigError, load_plugin_config


def refusal(extra: dict) -> str:
    with pytest.raises(PluginConfigError) as err:
        load_plugin_config(extra)
    return str(err.value)


@pytest.mark.parametrize("url", [
    # Before, each passed the check and the transport thread died at its first connect
    # (nats-py cannot parse it; closing the never-connected client then raised): the
    # engine ran without NATS for its whole life, internal_errors still 0.
    "nats://w0:n4ts-pw@127.0.0.1:notaport",
    "nats://w0:n4ts-pw@127.0.0.1:99999",
    "nats://w0:n4ts-pw@",
    "nats://w0:n4ts-pw@:4222",
    "nats://w0:n4ts-pw@nats:4222,ws://w0:n4ts-pw@nats:8080",  # nats-py refuses the mix
])
def test_a_nats_url_that_nats_cannot_connect_to_stops_start_up(url: str) -> None:
    says = refusal({"nats_url": url})
    assert "kv_connector_extra_config['nats_url']" in says and "n4ts-pw" not in says


@pytest.mark.parametrize("url", [
    "nats://127.0.0.1:4222", "nats://nats", "tls://w0:n4ts-pw@nats:4222",
    "nats://[::1]:4222", "nats://a:4222, nats://b:4222", "ws://nats:8080,wss://nats:8443",
])
def test_nats_urls_nats_connects_to_are_accepted(url: str) -> None:
    assert load_plugin_config({"nats_url": url}).nats_servers


def test_an_unknown_key_names_the_key_it_may_mean_and_the_known_ones() -> None:
    says = refusal({"retain_budget_fration": 0.3})
    assert "kv_connector_extra_config['retain_budget_fration']: unknown key" in says
    assert "did you mean 'retain_budget_fraction'?" in says
    assert all(key in says for key in PluginConfig.model_fields)


def test_an_unknown_key_never_echoes_its_value() -> None:
    """Before, its value was shown: a misspelt nats_url printed its password."""
    says = refusal({"nats_ulr": "nats://w0:n4ts-pw@nats:4222"})
    assert "did you mean 'nats_url'?" in says and "n4ts-pw" not in says


@pytest.mark.parametrize("key", [
    "pin_budget_fraction", "max_pin_ttl_s", "demote_copy_wait_s", "heartbeat_interval_s",
    "defer_after_s", "events_stream_max_age_s",
])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_infinite_or_nan_numbers_are_refused(key: str, value: float) -> None:
    """vLLM reads --kv-transfer-config with json.loads, which takes Infinity and NaN (and
    1e999). Before, events_stream_max_age_s Infinity was accepted: creating the stream
    then raised on every try, and the worker never sent a heartbeat."""
    says = refusal({key: value})
    assert f"kv_connector_extra_config[{key!r}]" in says


def test_credentials_written_into_the_transfer_config_are_told_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM logs --kv-transfer-config: credentials in nats_url itself are in its log (the
    connector warns, naming nats_url_env); read through nats_url_env they are not."""
    assert PluginConfig(nats_url="nats://u:pw@h:4222,nats://h2:4222").credentials_in_transfer_config
    assert PluginConfig(nats_url="nats://tok@h:4222").credentials_in_transfer_config
    assert not PluginConfig(nats_url="nats://h:4222").credentials_in_transfer_config
    assert not PluginConfig().credentials_in_transfer_config
    monkeypatch.setenv("KVHINT_TEST_NATS", "nats://u:pw@h:4222")
    assert not PluginConfig(nats_url_env="KVHINT_TEST_NATS").credentials_in_transfer_config


def test_the_deploy_files_placeholder_nats_password_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/'s kvhint-nats Secret ships change-me-nats: applied as it is, the workers
    (and NATS) ran with a password anyone who read the repository holds. The router
    refuses its placeholders; the plugin now refuses this one, never showing it."""
    monkeypatch.setenv("KVHINT_TEST_NATS", "nats://kvhint:change-me-nats@nats:4222")
    for extra in ({"nats_url_env": "KVHINT_TEST_NATS"},
                  {"nats_url": "nats://h:4222,nats://Change-Me-token@h2:4222"}):
        with pytest.raises(PluginConfigError, match="placeholder") as refused:
            load_plugin_config(extra)
        assert "change-me-nats" not in str(refused.value).lower().replace("change-me...", "")
    assert load_plugin_config({"nats_url": "nats://kvhint:s3cret@nats:4222"}).nats_url


# Each time or size just under its floor (the field's description says why), and at it.
FLOORS = {
    "max_pin_ttl_s": (0.5, 1.0),
    "max_retain_ttl_s": (0.5, 1.0),
    "demote_copy_wait_s": (0.005, 0.01),
    "heartbeat_interval_s": (1e-9, 0.1),
    "defer_after_s": (0.001, 0.005),
    "events_stream_max_age_s": (0.05, 60.0),
    "events_stream_max_bytes": (64 << 10, 1 << 20),
    "event_buffer_bytes": ((1 << 20) - 1, 1 << 20),
}


@pytest.mark.parametrize("key", sorted(FLOORS))
def test_a_time_or_size_under_its_floor_is_refused_naming_the_key(key: str) -> None:
    """Before, any positive value passed: a heartbeat_interval_s of 1e-9 published a
    heartbeat at every round of the publisher (every 10 ms), an events stream of 64 KiB
    dropped a large batch as soon as it stored it, and one kept 50 ms nats-server refuses
    to create."""
    under, floor = FLOORS[key]
    says = refusal({key: under})
    assert f"kv_connector_extra_config[{key!r}]" in says
    assert getattr(load_plugin_config({key: floor}), key) == floor


def test_no_demote_wait_is_still_allowed() -> None:
    assert load_plugin_config({"demote_copy_wait_s": 0}).demote_copy_wait_s == 0


@pytest.mark.parametrize("key", ["donor_retain", "create_events_stream", "wake_idle_engine"])
@pytest.mark.parametrize("value", ["yes", "false", "off", 1, 0])
def test_a_switch_takes_only_json_true_or_false(key: str, value: object) -> None:
    """Before, pydantic's lax mode read "yes" and 1 as true and "off" and 0 as false."""
    says = refusal({key: value})
    assert f"kv_connector_extra_config[{key!r}]" in says and "boolean" in says
    assert getattr(load_plugin_config({key: False}), key) is False


def test_a_percent_encoded_password_in_the_environment_is_decoded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's transport connects with the decoded user and password and servers
    without user info (nats-py never decodes a URL's; the real server takes it:
    tests/integration/plugin/test_plugin_nats_credentials.py)."""
    monkeypatch.setenv("KVHINT_TEST_NATS", "nats://kvhint:p%2Fa%23s%3Fs%40w%25rd@nats:4222")
    connection = load_plugin_config({"nats_url_env": "KVHINT_TEST_NATS"}).nats_connection
    assert connection.servers == ("nats://nats:4222",)
    assert (connection.user, connection.password) == ("kvhint", "p/a#s?s@w%rd")
    monkeypatch.setenv("KVHINT_TEST_NATS", "nats://kvhint:p/a#s?s@w%rd@nats:4222")
    says = refusal({"nats_url_env": "KVHINT_TEST_NATS"})
    assert "server 1 of 1 ('nats://***@nats:4222')" in says and "percent-encode" in says
    assert "p/a" not in says and "w%rd" not in says
    assert load_plugin_config({}).nats_connection.servers == ()
