"""A 500 KB session id over a real NATS server to the plugin on vLLM's real scheduler:
a Pin naming it, and donor advice for it, are rejected (the reason quoting its start
only) and nothing is held (schemas._codec.MAX_SESSION_ID_CHARS). Before, the Pin was
accepted and its hold kept the id for its TTL: one such action per message made a
publisher's holds cost gigabytes. A session id as long as any the router makes (321
characters) is pinned as before."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvhint.schemas import DonorAdvice, HintOutcome, Subjects, decode_outcome, encode_advice
from kvhint.schemas._codec import MAX_SESSION_ID_CHARS
from scheduler_fixtures import collect, nats_client, pin_message
from scheduler_fixtures import nats_plugin as plugin
from scheduler_fixtures import turn, until

HUGE = "S" * 500_000
ROUTERS_LONGEST = "t" * 64 + "/" + "c" * 256  # <tenant>/<client session id>


@pytest.fixture(autouse=True)
def _quiet_nats_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="nats")


async def _terminal(outcomes: asyncio.Queue, count: int) -> dict[str, HintOutcome]:
    got: dict[str, HintOutcome] = {}
    while len(got) < count:
        outcome = decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
        if outcome.status.is_terminal:
            got[outcome.action_id] = outcome
    return got


async def test_a_500kb_session_id_is_rejected_and_not_held(
        nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        outcomes = await collect(nc, subjects.outcomes("w0"))
        with plugin(nats_url, subject_prefix, pin_budget_fraction=0.5,
                    create_events_stream=False) as h:
            core, transport = h.connector.core, h.connector.transport
            await until(lambda: transport.set_up)
            turn(h, HUGE, [1, 2, 3])  # resident: without the bound the Pin would hold it
            turn(h, ROUTERS_LONGEST, [4, 5, 6])
            assert core.index.has_session(HUGE) and core.index.has_session(ROUTERS_LONGEST)
            advice = encode_advice(DonorAdvice(
                advice_id="d-long", session_id=HUGE, namespace=core.cache_namespace,
                donor_block_hashes=core.index.session_blocks(ROUTERS_LONGEST),
                similarity=0.9, at=time.time()))
            for message in (pin_message("long", session=HUGE), advice,
                            pin_message("router", session=ROUTERS_LONGEST)):
                assert len(message) < nc.max_payload
            await nc.publish(subjects.hints("w0"), pin_message("long", session=HUGE))
            await nc.publish(subjects.advice("w0"), advice)
            await nc.publish(subjects.hints("w0"),
                             pin_message("router", session=ROUTERS_LONGEST))
            # The advice is answered by the transport on decoding (nothing to apply).
            await until(lambda: len(core.mailbox.inbound) == 2)
            while core.mailbox.inbound:
                h.step()
            got = await _terminal(outcomes, 3)
            long, advised, router = got["long"], got["d-long"], got["router"]
            assert long.status.value == "rejected"
            assert (f"target: session_id is longer than {MAX_SESSION_ID_CHARS} characters"
                    in long.reason)
            assert (advised.action_type, advised.status.value) == ("kv.donor", "rejected")
            assert (f"session_id is longer than {MAX_SESSION_ID_CHARS} characters"
                    in advised.reason)
            assert max(len(long.reason), len(advised.reason)) < 300
            assert router.status.value == "accepted", router.reason
            # Only the router-made session's blocks are held; nothing keeps the long id.
            assert core.executor.pinned_blocks == router.applied.blocks == 3
            remembered = core.mailbox.answered
            assert max(len(o.reason) for o in remembered.values()) < 300
            assert core.counters.internal_errors == 0
