"""A ``/v1/completions`` batch (``prompt`` a list of strings or token-id lists,
``prompt_embeds`` a list) through the router's HTTP front, real tokenizer, stub worker:
vLLM 0.32 runs each prompt as an engine request of its own, each with ``n`` sequences,
so ``routing.max_n`` bounds the request's prompts x max(n, best_of); and a batched
session turn is planned, and its usage checked, as one prompt's."""

from __future__ import annotations

from pathlib import Path

import httpx
from aiohttp import web

from conftest import StubWorker, router_settings, running_router, sample, scrape, usage

TENANTS = [{"name": "acme", "api_keys": ["ka"]}]
ACME = {"Authorization": "Bearer ka"}
URL = "{}/v1/completions".format


class BatchStub(StubWorker):
    """Answers a whole completions request as vLLM does a batch: P x n choices (5
    completion tokens each), one usage summing every prompt's tokens (``prompt_tokens``
    per prompt), its cached_tokens one prompt's (32)."""

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        prompt = body["prompt"]
        prompts = len(prompt) if isinstance(prompt, list) and isinstance(
            prompt[0], (str, list)) else 1
        choices = prompts * body.get("n", 1)
        return web.json_response({
            "id": "x", "object": "text_completion", "model": "stub",
            "choices": [{"index": i, "text": "hi", "finish_reason": "stop"}
                        for i in range(choices)],
            "usage": usage(self.prompt_tokens * prompts, 32, 5 * choices)})


async def test_a_batch_over_max_n_sequences_is_refused_naming_the_field(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """Prompts x max(n, best_of) over routing.max_sequences (here 16) is a 400 naming the
    field and the bound, sent nowhere, counted as gateway_rejections{over_max_n} (an
    ``n`` alone over it too, as before but now counted there). Before, a batch of 17
    prompts (or 4 prompts with n = 5: 20 sequences) passed as one request of n
    sequences, up to vLLM's own 1024 prompts x 16. One prompt of many token ids is one
    prompt; a batch of 8 with n = 1, and 4 with n = 4, pass."""
    stub = BatchStub(model_root=str(tiny_model_dir))
    await stub.start()
    try:
        settings = router_settings(tmp_path, [("w0", stub.url)], tenants=TENANTS,
                                   routing={"max_sequences": 16})
        async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
            base = {"model": "stub", "max_tokens": 4}
            refused_bodies = [
                ({"prompt": ["p"] * 17}, "prompt"),
                ({"prompt": [[1, 2, 3]] * 17}, "prompt"),
                ({"prompt": ["p"] * 4, "n": 5}, "prompt"),
                ({"prompt": ["p"] * 4, "n": 2, "best_of": 5}, "prompt"),
                ({"prompt": ["p"] * 4, "n": "5"}, "prompt"),  # read as vLLM reads it
                ({"prompt": "p", "prompt_embeds": ["QUJD"] * 16}, "prompt_embeds"),
                ({"prompt": "p", "n": 17}, "n"),
            ]
            for extra, field in refused_bodies:
                refused = await client.post(URL(router.url), json={**base, **extra},
                                            headers=ACME)
                assert refused.status_code == 400, extra
                error = refused.json()["error"]
                assert error["param"] == field and error["type"] == "invalid_request_error"
                assert ("routing.max_n" if field == "n" else "routing.max_sequences"
                        ) in error["message"] and "16" in error["message"]
            assert stub.received == []
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_gateway_rejections_total", tenant="acme",
                          reason="over_max_n") == len(refused_bodies)
            assert sample(samples, "kvhint_router_requests_total", endpoint="completion",
                          worker="none", code="400") == len(refused_bodies)

            accepted = [{"prompt": ["p"] * 8}, {"prompt": [[1, 2]] * 4, "n": 4},
                        {"prompt": list(range(1, 200))}, {"prompt": "p", "n": 16}]
            for extra in accepted:
                answered = await client.post(URL(router.url), json={**base, **extra},
                                             headers=ACME)
                assert answered.status_code == 200, (extra, answered.text)
            assert len(stub.received) == len(accepted)
    finally:
        await stub.stop()


async def test_by_default_a_batch_of_256_prompts_passes_and_257_do_not(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """The defaults keep batch clients working: routing.max_sequences is 256, so 256
    one-sample prompts pass, though each is over nothing and their count is over
    routing.max_n (16: one prompt's n); 257 are a 400 naming ``prompt`` and
    routing.max_sequences. A single bound of 16 for both refused any batch past 16."""
    stub = BatchStub(model_root=str(tiny_model_dir))
    await stub.start()
    try:
        settings = router_settings(tmp_path, [("w0", stub.url)], tenants=TENANTS)
        async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
            base = {"model": "stub", "max_tokens": 4}
            answered = await client.post(URL(router.url), json={**base, "prompt": ["p"] * 256},
                                         headers=ACME)
            assert answered.status_code == 200, answered.text
            refused = await client.post(URL(router.url), json={**base, "prompt": ["p"] * 257},
                                        headers=ACME)
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert error["param"] == "prompt" and "routing.max_sequences" in error["message"]
            assert len(stub.received) == 1
    finally:
        await stub.stop()


async def test_a_batched_session_turn_is_planned_as_one_prompt_and_unchecked(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A batch is routed and predicted by its first prompt, and a session continues at
    most one of its prompts; vLLM's usage sums every prompt's tokens and reports one
    prompt's cached_tokens. So the session's plan takes one prompt's tokens (160 / 4)
    and one completion's (20 / 4), not the sums, and the usage is counted without a
    prediction (the skip as a drop). Before, the plan took 160 + 5 tokens of context,
    and the last prompt's cached tokens were booked against the first's prediction."""
    stub = BatchStub(model_root=str(tiny_model_dir))
    await stub.start()
    try:
        settings = router_settings(tmp_path, [("w0", stub.url)])
        async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
            answered = await client.post(URL(router.url), json={
                "model": "stub", "max_tokens": 4, "session_id": "s",
                "prompt": ["alpha beta", "gamma delta", "epsilon", "zeta eta"]})
            assert answered.status_code == 200 and len(answered.json()["choices"]) == 4
            record = router.runtime.sessions.get("default", "s")
            assert record.plan.context_tokens == stub.prompt_tokens + 5
            assert record.prompt_tokens == 4 * stub.prompt_tokens  # the usage, as billed
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_drops_total",
                          what="cached_prediction_unchecked:batched_prompts") == 1
            assert not sample(samples, "kvhint_router_cached_tokens_actual_total",
                              worker="w0", predicted="true")
            assert sample(samples, "kvhint_router_cached_tokens_actual_total",
                          worker="w0", predicted="false") == 32
    finally:
        await stub.stop()


async def test_a_batch_books_every_prompt_as_load_and_hashes_only_its_first(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A batch's P prompts are P engine requests on the worker it goes to: its routed
    load books them all (the first less its predicted hits, the others whole, by their
    length: token ids counted, strings at 4 characters a token), and gives every block
    back at its end. Only the first prompt, which the batch is routed and planned by, is
    tokenized and hashed. Before, every prompt was tokenized and hashed and only the
    first's tokens were booked (a batch of 4 weighed as one prompt)."""
    stub = BatchStub(model_root=str(tiny_model_dir))
    await stub.start()
    try:
        settings = router_settings(tmp_path, [("w0", stub.url)])
        async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
            routing = router.runtime.routing
            routing.clock = lambda: 1000.0  # held still: the recent load does not decay
            assert routing.hasher is not None
            renderer = routing.hasher.renderer("stub")
            encoded: list[str] = []
            encode = renderer._encode

            def counting(text: str, add_special_tokens: bool) -> list[int]:
                encoded.append(text)
                return encode(text, add_special_tokens)

            renderer._encode = counting  # type: ignore[method-assign]

            def booked() -> float:
                load = routing._loads.get("w0")
                return 0.0 if load is None else load.recent.prefill_tokens

            ids = [list(range(1, 101)), list(range(1, 61)), list(range(7, 47))]
            strings = ["alpha beta gamma delta", "x" * 400, "y" * 80, "z" * 40]
            first = len(encode(strings[0], True))
            for prompt, expected in ((ids, 100 + 60 + 40),
                                     (strings, first + 100 + 20 + 10)):
                before = booked()
                answered = await client.post(URL(router.url), json={
                    "model": "stub", "max_tokens": 4, "session_id": f"s{len(prompt)}",
                    "prompt": prompt})
                assert answered.status_code == 200, answered.text
                assert booked() - before == expected, prompt[:1]
                load = routing._loads.get("w0")
                assert load is not None and (load.pending_prefill, load.active_blocks) == (0, 0)
            assert encoded == [strings[0]]  # the batch of strings: its first alone
    finally:
        await stub.stop()
