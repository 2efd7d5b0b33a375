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
