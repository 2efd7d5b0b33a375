from __future__ import annotations

import json

import pytest

from kvhint.router.service.inbound import BadRequest, Endpoint, parse_inbound
from kvhint.router.service.settings import TenantBudget
from kvhint.router.service.tenancy import Tenant

ACME = Tenant("acme", "salt-acme", TenantBudget())
DEV = Tenant("default", None, TenantBudget())


def chat(**extra: object) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                       **extra}).encode()


def test_session_id_sources_in_order() -> None:
    body = chat(session_id="b", prompt_cache_key="k")
    assert parse_inbound(Endpoint.CHAT, body, ACME, "h", None).client_session_id == "b"
    body = chat(prompt_cache_key="k")
    assert parse_inbound(Endpoint.CHAT, body, ACME, "h", None).client_session_id == "h"
    assert parse_inbound(Endpoint.CHAT, body, ACME, None, None).client_session_id == "k"
    assert parse_inbound(Endpoint.CHAT, chat(), ACME, None, None).client_session_id is None


def test_router_owns_session_salt_and_transfer_params() -> None:
    # vLLM copies vllm_xargs into the request's extra_args and takes kv_transfer_params
    # from there too: a string there would raise inside vLLM's scheduler with a connector.
    body = chat(session_id="s1", cache_salt="mine", kv_transfer_params={"do_remote": True},
                ec_transfer_params={"x": 1}, prompt_cache_key="k",
                vllm_xargs={"session_id": "evil", "kv_transfer_params": "x",
                            "cache_salt": "mine", "kv_cache_report_mode": "full", "x": 1})
    inbound = parse_inbound(Endpoint.CHAT, body, ACME, None, None)
    forwarded = inbound.body
    assert forwarded["session_id"] == "acme/s1"
    assert forwarded["cache_salt"] == "salt-acme"
    assert "kv_transfer_params" not in forwarded and "prompt_cache_key" not in forwarded
    assert "ec_transfer_params" not in forwarded
    assert forwarded["vllm_xargs"] == {"x": 1}
    assert inbound.worker_session_id == "acme/s1"


def test_dev_tenant_sets_no_salt_and_no_session_without_id() -> None:
    inbound = parse_inbound(Endpoint.CHAT, chat(cache_salt="x"), DEV, None, None)
    assert "cache_salt" not in inbound.body and "session_id" not in inbound.body


def test_stream_usage_is_requested_and_marked_for_stripping() -> None:
    inbound = parse_inbound(Endpoint.CHAT, chat(stream=True), DEV, None, None)
    assert inbound.stream and inbound.strip_usage_chunk
    assert inbound.body["stream_options"] == {"include_usage": True}
    inbound = parse_inbound(Endpoint.CHAT, chat(stream=True,
                                                stream_options={"include_usage": True}),
                            DEV, None, None)
    assert not inbound.strip_usage_chunk


def test_continuous_usage_goes_with_the_usage_the_router_asks_for_itself() -> None:
    """vLLM reads ``continuous_usage_stats`` only with ``include_usage``: a client that
    sends it alone gets no usage anywhere. The router's own ``include_usage`` made vLLM put
    a usage on every chunk the client got; it now leaves that option out. A client that
    asked for usage keeps both."""
    inbound = parse_inbound(Endpoint.CHAT, chat(stream=True, stream_options={
        "continuous_usage_stats": True}), DEV, None, None)
    assert inbound.strip_usage_chunk
    assert inbound.body["stream_options"] == {"include_usage": True}
    asked = {"include_usage": True, "continuous_usage_stats": True}
    inbound = parse_inbound(Endpoint.CHAT, chat(stream=True, stream_options=asked), DEV,
                            None, None)
    assert not inbound.strip_usage_chunk and inbound.body["stream_options"] == asked


def test_session_end_header() -> None:
    assert parse_inbound(Endpoint.CHAT, chat(), DEV, "s", "true").session_end
    assert not parse_inbound(Endpoint.CHAT, chat(), DEV, "s", "no").session_end


@pytest.mark.parametrize("endpoint,body,needle", [
    (Endpoint.CHAT, b"", "empty"),
    (Endpoint.CHAT, b"{not json", "not valid JSON"),
    (Endpoint.CHAT, b"[1]", "JSON object"),
    (Endpoint.CHAT, b'{"model": "tiny"}', "messages"),
    (Endpoint.CHAT, b'{"messages": ["x"]}', "messages"),
    # (vLLM reads "yes" as true: test_service_request_fields.py)
    (Endpoint.CHAT, b'{"messages": [{"role": "user"}], "stream": "maybe"}', "stream"),
    (Endpoint.CHAT, b'{"messages": [{"role": "user"}], "session_id": 5}', "session_id"),
    (Endpoint.CHAT, b'{"messages": [{"role": "user"}], "model": 1}', "model"),
    (Endpoint.COMPLETION, b'{"model": "tiny"}', "prompt"),
    (Endpoint.COMPLETION, b'{"prompt": []}', "prompt"),
])
def test_bad_bodies_are_400_with_a_message(endpoint: Endpoint, body: bytes, needle: str) -> None:
    with pytest.raises(BadRequest) as exc:
        parse_inbound(endpoint, body, DEV, None, None)
    assert exc.value.status == 400
    assert needle in exc.value.message


def test_session_id_limits() -> None:
    with pytest.raises(BadRequest):
        parse_inbound(Endpoint.CHAT, chat(session_id="x" * 300), DEV, None, None)
    with pytest.raises(BadRequest):
        parse_inbound(Endpoint.CHAT, chat(), DEV, "bad\nid", None)


def test_a_body_nested_too_deeply_is_a_bad_request() -> None:
    # msgspec gives up with a RecursionError, which was a 500.
    with pytest.raises(BadRequest, match="nested too deeply"):
        parse_inbound(Endpoint.CHAT, b"[" * 1200 + b"]" * 1200, DEV, None, None)
    deep = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "x": ' + \
        b"[" * 1200 + b"]" * 1200 + b"}"
    with pytest.raises(BadRequest, match="nested too deeply"):
        parse_inbound(Endpoint.CHAT, deep, DEV, None, None)


def test_media_uuids_are_scoped_to_the_tenant() -> None:
    """vLLM keys its multimodal caches by a part's client-given uuid alone (not by the
    cache salt): two tenants naming the same uuid would share (or overwrite) one image."""
    def image(uuid: object) -> dict[str, object]:
        return {"type": "image_url", "image_url": {"url": "http://x/cat.png"}, "uuid": uuid}

    def forwarded_uuids(tenant: Tenant, uuid: object = "img-1") -> list[object]:
        body = chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, image(uuid),
            {"type": "image_url", "image_url": None, "uuid": uuid}]},
            {"role": "assistant", "content": "a cat"}])
        message = parse_inbound(Endpoint.CHAT, body, tenant, None, None).body["messages"][0]
        assert message["content"][0] == {"type": "text", "text": "what is this?"}
        return [part["uuid"] for part in message["content"][1:]]

    other = Tenant("other", "salt-other", TenantBudget())
    mine = forwarded_uuids(ACME)
    assert mine[0] == mine[1] == forwarded_uuids(ACME)[0] != "img-1"  # repeats still hit
    assert set(mine).isdisjoint(forwarded_uuids(other))
    assert forwarded_uuids(DEV) == ["img-1", "img-1"]  # one tenant, nobody to keep apart
    with pytest.raises(BadRequest, match="'uuid' must be a string") as error:
        forwarded_uuids(ACME, uuid=7)
    assert error.value.param == "messages[0].content"


def test_media_uuids_in_a_responses_tool_output_are_scoped_too() -> None:
    """A Responses ``function_call_output`` whose ``output`` is a list of parts becomes a
    tool message with those parts as its content (vLLM's responses/utils.py), its
    images' uuids read as their cache keys as a message's are: scoped the same way."""
    def forwarded(tenant: Tenant) -> list[dict[str, object]]:
        body = json.dumps({"model": "tiny", "input": [
            {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [
                {"type": "input_image", "image_url": "http://x/cat.png", "uuid": "img-1"},
                {"type": "input_text", "text": "the screenshot"}]},
            {"type": "custom_tool_call_output", "call_id": "c2", "output": [
                {"type": "input_image", "image_url": "http://x/dog.png", "uuid": "img-2"}]},
            {"type": "function_call_output", "call_id": "c3", "output": "plain text"},
        ]}).encode()
        return parse_inbound(Endpoint.RESPONSES, body, tenant, None, None).body["input"]

    other = Tenant("other", "salt-other", TenantBudget())
    mine, theirs = forwarded(ACME), forwarded(other)
    uuids = [mine[1]["output"][0]["uuid"], mine[2]["output"][0]["uuid"]]
    assert "img-1" not in uuids and "img-2" not in uuids
    assert uuids[0] == forwarded(ACME)[1]["output"][0]["uuid"]  # repeats still hit
    assert uuids[0] != theirs[1]["output"][0]["uuid"]
    assert mine[1]["output"][1] == {"type": "input_text", "text": "the screenshot"}
    assert mine[3]["output"] == "plain text"
    assert forwarded(DEV)[1]["output"][0]["uuid"] == "img-1"
    bad = json.dumps({"model": "tiny", "input": [{"type": "function_call_output",
                      "call_id": "c1", "output": [{"type": "input_image", "uuid": 7}]}]})
    with pytest.raises(BadRequest, match="'uuid' must be a string") as error:
        parse_inbound(Endpoint.RESPONSES, bad.encode(), ACME, None, None)
    assert error.value.param == "input[0].output"


def test_a_tenant_limited_to_some_models_names_one_of_them() -> None:
    limited = Tenant("acme", "salt-acme", TenantBudget(), frozenset({"tiny"}))
    assert parse_inbound(Endpoint.CHAT, chat(), limited, None, None).model == "tiny"
    with pytest.raises(BadRequest) as other:
        parse_inbound(Endpoint.CHAT, chat(model="private-lora"), limited, None, None)
    assert (other.value.status, other.value.param, other.value.error_type) == (
        404, "model", "NotFoundError")
    assert other.value.message == "The model `private-lora` does not exist."
    body = json.dumps({"prompt": "hi"}).encode()
    with pytest.raises(BadRequest, match="'model' is required") as missing:
        parse_inbound(Endpoint.COMPLETION, body, limited, None, None)
    assert missing.value.status == 400
    # No list: every model, as before.
    assert parse_inbound(Endpoint.CHAT, chat(model="x"), ACME, None, None).model == "x"
