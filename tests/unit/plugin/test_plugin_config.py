"""The connector's extra config: defaults, and bad values named by key."""

from __future__ import annotations

import pytest

from kvhint.engine_plugin.config import PluginConfig, PluginConfigError, load_plugin_config


def test_defaults_run_without_nats() -> None:
    config = load_plugin_config({})
    assert config.nats_url is None and config.nats_servers == []
    assert config.resolved_worker_id(3) == "w3"
    assert config.pin_budget_blocks(1000) == 100  # 10% by default
    assert config.prefetch_budget_blocks(1000) == 250  # 25% by default
    assert config.subject_prefix == "kvhint"
    assert config.event_buffer_bytes == 256 << 20


def test_values_from_the_dev_stack_are_accepted() -> None:
    config = load_plugin_config({"worker_id": "w0", "nats_url": "nats://127.0.0.1:4222"})
    assert config.worker_id == "w0" and config.nats_servers == ["nats://127.0.0.1:4222"]


@pytest.mark.parametrize(("extra", "key"), [
    ({"worker_id": "w.0"}, "worker_id"),
    ({"nats_url": "http://x"}, "nats_url"),
    ({"subject_prefix": "a..b"}, "subject_prefix"),
    ({"pin_budget_fraction": 2}, "pin_budget_fraction"),
    ({"max_pin_ttl_s": 0}, "max_pin_ttl_s"),
    ({"heartbeat_interval_s": -1}, "heartbeat_interval_s"),
    ({"event_buffer_batches": 0}, "event_buffer_batches"),
    ({"event_buffer_bytes": 1000}, "event_buffer_bytes"),  # less than a step's batch
    ({"inbound_buffer": "many"}, "inbound_buffer"),
    ({"prefetch_budget_fraction": 1.5}, "prefetch_budget_fraction"),
    ({"snapshot_keep_blocks": 0}, "snapshot_keep_blocks"),
    ({"pin_budget": 0.1}, "pin_budget"),  # unknown key (typo) is an error, not ignored
])
def test_bad_values_stop_with_the_key_named(extra: dict, key: str) -> None:
    with pytest.raises(PluginConfigError) as err:
        load_plugin_config(extra)
    assert f"kv_connector_extra_config[{key!r}]" in str(err.value)


def test_config_is_frozen() -> None:
    config = PluginConfig()
    with pytest.raises(ValueError):
        config.worker_id = "x"  # type: ignore[misc]


def test_a_bad_nats_url_is_named_without_its_password() -> None:
    with pytest.raises(PluginConfigError) as err:
        load_plugin_config({"nats_url": "nats://w0:n4ts-pw@nats:4222,http://w0:n4ts-pw@x"})
    assert "kv_connector_extra_config['nats_url']" in str(err.value)
    assert "http://***@x" in str(err.value) and "n4ts-pw" not in str(err.value)


def test_nats_url_may_come_from_an_environment_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM logs --kv-transfer-config: nats_url_env keeps the credentials out of it."""
    monkeypatch.delenv("KVHINT_TEST_UNSET", raising=False)
    monkeypatch.setenv("KVHINT_TEST_NATS_URL", "nats://w0:n4ts-pw@nats:4222")
    config = load_plugin_config({"nats_url_env": "KVHINT_TEST_NATS_URL"})
    assert config.nats_servers == ["nats://w0:n4ts-pw@nats:4222"]
    monkeypatch.setenv("KVHINT_TEST_NATS_URL", "http://w0:n4ts-pw@nats:4222")
    for extra, says in (
            ({"nats_url_env": "KVHINT_TEST_NATS_URL"}, "http://***@nats:4222"),
            ({"nats_url_env": "KVHINT_TEST_UNSET"}, "'KVHINT_TEST_UNSET'"),
            ({"nats_url_env": "KVHINT_TEST_NATS_URL", "nats_url": "nats://x:1"}, "not both")):
        with pytest.raises(PluginConfigError) as err:
            load_plugin_config(extra)
        assert says in str(err.value) and "n4ts-pw" not in str(err.value)


def test_the_readme_names_every_key_of_the_extra_config() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "docs" / "engine_plugin.md").read_text()
    listing = readme[readme.index("Everything in `kv_connector_extra_config` is validated"):]
    listing = listing[:listing.index("\n\n")]
    missing = [key for key in PluginConfig.model_fields if f"`{key}`" not in listing]
    assert not missing, f"docs/engine_plugin.md's extra-config list lacks {missing}"
