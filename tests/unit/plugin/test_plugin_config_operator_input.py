"""Bad ``kv_connector_extra_config`` an operator could give, against the real config
model: each stops start-up with one message naming the key. The gaps this closed: a
JSON true/false read as the number 1/0, an empty or blank nats_url (the engine ran
without NATS, or with a transport that had no server), and nats_url_env's refusals
named "(config)" rather than their key. One case goes end to end through vLLM's real
Scheduler building the connector (headless.py).
"""

from __future__ import annotations

import pytest

from kvhint.engine_plugin.config import PluginConfig, PluginConfigError, load_plugin_config
from kvhint.router.service.settings import RouterSettings

NUMBER_KEYS = sorted(name for name, field in PluginConfig.model_fields.items()
                     if field.annotation in (int, float))


def refusal(extra: dict) -> str:
    with pytest.raises(PluginConfigError) as err:
        load_plugin_config(extra)
    return str(err.value)


def test_number_keys_are_found() -> None:
    assert {"pin_budget_fraction", "donor_retain_priority", "max_sessions",
            "heartbeat_interval_s"} <= set(NUMBER_KEYS)


@pytest.mark.parametrize("key", NUMBER_KEYS)
@pytest.mark.parametrize("value", [True, False])
def test_a_number_key_refuses_true_or_false(key: str, value: bool) -> None:
    """Before, lax mode read true as 1 and false as 0: "donor_retain_priority": true was
    priority 1, "retain_budget_fraction": true all the blocks."""
    says = refusal({key: value})
    assert f"kv_connector_extra_config[{key!r}]: " in says and "not true or false" in says


@pytest.mark.parametrize("key", NUMBER_KEYS)
def test_a_number_key_refuses_a_quoted_number_and_says_what_to_write(key: str) -> None:
    """Before, lax mode read "30" as 30 (and "1_000" as 1000, " 30.0 " as 30): a value
    written as a string passed unseen. vLLM's --kv-transfer-config is typed JSON."""
    number = PluginConfig.model_fields[key].default
    says = refusal({key: f" {number} "})
    assert f"kv_connector_extra_config[{key!r}]: " in says
    assert f"takes a JSON number, not a string: write {number} without the quotes" in says
    assert getattr(load_plugin_config({key: number}), key) == number  # as advised


@pytest.mark.parametrize(("value", "advice"), [
    ("1e9", ": write 1e9 without the quotes"), ("0.5", ": write 0.5 without the quotes"),
    ("1_000", ""), ("Infinity", ""), ("many", ""), ("true", "")])
def test_the_advice_is_given_only_for_a_json_number(value: str, advice: str) -> None:
    says = refusal({"max_sessions": value})
    assert f"takes a JSON number, not a string{advice} (got {value!r})" in says


@pytest.mark.parametrize("url", ["", " ", ",", " , "])
def test_an_empty_or_blank_nats_url_is_refused(url: str) -> None:
    """Before, "" ran the engine without NATS (an unset template variable, said once in
    the log as if meant) and " " or "," started the transport with no server."""
    says = refusal({"worker_id": "w0", "nats_url": url})
    assert "kv_connector_extra_config['nats_url']: " in says and "names no server" in says
    assert load_plugin_config({"worker_id": "w0", "nats_url": None}).nats_url is None


def test_a_blank_router_nats_url_is_refused_and_an_empty_one_is_still_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The router shares the check (schemas/nats_address.py): " " ran a NATS link with
    no server; "" is documented as off and stays so."""
    monkeypatch.setenv("KVHINT_ROUTER_NATS_URL", " , ")
    with pytest.raises(ValueError, match="names no server"):
        RouterSettings()
    monkeypatch.setenv("KVHINT_ROUTER_NATS_URL", "")
    assert RouterSettings().nats_url is None


def test_nats_url_env_refusals_name_their_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, they read kv_connector_extra_config['(config)']: ..."""
    monkeypatch.delenv("KVHINT_TEST_UNSET", raising=False)
    monkeypatch.setenv("KVHINT_TEST_NATS_URL", "nats://nats:4222")
    for extra in ({"nats_url_env": "KVHINT_TEST_UNSET"},
                  {"nats_url_env": "KVHINT_TEST_NATS_URL", "nats_url": "nats://x:1"},
                  {"nats_url_env": 5}):
        says = refusal(extra)
        assert "kv_connector_extra_config['nats_url_env']: " in says, says
        assert "(config)" not in says


@pytest.mark.parametrize(("extra", "key"), [
    # The rest of the review's list, refused before this change too: held here so the
    # list stays whole.
    ({"pin_budget_fracton": 0.2}, "pin_budget_fracton"),          # a typo
    ({"max_sessions": "many"}, "max_sessions"),                     # wrong type
    ({"worker_id": 7}, "worker_id"),
    ({"retain_budget_fraction": 1.01}, "retain_budget_fraction"),   # out of range
    ({"prefetch_budget_fraction": -0.1}, "prefetch_budget_fraction"),
    ({"pin_budget_fraction": float("nan")}, "pin_budget_fraction"),
    ({"worker_id": "w 0"}, "worker_id"),                            # NATS subject token
    ({"worker_id": "w.0"}, "worker_id"),
    ({"worker_id": "w*"}, "worker_id"),
    ({"worker_id": "w>"}, "worker_id"),
    ({"subject_prefix": "kvhint.*"}, "subject_prefix"),             # wildcards
    ({"subject_prefix": "kvhint.>"}, "subject_prefix"),
    ({"subject_prefix": ""}, "subject_prefix"),
])
def test_the_rest_of_the_operators_mistakes_are_refused_by_key(extra: dict, key: str) -> None:
    says = refusal(extra)
    assert f"kv_connector_extra_config[{key!r}]: " in says
    assert says.count("kv_connector_extra_config[") == 1  # one message, this key


def test_a_bad_key_stops_vllms_scheduler_building_the_connector() -> None:
    """End to end: vLLM's real Scheduler builds the connector, which refuses its config
    with the message, not a traceback of pydantic's (``from None``)."""
    from kvhint.engine_plugin.headless import HeadlessSchedulerSpec, build_scheduler

    with pytest.raises(PluginConfigError) as err:
        build_scheduler(HeadlessSchedulerSpec(
            block_size=16, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
            connector_extra_config={"worker_id": "w0", "nats_url": "",
                                    "donor_retain_priority": True}))
    says = str(err.value)
    assert "kv_connector_extra_config['nats_url']: " in says
    assert "kv_connector_extra_config['donor_retain_priority']: " in says
    assert err.value.__cause__ is None and err.value.__suppress_context__
