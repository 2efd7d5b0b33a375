"""Media sent without a ``uuid`` and vLLM 0.32's multimodal caches (security review).

vLLM keys its processor and encoder caches by each media item's hash, computed from the
decoded content alone when the part names no uuid (``ProcessorInputs.get_mm_hashes``):
not by ``cache_salt``, so the same image from two tenants is one cache entry, and a
tenant timing its requests learns whether another sent that image. The router now gives
each part whose media is all in the request (a ``data:`` URL, ``input_audio``,
embeddings) a uuid of the tenant's salt and the part. Checked here with vLLM's own
part parsing, media loading and hashing."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image
from vllm.exceptions import VLLMClientError
from vllm.multimodal.media.connector import MediaConnector
from vllm.multimodal.parse import MultiModalDataParser
from vllm.multimodal.processing.inputs import ProcessorInputs
from vllm.renderers.chat_utils import _parse_chat_message_content_mm_part

from kvhint.router.service.inbound import Endpoint, parse_inbound
from kvhint.router.service.tenancy import Tenant, TenantBudget

ACME = Tenant("acme", "salt-acme", TenantBudget())
OTHER = Tenant("other", "salt-other", TenantBudget())
DEV = Tenant("default", None, TenantBudget())


def _png(color: tuple[int, int, int]) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


RED, BLUE = _png((255, 0, 0)), _png((0, 0, 255))


def forwarded_part(tenant: Tenant, part: dict) -> dict:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, part]}]}).encode()
    return parse_inbound(Endpoint.CHAT, body, tenant, None, None).body["messages"][0][
        "content"][1]


def vllm_image_hash(part: dict) -> str:
    """The hash vLLM keys this image part's cache entries by: its chat parsing of the
    part (type, media, uuid), its loading of the data URL, its hashing."""
    kind, url = _parse_chat_message_content_mm_part(part)
    assert kind == "image_url"
    image = MediaConnector().fetch_image(url)
    items = MultiModalDataParser().parse_mm_data({"image": [image]})
    inputs = ProcessorInputs(prompt=[1], mm_data_items=items,
                             mm_uuid_items={"image": [part.get("uuid")]})
    return inputs.get_mm_hashes("m", "sha256")["image"][0]


def test_an_inline_image_is_keyed_per_tenant_in_vllms_caches() -> None:
    part = {"type": "image_url", "image_url": {"url": RED}}
    # Unscoped (what reached vLLM before): one key for every tenant.
    assert vllm_image_hash(dict(part)) == vllm_image_hash(dict(part))
    mine = vllm_image_hash(forwarded_part(ACME, dict(part)))
    assert mine == vllm_image_hash(forwarded_part(ACME, dict(part)))  # repeats still hit
    theirs = vllm_image_hash(forwarded_part(OTHER, dict(part)))
    assert mine != theirs and vllm_image_hash(dict(part)) not in (mine, theirs)
    # Another image of the same tenant is another entry.
    assert vllm_image_hash(forwarded_part(ACME, {"type": "image_url",
                                                 "image_url": {"url": BLUE}})) != mine
    # vLLM reads the forwarded part as the same image (the uuid path reads by key).
    forwarded = forwarded_part(ACME, dict(part))
    assert _parse_chat_message_content_mm_part(forwarded) == ("image_url", RED)


@pytest.mark.parametrize("part", [
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    {"type": "image_embeds", "image_embeds": "QUJD"},
    {"image_url": RED},  # untyped, as vLLM takes it
    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
])
def test_other_inline_media_get_a_tenant_uuid(part: dict) -> None:
    mine = forwarded_part(ACME, dict(part))["uuid"]
    assert mine == forwarded_part(ACME, dict(part))["uuid"]
    assert mine != forwarded_part(OTHER, dict(part))["uuid"]


@pytest.mark.parametrize("part", [
    # Fetched by the worker: the router never sees the content (docs/router.md).
    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    {"type": "image_url", "image_url": {"url": "file:///srv/media/cat.png"}},
    # vLLM would read these otherwise with a uuid (by key, not type): left as sent.
    {"type": "video_url", "video_url": {"url": RED}, "image_url": {"url": RED}},
    {"type": "image_url", "image_url": RED},
    {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
    {"type": "text", "text": RED},
])
def test_media_by_address_or_read_otherwise_is_left_alone(part: dict) -> None:
    assert "uuid" not in forwarded_part(ACME, dict(part))


@pytest.mark.parametrize("kind", [["image_url"], {"image_url": 1}])
def test_a_part_whose_type_is_not_a_string_is_left_for_vllm_to_refuse(kind: object) -> None:
    """An array or object ``type`` (unhashable) was the router's 500 (a TypeError in its
    media check). Left as sent, vLLM refuses the part (400); given a uuid, it would have
    read it by its key instead."""
    part = forwarded_part(ACME, {"type": kind, "image_url": {"url": RED}})
    assert "uuid" not in part
    with pytest.raises(VLLMClientError, match="Invalid 'type'"):  # vLLM's 4xx
        _parse_chat_message_content_mm_part(part)


def test_a_responses_inline_image_gets_a_tenant_uuid_and_dev_mode_none() -> None:
    def forwarded(tenant: Tenant) -> dict:
        body = json.dumps({"model": "m", "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": RED}]}]}).encode()
        return parse_inbound(Endpoint.RESPONSES, body, tenant, None, None).body[
            "input"][0]["content"][0]

    assert forwarded(ACME)["uuid"] != forwarded(OTHER)["uuid"]
    assert _parse_chat_message_content_mm_part(forwarded(ACME)) == ("image_url", RED)
    assert "uuid" not in forwarded(DEV)  # one tenant: nobody to keep apart
    assert "uuid" not in forwarded_part(DEV, {"type": "image_url", "image_url": {"url": RED}})
