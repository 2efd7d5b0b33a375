"""A Demote by block hashes over pinned blocks, against vLLM's real OffloadingConnector
beside the plugin (the set-up of ``test_plugin_host_tier``): a Pin is hard until its TTL,
so its blocks stay in G1, and the outcome says so instead of counting them demoted."""

from __future__ import annotations

from test_plugin_host_tier import BS, hint, plugin, sched, turn

from kvhint.schemas import DemotePayload, HintOwner, PinPayload, Target


def test_a_demote_by_block_hashes_counts_no_pinned_block_as_demoted() -> None:
    # Before, an agent's (or a planner's) Demote by block hashes over the planner's Pin
    # answered accepted with every block applied, while each stayed pinned in G1 and
    # none moved in the free queue: the router was told the blocks went to the host.
    h = sched()
    turn(h, "s", [1, 2, 3, 4])
    core = plugin(h).core
    keys = core.index.session_blocks("s")
    pin = hint(h, PinPayload(target=Target(session_id="s", prefix_tokens=2 * BS), ttl_s=60))
    assert (pin.status.value, pin.applied.blocks) == ("accepted", 2)
    queue = h.kv_cache_manager.block_pool.free_block_queue
    outcome = hint(h, DemotePayload(target=Target(block_hashes=keys), owner=HintOwner.AGENT))
    assert (outcome.status.value, outcome.applied.blocks) == ("clipped", 2), outcome
    assert "2 pinned blocks stay in G1" in outcome.reason
    assert core.executor.pinned_blocks == 2
    moved = {core.executor.cache.lookup(k).block_id for k in keys[2:]}
    cached_free = [b.block_id for b in queue.get_all_free_blocks() if b.block_hash is not None]
    assert set(cached_free[:2]) == moved  # the unpinned two go first
    # Every block pinned: nothing moves, and the Demote is clipped to nothing (not
    # rejected: it did all it may, as when other claims hold every block).
    outcome = hint(h, DemotePayload(target=Target(block_hashes=keys[:2])))
    assert (outcome.status.value, outcome.applied.blocks) == ("clipped", 0), outcome
    assert core.executor.pinned_blocks == 2
