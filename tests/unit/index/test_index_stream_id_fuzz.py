"""Randomized: rollouts and misconfigured servers under one worker id, driven through
:class:`WorkerStream` (router/kv_index/stream_sources.py), over seeds.

- Surge rollouts, one after another (every 100-400 s), the new pod at its own address,
  all behind one Service address, or naming none: the old pod serves until the new one is
  ready, then drains and stops; the newest pod's container may crash once and restart at
  its address (before it is ready, or while the old one drains). Heartbeats jitter, 1%
  are lost; batches come between them. No overlap reaches conflict_confirm_s: nothing
  is ever reported. Before, a new pod's restart made its address "a server that came
  back" (reported at once, at its next rollout too).
- A second server crash-looping beside a stable one (up 30-200 s, down 5-120 s, each at
  its own address): the stable one is followed throughout (no purge, no swap at the
  other's restarts), and the conflict is reported by conflict_confirm_s after it was
  found, and stays reported.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from kvhint import schemas as s
from kvhint.router.kv_index.stream import StreamConfig, WorkerStream

STEP_S = 0.1
INTERVAL_S = 1.0
SEEDS = range(12)


@dataclass
class Pod:
    url: str | None
    epoch: str
    next_beat: float
    seq: int = 0
    beat: bool = False            # its engine's first heartbeat went out
    crashed: bool = False         # it crashed once already (at most once a pod)
    down_until: float | None = None
    ready_at: float | None = None
    stop_at: float | None = None


class Fleet:
    """Pods under w0 and the router's stream of them, on one clock."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.now = 1000.0
        self.stream: WorkerStream[None] = WorkerStream("w0", StreamConfig())
        self.reports = 0

    def start(self, url: str | None) -> Pod:
        return Pod(url, s.new_epoch(self.now), self.now + self.rng.uniform(0, INTERVAL_S))

    def restart(self, pod: Pod) -> None:
        pod.epoch, pod.seq, pod.down_until, pod.beat = s.new_epoch(self.now), 0, None, False
        pod.next_beat = self.now + self.rng.uniform(0, INTERVAL_S)

    def publish(self, pod: Pod) -> None:
        """One step of a running pod: maybe a batch, its heartbeat when due. An engine's
        first heartbeat goes out before its first batch (the plugin's publisher beats
        first, on the connection its batches take)."""
        if pod.beat and self.rng.random() < 0.1:
            pod.seq += 1
            self.stream.on_batch(pod.epoch, pod.seq, None, self.now)
        if self.now < pod.next_beat:
            return
        pod.next_beat = self.now + INTERVAL_S * self.rng.uniform(0.9, 1.1)
        if pod.beat and self.rng.random() < 0.01:
            return  # lost
        pod.beat = True
        decision = self.stream.on_status(pod.epoch, pod.seq, INTERVAL_S, self.now, url=pod.url)
        self.reports += decision.id_conflict

    def step(self) -> None:
        self.now += STEP_S
        self.stream.tick(self.now)


def _address(mode: str, n: int) -> str | None:
    return {"own": f"http://pod-{n}:8000", "service": "http://vllm:8000", "none": None}[mode]


@pytest.mark.parametrize("mode", ["own", "service", "none"])
@pytest.mark.parametrize("seed", SEEDS)
def test_rollouts_with_restarting_pods_are_never_reported(mode: str, seed: int) -> None:
    rng = random.Random(seed)
    fleet = Fleet(rng)
    pods = [fleet.start(_address(mode, 0))]
    pods[0].ready_at = fleet.now
    next_rollout, n = fleet.now + rng.uniform(100, 400), 0
    for _ in range(30_000):
        fleet.step()
        now = fleet.now
        if now >= next_rollout:
            n += 1
            pods.append(fleet.start(_address(mode, n)))
            next_rollout = now + rng.uniform(100, 400)
        newest = pods[-1]
        if newest.ready_at is None and newest.down_until is None:
            newest.ready_at = now + rng.uniform(20, 60)
        for pod in list(pods):
            if pod is not newest and newest.ready_at is not None and now >= newest.ready_at:
                pod.stop_at = pod.stop_at or now + rng.uniform(0, 30)  # drains, then stops
            if pod.stop_at is not None and now >= pod.stop_at:
                pods.remove(pod)
                continue
            if pod.down_until is not None:
                if now < pod.down_until:
                    continue
                fleet.restart(pod)
            if pod is newest and not pod.crashed and rng.random() < 0.0005:
                pod.crashed, pod.down_until = True, now + rng.uniform(5, 60)
                if pod.ready_at is not None and now < pod.ready_at:
                    pod.ready_at = None  # not ready yet: the old pod waits
                continue
            fleet.publish(pod)
        assert fleet.stream.conflict(now) is None, (seed, now)
    assert fleet.reports == 0
    assert fleet.stream.counters.id_conflicts == 0


@pytest.mark.parametrize("seed", SEEDS)
def test_a_crash_looping_second_server_is_reported_and_never_followed(seed: int) -> None:
    rng = random.Random(seed)
    fleet = Fleet(rng)
    loop = fleet.start("http://server-a:8000")
    fleet.step()
    stable = fleet.start("http://server-b:8000")
    loop.stop_at = fleet.now + rng.uniform(30, 200)
    found = None
    for _ in range(12_000):
        fleet.step()
        now = fleet.now
        if loop.down_until is not None and now >= loop.down_until:
            fleet.restart(loop)
            loop.stop_at = now + rng.uniform(30, 200)
        elif loop.down_until is None and loop.stop_at is not None and now >= loop.stop_at:
            loop.down_until = now + rng.uniform(5, 120)
        if loop.down_until is None:
            fleet.publish(loop)
        fleet.publish(stable)
        if now > 1010.0:
            assert fleet.stream.epoch == stable.epoch, (seed, now)
        if found is None and fleet.stream.counters.other_source_dropped + \
                fleet.stream.counters.stale_status >= 2:
            found = now
        if found is not None and now - found > fleet.stream.config.conflict_confirm_s + 130:
            # Reported (the other may be down: a restart, up to 120 s, does not end it).
            assert fleet.stream.conflict(now) is not None, (seed, now)
    assert fleet.reports == 1
    assert fleet.stream.counters.epoch_changes <= 1  # B over A at its start, if A was first
