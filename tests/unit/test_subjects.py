from __future__ import annotations

import pytest

from kvhint.schemas import Subjects, WireDecodeError


def test_subject_names() -> None:
    subjects = Subjects()
    assert subjects.hints("w0") == "kvhint.v1.hints.w0"
    assert subjects.outcomes("w0") == "kvhint.v1.outcomes.w0"
    assert subjects.releases("w0") == "kvhint.v1.releases.w0"
    assert subjects.events("dp-3") == "kvhint.v1.events.dp-3"
    assert subjects.advice("w0") == "kvhint.v1.advice.w0"
    assert subjects.status("w0") == "kvhint.v1.status.w0"
    assert subjects.snapshot("w0") == "kvhint.v1.snapshot.w0"
    assert subjects.cancels("w0") == "kvhint.v1.cancels.w0"
    assert subjects.all_of("cancels") == "kvhint.v1.cancels.*"
    assert subjects.all_of("events") == "kvhint.v1.events.*"
    assert subjects.events_stream == "KVHINT_V1_EVENTS"


def test_custom_prefix_and_worker_of() -> None:
    subjects = Subjects("acme.prod")
    assert subjects.status("w_1") == "acme.prod.v1.status.w_1"
    assert subjects.worker_of("acme.prod.v1.events.w_1") == "w_1"
    assert subjects.events_stream == "ACME_PROD_V1_EVENTS"
    with pytest.raises(WireDecodeError):
        subjects.worker_of("other.v1.events.w_1")
    with pytest.raises(WireDecodeError):
        subjects.worker_of("acme.prod.v1.nonsense.w_1")


@pytest.mark.parametrize("worker", ["", "a.b", "a b", "*", ">", "x" * 129])
def test_bad_worker_ids_are_refused(worker: str) -> None:
    with pytest.raises(WireDecodeError, match="invalid worker id"):
        Subjects().hints(worker)


@pytest.mark.parametrize("prefix", ["", "a..b", "a.*", "a b", ".a"])
def test_bad_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(WireDecodeError, match="invalid subject prefix"):
        Subjects(prefix)


def test_unknown_kind() -> None:
    with pytest.raises(ValueError):
        Subjects().all_of("gossip")


def test_a_nats_url_reaches_logs_without_its_credentials() -> None:
    from kvhint.schemas.nats_address import loggable_nats_url, nats_servers

    url = "nats://router:s3cret@nats-a:4222, tls://t0ken@[::1]:4223,nats://plain:4222"
    assert nats_servers(url) == ["nats://router:s3cret@nats-a:4222", "tls://t0ken@[::1]:4223",
                                 "nats://plain:4222"]
    shown = loggable_nats_url(url)
    assert shown == "nats://***@nats-a:4222,tls://***@[::1]:4223,nats://plain:4222"
    assert "s3cret" not in shown and "t0ken" not in shown
    # Everything up to a part's last '@' is hidden, whether the part parses or not: an
    # unencoded '/', '#' or '?' ends the host part early, and a parse of
    # "nats://u:p/w@h" sees no user info. Before, such a part was shown whole.
    assert loggable_nats_url("nats://u:p@h:99999") == "nats://***@h:99999"
    assert loggable_nats_url("nats://u:p/a#s?s@w%rd@h:4222") == "nats://***@h:4222"
    assert loggable_nats_url(None) == "" and nats_servers("") == []
