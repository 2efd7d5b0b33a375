"""Self-describing response ids (responses_id_codec.py) and the map's reading of the ids it
does not hold (responses_ids.py): a replica that never relayed a response reaches its
worker from the id alone, for the tenant it was made for only, and still tells a worker
restarted (or gone, or down) since from an id it never held."""

from __future__ import annotations

import time

import pytest

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.responses_id_codec import ResponseIdCodec, epoch_tag
from kvhint.router.service.responses_ids import IdEntry, IdMiss, ResponseIds
from kvhint.router.service.workers import WorkerRegistry
from kvhint.schemas import WorkerStatus
from kvhint.schemas.status import Budgets, Usage

CODEC = ResponseIdCodec("shared-secret")


def test_an_id_says_its_worker_epoch_and_session_for_its_tenant_only() -> None:
    made = CODEC.mint("acme", "gpu_0-dp1", "0190a1b2c3d4-1a2b3c4d", in_session=True)
    assert made.startswith("resp_gpu_0-dp1_")
    minted = CODEC.read(made)
    assert minted is not None
    assert (minted.worker_id, minted.in_session, minted.epoch_tag) == (
        "gpu_0-dp1", True, epoch_tag("0190a1b2c3d4-1a2b3c4d"))
    assert CODEC.binds(minted, "acme")
    assert not CODEC.binds(minted, "beta")
    # A replica with the same salt_secret reads it; one with another does not.
    assert ResponseIdCodec("shared-secret").binds(minted, "acme")
    assert not ResponseIdCodec("another-secret").binds(minted, "acme")
    sessionless = CODEC.read(CODEC.mint("acme", "w0", None, in_session=False))
    assert sessionless is not None
    assert (sessionless.in_session, sessionless.epoch_tag) == (False, None)
    assert CODEC.mint("acme", "w0", None, False) != CODEC.mint("acme", "w0", None, False)


def test_no_character_of_an_id_can_be_changed() -> None:
    made = CODEC.mint("acme", "w0", "e1", in_session=False)
    for position in range(len("resp_"), len(made)):
        for other in {"0", "1", "f", "s", "n", "_", "w"} - {made[position]}:
            changed = made[:position] + other + made[position + 1:]
            minted = CODEC.read(changed)
            assert minted is None or not CODEC.binds(minted, "acme"), changed


@pytest.mark.parametrize("response_id", [
    "resp_" + "a" * 32,  # an older router's (and vLLM's own form)
    "resp_nope", "mine", "", "resp_w0_" + "a" * 64, "resp_w.0_" + "a" * 65,
])
def test_ids_not_in_the_routers_form_are_not_read(response_id: str) -> None:
    assert CODEC.read(response_id) is None


def _heartbeat(registry: WorkerRegistry, worker_id: str, epoch: str) -> None:
    registry.on_heartbeat(WorkerStatus(
        worker_id=worker_id, epoch=epoch, model="tiny", cache_namespace="ns", block_size=4,
        hash_algo="sha256", none_hash_seed="vllm-none-hash",
        supported_actions={"kv.pin": ["1.0"]},
        budgets=Budgets(max_pinned_blocks=50, max_pin_ttl_s=600, max_retained_blocks=200,
                        max_retain_ttl_s=3600),
        usage=Usage(gpu_blocks_total=100, gpu_blocks_free=100, kv_usage=0.0),
        interval_s=1.0, at=time.time(), http_url=f"http://{worker_id}"),
        now=time.monotonic())


def test_a_map_that_never_learnt_an_id_reaches_it_from_the_id() -> None:
    metrics = RouterMetrics()
    registry = WorkerRegistry([("w0", "http://w0")])
    _heartbeat(registry, "w1", "epoch-1")
    _heartbeat(registry, "w2", "epoch-1")
    ids = ResponseIds(10, registry, metrics, CODEC)
    on_w0 = CODEC.mint("acme", "w0", None, in_session=True)
    on_w1 = CODEC.mint("acme", "w1", "epoch-1", in_session=False)
    on_w2 = CODEC.mint("acme", "w2", "epoch-1", in_session=False)
    assert ids.find(on_w0, "acme") == IdEntry("acme", "w0", None, None, None, True)
    assert ids.find(on_w1, "acme") == IdEntry("acme", "w1", None, None,
                                              epoch_tag("epoch-1"), False)
    assert len(ids) == 0  # read, not remembered
    # Another tenant's id, not held here, reads as a forged one does (module doc): its
    # tag is not the requester's. One this map holds says whose it is.
    assert ids.find(on_w0, "beta") == IdMiss("unverified")
    forged = ResponseIdCodec("another-secret").mint("beta", "w0", None, False)
    assert ids.find(forged, "beta") == IdMiss("unverified")
    ids.learn(on_w2, "acme", "w2", None)
    assert ids.find(on_w2, "beta") == IdMiss("other_tenant")
    assert ids.find("resp_" + "a" * 32, "acme") == IdMiss("unknown")
    registry.get("w0").mark_http_failure("refused")
    assert ids.find(on_w0, "acme") == IdMiss("worker_down", "w0")
    _heartbeat(registry, "w1", "epoch-2")  # its engine restarted: its store is gone
    assert ids.find(on_w1, "acme") == IdMiss("worker_restarted", "w1")
    assert registry.forget_silent(time.monotonic() + 7200, after_s=3600) == ["w1", "w2"]
    assert ids.find(on_w2, "acme") == IdMiss("worker_gone", "w2")
    assert metrics.response_ids_read._value.get() == 4
    counted = {r: metrics.response_id_misses.labels(r)._value.get()
               for r in ("other_tenant", "unverified", "unknown", "worker_down",
                         "worker_restarted", "worker_gone")}
    assert counted == dict.fromkeys(counted, 1) | {"unverified": 2}


class _CountingCodec(ResponseIdCodec):
    """The router's codec, counting the HMACs it computes (one per tag: mint, binds)."""

    def __init__(self, secret: str) -> None:
        super().__init__(secret)
        self.hmacs = 0

    def _tag(self, tenant: str, signed: str) -> str:
        self.hmacs += 1
        return super()._tag(tenant, signed)


def test_an_id_not_held_costs_one_hmac_however_many_tenants() -> None:
    """An id this map does not hold is checked for the requesting tenant only: one HMAC
    per request, whatever the number of tenants. Before, a miss was checked against
    every tenant the router serves, to count another tenant's id apart from a forged one
    (the client's 404 the same either way): 999 HMACs here on the event loop, per GET,
    cancel or previous_response_id any key could send (2-5 ms at 1,000 tenants)."""
    codec = _CountingCodec("shared-secret")
    metrics = RouterMetrics()
    ids = ResponseIds(10, WorkerRegistry([("w0", "http://w0")]), metrics, codec)
    tenants = [f"t{n}" for n in range(1000)]
    theirs = codec.mint("t0", "w0", None, in_session=False)  # via another replica
    forged = ResponseIdCodec("another-secret").mint("t1", "w0", None, False)
    held = codec.mint("t0", "w0", None, in_session=False)
    ids.learn(held, "t0", "w0", None)
    for requester in tenants[1:4]:
        codec.hmacs = 0
        assert ids.find(theirs, requester) == IdMiss("unverified")
        assert ids.find(forged, requester) == IdMiss("unverified")
        assert codec.hmacs == 2, codec.hmacs
        codec.hmacs = 0
        assert ids.find(held, requester) == IdMiss("other_tenant")  # held: no HMAC
        assert codec.hmacs == 0
    codec.hmacs = 0
    assert ids.find(theirs, "t0") == IdEntry("t0", "w0", None, None, None, False)
    assert codec.hmacs == 1
    assert metrics.response_id_misses.labels("unverified")._value.get() == 6
    assert metrics.response_id_misses.labels("other_tenant")._value.get() == 3
