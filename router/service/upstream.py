"""HTTP to the workers: one pooled aiohttp session for the router's lifetime.

aiohttp rather than httpx because the proxy's own overhead is a benchmark target (it
adds less per request here). :meth:`UpstreamPool.open` returns once the worker has sent
its status line and headers. A failure before the worker has the request (connection
refused or timed out, a connection reset before any answer) or a 502/503/504 is an
:class:`UpstreamUnavailable`, the only failure the router retries on another worker.

There is no limit on a response's whole length (a healthy stream may run for many
minutes, and vLLM sends a non-streamed answer only once it is complete): the worker may
keep the router waiting at most ``request_timeout_s`` for any byte, for its status line
after the request was sent or between two chunks of its body. Running past that is an
:class:`UpstreamTimeout` before the response starts, an :class:`UpstreamBroken` with
``timed_out`` after: a slow worker, not a dead one, which may still be running the
request, so it is neither marked down nor given the request again elsewhere.

What the router reads whole is bounded in bytes (a stream is relayed as it comes, each
event bounded by its relay: response_scan.py): a non-streamed answer by
``upstream_answer_max_bytes`` (:meth:`UpstreamResponse.read`), a 502/503/504's body and a
``/v1/models`` listing by :data:`SMALL_ANSWER_MAX_BYTES`. Past it the router stops
reading and closes the connection (:class:`AnswerTooLarge`, a broken answer): before, a
worker or a proxy before it answering an endless body grew the router's memory without
bound.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp
from pydantic import SecretStr

# Statuses that mean "this worker cannot take the request now" (a proxy or the server
# itself refusing): retried on the next-best worker like a refused connection.
RETRYABLE_STATUSES = frozenset({502, 503, 504})

# vLLM's header that picks one data-parallel rank (engine) of a server: the router sends
# it to a worker whose heartbeat names one (WorkerStatus.http_dp_rank); a client's never
# reaches a worker (no client header does), so no client can steer a request off the
# rank the router chose, or onto a rank the router did not.
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"

# A non-streamed answer's default bound (``upstream_answer_max_bytes``): far above any
# real one (a chat answer with n choices and top logprobs runs to tens of MiB; a stored
# Responses object echoes its request's instructions and tools, up to max_body_bytes).
DEFAULT_ANSWER_MAX_BYTES = 256 * 1024 * 1024
# What the router reads whole that is small by nature: a worker's (or a proxy's)
# 502/503/504 error body, passed to the client where no other worker takes the request,
# and a /v1/models listing (about 600 bytes a model card: some 1,700 models or LoRA
# adapters).
SMALL_ANSWER_MAX_BYTES = 1024 * 1024

# Never copied from a worker's response to the client.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
    "server", "date", "proxy-authenticate", "trailer", "upgrade", "proxy-connection", "te",
})


class UpstreamUnavailable(Exception):
    """The worker could not be reached or refused before the response started.
    ``unreachable``: no connection to its address could be made at all (refused, or not
    accepted within the connect timeout): a fact of the address, not of the request."""

    def __init__(self, worker_id: str, reason: str, status: int | None = None,
                 body: bytes = b"", *, unreachable: bool = False,
                 client_reason: str | None = None) -> None:
        super().__init__(f"worker {worker_id}: {reason}")
        self.worker_id = worker_id
        self.reason = reason
        self.status = status
        self.body = body
        self.unreachable = unreachable
        # What a client is told (``reason`` less what names the worker's address, which
        # aiohttp's connection errors spell out: host, port, resolver text). The whole
        # ``reason`` is for the log and a fleet admin's ``last_http_error`` only.
        self.client_reason = reason if client_reason is None else client_reason


class UpstreamTimeout(Exception):
    """The worker has the request but sent no status line within ``request_timeout_s``
    (it may be running it: not retried, not a worker down)."""

    def __init__(self, worker_id: str, timeout_s: float) -> None:
        super().__init__(f"worker {worker_id}: no answer within {timeout_s:g} s "
                         "(request_timeout_s)")
        self.worker_id = worker_id
        self.timeout_s = timeout_s


class UpstreamBroken(Exception):
    """The worker failed after the response started (the client may have bytes);
    ``timed_out``: it sent nothing for ``request_timeout_s``."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class AnswerTooLarge(UpstreamBroken):
    """A body the router reads whole ran past its bound (its Content-Length, or the
    bytes that came): the router read no further and closed the connection. A broken
    answer (the client's 502), never passed on in part."""

    def __init__(self, worker_id: str, size: int, limit: int, bound: str) -> None:
        super().__init__(f"worker {worker_id}: answered {size} bytes or more, past "
                         f"{limit} ({bound})")


async def _read_bounded(response: aiohttp.ClientResponse, worker_id: str,
                        limit: int | None, bound: str) -> bytes:
    """``response``'s whole body, at most ``limit`` bytes (None: unbounded); past it
    :class:`AnswerTooLarge`, the connection closed (not kept for reuse: the rest of the
    body is still coming) and nothing read kept. A Content-Length over it is refused
    before any byte is read. The caller releases ``response`` (a no-op once closed)."""
    if limit is None:
        return await response.read()
    if response.content_length is not None and response.content_length > limit:
        response.close()
        raise AnswerTooLarge(worker_id, response.content_length, limit, bound)
    body = bytearray()
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) > limit:
            size = len(body)
            body.clear()
            response.close()
            raise AnswerTooLarge(worker_id, size, limit, bound)
    return bytes(body)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What one ``/health`` probe found. ``address_failed``: the failure is a fact of the
    address, not of the worker id probed: no connection could be made, or nothing
    answered in time (a hung server). Every worker at that address shares it (the
    data-parallel ranks of one vLLM server share its one API server). A status other
    than 200, or an error after the server answered, is the probed worker's own."""

    ok: bool
    reason: str = ""
    address_failed: bool = False


@dataclass(slots=True)
class UpstreamResponse:
    worker_id: str
    status: int
    headers: dict[str, str]
    _response: aiohttp.ClientResponse
    _read_timeout_s: float
    # The most bytes :meth:`read` takes (``upstream_answer_max_bytes``); None: no bound.
    _max_bytes: int | None = DEFAULT_ANSWER_MAX_BYTES

    async def read(self) -> bytes:
        """The whole body; past ``_max_bytes`` an :class:`AnswerTooLarge` (an
        :class:`UpstreamBroken`: the caller answers it as any broken answer)."""
        try:
            return await _read_bounded(self._response, self.worker_id, self._max_bytes,
                                       "upstream_answer_max_bytes")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self._broken(exc) from exc
        finally:
            self._response.release()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self._broken(exc) from exc
        finally:
            self._response.close()

    def _broken(self, exc: BaseException) -> UpstreamBroken:
        if isinstance(exc, aiohttp.SocketTimeoutError):
            return UpstreamBroken(f"worker {self.worker_id}: sent nothing for "
                                  f"{self._read_timeout_s:g} s (request_timeout_s)",
                                  timed_out=True)
        return UpstreamBroken(f"worker {self.worker_id}: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._response.close()


class UpstreamPool:
    """Every request to a worker carries that worker's key (``Authorization: Bearer``,
    what vLLM's ``--api-key`` requires): its own from ``worker_api_keys`` (by worker id),
    else ``worker_api_key``, else none. Nothing from a client's request is copied into
    it, so a tenant's key never reaches a worker. The keys stay SecretStr until a header
    is built: no repr, log line or error message of the pool shows one."""

    def __init__(self, connect_timeout_s: float, request_timeout_s: float,
                 worker_api_key: SecretStr | None = None,
                 worker_api_keys: Mapping[str, SecretStr] | None = None, *,
                 keepalive_s: float,
                 answer_max_bytes: int | None = DEFAULT_ANSWER_MAX_BYTES) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._answer_max_bytes = answer_max_bytes
        self._request_timeout_s = request_timeout_s
        self._keepalive_s = keepalive_s
        self._base_headers = {"Content-Type": "application/json"}
        self._default_key = worker_api_key
        self._keys = dict(worker_api_keys or {})
        self._session: aiohttp.ClientSession | None = None

    def _headers(self, worker_id: str) -> dict[str, str]:
        headers = dict(self._base_headers)
        key = self._keys.get(worker_id, self._default_key)
        if key is not None and key.get_secret_value():
            headers["Authorization"] = f"Bearer {key.get_secret_value()}"
        return headers

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self._keepalive_s,
                                         ttl_dns_cache=300)
        # No total: a response lasts as long as the worker keeps sending (module doc).
        # sock_connect: nothing sent yet, so a worker that does not accept in time is
        # down and the request goes elsewhere; sock_read runs from the request's last
        # byte to the status line, then between chunks.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s,
                                        sock_read=self._request_timeout_s)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout,
                                              auto_decompress=False, skip_auto_headers=(
                                                  "User-Agent", "Accept-Encoding"))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("UpstreamPool used before start()")
        return self._session

    async def open(self, worker_id: str, url: str, body: bytes,
                   extra_headers: Mapping[str, str] | None = None, *,
                   method: str = "POST") -> UpstreamResponse:
        """``method``: POST for inference; a stored response's GET (or its cancel's
        POST) has no body (``b""``)."""
        headers = self._headers(worker_id)
        if extra_headers:
            headers.update(extra_headers)
        try:
            response = await self.session.request(method, url, data=body or None,
                                                  headers=headers)
        except aiohttp.SocketTimeoutError as exc:  # sent; a connect timeout is not one
            raise UpstreamTimeout(worker_id, self._request_timeout_s) from exc
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            unreachable = isinstance(exc, (aiohttp.ClientConnectorError,
                                           aiohttp.ConnectionTimeoutError))
            raise UpstreamUnavailable(
                worker_id, f"{type(exc).__name__}: {exc}", unreachable=unreachable,
                client_reason=f"{type(exc).__name__}: " + (
                    "no connection could be made" if unreachable
                    else "the connection failed before any answer")) from exc
        if response.status == 401:
            # No client credential is ever sent to a worker: its 401 refuses the router's
            # own key (vLLM's --api-key against worker_api_key / workers[].api_key).
            # Passed through, it told the client its own key was wrong; it is the
            # worker that cannot serve, like one that is down: the next-best takes it.
            response.release()
            raise UpstreamUnavailable(worker_id, "HTTP 401: the worker refused the "
                                      "router's worker API key")
        if response.status in RETRYABLE_STATUSES:
            try:
                error_body = await _read_bounded(response, worker_id,
                                                 SMALL_ANSWER_MAX_BYTES, "an error's bound")
            except (aiohttp.ClientError, asyncio.TimeoutError, AnswerTooLarge):
                error_body = b""  # the status alone is told (unavailable_answer)
            finally:
                response.release()
            raise UpstreamUnavailable(worker_id, f"HTTP {response.status}", response.status,
                                      error_body)
        return UpstreamResponse(worker_id, response.status, _copy_headers(response), response,
                                self._request_timeout_s, self._answer_max_bytes)

    async def get_json(self, url: str, timeout_s: float, *, worker_id: str,
                       whole_answer: bool = False) -> object:
        """JSON GETs to ``worker_id`` (whose key goes with it); raises on any failure. A
        failed status is raised as an :class:`UpstreamUnavailable`, not aiohttp's error,
        whose repr shows the request's headers (the key); a body past its bound as an
        :class:`AnswerTooLarge`. The bound: :data:`SMALL_ANSWER_MAX_BYTES` (a
        /v1/models listing), or ``upstream_answer_max_bytes`` where ``whole_answer``
        (a stored Responses object, which may be as large as any answer: the cancel
        rechecks, responses_cancel_rechecks.py)."""
        limit, bound = ((self._answer_max_bytes, "upstream_answer_max_bytes") if whole_answer
                        else (SMALL_ANSWER_MAX_BYTES, "a model listing's bound"))
        async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                    headers=self._headers(worker_id)) as response:
            if response.status >= 400:
                raise UpstreamUnavailable(worker_id, f"HTTP {response.status} from {url}",
                                          response.status)
            return json.loads(await _read_bounded(response, worker_id, limit, bound))

    async def probe(self, url: str, timeout_s: float, *, worker_id: str) -> ProbeResult:
        """A health probe of ``worker_id`` (its key goes with it): answered 200, or why
        not, and whether that is a fact of the address (:class:`ProbeResult`)."""
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                        headers=self._headers(worker_id)) as response:
                if response.status == 200:
                    return ProbeResult(True)
                return ProbeResult(False, f"/health answered HTTP {response.status}")
        except asyncio.TimeoutError:  # aiohttp's timeouts are asyncio.TimeoutErrors too
            return ProbeResult(False, f"no answer to /health within {timeout_s:g} s",
                               address_failed=True)
        except aiohttp.ClientConnectorError as exc:
            return ProbeResult(False, f"cannot connect: {type(exc).__name__}: {exc}",
                               address_failed=True)
        except (aiohttp.ClientError, OSError) as exc:
            return ProbeResult(False, f"/health failed: {type(exc).__name__}: {exc}")


# What a worker's answer may be served to the client as; any other type (a proxy's HTML
# error page, a worker a forged heartbeat pointed elsewhere) is served as plain text:
# the router's origin also serves the dashboard, which keeps an admin key for its tab.
_RELAYED_MEDIA_TYPES = frozenset({"application/json", "text/event-stream", "text/plain"})
# Not copied either: set below for every relayed answer.
_NOT_COPIED = _HOP_BY_HOP | {"content-type", "x-content-type-options"}
# Nor what a worker's answer would set for the router's whole origin, where the dashboard
# runs and keeps an admin key, and whose browser policy is the router's own
# (origin_policy.py: no CORS header but its grant's, ever): cookies, CORS grants (a
# worker's "*" let any site read the answer), HSTS, alternative services (where a
# browser sends this origin's next requests), site-data clearing, a CSP or refresh, an
# HTTP-auth challenge (a browser's login prompt on the router's origin), a redirect.
# vLLM sends none of them; relayed, a worker's (or a proxy's before it) spoke for the
# router's origin.
_ORIGIN_SCOPED = frozenset({
    "set-cookie", "set-cookie2", "strict-transport-security", "alt-svc", "clear-site-data",
    "content-security-policy", "content-security-policy-report-only", "refresh",
    "www-authenticate", "location",
    # The router's own (forwarding.py WORKER_HEADER), set on every relayed answer: a
    # worker's, in another case, went out beside it and was the one read back (the
    # Responses API records a response id as held by that worker).
    "x-kvhint-worker",
})


def _copy_headers(response: aiohttp.ClientResponse) -> dict[str, str]:
    # The worker's hop-by-hop headers include those its ``Connection`` header names
    # (RFC 9110 7.6.1): meant for the router's connection to it, not for the client.
    named = {token.strip().lower() for value in response.headers.getall("connection", ())
             for token in value.split(",")}
    headers = {k: v for k, v in response.headers.items()
               if (name := k.lower()) not in _NOT_COPIED and name not in _ORIGIN_SCOPED
               and name not in named and not name.startswith("access-control-")}
    media_type = (response.content_type or "").lower()
    headers["content-type"] = (response.headers.get("content-type", media_type)
                               if media_type in _RELAYED_MEDIA_TYPES
                               else "text/plain; charset=utf-8")
    headers["x-content-type-options"] = "nosniff"
    return headers
