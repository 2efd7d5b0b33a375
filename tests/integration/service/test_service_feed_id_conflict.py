"""Two servers publishing under one worker id, against a real NATS server: the plugin's
default ``w<rank>`` makes every single-rank server without a worker_id "w0".

Before, the router kept the newer epoch's engine in the index but took every heartbeat
into its worker registry: w0's epoch, address and status swapped at every beat (each
swap a "restart" that reset its hints), and either server's restart swapped the engine
the index followed, with a purge and a snapshot each time. Nothing told the operator.

The "plugins" are this test publishing heartbeats (the epochs need exact control). Their
addresses refuse connections: no request goes to them here.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import annotated_types
import pytest
from pydantic import ValidationError

from conftest import router_settings, running_router
from feed_helpers import router_hearing_nats, status, until
from kvhint.engine_plugin.config import PluginConfig
from kvhint.router.kv_index.stream_types import StreamConfig
from kvhint.router.service.settings import RouterSettings
from kvhint.schemas import Subjects, new_epoch

pytestmark = pytest.mark.usefixtures("throwaway_streams")

URL_A, URL_B = "http://127.0.0.1:1", "http://127.0.0.1:2"
# Engine starts in this order: A's first engine, B's, A's restart, B's restart.
A1, B1, A2, B2 = (new_epoch(t) for t in (1_000.0, 2_000.0, 3_000.0, 4_000.0))


async def test_two_servers_under_one_id_are_reported_and_the_router_keeps_to_one(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reported at the first alternation here (conflict_confirm_s 0): the confirm
    window's default is test_a_surge_rollout_is_not_reported's."""
    monkeypatch.setenv("KVHINT_ROUTER_CONFLICT_CONFIRM_S", "0")
    subjects = Subjects(subject_prefix)
    async with router_hearing_nats(tmp_path, nats_url, subject_prefix) as (
            router, client, nc):
        runtime = router.runtime
        ingestor = runtime.ingestor

        def refused() -> int:
            stream = ingestor.stats().stream
            return stream["stale_status"] + stream["other_source_dropped"]

        async def beat(epoch: str, url: str) -> None:
            await nc.publish(subjects.status("w0"), status("w0", epoch, 0, url))

        async def both(other_epoch: str, rounds: int) -> None:
            """B's beat, then the other's; after each of the other's (refused), w0
            is still B's in the registry too."""
            for _ in range(rounds):
                await beat(B1, URL_B)
                await asyncio.sleep(0.1)
                before = refused()
                await beat(other_epoch, URL_A)
                await until(lambda: refused() > before)  # noqa: B023
                w0 = runtime.workers.get("w0")
                assert (w0.epoch, w0.url) == (B1, URL_B)
                await asyncio.sleep(0.1)

        with caplog.at_level(logging.WARNING, logger="kvhint"):
            await beat(A1, URL_A)
            await until(lambda: runtime.workers.get("w0") is not None
                        and runtime.workers.get("w0").epoch == A1)
            await beat(B1, URL_B)  # B starts: taken as w0's restart (no way to tell)
            await until(lambda: runtime.workers.get("w0").epoch == B1)
            await both(A1, 5)
            assert ingestor.conflicting_workers() == ("w0",)
            # A restarts with an epoch newer than B's: not taken, w0 stays B's.
            await both(A2, 5)

        stream = ingestor.stats().stream
        assert stream["epoch_changes"] == 1 and stream["id_conflicts"] == 1
        assert stream["other_source_dropped"] == 5 and stream["stale_status"] == 5
        warnings = [r.getMessage() for r in caplog.records
                    if "two engines heartbeat" in r.getMessage()]
        assert len(warnings) == 1, warnings  # once per conflict
        assert "w0" in warnings[0] and URL_A in warnings[0] and URL_B in warnings[0]
        text = (await client.get(f"{router.url}/metrics")).text
        assert 'kvhint_router_worker_id_conflict{worker="w0"} 1.0' in text
        assert 'kvhint_router_index_ingest_total{what="stream_id_conflicts"} 1.0' in text
        view = (await client.get(f"{router.url}/admin/workers/w0")).json()
        assert view["url"] == URL_B and view["epoch"] == B1
        assert view["conflict"]["other_url"] == URL_A
        assert view["conflict"]["other_epoch"] == A2


async def test_a_worker_restarting_alone_is_no_conflict(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    """The legitimate case: the engine restarts (a new, newer epoch; the old one gone,
    its last beat late): taken at once, the registry follows, no conflict."""
    subjects = Subjects(subject_prefix)
    async with router_hearing_nats(tmp_path, nats_url, subject_prefix) as (
            router, client, nc):
        runtime = router.runtime
        await nc.publish(subjects.status("w0"), status("w0", A1, 0, URL_A))
        await until(lambda: runtime.workers.get("w0") is not None)
        await nc.publish(subjects.status("w0"), status("w0", A2, 0, URL_A))
        await until(lambda: runtime.workers.get("w0").epoch == A2)
        await nc.publish(subjects.status("w0"), status("w0", A1, 0, URL_A))  # late
        for _ in range(10):
            await nc.publish(subjects.status("w0"), status("w0", A2, 0, URL_A))
            await asyncio.sleep(0.1)
        await until(lambda: runtime.ingestor.stats().stream["stale_status"] == 1)
        assert runtime.workers.get("w0").epoch == A2
        assert runtime.ingestor.conflicting_workers() == ()
        text = (await client.get(f"{router.url}/metrics")).text
        assert "kvhint_router_worker_id_conflict{" not in text
        assert (await client.get(f"{router.url}/admin/workers/w0")).json()["conflict"] \
            is None


async def test_a_surge_rollout_is_not_reported(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Default settings. The new pod (B1) starts while the old one (A1) drains: both beat
    under w0 for a while, then A stops. Nothing is warned of or shown (before: the
    warning, kvhint_router_worker_id_conflict 1 for conflict_hold_s and so the alert);
    the overlap is counted (stream_id_conflicts_unconfirmed) and the registry follows B,
    whose own restart is then taken at once."""
    subjects = Subjects(subject_prefix)
    async with router_hearing_nats(tmp_path, nats_url, subject_prefix) as (
            router, client, nc):
        runtime = router.runtime

        async def beat(epoch: str, url: str) -> None:
            await nc.publish(subjects.status("w0"), status("w0", epoch, 0, url))

        def stream() -> dict[str, int]:
            return dict(runtime.ingestor.stats().stream)

        with caplog.at_level(logging.WARNING, logger="kvhint"):
            await beat(A1, URL_A)
            await until(lambda: runtime.workers.get("w0") is not None)
            await beat(B1, URL_B)
            await until(lambda: runtime.workers.get("w0").epoch == B1)
            for _ in range(8):  # the old pod drains beside the new one
                await beat(B1, URL_B)
                await asyncio.sleep(0.1)
                await beat(A1, URL_A)
                await asyncio.sleep(0.1)
            await until(lambda: stream()["stale_status"] == 8)
            text = (await client.get(f"{router.url}/metrics")).text
            assert "kvhint_router_worker_id_conflict{" not in text
            for _ in range(12):  # A gone: the overlap ends a liveness window (1.5 s) on
                await beat(B1, URL_B)
                await asyncio.sleep(0.25)
            await until(lambda: stream()["id_conflicts_unconfirmed"] == 1)
            await beat(B2, URL_B)  # B's own restart
            await until(lambda: runtime.workers.get("w0").epoch == B2, timeout_s=1.0)
        assert not [r for r in caplog.records if "two engines heartbeat" in r.getMessage()]
        assert stream()["id_conflicts"] == 0 and stream()["deaths"] == 0
        text = (await client.get(f"{router.url}/metrics")).text
        assert "kvhint_router_worker_id_conflict{" not in text
        assert ('kvhint_router_index_ingest_total{what="stream_id_conflicts_unconfirmed"} 1.0'
                in text)
        assert (await client.get(f"{router.url}/admin/workers/w0")).json()["conflict"] \
            is None


async def test_the_followed_servers_restart_is_taken_at_once_during_a_conflict(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """B, followed while the conflict with A is held, restarts: B2's heartbeat names B's
    address (not A's), so the registry follows B2 at once, well inside B1's liveness
    window (1.5 s); before, it waited until B1 was declared dead (w0 purged, its plugin
    down meanwhile). A stays refused."""
    monkeypatch.setenv("KVHINT_ROUTER_CONFLICT_CONFIRM_S", "0")
    subjects = Subjects(subject_prefix)
    async with router_hearing_nats(tmp_path, nats_url, subject_prefix) as (
            router, client, nc):
        runtime = router.runtime

        async def beat(epoch: str, url: str) -> None:
            await nc.publish(subjects.status("w0"), status("w0", epoch, 0, url))

        await beat(A1, URL_A)
        await until(lambda: runtime.workers.get("w0") is not None)
        await beat(B1, URL_B)
        await until(lambda: runtime.workers.get("w0").epoch == B1)
        for _ in range(3):
            await beat(B1, URL_B)
            await asyncio.sleep(0.1)
            await beat(A1, URL_A)
            await asyncio.sleep(0.1)
        await until(lambda: runtime.ingestor.conflicting_workers() == ("w0",))
        await beat(B2, URL_B)
        await until(lambda: runtime.workers.get("w0").epoch == B2, timeout_s=0.5)
        await beat(A1, URL_A)
        await beat(B2, URL_B)
        await asyncio.sleep(0.2)
        w0 = runtime.workers.get("w0")
        assert (w0.epoch, w0.url, w0.plugin_alive) == (B2, URL_B, True)
        stream = runtime.ingestor.stats().stream
        assert stream["deaths"] == 0 and stream["epoch_changes"] == 2
        view = (await client.get(f"{router.url}/admin/workers/w0")).json()
        assert view["conflict"]["other_url"] == URL_A


async def test_the_conflict_hold_is_a_router_setting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KVHINT_ROUTER_CONFLICT_HOLD_S reaches the ingestor the router runs with (before,
    the hold was StreamConfig's 600 s, not a setting); out of its bounds it is refused,
    naming it. Its floor is the plugin's longest heartbeat interval: a shorter hold would
    end between two of the other engine's beats (the conflict found, and warned of, anew
    at each)."""
    assert RouterSettings().conflict_hold_s == StreamConfig().conflict_hold_s
    (longest,) = [m.le for m in PluginConfig.model_fields["heartbeat_interval_s"].metadata
                  if isinstance(m, annotated_types.Le)]
    for bad in ("0", str(longest - 1), "86401"):
        monkeypatch.setenv("KVHINT_ROUTER_CONFLICT_HOLD_S", bad)
        with pytest.raises(ValidationError) as refused:
            router_settings(tmp_path, [])
        assert "conflict_hold_s" in str(refused.value)
    monkeypatch.setenv("KVHINT_ROUTER_CONFLICT_HOLD_S", str(longest))
    assert router_settings(tmp_path, []).conflict_hold_s == longest
    monkeypatch.setenv("KVHINT_ROUTER_CONFLICT_HOLD_S", "900")
    async with running_router(router_settings(tmp_path, [])) as router:
        assert router.runtime.ingestor.config.conflict_hold_s == 900.0


async def test_the_conflict_confirm_window_is_a_router_setting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KVHINT_ROUTER_CONFLICT_CONFIRM_S reaches the ingestor the router runs with; out of
    its bounds it is refused, naming it; 0 reports a conflict at once."""
    assert RouterSettings().conflict_confirm_s == StreamConfig().conflict_confirm_s == 300.0
    for bad in ("-1", "3601"):
        monkeypatch.setenv("KVHINT_ROUTER_CONFLICT_CONFIRM_S", bad)
        with pytest.raises(ValidationError) as refused:
            router_settings(tmp_path, [])
        assert "conflict_confirm_s" in str(refused.value)
    monkeypatch.setenv("KVHINT_ROUTER_CONFLICT_CONFIRM_S", "0")
    assert router_settings(tmp_path, []).conflict_confirm_s == 0.0
    monkeypatch.setenv("KVHINT_ROUTER_CONFLICT_CONFIRM_S", "120")
    async with running_router(router_settings(tmp_path, [])) as router:
        assert router.runtime.ingestor.config.conflict_confirm_s == 120.0
