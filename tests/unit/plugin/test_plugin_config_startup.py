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
