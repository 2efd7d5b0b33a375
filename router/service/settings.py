"""Router settings: environment (``KVHINT_ROUTER_*``) over a YAML/JSON config file over
defaults. ``kvhint router --config FILE`` names the file; ``kvhint up`` passes only
environment variables (``KVHINT_ROUTER_PORT``, ``KVHINT_ROUTER_WORKERS``,
``KVHINT_ROUTER_NATS_URL``, ``KVHINT_ROUTER_DATABASE_URL``).

``KVHINT_ROUTER_WORKERS`` is ``"w0=http://127.0.0.1:8001,w1=http://127.0.0.1:8002"``; in a
config file ``workers`` is a list of ``{id, url}`` (``api_key`` too: see WorkerConfig),
or the same string.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from kvhint.router.service.origin_policy import AllowedHost, CorsOrigin, cors_problem
from kvhint.router.service.responses_ids import ResponsesSettings
from kvhint.router.service.settings_sections import (
    HintSettings,
    ModelPromptSettings,
    RoutingSettings,
)
from kvhint.router.service.settings_tenants import (
    ApiCallRate,
    PriorityBounds,
    TenantBudget,
    TenantConfig,
)
from kvhint.router.service.upstream import DEFAULT_ANSWER_MAX_BYTES
from kvhint.router.service.worker_urls import parse_host_entry
from kvhint.schemas import (
    MIN_STREAM_MAX_AGE_S,
    MIN_STREAM_MAX_BYTES,
    Subjects,
    is_valid_worker_id,
)
from kvhint.schemas.nats_address import (
    PLACEHOLDER_SECRET_PREFIX,
    is_placeholder_secret,
    nats_servers,
    nats_url_problem,
    url_secret,
)

# What callers import from here: the tenants' models (settings_tenants.py) included.
__all__ = ["DEFAULT_SALT_SECRET", "DEFAULT_TENANT", "ENV_NULL", "ENV_PREFIX",
           "ApiCallRate", "PriorityBounds", "RouterSettings", "TenantBudget", "TenantConfig",
           "WorkerConfig", "parse_worker_list", "refuse_empty_key"]

ENV_PREFIX = "KVHINT_ROUTER_"
# The environment's spelling of None (YAML's and JSON's null): see RouterSettings.
ENV_NULL = "null"
# Published (it is in this file): salts derived from it are secret from nobody.
DEFAULT_SALT_SECRET = "kvhint-dev-salt-secret"
# The tenant of a global admin's own traffic (its inference and hints naming no
# ?tenant=) and, in dev mode, of all traffic (tenancy.py). A tenant configured with this
# name only sets that traffic's budget and limits: keys of its own are refused.
DEFAULT_TENANT = "default"


class WorkerConfig(BaseModel, frozen=True, extra="forbid"):
    id: str
    url: str
    # The key this worker's vLLM requires (its --api-key), sent as Authorization: Bearer
    # on every request the router makes to it; None: RouterSettings.worker_api_key.
    api_key: SecretStr | None = None

    @field_validator("id")
    @classmethod
    def _worker_id(cls, value: str) -> str:
        if not is_valid_worker_id(value):
            raise ValueError(f"worker id {value!r}: use letters, digits, '_' or '-'")
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"worker url {value!r} must start with http:// or https://")
        return value.rstrip("/")

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, value: SecretStr | None) -> SecretStr | None:
        return refuse_empty_key(value, "api_key")


class RouterSettings(BaseSettings):
    # A variable set to exactly ENV_NULL is None, for every setting, nested sections'
    # (KVHINT_ROUTER_ROUTING__SESSION_REFRESH) included: the environment can say what a
    # config file's null says ("no bound", "derived", "off"). A setting that takes no
    # None refuses it, naming itself. An empty variable stays the empty string (an empty
    # Secret is refused, not taken as "unset": refuse_empty_key).
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__",
                                      extra="forbid", env_parse_none_str=ENV_NULL)

    config_file: Path | None = None
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    workers: Annotated[list[WorkerConfig], NoDecode] = Field(default_factory=list)
    # The key for workers with no api_key of their own (those learnt from heartbeats
    # too): vLLM's --api-key. Never logged nor shown (SecretStr); a client's own key is
    # never sent to a worker in its place.
    worker_api_key: SecretStr | None = None
    # A worker heard only by its heartbeats (not in ``workers``) is routed to, and sent
    # worker_api_key, at the heartbeat's http_url (worker_urls.py): only where it is
    # http(s) and its host is one of these (an exact name, "*.domain", an IP or CIDR, "*"
    # for any). Empty: private-network hosts only (localhost, a name without a dot, a
    # loopback/private/link-local IP). learn_workers_from_heartbeats false: none at all.
    learn_workers_from_heartbeats: bool = True
    heartbeat_worker_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)

    # NATS with JetStream; None runs without the cluster feed (routing by load and
    # session affinity only, no hints), said loudly at start.
    nats_url: str | None = "nats://127.0.0.1:4222"
    subject_prefix: str = "kvhint"
    # Streams the router creates when missing (JetStream reserves max_bytes on disk).
    events_stream_max_bytes: int = Field(1 << 30, ge=MIN_STREAM_MAX_BYTES)
    events_stream_max_age_s: float = Field(3600.0, ge=MIN_STREAM_MAX_AGE_S)
    outcomes_stream_max_bytes: int = Field(256 << 20, ge=MIN_STREAM_MAX_BYTES)
    outcomes_stream_max_age_s: float = Field(24 * 3600.0, ge=MIN_STREAM_MAX_AGE_S)
    releases_stream_max_bytes: int = Field(64 << 20, ge=MIN_STREAM_MAX_BYTES)
    releases_stream_max_age_s: float = Field(24 * 3600.0, ge=MIN_STREAM_MAX_AGE_S)
    # Missed heartbeats (times the advertised interval) before the plugin counts as gone.
    heartbeat_misses: int = Field(3, ge=1)
    # How long the replay of the events stream's history (at the router's start, or its
    # NATS link set up again) is waited for: meanwhile a worker heard with none of its
    # batches applied waits for them instead of taking a snapshot. Past it the replay is
    # taken as over and those workers resync. A full default stream (1 GiB) replays in
    # ~30 s on 2 cores: raise it with a larger events_stream_max_bytes or a slower host.
    replay_wait_s: float = Field(60.0, gt=0, le=3600)
    # A worker's snapshot request that failed (refused: its inbox full; a NATS error, a
    # timeout) is asked again after 1 s, doubled at each failure in a row up to this.
    snapshot_retry_max_s: float = Field(8.0, ge=1, le=600)
    # How long a conflict over a worker's id (two engines heartbeating under it) stays
    # held, reported (kvhint_router_worker_id_conflict, /admin/workers' "conflict") and
    # the followed engine kept, after the other engine was last heard: longer than a vLLM
    # server's restart, so the other one restarting does not end it. At least the
    # plugin's longest heartbeat interval (300 s): a shorter hold ends between two of
    # the other engine's beats, and the conflict is found and warned of again each time.
    conflict_hold_s: float = Field(600.0, ge=300, le=86_400)
    # How long two engines must be heard side by side under one id before that conflict
    # is reported (warned of, kvhint_router_worker_id_conflict, held conflict_hold_s):
    # longer than a surge rollout's overlap (the new pod heartbeats while the old one
    # drains, its terminationGracePeriodSeconds, 30 s by default). Meanwhile the router
    # already keeps to the engine it follows; a conflict that ends sooner (the other
    # engine silent for its liveness window) is counted, not reported. 0: at once.
    conflict_confirm_s: float = Field(300.0, ge=0, le=3600)

    database_url: str = "sqlite:///kvhint-router.db"
    migrate_on_start: bool = True
    # A PostgreSQL connection attempt fails after this (a URL's own connect_timeout wins).
    store_connect_timeout_s: float = Field(10.0, gt=0)
    store_flush_interval_s: float = Field(0.25, ge=0.01, description=(
        "At least 0.01 s: the writer wakes this often on the event loop to flush "
        "(a transaction, in a thread); a tinier one wakes it back to back and writes "
        "a session's row at nearly every turn instead of once per interval."))
    store_queue_max: int = Field(100_000, gt=0)
    # History older than this is deleted from the store, hourly: answered hint actions,
    # sessions idle that long, workers learned from heartbeats not heard that long
    # (router/store/retention.py).
    store_retention_s: float = Field(7 * 86_400.0, gt=0)

    # Tokenizer (path or name) for vLLM-compatible block hashes; None: ask the workers'
    # /v1/models for the model's root.
    tokenizer: str | None = None
    # Per served model name ("*": every model without an entry of its own): the workers'
    # prompt-shaping flags (ModelPromptSettings).
    model_prompts: dict[str, ModelPromptSettings] = Field(default_factory=dict)
    # Block size and hash seed when no heartbeat says them.
    block_size: int = Field(16, gt=0)

    tenants: list[TenantConfig] = Field(default_factory=list)
    # KVHINT_ROUTER_ADMIN_KEYS is "key1,key2" (not JSON): NoDecode hands the string
    # to the validator below.
    admin_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    salt_secret: str = DEFAULT_SALT_SECRET
    # When set, /metrics answers only ``Authorization: Bearer <metrics_token>`` (Prometheus:
    # ``authorization: {credentials_file: ...}``), else 401. Its own secret, not an admin
    # key: a scraper must not be able to send hints. None: open, like vLLM's own /metrics
    # (keep it to the monitoring network). It shows tenant and worker names, and each
    # scrape walks every session in memory.
    metrics_token: str | None = Field(None, min_length=16)

    routing: RoutingSettings = RoutingSettings()
    hints: HintSettings = HintSettings()
    # The Responses API's stored-response ids (responses_ids.py).
    responses: ResponsesSettings = ResponsesSettings()
    # Record the traffic served as session JSONL for `kvhint sim run` (block hashes and
    # lengths, no text; trace_recorder.py): one file per start in this directory. None: off.
    trace_dir: Path | None = None
    # A trace file past this many bytes is rotated (<file>.jsonl -> <file>.jsonl.1 ...),
    # keeping trace_keep_files rotated files of this start; the oldest is deleted
    # (its requests counted, drops_total{what="trace_rotated_out"}). None: no cap.
    trace_max_bytes: int | None = Field(1 << 30, gt=0)
    trace_keep_files: int = Field(4, ge=1)

    # A worker that does not accept the connection in this long is down: the request
    # goes to the next-best worker.
    connect_timeout_s: float = Field(3.0, gt=0)
    # The longest a worker may keep the router waiting for a byte once it has the
    # request: for its answer to start (vLLM sends a non-streamed answer only once it is
    # complete, so this bounds its whole generation) and, within an answer, between two
    # chunks (a stream may last longer in all). Running past it is a 504 (an error event
    # mid-stream); the worker is slow, not down, and may still be running the request,
    # so it is not marked down and the request is not run again elsewhere.
    request_timeout_s: float = Field(600.0, gt=0)
    # How long an idle connection to a worker is kept for reuse. Below the workers' own
    # keep-alive (vLLM's server: 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so the router gives
    # a connection up before the worker closes it: a request written just as the worker
    # closes fails before any answer, and the worker was counted down for it.
    upstream_keepalive_s: float = Field(4.0, gt=0)
    # Worker HTTP health probe period (s) for workers marked down.
    health_probe_s: float = Field(2.0, ge=0.05, description=(
        "At least 0.05 s: a down worker is probed this often; a tinier period sends "
        "probes back to back."))
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)
    # The most bytes of one event a relayed stream (chat, completions, Responses) may
    # send without the event's end (a blank line): past it the router drops them and ends
    # the stream as a broken one (502, its own error event), rather than holding them
    # for as long as a worker or proxy sends them. Above the largest event a worker
    # sends: a Responses stream's terminal event carries the whole response, which
    # echoes the request's instructions and tools (up to max_body_bytes). None: no bound.
    stream_event_max_bytes: int | None = Field(64 * 1024 * 1024, gt=0)
    # The most bytes of a worker's answer the router reads whole (a request without
    # "stream", a stored response's GET or cancel): past it the router stops reading,
    # closes the connection and answers 502, counted as a broken response, rather than
    # holding what a worker or proxy sends for as long as it sends it. Above the largest
    # real answer (n choices with logprobs; a Responses object echoes its request, up to
    # max_body_bytes). None: no bound.
    upstream_answer_max_bytes: int | None = Field(DEFAULT_ANSWER_MAX_BYTES, gt=0)
    # The client-facing HTTP server (h11: httptools bounds no header's size). A request
    # line plus headers over this many bytes is refused and its connection closed.
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    # How long an idle client connection is kept open between requests (s).
    http_keep_alive_s: float = Field(60.0, gt=0)
    # A connection whose request line and headers are not all in this long after it
    # opened (or after a keep-alive request's first byte) is closed: slowloris clients
    # would otherwise hold connections (and http_max_concurrency slots) forever.
    # Counted as kvhint_router_client_timeouts_total{phase="headers"}.
    http_header_timeout_s: float = Field(10.0, gt=0)
    # A request body not all in this long after its headers is answered 408 and its
    # connection closed (also the rest of a body the router answered without reading:
    # an auth error). Counted as client_timeouts_total{phase="body"}. A body of
    # max_body_bytes needs at least max_body_bytes / this bytes per second.
    http_body_timeout_s: float = Field(60.0, gt=0)
    # On shutdown, connections still open after this long (s) are closed (a client that
    # never finishes its request would otherwise hold the shutdown forever).
    http_shutdown_grace_s: float = Field(30.0, gt=0)
    # Connections and requests at once; over it a request is answered 503. None: no cap.
    http_max_concurrency: int | None = Field(10_000, gt=0)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    # Serve /docs, /redoc and /openapi.json (swagger-ui and redoc load from a CDN, on the
    # origin where the dashboard keeps its admin key): off unless asked for.
    api_docs: bool = False
    # Browsers (origin_policy.py). CORS on /v1/chat/completions, /v1/completions and
    # /v1/models only, for these origins ("*": any); none by default. Dev mode: requests
    # whose Host is not localhost, an IP or a dotless name must name one of allowed_hosts.
    cors_allowed_origins: Annotated[list[CorsOrigin], NoDecode] = Field(default_factory=list)
    cors_allow_credentials: bool = False
    allowed_hosts: Annotated[list[AllowedHost], NoDecode] = Field(default_factory=list)

    @field_validator("workers", mode="before")
    @classmethod
    def _parse_workers(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_worker_list(value)
        return value

    @field_validator("worker_api_key")
    @classmethod
    def _worker_api_key(cls, value: SecretStr | None) -> SecretStr | None:
        return refuse_empty_key(value, "worker_api_key")

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("subject_prefix")
    @classmethod
    def _subject_prefix(cls, value: str) -> str:
        Subjects(value)  # its WireDecodeError is a ValueError: pydantic reports it
        return value

    @field_validator("admin_keys", "cors_allowed_origins", "allowed_hosts",
                     "heartbeat_worker_hosts", mode="before")
    @classmethod
    def _parse_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value

    @field_validator("trace_dir", mode="before")
    @classmethod
    def _trace_dir(cls, value: Any) -> Any:
        # Path("") is the working directory: an empty variable meant to turn recording
        # off would record every request's hashes there instead.
        if isinstance(value, str) and not value.strip():
            raise ValueError("trace_dir is empty: give a directory to record traffic in, "
                             f"or leave it unset ({ENV_NULL}) to record none")
        return value

    @field_validator("heartbeat_worker_hosts")
    @classmethod
    def _heartbeat_worker_hosts(cls, value: list[str]) -> list[str]:
        return [parse_host_entry(entry) for entry in value]

    @field_validator("nats_url")
    @classmethod
    def _nats_url(cls, value: str | None) -> str | None:
        # nats-py refusing the URL in the link's connect loop would leave the router
        # without NATS (no index, no hints) while it served on.
        if value and (problem := nats_url_problem(value)):
            raise ValueError(problem)
        return value or None

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        # The plain scheme would pick psycopg2, which we do not ship.
        if value.startswith("postgresql://") or value.startswith("postgres://"):
            return "postgresql+psycopg://" + value.split("://", 1)[1]
        return value

    @model_validator(mode="after")
    def _unique(self) -> RouterSettings:
        ids = [w.id for w in self.workers]
        if len(ids) != len(set(ids)):
            raise ValueError(f"worker ids must be unique: {ids}")
        names = [t.name for t in self.tenants]
        if len(names) != len(set(names)):
            raise ValueError(f"tenant names must be unique: {names}")
        keys = [k for t in self.tenants for k in (*t.api_keys, *t.admin_keys)] + self.admin_keys
        if len(keys) != len(set(keys)):
            raise ValueError("an API key appears twice (keys identify one tenant or admin)")
        for n, tenant in enumerate(self.tenants):
            if tenant.name == DEFAULT_TENANT and (tenant.api_keys or tenant.admin_keys):
                raise ValueError(
                    f"tenants[{n}].name {DEFAULT_TENANT!r} with api_keys or admin_keys: "
                    f"{DEFAULT_TENANT!r} is the global admin's own traffic (its requests "
                    "naming no ?tenant=, all traffic in dev mode); that tenant's keys "
                    "would see and end the global admin's sessions and share its cache "
                    "salt. Rename the tenant, or leave its keys out to configure only "
                    "the budget and limits of that traffic")
        salted: dict[str, str] = {}
        for tenant in self.tenants:
            if tenant.cache_salt is None:
                continue
            if (other := salted.setdefault(tenant.cache_salt, tenant.name)) != tenant.name:
                raise ValueError(f"tenants {other!r} and {tenant.name!r} have the same "
                                 "cache_salt: they would share each other's cached prompts")
        if problem := cors_problem(self.cors_allowed_origins, self.cors_allow_credentials):
            raise ValueError(problem)
        if example := self._example_secrets():
            raise ValueError(f"{', '.join(example)}: still the deploy files' example value "
                             f"({PLACEHOLDER_SECRET_PREFIX}...), public in this repository; "
                             "replace it with a secret of your own (deploy/README.md)")
        return self

    def _example_secrets(self) -> list[str]:
        """The settings whose secret is still one of deploy/'s placeholders (they all
        start with ``change-me``): anyone who read the repository holds it. Named, never
        shown."""
        secrets: list[tuple[str, str | None]] = [
            ("admin_keys", key) for key in self.admin_keys]
        for tenant in self.tenants:
            secrets += [(f"tenants[{tenant.name}].api_keys", key) for key in tenant.api_keys]
            secrets += [(f"tenants[{tenant.name}].admin_keys", key)
                        for key in tenant.admin_keys]
        secrets += [("salt_secret", self.salt_secret), ("metrics_token", self.metrics_token),
                    ("worker_api_key", self.worker_api_key and
                     self.worker_api_key.get_secret_value())]
        secrets += [(f"workers[{w.id}].api_key", w.api_key.get_secret_value())
                    for w in self.workers if w.api_key is not None]
        secrets += [("nats_url password", url_secret(server))
                    for server in nats_servers(self.nats_url)]
        secrets.append(("database_url password", url_secret(self.database_url)))
        return list(dict.fromkeys(
            name for name, secret in secrets
            if is_placeholder_secret(secret)))

    @property
    def dev_mode(self) -> bool:
        """No key configured anywhere: one tenant, open admin API."""
        return not self.admin_keys and not any(t.api_keys or t.admin_keys for t in self.tenants)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Precedence: explicit arguments, then environment, then the config file.
        config_file = getattr(init_settings, "init_kwargs", {}).get("config_file")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if config_file is None:
            config_file = os.environ.get(ENV_PREFIX + "CONFIG_FILE")
            if config_file == ENV_NULL:  # the variable's None, as for every setting
                config_file = None
        if config_file is not None:
            path = Path(config_file)
            if not path.is_file():
                raise FileNotFoundError(f"router config file not found: {path}")
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


def refuse_empty_key(value: SecretStr | None, name: str) -> SecretStr | None:
    """A worker key given but empty (or blank): refused. Almost surely a mistake (an empty
    Kubernetes Secret, a variable set to nothing), and the router would send the workers
    no key at all, quietly; compose refuses an empty ``KVHINT_WORKER_API_KEY`` the same
    way. Sending none is said by leaving the setting unset."""
    if value is not None and not value.get_secret_value().strip():
        raise ValueError(f"{name} is empty (an empty Secret or variable?): the router would "
                         "send the workers no key; give the key their vLLM requires, or "
                         "leave it unset to send none")
    return value


def parse_worker_list(value: str) -> list[dict[str, str]]:
    """``"w0=http://a:8001,w1=http://b:8001"`` -> ``[{id, url}, ...]``."""
    workers = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        worker_id, sep, url = item.partition("=")
        if not sep:
            raise ValueError(f"worker entry {item!r}: expected ID=URL")
        workers.append({"id": worker_id.strip(), "url": url.strip()})
    return workers
