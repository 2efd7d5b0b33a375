""""The index can be rebuilt by replaying events", at the level the router relies on it:
a router that restarts and replays the events stream from its start (the JetStream
ordered consumer, ``router/service/cluster_feed.py``) through the ingestor ends with the
index a router that ran all along built, session placements included, for both index
implementations. (``test_index_replay`` replays domain events into one implementation;
this replays the wire messages, epochs, redeliveries and all.)"""

from __future__ import annotations

import random

import pytest
from ingest_fixtures import Clock, batch, store

from kvhint import schemas as s
from kvhint.router.kv_index import (
    ClusterKvIndex,
    InMemoryClusterKvIndex,
    KvEventIngestor,
    NaiveClusterKvIndex,
    RequestSnapshot,
)

WORKERS = ("w0", "w1", "w2")
# The KV-cache group each worker's batches name (Kvhint-Group): w2 is a hybrid model
# whose full-attention group is 1, its group 0 a sliding-window one.
GROUPS = {"w0": 0, "w1": 0, "w2": 1}


def _history(seed: int) -> list[tuple[str, str, int, bytes]]:
    """What the events stream holds, in stream order: three workers' batches, numbered
    per epoch, with engine restarts, prefix-cache resets (runs of two: GPU, then CPU),
    CPU stores and removals, a KV-cache group not followed and sessions."""
    rng = random.Random(seed)
    chains = [[rng.getrandbits(63) for _ in range(8)] for _ in range(6)]
    epochs = {w: s.new_epoch(1000.0 + i) for i, w in enumerate(WORKERS)}
    seqs = dict.fromkeys(WORKERS, 0)
    t = 2000.0
    out = []
    for _ in range(600):
        w = rng.choice(WORKERS)
        if rng.random() < 0.01:
            t += 1.0
            epochs[w], seqs[w] = s.new_epoch(t), 0
        events: list[s.BlockStored | s.BlockRemoved | s.AllBlocksCleared] = []
        group, other = GROUPS[w], 1 - GROUPS[w]
        for _ in range(rng.randint(1, 3)):
            roll, chain = rng.random(), rng.choice(chains)
            if roll < 0.55:
                i = rng.randrange(len(chain))
                j = rng.randint(i + 1, len(chain))
                events.append(store(chain[i:j], chain[i - 1] if i else None,
                                    rng.choice(("GPU", None, "CPU")),
                                    rng.choice((None, "t/a", "t/b", "t/c")), group=group))
            elif roll < 0.93:
                events.append(s.BlockRemoved(block_hashes=[rng.choice(chain)],
                                             medium=rng.choice(("GPU", "CPU")),
                                             group_idx=rng.choice((group, group, other))))
            elif roll < 0.98:
                events.append(store([rng.getrandbits(63)], group=other))
            else:
                events += [s.AllBlocksCleared()] * rng.randint(1, 2)
        seqs[w] += 1
        out.append((w, epochs[w], seqs[w], batch(*events)))
    return out


def _feed(ing: KvEventIngestor, messages: list[tuple[str, str, int, bytes]]) -> None:
    for w, epoch, seq, payload in messages:
        meta = s.EventBatchMeta(w, epoch, seq, GROUPS[w])
        acts = ing.on_event_message(meta.to_headers(), payload)
        assert not any(isinstance(a, RequestSnapshot) for a in acts), (w, epoch, seq)


@pytest.mark.parametrize("impl", [InMemoryClusterKvIndex, NaiveClusterKvIndex],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("seed", range(3))
def test_replaying_the_stream_rebuilds_the_live_index(seed: int,
                                                      impl: type[ClusterKvIndex]) -> None:
    history = _history(seed)
    rng = random.Random(seed)
    # The live router: every message, some delivered twice (a JetStream redelivery, a
    # plain subscription overlapping a consumer) and some old engines' late batches.
    live_index = impl()
    live = KvEventIngestor(live_index, Clock())
    delivered = []
    for n, message in enumerate(history):
        delivered.append(message)
        if rng.random() < 0.05:
            delivered.append(message)
        if n > 50 and rng.random() < 0.02:
            delivered.append(history[rng.randrange(n)])
    _feed(live, delivered)
    # The restarted router: the stream from its start, in stream order.
    replayed_index = impl()
    replayed = KvEventIngestor(replayed_index, Clock())
    _feed(replayed, history)
    want = live_index.export_state()
    assert replayed_index.export_state() == want
    assert {w: v.applied_seq for w, v in replayed.worker_views().items()} == \
        {w: v.applied_seq for w, v in live.worker_views().items()}
    # Not vacuous: several workers, tiers and sessions; restarts and drops happened.
    assert len(want.blocks) >= 2 and want.sessions
    assert any("CPU" in tiers for tiers in want.blocks.values())
    assert "w2" in want.blocks  # the worker that follows group 1 was followed
    adapter = live.stats().adapter
    assert adapter["other_group_events"] > 0 and adapter["unknown_events"] == 0
    stats = live.stats().stream
    assert stats["epoch_changes"] > 0 and stats["duplicates"] > 0 and stats["stale_epoch"] > 0
