"""Two router replicas behind one address (one PostgreSQL store, one NATS, the same
workers, tenants and salt_secret), as a load balancer spreads an agent's requests: a
follow-up (``previous_response_id``), GET or cancel that lands on the replica that did not
relay the response reaches the worker that holds it, and only for the tenant it was made
for, a follow-up naming no session continuing its response's session (read from the
store: test_service_responses_shared_sessions.py has the rest); a worker restarted since
is still a 404 saying so. Before, the id -> worker map was each replica's own and the
other replica answered 404.

Stand-in workers answer in vLLM 0.32's shapes (test_service_responses_api.py), as the
same paths against real vLLM servers are single-router (tests/e2e/service)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path

import httpx
import nats
import pytest
from conftest import RunningRouter, router_settings, running_router, sample, scrape
from feed_helpers import status, until
from test_service_responses_api import TENANTS, ResponsesStub, create, events

from kvhint.router.service.settings import RouterSettings
from kvhint.schemas import Subjects
from kvhint.schemas.status import new_epoch

pytestmark = pytest.mark.usefixtures("throwaway_streams")

ACME, BETA = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}


@pytest.fixture
async def holders(tiny_model_dir: Path) -> AsyncIterator[dict[str, ResponsesStub]]:
    workers = {"w0": ResponsesStub(str(tiny_model_dir)),
               "w1": ResponsesStub(str(tiny_model_dir))}
    for worker in workers.values():
        await worker.start()
    try:
        yield workers
    finally:
        for worker in workers.values():
            await worker.stop()


def _replica(tmp_path: Path, workers: dict[str, ResponsesStub], database_url: str,
             nats_url: str, subject_prefix: str) -> RouterSettings:
    """What every replica is configured with (one config file, several pods)."""
    return router_settings(tmp_path, [(w, s.url) for w, s in workers.items()],
                           tenants=TENANTS, salt_secret="replicas-share-this-secret",
                           database_url=database_url, nats_url=nats_url,
                           subject_prefix=subject_prefix)


@contextmanager
def _nothing_sent(workers: dict[str, ResponsesStub]) -> Iterator[None]:
    before = [(len(s.received), len(s.fetched)) for s in workers.values()]
    yield
    assert [(len(s.received), len(s.fetched)) for s in workers.values()] == before


async def _make_on_both_workers(client: httpx.AsyncClient, router: RunningRouter
                                ) -> dict[str, tuple[str, str | None]]:
    """acme's responses through ``router``: one made without a session, then one in
    a session of its own until each worker holds one: id -> (worker, session)."""
    made: dict[str, tuple[str, str | None]] = {}
    url = f"{router.url}/v1/responses"
    for number in range(40):
        if number and {w for w, s in made.values() if s} == {"w0", "w1"}:
            return made
        session = f"s{number}" if number else None
        extra = {} if session is None else {"session_id": session}
        answer = await client.post(url, json=create(**extra), headers=ACME)
        assert answer.status_code == 200, answer.text
        made[answer.json()["id"]] = (answer.headers["x-kvhint-worker"], session)
    raise AssertionError("every new session went to one worker")


async def test_a_replica_reaches_the_responses_another_relayed(
        tmp_path: Path, database_url: str, nats_url: str, subject_prefix: str,
        holders: dict[str, ResponsesStub]) -> None:
    if not database_url.startswith("postgresql"):
        pytest.skip("replicas share a PostgreSQL store; SQLite is one router's own")
    settings = _replica(tmp_path, holders, database_url, nats_url, subject_prefix)
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(nc.drain)
        a = await stack.enter_async_context(running_router(settings))
        b = await stack.enter_async_context(running_router(settings))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        for router in (a, b):
            # Set up: wait_connected comes before the subscriptions and streams.
            assert await router.runtime.link.wait_set_up(10)
        epochs = {w: new_epoch(time.time()) for w in holders}
        for worker, stub in holders.items():  # the workers' plugins, heard by both
            await nc.publish(subjects.status(worker), status(worker, epochs[worker], 0,
                                                             url=stub.url))
        await until(lambda: all(r.runtime.workers.get(w).epoch == epochs[w]
                                for r in (a, b) for w in holders))
        made = await _make_on_both_workers(client, a)
        await a.runtime.writer.flush()  # their sessions in the store (written behind)
        url = f"{b.url}/v1/responses"
        for response_id, (worker, session) in made.items():
            holder = holders[worker]
            with _nothing_sent({w: s for w, s in holders.items() if w != worker}):
                follow = await client.post(url, headers=ACME, json=create(
                    previous_response_id=response_id, stream=True))
                assert follow.status_code == 200, follow.text
                assert follow.headers["x-kvhint-worker"] == worker
                assert holder.received[-1]["previous_response_id"] == response_id
                # B reads the session A relayed it in from the store, and continues it.
                if session is None:
                    assert "session_id" not in holder.received[-1]
                else:
                    assert holder.received[-1]["session_id"] == f"acme/{session}"
                if session is not None:
                    named = await client.post(url, headers=ACME | {"X-Session-ID": session},
                                              json=create(previous_response_id=response_id))
                    assert named.headers["x-kvhint-worker"] == worker
                    assert holder.received[-1]["session_id"] == f"acme/{session}"
                got = await client.get(f"{url}/{response_id}", headers=ACME)
                assert got.status_code == 200 and got.json()["id"] == response_id
                assert holder.fetched[-1] == response_id
                cancel = await client.post(f"{url}/{response_id}/cancel", headers=ACME)
                assert cancel.status_code == 400 and "synchronous" in cancel.text
            # And back: the follow-up B named is reached through A.
            streamed_id = events(follow.text)[0][1]["response"]["id"]
            await b.runtime.writer.flush()
            back = await client.post(f"{a.url}/v1/responses", headers=ACME,
                                     json=create(previous_response_id=streamed_id))
            assert back.status_code == 200 and back.headers["x-kvhint-worker"] == worker
            if session is not None:
                assert holder.received[-1]["session_id"] == f"acme/{session}"
        # Another tenant, on either replica: the id is unknown to it, word for word as
        # one never made, and nothing reaches a worker.
        response_id = next(iter(made))
        unknown = (await client.get(f"{url}/resp_nope", headers=BETA)).json()
        expected = json.loads(json.dumps(unknown).replace("resp_nope", response_id))
        with _nothing_sent(holders):
            for router in (a, b):
                base = f"{router.url}/v1/responses"
                for answer in (
                        await client.get(f"{base}/{response_id}", headers=BETA),
                        await client.post(f"{base}/{response_id}/cancel", headers=BETA),
                        await client.post(base, headers=BETA, json=create(
                            previous_response_id=response_id))):
                    assert answer.status_code == 404 and answer.json() == expected
            # One character changed: checks out for no tenant.
            tampered = response_id[:-1] + ("0" if response_id[-1] != "0" else "1")
            refused = await client.get(f"{url}/{tampered}", headers=ACME)
            assert refused.status_code == 404, refused.text
            assert refused.json() == json.loads(json.dumps(unknown).replace(
                "resp_nope", tampered))
        # w0's engine restarts: vLLM's store went with it, on every replica's word.
        on_w0 = next(r for r, (w, _s) in made.items() if w == "w0")
        await nc.publish(subjects.status("w0"), status(
            "w0", new_epoch(time.time() + 1), 1, url=holders["w0"].url))
        await until(lambda: all(r.runtime.workers.get("w0").epoch != epochs["w0"]
                                for r in (a, b)))
        with _nothing_sent(holders):
            for router in (a, b):
                gone = await client.post(f"{router.url}/v1/responses", headers=ACME,
                                         json=create(previous_response_id=on_w0))
                assert gone.status_code == 404
                assert "worker w0, which stored it, has restarted since" in gone.text
        samples = await scrape(client, b.url)
        # B read each of A's ids from the id itself, at every request that named one
        # (3, and the follow-up naming its session), and at the restart's.
        in_session = sum(session is not None for _w, session in made.values())
        assert sample(samples, "kvhint_router_response_ids_read_total") == (
            3 * len(made) + in_session + 1)
        # Beta's 3 requests for acme's id and the changed id: B never relayed that id,
        # so it checks the tag for the requester only (one HMAC): all 4 unverified.
        assert sample(samples, "kvhint_router_response_id_misses_total",
                      reason="other_tenant") == 0
        assert sample(samples, "kvhint_router_response_id_misses_total",
                      reason="unverified") == 4
        assert sample(samples, "kvhint_router_response_id_misses_total",
                      reason="worker_restarted") == 1
        # Each follow-up naming no session read its session from the store.
        assert sample(samples, "kvhint_router_response_session_reads_total",
                      outcome="found") == in_session
        assert sample(samples, "kvhint_router_drops_total",
                      what="response_session_unknown") is None
