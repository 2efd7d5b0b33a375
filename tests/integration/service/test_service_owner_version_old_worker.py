"""An agent's action asked for as ``action_version`` 1.2 through the hints API goes to a
worker that does not take ``owner`` on its type (a plugin of an earlier release: 1.0
Prefetch, 1.0/1.1 Retain) as the lowest version that carries what is left once the API
has taken ``owner`` out: a version that worker advertises. Before, it went out as 1.2,
which that worker rejects (``unsupported action_version``) though nothing of 1.2 was in
it; a 1.2 Prefetch was refused by the router itself until kv.prefetch 1.2 came.

The real router app, its SQLite store and a real NATS server; w0's plugin is played
(:class:`feed_helpers.AcceptingPlugin`), and the test reads the wire versions sent."""

from __future__ import annotations

from pathlib import Path

import msgspec
import nats
import pytest

from conftest import StubWorker
from feed_helpers import ACTIONS, chat, router_with_accepting_plugin, until
from kvhint.schemas import Subjects

pytestmark = pytest.mark.usefixtures("throwaway_streams")

# A plugin of the release before: owner on kv.retain only as 1.1 at most, kv.prefetch 1.0.
OLD = {**ACTIONS, "kv.retain": ["1.0", "1.1"]}


async def test_an_agents_1_2_action_goes_to_an_older_worker_as_a_version_it_takes(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    wire: dict[str, tuple[str, str, dict]] = {}  # action id: (type, version, payload)

    async def seen(msg) -> None:  # noqa: ANN001 - what w0 is sent, as sent
        for raw in msgspec.json.decode(msg.data)["actions"]:
            wire[raw["action_id"]] = (raw["action_type"], raw["action_version"],
                                      raw["payload"])

    await nc.subscribe(subjects.hints("w0"), cb=seen)
    try:
        async with router_with_accepting_plugin(tmp_path, nats_url, subject_prefix,
                                                stub_workers[0], actions=OLD,
                                                hints={"enabled": False}
                                                ) as (router, client, _plugin):
            await chat(client, router.url, "s", "y" * 400)
            answer = await client.post(f"{router.url}/v1/sessions/s/hints", json={
                "actions": [
                    {"action_type": "kv.prefetch", "action_version": "1.2",
                     "payload": {"deadline_s": 10}},
                    {"action_type": "kv.retain", "action_version": "1.2",
                     "payload": {"priority": 5, "ttl_s": 60}},
                    {"action_type": "kv.retain", "action_version": "1.2",
                     "payload": {"priority": 5, "ttl_s": 60, "evict_rest_first": True}}]})
            assert answer.status_code in (200, 202), answer.text
            ids = [a["action_id"] for a in answer.json()["actions"]]
            await until(lambda: set(ids) <= set(wire))
            versions = [wire[i][1] for i in ids]
            assert versions == ["1.0", "1.0", "1.1"], versions
            for action_type, version, payload in (wire[i] for i in ids):
                assert version in OLD[action_type] and "owner" not in payload
    finally:
        await nc.drain()
