"""What the transport does with a queued outcome or release report that NATS refuses as
larger than its ``max_payload`` (``MaxPayloadError``): it can never be published as it
is, so it is made smaller or dropped, counted (``kvhint:publish_errors{what=oversize}``).

Before, it went back to its queue's head like any refused publish and was retried every
50 ms for good: one hints message of ~560 KB (an action_type the outcome echoes twice, in
``action_type`` and in its reason; or an advice_id echoed as message and action id) and
no outcome, release report, KV event batch or snapshot page of that worker was published
again until the engine restarted.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from kvhint.engine_plugin.config import LOGGER_NAME
from kvhint.engine_plugin.transport_counters import TransportCounters
from kvhint.schemas import HintOutcome, HoldsReleased

logger = logging.getLogger(LOGGER_NAME)

# The most of an oversize outcome's reason kept (it may echo what the sender sent).
REASON_KEPT_CHARS = 1_000
CUT_NOTE = " ... (cut: the outcome passed NATS max_payload)"


def smaller(item: Any, counters: TransportCounters, subject: str) -> list[Any]:
    """What to publish on ``subject`` in place of ``item``, which NATS refused as too
    large (strictly smaller, so this ends): an outcome with its reason cut; a release
    report in two halves. [] when it cannot be made smaller: dropped, counted."""
    if isinstance(item, HintOutcome) and len(item.reason) > REASON_KEPT_CHARS + len(CUT_NOTE):
        return [msgspec.structs.replace(item, reason=item.reason[:REASON_KEPT_CHARS]
                                        + CUT_NOTE)]
    if isinstance(item, HoldsReleased) and len(item.releases) > 1:
        half = len(item.releases) // 2
        return [msgspec.structs.replace(item, releases=item.releases[:half]),
                msgspec.structs.replace(item, releases=item.releases[half:])]
    note_oversize_dropped(counters, item, subject)
    return []


def header_bytes(headers: dict[str, str]) -> int:
    """What ``headers`` take of a message on the wire, as the NATS client encodes them
    (``NATS/1.0\\r\\n``, ``key: value\\r\\n`` each, ``\\r\\n``): the server checks
    ``max_payload`` against headers and payload together."""
    return (len(b"NATS/1.0\r\n\r\n")
            + sum(len(k.strip().encode()) + len(v.strip().encode()) + 4
                  for k, v in headers.items() if k.strip()))


def note_oversize_dropped(counters: TransportCounters, item: Any, subject: str) -> None:
    """``item`` cannot be made to fit (an outcome whose ids alone pass max_payload, one
    release of such an id): lost, counted, logged (warning the first time)."""
    counters.oversize_dropped += 1
    logger.log(logging.WARNING if counters.oversize_dropped == 1 else logging.DEBUG,
               "kvhint: a %s for %s passes NATS max_payload even made smaller; dropped "
               "(kvhint:publish_errors{what=oversize})", type(item).__name__, subject)
