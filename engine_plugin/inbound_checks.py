"""Checks the core makes on inbound actions before the executor works on them, and the
``rejected`` outcomes it answers itself (no vLLM, no state: PluginCore calls these)."""

from __future__ import annotations

from kvhint.schemas import (
    REJECTED_INTERNAL_ERROR,
    DecodedHints,
    HintOutcome,
    InvalidAction,
    OutcomeStatus,
    ParsedAction,
    decode_hints,
)
from kvhint.schemas.outcomes import REJECTED_NO_PREFIX_CACHE

# The reason of an action the plugin failed on (a bug, counted as kvhint:internal_errors
# and logged once): transient for the router (schemas.is_transient_rejection).
INTERNAL_ERROR_REASON = (f"{REJECTED_INTERNAL_ERROR} in the kvhint plugin (logged in the "
                         "engine); this action may be sent again")


# The reason of every action and advice on a worker whose vLLM runs without prefix caching
# (``--no-enable-prefix-caching``, or a model vLLM cannot prefix-cache): nothing is cached,
# so nothing can be held or found. Not transient: the router learns the worker applies none.
NO_PREFIX_CACHE_REASON = (f"{REJECTED_NO_PREFIX_CACHE} (vLLM runs without "
                          "--enable-prefix-caching): there is no cache to hold or find "
                          "blocks in; nothing changed")


def type_name(action: ParsedAction | InvalidAction) -> str:
    return action.action_type.value if isinstance(action, ParsedAction) else action.action_type


def too_many_hashes(hashes: list[int] | None, limit: int, what: str) -> str | None:
    """Why naming ``hashes`` is refused on a pool of ``limit`` blocks, or None: more
    cannot be resident, and each is looked up on the scheduler thread (a 1 MB message
    names ~45k)."""
    if hashes is None or len(hashes) <= limit:
        return None
    return (f"invalid payload: {what} names {len(hashes)} block hashes, more than the "
            f"{limit} blocks of this worker's GPU cache (more cannot be resident)")


def too_many_tokens(prefix_tokens: int | None, limit: int, block_size: int) -> str | None:
    """Why a target's ``prefix_tokens`` is refused on a pool of ``limit`` blocks of
    ``block_size`` tokens, or None: as with :func:`too_many_hashes`, more cannot be
    resident (and an unbounded number would be echoed back in the outcome's
    ``requested``, past what the router can store)."""
    if prefix_tokens is None or prefix_tokens <= limit * block_size:
        return None
    return (f"invalid payload: target prefix_tokens {prefix_tokens} is more than the "
            f"{limit * block_size} tokens ({limit} blocks of {block_size}) of this "
            "worker's GPU cache (more cannot be resident)")


def within_pool(action: ParsedAction | InvalidAction, limit: int, block_size: int
                ) -> ParsedAction | InvalidAction:
    """``action``, or an InvalidAction (answered ``rejected``) when its target names more
    block hashes than the pool has blocks (:func:`too_many_hashes`), or more prefix
    tokens than they hold (:func:`too_many_tokens`)."""
    if isinstance(action, ParsedAction):
        target = action.payload.target
        problem = (too_many_hashes(target.block_hashes, limit, "target")
                   or too_many_tokens(target.prefix_tokens, limit, block_size))
        if problem is not None:
            return InvalidAction(action.action_id, action.action_type.value, problem)
    return action


def rejected(worker_id: str, message_id: str, action_id: str, action_type: str, reason: str,
             at: float) -> HintOutcome:
    return HintOutcome(message_id=message_id, action_id=action_id, action_type=action_type,
                       worker_id=worker_id, status=OutcomeStatus.REJECTED, reason=reason,
                       at=at)


def decode_hints_safely(data: bytes | str) -> tuple[DecodedHints, Exception | None]:
    """``data`` decoded, and None; the transport (off the scheduler thread) and the core
    (a message posted undecoded) both decode through here. ``decode_hints`` answers any
    bad input in what it returns, a malformed envelope as a message naming no action
    (answered ``rejected``, "malformed hints message: ..."); should it raise all the same
    (a bug, for the caller to count), the message is answered the same way, with what
    was raised as the reason, and the exception is returned."""
    try:
        return decode_hints(data), None
    except Exception as exc:  # the decoder's bug must not cost the message its answer
        reason = f"could not be decoded ({type(exc).__name__}: {exc}); not applied"
        return DecodedHints(message_id="", actions=[], error=reason), exc
