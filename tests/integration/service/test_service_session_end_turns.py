"""``X-Session-End`` on a turn that fails, against stub workers (the fault on cue: a worker's
error status, a stream that breaks after its first event; tests/e2e/service runs real
vLLM): an agent whose last turn failed retries it, so the session must still be open."""

from __future__ import annotations

from pathlib import Path

import httpx

from conftest import StubWorker, router_settings, running_router, sample, scrape
from kvhint.router.service.metrics import SESSION_END_SKIPS

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4}
END = {"x-session-id": "agent-1", "x-session-end": "true"}
SKIPS = "kvhint_router_session_end_skips_total"


async def test_a_failed_turn_does_not_end_its_session_and_the_retry_does(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A turn with ``X-Session-End`` that the worker refuses (4xx), fails (5xx), or whose
    stream breaks mid-way (the client gets an error event) leaves the session open,
    counted in session_end_skips_total by reason; the retry that succeeds ends it.
    Before, every one of them ended the session."""
    stub = stub_workers[0]
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        url = f"{router.url}/v1/chat/completions"
        assert (await client.post(url, json=CHAT, headers={"x-session-id": "agent-1"})
                ).status_code == 200
        record = router.runtime.sessions.get("default", "agent-1")
        for mode, stream, code, reason in (("status:400", False, 400, "refused"),
                                           ("status:500", False, 500, "failed"),
                                           ("die_mid_stream", True, 200, "failed")):
            stub.mode = mode
            before = sample(await scrape(client, router.url), SKIPS, reason=reason)
            answer = await client.post(url, json={**CHAT, "stream": stream}, headers=END)
            assert answer.status_code == code, (mode, answer.text)
            if stream:
                assert "worker failed mid-stream" in answer.text
            assert record.state == "active", mode
            after = sample(await scrape(client, router.url), SKIPS, reason=reason)
            assert after == before + 1, (mode, before, after)
        stub.mode = "ok"
        skipped = _skips(await scrape(client, router.url))
        retried = await client.post(url, json={**CHAT, "stream": True}, headers=END)
        assert retried.status_code == 200 and "[DONE]" in retried.text
        assert record.state == "ended"
        assert _skips(await scrape(client, router.url)) == skipped


def _skips(samples: dict) -> dict[str, float | None]:
    return {reason: sample(samples, SKIPS, reason=reason)
            for reason in SESSION_END_SKIPS}
