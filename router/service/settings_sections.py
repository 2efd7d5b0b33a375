"""The nested sections of :class:`RouterSettings` that tune one part of the router:
``routing:`` (RoutingSettings), ``hints:`` (HintSettings) and ``model_prompts.<model>:``
(ModelPromptSettings). Each is a frozen pydantic model that forbids unknown keys; its
fields, defaults and bounds are what an operator sets under that key (in the config file,
or ``KVHINT_ROUTER_<SECTION>__<FIELD>``), and REFERENCE.md's settings table is held to
them (tests/unit/test_readme_reference.py). Nothing here reads the environment or a file
of settings: :mod:`kvhint.router.service.settings` composes them.
"""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from kvhint.router.policy import RoutingConfig, RoutingPolicy


class RoutingSettings(BaseModel, frozen=True, extra="forbid"):
    # kvhint (cache + load + bounded session affinity), kv_aware, session_affinity or
    # round_robin: the policy functions in kvhint.router.policy.routing.
    policy: str = "kvhint"
    # The kvhint policy keeps a worker whose recent uncached prefill exceeds the fleet mean
    # by more than 8% from taking new work (hot-spot protection). At low load a single
    # long prompt is already 8% "over", and new sessions would leave the worker that holds
    # their shared prefix (a session's own worker keeps it anyway unless the excess beats
    # its cached tokens); this many tokens are added to every worker's count, so the
    # excess must also be material in absolute terms (~8% of this). 0 turns it off.
    balance_floor_tokens: float = Field(RoutingConfig().balance_floor_tokens, ge=0)
    # A new session's first turn pays this many times its prompt tokens per recently
    # placed session a worker has above the least (kvhint policy): spreads bursts of new
    # sessions that share a cached system prompt. Off by default; measured to cost cache
    # hits on the agent bench and in the simulator (BENCHMARKS.md).
    new_session_spread: float = Field(0.0, ge=0)
    # Prompts estimated at this many tokens or more are tokenized and hashed on the
    # router's hashing thread, not on the event loop (a long agent context would stall
    # every other request's stream for tens of ms); shorter ones inline, where the thread
    # hop costs more than it saves. 0: every prompt on the thread.
    hash_thread_min_tokens: int = Field(2048, ge=0)
    # A body over this many bytes is always hashed on the thread, whatever its estimate
    # (text in odd fields or a million empty messages renders to many more tokens than
    # the estimate counts; a body has at least about as many bytes as its prompt tokens).
    hash_inline_max_bytes: int = Field(8192, ge=0)
    # Threads hashing long prompts, and the most hash jobs one tenant may have waiting
    # for them. The threads serve the tenants' queues in turn (service/hash_queue.py):
    # one tenant's burst of long prompts delays another's by about one job, not the
    # burst. A job over the bound is routed without prompt hashes (counted as
    # drops_total{what="prompt_hashing:tenant_queue_full"}).
    hash_threads: int = Field(1, ge=1, le=64)
    hash_queue_per_tenant: int = Field(64, ge=1)
    # The longest prompt (tokens) the workers take: set it to the models' --max-model-len.
    # Longer prompts are routed without prefix hashes (vLLM refuses them anyway; counted
    # as prompt_hashing:over_max_length), and a session keeps at most this many tokens
    # of block hashes.
    max_prompt_tokens: int = Field(131072, ge=1)
    # How long (s) an ended or idle session stays in memory before it is forgotten.
    session_forget_s: float = Field(3600.0, gt=0)
    # How long a turn (an end, a hints call) of a session id this router holds no record
    # of waits for the store to give the session's row (another replica's session, or one
    # forgotten): past it, or with the store failing, the turn starts a record of its own,
    # counted (service/session_reads.py).
    session_read_timeout_s: float = Field(0.5, gt=0, le=10)
    # Whether each turn (end, hints call) of a session held in memory reads its row first,
    # to continue turns another replica served since (session_reads.StoredSessions.latest):
    # one primary-key read per turn, 0.4-0.8 ms of the router's CPU (BENCHMARKS.md). None:
    # on with a PostgreSQL store (the store replicas share), off with a SQLite file (one
    # router's own). Off: a router that is the store's only replica, or behind a load
    # balancer keeping each session on one replica, saves that read; saves still merge
    # another replica's (session_merge.py).
    session_refresh: bool | None = None
    # This replica's name among those sharing the store, unique to it and kept across its
    # restarts (a pod's name, a host's): a session's row names the replica that saw its
    # latest event, and one restarting leaves the idle review of a session another
    # replica served last to that replica (service/idle_reviews.py). None: rows name
    # none, and a restart reviews every session it restores (as before the setting).
    replica_id: str | None = Field(None, min_length=1, max_length=128)
    # The most sequences one prompt may ask to sample (``n``, or ``best_of``); more is a
    # 400 (sampling.py). Each is a sequence decoding on the worker beside every other
    # tenant's, and a session continues at most one of them (response_scan.py).
    max_n: int = Field(16, ge=1)
    # The most sequences one request may ask in all: its prompts (a /v1/completions batch:
    # vLLM runs each as a request of its own) x max(n, best_of); more is a 400. At least
    # max_n (one prompt's n is never refused by the total).
    max_sequences: int = Field(256, ge=1)
    seed: int = 0

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        try:
            return RoutingPolicy(value).value
        except ValueError:
            known = ", ".join(p.value for p in RoutingPolicy)
            raise ValueError(f"routing.policy {value!r}: one of {known}") from None

    @model_validator(mode="after")
    def _sequences_hold_one_prompts_n(self) -> RoutingSettings:
        if self.max_sequences < self.max_n:
            raise ValueError(f"routing.max_sequences {self.max_sequences} is under "
                             f"routing.max_n {self.max_n}: one prompt's n would be refused")
        return self


class HintSettings(BaseModel, frozen=True, extra="forbid"):
    enabled: bool = True
    # How long the hints API waits for a worker's terminal outcome before answering 202.
    api_outcome_timeout_s: float = Field(5.0, ge=0, le=60)
    # For this long after the router starts, a hints call for a worker whose plugin it
    # has not heard yet waits for the first heartbeat (the plugin's default interval is
    # 2 s) instead of answering 503 at once. 0: never wait.
    api_heartbeat_wait_s: float = Field(5.0, ge=0, le=60)
    # Hints calls of one tenant open at once (each waits up to its wait_s, 60 s at most,
    # for its actions' outcomes); one more is a 429 with Retry-After (hint_open_calls.py).
    api_max_open_calls: int = Field(64, ge=1)
    # Planner tick (idle decay, expiries), seconds.
    tick_s: float = Field(1.0, ge=0.05, description=(
        "At least 0.05 s: each tick walks every session in memory on the event loop; "
        "a tinier one would run it back to back."))


class ModelPromptSettings(BaseModel, frozen=True, extra="forbid"):
    """The vLLM server flags that shape a served model's prompt, as its workers were
    started with: the router renders prompts the same way to hash them (a worker started
    with ``--chat-template`` renders other tokens than the tokenizer's template, and every
    predicted hit would miss)."""

    # ``--chat-template``: a file path, or the template itself (vLLM's rule: a value that
    # does not open as a file and has no ``{``, ``}`` or newline is a path that failed).
    chat_template: str | None = None
    # ``--default-chat-template-kwargs`` (JSON object).
    default_chat_template_kwargs: dict[str, Any] | None = None
    # ``--exclude-tools-when-tool-choice-none``.
    exclude_tools_when_tool_choice_none: bool = False

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return Path(value).expanduser().read_text()
        except (OSError, ValueError):
            if not any(c in value for c in "{}\n"):
                raise ValueError(f"chat_template {value!r} looks like a file path, but it "
                                 "could not be read") from None
            return codecs.decode(value, "unicode_escape")
