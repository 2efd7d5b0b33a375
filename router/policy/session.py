"""The planner's per-session state and the lifecycle events it reacts to.

:class:`SessionPlanState` is plain, frozen data: the caller stores one per session
(the service persists it with the session; the simulator keeps it in a dict), passes it
into the planner functions and stores the new value they return.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, fields, replace

from kvhint.router.policy.holdings import held_blocks
from kvhint.schemas.outcomes import HintOutcome


class FinishReason(str, enum.Enum):
    STOP = "stop"
    TOOL_CALLS = "tool_calls"
    LENGTH = "length"
    OTHER = "other"

    @classmethod
    def parse(cls, value: str | None) -> FinishReason:
        """OpenAI's finish_reason string (``None``/unknown -> OTHER; ``function_call``
        counts as tool calls)."""
        if value == "function_call":
            return cls.TOOL_CALLS
        try:
            return cls(value)
        except ValueError:
            return cls.OTHER


@dataclass(frozen=True, slots=True)
class Protection:
    """The last protecting action the planner sent for a session (Pin or Retain)."""

    action_id: str
    action_type: str
    worker_id: str
    priority: int
    blocks: int
    expires_at: float


@dataclass(frozen=True, slots=True)
class SessionPlanState:
    """What the planner remembers of one session.

    ``turns``: the depth of the current/last turn: the turns answered before it, plus
    it. A turn that failed does not count (:class:`TurnRouted` ``depth``): its retry
    has the same depth, as the session's record counts its answered turns.
    ``context_tokens``: tokens of the last turn's prompt + completion (the session's chain
    on its worker); ``prompt_tokens``: of the last turn's prompt alone; ``added_tokens``:
    how many tokens that prompt added beyond the turn before it (prompt + completion; 0
    on the first turn).
    ``gap_kind``/``gap_opened_at``: set between a response and the next turn (``gap_kind``
    is a tool name, or ``@user`` refined by tempo); ``gap_predicted_s`` what was
    predicted. ``ended``: explicitly ended or abandoned (idle past the horizon);
    ``ended_explicitly``: the end was explicit (:class:`SessionEnded`, not an abandonment),
    until the session's next turn (the router refuses an agent's hints for such a
    session: its client said it is over).
    """

    session_id: str
    tenant: str
    worker_id: str | None = None
    turns: int = 0
    context_tokens: int = 0
    prompt_tokens: int = 0
    added_tokens: int = 0
    last_activity: float = 0.0
    gap_kind: str | None = None
    gap_opened_at: float | None = None
    gap_predicted_s: float = 0.0
    protection: Protection | None = None
    demoted: bool = False
    # An agent runtime demoted the session through the API in this gap: the planner
    # leaves it to the host tier until its next turn (its reviews would re-protect it).
    agent_demoted: bool = False
    ended: bool = False
    ended_explicitly: bool = False
    # Whether this gap's return/no-return was already observed (see return_window_s).
    return_counted: bool = False
    # The last user gap (response ended with ``stop`` -> next turn), seconds: the
    # session's tempo, which refines the next user gap's kind (stats.user_gap_kind).
    last_user_gap_s: float | None = None

    @property
    def awaiting_return(self) -> bool:
        return self.gap_opened_at is not None and not self.ended

    def settled(self, outcome: HintOutcome) -> SessionPlanState:
        """This state with the worker's terminal answer to its protection folded in
        (:meth:`holding`): the blocks the worker applied; one that applied none (clipped
        to nothing by the worker's budget, blocks already gone, rejected) leaves no
        protection. A non-terminal answer changes nothing."""
        blocks = held_blocks(outcome)
        return self if blocks is None else self.holding(outcome.action_id, blocks)

    def holding(self, action_id: str, blocks: int) -> SessionPlanState:
        """This state with its protection, if it is the action ``action_id``, covering
        ``blocks`` (0: the session holds nothing, so the planner's next review asks again
        instead of believing it held; also for an action that was never sent). Any other
        action (an older one, a shared prefix's) changes nothing. ``self`` when unchanged."""
        current = self.protection
        if current is None or current.action_id != action_id or current.blocks == blocks:
            return self
        return replace(self, protection=replace(current, blocks=blocks) if blocks > 0 else None)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> SessionPlanState:
        """From :meth:`to_dict`'s form. Fields this version does not know (a newer
        router wrote them, and the store outlived it) are left out, at the top level and
        inside ``protection``, so a rolled-back router keeps the rest of the plan instead
        of starting the session afresh. A protection that is still unreadable (a field
        this version needs is missing) is left out alone: the planner then believes the
        session holds nothing and its next review asks again, which is safe.
        Raises TypeError only when the top level lacks what this version needs."""
        raw = _known_fields(cls, data)
        protection = raw.pop("protection", None)
        state = cls(**raw)  # type: ignore[arg-type]
        if isinstance(protection, dict):
            try:
                kept = Protection(**_known_fields(Protection, protection))  # type: ignore[arg-type]
            except TypeError:
                return state
            state = replace(state, protection=kept)
        return state


def _known_fields(cls: type, data: dict[str, object]) -> dict[str, object]:
    """``data`` without the keys that are no field of the dataclass ``cls``."""
    known = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in known}


@dataclass(frozen=True, slots=True)
class TurnRouted:
    """A request of the session was routed to ``worker_id`` (after routing, before the
    response). ``cached_tokens``: the prompt tokens the router's index found cached on
    that worker (None: not known). ``depth``: the turn's depth, its session's answered
    turns plus one (the router counts them: a turn that was refused or failed, which
    the agent retries, is no exchange, and would otherwise deepen every later turn);
    None: one past the state's own ``turns`` (every turn answered, as in the
    simulator)."""

    session_id: str
    tenant: str
    worker_id: str
    prompt_tokens: int
    at: float
    cached_tokens: int | None = None
    depth: int | None = None


@dataclass(frozen=True, slots=True)
class ResponseFinished:
    """The session's response finished. ``tool_names``: names of the tool calls when
    ``finish_reason`` is ``tool_calls`` (may be empty if the client did not say)."""

    session_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    at: float
    tool_names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SessionEnded:
    """Explicit end: ``DELETE /v1/sessions/{id}`` or ``X-Session-End: true``."""

    session_id: str
    at: float
