"""What a session's protection covers: the part of its chain the next turn reads.

A turn's prompt always extends the previous prompt, so the next turn reads that prompt's
blocks. Whether it also reads the blocks holding the previous *response* is up to the
workload: vLLM caches output blocks, and a chat template that renders the assistant
message back into the tokens the model produced lets the next turn read them; one that
re-renders tool calls, strips reasoning, or a trace that never reuses outputs (the
Mooncake format) does not. The planner learns which from each next turn
(:func:`completion_read`, folded into the statistics as a
:class:`~kvhint.router.policy.stats.CompletionReadObserved`) and protects accordingly
(:func:`protected_tokens`). Pure functions, like the rest of the planner.
"""

from __future__ import annotations

from kvhint.router.policy.plan_types import PlannerContext
from kvhint.router.policy.session import SessionPlanState, TurnRouted


def protected_tokens(ctx: PlannerContext, session: SessionPlanState) -> int:
    """The tokens of ``session``'s chain a protection covers: what its next turn is
    expected to read. That is its last prompt, and the last response's tokens too while
    next turns are seen reading them (:meth:`LearnedStats.completion_read_probability` at
    least one half). Response blocks a next turn never reads would hold cache space for
    nothing through the whole gap; a session state from before prompts were recorded
    (``prompt_tokens`` 0) keeps its whole context."""
    if session.prompt_tokens <= 0 or ctx.stats.completion_read_probability() >= 0.5:
        return session.context_tokens
    return min(session.prompt_tokens, session.context_tokens)


def completion_read(ctx: PlannerContext, session: SessionPlanState | None,
                    event: TurnRouted) -> bool | None:
    """Whether this turn read its session's previous response's KV; None when the turn
    does not tell: a new session, one with no response finished since its last turn
    (overlapping requests), another worker, no cached count, a previous response
    that filled no block of its own, a prompt too short to reach one, or a previous
    prompt no longer wholly cached (then a missing response block may just have been
    evicted: vLLM frees a request's blocks leaf first, so with the prompt's last block
    still cached, its response blocks most likely are too)."""
    if session is None or event.cached_tokens is None or session.prompt_tokens <= 0 or (
            session.gap_opened_at is None):
        return None
    worker = ctx.workers.get(event.worker_id)
    if worker is None or session.worker_id != event.worker_id:
        return None
    block = max(worker.block_size, 1)
    prompt_end = session.prompt_tokens // block * block
    if session.context_tokens // block * block <= prompt_end:
        return None
    if event.prompt_tokens <= prompt_end + block or event.cached_tokens < prompt_end:
        return None
    return event.cached_tokens > prompt_end
