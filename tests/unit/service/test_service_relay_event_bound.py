"""The relays' bound on an unfinished event (``stream_event_max_bytes``: response_scan.py
``check_pending``): what they hold of an event not yet ended may not pass it; the whole
events before are relayed first, and an event that ends within the bound (or comes
whole in one read, holding nothing) passes untouched. Before, the relays held an
unended event's bytes for as long as they came (the service tests'
test_service_stream_event_bound.py shows the stream's end)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvhint.router.service.response_scan import EventTooLarge, ResponseObservation, SseRelay
from kvhint.router.service.responses_scan import ResponsesObservation, ResponsesRelay
from kvhint.router.service.upstream import UpstreamBroken

LIMIT = 64


def _relay(kind: str) -> SseRelay | ResponsesRelay:
    relay: SseRelay | ResponsesRelay = (SseRelay(ResponseObservation(), False) if kind == "chat"
                                        else ResponsesRelay(ResponsesObservation()))
    relay.max_event_bytes, relay.worker_id = LIMIT, "w0"
    return relay


async def _source(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


FIRST = b'event: response.output_text.delta\ndata: {"type": "x"}\n\n'


@pytest.mark.parametrize("kind", ["chat", "responses"])
@pytest.mark.parametrize("newline_seen", [True, False])
async def test_an_event_held_past_the_bound_breaks_the_stream_after_the_whole_ones(
        kind: str, newline_seen: bool) -> None:
    """Whole events go out first; then the unended one past LIMIT raises EventTooLarge (a
    break: relay_end.py ends the stream), its bytes dropped. ``newline_seen`` False: no
    line has ended yet (the stream's line ending is still unknown)."""
    relay = _relay(kind)
    parts = ([FIRST] if newline_seen else []) + [b"data: {"] + [b"x" * 16] * 8
    out: list[bytes] = []
    with pytest.raises(EventTooLarge) as raised:
        async for chunk in relay.relay(_source(parts)):
            out.append(chunk)
    assert isinstance(raised.value, UpstreamBroken) and not raised.value.timed_out
    assert "w0" in str(raised.value) and "stream_event_max_bytes" in str(raised.value)
    assert out == ([FIRST] if newline_seen else [])
    assert not relay._pending  # dropped, not held


@pytest.mark.parametrize("kind", ["chat", "responses"])
async def test_events_within_the_bound_or_whole_in_one_read_pass(kind: str) -> None:
    """An event held up to LIMIT bytes before its end, and one far larger that comes
    whole in one read (nothing held), are relayed as they came."""
    relay = _relay(kind)
    held = b"data: " + b"y" * (LIMIT - 6)  # exactly LIMIT bytes held, then its end
    whole = b"data: " + b"z" * (4 * LIMIT) + b"\n\n"
    parts = [FIRST, held[:30], held[30:], b"\n\n", whole]
    relayed = b"".join([chunk async for chunk in relay.relay(_source(parts))])
    assert relayed == b"".join(parts)


@pytest.mark.parametrize("kind", ["chat", "responses"])
async def test_no_bound_holds_as_before(kind: str) -> None:
    """``max_event_bytes`` None (``stream_event_max_bytes: null``): no bound."""
    relay = _relay(kind)
    relay.max_event_bytes = None
    parts = [FIRST] + [b"x" * 1024] * 8
    relayed = b"".join([chunk async for chunk in relay.relay(_source(parts))])
    assert relayed == b"".join(parts)
