"""Turn an OpenAI request body into a typed :class:`InboundRequest` and the body the
worker gets.

The router owns three fields of the forwarded body: ``session_id`` (``<tenant>/<client
id>``), ``cache_salt`` (the tenant's) and ``kv_transfer_params`` (never from a client);
it scopes media ``uuid`` s to the tenant (and gives one to media sent inline without
one), and holds a tenant's ``priority`` within its
bounds (request_fields.py). Everything else passes through untouched, so vLLM validates
it and its errors reach the client as they are.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
from starlette.responses import Response

from kvhint.router.safe_text import unsafe_refusal
from kvhint.router.service.request_fields import (
    PRIORITY_REJECTION,
    priority_refusal,
    read_stream,
    wants_usage,
)
from kvhint.router.service.tenancy import Tenant

SESSION_HEADER = "x-session-id"
SESSION_END_HEADER = "x-session-end"
MAX_SESSION_ID_LEN = 256
# kvhint_router_gateway_rejections_total's reason for a session id refused (its
# characters, its length or its type: :func:`check_session_id`).
SESSION_ID_REJECTION = "bad_session_id"
# Stripped from every client body: the router sets them (or nobody does).
# Fields a client may not set (the body's, and vllm_xargs'): the router sets the session
# and the salt; transfer params are for connectors, which a client must not steer.
ROUTER_OWNED_FIELDS = ("kv_transfer_params", "ec_transfer_params", "cache_salt",
                       "prompt_cache_key", "session_id")
# Stripped from a client's vllm_xargs only: ``kv_cache_report_mode: "full"`` makes vLLM
# announce every prefix hit as a BlockStored of the reused blocks. The router reads those
# as no-ops, but the plugin's index counts each as one more GPU copy that no BlockRemoved
# ever retires: the blocks stay "resident" in it, and in the snapshots a router resyncs
# from, after vLLM evicted them (false hits for good).
ENGINE_OWNED_XARGS = ("kv_cache_report_mode",)

_json_decoder = msgspec.json.Decoder()


async def read_body_within(chunks: AsyncIterator[bytes], declared_length: str | None,
                           limit: int, timeout_s: float | None = None) -> bytes:
    """The whole request body, or :class:`BadRequest` 413 as soon as it is known to be over
    ``limit`` bytes: from its ``Content-Length`` before reading, or while reading a chunked
    body. The router never holds more than ``limit`` bytes of one body. A body not all in
    within ``timeout_s`` (None: no bound) is :class:`BodyTimeout` (408): a client that
    stops sending must not hold the handler and its connection forever."""
    too_large = BadRequest(f"request body is larger than {limit} bytes", status=413)
    if declared_length is not None and declared_length.isdigit() and int(declared_length) > limit:
        raise too_large
    body = bytearray()

    async def read() -> None:
        async for chunk in chunks:
            body.extend(chunk)
            if len(body) > limit:
                raise too_large

    try:
        await asyncio.wait_for(read(), timeout_s)  # (asyncio.timeout: Python 3.11+)
    except asyncio.TimeoutError:
        raise BodyTimeout(f"request body not received within {timeout_s:g} s "
                          f"({len(body)} bytes arrived)") from None
    return bytes(body)


def refusal_headers(status: int) -> dict[str, str]:
    """Headers for an error answer: a 413 or 408 closes the connection, because the rest
    of the body is still unread and a keep-alive connection would have the server read
    (and discard) all of it, and let the client go on sending. Every one is ``nosniff``:
    its body is JSON, never to be read as anything else from the dashboard's origin."""
    headers = {"x-content-type-options": "nosniff"}
    if status in (408, 413):
        headers["connection"] = "close"
    return headers


class Endpoint(str, enum.Enum):
    CHAT = "chat"
    COMPLETION = "completion"
    RESPONSES = "responses"  # POST /v1/responses (responses_api.py)

    @property
    def path(self) -> str:
        return _PATHS[self]


_PATHS = {Endpoint.CHAT: "/v1/chat/completions", Endpoint.COMPLETION: "/v1/completions",
          Endpoint.RESPONSES: "/v1/responses"}


class BadRequest(Exception):
    """A client error the router answers itself (400 unless said), OpenAI-style."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 error_type: str | None = None, rejection: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.error_type = error_type
        # A tenant policy's refusal: its kvhint_router_gateway_rejections_total reason.
        self.rejection = rejection


class BodyTimeout(BadRequest):
    """408: the request body did not all arrive within ``http_body_timeout_s`` (callers
    count it as ``client_timeouts_total{phase="body"}``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=408)


@dataclass(frozen=True, slots=True)
class InboundRequest:
    endpoint: Endpoint
    tenant: Tenant
    # The client's own session id (None: route by cache overlap alone).
    client_session_id: str | None
    model: str | None
    stream: bool
    # The router asked the worker for a final usage chunk the client did not want;
    # the proxy removes it on the way back.
    strip_usage_chunk: bool
    session_end: bool
    # The body to forward (already carrying session_id and cache_salt).
    body: dict[str, Any]
    # Bytes of the body as received: bounds the prompt's tokens from above whatever its
    # shape (what decides where, and whether, it is hashed: routing_service.py).
    raw_size: int = 0

    @property
    def worker_session_id(self) -> str | None:
        if self.client_session_id is None:
            return None
        return self.tenant.worker_session_id(self.client_session_id)

    @property
    def messages(self) -> list[Any] | None:
        return self.body.get("messages") if self.endpoint is Endpoint.CHAT else None

    @property
    def prompt(self) -> Any:
        return self.body.get("prompt") if self.endpoint is Endpoint.COMPLETION else None


def check_json_media_type(content_type: str | None) -> None:
    """Raise :class:`BadRequest` unless the body is declared JSON (``application/json``
    or ``application/*+json``), as vLLM's own endpoints require (FastAPI's strict content
    type: no type, or another, is a 400 there). It is also what keeps a page on another
    site from spending the workers through an open (dev mode) router: an HTML form or a
    ``no-cors`` fetch can send a body only as a form, ``text/plain`` or untyped, never as
    JSON without a CORS preflight (cross_site.py)."""
    media_type = (content_type or "").partition(";")[0].strip().lower()
    main, _, sub = media_type.partition("/")
    if main != "application" or not (sub == "json" or sub.endswith("+json")):
        raise BadRequest("send the request body as JSON, with 'Content-Type: "
                         "application/json' (as vLLM requires)")


def parse_inbound(
    endpoint: Endpoint,
    raw_body: bytes,
    tenant: Tenant,
    header_session_id: str | None,
    header_session_end: str | None,
) -> InboundRequest:
    """Validate the parts the router relies on; raise :class:`BadRequest` with a message."""
    if not raw_body:
        raise BadRequest("request body is empty; send a JSON object")
    try:
        body = _json_decoder.decode(raw_body)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError:  # msgspec gives up around 1,000 levels of nesting
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")

    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array", param="messages")
        if not all(isinstance(m, dict) for m in messages):
            raise BadRequest("every item of 'messages' must be an object", param="messages")
    elif endpoint is Endpoint.COMPLETION:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise BadRequest("'prompt' must be a string or a non-empty array", param="prompt")
    elif not isinstance(body.get("input"), (str, list)):
        raise BadRequest("'input' must be a string or an array", param="input")

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    if tenant.models is not None:
        # A tenant limited to some models names one (a worker would otherwise answer
        # with its default model, whichever that is); another is not there for it, in
        # the words vLLM uses for a model it does not serve.
        if model is None:
            raise BadRequest("'model' is required: name one of the models your key may use",
                             param="model")
        if not tenant.may_use(model):
            raise BadRequest(f"The model `{model}` does not exist.", param="model",
                             status=404, error_type="NotFoundError")
    if (refusal := priority_refusal(body, tenant)) is not None:
        raise BadRequest(refusal, param="priority", rejection=PRIORITY_REJECTION)
    # Read as vLLM reads it ("true", 1, "yes" stream too: request_fields.py).
    stream = read_stream(body)
    if stream is None:
        raise BadRequest("'stream' must be a boolean", param="stream")

    client_session_id = _session_id(body, header_session_id)
    for field in ROUTER_OWNED_FIELDS:
        body.pop(field, None)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        # vLLM copies vllm_xargs into the request's extra_args and reads a session id, KV
        # transfer params and a cache salt from them too; only the router may set those.
        for field in ROUTER_OWNED_FIELDS + ENGINE_OWNED_XARGS:
            xargs.pop(field, None)
    if client_session_id is not None:
        body["session_id"] = tenant.worker_session_id(client_session_id)
    if tenant.cache_salt is not None:
        body["cache_salt"] = tenant.cache_salt
        if endpoint is Endpoint.CHAT:
            _scope_media_uuids(body["messages"], tenant.cache_salt)
        elif endpoint is Endpoint.RESPONSES and isinstance(body["input"], list):
            # vLLM keeps a part's uuid through its Responses validation into the same
            # chat parsing: the same scoping, for a message's content and for a tool
            # output's parts (a ``function_call_output``'s ``output`` list is its tool
            # message's content: responses/utils.py).
            _scope_media_uuids(body["input"], tenant.cache_salt, "input")
            _scope_media_uuids(body["input"], tenant.cache_salt, "input", "output")

    strip_usage = False
    # A Responses stream always ends in its usage (response.completed): nothing to ask.
    if stream and endpoint is not Endpoint.RESPONSES:
        options = body.get("stream_options")
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object", param="stream_options")
        include_usage = wants_usage(options)
        if include_usage is None:
            raise BadRequest("'stream_options.include_usage' must be a boolean",
                             param="stream_options")
        if not include_usage:
            # The worker's usage (cached tokens) is how the router learns what its
            # routing achieved; the client never sees the extra chunk.
            # ``continuous_usage_stats`` goes: vLLM reads it only with include_usage,
            # so the client's answer (no usage anywhere) is unchanged; left in, it put
            # a usage on every chunk the client gets.
            kept = {k: v for k, v in options.items() if k != "continuous_usage_stats"}
            body["stream_options"] = {**kept, "include_usage": True}
            strip_usage = True

    return InboundRequest(
        endpoint=endpoint,
        tenant=tenant,
        client_session_id=client_session_id,
        model=model,
        stream=stream,
        strip_usage_chunk=strip_usage,
        session_end=_truthy(header_session_end),
        body=body,
        raw_size=len(raw_body),
    )


def _scope_media_uuids(messages: list[dict[str, Any]], salt: str,
                       field: str = "messages", parts: str = "content") -> None:
    """Make every content part's media cache key (``uuid``, in each item's ``parts``
    list) the tenant's own.

    vLLM 0.32 takes a part's client-given ``uuid`` as its media item's hash, and keys
    the processor's and the encoder's caches by it alone, not by ``cache_salt``
    (``multimodal/processing/inputs.py``, ``v1/engine/input_processor.py``); a part may
    even carry a ``uuid`` and no data, to reuse a cached item. So a tenant naming
    another's uuid would be answered from that tenant's image, or, sending data with
    it, would replace what that tenant's next request reads. Each uuid becomes a digest
    of the tenant's salt and the uuid: one tenant's repeats still hit its cache; no two
    tenants share an entry.

    A part without a ``uuid`` is keyed by vLLM by its content's hash, the same for
    every tenant: one tenant's request served faster from another's cached image tells
    it that image was sent (a timing side channel). Where the content is all in the
    part (a ``data:`` URL, ``input_audio``, embeddings: :func:`_inline_media`), the
    router gives it a uuid: a digest of the tenant's salt and the part, so the same
    part from the same tenant still hits, and no other tenant's can. A part naming
    media by address (``http(s)://``, ``file:``) is left alone: its content is what
    the worker fetches, which the router never sees, and a key from the address would
    serve a changed resource from the cache (docs/router.md, the residual risk)."""
    for number, message in enumerate(messages):
        content = message.get(parts) if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            uuid = part.get("uuid")
            if uuid is None:
                if _inline_media(part):
                    canonical = msgspec.json.encode(part, order="sorted")
                    part["uuid"] = hashlib.sha256(
                        salt.encode() + b"\x01" + canonical).hexdigest()
                continue
            if not isinstance(uuid, str):
                raise BadRequest("a content part's 'uuid' must be a string",
                                 param=f"{field}[{number}].{parts}")
            part["uuid"] = hashlib.sha256(f"{salt}\x00{uuid}".encode()).hexdigest()


# The key of its media of each content part type that carries media, as vLLM's chat
# parsing reads it (``renderers/chat_utils.py``; a URL key holds a string or
# ``{"url": ...}``). A part with a ``uuid`` is read by which key it has, not by its
# ``type``: the router gives one only to a part with one such key, its type's own.
_MEDIA_KEY_OF_TYPE = {
    "image_url": "image_url", "input_image": "image_url", "audio_url": "audio_url",
    "video_url": "video_url", "input_audio": "input_audio",
    "image_embeds": "image_embeds", "audio_embeds": "audio_embeds",
    "video_embeds": "video_embeds",
}
_MEDIA_KEYS = frozenset(_MEDIA_KEY_OF_TYPE.values()) | {"image_pil", "prompt_embeds"}
_URL_KEYS = ("image_url", "audio_url", "video_url")


def _inline_media(part: dict[str, Any]) -> bool:
    """Whether ``part`` is one media item all in the part itself (a ``data:`` URL, as
    vLLM's MediaConnector reads the scheme; ``input_audio``'s data; embeddings), so
    that equal parts are equal media; and vLLM reads it the same with a uuid."""
    keys = [key for key in part if key in _MEDIA_KEYS]
    if len(keys) != 1:
        return False
    key = keys[0]
    kind = part.get("type")
    # A ``type`` that is not a string (an array, an object: unhashable, which was a 500
    # here) is left as sent: vLLM answers it 400 without a uuid, but would read the
    # part by its key with one.
    if kind is not None and (not isinstance(kind, str) or _MEDIA_KEY_OF_TYPE.get(kind) != key):
        return False
    value = part[key]
    if key in _URL_KEYS:
        if kind == key and not isinstance(value, dict):
            return False  # vLLM refuses it without a uuid (it reads ``[key]["url"]``)
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str):
            return False
        try:
            return urlsplit(url).scheme == "data"
        except ValueError:
            return False
    if key == "input_audio":
        return isinstance(value, dict) and isinstance(value.get("data"), str) \
            and bool(value["data"])
    return key in _MEDIA_KEY_OF_TYPE.values() and bool(value)  # embeddings


def _session_id(body: dict[str, Any], header: str | None) -> str | None:
    for source, value in (("session_id", body.get("session_id")),
                          ("X-Session-ID", None if header is None else _utf8_header(header)),
                          ("prompt_cache_key", body.get("prompt_cache_key"))):
        if value is None or value == "":
            continue
        return check_session_id(value, source)
    return None


def _utf8_header(value: str) -> str:
    """A header value as its sender meant it: HTTP hands over bytes, which the server
    decodes as Latin-1; clients (the OpenAI SDKs, httpx, curl) send a non-ASCII id as
    UTF-8, so a value whose bytes are UTF-8 is read so, the same id as in the body ("€"
    in the header is the session "€", not "â\x82¬", whose C1 control is refused).
    Bytes that are not UTF-8 stay as Latin-1 read them."""
    if value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return value


def check_session_id(value: Any, source: str = "session_id") -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{source} must be a string", param=source,
                         rejection=SESSION_ID_REJECTION)
    if len(value) > MAX_SESSION_ID_LEN:
        raise BadRequest(f"{source} is longer than {MAX_SESSION_ID_LEN} characters",
                         param=source, rejection=SESSION_ID_REJECTION)
    # The admin API refuses the same in a path (admin_api.py ``_safe_name``, the one
    # rule of safe_text.py), so a session named here can be read and ended there.
    if (bad := unsafe_refusal(value)) is not None:
        raise BadRequest(f"{source} contains control characters ({bad}): an id may hold "
                         "no C0 or C1 control, DEL, bidi, zero-width (but a joiner in an "
                         "emoji sequence) or other format character (an X-Session-ID "
                         "header is read as UTF-8)", param=source,
                         rejection=SESSION_ID_REJECTION)
    return value


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes")


def error_type_of(status: int) -> str:
    """The OpenAI error ``type`` of a router's own answer with ``status``, the same on
    every path (the gateway's, the sessions API's, the app's 404/405): a key missing,
    unknown or not allowed is an ``authentication_error``, a limit reached a
    ``rate_limit_error``, any other client error an ``invalid_request_error``."""
    if status in (401, 403):
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def openai_error(message: str, status: int, param: str | None = None,
                 error_type: str | None = None) -> bytes:
    """An error body in the shape OpenAI clients parse; ``error_type`` when the answer
    speaks in another's words (vLLM's ``NotFoundError``), else :func:`error_type_of`."""
    kind = error_type or error_type_of(status)
    return msgspec.json.encode(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}
    )


def error_response(message: str, status: int, param: str | None = None,
                   error_type: str | None = None,
                   headers: Mapping[str, str] | None = None) -> Response:
    """The router's own error answer: :func:`openai_error`'s body, with
    :func:`refusal_headers` and ``headers`` (a 429's ``Retry-After``, a 405's ``Allow``)."""
    return Response(openai_error(message, status, param, error_type), status_code=status,
                    media_type="application/json",
                    headers={**refusal_headers(status), **(headers or {})})
