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
    ids = ResponseIds(10, registry, metrics, CODEC, frozenset({"acme", "beta"}))
    on_w0 = CODEC.mint("acme", "w0", None, in_session=True)
    on_w1 = CODEC.mint("acme", "w1", "epoch-1", in_session=False)
    on_w2 = CODEC.mint("acme", "w2", "epoch-1", in_session=False)
    assert ids.find(on_w0, "acme") == IdEntry("acme", "w0", None, None, None, True)
    assert ids.find(on_w1, "acme") == IdEntry("acme", "w1", None, None,
                                              epoch_tag("epoch-1"), False)
    assert len(ids) == 0  # read, not remembered
    assert ids.find(on_w0, "beta") == IdMiss("other_tenant")
    forged = ResponseIdCodec("another-secret").mint("beta", "w0", None, False)
    assert ids.find(forged, "beta") == IdMiss("unverified")
    assert ids.find("resp_" + "a" * 32, "acme") == IdMiss("unknown")
    registry.get("w0").mark_http_failure("refused")
    assert ids.find(on_w0, "acme") == IdMiss("worker_down", "w0")
    _heartbeat(registry, "w1", "epoch-2")  # its engine restarted: its store is gone
    assert ids.find(on_w1, "acme") == IdMiss("worker_restarted", "w1")
    assert registry.forget_silent(time.monotonic() + 7200, after_s=3600) == ["w1", "w2"]
    assert ids.find(on_w2, "acme") == IdMiss("worker_gone", "w2")
    assert metrics.response_ids_read._value.get() == 5
    counted = {r: metrics.response_id_misses.labels(r)._value.get()
               for r in ("other_tenant", "unverified", "unknown", "worker_down",
                         "worker_restarted", "worker_gone")}
    assert counted == dict.fromkeys(counted, 1)
