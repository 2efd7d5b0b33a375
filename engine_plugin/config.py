"""The plugin's settings: vLLM's ``kv_connector_extra_config``, validated at start-up.

A bad value stops the engine with a message naming the key (``PluginConfigError``);
unknown keys are errors too, so a typo does not silently fall back to a default.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvhint.schemas import (
    MAX_HEARTBEAT_INTERVAL_S,
    MIN_HEARTBEAT_INTERVAL_S,
    MIN_STREAM_MAX_AGE_S,
    MIN_STREAM_MAX_BYTES,
    Subjects,
    is_valid_worker_id,
)
from kvhint.schemas.nats_address import (
    PLACEHOLDER_SECRET_PREFIX,
    NatsConnection,
    is_placeholder_secret,
    nats_connection,
    nats_servers,
    nats_url_problem,
    url_secret,
)
from kvhint.schemas.worker_url import http_url_form

# Under vLLM's "vllm" logger, so plugin lines appear in the engine's log with vLLM's format
# and follow VLLM_LOGGING_LEVEL (vLLM configures only that logger in EngineCore).
LOGGER_NAME = "vllm.kvhint"

# The kv_role to load the plugin with when it is the engine's only connector. The plugin
# moves no KV data, so it declares no consumer role: vLLM treats a KV consumer as one that
# may load into freshly allocated blocks (see the vllm_adapter package docstring).
# Beside vLLM's OffloadingConnector (in a MultiConnector), the MultiConnector's own role
# stays "kv_both": that connector does load.
KV_ROLE = "kv_producer"


class PluginConfigError(ValueError):
    """The connector's extra config is invalid; the message names every bad key."""


class PluginConfig(BaseModel):
    # No inf or NaN: vLLM parses --kv-transfer-config with json.loads, which takes
    # Infinity, NaN and 1e999; an infinite stream max age made every stream create raise.
    # Booleans are strict (StrictBool: JSON true/false only): pydantic's lax mode took
    # "yes", "off", 1 or "0" for one, and a quoted "false" read as false by luck.
    # Every time and size has a floor its use needs (each field's description says why);
    # before, 1e-9 passed (a heartbeat due at every publisher round).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # Identity. One data-parallel rank: this id as it is. One of several ranks (vLLM's
    # --data-parallel-size > 1 gives every rank this same config): "<worker_id>-dp<rank>",
    # so each rank, with its own KV cache, is its own worker (resolved_worker_id).
    # `None` = "w<dp rank>".
    worker_id: str | None = None
    # NATS server(s), comma-separated. Absent: the index and metrics run, nothing is
    # published or received (said once in the log).
    nats_url: str | None = None
    # The name of an environment variable holding nats_url instead (read at start-up):
    # vLLM logs --kv-transfer-config, so credentials in nats_url reach its log.
    nats_url_env: str | None = None
    subject_prefix: str = "kvhint"
    # Where operators reach this worker over HTTP (put in the heartbeat), if known.
    # Checked at start-up by the rule every router applies to it (schemas/worker_url.py).
    http_url: str | None = None

    # Budgets. Pins are hard: they may cost a preemption, so they get a small budget.
    # Retained blocks are released whenever an allocation would otherwise fail.
    pin_budget_fraction: float = Field(0.10, ge=0.0, le=0.9)
    max_pin_ttl_s: float = Field(600.0, ge=1.0, le=86_400.0, description=(
        "The longest a pin holds (a hint's ttl_s is clipped to it). At least 1 s: the "
        "router plans pins across the gap between a session's turns and learns this cap "
        "from heartbeats (2 s apart); a shorter one lapses before any turn could use it."))
    retain_budget_fraction: float = Field(0.5, ge=0.0, le=1.0)
    max_retain_ttl_s: float = Field(3600.0, ge=1.0, le=86_400.0, description=(
        "The longest a Retain holds, and what an untimed one holds for. At least 1 s, "
        "as max_pin_ttl_s."))
    # Donor advice: keep the donor's resident blocks retained for the advice's ttl_s.
    donor_retain: StrictBool = True
    donor_retain_priority: int = Field(60, ge=0, le=100)
    # Prefetch of blocks already in G1: keep them retained at this priority until the deadline.
    prefetch_retain_priority: int = Field(80, ge=0, le=100)
    # Prefetch work: the most target blocks deferred Prefetches may wait for at once, as a
    # fraction of the GPU blocks (each waiting Prefetch counts at least one). Every step
    # re-checks what they wait for, so this bounds that work as the pin and retain budgets
    # bound holds. A Prefetch past it waits only for its root-most blocks that fit and is
    # ``clipped``; with no room left it is answered at once (``clipped``, with what is in
    # G1 already). 0: Prefetches never wait.
    prefetch_budget_fraction: float = Field(0.25, ge=0.0, le=1.0)
    # A Demote that finds host copies still in flight (vLLM's offloading connector copies
    # asynchronously, and a Demote planned as a response ends can come before the copies
    # of its last blocks finish) is answered ``deferred`` and applied when they finish, or
    # after this long with what has a copy then. 0: applied at once.
    demote_copy_wait_s: float = Field(2.0, ge=0.0, le=60.0, description=(
        "0, or at least 0.01 s: the wait is checked once per engine step (~10 ms or "
        "more), so a shorter one only adds a deferred answer and applies the Demote at "
        "the next step as 0 would at once."))

    # Session index bounds.
    max_sessions: int = Field(100_000, ge=1)
    max_frontiers_per_session: int = Field(8, ge=1, le=1024)
    # Idempotency memory: outcomes of this many recent action ids are kept.
    max_remembered_actions: int = Field(100_000, ge=1)

    # Transport.
    heartbeat_interval_s: float = Field(2.0, ge=MIN_HEARTBEAT_INTERVAL_S,
                                        le=MAX_HEARTBEAT_INTERVAL_S, description=(
        "Seconds between heartbeats (the worker's status). At least 0.1 s: the router "
        "declares a worker dead after heartbeat_misses intervals, so a shorter one makes "
        "a router pause of a few tenths of a second purge a live worker's index; each "
        "beat builds and publishes the whole status."))
    event_buffer_batches: int = Field(10_000, ge=1)
    # ...and at most this many bytes (estimated: a BlockStored carries its block's token
    # ids, ~48 bytes each held): while NATS is down, 10,000 batches of 8k-token prefills
    # would hold ~4.4 GB. Past either bound the oldest batches are dropped (counted,
    # kvhint:events_dropped; the router resyncs). At least 1 MiB (a step's batch).
    event_buffer_bytes: int = Field(256 << 20, ge=1 << 20, description=(
        "At least 1 MiB: one engine step's batch (up to NATS's default 1 MiB payload) "
        "must fit, or every batch would be dropped."))
    outcome_buffer: int = Field(10_000, ge=1)
    inbound_buffer: int = Field(10_000, ge=1)
    # Create the JetStream events stream when it does not exist yet.
    create_events_stream: StrictBool = True
    events_stream_max_age_s: float = Field(3600.0, ge=MIN_STREAM_MAX_AGE_S, description=(
        "At least 60 s: the router replays this stream to rebuild its index when it "
        "starts or reconnects; a shorter history is gone before it reads it, and every "
        "worker has to resync by snapshot instead (nats-server itself refuses under "
        "100 ms)."))
    events_stream_max_bytes: int = Field(1 << 30, ge=MIN_STREAM_MAX_BYTES, description=(
        "At least 1 MiB: one step's batch may be up to NATS's default 1 MiB payload, "
        "and JetStream acknowledges a message larger than the stream, then drops it "
        "at once: the router would replay nothing."))
    # Wake an idle engine when a hint arrives, so it is applied within milliseconds.
    wake_idle_engine: StrictBool = True
    # A hint the engine has not taken after this long (a long prefill step, or an engine
    # that cannot be woken) is answered ``deferred`` at once; its final outcome follows.
    defer_after_s: float = Field(0.02, ge=0.005, le=10.0, description=(
        "At least 5 ms: an idle engine woken for a hint takes it within a few ms; a "
        "shorter wait answers nearly every hint twice (deferred, then its outcome)."))
    # Snapshots kept for their later pages (router replicas paging at once), bounded by
    # their blocks in all: past it the oldest go first (counted, kvhint:snapshots_dropped),
    # the latest always stays (without it every page would copy the index again).
    snapshot_keep_blocks: int = Field(1_000_000, ge=1)

    @field_validator("*", mode="before")
    @classmethod
    def _only_a_json_number_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # JSON true/false is not a number: lax mode read true as 1 (a priority of 1, a
        # budget of all the blocks, a 1 s TTL) and false as 0, silently. Nor is a quoted
        # number: lax mode read "30" as 30, and "1_000" or " 30.0 " too, so a value
        # written as a string (a template that quotes, a number that was meant to be a
        # name) passed unseen; vLLM's --kv-transfer-config is typed JSON.
        if info.field_name is None or (
                cls.model_fields[info.field_name].annotation not in (int, float)):
            return value
        if isinstance(value, bool):
            raise ValueError("takes a number, not true or false")
        if isinstance(value, str):
            raise ValueError("takes a JSON number, not a string" + _unquoted(value))
        return value

    @field_validator("worker_id")
    @classmethod
    def _check_worker_id(cls, value: str | None) -> str | None:
        if value is not None and not is_valid_worker_id(value):
            raise ValueError("use 1-128 letters, digits, '_' or '-' (a NATS subject token)")
        return value

    @model_validator(mode="before")
    @classmethod
    def _nats_url_from_env(cls, data: Any) -> Any:
        """``nats_url_env``: nats_url is that variable's value (then checked as one).
        Its refusals name ``nats_url_env`` as their key (_key_error); a name that is no
        string is left to the field's own check, which says so."""
        if not isinstance(data, dict) or not isinstance(name := data.get("nats_url_env"),
                                                         str):
            return data
        if data.get("nats_url") is not None:
            raise _key_error("nats_url_env", "set nats_url or nats_url_env, not both")
        if not (value := os.environ.get(name)):
            raise _key_error("nats_url_env", f"names {name!r}, an environment variable "
                             "that is not set (or empty) in vLLM's environment")
        return {**data, "nats_url": value}

    @field_validator("nats_url")
    @classmethod
    def _check_nats_url(cls, value: str | None) -> str | None:
        # Absent or null: no NATS. Empty or blank is refused: before, "" (an unset
        # template variable) ran the engine without NATS, said only as if asked for, and
        # " " or "," started the transport with no server to connect to, for ever.
        if value is None:
            return None
        if not nats_servers(value):
            raise ValueError("names no server (it is blank, or only ',' and spaces): leave "
                             "nats_url out, or null, to run without NATS")
        # Checked here: the transport connects in its own thread, where nats-py refusing
        # the URL ended that thread and left the engine without NATS for good.
        # Also the one set of credentials, percent-decoded, that the transport sends
        # (schemas/nats_address.py): a URL whose user info cannot be told apart is refused.
        if problem := nats_url_problem(value):
            raise ValueError(problem)
        if any(is_placeholder_secret(url_secret(server)) for server in nats_servers(value)):
            raise ValueError("its password is still deploy/'s public placeholder "
                             f"({PLACEHOLDER_SECRET_PREFIX}...): replace it (the "
                             "kvhint-nats Secret, KVHINT_NATS_PASSWORD)")
        return value

    @field_validator("http_url")
    @classmethod
    def _check_http_url(cls, value: str | None) -> str | None:
        # A router routes to (and sends its worker_api_key to) a heartbeat's http_url only
        # in this form: one that is not fails here, with the reason, rather than being
        # refused by every router that reads the heartbeats (worker_url_refused).
        if value is None:
            return None
        problem, _host = http_url_form(value)
        if problem is not None:
            raise ValueError(f"{problem}: use http(s)://host[:port][/path], the address "
                             "the router reaches this worker at, without credentials, "
                             "query or fragment")
        return value

    @field_validator("demote_copy_wait_s")
    @classmethod
    def _check_demote_copy_wait(cls, value: float) -> float:
        if 0 < value < 0.01:
            raise ValueError("use 0 (no wait) or at least 0.01 s (one engine step)")
        return value

    @field_validator("subject_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        Subjects(value)  # its WireDecodeError is a ValueError: pydantic reports it
        return value

    @property
    def nats_servers(self) -> list[str]:
        """The server entries of ``nats_url`` as written (credentials included)."""
        return nats_servers(self.nats_url)

    @property
    def nats_connection(self) -> NatsConnection:
        """What the transport connects with: the servers without user info and the
        decoded credentials (an empty server list without ``nats_url``)."""
        return nats_connection(self.nats_url) if self.nats_url else NatsConnection(())

    @property
    def worker_id_defaulted(self) -> bool:
        """NATS is configured and ``worker_id`` is not: the worker id is the default
        ``w<data-parallel rank>``, ``w0`` on every single-rank server, so two such servers
        publish as one worker (the router follows one, refuses the other's messages and
        raises KvhintWorkerIdConflict). Warned of once at start-up (connector.py)."""
        return self.nats_url is not None and self.worker_id is None

    def resolved_worker_id(self, data_parallel_rank: int, several_ranks: bool = False) -> str:
        """The worker id of data-parallel rank ``data_parallel_rank`` (the global rank).

        Contract: every rank of one engine gets a distinct id, and an engine of one rank
        (``several_ranks`` False) keeps ``worker_id`` exactly as configured. vLLM hands
        every rank of ``--data-parallel-size N`` the same kv_connector_extra_config, and
        two ranks under one id would publish one worker's events, status and outcomes
        from two caches (the router keeps the newer epoch's and drops the other's).
        Raises PluginConfigError when ``worker_id`` leaves no room for the suffix."""
        if self.worker_id is None:
            return f"w{data_parallel_rank}"
        if not several_ranks:
            return self.worker_id
        resolved = f"{self.worker_id}-dp{data_parallel_rank}"
        if not is_valid_worker_id(resolved):
            raise PluginConfigError(
                f"kvhint engine plugin: invalid config: kv_connector_extra_config"
                f"['worker_id']: data-parallel rank {data_parallel_rank} would be "
                f"{resolved[:40]!r}... ({len(resolved)} characters, at most 128): "
                "shorten the worker id")
        return resolved

    def pin_budget_blocks(self, num_blocks: int) -> int:
        return int(self.pin_budget_fraction * num_blocks)

    def retain_budget_blocks(self, num_blocks: int) -> int:
        return int(self.retain_budget_fraction * num_blocks)

    def prefetch_budget_blocks(self, num_blocks: int) -> int:
        return int(self.prefetch_budget_fraction * num_blocks)

    @property
    def credentials_in_transfer_config(self) -> bool:
        """Whether ``nats_url`` itself (not one read through ``nats_url_env``) carries a
        user, password or token: vLLM logs its ``--kv-transfer-config`` at start-up, so
        they are in its log."""
        return self.nats_url_env is None and any(
            url_secret(server) is not None for server in self.nats_servers)


def _unquoted(text: str) -> str:
    """What to write instead of a quoted number: the number, where the string is one."""
    try:
        number = json.loads(text.strip())
    except ValueError:
        return ""
    if isinstance(number, bool) or not isinstance(number, (int, float)) or (
            not math.isfinite(number)):
        return ""
    return f": write {text.strip()} without the quotes"


def _key_error(key: str, message: str) -> PydanticCustomError:
    """A config-level refusal (a model validator's) that names ``key`` in the message, as
    a field's own refusal does (_problem reads it from the error's context)."""
    return PydanticCustomError("config_key", message.replace("{", "{{").replace("}", "}}"),
                               {"key": key})


def _problem(err: Any) -> str:
    """One validation error as the message shows it: the key, what is wrong, and the
    value given, except where it may be secret: a nats_url, an http_url (refused, it
    may carry a password), the whole config (the input of a config-level error) and an
    unknown key's (a misspelt nats_url)."""
    config_level = not err["loc"]
    key = (".".join(str(p) for p in err["loc"]) or (err.get("ctx") or {}).get("key")
           or "(config)")
    if err["type"] == "extra_forbidden":
        close = difflib.get_close_matches(key, PluginConfig.model_fields, n=1)
        return (f"kv_connector_extra_config[{key!r}]: unknown key"
                + (f" (did you mean {close[0]!r}?)" if close else ""))
    got = ("" if config_level or key in ("nats_url", "http_url")
           else f" (got {err.get('input')!r})")
    return f"kv_connector_extra_config[{key!r}]: {err['msg']}{got}"


def load_plugin_config(extra: Mapping[str, Any] | None) -> PluginConfig:
    """Validate vLLM's ``kv_connector_extra_config``; raise PluginConfigError naming keys."""
    try:
        return PluginConfig.model_validate(dict(extra or {}))
    except ValidationError as exc:
        errors = exc.errors()
        message = "; ".join(_problem(err) for err in errors)
        if any(err["type"] == "extra_forbidden" for err in errors):
            message += "; the known keys: " + ", ".join(PluginConfig.model_fields)
        raise PluginConfigError("kvhint engine plugin: invalid config: " + message) from None


def check_plugin_config_early(extra: Mapping[str, Any] | None) -> None:
    """The checks of :func:`load_plugin_config` that hold in any process: for a check
    made before the engine starts, in vLLM's API server (the connector's
    ``requires_piecewise_for_cudagraph``). ``nats_url_env`` is left to the engine's own
    check: it names a variable of the engine's environment, which a front end (e.g. of
    a multi-node deployment) may not have. Raises PluginConfigError as that does."""
    data = dict(extra or {})
    if isinstance(data.get("nats_url_env"), str):
        del data["nats_url_env"]
    load_plugin_config(data)
