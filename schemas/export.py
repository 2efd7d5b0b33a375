"""JSON Schema for every wire message, for implementations in other languages."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from kvhint.schemas.advice import DonorAdvice
from kvhint.schemas.events import KVEventBatch
from kvhint.schemas.hints import (
    DemotePayload,
    KvHintsEnvelope,
    PinPayload,
    PrefetchPayload,
    RetainPayload,
    SharePayload,
)
from kvhint.schemas.outcomes import HintOutcome
from kvhint.schemas.releases import HoldsReleased
from kvhint.schemas.snapshot import SnapshotRefused, SnapshotRequest, WorkerSnapshot
from kvhint.schemas.status import WorkerStatus

MESSAGES: dict[str, type] = {
    "KvHintsEnvelope": KvHintsEnvelope,
    "RetainPayload": RetainPayload,
    "PinPayload": PinPayload,
    "DemotePayload": DemotePayload,
    "PrefetchPayload": PrefetchPayload,
    "SharePayload": SharePayload,
    "HintOutcome": HintOutcome,
    "HoldsReleased": HoldsReleased,
    "KVEventBatch": KVEventBatch,
    "DonorAdvice": DonorAdvice,
    "WorkerStatus": WorkerStatus,
    "SnapshotRequest": SnapshotRequest,
    "WorkerSnapshot": WorkerSnapshot,
    "SnapshotRefused": SnapshotRefused,
}


def json_schema(message: type) -> dict:
    return msgspec.json.schema(message)


def export_schemas(directory: Path) -> list[Path]:
    """Write ``<Name>.schema.json`` for every message; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, message in MESSAGES.items():
        path = directory / f"{name}.schema.json"
        path.write_text(json.dumps(json_schema(message), indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written
